// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// ARM64 BF16 tier (ARMv8.6 BF16, HWCAP2_BF16): BFDOT, which multiplies two pairs of bf16
/// values and adds both products to a float lane, and BFCVTN, which rounds float to bf16.
/// Holds both products of decoding over a bf16 cache (kernel::decode_bfdot, driven by
/// ops/decode_kernel.hpp): bf16 queries and keys as they are stored, P rounded to bf16 for the
/// value sum, float accumulation. The same contract as the AVX512-BF16 kernel
/// (x86_avx512bf16.hpp, decode_bf16), on four keys a block.
///
/// The build stays at the baseline ARMv8-A: the BFDOT code is compiled with a target attribute
/// (arch=armv8.2-a+bf16) and runs only where the CPU reports the instructions
/// (gattn::bf16_kernel(), Bf16Kernel::Bfdot); elsewhere bf16 is widened to float. On other
/// architectures (kEnabled false) the kernels are only declared, for drivers that name them in
/// `if constexpr` branches they never instantiate.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "gattn/config.hpp"
#include "gattn/simd/compat.hpp"
#include "gattn/types.hpp"

#if defined(__aarch64__) && defined(__ARM_NEON) && (defined(__GNUC__) || defined(__clang__))
#include <arm_neon.h>
#define GATTN_HAS_BFDOT_KERNEL 1
/// Compiles a function for ARMv8.2-A with the BF16 instructions (BFDOT, BFCVTN).
#define GATTN_TARGET_BF16 __attribute__((target("arch=armv8.2-a+bf16")))
#endif

GATTN_BEGIN_ISA_NAMESPACE
namespace simd {
namespace neon_bf16 {
#if defined(GATTN_HAS_BFDOT_KERNEL)
inline constexpr bool kEnabled = true;  ///< ARM64: the BFDOT kernels are compiled in (run where HWCAP2 says)
#else
inline constexpr bool kEnabled = false;
#endif
}  // namespace neon_bf16
}  // namespace simd

namespace kernel {

/// Decoding products on bf16 with BFDOT for a bf16 cache. BFDOT sums each pair of products
/// before adding it to the lane: without FEAT_EBF16 that intermediate sum is rounded to odd
/// and subnormal inputs and results are flushed to zero (Arm ARM, BFDOT), as VDPBF16PS
/// flushes them; the error bound is that of rounding P to bf16.
namespace decode_bfdot {

/// Whether the BFDOT decoding kernel takes these head sizes (8 bf16 values a register).
inline constexpr bool takes(Index dk, Index dv) noexcept { return dk % 8 == 0 && dv % 8 == 0; }

/// Whether row r < R skips a key kk < nk of the block (score −∞).
template <int R>
inline bool any_skipped(const float (*score)[4], Index nk) noexcept {
    GATTN_UNROLL
    for (int r = 0; r < R; ++r)
        for (Index kk = 0; kk < nk; ++kk)
            if (score[r][kk] == -std::numeric_limits<float>::infinity()) return true;
    return false;
}

/// Whether the V rows of keys kk < nk that some of the R rows skip (score −∞) are all finite
/// (exponent bits not all ones), so that a weight of 0 for them adds exactly 0.
template <int R>
inline bool skipped_values_finite(const float (*score)[4], Index nk, const bfloat16* value, Index value_stride,
                                  Index dv) noexcept {
    for (Index kk = 0; kk < nk; ++kk) {
        bool skipped = false;
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) skipped = skipped || score[r][kk] == -std::numeric_limits<float>::infinity();
        if (!skipped) continue;
        const bfloat16* v = value + kk * value_stride;
        for (Index d = 0; d < dv; ++d)
            if ((Eigen::numext::bit_cast<std::uint16_t>(v[d]) & 0x7F80u) == 0x7F80u) return false;
    }
    return true;
}

/// The value sum of a block where some row skips a key (score −∞) whose V row may hold
/// anything: key by key, skipping those keys, in feature order.
template <int R>
inline void values_skipping(const float (*score)[4], const std::uint16_t (*pw)[16], Index nk, const bfloat16* value,
                            Index value_stride, float* const* acc, Index dv) noexcept {
    GATTN_UNROLL
    for (int r = 0; r < R; ++r)
        for (Index kk = 0; kk < nk; ++kk) {
            if (score[r][kk] == -std::numeric_limits<float>::infinity()) continue;
            const float p = float(Eigen::numext::bit_cast<bfloat16>(pw[r][kk]));
            const bfloat16* v = value + kk * value_stride;
            for (Index d = 0; d < dv; ++d) acc[r][d] = std::fma(p, float(v[d]), acc[r][d]);
        }
}

#if defined(GATTN_HAS_BFDOT_KERNEL)
namespace detail {
/// 8 bf16 values at p as a register.
GATTN_TARGET_BF16 inline bfloat16x8_t load8(const bfloat16* p) noexcept {
    return vreinterpretq_bf16_u16(vld1q_u16(reinterpret_cast<const std::uint16_t*>(p)));
}

/// a[r][0..1] (features f..f+3, f+4..f+7) += the weights of key pair Pair (lane Pair of p[r])
/// times the pair's rows x and y at those 8 features, interleaved into feature pairs.
template <int Pair, int R>
GATTN_TARGET_BF16 inline void add_key_pair(float32x4_t (*a)[2], const bfloat16x4_t* p, uint16x8_t x,
                                           uint16x8_t y) noexcept {
    const bfloat16x8_t lo = vreinterpretq_bf16_u16(vzip1q_u16(x, y)), hi = vreinterpretq_bf16_u16(vzip2q_u16(x, y));
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        a[r][0] = vbfdotq_lane_f32(a[r][0], lo, p[r], Pair);
        a[r][1] = vbfdotq_lane_f32(a[r][1], hi, p[r], Pair);
    }
}
}  // namespace detail

