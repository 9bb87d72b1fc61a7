// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// x86 AVX-512 (F, BW) tier: 32 registers of 512 bits. The float flash kernel's tile shape
/// for them (FlashTiles), the decoding kernel's rows per K and V load (DecodeTiles), and the
/// narrow KV-cache values widened to float as they load: int8 codes (VPMOVSXBD, VCVTDQ2PS),
/// bf16 (a 16-bit shift) and fp16 (VCVTPH2PS). The float arithmetic itself is xsimd's AVX-512
/// code. Compiled in where the translation unit is built with -mavx512f (kEnabled); elsewhere
/// widen is only declared, for drivers that name it in `if constexpr` branches they never
/// instantiate.

#include <cstdint>
#include <type_traits>

#include "gattn/config.hpp"
#include "gattn/types.hpp"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

GATTN_BEGIN_ISA_NAMESPACE
namespace simd {
namespace avx512 {

#if defined(__AVX512F__)
inline constexpr bool kEnabled = true;  ///< built with AVX-512F
#else
inline constexpr bool kEnabled = false;
#endif

/// Tile geometry of the float flash kernel (kernel::FlashGeometry) on 32 registers.
struct FlashTiles {
    static constexpr int kCols = 4;            // registers of queries per tile row
    static constexpr int kRows = 6;            // 6 × 4 = 24 accumulators of 32 registers
    static constexpr int kMaskedRows = kRows;  // masked FMAs take a mask register (k0–k7)
};

/// Decoding (kernel::decode_chunk): query rows that share each K and V register load, and the
/// value sum's accumulator registers.
struct DecodeTiles {
    static constexpr int kRows = 4, kValueRegisters = 16;
};

#if defined(__AVX512F__)
/// Sixteen float lanes (B: a 16-float register) from sixteen int8 codes, bf16 or fp16 values
/// at p, exactly.
template <class B, class KV>
inline B widen(const KV* p) noexcept {
    if constexpr (std::is_same_v<KV, std::int8_t>) {
        return B(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
    } else {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        if constexpr (std::is_same_v<KV, bfloat16>)
            return B(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        else
            return B(_mm512_cvtph_ps(h));
    }
}
#else
template <class B, class KV>
B widen(const KV* p) noexcept;
#endif

}  // namespace avx512
}  // namespace simd
GATTN_END_ISA_NAMESPACE
