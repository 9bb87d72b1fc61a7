// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The backward pass of scaled dot-product attention (ops/sdpa.hpp): dQ, dK, dV (and the
/// gradient of learned sinks) from Q, K, V, the forward's output O and log-sum-exp, and dO.
///
/// Algorithm: FlashAttention-2's backward (Dao 2023, "FlashAttention-2: Faster Attention with
/// Better Parallelism and Work Partitioning", Algorithm 2). The N_q × N_k probabilities are
/// never stored: each tile of 64 queries × 64 keys recomputes its logits ℓ from Q and K with
/// the forward's options, and its probabilities P = e^(ℓ − lse) from the saved log-sum-exp.
/// With D_i = Σ_c dO_ic·O_ic (rowsum(dO ⊙ O)),
///     dP = dO·Vᵀ,   dℓ = P ⊙ (dP − D),   dV = Pᵀ·dO,
/// and, through the logit's chain (ℓ = cap(scale·q·k) + ALiBi + bias),
///     dx = dℓ · (1 − (cap(x)/c)²)   (softcap c: d/dx c·tanh(x/c) = 1 − tanh²(x/c); 1 without),
///     dQ = scale·dx·K,   dK = scale·dxᵀ·Q
/// (ALiBi and the bias add constants: they change P, not the chain). A learned sink s_h joins
/// the denominator with no value, so dO·∂O/∂s_h = −P_sink·D with P_sink = e^(s_h − lse):
///     ∂L/∂s_h = −Σ_(b,i) e^(s_h − lse_(b,i,h))·D_(b,i,h).
/// No atomics: every gradient element is written by one task in a fixed order. When there is
/// a task per (sequence, KV head) for every thread, each such task walks its key tiles, adds
/// dK and dV of the tile over the group's query heads and tiles (GQA: dK and dV sum over the
/// group), and adds each query tile's dQ += dS·K as it goes (5 tile products). Otherwise two
/// passes: dQ by (sequence, query head, query tile) over its visible key tiles, then dK and dV
/// by (sequence, KV head, key tile), recomputing P (7 products). Both add the same products
/// in the same order, so the gradients are bitwise the same for any thread count. The tile
/// products run on kernel::tile_product (ops/tile_product.hpp), with a key tile's Kᵀ and Vᵀ
/// copied once for all the query tiles it meets.

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "gattn/ops/sdpa.hpp"
#include "gattn/ops/tile_product.hpp"

