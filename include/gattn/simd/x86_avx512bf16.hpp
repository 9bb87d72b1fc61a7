// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// x86 AVX512-BF16 tier (with AVX512-BW and -VL): VDPBF16PS, which multiplies pairs of bf16
/// values and adds both products to a float accumulator. Holds the micro-kernels of the bf16
/// prefill kernel (kernel::bf16, driven by ops/bf16_flash_kernel.hpp) and of bf16 decoding
/// (kernel::decode_bf16, driven by ops/decode_kernel.hpp), and PackedLinear's bf16 product
/// (detail::linear_tile, driven by ops/packed_linear.hpp). Compiled in where the
/// translation unit is built for AVX512-BF16 (kEnabled); elsewhere the decoding kernels are
/// only declared here, and the prefill and PackedLinear ones in simd/tiers.hpp (shared with
/// ARM64's BFDOT kernels), for drivers that name them in `if constexpr` branches they never
/// instantiate.

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "gattn/config.hpp"
#include "gattn/simd/compat.hpp"
#include "gattn/simd/x86_avx512.hpp"
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

/// Bits of a 16-bit value.
template <class S>
inline std::uint16_t bits16(const S& x) noexcept {
    static_assert(sizeof(S) == 2, "16-bit storage");
    std::uint16_t b;
    std::memcpy(&b, &x, 2);
    return b;
}

