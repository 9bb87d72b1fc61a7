// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// ARM64 BF16 tier (ARMv8.6 BF16, HWCAP2_BF16): BFDOT, which multiplies two pairs of bf16
/// values and adds both products to a float lane, and BFCVTN, which rounds float to bf16.
/// Holds both products of decoding over a bf16 cache (kernel::decode_bfdot, driven by
/// ops/decode_kernel.hpp): bf16 queries and keys as they are stored, P rounded to bf16 for the
/// value sum, float accumulation. The same contract as the AVX512-BF16 kernel
/// (x86_avx512bf16.hpp, decode_bf16), on four keys a block. And the micro-kernels of the bf16
/// prefill tiles (kernel::bf16, driven by ops/bf16_flash_kernel.hpp as on x86) and
/// PackedLinear's bf16 product (detail::linear_tile, driven by ops/packed_linear.hpp).
///
/// The build stays at the baseline ARMv8-A: the BFDOT code is compiled with a target attribute
/// (arch=armv8.2-a+bf16) and runs only where the CPU reports the instructions
/// (gattn::bf16_kernel(), Bf16Kernel::Bfdot); elsewhere bf16 is widened to float. On other
/// architectures (kEnabled false) the decoding kernels are only declared here, and the prefill
/// and PackedLinear ones in simd/tiers.hpp, for drivers that name them in `if constexpr`
/// branches they never instantiate.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

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

#if defined(__aarch64__)
/// The micro-kernels of the bf16 prefill kernel on ARM64 (BFDOT), which ops/bf16_flash_kernel.hpp
/// drives as it drives the AVX512-BF16 ones (simd/x86_avx512bf16.hpp), with the same layouts on
/// NEON's block of W = 8 queries: Q packed as pairs of features [d_k/2][W], Vᵀ as pairs of keys
/// [d_v][Bc/2], Pᵀ as pairs of keys [Bc/2][W], Sᵀ and Oᵀ in float [keys or d_v][W]. BFDOT's
/// by-element form multiplies a register of four queries' pairs by one pair of another
/// register, so one load of a K row's 8 features (or of a Vᵀ row's 4 key pairs) serves four
/// instructions per query register.
namespace bf16 {

using B = simd::Batch<float>;
constexpr int C = 2;      // query registers per block (simd::portable::FlashTiles::kCols)
constexpr int L = 4;      // lanes per register
constexpr int W = C * L;  // queries per block (FlashGeometry's kQueries)
constexpr int Bc = 64;    // keys per block (FlashGeometry's kKeys)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if defined(GATTN_HAS_BFDOT_KERNEL)
/// qp[p][t] = (q_t[2p], q_t[2p + 1]) for the block's lanes (the second half 0 past an odd d_k),
/// 0 in padding lanes.
template <class Block>
inline void pack_query_pairs(const Block& blk, Index dk, std::uint32_t* qp) noexcept {
    const Index pairs = (dk + 1) / 2;
    for (int t = 0; t < W; ++t) {
        const auto* q = t < blk.count ? reinterpret_cast<const std::uint16_t*>(blk.q[t]) : nullptr;
        for (Index p = 0; p < pairs; ++p)
            qp[p * W + t] = q ? std::uint32_t(q[2 * p]) | std::uint32_t(2 * p + 1 < dk ? q[2 * p + 1] : 0) << 16 : 0;
    }
}

/// vt[j][p] = (V[2p][j], V[2p + 1][j]) for keys < nk, 0 for the key past an odd nk. Returns
/// whether a value is non-finite (exponent all ones).
inline bool pack_value_pairs(const bfloat16* value, Index value_stride, Index nk, Index dv,
                             std::uint32_t* vt) noexcept {
    constexpr int P = Bc / 2;
    std::uint16_t any = 0;
    for (Index p = 0; p < (nk + 1) / 2; ++p) {
        const auto* a = reinterpret_cast<const std::uint16_t*>(value + 2 * p * value_stride);
        const auto* b = 2 * p + 1 < nk ? reinterpret_cast<const std::uint16_t*>(value + (2 * p + 1) * value_stride)
                                       : nullptr;
        for (Index j = 0; j < dv; ++j) {
            const std::uint16_t lo = a[j], hi = b ? b[j] : std::uint16_t(0);
            any |= static_cast<std::uint16_t>(((lo & 0x7F80u) == 0x7F80u) | ((hi & 0x7F80u) == 0x7F80u));
            vt[j * P + p] = std::uint32_t(lo) | (std::uint32_t(hi) << 16);
        }
    }
    return any != 0;
}

namespace detail {
/// Four pairs of 32-bit values at p as a bf16 register.
GATTN_TARGET_BF16 inline bfloat16x8_t load_pairs(const std::uint32_t* p) noexcept {
    return vreinterpretq_bf16_u32(vld1q_u32(p));
}

/// acc[q] += BFDOT of the query registers qv[i][q] with pair i of x, for the four pairs i.
GATTN_TARGET_BF16 inline void dot_four_pairs(float32x4_t* acc, const bfloat16x8_t (*qv)[C], bfloat16x8_t x) noexcept {
    GATTN_UNROLL
    for (int q = 0; q < C; ++q) {
        acc[q] = vbfdotq_laneq_f32(acc[q], qv[0][q], x, 0);
        acc[q] = vbfdotq_laneq_f32(acc[q], qv[1][q], x, 1);
        acc[q] = vbfdotq_laneq_f32(acc[q], qv[2][q], x, 2);
        acc[q] = vbfdotq_laneq_f32(acc[q], qv[3][q], x, 3);
    }
}

/// acc[r][c] += BFDOT of the registers regs[c] with the pair src[r·stride] broadcast, for R rows
/// (one pair: the tails of the by-element loops).
template <int R, int Regs>
GATTN_TARGET_BF16 inline void dot_one_pair(float32x4_t (*acc)[Regs], const bfloat16x8_t* regs, const std::uint32_t* src,
                                           Index stride) noexcept {
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        const bfloat16x8_t b = vreinterpretq_bf16_u32(vdupq_n_u32(src[r * stride]));
        GATTN_UNROLL
        for (int c = 0; c < Regs; ++c) acc[r][c] = vbfdotq_f32(acc[r][c], regs[c], b);
    }
}
}  // namespace detail

