// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// x86 AVX-VNNI tier: VPDPWSSD in its VEX encoding on 256-bit registers (Intel Alder Lake and
/// later client CPUs, AMD Zen 5), which multiplies pairs of 16-bit integers and adds both
/// products to a 32-bit lane. Holds the int8 cache decoding micro-kernels for AVX2 machines
/// (kernel::decode_int8_ymm, driven by ops/decode_kernel.hpp): the same integer products as the
/// AVX512-VNNI tier's (x86_avx512vnni.hpp), on 8-key blocks and 16 registers. Compiled in where
/// the translation unit is built with -mavxvnni, AVX2 and FMA (kEnabled; -march=alderlake, or
/// -march=native on such a CPU); runs where the CPU reports AVX-VNNI (CPUID; int8_kernel()).
/// Elsewhere the kernels are only declared, for drivers that name them in `if constexpr`
/// branches they never instantiate. Only xmm0–15/ymm0–15 are used (VEX cannot name more), so in
/// an AVX-512 build the kernel runs too (through set_int8_kernel_limit), on 16-key blocks as two
/// halves.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "gattn/config.hpp"
#include "gattn/simd/compat.hpp"
#include "gattn/simd/x86_avx512vnni.hpp"
#include "gattn/types.hpp"

#if defined(__AVXVNNI__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GATTN_HAS_AVXVNNI_KERNEL 1
#endif

GATTN_BEGIN_ISA_NAMESPACE
namespace simd {
namespace avxvnni {
#if defined(GATTN_HAS_AVXVNNI_KERNEL)
inline constexpr bool kEnabled = true;  ///< built with AVX-VNNI, AVX2 and FMA
#else
inline constexpr bool kEnabled = false;
#endif
}  // namespace avxvnni
}  // namespace simd