/// The micro-kernels of the AVX512-BF16 prefill kernel, which ops/bf16_flash_kernel.hpp drives
/// (bf16::step: masks and the online softmax; bf16_attention_blocks: the key blocks). Queries
/// in the lanes: Q packed as pairs of features [d_k/2][W], Vᵀ as pairs of keys [d_v][Bc/2], Pᵀ
/// as pairs of keys [Bc/2][W], Sᵀ and Oᵀ in float [keys or d_v][W].
namespace bf16 {

using B = simd::Batch<float>;
#if !defined(__aarch64__)                           // (ARM64's BFDOT kernel has its own block: simd/arm_neon_bf16.hpp)
constexpr int C = simd::avx512::FlashTiles::kCols;  // query registers per block
constexpr int L = 16;                               // lanes per register
constexpr int W = C * L;                            // queries per block (FlashGeometry's kQueries)
constexpr int Bc = 64;                              // keys per block (FlashGeometry's kKeys)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
#endif

#if defined(GATTN_HAS_AVX512BF16_KERNEL)
static_assert(sizeof(B) == 64, "the AVX512-BF16 kernel uses 512-bit registers");

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

/// The pair (row[2p], row[2p + 1]) as one 32-bit value; for an odd count n the last pair's
/// second half is 0 (no read past the row).
inline std::uint32_t pair_at(const bfloat16* row, Index p, Index n) noexcept {
    std::uint32_t lo = bits16(row[2 * p]);
    std::uint32_t hi = 2 * p + 1 < n ? bits16(row[2 * p + 1]) : 0u;
    return lo | (hi << 16);
}

/// Transposes the 16 × 16 matrix of 32-bit values whose rows are r[0..15] (the classic
/// unpack-32, unpack-64, 128-bit-lane shuffle sequence: 64 instructions).
inline void transpose16x16(__m512i* r) noexcept {
    __m512i t[16];
    GATTN_UNROLL
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // r[4i + c], 128-bit lane l: rows 4i..4i + 3 of column 4l + c.
    GATTN_UNROLL
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    // A 4 × 4 transpose of 128-bit lanes among r[c], r[4 + c], r[8 + c], r[12 + c].
    GATTN_UNROLL
    for (int c = 0; c < 4; ++c) {
        const __m512i x0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
        const __m512i y0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        const __m512i y1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
        t[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
        t[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
    }
    GATTN_UNROLL
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}

/// qp[p][t] = (q_t[2p], q_t[2p + 1]) for the block's lanes, 0 in padding lanes. Whole groups
/// of 16 queries × 16 pairs are transposed in registers, the rest pair by pair.
template <class Block>
inline void pack_query_pairs(const Block& blk, Index dk, std::uint32_t* qp) noexcept {
    const Index pairs = (dk + 1) / 2, vector_pairs = dk / 32 * 16;
    const int vector_queries = blk.count / 16 * 16;
    for (int t0 = 0; t0 < vector_queries; t0 += 16)
        for (Index p0 = 0; p0 < vector_pairs; p0 += 16) {
            __m512i r[16];
            GATTN_UNROLL
            for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(blk.q[t0 + i] + 2 * p0);
            transpose16x16(r);
            GATTN_UNROLL
            for (int j = 0; j < 16; ++j) _mm512_storeu_si512(qp + (p0 + j) * W + t0, r[j]);
        }
    for (int t = 0; t < W; ++t) {
        const Index from = t < vector_queries ? vector_pairs : 0;
        if (t < blk.count) {
            const bfloat16* q = blk.q[t];
            for (Index p = from; p < pairs; ++p) qp[p * W + t] = pair_at(q, p, dk);
        } else {
            for (Index p = from; p < pairs; ++p) qp[p * W + t] = 0;
        }
    }
}

/// vt[j][p] = (V[2p][j], V[2p + 1][j]) for keys < nk, 0 for the key past an odd nk. Returns
/// whether a value is non-finite (exponent all ones). Whole groups of 16 pairs × 16 features
/// are interleaved and transposed in registers, the rest value by value.
inline bool pack_value_pairs(const bfloat16* value, Index value_stride, Index nk, Index dv,
                             std::uint32_t* vt) noexcept {
    constexpr int P = Bc / 2;
    const Index pairs = (nk + 1) / 2, vector_pairs = nk / 32 * 16, vector_dv = dv / 16 * 16;
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                                6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i exponent = _mm512_set1_epi16(0x7F80);
    __mmask32 non_finite = 0;
    for (Index p0 = 0; p0 < vector_pairs; p0 += 16)
        for (Index j0 = 0; j0 < vector_dv; j0 += 16) {
            __m512i r[16];
            GATTN_UNROLL
            for (int i = 0; i < 16; ++i) {
                const bfloat16* a = value + (2 * (p0 + i)) * value_stride + j0;
                const __m512i ab =
                    _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + value_stride)), 1);
                r[i] = _mm512_permutexvar_epi16(interleave, ab);
                non_finite |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(r[i], exponent), exponent);
            }
            transpose16x16(r);
            GATTN_UNROLL
            for (int j = 0; j < 16; ++j) _mm512_storeu_si512(vt + (j0 + j) * P + p0, r[j]);
        }
    std::uint16_t any = non_finite != 0;
    for (Index p = 0; p < pairs; ++p) {
        const std::uint16_t* a = reinterpret_cast<const std::uint16_t*>(value + 2 * p * value_stride);
        const std::uint16_t* b =
            2 * p + 1 < nk ? reinterpret_cast<const std::uint16_t*>(value + (2 * p + 1) * value_stride) : nullptr;
        for (Index j = p < vector_pairs ? vector_dv : 0; j < dv; ++j) {
            const std::uint16_t lo = a[j], hi = b ? b[j] : std::uint16_t(0);
            any |= static_cast<std::uint16_t>(((lo & 0x7F80u) == 0x7F80u) | ((hi & 0x7F80u) == 0x7F80u));
            vt[j * P + p] = std::uint32_t(lo) | (std::uint32_t(hi) << 16);
        }
    }
    return any != 0;
}

/// Sᵀ row of key j (relative to the block) from its dot products acc: scaled by c, transformed
/// (softcap, ALiBi), −∞ in the lanes that do not see key j; folds into the block max.
template <bool Masked, class Transform>
inline void finish_scores(const __m512* acc, float* st_row, Index j0, const float* lane_begin, const float* lane_end,
                          B* bmax, float c, const Transform* tf) noexcept {
    const B j(static_cast<float>(j0));
    GATTN_UNROLL
    for (int q = 0; q < C; ++q) {
        B v = B(acc[q]) * B(c);
        if (tf) v = tf->apply(v, q, j);
        if constexpr (Masked) {
            const auto visible = (B::load_aligned(lane_begin + q * L) <= j) & (j < B::load_aligned(lane_end + q * L));
            v = xsimd::select(visible, v, B(kNegInf));
        }
        v.store_aligned(st_row + q * L);
        bmax[q] = xsimd::max(bmax[q], v);
    }
}