GATTN_BEGIN_ISA_NAMESPACE
namespace detail {

/// Queries and keys per tile of the backward pass.
inline constexpr int kBackwardTile = 64;

/// A tile's matrix.
template <class T>
using BackwardTile = RowMatrix<T>;

/// One thread's scratch for the backward tiles.
/// s and dp are whole tiles (row stride kBackwardTile); k_t and v_t hold the key tile's Kᵀ and
/// Vᵀ, [d][kBackwardTile], with 0 past its keys; k_wide and v_wide its 16-bit K and V rows
/// widened.
template <class T>
struct BackwardScratch {
    BackwardTile<T> q, d_out, k, q_seen, s, dp, acc_a, acc_b, k_t, v_t, k_wide, v_wide;
    std::vector<T> d, lse, lse_fix, factor_row;
    std::vector<KeyRange> range;
    std::vector<unsigned char> seen, row_seen;  ///< per key / per query row of the tile: sees or is seen
    BackwardScratch()
        : s(kBackwardTile, kBackwardTile),
          dp(kBackwardTile, kBackwardTile),
          d(kBackwardTile),
          lse(kBackwardTile),
          lse_fix(kBackwardTile),
          factor_row(kBackwardTile),
          range(kBackwardTile),
          seen(kBackwardTile),
          row_seen(kBackwardTile) {}
};

/// What a backward tile needs of the call.
template <class T>
struct BackwardCall {
    const AttentionMask<T>* mask = nullptr;
    const SdpaOptions<T>* options = nullptr;
    Index Nq = 0, Nk = 0, H = 0;
    T scale = T(1), softcap = T(0);
    const T* row_d = nullptr;  ///< [B·N_q, H]: D = rowsum(dO ⊙ O), 0 for rows that see no key
    /// [B·N_q, H]: log Σ e^(ℓ − lse) over a row's keys and sink where the saved log-sum-exp is too
    /// large to carry log n (backward_lse_fixes), else 0; nullptr when no row needs it.
    const T* row_lse_fix = nullptr;
};

/// Whether a row's saved log-sum-exp is so large that its rounding, up to |lse|·ε/2, can swamp
/// the log of the row's normaliser: |lse| ≥ 1 / (1024·ε), 8192 in float, 4.4e12 in double. A
/// row whose every key carries a bias near −FLT_MAX (Hugging Face's padding value) gets
/// lse = −FLT_MAX, log n lost, and e^(ℓ − lse) = 1 for every key.
template <class T>
inline bool lse_needs_fix(T lse) noexcept {
    return std::isfinite(lse) && std::abs(lse) >= T(1) / (T(1024) * std::numeric_limits<T>::epsilon());
}

/// Turns the tile's raw products S = Q·Kᵀ and dP = dO·Vᵀ (rows = queries i0 + t of head h in
/// sequence b, columns = keys k0 + c) into P (in s) and scale·dx (in dp): the logit as the
/// forward computes it (scale, softcap, ALiBi, bias), P = e^(ℓ − lse), dℓ = P·(dP − D), times
/// the softcap's derivative and the scale. Invisible entries and rows marked invalid get 0 by
/// assignment (never a multiply by 0). When seen is given, seen[c] is set for each key some row
/// sees; sc.row_seen[t] says whether row t sees a key of the tile.
template <class T>
inline void backward_tile_gradients(const BackwardCall<T>& call, BackwardScratch<T>& sc, Index b, Index h, Index i0,
                                    Index k0, int rows, int cols, unsigned char* seen) {
    using B = simd::Batch<T>;
    constexpr Index L = static_cast<Index>(simd::kLanes<T>);
    const auto& mask = *call.mask;
    const auto& options = *call.options;
    const T slope = options.alibi_slopes.empty() ? T(0) : options.alibi_slopes[h];
    const bool capped = call.softcap > T(0);
    const T inv_cap = capped ? T(1) / call.softcap : T(0);
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    const bool plain_logits = !capped && slope == T(0) && mask.bias.empty() && mask.bool_mask.empty();
    T* factor = sc.factor_row.data();
    for (int t = 0; t < rows; ++t) {
        T* s = sc.s.row(t).data();
        T* dp = sc.dp.row(t).data();
        const KeyRange r = sc.range[static_cast<std::size_t>(t)];
        const Index lo = std::clamp<Index>(r.begin - k0, 0, cols), hi = std::clamp<Index>(r.end - k0, 0, cols);
        unsigned char& row_seen = sc.row_seen[static_cast<std::size_t>(t)];
        row_seen = lo < hi;
        if (lo >= hi) {
            std::fill(s, s + cols, T(0));
            std::fill(dp, dp + cols, T(0));
            continue;
        }
        const T lse = sc.lse[static_cast<std::size_t>(t)], d = sc.d[static_cast<std::size_t>(t)];
        const T fix = sc.lse_fix[static_cast<std::size_t>(t)];
        if (plain_logits && lo == 0 && hi == cols && fix == T(0)) {
            // The common tile: every key visible, logits scale·q·k. One pass in registers.
            const B vs(call.scale), vl(lse), vd(d);
            Index c = 0;
            for (; c + L <= cols; c += L) {
                const B p = simd::exp<T>(xsimd::fms(B::load_unaligned(s + c), vs, vl));
                p.store_unaligned(s + c);
                ((B::load_unaligned(dp + c) - vd) * p * vs).store_unaligned(dp + c);
            }
            for (; c < cols; ++c) {
                const T p = simd::exp_scalar<T>(s[c] * call.scale - lse);
                s[c] = p;
                dp[c] = (dp[c] - d) * p * call.scale;
            }
            if (seen) std::fill(seen, seen + cols, static_cast<unsigned char>(1));
            continue;
        }
        const Index i = i0 + t;
        const bool* bool_row = mask.bool_mask.empty() ? nullptr : mask.bool_mask.row(b, h, i) + k0;
        const T* bias_row = mask.bias.empty() ? nullptr : mask.bias.row(b, h, i) + k0;
        const Index position = aligned_position(mask, b, i, call.Nq, call.Nk);
        // The logit, as the forward's kernels compute it.
        for (Index c = 0; c < cols; ++c) s[c] *= call.scale;
        if (capped) {
            simd::transform(s, s, static_cast<std::size_t>(cols),
                            [&](const simd::Batch<T>& x) { return simd::softcap<T>(x, call.softcap, inv_cap); });
            for (Index c = 0; c < cols; ++c) {
                const T u = s[c] * inv_cap;
                factor[c] = T(1) - u * u;
            }
        }
        if (slope != T(0))
            for (Index c = lo; c < hi; ++c) {
                const Index j = k0 + c;
                s[c] = std::fma(-slope, static_cast<T>(position > j ? position - j : j - position), s[c]);
            }
        if (bias_row)
            for (Index c = lo; c < hi; ++c) s[c] += bias_row[c];
        for (Index c = lo; c < hi; ++c) s[c] -= lse;
        if (fix != T(0))  // (ℓ − lse) − log Σ e^(ℓ − lse): a distribution again (lse_needs_fix)
            for (Index c = lo; c < hi; ++c) s[c] -= fix;
        simd::transform(s + lo, s + lo, static_cast<std::size_t>(hi - lo),
                        [](const simd::Batch<T>& x) { return simd::exp<T>(x); });
        for (Index c = 0; c < lo; ++c) s[c] = dp[c] = T(0);
        for (Index c = hi; c < cols; ++c) s[c] = dp[c] = T(0);
        if (capped)
            for (Index c = lo; c < hi; ++c) dp[c] = (dp[c] - d) * s[c] * call.scale * factor[c];
        else
            for (Index c = lo; c < hi; ++c) dp[c] = (dp[c] - d) * s[c] * call.scale;
        if (bool_row || bias_row) {
            row_seen = 0;
            for (Index c = lo; c < hi; ++c)
                if ((bool_row && !bool_row[c]) || (bias_row && bias_row[c] == kNegInf))
                    s[c] = dp[c] = T(0);
                else
                    row_seen = 1;
        }
        if (seen)
            for (Index c = lo; c < hi; ++c)
                if (!((bool_row && !bool_row[c]) || (bias_row && bias_row[c] == kNegInf))) seen[c] = 1;
    }
}

/// A query tile's operands: Q and dO in place, or copies whose rows that see nothing are 0.
template <class T>
struct QueryTile {
    using Map = Eigen::Map<const BackwardTile<T>, 0, Eigen::OuterStride<>>;
    Map q, d_out;
    KeyRange keys;  ///< union of the rows' key ranges (empty: no row sees a key)
};

/// Loads a tile's query rows: their key ranges, log-sum-exp and D, and Q and dO in place, or
/// as copies with the rows that see nothing (padding, empty range, log-sum-exp −∞) set to 0
/// when there are such rows. 16-bit rows (S ≠ T) are always copied, widened to T.
template <class T, class S>
inline QueryTile<T> backward_load_queries(const BackwardCall<T>& call, BackwardScratch<T>& sc, ConstMatrixRef<S> query,
                                          ConstMatrixRef<T> lse, ConstMatrixRef<S> d_out, Index b, Index h, Index i0,
                                          int rows, Index dk, Index dv) {
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    KeyRange all{call.Nk, 0};
    bool copy = !std::is_same_v<S, T>;
    for (int t = 0; t < rows; ++t) {
        const Index i = i0 + t, row = b * call.Nq + i;
        KeyRange r = visible_key_range(*call.mask, b, i, call.Nq, call.Nk);
        const T l = lse(row, h);
        if (l == kNegInf) r = {0, 0};
        sc.range[static_cast<std::size_t>(t)] = r;
        sc.lse[static_cast<std::size_t>(t)] = l;
        sc.lse_fix[static_cast<std::size_t>(t)] = call.row_lse_fix ? call.row_lse_fix[row * call.H + h] : T(0);
        sc.d[static_cast<std::size_t>(t)] = call.row_d[row * call.H + h];
        if (r.begin >= r.end) {
            copy = true;
            continue;
        }
        all.begin = std::min(all.begin, r.begin);
        all.end = std::max(all.end, r.end);
    }
    if (all.end <= all.begin) all = {0, 0};
    const S* q0 = query.data() + (b * call.Nq + i0) * query.outerStride() + h * dk;
    const S* o0 = d_out.data() + (b * call.Nq + i0) * d_out.outerStride() + h * dv;
    using Map = typename QueryTile<T>::Map;
    if constexpr (std::is_same_v<S, T>)
        if (!copy)
            return {Map(q0, rows, dk, Eigen::OuterStride<>(query.outerStride())),
                    Map(o0, rows, dv, Eigen::OuterStride<>(d_out.outerStride())), all};
    sc.q.resize(rows, dk);
    sc.d_out.resize(rows, dv);
    for (int t = 0; t < rows; ++t) {
        const KeyRange r = sc.range[static_cast<std::size_t>(t)];
        if (r.begin >= r.end) {
            sc.q.row(t).setZero();
            sc.d_out.row(t).setZero();
            sc.d[static_cast<std::size_t>(t)] = T(0);
        } else {
            if constexpr (std::is_same_v<S, T>) {
                using Row = Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>;
                sc.q.row(t) = Row(q0 + t * query.outerStride(), dk);
                sc.d_out.row(t) = Row(o0 + t * d_out.outerStride(), dv);
            } else {
                kernel::widen_row(q0 + t * query.outerStride(), sc.q.row(t).data(), dk);
                kernel::widen_row(o0 + t * d_out.outerStride(), sc.d_out.row(t).data(), dv);
            }
        }
    }
    return {Map(sc.q.data(), rows, dk, Eigen::OuterStride<>(dk)),
            Map(sc.d_out.data(), rows, dv, Eigen::OuterStride<>(dv)), all};
}

/// For the rows whose saved log-sum-exp lse_needs_fix: log Σ e^(ℓ − lse) over the row's visible
/// keys and its sink, with ℓ as the forward computes it (scale, softcap, ALiBi, bias), so that the
/// tiles' P = e^((ℓ − lse) − fix) sums to 1 (the forward normalised by the sum itself). Returns
/// [B·N_q, H] values, 0 for the other rows, or nothing when no row needs it (the usual case).
template <class T, class S>
inline std::vector<T> backward_lse_fixes(const BackwardCall<T>& call, ConstMatrixRef<S> query, ConstMatrixRef<S> key,
                                         ConstMatrixRef<T> lse, Index batch, Index num_kv_heads, Index dk) {
    std::vector<T> fixes;
    const Index H = call.H, group = H / std::max<Index>(num_kv_heads, 1);
    const auto& mask = *call.mask;
    const auto& options = *call.options;
    std::vector<T> q_wide(static_cast<std::size_t>(dk)), k_wide(static_cast<std::size_t>(dk));
    auto widened = [&](const S* p, std::vector<T>& wide) -> const T* {
        if constexpr (std::is_same_v<S, T>) {
            return p;
        } else {
            kernel::widen_row(p, wide.data(), dk);
            return wide.data();
        }
    };
    for (Index b = 0; b < batch; ++b)
        for (Index i = 0; i < call.Nq; ++i)
            for (Index h = 0; h < H; ++h) {
                const Index row = b * call.Nq + i;
                const T l = lse(row, h);
                if (!lse_needs_fix(l)) continue;
                if (fixes.empty()) fixes.assign(static_cast<std::size_t>(batch * call.Nq * H), T(0));
                const T* q = widened(query.data() + row * query.outerStride() + h * dk, q_wide);
                const RowLogits<T> logit(mask, options, call.softcap, b, h, i, call.Nq, call.Nk);
                const KeyRange r = visible_key_range(mask, b, i, call.Nq, call.Nk);
                const T sink = options.sinks.empty() ? -std::numeric_limits<T>::infinity() : options.sinks[h];
                T sum = std::isfinite(sink) ? std::exp(sink - l) : T(0);
                for (Index j = r.begin; j < r.end; ++j) {
                    if (logit.hidden(j)) continue;
                    const T* k = widened(key.data() + (b * call.Nk + j) * key.outerStride() + (h / group) * dk, k_wide);
                    sum += std::exp(logit(simd::dot(q, k, static_cast<std::size_t>(dk)) * call.scale, j) - l);
                }
                fixes[static_cast<std::size_t>(row * H + h)] = sum > T(0) ? std::log(sum) : T(0);
            }
    return fixes;
}

/// Kᵀ and Vᵀ of a key tile of `cols` keys into sc.k_t and sc.v_t (widened to T), 0 past the
/// keys: once per key tile, for the products of every query tile against it.
template <class T, class KMap>
inline void backward_load_keys(BackwardScratch<T>& sc, const KMap& kt, const KMap& vt, int cols) {
    sc.k_t.resize(kt.cols(), kBackwardTile);
    sc.v_t.resize(vt.cols(), kBackwardTile);
    if constexpr (std::is_same_v<typename KMap::Scalar, T>) {
        sc.k_t.leftCols(cols) = kt.transpose();
        sc.v_t.leftCols(cols) = vt.transpose();
    } else {
        sc.k_wide.resize(cols, kt.cols());
        sc.v_wide.resize(cols, vt.cols());
        for (int c = 0; c < cols; ++c) {
            kernel::widen_row(kt.row(c).data(), sc.k_wide.row(c).data(), kt.cols());
            kernel::widen_row(vt.row(c).data(), sc.v_wide.row(c).data(), vt.cols());
        }
        sc.k_t.leftCols(cols) = sc.k_wide.transpose();
        sc.v_t.leftCols(cols) = sc.v_wide.transpose();
    }
    sc.k_t.rightCols(kBackwardTile - cols).setZero();
    sc.v_t.rightCols(kBackwardTile - cols).setZero();
}

/// One (query tile, key tile) step: P and dS of the tile into sc.s and sc.dp, from Q, dO and
/// the key tile's Kᵀ and Vᵀ (backward_load_keys). Columns from `cols` to the next whole
/// register hold products with the zero padding; nothing reads them.
template <class T>
inline void backward_tile(const BackwardCall<T>& call, BackwardScratch<T>& sc, const QueryTile<T>& qt, Index b, Index h,
                          Index i0, Index k0, int rows, int cols, unsigned char* seen) {
    constexpr int L = static_cast<int>(simd::kLanes<T>), W = kBackwardTile;
    const int n = (cols + L - 1) / L * L;
    kernel::tile_product<T, false>(rows, n, qt.q.cols(), qt.q.data(), qt.q.outerStride(), 1, sc.k_t.data(), W,
                                   sc.s.data(), W);
    kernel::tile_product<T, false>(rows, n, qt.d_out.cols(), qt.d_out.data(), qt.d_out.outerStride(), 1, sc.v_t.data(),
                                   W, sc.dp.data(), W);
    backward_tile_gradients<T>(call, sc, b, h, i0, k0, rows, cols, seen);
}

/// dQ[rows × d_k] (row stride dq_stride) += dS·K over one key tile, with the keys no row of the
/// tile sees entering as 0 (their rows may hold anything). 16-bit K rows come widened
/// (sc.k_wide, backward_load_keys).
template <class T, class KMap>
inline void backward_add_dq(BackwardScratch<T>& sc, const KMap& kt, int rows, int cols, T* dq, Index dq_stride) {
    bool all_seen = true;
    for (int c = 0; c < cols; ++c) all_seen = all_seen && sc.seen[static_cast<std::size_t>(c)];
    const T* k = nullptr;
    Index k_stride = 0;
    if constexpr (std::is_same_v<typename KMap::Scalar, T>) {
        k = kt.data();
        k_stride = kt.outerStride();
    } else {
        k = sc.k_wide.data();
        k_stride = sc.k_wide.cols();
    }
    if (!all_seen) {
        sc.k = Eigen::Map<const BackwardTile<T>, 0, Eigen::OuterStride<>>(k, cols, kt.cols(),
                                                                          Eigen::OuterStride<>(k_stride));
        for (int c = 0; c < cols; ++c)
            if (!sc.seen[static_cast<std::size_t>(c)]) sc.k.row(c).setZero();
        k = sc.k.data();
        k_stride = sc.k.cols();
    }
    kernel::tile_product<T, true>(rows, static_cast<int>(kt.cols()), cols, sc.dp.data(), kBackwardTile, 1, k, k_stride,
                                  dq, dq_stride);
}

/// dK of a key tile (sc.acc_a, [cols × d_k]) += dSᵀ·Q and dV (sc.acc_b, [cols × d_v]) += Pᵀ·dO
/// over one query tile, with the query rows that see no key of the tile entering dK as 0 (a
/// row hidden from every key by the masks, whose log-sum-exp is a sink's, may hold anything;
/// its P row and dO row are 0).
template <class T>
inline void backward_add_dk_dv(BackwardScratch<T>& sc, const QueryTile<T>& qt, int rows, int cols) {
    constexpr Index W = kBackwardTile;
    bool all_seen = true;
    for (int t = 0; t < rows; ++t) all_seen = all_seen && sc.row_seen[static_cast<std::size_t>(t)];
    const T* q = qt.q.data();
    Index q_stride = qt.q.outerStride();
    if (!all_seen) {
        sc.q_seen = qt.q;
        for (int t = 0; t < rows; ++t)
            if (!sc.row_seen[static_cast<std::size_t>(t)]) sc.q_seen.row(t).setZero();
        q = sc.q_seen.data();
        q_stride = sc.q_seen.cols();
    }
    kernel::tile_product<T, true>(cols, static_cast<int>(sc.acc_b.cols()), rows, sc.s.data(), 1, W, qt.d_out.data(),
                                  qt.d_out.outerStride(), sc.acc_b.data(), sc.acc_b.cols());
    kernel::tile_product<T, true>(cols, static_cast<int>(sc.acc_a.cols()), rows, sc.dp.data(), 1, W, q, q_stride,
                                  sc.acc_a.data(), sc.acc_a.cols());
}

/// Validates a backward call (everything the forward checks, plus the saved tensors, dO and the
/// gradients); returns {d_k, d_v}.
template <class S, class T = compute_t<S>>
inline std::pair<Index, Index> validate_sdpa_backward(ConstMatrixRef<S> query, ConstMatrixRef<S> key,
                                                      ConstMatrixRef<S> value, const HeadLayout& heads,
                                                      ConstMatrixRef<S> out, ConstMatrixRef<T> log_sum_exp,
                                                      ConstMatrixRef<S> d_out, const MatrixRef<S>& d_query,
                                                      const MatrixRef<S>& d_key, const MatrixRef<S>& d_value,
                                                      const SdpaOptions<T>& options, const std::vector<T>* d_sinks) {
    constexpr const char* fn = "gattn::scaled_dot_product_attention_backward";
    const auto dims = validate_sdpa<T>(fn, query.rows(), query.cols(), key.rows(), key.cols(), value.rows(),
                                       value.cols(), heads, options);
    const Index dk = dims.first, dv = dims.second;
    const Index B = heads.batch, H = heads.num_heads, Hkv = heads.num_kv_heads;
    const Index Nq = B == 0 ? 0 : query.rows() / B;
    const Index Nk = B == 0 ? 0 : key.rows() / B;
    check_shape(fn, "out", out.rows(), out.cols(), B * Nq, H * dv);
    check_shape(fn, "log_sum_exp", log_sum_exp.rows(), log_sum_exp.cols(), B * Nq, H);
    check_shape(fn, "d_out", d_out.rows(), d_out.cols(), B * Nq, H * dv);
    check_output(fn, "d_query", d_query, B * Nq, H * dk);
    check_output(fn, "d_key", d_key, B * Nk, Hkv * dk);
    check_output(fn, "d_value", d_value, B * Nk, Hkv * dv);
    if (d_sinks && options.sinks.empty())
        throw_invalid(fn, "d_sinks", "must be null when options.sinks is empty (no sinks to differentiate)");
    if (d_sinks == &options.sinks) throw_invalid(fn, "d_sinks", "must not be options.sinks");
    const auto& bias = options.mask.bias;
    auto check_gradient = [&](const MatrixRef<S>& g, const char* name) {
        if (views_overlap(g, query) || views_overlap(g, key) || views_overlap(g, value) || views_overlap(g, out) ||
            views_overlap(g, log_sum_exp) || views_overlap(g, d_out) ||
            (!bias.empty() && overlaps_any(g.data(), span_of(g), bias.data, numel(bias))))
            throw_invalid(fn, name,
                          "must not share an element with query, key, value, out, log_sum_exp, d_out or "
                          "mask.bias");
    };
    check_gradient(d_query, "d_query");
    check_gradient(d_key, "d_key");
    check_gradient(d_value, "d_value");
    if (views_overlap(d_query, d_key) || views_overlap(d_query, d_value))
        throw_invalid(fn, "d_query", "must not share an element with d_key or d_value");
    if (views_overlap(d_key, d_value)) throw_invalid(fn, "d_key", "must not share an element with d_value");
    for (Index r = 0; r < d_out.rows(); ++r)
        for (Index c = 0; c < d_out.cols(); ++c)
            if (!std::isfinite(static_cast<T>(d_out(r, c))))
                throw_invalid(fn, "d_out",
                              "must be finite, got " + number_string(double(static_cast<T>(d_out(r, c)))) + " at (" +
                                  std::to_string(r) + ", " + std::to_string(c) + ")");
    return dims;
}

}  // namespace detail