namespace kernel {

/// The int8 decoding kernel of decode_int8 (the same contract: decode_int8::takes,
/// takes_values, QueryScales, the query's rounding and residual codes, the weights rounded per
/// block) on 256-bit registers with the VEX-encoded VPDPWSSD.
namespace decode_int8_ymm {

/// Prefetch steps (SpreadPrefetch::step) of one group of query rows over an L-key block: one per
/// 4 keys of the logits, one per key pair of each 32-feature pass of the value sum.
inline constexpr Index prefetch_steps(Index L, Index dv) noexcept { return L / 4 + dv / 32 * (L / 2); }

#if defined(GATTN_HAS_AVXVNNI_KERNEL)
/// acc + VPDPWSSD(a, b), VEX-encoded, accumulating in place (as decode_int8::dpwssd).
inline __m256i dpwssd(__m256i acc, __m256i a, __m256i b) noexcept {
#if defined(__GNUC__) && !defined(__clang__)
    // "x": ymm0–15, which VEX encodes; {vex} keeps the assembler off the EVEX form.
    __asm__("%{vex%} vpdpwssd {%2, %1, %0|%0, %1, %2}" : "+x"(acc) : "x"(a), "x"(b));  // AT&T | Intel
    return acc;
#else
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#endif
}

/// x rounded to the nearest integer, ties to even, whatever the rounding mode.
inline __m256i round_to_int(__m256 x) noexcept {
    return _mm256_cvtps_epi32(_mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/// |x| lane by lane.
inline __m256 abs(__m256 x) noexcept { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }

/// The sum of the eight lanes of x.
inline float reduce_add(__m256 x) noexcept {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/// The largest of the eight lanes of x (none NaN).
inline float reduce_max(__m256 x) noexcept {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/// Eight 32-bit integers (each within ±32767) stored as 16-bit integers at out, saturating.
inline void store_codes(__m256i x, std::int16_t* out) noexcept {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
}

/// Rounds n floats (n a multiple of 8) to 16-bit integer codes against max|x| = top > 0, to
/// nearest even; returns Σ |x / top| (decode_int8::round_to_codes).
inline float round_to_codes(const float* x, Index n, float top, std::int16_t* codes) noexcept {
    const __m256 t = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (Index e = 0; e < n; e += 8) {
        const __m256 rel = _mm256_div_ps(_mm256_loadu_ps(x + e), t);
        sum = _mm256_add_ps(sum, abs(rel));
        store_codes(round_to_int(_mm256_mul_ps(rel, _mm256_set1_ps(32767.0f))), codes + e);
    }
    return reduce_add(sum);
}

/// decode_int8::quantize_query on 256-bit registers: the dk floats of q (dk a multiple of 32) as
/// 16-bit codes of scale max|q| / 32767, and residual codes for a row with an outlier; codes 0
/// and scale NaN for a row with a NaN or infinity.
inline decode_int8::QueryScales quantize_query(const float* q, Index dk, std::int16_t* codes,
                                               std::int16_t* residual) noexcept {
    const auto bytes = static_cast<std::size_t>(dk) * sizeof(std::int16_t);
    __m256 amax = _mm256_setzero_ps();
    int not_finite = 0;
    for (Index e = 0; e < dk; e += 8) {
        const __m256 a = abs(_mm256_loadu_ps(q + e));
        not_finite |=
            _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ));
        amax = _mm256_max_ps(amax, a);
    }
    std::memset(residual, 0, bytes);
    if (not_finite) {
        std::memset(codes, 0, bytes);
        return {std::numeric_limits<float>::quiet_NaN(), 0.0f};
    }
    const float m = reduce_max(amax);
    if (!(m > 0)) {
        std::memset(codes, 0, bytes);
        return {};
    }
    const float sum = round_to_codes(q, dk, m, codes);
    const decode_int8::QueryScales scales{m / 32767.0f, 0.0f};
    // max|q| > ratio · mean|q| ⇔ Σ |q / max|q|| < d_k / ratio.
    if (!(sum * decode_int8::kQueryOutlierRatio < static_cast<float>(dk))) return scales;
    alignas(32) float r[8];
    float r_max = 0;
    for (Index e = 0; e < dk; ++e) r_max = std::max(r_max, std::abs(q[e] - scales.scale * float(codes[e])));
    if (!(r_max > 0)) return scales;
    for (Index e = 0; e < dk; e += 8) {
        for (Index i = 0; i < 8; ++i) r[i] = q[e + i] - scales.scale * float(codes[e + i]);
        round_to_codes(r, 8, r_max, residual + e);
    }
    return {scales.scale, r_max / 32767.0f};
}

/// Register whose lane i is the sum of the eight 32-bit lanes of rows[i] (8 registers), exact
/// while no sum leaves int32.
inline __m256i reduce_rows(const __m256i* rows) noexcept {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(rows[0], rows[1]), _mm256_hadd_epi32(rows[2], rows[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(rows[4], rows[5]), _mm256_hadd_epi32(rows[6], rows[7]));
    // a: rows 0–3 of the low 128 bits, then rows 0–3 of the high; b likewise for rows 4–7.
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/// As reduce_rows, on floats.
inline __m256 reduce_rows(const __m256* rows) noexcept {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(rows[0], rows[1]), _mm256_hadd_ps(rows[2], rows[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(rows[4], rows[5]), _mm256_hadd_ps(rows[6], rows[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/// dots[r][kk] (RR ≤ 2 rows, 8 keys): one register of VPDPWSSD lane sums of q_r · key kk for
/// kk < nk (nk ≤ 8), 0 past nk. Four keys at a time: 8 accumulators, 4 key registers and a
/// query register. prefetch (may be null): stepped once per 4 keys.
template <int RR, class Prefetch>
inline void dot_rows(const std::int16_t* const* q, const std::int8_t* key, Index key_stride, Index nk, Index dk,
                     __m256i (*dots)[8], Prefetch* prefetch) noexcept {
    auto load = [&](Index kk, Index d) {
        return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(key + kk * key_stride + d)));
    };
    Index kk = 0;
    for (; kk + 4 <= nk; kk += 4) {
        if (prefetch) prefetch->step(prefetch->per_step);
        __m256i a[RR][4];
        GATTN_UNROLL
        for (int r = 0; r < RR; ++r) {
            GATTN_UNROLL
            for (int i = 0; i < 4; ++i) a[r][i] = _mm256_setzero_si256();
        }
        for (Index d = 0; d < dk; d += 16) {
            __m256i kv[4];
            GATTN_UNROLL
            for (int i = 0; i < 4; ++i) kv[i] = load(kk + i, d);
            GATTN_UNROLL
            for (int r = 0; r < RR; ++r) {
                const __m256i qd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + d));
                GATTN_UNROLL
                for (int i = 0; i < 4; ++i) a[r][i] = dpwssd(a[r][i], qd, kv[i]);
            }
        }
        GATTN_UNROLL
        for (int r = 0; r < RR; ++r) {
            GATTN_UNROLL
            for (int i = 0; i < 4; ++i) dots[r][kk + i] = a[r][i];
        }
    }
    for (; kk < 8; ++kk) {
        GATTN_UNROLL
        for (int r = 0; r < RR; ++r) {
            __m256i a = _mm256_setzero_si256();
            if (kk < nk)
                for (Index d = 0; d < dk; d += 16)
                    a = dpwssd(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + d)), load(kk, d));
            dots[r][kk] = a;
        }
    }
}

/// decode_int8::logits for an L-key block (L = 8 or 16, the float lanes of the build; 16 as
/// two halves of 8): logits[r] lane kk = s_q[r] · Σ_d q_r[d]·key[kk][d] for R rows and keys
/// kk < nk (lanes kk ≥ nk are 0). Rows go two at a time (16 registers). Up to d_k = 512 a whole
/// dot product fits int32, so the lanes add as integers; beyond, each lane's partial sum turns
/// into a float first. prefetch (may be null): stepped once per 4 keys.
template <int R, class Prefetch>
inline void logits(const std::int16_t* const* q, const float* q_scale, const std::int8_t* key, Index key_stride,
                   Index nk, Index dk, simd::Batch<float>* logits, Prefetch* prefetch) noexcept {
    using B = simd::Batch<float>;
    constexpr Index L = static_cast<Index>(simd::kLanes<float>);
    static_assert(L % 8 == 0, "8-key halves");
    alignas(64) float out[R][L];
    for (Index h = 0; h < L; h += 8) {
        const Index n = std::clamp<Index>(nk - h, 0, 8);
        if (n == 0) {  // no key in this half (16-key blocks)
            GATTN_UNROLL
            for (int r = 0; r < R; ++r) _mm256_store_ps(out[r] + h, _mm256_setzero_ps());
            continue;
        }
        const std::int8_t* k = key + h * key_stride;
        for (int r0 = 0; r0 < R; r0 += 2) {
            __m256i dots[2][8];
            Prefetch* p = r0 == 0 ? prefetch : nullptr;  // the first rows step it
            if (r0 + 1 < R)
                dot_rows<2>(q + r0, k, key_stride, n, dk, dots, p);
            else
                dot_rows<1>(q + r0, k, key_stride, n, dk, dots, p);
            for (int r = r0; r < std::min(r0 + 2, R); ++r) {
                const __m256 s = _mm256_set1_ps(q_scale[r]);
                __m256 x;
                if (dk <= 512) {
                    x = _mm256_cvtepi32_ps(reduce_rows(dots[r - r0]));
                } else {
                    __m256 lanes[8];
                    GATTN_UNROLL
                    for (int i = 0; i < 8; ++i) lanes[i] = _mm256_cvtepi32_ps(dots[r - r0][i]);
                    x = reduce_rows(lanes);
                }
                _mm256_store_ps(out[r] + h, _mm256_mul_ps(x, s));
            }
        }
    }
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) logits[r] = B::load_aligned(out[r]);
}

/// acc_r[j…j+31] += Σ_pairs codes·values for RR ≤ 2 rows (one 32-feature pass of values):
/// two keys' codes interleaved into 16-bit pairs, VPDPWSSD against each row's broadcast
/// weight pair; 8 accumulators, 4 value registers and the broadcast. The lanes turn into
/// floats once, times unit[r] / 32767.
template <int RR, Index L, class Prefetch>
inline void value_pass(const std::int16_t (*codes)[L], const float* unit, Index nk, const std::int8_t* value,
                       Index value_stride, float* const* acc, Index j, Prefetch* prefetch) noexcept {
    __m256i a[RR][4];
    GATTN_UNROLL
    for (int r = 0; r < RR; ++r) {
        GATTN_UNROLL
        for (int c = 0; c < 4; ++c) a[r][c] = _mm256_setzero_si256();
    }
    const Index pairs = (nk + 1) / 2;
    for (Index pr = 0; pr < pairs; ++pr) {
        if (prefetch) prefetch->step(prefetch->per_step);
        const std::int8_t* v0 = value + 2 * pr * value_stride + j;
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0));
        const __m256i y = 2 * pr + 1 < nk ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + value_stride))
                                          : _mm256_setzero_si256();
        // Per 128-bit lane ℓ, lo pairs features 16ℓ + 0…7 of the two keys, hi 16ℓ + 8…15;
        // widened, the four registers hold features 0–7, 8–15, 16–23 and 24–31.
        const __m256i lo = _mm256_unpacklo_epi8(x, y), hi = _mm256_unpackhi_epi8(x, y);
        const __m256i v[4] = {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(lo)),
                              _mm256_cvtepi8_epi16(_mm256_castsi256_si128(hi)),
                              _mm256_cvtepi8_epi16(_mm256_extracti128_si256(lo, 1)),
                              _mm256_cvtepi8_epi16(_mm256_extracti128_si256(hi, 1))};
        GATTN_UNROLL
        for (int r = 0; r < RR; ++r) {
            std::int32_t word;
            std::memcpy(&word, codes[r] + 2 * pr, sizeof word);
            const __m256i pp = _mm256_set1_epi32(word);
            GATTN_UNROLL
            for (int c = 0; c < 4; ++c) a[r][c] = dpwssd(a[r][c], pp, v[c]);
        }
    }
    GATTN_UNROLL
    for (int r = 0; r < RR; ++r) {
        // Σ·(1 / 32767)·max |w| in two steps: max |w| / 32767 would lose bits below 2⁻¹²⁶·32767.
        const __m256 u = _mm256_set1_ps(unit[r]), inv = _mm256_set1_ps(1.0f / 32767.0f);
        GATTN_UNROLL
        for (int c = 0; c < 4; ++c) {
            float* o = acc[r] + j + 8 * c;
            _mm256_storeu_ps(o,
                             _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a[r][c]), inv), u, _mm256_loadu_ps(o)));
        }
    }
}