/// Sᵀ[kk][·] = c · Σ_p K[kk]·Q pairs for kk in [0, R) keys × C registers; masked lanes −∞;
/// folds into the block max. p_begin > 0: Sᵀ already holds the sums over the first p_begin
/// pairs (the AMX tiles'), to which the remaining pairs are added.
template <int R, bool Masked, class Transform>
inline void scores_tile(const bfloat16* key, Index key_stride, const std::uint32_t* qp, Index dk, Index p_begin,
                        float* st, Index j0, const float* lane_begin, const float* lane_end, B* bmax, float c,
                        const bfloat16* next_key, const Transform* tf) noexcept {
    __m512 acc[R][C];
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        GATTN_UNROLL
        for (int q = 0; q < C; ++q) acc[r][q] = p_begin > 0 ? _mm512_load_ps(st + r * W + q * L) : _mm512_setzero_ps();
    }
    const Index full_pairs = dk / 2;
    for (Index p = p_begin; p < full_pairs; ++p) {
        if (p % 32 == 0) {
            GATTN_UNROLL
            for (int r = 0; r < R; ++r) simd::prefetch(next_key + r * key_stride + 2 * p);
        }
        __m512i qv[C];
        GATTN_UNROLL
        for (int q = 0; q < C; ++q) qv[q] = _mm512_load_si512(qp + p * W + q * L);
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            std::uint32_t k;
            std::memcpy(&k, key + r * key_stride + 2 * p, 4);
            const __m512i kb = _mm512_set1_epi32(static_cast<int>(k));
            GATTN_UNROLL
            for (int q = 0; q < C; ++q) acc[r][q] = dp(acc[r][q], kb, qv[q]);
        }
    }
    if (dk % 2 != 0) {  // last feature alone, paired with 0
        const Index p = full_pairs;
        __m512i qv[C];
        GATTN_UNROLL
        for (int q = 0; q < C; ++q) qv[q] = _mm512_load_si512(qp + p * W + q * L);
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            const __m512i kb = _mm512_set1_epi32(static_cast<int>(bits16(key[r * key_stride + 2 * p])));
            GATTN_UNROLL
            for (int q = 0; q < C; ++q) acc[r][q] = dp(acc[r][q], kb, qv[q]);
        }
    }
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) finish_scores<Masked>(acc[r], st + r * W, j0 + r, lane_begin, lane_end, bmax, c, tf);
}

/// Oᵀ[j + r][·] = α·Oᵀ[j + r][·] + Σ_p Vᵀ pairs · Pᵀ pairs for r in [0, R).
template <int R>
inline void values_tile(const std::uint32_t* vt, const std::uint32_t* pt, Index pairs, const B* alpha,
                        float* ot) noexcept {
    constexpr int P = Bc / 2;
    __m512 acc[R][C];
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        GATTN_UNROLL
        for (int q = 0; q < C; ++q) acc[r][q] = _mm512_setzero_ps();
    }
    for (Index p = 0; p < pairs; ++p) {
        __m512i pv[C];
        GATTN_UNROLL
        for (int q = 0; q < C; ++q) pv[q] = _mm512_load_si512(pt + p * W + q * L);
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            const __m512i vb = _mm512_set1_epi32(static_cast<int>(vt[r * P + p]));
            GATTN_UNROLL
            for (int q = 0; q < C; ++q) acc[r][q] = dp(acc[r][q], vb, pv[q]);
        }
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

/// The weights pa (key 2p) and pb (key 2p + 1) of one register of queries rounded to bf16 and
/// stored interleaved at dst (each lane's pair of keys in one 32-bit value); returns lsum plus
/// the rounded weights' sums (a VDPBF16PS against ones), so that l adds what multiplies V.
inline B pack_weight_pair(const B& pa, const B& pb, std::uint32_t* dst, const B& lsum) noexcept {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                                6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i ones = _mm512_set1_epi32(0x3F803F80);  // (1.0, 1.0) in bf16
    const __m512i packed = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(pb, pa));
    _mm512_store_si512(dst, packed);
    return B(dp(lsum, packed, ones));
}
#endif  // GATTN_HAS_AVX512BF16_KERNEL

}  // namespace bf16

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
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            GATTN_UNROLL
            for (int i = 0; i < 4; ++i) a[r][i] = _mm512_setzero_ps();
        }
        if (kk < nk) {
            const int keys = static_cast<int>(std::min<Index>(4, nk - kk));
            const bfloat16* k = key + kk * key_stride;
            for (Index d = 0; d < dk; d += 32) {
                __m512i kv[4];
                GATTN_UNROLL
                for (int i = 0; i < 4; ++i)
                    kv[i] = i < keys ? _mm512_loadu_si512(k + i * key_stride + d) : _mm512_setzero_si512();
                GATTN_UNROLL
                for (int r = 0; r < R; ++r) {
                    const __m512i qd = _mm512_loadu_si512(q[r] + d);
                    GATTN_UNROLL
                    for (int i = 0; i < 4; ++i) a[r][i] = bf16::dp(a[r][i], qd, kv[i]);
                }
            }
        }
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            GATTN_UNROLL
            for (int i = 0; i < 4; ++i) dots[r][kk + i] = B(a[r][i]);
        }
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
        GATTN_UNROLL
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
            GATTN_UNROLL
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
        GATTN_UNROLL
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
    GATTN_UNROLL
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
        GATTN_UNROLL
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
    GATTN_UNROLL
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
    GATTN_UNROLL
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

