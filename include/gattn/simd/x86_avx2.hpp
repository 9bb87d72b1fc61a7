// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// x86 AVX2 (+ FMA) tier: 16 registers of 256 bits. The float flash kernel's tile shape for
/// them (FlashTiles), streaming stores of 256-bit registers (AVX), and the narrow KV-cache
/// values widened to float as they load: int8 codes
/// (VPMOVSXBD, VCVTDQ2PS), bf16 (a 16-bit shift) and fp16 (VCVTPH2PS where the unit is built
/// with F16C, as -march=haswell and later; else integer operations, exact for every fp16
/// value). The float arithmetic itself is xsimd's AVX2 code. Compiled in where the translation
/// unit is built with -mavx2 (kEnabled; the tiles also need -mfma, kFma); elsewhere widen and
/// widen_row are only declared, for drivers that name them in `if constexpr` branches they
/// never instantiate.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gattn/config.hpp"
#include "gattn/types.hpp"

#if defined(__AVX__)
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
    // Pairs of a KV head up to which several query rows decode rather than run tiles of one
    // query register (8 lanes): 4 and 5 pairs decoded 1.4–2× faster than as tiles at 2048 keys
    // (Zen 5, -mavx2 -mfma, 1 thread), 6 alike.
    static constexpr int kDecodePairs = 6;
    // Few-query blocks (kernel::runs_row_tiles) with the rows of queries broadcast: 8 queries a
    // KV head, d = 128, 2048 keys, 8 KV heads, 1 thread, Zen 5: 1.10× the query-lane tiles.
    static constexpr bool kRowTiles = true;
    static constexpr int kRowValueRows = kRows, kRowValueCols = kCols;  // their P·V tiles
    // Their S from a transposed K block (kernel::row_block_scores): AVX2's multiply-adds take no
    // broadcast operand, and tiles of 8 or 12 keys × one register of queries from the K rows,
    // a broadcast load per multiply-add, ran at 0.67–0.76 of it (8 queries on 8 KV heads, d =
    // 128, 2k and 8k keys, 1 thread, Zen 4).
    static constexpr int kRowKeyRows = 0;
};

#if defined(__AVX__)
inline constexpr bool kAvx = true;  ///< built with AVX (256-bit float registers)

/// Stores register v (8 floats or 4 doubles, as T) at p, aligned to 32 bytes, with a
/// non-temporal hint.
template <class T, class Packet>
inline void stream_store(T* p, const Packet& v) noexcept {
    if constexpr (std::is_same_v<T, float>)
        _mm256_stream_ps(p, v);
    else
        _mm256_stream_pd(p, v);
}
#else
inline constexpr bool kAvx = false;
template <class T, class Packet>
void stream_store(T* p, const Packet& v) noexcept;
#endif

#if defined(__F16C__)
inline constexpr bool kF16c = true;  ///< built with F16C: fp16 widens with VCVTPH2PS
#else
inline constexpr bool kF16c = false;
#endif

#if defined(__AVX2__)
/// Eight floats from the eight fp16 values (bit patterns) of h, exactly: VCVTPH2PS with F16C;
/// without, a normal or infinite/NaN value moves its exponent and mantissa into place and
/// rebiases the exponent (NaN payloads kept, as VCVTPH2PS does with quiet NaNs), and a
/// subnormal, m·2⁻²⁴, converts its mantissa as an integer (no subnormal float is formed, so a
/// denormals-are-zero mode changes nothing).
inline __m256 widen_half(__m128i h) noexcept {
#if defined(__F16C__)
    return _mm256_cvtph_ps(h);
#else
    const __m256i x = _mm256_cvtepu16_epi32(h);
    const __m256i magnitude = _mm256_and_si256(x, _mm256_set1_epi32(0x7fff));
    const __m256i sign = _mm256_slli_epi32(_mm256_xor_si256(x, magnitude), 16);
    // Exponent 1–30: bits << 13, exponent + (127 − 15); exponent 31 (inf, NaN): + (255 − 31).
    const __m256i special = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7bff));
    const __m256i bias = _mm256_blendv_epi8(_mm256_set1_epi32(112 << 23), _mm256_set1_epi32(224 << 23), special);
    const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(magnitude, 13), bias));
    const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(1.0f / 16777216.0f));
    const __m256i tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x0400), magnitude);  // exponent 0
    const __m256 m = _mm256_blendv_ps(normal, subnormal, _mm256_castsi256_ps(tiny));
    return _mm256_or_ps(m, _mm256_castsi256_ps(sign));
#endif
}

/// Eight float lanes (B: an 8-float register) from eight int8 codes, bf16 or fp16 values at p,
/// exactly.
template <class B, class KV>
inline B widen(const KV* p) noexcept {
    if constexpr (std::is_same_v<KV, std::int8_t>) {
        return B(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
    } else {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        if constexpr (std::is_same_v<KV, bfloat16>)
            return B(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
        else
            return B(widen_half(h));
    }
}

/// dst[i] = float(src[i]) for i < n, exactly: eight at a time (widen_half), the tail through a
/// zeroed copy.
inline void widen_row(const half* src, float* dst, std::ptrdiff_t n) noexcept {
    std::ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, widen_half(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    if (i < n) {
        const auto tail = static_cast<std::size_t>(n - i);
        alignas(16) std::uint16_t bits[8] = {};
        alignas(32) float wide[8];
        std::memcpy(bits, src + i, tail * sizeof(half));
        _mm256_store_ps(wide, widen_half(_mm_load_si128(reinterpret_cast<const __m128i*>(bits))));
        std::memcpy(dst + i, wide, tail * sizeof(float));
    }
}
#else
template <class B, class KV>
B widen(const KV* p) noexcept;
void widen_row(const half* src, float* dst, std::ptrdiff_t n) noexcept;
#endif

}  // namespace avx2
}  // namespace simd
GATTN_END_ISA_NAMESPACE
