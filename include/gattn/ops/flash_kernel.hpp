// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The tiled SDPA kernel: one block of queries against blocks of keys with an online softmax
/// (FlashAttention, Dao et al. 2022, Algorithm 1), written for CPUs.
///
/// Queries sit in the SIMD lanes: every tile is stored transposed (Sᵀ[key][query],
/// Oᵀ[feature][query]), so the running max, sum and rescale of the softmax are vertical vector
/// operations and both products are register-blocked outer products that broadcast K and V
/// straight from their natural row-major rows (no packing of K or V). The query block holds the
/// queries of all heads that share one KV head (GQA), so a decoding step with one query still
/// fills lanes with the group's heads and streams K and V once.
///
/// Per key block: Sᵀ = K·(scale·Qᵀ); mask (partial blocks only); block max; α = e^(m − m_new);
/// Pᵀ = e^(Sᵀ − m_new); l = α·l + Σ Pᵀ; Oᵀ = α·Oᵀ + Vᵀ·Pᵀ. A key block that no query of the
/// block can see is skipped, so causal attention costs about half of full attention.
/// In partial blocks a masked key gets P = 0 and is skipped in Vᵀ·Pᵀ by a select (never
/// multiplied by 0), so NaN in masked K or V cannot reach the output.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gattn/ops/mask.hpp"
#include "gattn/simd/math.hpp"
#include "gattn/types.hpp"

