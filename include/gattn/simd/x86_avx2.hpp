// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// x86 AVX2 (+ FMA) tier: 16 registers of 256 bits. The float flash kernel's tile shape for
/// them (FlashTiles) and the int8 codes widened to float as they load (VPMOVSXBD, VCVTDQ2PS).
/// The float arithmetic itself is xsimd's AVX2 code. Compiled in where the translation unit is
/// built with -mavx2 (kEnabled; the tiles also need -mfma, kFma); elsewhere widen is only
/// declared, for drivers that name it in `if constexpr` branches they never instantiate.

#include <cstdint>

#include "gattn/config.hpp"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

GATTN_BEGIN_ISA_NAMESPACE
namespace simd {
namespace avx2 {

#if defined(__AVX2__)
inline constexpr bool kEnabled = true;  ///< built with AVX2
#else
inline constexpr bool kEnabled = false;
#endif
#if defined(__FMA__)
inline constexpr bool kFma = true;  ///< built with FMA3
#else
inline constexpr bool kFma = false;
#endif

/// Tile geometry of the float flash kernel (kernel::FlashGeometry) on 16 registers.
struct FlashTiles {
    // 4 × 3 = 12 accumulators + 3 query registers + 1 broadcast: all 16 registers, 7 loads per
    // 12 FMAs (6 × 2: 8 per 12), each K and V value used by 24 queries instead of 16, and
    // d = 64, 128, 256 and Bc split into whole tiles. Measured against 6 × 2 in
    // bench_flash_peak (docs/flash_avx2.md): alike on AMD Zen 5 (0.81–0.84 of the FMA peak at
    // N = 2048, d = 128, 8 heads, 1 thread), built for the 8-way L1s of Zen 2–4 and Skylake.
    static constexpr int kCols = 3;
    static constexpr int kRows = 4;
    // The PV tiles of masked keys keep a skip mask per query register (compare + blend, no
    // mask registers in AVX2): 3 rows, 9 accumulators + 3 P + 3 masks + 1 broadcast.
    static constexpr int kMaskedRows = 3;
};

#if defined(__AVX2__)
/// Eight float lanes (B: an 8-float register) from eight int8 codes at p, exactly.
template <class B>
inline B widen(const std::int8_t* p) noexcept {
    return B(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
}
#else
template <class B>
B widen(const std::int8_t* p) noexcept;
#endif

}  // namespace avx2
}  // namespace simd
GATTN_END_ISA_NAMESPACE
