// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// x86 AVX512-VNNI tier (with AVX512-BW): VPDPWSSD, which multiplies pairs of 16-bit integers
/// and adds both products to a 32-bit lane. Holds the micro-kernels of int8 cache decoding
/// (kernel::decode_int8, driven by ops/decode_kernel.hpp). Compiled in where the translation
/// unit is built for AVX512-VNNI (kEnabled); elsewhere the kernels are only declared, for
/// drivers that name them in `if constexpr` branches they never instantiate.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "gattn/config.hpp"
#include "gattn/simd/compat.hpp"
#include "gattn/types.hpp"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define GATTN_HAS_INT8_DOT_KERNEL 1
#endif

GATTN_BEGIN_ISA_NAMESPACE
namespace simd {
namespace avx512vnni {
#if defined(GATTN_HAS_INT8_DOT_KERNEL)
inline constexpr bool kEnabled = true;  ///< built with AVX512-VNNI and -BW
#else
inline constexpr bool kEnabled = false;
#endif
}  // namespace avx512vnni
}  // namespace simd

namespace kernel {

/// Logits of int8 keys as integer products: the query rows are rounded once to 16-bit integers
/// (q ≈ s_q·c, s_q = max|q| / 32767, a relative 2⁻¹⁶ of the row's largest value), and VPDPWSSD
/// sums c·k over pairs of features into 32-bit lanes, exactly (|Σ| < 2³¹ for d_k ≤ 4096). Four
/// times fewer instructions than widening the codes to float FMAs, and no widening to float.
namespace decode_int8 {

/// Whether the kernel takes these key head sizes.
inline constexpr bool takes(Index dk) noexcept { return dk % 32 == 0 && dk <= 4096; }

/// A query row as the integer logits take it: q ≈ scale·codes + residual_scale·residual.
struct QueryScales {
    float scale = 0;           ///< max|q| / 32767; NaN when q holds a NaN or infinity
    float residual_scale = 0;  ///< 0 when the row has no residual codes
};

/// A row whose largest magnitude is more than this many times its mean magnitude (an outlier
/// feature, as massive activations give) also gets residual codes: with one scale for the
/// row, its typical features would keep 10 bits or fewer.
inline constexpr float kQueryOutlierRatio = 32.0f;

/// The query that quantize_query's codes stand for, in float: out[d] = scale·codes[d] +
/// residual_scale·residual[d] for d < dk (what the integer logits multiply the keys by).
inline void dequantize_query(const std::int16_t* codes, const std::int16_t* residual, QueryScales scales, Index dk,
                             float* out) noexcept {
    for (Index d = 0; d < dk; ++d) out[d] = scales.scale * float(codes[d]) + scales.residual_scale * float(residual[d]);
}

/// Whether the integer value sum (values) takes this value head size.
inline constexpr bool takes_values(Index dv) noexcept { return dv % 64 == 0; }

#if defined(GATTN_HAS_INT8_DOT_KERNEL)
/// acc + VPDPWSSD(a, b), accumulating in place: GCC 12 copies every accumulator of the
/// intrinsic's loops through other registers, and the stack, on each step.
inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) noexcept {
#if defined(__GNUC__) && !defined(__clang__)
    __asm__("vpdpwssd {%2, %1, %0|%0, %1, %2}" : "+v"(acc) : "v"(a), "v"(b));  // AT&T | Intel syntax
    return acc;
#else
    return _mm512_dpwssd_epi32(acc, a, b);
#endif
}

/// x rounded to the nearest integer, ties to even, whatever the rounding mode.
inline __m512i round_to_int(__m512 x) noexcept {
    return _mm512_cvt_roundps_epi32(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/// Rounds n floats (n a multiple of 16) to 16-bit integer codes against max|x| = top > 0, to
/// nearest even; returns Σ |x / top|.
inline float round_to_codes(const float* x, Index n, float top, std::int16_t* codes) noexcept {
    // (x / max|x|)·32767 rounds into [−32767, 32767] (dividing first: 32767 / max|x| would
    // overflow for a tiny row); the pack saturates the last ulp.
    const __m512 t = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (Index e = 0; e < n; e += 16) {
        const __m512 rel = _mm512_div_ps(_mm512_loadu_ps(x + e), t);
        sum = _mm512_add_ps(sum, _mm512_abs_ps(rel));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + e),
                            _mm512_cvtsepi32_epi16(round_to_int(_mm512_mul_ps(rel, _mm512_set1_ps(32767.0f)))));
    }
    return _mm512_reduce_add_ps(sum);
}

/// Rounds the dk floats of q (dk a multiple of 32) to 16-bit integer codes, to nearest even,
/// with scale max|q| / 32767 (a relative 2⁻¹⁶ of the row's largest value); a row with an outlier
/// (kQueryOutlierRatio) also gets the rounding error r = q − scale·codes as 16-bit residual codes
/// of their own scale (the logits then take a second integer pass; the query is then kept to a
/// relative 2⁻³¹ of its largest value), else residual codes 0 and residual_scale 0. A row with a
/// NaN or infinity gets codes 0 and scale NaN (its logits, and so its output, are then NaN).
/// Below max|q| ≈ 4e-34 the scale is subnormal and the logits lose precision.
inline QueryScales quantize_query(const float* q, Index dk, std::int16_t* codes, std::int16_t* residual) noexcept {
    const auto bytes = static_cast<std::size_t>(dk) * sizeof(std::int16_t);
    __m512 amax = _mm512_setzero_ps();
    __mmask16 not_finite = 0;
    for (Index e = 0; e < dk; e += 16) {
        const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(q + e));
        not_finite |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ);
        amax = _mm512_max_ps(amax, a);
    }
    const float m = _mm512_reduce_max_ps(amax);
    std::memset(residual, 0, bytes);
    if (not_finite) {
        std::memset(codes, 0, bytes);
        return {std::numeric_limits<float>::quiet_NaN(), 0.0f};
    }
    if (!(m > 0)) {
        std::memset(codes, 0, bytes);
        return {};
    }
    const float sum = round_to_codes(q, dk, m, codes);
    const QueryScales scales{m / 32767.0f, 0.0f};
    // max|q| > ratio · mean|q| ⇔ Σ |q / max|q|| < d_k / ratio.
    if (!(sum * kQueryOutlierRatio < static_cast<float>(dk))) return scales;
    alignas(64) float r[16];
    float r_max = 0;
    for (Index e = 0; e < dk; ++e) r_max = std::max(r_max, std::abs(q[e] - scales.scale * float(codes[e])));
    if (!(r_max > 0)) return scales;
    for (Index e = 0; e < dk; e += 16) {
        for (Index i = 0; i < 16; ++i) r[i] = q[e + i] - scales.scale * float(codes[e + i]);
        round_to_codes(r, 16, r_max, residual + e);
    }
    return {scales.scale, r_max / 32767.0f};
}