/// Sᵀ[kk][·] = c · Σ_p K[kk]·Q pairs for kk in [0, R) keys × C registers; masked lanes −∞;
/// folds into the block max (p_begin: 0, no tile unit here).
template <int R, bool Masked, class Transform>
GATTN_TARGET_BF16 inline void scores_tile(const bfloat16* key, Index key_stride, const std::uint32_t* qp, Index dk,
                                          Index p_begin, float* st, Index j0, const float* lane_begin,
                                          const float* lane_end, B* bmax, float c, const bfloat16* next_key,
                                          const Transform* tf) noexcept {
    (void)p_begin;
    float32x4_t acc[R][C];
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        GATTN_UNROLL
        for (int q = 0; q < C; ++q) acc[r][q] = vdupq_n_f32(0.0f);
    }
    const Index quads = dk / 8;  // 8 features (4 pairs) a K load
    for (Index f = 0; f < quads; ++f) {
        if (f % 4 == 0) {
            GATTN_UNROLL
            for (int r = 0; r < R; ++r) simd::prefetch(next_key + r * key_stride + 8 * f);
        }
        bfloat16x8_t qv[4][C];
        GATTN_UNROLL
        for (int i = 0; i < 4; ++i) {
            GATTN_UNROLL
            for (int q = 0; q < C; ++q) qv[i][q] = detail::load_pairs(qp + (4 * f + i) * W + q * L);
        }
        GATTN_UNROLL
        for (int r = 0; r < R; ++r)
            detail::dot_four_pairs(acc[r], qv, decode_bfdot::detail::load8(key + r * key_stride + 8 * f));
    }
    for (Index p = 4 * quads; p < (dk + 1) / 2; ++p) {  // the last pairs one by one (an odd d_k: with 0)
        bfloat16x8_t qv[C];
        GATTN_UNROLL
        for (int q = 0; q < C; ++q) qv[q] = detail::load_pairs(qp + p * W + q * L);
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            const auto* k = reinterpret_cast<const std::uint16_t*>(key + r * key_stride);
            const std::uint32_t pair = std::uint32_t(k[2 * p]) | std::uint32_t(2 * p + 1 < dk ? k[2 * p + 1] : 0) << 16;
            const bfloat16x8_t kb = vreinterpretq_bf16_u32(vdupq_n_u32(pair));
            GATTN_UNROLL
            for (int q = 0; q < C; ++q) acc[r][q] = vbfdotq_f32(acc[r][q], qv[q], kb);
        }
    }
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        const B j(static_cast<float>(j0 + r));
        GATTN_UNROLL
        for (int q = 0; q < C; ++q) {
            B v = B(acc[r][q]) * B(c);
            if (tf) v = tf->apply(v, q, j);
            if constexpr (Masked) {
                const auto visible = (B::load_aligned(lane_begin + q * L) <= j) &
                                     (j < B::load_aligned(lane_end + q * L));
                v = xsimd::select(visible, v, B(kNegInf));
            }
            v.store_aligned(st + r * W + q * L);
            bmax[q] = xsimd::max(bmax[q], v);
        }
    }
}

