// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// ARM64 dot-product tier (ARMv8.2 DotProd, HWCAP asimddp): SDOT, which multiplies four pairs of
/// signed bytes and adds the four products to a 32-bit lane. Holds the logits of int8 cache
/// decoding (kernel::decode_sdot, driven by ops/decode_kernel.hpp); the value sum widens the
/// codes to float (a NEON block is four keys, too few to amortise rounding the weights).
///
/// The build stays at the baseline ARMv8-A: the SDOT code is compiled with a target attribute
/// (arch=armv8.2-a+dotprod) and runs only where the CPU reports the instructions
/// (gattn::int8_kernel(), Int8Kernel::Sdot); elsewhere the codes are widened to float. On other
/// architectures (kEnabled false) the kernels are only declared, for drivers that name them in
/// `if constexpr` branches they never instantiate.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "gattn/config.hpp"
#include "gattn/simd/compat.hpp"
#include "gattn/types.hpp"

#if defined(__aarch64__) && defined(__ARM_NEON) && (defined(__GNUC__) || defined(__clang__))
#include <arm_neon.h>
#define GATTN_HAS_SDOT_KERNEL 1
/// Compiles a function for ARMv8.2-A with the dot-product instructions (SDOT).
#define GATTN_TARGET_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#endif

GATTN_BEGIN_ISA_NAMESPACE
namespace simd {
namespace neon_dotprod {
#if defined(GATTN_HAS_SDOT_KERNEL)
inline constexpr bool kEnabled = true;  ///< ARM64: the SDOT kernels are compiled in (run where HWCAP says)
#else
inline constexpr bool kEnabled = false;
#endif
}  // namespace neon_dotprod
}  // namespace simd

