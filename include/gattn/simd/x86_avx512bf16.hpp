// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// x86 AVX512-BF16 tier (with AVX512-BW and -VL): VDPBF16PS, which multiplies pairs of bf16
/// values and adds both products to a float accumulator. Holds the micro-kernels of bf16
/// decoding (kernel::decode_bf16, driven by ops/decode_kernel.hpp). Compiled in where the
/// translation unit is built for AVX512-BF16 (kEnabled); elsewhere the kernels are only
/// declared, for drivers that name them in `if constexpr` branches they never instantiate.

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "gattn/config.hpp"
#include "gattn/simd/compat.hpp"
#include "gattn/types.hpp"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define GATTN_HAS_AVX512BF16_KERNEL 1
#endif

GATTN_BEGIN_ISA_NAMESPACE
namespace simd {
namespace avx512bf16 {
#if defined(GATTN_HAS_AVX512BF16_KERNEL)
inline constexpr bool kEnabled = true;  ///< built with AVX512-BF16, -BW and -VL
#else
inline constexpr bool kEnabled = false;
#endif
}  // namespace avx512bf16
}  // namespace simd

namespace kernel {

#if defined(GATTN_HAS_AVX512BF16_KERNEL)
namespace bf16 {

/// acc + VDPBF16PS(a, b), accumulating in place: GCC 12 copies the intrinsic's accumulators
/// through other registers (and the stack when they run short) on every step of a loop.
inline __m512 dp(__m512 acc, __m512i a, __m512i b) noexcept {
#if defined(__GNUC__) && !defined(__clang__)
    __asm__("vdpbf16ps {%2, %1, %0|%0, %1, %2}" : "+v"(acc) : "v"(a), "v"(b));  // AT&T | Intel syntax
    return acc;
#else
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);  // NOLINT: vector casts
#endif
}

}  // namespace bf16
#endif  // GATTN_HAS_AVX512BF16_KERNEL

/// Products on bf16 with VDPBF16PS (AVX512-BF16) for a bf16 cache: bf16 queries and keys as
/// they are stored, and P rounded to bf16 (nearest even) for the value sum, as in the bf16
/// prefill kernel; accumulation in float. Half the instructions of widening to float FMAs, and
/// no widening. Needs d_k and d_v multiples of 32.
namespace decode_bf16 {

/// Whether the VDPBF16PS decoding kernel takes these head sizes.
inline constexpr bool takes(Index dk, Index dv) noexcept { return dk % 32 == 0 && dv % 32 == 0; }

/// Position within a 32-wide block of d_v of feature d's sum: interleaving two keys' rows
/// with unpacklo/unpackhi_epi16 pairs features (8L + w) of 128-bit lane L, w < 4 (low) and
/// w ≥ 4 (high), so the float sums come out in that order; unpermute() restores it.
inline constexpr Index permuted(Index d) noexcept {
    const Index lane = (d % 32) / 8, w = d % 8;
    return d / 32 * 32 + (w < 4 ? 4 * lane + w : 16 + 4 * lane + w - 4);
}

#if defined(GATTN_HAS_AVX512BF16_KERNEL)
/// As group_logits: dots[r][kk] holds 16 partial sums of q_r·K[kk] (pairs of features).
template <int R>
inline void logits(const bfloat16* const* q, const bfloat16* key, Index key_stride, Index nk, Index dk,
                   simd::Batch<float> (*dots)[16]) noexcept {
    using B = simd::Batch<float>;
    Index kk = 0;
    for (; kk < 16; kk += 4) {
        __m512 a[R][4];
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < 4; ++i) a[r][i] = _mm512_setzero_ps();
        if (kk < nk) {
            const int keys = static_cast<int>(std::min<Index>(4, nk - kk));
            const bfloat16* k = key + kk * key_stride;
            for (Index d = 0; d < dk; d += 32) {
                __m512i kv[4];
                for (int i = 0; i < 4; ++i)
                    kv[i] = i < keys ? _mm512_loadu_si512(k + i * key_stride + d) : _mm512_setzero_si512();
                for (int r = 0; r < R; ++r) {
                    const __m512i qd = _mm512_loadu_si512(q[r] + d);
                    for (int i = 0; i < 4; ++i) a[r][i] = bf16::dp(a[r][i], qd, kv[i]);
                }
            }
        }
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < 4; ++i) dots[r][kk + i] = B(a[r][i]);
    }
}

/// acc (permuted order) += Σ over key pairs of VDPBF16PS(P pair, V pair) for R rows. pw[r]:
/// row r's P rounded to bf16, as 16 words (keys kk < nk; 0 past nk).
template <int R>
inline void values(const std::uint16_t (*pw)[16], Index nk, const bfloat16* value, Index value_stride,
                   float* const* acc, Index dv) noexcept {
    constexpr int C = 2;  // 64 features per pass: 4·R accumulators
    const Index pairs = (nk + 1) / 2;
    for (Index j = 0; j < dv; j += 32 * C) {
        const int chunks = static_cast<int>(std::min<Index>(C, (dv - j) / 32));
        __m512 a[R][2 * C];
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < 2 * chunks; ++c) a[r][c] = _mm512_loadu_ps(acc[r] + j + 16 * c);
        for (Index pr = 0; pr < pairs; ++pr) {
            const bfloat16* v0 = value + 2 * pr * value_stride + j;
            const bool second = 2 * pr + 1 < nk;
            __m512i lo[C], hi[C];
            for (int c = 0; c < chunks; ++c) {
                const __m512i x = _mm512_loadu_si512(v0 + 32 * c);
                const __m512i y = second ? _mm512_loadu_si512(v0 + value_stride + 32 * c) : _mm512_setzero_si512();
                lo[c] = _mm512_unpacklo_epi16(x, y);
                hi[c] = _mm512_unpackhi_epi16(x, y);
            }
            for (int r = 0; r < R; ++r) {
                std::uint32_t word;
                std::memcpy(&word, pw[r] + 2 * pr, sizeof word);
                const __m512i pp = _mm512_set1_epi32(static_cast<int>(word));
                for (int c = 0; c < chunks; ++c) {
                    a[r][2 * c] = bf16::dp(a[r][2 * c], pp, lo[c]);
                    a[r][2 * c + 1] = bf16::dp(a[r][2 * c + 1], pp, hi[c]);
                }
            }
        }
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < 2 * chunks; ++c) _mm512_storeu_ps(acc[r] + j + 16 * c, a[r][c]);
    }
}