/// Oᵀ[j + r][·] = α·Oᵀ[j + r][·] + Σ_p Vᵀ pairs · Pᵀ pairs for r in [0, R).
template <int R>
GATTN_TARGET_BF16 inline void values_tile(const std::uint32_t* vt, const std::uint32_t* pt, Index pairs, const B* alpha,
                                          float* ot) noexcept {
    constexpr int P = Bc / 2;
    float32x4_t acc[R][C];
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        GATTN_UNROLL
        for (int q = 0; q < C; ++q) acc[r][q] = vdupq_n_f32(0.0f);
    }
    Index p = 0;
    for (; p + 4 <= pairs; p += 4) {
        bfloat16x8_t pv[4][C];
        GATTN_UNROLL
        for (int i = 0; i < 4; ++i) {
            GATTN_UNROLL
            for (int q = 0; q < C; ++q) pv[i][q] = detail::load_pairs(pt + (p + i) * W + q * L);
        }
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) detail::dot_four_pairs(acc[r], pv, detail::load_pairs(vt + r * P + p));
    }
    for (; p < pairs; ++p) {
        bfloat16x8_t pv[C];
        GATTN_UNROLL
        for (int q = 0; q < C; ++q) pv[q] = detail::load_pairs(pt + p * W + q * L);
        detail::dot_one_pair<R>(acc, pv, vt + p, P);
    }
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        GATTN_UNROLL
        for (int q = 0; q < C; ++q) {
            float* o = ot + r * W + q * L;
            simd::fma(B::load_aligned(o), alpha[q], B(acc[r][q])).store_aligned(o);
        }
    }
}

/// The weights pa (key 2p) and pb (key 2p + 1) of one register of queries rounded to bf16
/// (BFCVTN: nearest even) and stored interleaved at dst (each lane's pair of keys in one 32-bit
/// value); returns lsum plus the rounded weights, widened back (exact) and added in float, so
/// that l adds what multiplies V. (A BFDOT against a register of bf16 ones, as on x86, makes
/// GCC 12 emit an FP16 FMOV for the constant, which BF16 alone does not have.)
GATTN_TARGET_BF16 inline B pack_weight_pair(const B& pa, const B& pb, std::uint32_t* dst, const B& lsum) noexcept {
    const uint16x4_t a = vreinterpret_u16_bf16(vcvt_bf16_f32(pa)), b = vreinterpret_u16_bf16(vcvt_bf16_f32(pb));
    vst1q_u32(dst, vreinterpretq_u32_u16(vcombine_u16(vzip1_u16(a, b), vzip2_u16(a, b))));
    const float32x4_t wa = vreinterpretq_f32_u32(vshll_n_u16(a, 16)), wb = vreinterpretq_f32_u32(vshll_n_u16(b, 16));
    return lsum + B(vaddq_f32(wa, wb));
}
#endif  // GATTN_HAS_BFDOT_KERNEL

}  // namespace bf16
#endif  // __aarch64__
}  // namespace kernel