namespace kernel {

/// Logits of int8 keys as integer products with SDOT: each query row is rounded once to 16-bit
/// integers c (q ≈ s·c, s = max|q| / 32639, ties to even), held as two signed bytes
/// c = 256·hi + lo (hi, lo in [−128, 127]); SDOT sums hi·k and lo·k over quadruples of features
/// into 32-bit lanes, exactly, and the logit is s·(256·Σhi·k + Σlo·k). A row with an outlier
/// feature also gets residual codes, as decode_int8's (the same contract as the AVX512-VNNI
/// kernel, with codes up to 32639 instead of 32767).
namespace decode_sdot {

/// Largest code magnitude: 127·256 + 127, the largest 16-bit code whose high byte is a signed byte.
inline constexpr float kCodeMax = 32639.0f;

/// Whether the kernel takes these key head sizes.
inline constexpr bool takes(Index dk) noexcept { return dk % 16 == 0 && dk <= 4096; }

/// A row whose largest magnitude is more than this many times its mean magnitude also gets
/// residual codes (decode_int8::kQueryOutlierRatio).
inline constexpr float kQueryOutlierRatio = 32.0f;

/// A query row as the integer logits take it: q ≈ scale·codes + residual_scale·residual.
struct QueryScales {
    float scale = 0;           ///< max|q| / kCodeMax; NaN when q holds a NaN or infinity
    float residual_scale = 0;  ///< 0 when the row has no residual codes
};

/// The 16-bit code that the bytes hi (at codes[d]) and lo (at codes[dk + d]) of feature d stand for.
inline constexpr std::int32_t code(const std::int8_t* codes, Index dk, Index d) noexcept {
    return 256 * std::int32_t(codes[d]) + std::int32_t(codes[dk + d]);
}

/// The query that quantize_query's codes stand for, in float: out[d] = scale·code(codes, d) +
/// residual_scale·code(residual, d) for d < dk.
inline void dequantize_query(const std::int8_t* codes, const std::int8_t* residual, QueryScales scales, Index dk,
                             float* out) noexcept {
    for (Index d = 0; d < dk; ++d)
        out[d] = scales.scale * float(code(codes, dk, d)) + scales.residual_scale * float(code(residual, dk, d));
}

#if defined(GATTN_HAS_SDOT_KERNEL)
/// Rounds n floats x (n a multiple of 4) against max|x| = top > 0 to codes in
/// [−kCodeMax, kCodeMax], to nearest even whatever the rounding mode (FCVTNS), stored as high
/// bytes at codes[0, n) and low bytes at codes[n, 2n); returns Σ |x / top|.
inline float round_to_codes(const float* x, Index n, float top, std::int8_t* codes) noexcept {
    float sum = 0;
    for (Index e = 0; e < n; e += 4) {
        // Dividing first: kCodeMax / top would overflow for a tiny row.
        const float32x4_t rel = vdivq_f32(vld1q_f32(x + e), vdupq_n_f32(top));
        sum += vaddvq_f32(vabsq_f32(rel));
        int32x4_t c = vcvtnq_s32_f32(vmulq_f32(rel, vdupq_n_f32(kCodeMax)));
        c = vmaxq_s32(vminq_s32(c, vdupq_n_s32(32639)), vdupq_n_s32(-32639));
        // lo: the low byte as a signed byte; hi = (c − lo) / 256, in [−127, 127].
        const int32x4_t lo = vshrq_n_s32(vshlq_n_s32(c, 24), 24);
        const int32x4_t hi = vshrq_n_s32(vsubq_s32(c, lo), 8);
        std::int32_t h[4], l[4];
        vst1q_s32(h, hi);
        vst1q_s32(l, lo);
        GATTN_UNROLL
        for (int i = 0; i < 4; ++i) {
            codes[e + i] = static_cast<std::int8_t>(h[i]);
            codes[n + e + i] = static_cast<std::int8_t>(l[i]);
        }
    }
    return sum;
}

/// Rounds the dk floats of q (takes(dk)) to codes (2·dk bytes: high bytes, then low bytes) with
/// scale max|q| / kCodeMax; a row with an outlier (kQueryOutlierRatio) also gets the rounding
/// error r = q − scale·codes as residual codes of their own scale (a second integer pass), else
/// residual codes 0 and residual_scale 0. A row with a NaN or infinity gets codes 0 and scale
/// NaN (its logits, and so its output, are then NaN). As decode_int8::quantize_query.
inline QueryScales quantize_query(const float* q, Index dk, std::int8_t* codes, std::int8_t* residual) noexcept {
    const auto bytes = 2 * static_cast<std::size_t>(dk);
    float m = 0;
    bool finite = true;
    for (Index e = 0; e < dk; ++e) {
        const float a = std::abs(q[e]);
        finite = finite && a <= std::numeric_limits<float>::max();
        m = std::max(m, a);
    }
    std::memset(residual, 0, bytes);
    if (!finite) {
        std::memset(codes, 0, bytes);
        return {std::numeric_limits<float>::quiet_NaN(), 0.0f};
    }
    if (!(m > 0)) {
        std::memset(codes, 0, bytes);
        return {};
    }
    const float sum = round_to_codes(q, dk, m, codes);
    const QueryScales scales{m / kCodeMax, 0.0f};
    // max|q| > ratio · mean|q| ⇔ Σ |q / max|q|| < d_k / ratio.
    if (!(sum * kQueryOutlierRatio < static_cast<float>(dk))) return scales;
    float r_max = 0;
    for (Index e = 0; e < dk; ++e) r_max = std::max(r_max, std::abs(q[e] - scales.scale * float(code(codes, dk, e))));
    if (!(r_max > 0)) return scales;
    float r[16];
    for (Index e = 0; e < dk; e += 16) {
        for (Index i = 0; i < 16; ++i) r[i] = q[e + i] - scales.scale * float(code(codes, dk, e + i));
        std::int8_t part[32];
        round_to_codes(r, 16, r_max, part);
        std::memcpy(residual + e, part, 16);
        std::memcpy(residual + dk + e, part + 16, 16);
    }
    return {scales.scale, r_max / kCodeMax};
}

/// logits[r] lane kk = s_q[r] · Σ_d q_r[d]·key[kk][d] for R rows and the keys kk < nk ≤ 4 of
/// the block (lanes kk ≥ nk are 0); q[r]: the row's codes from quantize_query. Per key, SDOT
/// sums the high and the low bytes' products into two registers; their lanes add pairwise
/// (ADDP) into one register per row, lane kk for key kk. Up to d_k = 512 the whole dot product
/// 256·Σhi·k + Σlo·k fits int32 (|Σ| ≤ 512·32639·128 < 2³¹) and turns into a float once;
/// beyond, both sums turn into floats first. prefetch (may be null): stepped once per block.
template <int R, class Prefetch>
GATTN_TARGET_DOTPROD inline void logits(const std::int8_t* const* q, const float* q_scale, const std::int8_t* key,
                                        Index key_stride, Index nk, Index dk, simd::Batch<float>* logits,
                                        Prefetch* prefetch) noexcept {
    using B = simd::Batch<float>;
    if (prefetch) prefetch->step(prefetch->per_step);
    int32x4_t hi[R][4], lo[R][4];
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        GATTN_UNROLL
        for (int i = 0; i < 4; ++i) hi[r][i] = lo[r][i] = vdupq_n_s32(0);
    }
    // Keys past nk read key 0's row again (in the block, always readable); their lanes are cleared.
    const std::int8_t* k[4];
    GATTN_UNROLL
    for (int i = 0; i < 4; ++i) k[i] = key + (i < nk ? i : 0) * key_stride;
    for (Index d = 0; d < dk; d += 16) {
        int8x16_t kv[4];
        GATTN_UNROLL
        for (int i = 0; i < 4; ++i) kv[i] = vld1q_s8(k[i] + d);
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            const int8x16_t qh = vld1q_s8(q[r] + d), ql = vld1q_s8(q[r] + dk + d);
            GATTN_UNROLL
            for (int i = 0; i < 4; ++i) {
                hi[r][i] = vdotq_s32(hi[r][i], qh, kv[i]);
                lo[r][i] = vdotq_s32(lo[r][i], ql, kv[i]);
            }
        }
    }
    alignas(16)
        const std::uint32_t live_bits[4] = {nk > 0 ? ~0u : 0u, nk > 1 ? ~0u : 0u, nk > 2 ? ~0u : 0u, nk > 3 ? ~0u : 0u};
    const uint32x4_t live = vld1q_u32(live_bits);
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        const int32x4_t h = vpaddq_s32(vpaddq_s32(hi[r][0], hi[r][1]), vpaddq_s32(hi[r][2], hi[r][3]));
        const int32x4_t l = vpaddq_s32(vpaddq_s32(lo[r][0], lo[r][1]), vpaddq_s32(lo[r][2], lo[r][3]));
        const float32x4_t dots = dk <= 512 ? vcvtq_f32_s32(vaddq_s32(vshlq_n_s32(h, 8), l))
                                           : vfmaq_n_f32(vcvtq_f32_s32(l), vcvtq_f32_s32(h), 256.0f);
        const float32x4_t kept = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(dots), live));
        logits[r] = B(vmulq_n_f32(kept, q_scale[r]));
    }
}
#else
QueryScales quantize_query(const float* q, Index dk, std::int8_t* codes, std::int8_t* residual) noexcept;
template <int R, class Prefetch>
void logits(const std::int8_t* const* q, const float* q_scale, const std::int8_t* key, Index key_stride, Index nk,
            Index dk, simd::Batch<float>* logits, Prefetch* prefetch) noexcept;
#endif  // GATTN_HAS_SDOT_KERNEL

}  // namespace decode_sdot
}  // namespace kernel
GATTN_END_ISA_NAMESPACE