/// The backward pass of scaled_dot_product_attention: the gradients of a loss L with respect to
/// query, key, value (and the sinks) from the upstream gradient d_out = ∂L/∂out.
///
/// Algorithm: FlashAttention-2 (Dao 2023), Algorithm 2, without atomics (see the file comment
/// for the formulas, the softcap's chain 1 − (cap(x)/c)² and the sinks' −Σ e^(s − lse)·D).
/// Every option of the forward is differentiated: scale, every mask and their compositions,
/// GQA/MQA (dK and dV sum over each KV head's query heads), d_v ≠ d_k, sinks, logit softcap,
/// ALiBi. The probabilities are recomputed per 64 × 64 tile from the saved log-sum-exp: extra
/// memory is a few tiles per thread, plus D = rowsum(dO ⊙ O), B·N_q·H values (as many as the
/// log-sum-exp), and a key range per 64-query tile.
///
/// \param query, key, value, heads as given to the forward call.
/// \param out          [B·N_q, H·d_v]: the forward's output.
/// \param log_sum_exp  [B·N_q, H]: the forward's SdpaOutputs::log_sum_exp.
/// \param d_out        [B·N_q, H·d_v]: ∂L/∂out; every element finite.
/// \param d_query      [B·N_q, H·d_k], written: ∂L/∂query (0 for rows that see no key).
/// \param d_key        [B·N_k, H_kv·d_k], written: ∂L/∂key (0 for keys no query sees).
/// \param d_value      [B·N_k, H_kv·d_v], written: ∂L/∂value.
/// \param options      the forward call's options.
/// \param d_sinks      optional [H] output, resized and written: ∂L/∂options.sinks (summed over
///                     the batch and the queries). Only with sinks.
/// A key that no query of a 64-query tile sees (a mask hides it from all of them) is not read
/// into that tile's gradients: NaN in unused cache slots does not leak. Likewise a query that
/// sees no key of a 64-key tile is not read into that tile's dK: NaN in padding queries (also
/// those hidden only by the boolean mask or a −∞ bias row, in a call with sinks) does not leak.
/// A NaN in a key (query) that some rows of a tile see reaches the dQ (dK) of the tile's rows
/// (keys) that do not see it. Masks and the bias get no gradient. Non-finite values in query,
/// key, value, out or log_sum_exp propagate.
/// \throws shape_error when an argument's shape disagrees with the others (what the forward
///         checks, plus out, log_sum_exp, d_out and the gradients); std::invalid_argument for
///         what the forward refuses in its options, a d_out element that is NaN or ±∞ (naming
///         it), a gradient sharing an element with an input, the bias or another gradient or
///         with rows that overlap (row stride below its columns), and d_sinks given without
///         sinks or being options.sinks. Nothing is written before validation passes.
/// Scalar: float or double, in which everything runs; or 16-bit storage (gattn::bfloat16,
/// gattn::half) of query, key, value, out, d_out and the gradients, with the log-sum-exp, the
/// options and d_sinks in float (as the 16-bit forward gives them): each tile's rows are
/// widened to float, every product and sum runs in float on the float kernels, and each
/// gradient element is rounded to Scalar once, at the end (two passes, whatever the threads).
/// The 16-bit gradients are then the float gradients of the widened inputs within Scalar's
/// rounding (2⁻⁸ relative for bf16, 2⁻¹¹ for half), plus what D loses to the forward's rounded
/// output (docs/conventions.md, "Backward pass (SDPA)"); a half gradient beyond ±65504 is ±∞.
/// The saved log-sum-exp is a float or double, so P = e^(ℓ − lse) carries a relative error up
/// to |lse| times half its epsilon: in float, 6e-5 at |lse| = 1000, and near the ALiBi bound
/// float gradients are meaningless. A row with |lse| ≥ 1/(1024·ε) (8192 in float), where that
/// rounding can swamp log n (every key of the row biased by −FLT_MAX, Hugging Face's padding
/// value: lse = −FLT_MAX), is renormalised: its keys' e^(ℓ − lse) are summed first, one dot
/// product per key, and P = e^((ℓ − lse) − log sum), a distribution as in the forward.
/// Compiled with OpenMP, the work is split over (sequence, KV head) tasks when there are
/// enough of them for the threads, else over (sequence, head, query tile) and then (sequence,
/// KV head, key tile) tasks; the gradients are bitwise the same for any thread count.
template <class Scalar>
void scaled_dot_product_attention_backward(ConstMatrixRef<Scalar> query, ConstMatrixRef<Scalar> key,
                                           ConstMatrixRef<Scalar> value, const HeadLayout& heads,
                                           ConstMatrixRef<Scalar> out, ConstMatrixRef<compute_t<Scalar>> log_sum_exp,
                                           ConstMatrixRef<Scalar> d_out, MatrixRef<Scalar> d_query,
                                           MatrixRef<Scalar> d_key, MatrixRef<Scalar> d_value,
                                           const SdpaOptions<compute_t<Scalar>>& options = {},
                                           std::vector<compute_t<Scalar>>* d_sinks = nullptr) {
    static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double> || is_narrow_storage_v<Scalar>,
                  "GATTN_BACKWARD_SCALAR_MUST_BE_FLOAT_DOUBLE_BFLOAT16_OR_HALF");
    using T = compute_t<Scalar>;
    constexpr bool narrow = is_narrow_storage_v<Scalar>;
    namespace gd = gattn::detail;
    const auto dims = gd::validate_sdpa_backward<Scalar>(query, key, value, heads, out, log_sum_exp, d_out, d_query,
                                                         d_key, d_value, options, d_sinks);
    const Index dk = dims.first, dv = dims.second;
    const Index B = heads.batch, H = heads.num_heads, Hkv = heads.num_kv_heads, group = H / Hkv;
    const Index Nq = B == 0 ? 0 : query.rows() / B;
    const Index Nk = B == 0 ? 0 : key.rows() / B;
    constexpr Index tile = gd::kBackwardTile;
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    using KMap = Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;
    using DqMap = Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;

    gd::BackwardCall<T> call;
    call.mask = &options.mask;
    call.options = &options;
    call.Nq = Nq;
    call.Nk = Nk;
    call.H = H;
    call.scale = static_cast<T>(options.scale ? *options.scale : 1.0 / std::sqrt(double(dk)));
    call.softcap = options.logit_softcap ? static_cast<T>(*options.logit_softcap) : T(0);

    const Index q_blocks = (Nq + tile - 1) / tile, k_blocks = (Nk + tile - 1) / tile;
    // The union of each query tile's visible key ranges (B·q_blocks of them), so that a key tile
    // skips the query tiles that see none of its keys in one comparison: a scan of their rows
    // for every key tile took a third of a windowed backward at N = 65,536.
    std::vector<gd::KeyRange> tile_keys(static_cast<std::size_t>(B * q_blocks));
    for (Index b = 0; b < B; ++b)
        for (Index qb = 0; qb < q_blocks; ++qb) {
            gd::KeyRange u{Nk, 0};
            for (Index i = qb * tile; i < std::min(Nq, (qb + 1) * tile); ++i) {
                const gd::KeyRange r = gd::visible_key_range(options.mask, b, i, Nq, Nk);
                if (r.begin >= r.end) continue;
                u.begin = std::min(u.begin, r.begin);
                u.end = std::max(u.end, r.end);
            }
            tile_keys[static_cast<std::size_t>(b * q_blocks + qb)] = u;
        }
    // D = rowsum(dO ⊙ O) per (row, head): FlashAttention-2's preprocessing step, [B·N_q, H].
    std::vector<T> row_d(static_cast<std::size_t>(B * Nq * H));
    call.row_d = row_d.data();
    const std::vector<T> lse_fixes = gd::backward_lse_fixes<T, Scalar>(call, query, key, log_sum_exp, B, Hkv, dk);
    if (!lse_fixes.empty()) call.row_lse_fix = lse_fixes.data();