/// decode_int8::values for an L-key block (L = 8 or 16): acc_r += Σ_kk w[r][kk]·codes[kk] for R
/// rows over the keys kk < nk, each row's weights rounded to 16-bit integers against the
/// block's largest magnitude (ties to even), value codes paired two keys at a time, VPDPWSSD
/// into 32-bit lanes, exactly (|Σ| ≤ 16·128·32767 < 2³¹). A skipped key (score −∞) gets weight
/// 0; a row with a weight that is not finite takes float_values alone (the float sum for that
/// row's arguments). Needs dv a multiple of 32 (decode_int8::takes_values asks 64). Rows go two
/// at a time, in 32-feature passes. prefetch (may be null): stepped once per key pair of each
/// pass.
template <int R, class Prefetch, class FloatValues, Index L>
inline void values(const float (*score)[L], const float (*w)[L], Index nk, const std::int8_t* value, Index value_stride,
                   float* const* acc, Index dv, Prefetch* prefetch, const FloatValues& float_values) noexcept {
    static_assert(L % 8 == 0 && L <= 16, "8 or 16 keys");
    alignas(32) std::int16_t codes[R][L];  // the rounded weights (0 past nk)
    float unit[R];                         // max |w| of each row
    const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    const __m256 big = _mm256_set1_ps(std::numeric_limits<float>::max());
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        __m256 x[L / 8];
        __m256 top = _mm256_setzero_ps();
        int not_finite = 0;
        for (Index h = 0; h < L / 8; ++h) {
            const __m256 live = _mm256_cmp_ps(_mm256_load_ps(score[r] + 8 * h), neg_inf, _CMP_NEQ_UQ);
            x[h] = _mm256_and_ps(live, _mm256_load_ps(w[r] + 8 * h));
            not_finite |= _mm256_movemask_ps(_mm256_cmp_ps(abs(x[h]), big, _CMP_NLE_UQ));
            top = _mm256_max_ps(top, abs(x[h]));
        }
        if (not_finite) {
            // Only this row takes the float sum (the others' results do not change).
            float_values(score + r, w + r, nk, value, value_stride, acc + r, dv);
            std::memset(codes[r], 0, sizeof codes[r]);
            unit[r] = 0;
            continue;
        }
        // A view's value scales may be negative: the codes are signed, against max |w|.
        const float t = reduce_max(top);
        unit[r] = t;
        for (Index h = 0; h < L / 8; ++h) {
            const __m256 rel = t > 0 ? _mm256_div_ps(x[h], _mm256_set1_ps(t)) : _mm256_setzero_ps();
            store_codes(round_to_int(_mm256_mul_ps(rel, _mm256_set1_ps(32767.0f))), codes[r] + 8 * h);
        }
    }
    for (Index j = 0; j < dv; j += 32)
        for (int r0 = 0; r0 < R; r0 += 2) {
            Prefetch* p = r0 == 0 ? prefetch : nullptr;  // the first rows step it
            if (r0 + 1 < R)
                value_pass<2, L>(codes + r0, unit + r0, nk, value, value_stride, acc + r0, j, p);
            else
                value_pass<1, L>(codes + r0, unit + r0, nk, value, value_stride, acc + r0, j, p);
        }
}
#else
decode_int8::QueryScales quantize_query(const float* q, Index dk, std::int16_t* codes, std::int16_t* residual) noexcept;
template <int R, class Prefetch>
void logits(const std::int16_t* const* q, const float* q_scale, const std::int8_t* key, Index key_stride, Index nk,
            Index dk, simd::Batch<float>* logits, Prefetch* prefetch) noexcept;
template <int R, class Prefetch, class FloatValues, Index L>
void values(const float (*score)[L], const float (*w)[L], Index nk, const std::int8_t* value, Index value_stride,
            float* const* acc, Index dv, Prefetch* prefetch, const FloatValues& float_values) noexcept;
#endif  // GATTN_HAS_AVXVNNI_KERNEL

}  // namespace decode_int8_ymm
}  // namespace kernel
GATTN_END_ISA_NAMESPACE