/// Register whose lane i is the sum of the 32-bit lanes of rows[i] (16 registers): the
/// butterfly of simd::reduce_sum_rows on integers, exact while no sum leaves int32.
inline __m512i reduce_rows(const __m512i* rows) noexcept {
    __m512i a[8], b[4], c[2];
    GATTN_UNROLL
    for (int j = 0; j < 8; ++j)
        a[j] = _mm512_add_epi32(_mm512_unpacklo_epi32(rows[2 * j], rows[2 * j + 1]),
                                _mm512_unpackhi_epi32(rows[2 * j], rows[2 * j + 1]));
    GATTN_UNROLL
    for (int k = 0; k < 4; ++k)
        b[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * k], a[2 * k + 1]),
                                _mm512_unpackhi_epi64(a[2 * k], a[2 * k + 1]));
    GATTN_UNROLL
    for (int k = 0; k < 2; ++k)
        c[k] = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_i32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/// logits[r] lane kk = s_q[r] · Σ_d q_r[d]·key[kk][d] for R rows and the keys kk < nk of the
/// block (lanes kk ≥ nk are 0): the dot products reduced across lanes, as reduce_sum_rows
/// does for group_logits' registers. Up to d_k = 512 a whole dot product fits int32
/// (|Σ| ≤ 512·32767·128 < 2³¹), so the lanes add as integers and turn into floats once per
/// row; beyond, each lane's partial sum turns into a float first. prefetch (may be null):
/// stepped once per 4 keys (decode_chunk's spread prefetch, kernel::SpreadPrefetch).
template <int R, class Prefetch>
inline void logits(const std::int16_t* const* q, const float* q_scale, const std::int8_t* key, Index key_stride,
                   Index nk, Index dk, simd::Batch<float>* logits, Prefetch* prefetch) noexcept {
    using B = simd::Batch<float>;
    auto load = [&](Index kk, Index d) {
        return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + kk * key_stride + d)));
    };
    __m512i dots[R][16];
    Index kk = 0;
    for (; kk + 4 <= nk; kk += 4) {
        if (prefetch) prefetch->step(prefetch->per_step);
        __m512i a[R][4];
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            GATTN_UNROLL
            for (int i = 0; i < 4; ++i) a[r][i] = _mm512_setzero_si512();
        }
        for (Index d = 0; d < dk; d += 32) {
            __m512i kv[4];
            GATTN_UNROLL
            for (int i = 0; i < 4; ++i) kv[i] = load(kk + i, d);
            GATTN_UNROLL
            for (int r = 0; r < R; ++r) {
                const __m512i qd = _mm512_loadu_si512(q[r] + d);
                GATTN_UNROLL
                for (int i = 0; i < 4; ++i) a[r][i] = dpwssd(a[r][i], qd, kv[i]);
            }
        }
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            GATTN_UNROLL
            for (int i = 0; i < 4; ++i) dots[r][kk + i] = a[r][i];
        }
    }
    for (; kk < 16; ++kk) {
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            __m512i a = _mm512_setzero_si512();
            if (kk < nk)
                for (Index d = 0; d < dk; d += 32) a = dpwssd(a, _mm512_loadu_si512(q[r] + d), load(kk, d));
            dots[r][kk] = a;
        }
    }
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        const B s(q_scale[r]);
        if (dk <= 512) {
            logits[r] = B(_mm512_cvtepi32_ps(reduce_rows(dots[r]))) * s;
        } else {
            B lanes[16];
            GATTN_UNROLL
            for (int i = 0; i < 16; ++i) lanes[i] = B(_mm512_cvtepi32_ps(dots[r][i]));
            logits[r] = simd::reduce_sum_rows<float>(lanes) * s;
        }
    }
}