#ifdef _OPENMP
    const Index threads = omp_get_max_threads();
#else
    const Index threads = 1;
#endif
    [[maybe_unused]] const bool parallel = threads > 1 && B * H * Nq * Nk * (dk + dv) > (Index(1) << 18);
    // With a task per (sequence, KV head) for every thread, one pass: each task owns its heads'
    // dQ rows and its keys' dK and dV rows. Otherwise two passes (dQ by query tiles, then dK and
    // dV by key tiles). Both add the same tile products in the same order (dQ over key tiles,
    // dK and dV over query heads and tiles, ascending), so the choice changes no bit.
    // 16-bit gradients take two passes: dQ then sums a whole row of key tiles in a T tile
    // before it is rounded, once.
    const bool one_pass = !narrow && (B * Hkv % threads == 0 || B * Hkv >= 4 * threads);

#ifdef _OPENMP
#pragma omp parallel if (parallel)
#endif
    {
        gd::BackwardScratch<T> sc;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (Index row = 0; row < B * Nq; ++row)
            for (Index h = 0; h < H; ++h) {
                T& d = row_d[static_cast<std::size_t>(row * H + h)];
                const Scalar* g = d_out.data() + row * d_out.outerStride() + h * dv;
                const Scalar* o = out.data() + row * out.outerStride() + h * dv;
                if (log_sum_exp(row, h) == kNegInf) {
                    d = T(0);
                } else if constexpr (narrow) {
                    d = T(0);
                    for (Index c = 0; c < dv; ++c) d += static_cast<T>(g[c]) * static_cast<T>(o[c]);
                } else {
                    d = simd::dot(g, o, static_cast<std::size_t>(dv));
                }
            }
        // dK and dV of key tile kb of KV head g in sequence b over the group's query heads and
        // tiles; with dq, also each query tile's dQ += dS·K (the one-pass form).
        auto key_tile = [&](Index b, Index g, Index kb, bool dq) {
            const Index k0 = kb * tile;
            const int cols = static_cast<int>(std::min(tile, Nk - k0));
            const KMap kt(key.data() + (b * Nk + k0) * key.outerStride() + g * dk, cols, dk,
                          Eigen::OuterStride<>(key.outerStride()));
            const KMap vt(value.data() + (b * Nk + k0) * value.outerStride() + g * dv, cols, dv,
                          Eigen::OuterStride<>(value.outerStride()));
            sc.acc_a.setZero(cols, dk);  // dK
            sc.acc_b.setZero(cols, dv);  // dV
            gd::backward_load_keys<T>(sc, kt, vt, cols);
            for (Index h = g * group; h < (g + 1) * group; ++h)
                for (Index qb = 0; qb < q_blocks; ++qb) {
                    const Index i0 = qb * tile;
                    const int rows = static_cast<int>(std::min(tile, Nq - i0));
                    // Skip query tiles that see none of these keys (the ranges do not depend on h).
                    const gd::KeyRange seen = tile_keys[static_cast<std::size_t>(b * q_blocks + qb)];
                    if (!(seen.begin < k0 + cols && k0 < seen.end)) continue;
                    const gd::QueryTile<T> qt = gd::backward_load_queries<T, Scalar>(call, sc, query, log_sum_exp,
                                                                                     d_out, b, h, i0, rows, dk, dv);
                    if (!(qt.keys.begin < k0 + cols && k0 < qt.keys.end)) continue;
                    if (dq) std::fill(sc.seen.begin(), sc.seen.end(), static_cast<unsigned char>(0));
                    gd::backward_tile<T>(call, sc, qt, b, h, i0, k0, rows, cols, dq ? sc.seen.data() : nullptr);
                    gd::backward_add_dk_dv<T>(sc, qt, rows, cols);
                    if constexpr (!narrow)  // (16-bit gradients never run one pass)
                        if (dq)
                            gd::backward_add_dq<T>(sc, kt, rows, cols,
                                                   d_query.data() + (b * Nq + i0) * d_query.outerStride() + h * dk,
                                                   d_query.outerStride());
                }
            for (int c = 0; c < cols; ++c) {
                d_key.row(b * Nk + k0 + c).segment(g * dk, dk) = sc.acc_a.row(c).template cast<Scalar>();
                d_value.row(b * Nk + k0 + c).segment(g * dv, dv) = sc.acc_b.row(c).template cast<Scalar>();
            }
        };
        if (one_pass) {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (Index bg = 0; bg < B * Hkv; ++bg) {
                const Index b = bg / Hkv, g = bg % Hkv;
                for (Index h = g * group; h < (g + 1) * group; ++h)
                    for (Index i = 0; i < Nq; ++i) d_query.row(b * Nq + i).segment(h * dk, dk).setZero();
                for (Index kb = 0; kb < k_blocks; ++kb) key_tile(b, g, kb, true);
            }
        } else {
            // Pass 1: dQ by (sequence, head, query tile), the last tiles first (under a causal
            // mask they see the most keys).
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
            for (Index task = 0; task < B * H * q_blocks; ++task) {
                const Index qb = q_blocks - 1 - task % q_blocks, h = (task / q_blocks) % H, b = task / (q_blocks * H);
                const Index g = h / group, i0 = qb * tile;
                const int rows = static_cast<int>(std::min(tile, Nq - i0));
                const gd::QueryTile<T> qt =
                    gd::backward_load_queries<T, Scalar>(call, sc, query, log_sum_exp, d_out, b, h, i0, rows, dk, dv);
                DqMap dq(d_query.data() + (b * Nq + i0) * d_query.outerStride() + h * dk, rows, dk,
                         Eigen::OuterStride<>(d_query.outerStride()));
                // 16-bit dQ sums in a T tile (sc.acc_a is free until pass 2) and is rounded once.
                T* dq_sum = nullptr;
                Index dq_stride = d_query.outerStride();
                if constexpr (narrow) {
                    sc.acc_a.setZero(rows, dk);
                    dq_sum = sc.acc_a.data();
                    dq_stride = dk;
                } else {
                    dq.setZero();
                    dq_sum = dq.data();
                }
                for (Index k0 = (qt.keys.begin / tile) * tile; k0 < qt.keys.end; k0 += tile) {
                    const int cols = static_cast<int>(std::min(tile, Nk - k0));
                    const KMap kt(key.data() + (b * Nk + k0) * key.outerStride() + g * dk, cols, dk,
                                  Eigen::OuterStride<>(key.outerStride()));
                    const KMap vt(value.data() + (b * Nk + k0) * value.outerStride() + g * dv, cols, dv,
                                  Eigen::OuterStride<>(value.outerStride()));
                    gd::backward_load_keys<T>(sc, kt, vt, cols);
                    std::fill(sc.seen.begin(), sc.seen.end(), static_cast<unsigned char>(0));
                    gd::backward_tile<T>(call, sc, qt, b, h, i0, k0, rows, cols, sc.seen.data());
                    gd::backward_add_dq<T>(sc, kt, rows, cols, dq_sum, dq_stride);
                }
                if constexpr (narrow) dq = sc.acc_a.template cast<Scalar>();
            }
            // Pass 2: dK and dV by (sequence, KV head, key tile).
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
            for (Index task = 0; task < B * Hkv * k_blocks; ++task)
                key_tile(task / (k_blocks * Hkv), (task / k_blocks) % Hkv, task % k_blocks, false);
        }
    }
    if (d_sinks) {
        // −Σ e^(s_h − lse)·D over the batch and the queries, in row order.
        d_sinks->assign(static_cast<std::size_t>(H), T(0));
        for (Index h = 0; h < H; ++h) {
            const T sink = options.sinks[static_cast<std::size_t>(h)];
            if (sink == kNegInf) continue;
            T sum = 0;
            for (Index row = 0; row < B * Nq; ++row) {
                const T l = log_sum_exp(row, h), d = row_d[static_cast<std::size_t>(row * H + h)];
                const T fix = lse_fixes.empty() ? T(0) : lse_fixes[static_cast<std::size_t>(row * H + h)];
                if (l != kNegInf && d != T(0)) sum -= std::exp(sink - l - fix) * d;
            }
            (*d_sinks)[static_cast<std::size_t>(h)] = sum;
        }
    }
}

GATTN_END_ISA_NAMESPACE