GATTN_BEGIN_ISA_NAMESPACE
namespace kernel {

/// Tile geometry for scalar type T on this instruction set.
template <class T>
struct FlashGeometry {
    static constexpr int kLanes = static_cast<int>(simd::kLanes<T>);
#if defined(__AVX512F__)
    static constexpr int kCols = 4;  // registers of queries per tile row
    static constexpr int kRows = 6;  // 6 × 4 = 24 accumulators of 32 registers
#else
    static constexpr int kCols = 2;
    static constexpr int kRows = 6;  // 6 × 2 = 12 accumulators of 16 registers
#endif
    static constexpr int kQueries = kCols * kLanes;  // Br: queries per block
    static constexpr int kKeys = 64;  // Bc: keys per block
};

/// Per-thread scratch of the kernel (64-byte aligned through Eigen's allocator).
template <class T>
struct FlashScratch {
    using G = FlashGeometry<T>;
    RowMatrix<T> qt;  // [d_k, Br]  scale·Qᵀ
    RowMatrix<T> st;  // [Bc, Br]   Sᵀ, then Pᵀ
    RowMatrix<T> ot;  // [d_v, Br]  Oᵀ (unnormalised)
    void reserve(Index dk, Index dv) {
        qt.resize(dk, G::kQueries);
        st.resize(G::kKeys, G::kQueries);
        ot.resize(dv, G::kQueries);
    }
};

/// Description of one query block: up to Br (head, query) pairs that share KV head g of
/// sequence b. Lanes past `count` are padding.
template <class T>
struct FlashBlock {
    using G = FlashGeometry<T>;
    int count = 0;
    const T* q[G::kQueries];          // query rows (d_k values)
    T* out[G::kQueries];              // output rows (d_v values)
    Index begin[G::kQueries];         // visible key range per lane
    Index end[G::kQueries];
    const bool* bool_row[G::kQueries];  // null when no boolean mask
    const T* bias_row[G::kQueries];     // null when no bias
    T* lse[G::kQueries];                // null when not requested
    T* first_key[G::kQueries];          // null when not requested
};

/// Sᵀ[kk][·] = Σ_c K[k0 + kk][c] · Qᵀ[c][·] for kk in [0, R): R keys × kCols registers.
/// The epilogue masks keys outside each lane's range [lane_begin, lane_end) to −∞ (Masked) and
/// folds the tile into the block max, so Sᵀ is not read again for the max.
template <class T, int R, bool Masked>
inline void scores_tile(const T* key, Index key_stride, const T* qt, Index dk, T* st, Index j0,
                        const T* lane_begin, const T* lane_end, simd::Batch<T>* bmax) noexcept {
    using B = simd::Batch<T>;
    using G = FlashGeometry<T>;
    constexpr int C = G::kCols, L = G::kLanes, W = G::kQueries;
    B acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = B(T(0));
    for (Index d = 0; d < dk; ++d) {
        B qv[C];
        for (int c = 0; c < C; ++c) qv[c] = B::load_aligned(qt + d * W + c * L);
        for (int r = 0; r < R; ++r) {
            const B kb(key[r * key_stride + d]);
            for (int c = 0; c < C; ++c) acc[r][c] = xsimd::fma(kb, qv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r) {
        const B j(static_cast<T>(j0 + r));
        for (int c = 0; c < C; ++c) {
            B v = acc[r][c];
            if constexpr (Masked) {
                const auto visible = (B::load_aligned(lane_begin + c * L) <= j) & (j < B::load_aligned(lane_end + c * L));
                v = xsimd::select(visible, v, B(-std::numeric_limits<T>::infinity()));
            }
            v.store_aligned(st + r * W + c * L);
            bmax[c] = xsimd::max(bmax[c], v);
        }
    }
}

/// Oᵀ[j + r][·] = α·Oᵀ[j + r][·] + Σ_kk V[k0 + kk][j + r] · Pᵀ[kk][·] for r in [0, R).
/// Masked: a lane whose P is 0 skips the key (select, not a multiply by 0).
template <class T, int R, bool Masked>
inline void values_tile(const T* value, Index value_stride, const T* pt, Index nk,
                        const simd::Batch<T>* alpha, T* ot) noexcept {
    using B = simd::Batch<T>;
    using G = FlashGeometry<T>;
    constexpr int C = G::kCols, L = G::kLanes, W = G::kQueries;
    B acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = B(T(0));
    for (Index kk = 0; kk < nk; ++kk) {
        B pv[C];
        for (int c = 0; c < C; ++c) pv[c] = B::load_aligned(pt + kk * W + c * L);
        const T* v = value + kk * value_stride;
        for (int r = 0; r < R; ++r) {
            const B vb(v[r]);
            for (int c = 0; c < C; ++c) {
                if constexpr (Masked)
                    acc[r][c] = xsimd::select(pv[c] != B(T(0)), xsimd::fma(vb, pv[c], acc[r][c]), acc[r][c]);
                else
                    acc[r][c] = xsimd::fma(vb, pv[c], acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
            T* o = ot + r * W + c * L;
            xsimd::fma(B::load_aligned(o), alpha[c], acc[r][c]).store_aligned(o);
        }
}

template <class T, int R, bool Masked>
inline void scores_rows(const T* key, Index key_stride, const T* qt, Index dk, T* st, Index j0, Index nk,
                        const T* lane_begin, const T* lane_end, simd::Batch<T>* bmax) noexcept {
    using G = FlashGeometry<T>;
    Index kk = 0;
    for (; kk + R <= nk; kk += R)
        scores_tile<T, R, Masked>(key + kk * key_stride, key_stride, qt, dk, st + kk * G::kQueries, j0 + kk,
                                  lane_begin, lane_end, bmax);
    if constexpr (R > 1) {
        if (kk < nk)
            scores_rows<T, R - 1, Masked>(key + kk * key_stride, key_stride, qt, dk, st + kk * G::kQueries,
                                          j0 + kk, nk - kk, lane_begin, lane_end, bmax);
    }
}

template <class T, int R, bool Masked>
inline void values_rows(const T* value, Index value_stride, const T* pt, Index nk, const simd::Batch<T>* alpha,
                        T* ot, Index dv) noexcept {
    using G = FlashGeometry<T>;
    Index j = 0;
    for (; j + R <= dv; j += R) values_tile<T, R, Masked>(value + j, value_stride, pt, nk, alpha, ot + j * G::kQueries);
    if constexpr (R > 1) {
        if (j < dv) values_rows<T, R - 1, Masked>(value + j, value_stride, pt, nk, alpha, ot + j * G::kQueries, dv - j);
    }
}

/// Runs one query block against the keys [0, N_k) of one KV head.
/// key/value point at key 0 of the head (row strides key_stride/value_stride); the block's
/// queries are unscaled. Writes out, log-sum-exp and first-key probability for its lanes.
template <class T>
void flash_attention_block(const FlashBlock<T>& blk, const T* key, Index key_stride, const T* value,
                           Index value_stride, Index dk, Index dv, T scale, FlashScratch<T>& s) {
    using B = simd::Batch<T>;
    using G = FlashGeometry<T>;
    constexpr int C = G::kCols, L = G::kLanes, W = G::kQueries;
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();

    // Union and intersection of the lanes' visible key ranges.
    Index union_begin = std::numeric_limits<Index>::max(), union_end = 0;
    Index common_begin = 0, common_end = std::numeric_limits<Index>::max();
    bool elementwise = false;
    for (int t = 0; t < blk.count; ++t) {
        if (blk.bool_row[t] || blk.bias_row[t]) elementwise = true;
        common_begin = std::max(common_begin, blk.begin[t]);
        common_end = std::min(common_end, blk.end[t]);
        if (blk.begin[t] >= blk.end[t]) continue;
        union_begin = std::min(union_begin, blk.begin[t]);
        union_end = std::max(union_end, blk.end[t]);
    }

    // scale·Qᵀ, padding lanes zero.
    T* qt = s.qt.data();
    for (int t = 0; t < W; ++t) {
        const T* q = blk.q[t];  // read each query row once, in order
        if (t < blk.count)
            for (Index d = 0; d < dk; ++d) qt[d * W + t] = q[d] * scale;
        else
            for (Index d = 0; d < dk; ++d) qt[d * W + t] = T(0);
    }
    std::fill(s.ot.data(), s.ot.data() + dv * W, T(0));
    B m[C], l[C];
    for (int c = 0; c < C; ++c) {
        m[c] = B(kNegInf);
        l[c] = B(T(0));
    }
    // Per-lane range bounds as T, to mask a key with one vector compare per register.
    alignas(64) T lane_begin[W], lane_end[W], first_score[W];
    for (int t = 0; t < W; ++t) {
        lane_begin[t] = t < blk.count ? static_cast<T>(blk.begin[t]) : T(0);
        lane_end[t] = t < blk.count ? static_cast<T>(blk.end[t]) : T(0);
        first_score[t] = kNegInf;
    }

    T* st = s.st.data();
    // Key blocks start at multiples of Bc, so a lane's blocking (and rounding) does not depend
    // on which other lanes share its query block.
    for (Index k0 = union_begin / G::kKeys * G::kKeys; k0 < union_end; k0 += G::kKeys) {
        const Index nk = std::min<Index>(G::kKeys, union_end - k0);
        const bool full = !elementwise && common_begin <= k0 && k0 + nk <= common_end;
        B bmax[C];
        for (int c = 0; c < C; ++c) bmax[c] = B(kNegInf);
        if (full)
            scores_rows<T, G::kRows, false>(key + k0 * key_stride, key_stride, qt, dk, st, k0, nk, lane_begin,
                                            lane_end, bmax);
        else
            scores_rows<T, G::kRows, true>(key + k0 * key_stride, key_stride, qt, dk, st, k0, nk, lane_begin,
                                           lane_end, bmax);
        if (elementwise && !full) {
            // Boolean mask and additive bias, per lane; then the block max again.
            for (int c = 0; c < C; ++c) bmax[c] = B(kNegInf);
            for (Index kk = 0; kk < nk; ++kk) {
                T* row = st + kk * W;
                const Index j = k0 + kk;
                for (int t = 0; t < blk.count; ++t) {
                    if (blk.bool_row[t] && !blk.bool_row[t][j]) row[t] = kNegInf;
                    if (blk.bias_row[t])
                        row[t] = blk.bias_row[t][j] == kNegInf ? kNegInf : row[t] + blk.bias_row[t][j];
                }
                for (int c = 0; c < C; ++c) bmax[c] = xsimd::max(bmax[c], B::load_aligned(row + c * L));
            }
        }
        if (k0 == 0)
            for (int t = 0; t < W; ++t) first_score[t] = st[t];

        B alpha[C], shift[C], lsum[C];
        for (int c = 0; c < C; ++c) {
            const B m_new = xsimd::max(m[c], bmax[c]);
            // A lane with no visible key so far keeps m = −∞: shift by 0 so that no
            // (−∞) − (−∞) is formed; its P are e^(−∞) = 0 and its α is e^(−∞) = 0.
            shift[c] = xsimd::select(m_new == B(kNegInf), B(T(0)), m_new);
            alpha[c] = simd::exp_nonpositive<T>(m[c] - shift[c]);
            m[c] = m_new;
            lsum[c] = B(T(0));
        }
        for (Index kk = 0; kk < nk; ++kk) {
            T* row = st + kk * W;
            for (int c = 0; c < C; ++c) {
                const B p = simd::exp_nonpositive<T>(B::load_aligned(row + c * L) - shift[c]);
                p.store_aligned(row + c * L);
                lsum[c] += p;
            }
        }
        for (int c = 0; c < C; ++c) l[c] = xsimd::fma(l[c], alpha[c], lsum[c]);
        if (full)
            values_rows<T, G::kRows, false>(value + k0 * value_stride, value_stride, st, nk, alpha, s.ot.data(), dv);
        else
            values_rows<T, G::kRows, true>(value + k0 * value_stride, value_stride, st, nk, alpha, s.ot.data(), dv);
    }

    alignas(64) T m_lane[W], l_lane[W];
    for (int c = 0; c < C; ++c) {
        m[c].store_aligned(m_lane + c * L);
        l[c].store_aligned(l_lane + c * L);
    }
    const T* ot = s.ot.data();
    for (int t = 0; t < blk.count; ++t) {
        const T lt = l_lane[t];
        const bool empty = !(lt > 0) && !std::isnan(lt);
        const T inv = empty ? T(0) : T(1) / lt;
        T* o = blk.out[t];
        for (Index j = 0; j < dv; ++j) o[j] = empty ? T(0) : ot[j * W + t] * inv;
        if (blk.lse[t]) *blk.lse[t] = empty ? kNegInf : m_lane[t] + std::log(lt);
        if (blk.first_key[t])
            *blk.first_key[t] = empty ? T(0) : simd::exp_scalar<T>(first_score[t] - m_lane[t]) * inv;
    }
}

}  // namespace kernel
GATTN_END_ISA_NAMESPACE