/// PackedLinear's (ops/packed_linear.hpp) VDPBF16PS kernel: x rounded to bf16 pairs, times
/// weights packed in panels of kLinearPanel outputs × pairs of inputs.
namespace detail {

#if !defined(__aarch64__)  // (ARM64's BFDOT kernel: simd/arm_neon_bf16.hpp)
/// Outputs per packed panel (4 AVX-512 registers of float).
inline constexpr Index kLinearPanel = 64;
#endif

#if defined(GATTN_HAS_AVX512BF16_KERNEL)
/// dst[p] = the pair (x[2p], x[2p+1]) rounded to bf16 (nearest even), for p < ⌈n/2⌉; a missing
/// x[n] is 0.
template <class X>
inline void linear_pack_x(const X* x, Index n, std::uint32_t* dst) noexcept {
    if constexpr (std::is_same_v<X, float>) {
        // VCVTNE2PS2BF16 rounds to nearest even, as bfloat16(float) does; it reads subnormal
        // floats as 0, which the bf16 products read subnormal bf16 as anyway.
        for (Index i = 0; i < n; i += 32) {
            const Index left = n - i;
            const __mmask16 lo = left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
            const __mmask16 hi = left >= 32  ? __mmask16(0xFFFF)
                                 : left > 16 ? static_cast<__mmask16>((1u << (left - 16)) - 1u)
                                             : __mmask16(0);
            const __m512i v =
                (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + i + 16),  // NOLINT: vector cast
                                             _mm512_maskz_loadu_ps(lo, x + i));
            const Index pairs = std::min<Index>(16, (left + 1) / 2);
            _mm512_mask_storeu_epi32(dst + i / 2, static_cast<__mmask16>((1u << pairs) - 1u), v);
        }
    } else {
        for (Index p = 0; 2 * p < n; ++p)
            dst[p] = std::uint32_t(kernel::bits16(x[2 * p])) |
                     (2 * p + 1 < n ? std::uint32_t(kernel::bits16(x[2 * p + 1])) << 16 : 0u);
    }
}

/// out[r][o0 + j] = Σ_p x_pairs[r][p]·panel[p][j] + bias (j < n ≤ 64) for R rows.
template <int R>
inline void linear_tile(const std::uint32_t* x_pairs, Index pairs, const std::uint32_t* panel, const float* bias,
                        float* out, Index out_stride, Index n) noexcept {
    constexpr int C = 4, L = 16;
    __m512 acc[R][C];
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        GATTN_UNROLL
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    }
    for (Index p = 0; p < pairs; ++p) {
        __m512i w[C];
        GATTN_UNROLL
        for (int c = 0; c < C; ++c) w[c] = _mm512_load_si512(panel + p * kLinearPanel + c * L);
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            const __m512i xb = _mm512_set1_epi32(static_cast<int>(x_pairs[r * pairs + p]));
            GATTN_UNROLL
            for (int c = 0; c < C; ++c) acc[r][c] = kernel::bf16::dp(acc[r][c], xb, w[c]);
        }
    }
    GATTN_UNROLL
    for (int c = 0; c < C; ++c) {
        const Index j = c * L;
        if (j >= n) break;
        const __mmask16 m = n - j >= L ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1u);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + j) : _mm512_setzero_ps();
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * out_stride + j, m, _mm512_add_ps(acc[r][c], b));
    }
}
#endif  // GATTN_HAS_AVX512BF16_KERNEL

}  // namespace detail
GATTN_END_ISA_NAMESPACE