/// The value sum of a block where some row skips a key (score −∞) whose V row may hold
/// anything: lane by lane, skipping those keys, into the permuted order.
template <int R>
inline void values_skipping(const float (*score)[16], const std::uint16_t (*pw)[16], Index nk, const bfloat16* value,
                            Index value_stride, float* const* acc, Index dv) noexcept {
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    for (int r = 0; r < R; ++r)
        for (Index kk = 0; kk < nk; ++kk) {
            if (score[r][kk] == kNegInf) continue;
            const float p = float(Eigen::numext::bit_cast<bfloat16>(pw[r][kk]));
            const bfloat16* v = value + kk * value_stride;
            for (Index d = 0; d < dv; ++d) {
                float& a = acc[r][permuted(d)];
                a = std::fma(p, float(v[d]), a);
            }
        }
}

/// Whether the V rows of keys kk < nk that some of the R rows skip (score −∞) are all finite
/// (exponent bits not all ones), so that a weight of 0 for them adds exactly 0.
template <int R>
inline bool skipped_values_finite(const float (*score)[16], Index nk, const bfloat16* value, Index value_stride,
                                  Index dv) noexcept {
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    const __m512i exponent = _mm512_set1_epi16(0x7F80);
    for (Index kk = 0; kk < nk; ++kk) {
        bool skipped = false;
        for (int r = 0; r < R; ++r) skipped = skipped || score[r][kk] == kNegInf;
        if (!skipped) continue;
        const bfloat16* v = value + kk * value_stride;
        for (Index d = 0; d < dv; d += 32) {
            const __m512i e = _mm512_and_si512(_mm512_loadu_si512(v + d), exponent);
            if (_mm512_cmpeq_epi16_mask(e, exponent)) return false;
        }
    }
    return true;
}

/// Puts each row's sums back in feature order (after the last block of a chunk): feature d of a
/// 32-wide block is at permuted(d), gathered from the block's two registers.
inline void unpermute(float* acc, Index dv) noexcept {
    alignas(64) std::int32_t lo[16], hi[16];
    for (int i = 0; i < 16; ++i) {
        lo[i] = static_cast<std::int32_t>(permuted(i));
        hi[i] = static_cast<std::int32_t>(permuted(16 + i));
    }
    const __m512i lo_index = _mm512_load_si512(lo), hi_index = _mm512_load_si512(hi);
    for (Index j = 0; j < dv; j += 32) {
        const __m512 x = _mm512_loadu_ps(acc + j), y = _mm512_loadu_ps(acc + j + 16);
        _mm512_storeu_ps(acc + j, _mm512_permutex2var_ps(x, lo_index, y));
        _mm512_storeu_ps(acc + j + 16, _mm512_permutex2var_ps(x, hi_index, y));
    }
}

/// Whether row r < R skips a key kk < nk of the block (score −∞).
template <int R>
inline bool any_skipped(const float (*score)[16], Index nk) noexcept {
    const __mmask16 keys = nk >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << nk) - 1u);
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __mmask16 skipped = 0;
    for (int r = 0; r < R; ++r) skipped |= _mm512_mask_cmp_ps_mask(keys, _mm512_load_ps(score[r]), neg_inf, _CMP_EQ_OQ);
    return skipped != 0;
}

/// P rounded to bf16 once (nearest even), its 16 words stored at pw (aligned to 32 bytes), and
/// returned widened back to float: the value sum and l use the same weights.
inline simd::Batch<float> round_weights(const simd::Batch<float>& p, std::uint16_t* pw) noexcept {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(p);  // NOLINT: vector cast
    _mm256_store_si256(reinterpret_cast<__m256i*>(pw), h);
    return simd::Batch<float>(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
}
#else
template <int R>
void logits(const bfloat16* const* q, const bfloat16* key, Index key_stride, Index nk, Index dk,
            simd::Batch<float> (*dots)[16]) noexcept;
template <int R>
void values(const std::uint16_t (*pw)[16], Index nk, const bfloat16* value, Index value_stride, float* const* acc,
            Index dv) noexcept;
template <int R>
void values_skipping(const float (*score)[16], const std::uint16_t (*pw)[16], Index nk, const bfloat16* value,
                     Index value_stride, float* const* acc, Index dv) noexcept;
template <int R>
bool skipped_values_finite(const float (*score)[16], Index nk, const bfloat16* value, Index value_stride,
                           Index dv) noexcept;
void unpermute(float* acc, Index dv) noexcept;
template <int R>
bool any_skipped(const float (*score)[16], Index nk) noexcept;
simd::Batch<float> round_weights(const simd::Batch<float>& p, std::uint16_t* pw) noexcept;
#endif  // GATTN_HAS_AVX512BF16_KERNEL

}  // namespace decode_bf16
}  // namespace kernel
GATTN_END_ISA_NAMESPACE