/// acc_r += Σ_kk w[r][kk]·codes[kk] for R rows over the keys kk < nk of a block, as
/// group_values, with integer products: each row's weights are rounded to 16-bit integers
/// against the block's largest magnitude (w ≈ u·c, u = max |w| / 32767, ties to even; each
/// weight's rounding error is at most 2⁻¹⁶·max |w|), two keys' codes are interleaved into
/// 16-bit pairs, and VPDPWSSD sums c·code over each pair into 32-bit lanes, exactly
/// (|Σ| ≤ 16·128·32767 < 2³¹); the lanes turn into floats once per block, times u. A skipped
/// key (score −∞) gets weight 0, whatever its scale. Half the instructions of widening the
/// codes to float FMAs. A row with a weight that is not finite (a NaN or infinite logit or
/// value scale) takes float_values alone (the float sum, kernel::group_values, for that row's
/// arguments), so the NaN reaches it and the other rows are unchanged.
/// Needs dv a multiple of 64 (takes_values). prefetch (may be null): stepped once per key pair
/// of each 64-feature pass (decode_chunk's spread prefetch).
template <int R, class Prefetch, class FloatValues>
inline void values(const float (*score)[16], const float (*w)[16], Index nk, const std::int8_t* value,
                   Index value_stride, float* const* acc, Index dv, Prefetch* prefetch,
                   const FloatValues& float_values) noexcept {
    alignas(64) std::int16_t codes[R][16];  // the rounded weights (0 past nk)
    float unit[R];                          // max |w| of each row
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        const __mmask16 live = _mm512_cmp_ps_mask(_mm512_load_ps(score[r]), neg_inf, _CMP_NEQ_UQ);
        const __m512 x = _mm512_maskz_mov_ps(live, _mm512_load_ps(w[r]));
        if (_mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ)) {
            // Only this row takes the float sum (the others' results do not change).
            float_values(score + r, w + r, nk, value, value_stride, acc + r, dv);
            std::memset(codes[r], 0, sizeof codes[r]);
            unit[r] = 0;
            continue;
        }
        // A view's value scales may be negative: the codes are signed, against max |w|.
        const float top = _mm512_reduce_max_ps(_mm512_abs_ps(x));
        unit[r] = top;
        const __m512 rel = top > 0 ? _mm512_div_ps(x, _mm512_set1_ps(top)) : _mm512_setzero_ps();
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes[r]),
                           _mm512_cvtsepi32_epi16(round_to_int(_mm512_mul_ps(rel, _mm512_set1_ps(32767.0f)))));
    }
    const Index pairs = (nk + 1) / 2;
    for (Index j = 0; j < dv; j += 64) {
        __m512i a[R][4];
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            GATTN_UNROLL
            for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_si512();
        }
        for (Index pr = 0; pr < pairs; ++pr) {
            if (prefetch) prefetch->step(prefetch->per_step);
            const std::int8_t* v0 = value + 2 * pr * value_stride + j;
            const __m512i x = _mm512_loadu_si512(v0);
            const __m512i y = 2 * pr + 1 < nk ? _mm512_loadu_si512(v0 + value_stride) : _mm512_setzero_si512();
            // Per 128-bit lane ℓ, lo pairs features 16ℓ + 0…7 of the two keys, hi 16ℓ + 8…15;
            // widened, the four registers hold features {0–7, 16–23}, {8–15, 24–31},
            // {32–39, 48–55} and {40–47, 56–63} of the 64.
            const __m512i lo = _mm512_unpacklo_epi8(x, y), hi = _mm512_unpackhi_epi8(x, y);
            const __m512i v[4] = {_mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo)),
                                  _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi)),
                                  _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(lo, 1)),
                                  _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(hi, 1))};
            GATTN_UNROLL
            for (int r = 0; r < R; ++r) {
                std::int32_t word;
                std::memcpy(&word, codes[r] + 2 * pr, sizeof word);
                const __m512i pp = _mm512_set1_epi32(word);
                GATTN_UNROLL
                for (int c = 0; c < 4; ++c) a[r][c] = dpwssd(a[r][c], pp, v[c]);
            }
        }
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            // Σ·(1 / 32767)·max |w| in two steps: max |w| / 32767 would lose bits below 2⁻¹²⁶·32767.
            const __m512 u = _mm512_set1_ps(unit[r]), inv = _mm512_set1_ps(1.0f / 32767.0f);
            // Back to feature order: 256-bit halves of the registers for features 0–15, 16–31, …
            const __m512i f[4] = {_mm512_shuffle_i64x2(a[r][0], a[r][1], 0x44),
                                  _mm512_shuffle_i64x2(a[r][0], a[r][1], 0xEE),
                                  _mm512_shuffle_i64x2(a[r][2], a[r][3], 0x44),
                                  _mm512_shuffle_i64x2(a[r][2], a[r][3], 0xEE)};
            GATTN_UNROLL
            for (int c = 0; c < 4; ++c) {
                float* o = acc[r] + j + 16 * c;
                _mm512_storeu_ps(o,
                                 _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(f[c]), inv), u, _mm512_loadu_ps(o)));
            }
        }
    }
}
#else
QueryScales quantize_query(const float* q, Index dk, std::int16_t* codes, std::int16_t* residual) noexcept;
template <int R, class Prefetch>
void logits(const std::int16_t* const* q, const float* q_scale, const std::int8_t* key, Index key_stride, Index nk,
            Index dk, simd::Batch<float>* logits, Prefetch* prefetch) noexcept;
template <int R, class Prefetch, class FloatValues>
void values(const float (*score)[16], const float (*w)[16], Index nk, const std::int8_t* value, Index value_stride,
            float* const* acc, Index dv, Prefetch* prefetch, const FloatValues& float_values) noexcept;
#endif  // GATTN_HAS_INT8_DOT_KERNEL

}  // namespace decode_int8
}  // namespace kernel
GATTN_END_ISA_NAMESPACE