/// logits[r] lane kk = Σ_d q_r[d]·key[kk][d] for R rows and the keys kk < nk ≤ 4 of the block
/// (lanes kk ≥ nk are 0), unscaled. Per key and row BFDOT sums pairs of features into four
/// lanes; the four keys' registers add pairwise (FADDP) into one register per row.
template <int R>
GATTN_TARGET_BF16 inline void logits(const bfloat16* const* q, const bfloat16* key, Index key_stride, Index nk,
                                     Index dk, simd::Batch<float>* logits) noexcept {
    using B = simd::Batch<float>;
    float32x4_t a[R][4];
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        GATTN_UNROLL
        for (int i = 0; i < 4; ++i) a[r][i] = vdupq_n_f32(0.0f);
    }
    // Keys past nk read key 0's row again (in the block, always readable); their lanes are cleared.
    const bfloat16* k[4];
    GATTN_UNROLL
    for (int i = 0; i < 4; ++i) k[i] = key + (i < nk ? i : 0) * key_stride;
    for (Index d = 0; d < dk; d += 8) {
        bfloat16x8_t kv[4];
        GATTN_UNROLL
        for (int i = 0; i < 4; ++i) kv[i] = detail::load8(k[i] + d);
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            const bfloat16x8_t qd = detail::load8(q[r] + d);
            GATTN_UNROLL
            for (int i = 0; i < 4; ++i) a[r][i] = vbfdotq_f32(a[r][i], qd, kv[i]);
        }
    }
    alignas(16)
        const std::uint32_t live_bits[4] = {nk > 0 ? ~0u : 0u, nk > 1 ? ~0u : 0u, nk > 2 ? ~0u : 0u, nk > 3 ? ~0u : 0u};
    const uint32x4_t live = vld1q_u32(live_bits);
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        const float32x4_t dots = vpaddq_f32(vpaddq_f32(a[r][0], a[r][1]), vpaddq_f32(a[r][2], a[r][3]));
        logits[r] = B(vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(dots), live)));
    }
}

/// acc[r][d] += Σ_kk p[r][kk]·V[kk][d] for R rows over the keys kk < nk ≤ 4 of the block, in
/// feature order. pw[r]: row r's P rounded to bf16 (round_weights), 0 past nk. Two keys' rows
/// interleave (ZIP1, ZIP2) into pairs of the same feature; BFDOT multiplies each pair by the
/// pair of weights (a lane of the weights' register) into the feature's lane.
template <int R>
GATTN_TARGET_BF16 inline void values(const std::uint16_t (*pw)[16], Index nk, const bfloat16* value, Index value_stride,
                                     float* const* acc, Index dv) noexcept {
    constexpr int C = 4;  // 32 features per pass: 8·R accumulators
    bfloat16x4_t p[R];
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) p[r] = vreinterpret_bf16_u16(vld1_u16(pw[r]));
    // A key past nk stands in with zeros (its weight is 0; its row may be outside the cache).
    const bool second = nk > 1, third = nk > 2, fourth = nk > 3;
    const uint16x8_t zero = vdupq_n_u16(0);
    auto row = [&](Index kk, Index j, bool live) {
        return live ? vld1q_u16(reinterpret_cast<const std::uint16_t*>(value + kk * value_stride + j)) : zero;
    };
    for (Index j = 0; j < dv; j += 8 * C) {
        const int chunks = static_cast<int>(std::min<Index>(C, (dv - j) / 8));
        float32x4_t a[C][R][2];  // per chunk of 8 features and row: features 0–3, 4–7
        for (int c = 0; c < chunks; ++c) {
            GATTN_UNROLL
            for (int r = 0; r < R; ++r) {
                GATTN_UNROLL
                for (int h = 0; h < 2; ++h) a[c][r][h] = vld1q_f32(acc[r] + j + 8 * c + 4 * h);
            }
        }
        for (int c = 0; c < chunks; ++c) {
            const Index f = j + 8 * c;
            detail::add_key_pair<0, R>(a[c], p, row(0, f, true), row(1, f, second));
            if (third) detail::add_key_pair<1, R>(a[c], p, row(2, f, true), row(3, f, fourth));
        }
        for (int c = 0; c < chunks; ++c) {
            GATTN_UNROLL
            for (int r = 0; r < R; ++r) {
                GATTN_UNROLL
                for (int h = 0; h < 2; ++h) vst1q_f32(acc[r] + j + 8 * c + 4 * h, a[c][r][h]);
            }
        }
    }
}

/// P rounded to bf16 once (BFCVTN: nearest even under the default FPCR), its 4 words stored at
/// pw, and returned widened back to float: the value sum and l use the same weights.
GATTN_TARGET_BF16 inline simd::Batch<float> round_weights(const simd::Batch<float>& p, std::uint16_t* pw) noexcept {
    const uint16x4_t h = vreinterpret_u16_bf16(vcvt_bf16_f32(p));
    vst1_u16(pw, h);
    return simd::Batch<float>(vreinterpretq_f32_u32(vshll_n_u16(h, 16)));
}
#else
template <int R>
void logits(const bfloat16* const* q, const bfloat16* key, Index key_stride, Index nk, Index dk,
            simd::Batch<float>* logits) noexcept;
template <int R>
void values(const std::uint16_t (*pw)[16], Index nk, const bfloat16* value, Index value_stride, float* const* acc,
            Index dv) noexcept;
simd::Batch<float> round_weights(const simd::Batch<float>& p, std::uint16_t* pw) noexcept;
#endif  // GATTN_HAS_BFDOT_KERNEL

}  // namespace decode_bfdot
}  // namespace kernel
GATTN_END_ISA_NAMESPACE