#if defined(__aarch64__)
/// PackedLinear's (ops/packed_linear.hpp) BFDOT kernel: x rounded to bf16 pairs, times weights
/// packed in panels of kLinearPanel outputs × pairs of inputs (the layout of the AVX512-BF16
/// kernel in x86_avx512bf16.hpp).
namespace detail {

/// Outputs per packed panel (16 NEON registers of float).
inline constexpr Index kLinearPanel = 64;

#if defined(GATTN_HAS_BFDOT_KERNEL)
/// dst[p] = the pair (x[2p], x[2p+1]) rounded to bf16 (nearest even), for p < ⌈n/2⌉; a missing
/// x[n] is 0.
template <class X>
inline void linear_pack_x(const X* x, Index n, std::uint32_t* dst) noexcept {
    auto bits = [](const X& v) {
        std::uint16_t b;
        if constexpr (std::is_same_v<X, float>) {
            const bfloat16 h(v);  // nearest even
            std::memcpy(&b, &h, 2);
        } else {
            std::memcpy(&b, &v, 2);
        }
        return std::uint32_t(b);
    };
    for (Index p = 0; 2 * p < n; ++p) dst[p] = bits(x[2 * p]) | (2 * p + 1 < n ? bits(x[2 * p + 1]) << 16 : 0u);
}

/// acc[r][c] += the C registers of pair row `row` of a panel times pair Lane of xq[r].
template <int Lane, int R, int C>
GATTN_TARGET_BF16 inline void linear_pair(float32x4_t (*acc)[C], const bfloat16x8_t* xq,
                                          const std::uint32_t* row) noexcept {
    bfloat16x8_t wv[C];
    GATTN_UNROLL
    for (int c = 0; c < C; ++c) wv[c] = vreinterpretq_bf16_u32(vld1q_u32(row + c * 4));
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        GATTN_UNROLL
        for (int c = 0; c < C; ++c) acc[r][c] = vbfdotq_laneq_f32(acc[r][c], wv[c], xq[r], Lane);
    }
}

/// out[r][o0 + j] = Σ_p x_pairs[r][p]·panel[p][j] + bias (j < n ≤ 64) for R rows: the panel's
/// outputs in slices of C registers (16 with up to 4 rows, else 8), each slice's pairs four at
/// a time (BFDOT by element: one load of 4 pairs of a row of x serves four instructions per
/// register of 4 outputs), in input order.
template <int R>
GATTN_TARGET_BF16 inline void linear_tile(const std::uint32_t* x_pairs, Index pairs, const std::uint32_t* panel,
                                          const float* bias, float* out, Index out_stride, Index n) noexcept {
    constexpr int C = R <= 4 ? 4 : 2, L = 4;
    for (Index o = 0; o < n; o += C * L) {
        float32x4_t acc[R][C];
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            GATTN_UNROLL
            for (int c = 0; c < C; ++c) acc[r][c] = vdupq_n_f32(0.0f);
        }
        const std::uint32_t* w = panel + o;
        Index p = 0;
        for (; p + 4 <= pairs; p += 4) {
            bfloat16x8_t xq[R];
            GATTN_UNROLL
            for (int r = 0; r < R; ++r) xq[r] = vreinterpretq_bf16_u32(vld1q_u32(x_pairs + r * pairs + p));
            linear_pair<0, R, C>(acc, xq, w + p * kLinearPanel);
            linear_pair<1, R, C>(acc, xq, w + (p + 1) * kLinearPanel);
            linear_pair<2, R, C>(acc, xq, w + (p + 2) * kLinearPanel);
            linear_pair<3, R, C>(acc, xq, w + (p + 3) * kLinearPanel);
        }
        for (; p < pairs; ++p) {
            bfloat16x8_t wv[C];
            GATTN_UNROLL
            for (int c = 0; c < C; ++c) wv[c] = vreinterpretq_bf16_u32(vld1q_u32(w + p * kLinearPanel + c * L));
            kernel::bf16::detail::dot_one_pair<R>(acc, wv, x_pairs + p, pairs);
        }
        GATTN_UNROLL
        for (int c = 0; c < C; ++c) {
            const Index j = o + c * L;
            if (j >= n) break;
            alignas(16) float b[L] = {};
            for (Index i = 0; i < L && j + i < n; ++i) b[i] = bias ? bias[j + i] : 0.0f;
            const float32x4_t bv = vld1q_f32(b);
            GATTN_UNROLL
            for (int r = 0; r < R; ++r) {
                const float32x4_t y = vaddq_f32(acc[r][c], bv);
                if (n - j >= L) {
                    vst1q_f32(out + r * out_stride + j, y);
                } else {
                    alignas(16) float t[L];
                    vst1q_f32(t, y);
                    for (Index i = 0; j + i < n; ++i) out[r * out_stride + j + i] = t[i];
                }
            }
        }
    }
}
#endif  // GATTN_HAS_BFDOT_KERNEL

}  // namespace detail
#endif  // __aarch64__
GATTN_END_ISA_NAMESPACE
