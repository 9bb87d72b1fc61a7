// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Scaled dot-product attention (SDPA) over multi-head [B·N, H·d] activations with GQA/MQA.
///
/// Math (Vaswani et al. 2017, Eq. 1; GQA: Ainslie et al. 2023): for query head h, KV head
/// g = ⌊h / (H / H_kv)⌋ (repeat_interleave order),
///     out[b, i, h, :] = Σ_j softmax_j(scale · q[b,i,h]·k[b,j,g] + bias[b,h,i,j]) · v[b,j,g,:]
/// over the keys j that the mask allows (see ops/mask.hpp). The softmax is computed online
/// (running max and sum, Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022) over
/// tiles of queries and keys (ops/flash_kernel.hpp), so the N_q × N_k logits are never
/// materialised: extra memory is a few tiles per thread.
/// A row with no visible key gives an all-zero output and log-sum-exp −∞, never NaN.

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "gattn/ops/bf16_flash_kernel.hpp"
#include "gattn/ops/decode_kernel.hpp"
#include "gattn/ops/flash_kernel.hpp"
#include "gattn/ops/head_major_rows.hpp"
#include "gattn/ops/int8_rows.hpp"
#include "gattn/ops/logit_limits.hpp"
#include "gattn/ops/mask.hpp"
#include "gattn/simd/math.hpp"
#include "gattn/types.hpp"

namespace gattn {

/// Head layout of an attention call: [B·N, H·d] activations hold `batch` sequences.
struct HeadLayout {
    Index batch = 1;         ///< B ≥ 0; rows of query/key/value are multiples of it
    Index num_heads = 1;     ///< H, query heads
    Index num_kv_heads = 1;  ///< H_kv, divides H (H_kv = H: MHA, 1: MQA)
};

/// Options of scaled_dot_product_attention. Scalar is the compute type (float for bf16 and
/// fp16 inputs, see compute_t).
template <class Scalar>
struct SdpaOptions {
    /// Logit scale; empty = 1/√d_k (d_k the query/key head dim, never d_v or H·d_k).
    std::optional<double> scale;
    /// Masks; all apply together.
    AttentionMask<Scalar> mask;
    /// Learned attention sinks (gpt-oss): [H] logits s_h, one per query head, or empty for none.
    /// A sink joins each row's softmax denominator and has no value:
    ///     out = Σ_j e^(ℓ_j − m)·v_j / (e^(s_h − m) + Σ_j e^(ℓ_j − m)),
    /// so a row puts weight on "nothing" instead of on a key; −∞ is no sink for that head.
    /// The log-sum-exp output includes the sink; a row with no visible key gives 0 and
    /// log-sum-exp s_h. Partial results over disjoint key ranges still merge exactly with
    /// merge_attention when exactly one of the calls gets the sinks.
    std::vector<Scalar> sinks;
    /// Logit soft-capping (Gemma 2's attn_logit_softcapping, ONNX Attention's softcap): each
    /// scaled logit ℓ becomes c·tanh(ℓ/c) before ALiBi, the masks and the bias apply. Empty =
    /// none. c must lie in [detail::softcap_min, detail::softcap_max] of Scalar: a normal number
    /// (1/c finite, c at full precision) whose product with log₂e stays within half Scalar's
    /// largest value; in float [1.1755e-38, 1.1793e38]. Computed in the kernels by simd::softcap
    /// (absolute error about one rounding of c; see there).
    std::optional<double> logit_softcap;
    /// ALiBi (Press et al., "Train Short, Test Long", ICLR 2022): [H] slopes m_h, one per
    /// query head, or empty for none. Query i, at aligned position i' (AttentionMask: where the
    /// causal diagonal sits), and key j get −m_h·|i' − j| added to their logit after the
    /// softcap and before the bias; computed in the kernels, no [N_q, N_k] tensor. Composes
    /// with every mask. alibi_slopes(H) gives the standard geometric slopes. Under a causal
    /// mask, BLOOM's form m_h·j gives the same probabilities and outputs (it differs by the
    /// per-row constant m_h·i', which the log-sum-exp keeps). |m_h| ≤ detail::alibi_slope_max
    /// of Scalar (2^62 ≈ 4.6e18 in float): −m_h·|i' − j| then stays within half Scalar's largest
    /// value for any distance, so logits stay finite where the exact ones are.
    std::vector<Scalar> alibi_slopes;
};

/// Which logits SdpaOutputs::logits holds.
enum class LogitStage {
    Scaled,      ///< scale·q·k for every key j < N_k, masked or not (a hidden key may hold anything)
    Softcapped,  ///< Scaled after the logit softcap (the same as Scaled without one)
    Final,       ///< what enters the softmax: softcap, ALiBi and bias applied, −∞ for masked keys
};

/// Optional outputs of scaled_dot_product_attention. Each non-null matrix is resized and filled.
/// Scalar is the compute type (float for bf16 and fp16 inputs).
template <class Scalar>
struct SdpaOutputs {
    /// [B·N_q, H]: log Σ_j exp(logit_j) over visible keys (natural log; −∞ for a fully masked
    /// row). With it, partial results over disjoint key ranges merge exactly.
    RowMatrix<Scalar>* log_sum_exp = nullptr;
    /// [B·H·N_q, N_k], row ((b·H + h)·N_q + i): attention probabilities (0 for masked keys).
    /// O(N_q·N_k) memory: for analysis only.
    RowMatrix<Scalar>* probabilities = nullptr;
    /// [B·N_q, H]: probability each query puts on key 0 (paper §4.3 "first-token attention";
    /// 0 when key 0 is masked).
    RowMatrix<Scalar>* first_key_probability = nullptr;
    /// [B·H·N_q, N_k], row ((b·H + h)·N_q + i): the logits at logits_stage, recomputed with the
    /// kernels' arithmetic (softcap by simd::softcap). O(N_q·N_k) memory: for analysis only.
    RowMatrix<Scalar>* logits = nullptr;
    /// The stage logits holds; Final by default.
    LogitStage logits_stage = LogitStage::Final;
};

}  // namespace gattn

GATTN_BEGIN_ISA_NAMESPACE

/// The standard ALiBi slopes for num_heads heads (Press et al. 2022, §3; BLOOM's
/// build_alibi_tensor): for n = num_heads a power of two, m_h = 2^(−8(h+1)/n); otherwise the
/// n' = 2^⌊log₂ num_heads⌋ slopes of n' heads, then every other slope of 2n' heads
/// (2^(−4(2k+1)/n'), k = 0, 1, …) for the rest. E.g. 8 heads: 1/2, 1/4, …, 1/256.
/// \throws std::invalid_argument for num_heads < 1.
template <class Scalar = double>
std::vector<Scalar> alibi_slopes(Index num_heads) {
    if (num_heads < 1)
        throw std::invalid_argument("gattn::alibi_slopes: num_heads must be >= 1, got " + std::to_string(num_heads));
    Index n = 1;
    while (n * 2 <= num_heads) n *= 2;
    std::vector<Scalar> slopes;
    for (Index h = 1; h <= n; ++h) slopes.push_back(static_cast<Scalar>(std::exp2(-8.0 * double(h) / double(n))));
    for (Index k = 0; n + k < num_heads; ++k)
        slopes.push_back(static_cast<Scalar>(std::exp2(-4.0 * double(2 * k + 1) / double(n))));
    return slopes;
}

namespace detail {

/// Validates the options of an SDPA call that do not depend on its shapes (H query heads):
/// sinks, logit softcap, ALiBi slopes and scale, in the compute type Scalar (the layers check
/// theirs at construction with it). Throws shape_error for a count ≠ H, std::invalid_argument
/// for a value outside its range (see SdpaOptions).
template <class Scalar>
inline void validate_sdpa_options(const char* fn, const SdpaOptions<Scalar>& options, Index H) {
    if (!options.sinks.empty()) {
        if (static_cast<Index>(options.sinks.size()) != H)
            throw_shape(fn, "sinks", shape_string({H}), shape_string({static_cast<Index>(options.sinks.size())}));
        for (std::size_t h = 0; h < options.sinks.size(); ++h)
            if (std::isnan(options.sinks[h]) || options.sinks[h] == std::numeric_limits<Scalar>::infinity())
                throw_invalid(fn, "sinks[" + std::to_string(h) + "]",
                              "must be finite or -inf (no sink), got " + number_string(double(options.sinks[h])));
    }
    // Softcap and slopes: what the kernels compute with them stays finite in Scalar, in the
    // natural units of the float and double kernels and the base 2 of the 16-bit kernels.
    const std::string type = compute_type_name<Scalar>();
    if (options.logit_softcap) {
        const double c = double(static_cast<Scalar>(*options.logit_softcap));
        if (!(c >= softcap_min<Scalar>() && c <= softcap_max<Scalar>()))
            throw_invalid(fn, "logit_softcap",
                          "must be in [" + number_string(softcap_min<Scalar>()) + ", " +
                              number_string(softcap_max<Scalar>()) + "] (a normal " + type +
                              " whose product with log2(e) stays within half the largest " + type + "), got " +
                              number_string(*options.logit_softcap));
    }
    if (!options.alibi_slopes.empty()) {
        if (static_cast<Index>(options.alibi_slopes.size()) != H)
            throw_shape(fn, "alibi_slopes", shape_string({H}),
                        shape_string({static_cast<Index>(options.alibi_slopes.size())}));
        const double limit = alibi_slope_max<Scalar>();
        for (std::size_t h = 0; h < options.alibi_slopes.size(); ++h)
            if (!(std::abs(double(options.alibi_slopes[h])) <= limit))
                throw_invalid(fn, "alibi_slopes[" + std::to_string(h) + "]",
                              "must be in [-" + number_string(limit) + ", " + number_string(limit) +
                                  "] (the ALiBi term of any distance stays within half the largest " + type +
                                  "), got " + number_string(double(options.alibi_slopes[h])));
    }
    // The scale is applied in Scalar: it must be finite there, not only as a double.
    if (options.scale && !std::isfinite(static_cast<Scalar>(*options.scale)))
        throw_invalid(fn, "scale", "must be finite in " + type + ", got " + number_string(*options.scale));
}

/// Validates an SDPA call; throws shape_error / std::invalid_argument. Returns {d_k, d_v}.
template <class Scalar>
inline std::pair<Index, Index> validate_sdpa(const char* fn, Index q_rows, Index q_cols, Index k_rows, Index k_cols,
                                             Index v_rows, Index v_cols, const HeadLayout& heads,
                                             const SdpaOptions<Scalar>& options,
                                             const std::string& mask_prefix = "mask.") {
    const Index B = heads.batch, H = heads.num_heads, Hkv = heads.num_kv_heads;
    if (B < 0) throw_invalid(fn, "batch", "must be >= 0, got " + std::to_string(B));
    if (H < 1) throw_invalid(fn, "num_heads", "must be >= 1, got " + std::to_string(H));
    if (Hkv < 1 || H % Hkv != 0)
        throw_invalid(fn, "num_kv_heads",
                      "must be >= 1 and divide num_heads = " + std::to_string(H) + ", got " + std::to_string(Hkv));
    if (q_cols % H != 0 || q_cols == 0)
        throw_shape(fn, "query",
                    "[B*N_q, num_heads*head_dim] with num_heads = " + std::to_string(H) + " and head_dim >= 1",
                    shape_string({q_rows, q_cols}));
    const Index dk = q_cols / H;
    // "multiple of 0" would say nothing: a batch of no sequences has no rows.
    const auto rows_of = [B] { return B == 0 ? std::string("0 (batch 0)") : "multiple of " + std::to_string(B); };
    if (B == 0 ? q_rows != 0 : q_rows % B != 0)
        throw_shape(fn, "query", "[B*N_q, num_heads*head_dim] = [" + rows_of() + ", " + std::to_string(q_cols) + "]",
                    shape_string({q_rows, q_cols}));
    if (k_cols != Hkv * dk || (B == 0 ? k_rows != 0 : k_rows % B != 0))
        throw_shape(fn, "key", "[B*N_k, num_kv_heads*head_dim] = [" + rows_of() + ", " + std::to_string(Hkv * dk) + "]",
                    shape_string({k_rows, k_cols}));
    if (v_rows != k_rows || v_cols % Hkv != 0 || v_cols == 0)
        throw_shape(fn, "value",
                    "[" + std::to_string(k_rows) +
                        ", num_kv_heads*value_head_dim] with num_kv_heads = " + std::to_string(Hkv),
                    shape_string({v_rows, v_cols}));
    const Index dv = v_cols / Hkv;
    const Index Nq = B == 0 ? 0 : q_rows / B;
    const Index Nk = B == 0 ? 0 : k_rows / B;
    const auto& m = options.mask;
    if (m.sliding_window && *m.sliding_window < 1)
        throw_invalid(fn, mask_prefix + "sliding_window",
                      "must be >= 1 (it counts the diagonal), got " + std::to_string(*m.sliding_window));
    if (!m.key_lengths.empty()) {
        if (static_cast<Index>(m.key_lengths.size()) != B)
            throw_shape(fn, mask_prefix + "key_lengths", shape_string({B}),
                        shape_string({static_cast<Index>(m.key_lengths.size())}));
        for (std::size_t b = 0; b < m.key_lengths.size(); ++b)
            if (m.key_lengths[b] < 0 || m.key_lengths[b] > Nk)
                throw_invalid(fn, mask_prefix + "key_lengths[" + std::to_string(b) + "]",
                              "must be in [0, N_k = " + std::to_string(Nk) + "], got " +
                                  std::to_string(m.key_lengths[b]));
    }
    validate_sdpa_options(fn, options, H);
    if (!m.query_offsets.empty()) {
        if (static_cast<Index>(m.query_offsets.size()) != B)
            throw_shape(fn, mask_prefix + "query_offsets", shape_string({B}),
                        shape_string({static_cast<Index>(m.query_offsets.size())}));
        for (std::size_t b = 0; b < m.query_offsets.size(); ++b)
            if (m.query_offsets[b] < -Nq || m.query_offsets[b] > Nk)
                throw_invalid(fn, mask_prefix + "query_offsets[" + std::to_string(b) + "]",
                              "must be in [-N_q, N_k] = [" + std::to_string(-Nq) + ", " + std::to_string(Nk) +
                                  "], got " + std::to_string(m.query_offsets[b]));
    }
    if (!m.query_lengths.empty()) {
        if (static_cast<Index>(m.query_lengths.size()) != B)
            throw_shape(fn, mask_prefix + "query_lengths", shape_string({B}),
                        shape_string({static_cast<Index>(m.query_lengths.size())}));
        for (std::size_t b = 0; b < m.query_lengths.size(); ++b)
            if (m.query_lengths[b] < 0 || m.query_lengths[b] > Nq)
                throw_invalid(fn, mask_prefix + "query_lengths[" + std::to_string(b) + "]",
                              "must be in [0, N_q = " + std::to_string(Nq) + "], got " +
                                  std::to_string(m.query_lengths[b]));
    }
    auto check_view = [&](const auto& view, const std::string& name) {
        if (view.empty()) return;
        const bool ok = (view.batch == 1 || view.batch == B) && (view.heads == 1 || view.heads == H) &&
                        (view.query_len == 1 || view.query_len == Nq) && view.key_len == Nk;
        if (!ok)
            throw_shape(fn, name,
                        "[1|" + std::to_string(B) + ", 1|" + std::to_string(H) + ", 1|" + std::to_string(Nq) + ", " +
                            std::to_string(Nk) + "]",
                        shape_string({view.batch, view.heads, view.query_len, view.key_len}));
    };
    check_view(m.bool_mask, mask_prefix + "bool_mask");
    check_view(m.bias, mask_prefix + "bias");
    return {dk, dv};
}

/// True when [a, a + na) and [b, b + nb) (element ranges) overlap.
template <class T>
inline bool overlaps(const T* a, Index na, const T* b, Index nb) noexcept {
    if (na == 0 || nb == 0) return false;
    const auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
    return pa < pb + static_cast<std::uintptr_t>(nb) * sizeof(T) &&
           pb < pa + static_cast<std::uintptr_t>(na) * sizeof(T);
}

/// Elements of a mask view.
template <class T>
inline Index numel(const MaskView<T>& v) noexcept {
    return v.batch * v.heads * v.query_len * v.key_len;
}

/// True when a elements [a, a + na) and b elements [b, b + nb) of any two types share a byte.
template <class A, class B>
inline bool overlaps_any(const A* a, Index na, const B* b, Index nb) noexcept {
    return overlaps(reinterpret_cast<const char*>(a), na * Index(sizeof(A)), reinterpret_cast<const char*>(b),
                    nb * Index(sizeof(B)));
}

/// Memory span (in elements) of a strided row-major view.
template <class M>
inline Index span_of(const M& m) noexcept {
    return m.rows() == 0 ? 0 : (m.rows() - 1) * m.outerStride() + m.cols();
}

/// True when two row-major views share an element. Views with the same row stride (column
/// blocks of one matrix, say) are compared element by element; otherwise by their memory spans
/// (first to last element), which may report an overlap for interleaved views that share none.
/// Views of different element types (a float output of bf16 inputs) are compared by their spans.
template <class MA, class MB>
inline bool views_overlap(const MA& a, const MB& b) noexcept {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(a.data())>>;
    using TB = std::remove_cv_t<std::remove_pointer_t<decltype(b.data())>>;
    const Index na = span_of(a), nb = span_of(b);
    if constexpr (!std::is_same_v<T, TB>) {
        return overlaps_any(a.data(), na, b.data(), nb);
    } else {
        if (!overlaps(a.data(), na, static_cast<const T*>(b.data()), nb)) return false;
        const Index s = a.outerStride();
        const auto pa = reinterpret_cast<std::uintptr_t>(a.data()), pb = reinterpret_cast<std::uintptr_t>(b.data());
        if (s != b.outerStride() || s < a.cols() || s < b.cols() || (pa > pb ? pa - pb : pb - pa) % sizeof(T) != 0)
            return true;
        // Order the views so that b starts at or after a, δ = q·s + r elements later: b's row k is
        // a's row q + k from column r on, continuing into row q + k + 1 past column s.
        const bool swap = pb < pa;
        const Index ra = swap ? b.rows() : a.rows(), ca = swap ? b.cols() : a.cols();
        const Index rb = swap ? a.rows() : b.rows(), cb = swap ? a.cols() : b.cols();
        const Index delta = static_cast<Index>((swap ? pa - pb : pb - pa) / sizeof(T)), q = delta / s, r = delta % s;
        auto meet = [](Index lo1, Index hi1, Index lo2, Index hi2) { return lo1 < hi2 && lo2 < hi1; };
        if (meet(0, ra, q, q + rb) && meet(0, ca, r, std::min(s, r + cb))) return true;
        return r + cb > s && meet(0, ra, q + 1, q + 1 + rb) && meet(0, ca, 0, r + cb - s);
    }
}

/// True when m, an optional output that a call resizes (which frees its storage), holds an
/// element of the view v: writing v afterwards would write freed memory.
template <class S, class V>
inline bool resized_output_holds(const RowMatrix<S>* m, const V& v) noexcept {
    return m != nullptr && overlaps_any(m->data(), m->size(), v.data(), span_of(v));
}
/// The same for a mask (an additive bias): false when the mask is not given.
template <class S>
inline bool resized_output_holds(const RowMatrix<S>* m, const MaskView<S>& mask) noexcept {
    return m != nullptr && !mask.empty() && overlaps(m->data(), m->size(), mask.data, numel(mask));
}

}  // namespace detail

namespace detail {

/// T itself, in a context that template argument deduction does not look at.
template <class T>
struct identity {
    using type = T;
};
/// identity<T>::type.
template <class T>
using identity_t = typename identity<T>::type;

/// Prefill outputs of at least this many bytes are written with streaming stores
/// (simd::stream_store): their rows are not read for ownership before they are overwritten, and
/// they are not kept in cache. At 4 MiB the layer lost (N = 512, D = 2048: the output
/// projection read U from memory instead of L3: 2–3 % slower); at 8 MiB and more it gains.
inline constexpr Index kStreamOutputBytes = Index(8) << 20;

/// An output epilogue that does nothing.
struct NoEpilogue {
    template <class T>
    void operator()(Index, Index, T*) const noexcept {}
};

/// Where one sequence's keys and values lie for attention_tasks: the rows of its key 0 (all KV
/// heads), their int8 scales, and where key j's rows sit (consecutive, or in pages).
template <class KVElem>
struct SequenceRows {
    const KVElem* keys = nullptr;         ///< key 0's row
    const KVElem* values = nullptr;       ///< value 0's row
    const float* key_scales = nullptr;    ///< int8: key 0's scales, one per KV head
    const float* value_scales = nullptr;  ///< int8: value 0's scales
    kernel::PageMap map = {};             ///< key j's row: map.row(j) rows after key 0's page origin
};

/// Whether attention_tasks runs a sequence of `rows` ≥ 1 query rows, `group` query heads per KV
/// head, on the decoding kernel (keys in lanes) rather than the tiles: up to
/// FlashGeometry::kDecodePairs (head, query) pairs, or a token step (one query row, whose key
/// chunks give every thread work) of up to a quarter of a block. More pairs fill the lanes of
/// tiles with fewer query registers (FlashGeometry::kLiveRows).
template <class T>
inline bool runs_decoding(Index rows, Index group) noexcept {
    using Geometry = kernel::FlashGeometry<T>;
    const Index pairs = group * rows;
    return pairs <= Geometry::kDecodePairs || (rows == 1 && pairs <= Geometry::kQueries / 4);
}

/// The strides attention_tasks reads keys and values with, the same for every sequence. Key j
/// of KV head g lies at the sequence's key 0 + row(j)·key_stride + g·key_head_stride:
/// token-major rows (a head stride of d_k, d_v: every KV head of a token in one row) or
/// head-major ones (HeadMajorRows: a head stride of N_k rows).
struct KeyValueLayout {
    Index key_stride = 0;         ///< elements between key rows
    Index value_stride = 0;       ///< elements between value rows
    Index scale_stride = 0;       ///< int8: floats between the scale rows
    bool copies_blocks = false;   ///< prefill key blocks may straddle pages (copied into scratch)
    Index key_head_stride = 0;    ///< elements between KV head g's and g + 1's key 0
    Index value_head_stride = 0;  ///< elements between KV head g's and g + 1's value 0
};

/// The attention of B sequences' queries over their keys and values, checked by the caller:
/// the task split, the kernels and the merge of scaled_dot_product_attention and
/// paged_attention. Sequence b has query rows [q_begin[b], q_begin[b + 1]) (q_begin: B + 1
/// entries from 0; N_q may differ between sequences, whose masks are then given by causal
/// alignment, windows and offsets only) and lengths[b] keys found through sequence_rows(b) (a
/// SequenceRows); N_k is the mask's key axis. Each sequence decodes (few (head, query) pairs)
/// or runs the tile kernels, by its own shape: one call mixes both. lse and first_key, when
/// given, are already sized [q_begin[B], H] (first_key zeroed). epilogue as for
/// sdpa_with_epilogue_to.
template <class Scalar, class Out, class KVElem, class Epilogue, class Rows>
void attention_tasks(ConstMatrixRef<Scalar> query, MatrixRef<Out> out, const HeadLayout& heads, Index dk, Index dv,
                     const std::vector<Index>& q_begin, Index Nk, const std::vector<Index>& lengths,
                     const KeyValueLayout& kv, const Rows& sequence_rows, const SdpaOptions<compute_t<Scalar>>& options,
                     RowMatrix<compute_t<Scalar>>* lse, RowMatrix<compute_t<Scalar>>* first_key,
                     const Epilogue& epilogue) {
    using T = compute_t<Scalar>;
    constexpr bool kInt8 = std::is_same_v<KVElem, std::int8_t>;
    constexpr bool kNarrow = is_narrow_storage_v<Scalar>;
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    const Index B = heads.batch, H = heads.num_heads, Hkv = heads.num_kv_heads;
    const auto& mask = options.mask;
    const T scale = static_cast<T>(options.scale ? *options.scale : 1.0 / std::sqrt(double(dk)));
    const T softcap = options.logit_softcap ? static_cast<T>(*options.logit_softcap) : T(0);
    auto at = [](const std::vector<Index>& v, Index b) { return v[static_cast<std::size_t>(b)]; };
    auto query_count = [&](Index b) { return at(q_begin, b + 1) - at(q_begin, b); };
    // The (head, query) pairs of one KV head's GQA group share K and V. Many pairs: tiles with
    // queries in lanes (flash_kernel.hpp), tasks (sequence, KV head, block of Br pairs). Few
    // pairs (decoding): keys in lanes with the keys split into chunks (decode_kernel.hpp), tasks
    // (sequence, chunk) covering all KV heads. The choice depends on shapes only.
    using Geometry = kernel::FlashGeometry<T>;
    const Index group = H / Hkv;
    // A sequence with no query rows takes no task.
    auto decodes = [&](Index b) { return query_count(b) > 0 && runs_decoding<T>(query_count(b), group); };
    auto query_blocks = [&](Index b) { return (group * query_count(b) + Geometry::kQueries - 1) / Geometry::kQueries; };
    // Decoding tasks (sequence b, chunk c) are numbered chunk_begin[b] + c: chunks of
    // kChunkKeys of the sequence's L_b keys (a chunk past a shorter mask.key_lengths entry sees
    // no key and adds nothing to the merge).
    std::vector<Index> chunk_begin(static_cast<std::size_t>(B) + 1, 0);
    bool any_decode = false, any_prefill = false;
    Index decode_keys = 0;  // keys the decoding sequences read
    for (Index b = 0; b < B; ++b) {
        const bool d = decodes(b);
        (d ? any_decode : any_prefill) = true;
        if (d) decode_keys += at(lengths, b);
        chunk_begin[static_cast<std::size_t>(b) + 1] =
            at(chunk_begin, b) + (d ? (at(lengths, b) + kernel::kChunkKeys - 1) / kernel::kChunkKeys : 0);
    }
    // A prefill task runs up to kGroupBlocks query blocks of one KV head together (they share
    // each key block while it is in cache), as long as their tiles fit group_bytes() and that
    // leaves 4 tasks per thread. Each query block's arithmetic is the same in any grouping, so
    // this changes no result (nor does the cache size it reads).
    Index per_task = 1;
    if (any_prefill) {
#ifdef _OPENMP
        const Index threads = omp_get_max_threads();
#else
        const Index threads = 1;
#endif
        auto grouped_tasks = [&](Index n) {
            Index t = 0;
            for (Index b = 0; b < B; ++b)
                if (!decodes(b)) t += Hkv * ((query_blocks(b) + n - 1) / n);
            return t;
        };
        const Index block_bytes = Geometry::kQueries * (dk + dv) * Index(sizeof(T));
        while (per_task * 2 <= Geometry::kGroupBlocks && per_task * 2 * block_bytes <= Geometry::group_bytes() &&
               grouped_tasks(per_task * 2) >= 4 * threads)
            per_task *= 2;
    }
    // Tile tasks (sequence b, KV head, group of per_task query blocks) first, numbered from
    // tile_begin[b]; then the decoding tasks, each over all KV heads of a sequence's chunk.
    std::vector<Index> tile_begin(static_cast<std::size_t>(B) + 1, 0);
    for (Index b = 0; b < B; ++b)
        tile_begin[static_cast<std::size_t>(b) + 1] =
            at(tile_begin, b) + (decodes(b) ? 0 : Hkv * ((query_blocks(b) + per_task - 1) / per_task));
    const Index tile_tasks = at(tile_begin, B);
    const Index tasks = tile_tasks + at(chunk_begin, B);
    const Index total_rows = at(q_begin, B);
    const Index ldq = query.outerStride(), ldo = out.outerStride();
    // A large output is written with streaming stores: reading each line of the output rows for
    // ownership before overwriting it cost 4 % of a call at N = 2048, d = 128, 8 heads. With an
    // epilogue a block's outputs are staged in cache, the epilogue runs there, and the rows are
    // then streamed out.
    constexpr bool kHasEpilogue = !std::is_same_v<Epilogue, NoEpilogue>;
    const bool stream_outputs = !kNarrow && total_rows * H * dv * Index(sizeof(Scalar)) >= kStreamOutputBytes;
    const auto writes = !stream_outputs ? kernel::OutputWrites::Direct
                        : kHasEpilogue  ? kernel::OutputWrites::Staged
                                        : kernel::OutputWrites::Streaming;
    // Fills the block description of pairs [t0, t0 + count) of KV head g in sequence b.
    // Pair p of KV head g in sequence b is query i = p mod N_q of head g·(H / H_kv) + ⌊p / N_q⌋.
    auto pair_head = [&](Index b, Index g, Index pair) { return g * group + pair / query_count(b); };
    auto pair_row = [&](Index b, Index pair) { return at(q_begin, b) + pair % query_count(b); };
    auto describe_block = [&](kernel::FlashBlock<T, Scalar, Out>& blk, Index b, Index g, Index t0) {
        const Index Nq = query_count(b);
        blk.count = static_cast<int>(std::min<Index>(Geometry::kQueries, group * Nq - t0));
        blk.softcap = softcap;
        for (int t = 0; t < blk.count; ++t) {
            const Index pair = t0 + t, h = pair_head(b, g, pair), i = pair % Nq;
            const Index row = pair_row(b, pair);
            const auto range = gattn::detail::visible_key_range(mask, b, i, Nq, Nk);
            blk.q[t] = query.data() + row * ldq + h * dk;
            blk.out[t] = out.data() + row * ldo + h * dv;
            blk.begin[t] = range.begin;
            blk.end[t] = range.end;
            blk.bool_row[t] = mask.bool_mask.empty() ? nullptr : mask.bool_mask.row(b, h, i);
            blk.bias_row[t] = mask.bias.empty() ? nullptr : mask.bias.row(b, h, i);
            blk.lse[t] = lse ? &(*lse)(row, h) : nullptr;
            blk.sink[t] = options.sinks.empty() ? kNegInf : options.sinks[h];
            blk.position[t] = gattn::detail::aligned_position(mask, b, i, Nq, Nk);
            blk.alibi_slope[t] = options.alibi_slopes.empty() ? T(0) : options.alibi_slopes[h];
            blk.first_key[t] = first_key ? &(*first_key)(row, h) : nullptr;
        }
    };
    // The epilogue of pairs [t0, t0 + count) of KV head g in sequence b, whose outputs are at rows.
    auto finish_block = [&](int count, auto* const* rows, Index b, Index g, Index t0) {
        for (int t = 0; t < count; ++t) epilogue(pair_row(b, t0 + t), pair_head(b, g, t0 + t), rows[t]);
    };
    // Decoding a cache that does not fit in cache reads ahead with loads (decode_chunk).
    const bool decode_from_memory = decode_keys * Hkv * (dk + dv) * Index(sizeof(KVElem)) >
                                    kernel::kDecodeFromMemoryBytes;
    // int8: the scales of sequence b's first key and value row, KV head g.
    auto int8_scales = [&]([[maybe_unused]] const SequenceRows<KVElem>& r, [[maybe_unused]] Index g) {
        kernel::Int8Scales sc;
        if constexpr (kInt8) sc = {r.key_scales + g, r.value_scales + g, kv.scale_stride};
        return sc;
    };
    // The KV heads one decode_chunk call walks: all of them when a token's heads share a row.
    const Index heads_per_call = kv.key_head_stride == dk && kv.value_head_stride == dv ? Hkv : 1;
    // Decoding: one state per (sequence, chunk, KV head), merged per (sequence, KV head).
    std::vector<kernel::PartialState<T>> partial(static_cast<std::size_t>(at(chunk_begin, B) * Hkv));
    // 16-bit storage: the kernel family, chosen once per call (bf16_kernel() says why), for
    // decoding and the prefill tiles alike.
    const Bf16Kernel bf16_family = std::is_same_v<Scalar, bfloat16> ? gattn::detail::bf16_kernel_family()
                                                                    : Bf16Kernel::WidenedFloat;
    // An int8 cache's decoding kernel, chosen once per call (int8_kernel() says why).
    [[maybe_unused]] const Int8Kernel int8_family = kInt8 ? gattn::detail::int8_kernel_family() : Int8Kernel::Vnni;
    // Decoding a bf16 cache with VDPBF16PS (head sizes multiples of 32; also under AMX, whose
    // 16-row tiles would sit mostly idle on a decoding step's few queries) or BFDOT (ARM64, head
    // sizes multiples of 8); else widened.
    [[maybe_unused]] const bool decode_dot =
        (simd::avx512bf16::kEnabled && bf16_family != Bf16Kernel::WidenedFloat && kernel::decode_bf16::takes(dk, dv)) ||
        (simd::neon_bf16::kEnabled && bf16_family == Bf16Kernel::Bfdot && kernel::decode_bfdot::takes(dk, dv));
    // A float cache on ARM64 with SVE vectors wider than NEON's: both products in SVE
    // (instruction_sets().unused says why not).
    const bool decode_sve = simd::sve::kEnabled && std::is_same_v<KVElem, float> && std::is_same_v<T, float> &&
                            gattn::detail::sve_float_decoding();
#ifdef _OPENMP
#pragma omp parallel if (tasks > 1 && total_rows * H * Nk * (dk + dv) > (Index(1) << 18))
#endif
    {
        // The thread's scratch: the float kernel's, or the 16-bit kernels' (which also hold the
        // float copies of decoding blocks).
        auto& scratch = []() -> auto& {
            if constexpr (kNarrow)
                return kernel::NarrowScratch<Scalar, Out>::for_this_thread();
            else
                return kernel::FlashScratch<Scalar>::for_this_thread();
        }
        ();
        // (Reservations only grow the buffers: a call with both kinds of task makes room for both.)
        if constexpr (kNarrow) {
            if (any_decode) scratch.reserve_decode(dk, dv, Hkv);
            if (any_prefill)
                scratch.reserve(dk, dv, static_cast<int>(per_task), bf16_family != Bf16Kernel::WidenedFloat);
        } else {
            if (any_decode) scratch.reserve_blocks(Hkv);
            if (any_prefill)
                scratch.reserve(dk, dv, static_cast<int>(per_task), kv.value_stride,
                                writes == kernel::OutputWrites::Staged, kInt8 || kv.copies_blocks);
        }
        // Prefill: a task's query blocks. Decoding: a chunk's KV heads, later the block of a merge.
        kernel::FlashBlock<T, Scalar, Out>* const blk = scratch.blocks.data();
        // Decoding runs on float blocks: for 16-bit storage, copies of blk with float queries
        // whose outputs are staged in float (then rounded); otherwise blk itself.
        kernel::FlashBlock<T>* const decode_blk = [&] {
            if constexpr (kNarrow)
                return scratch.wide.data();
            else
                return blk;
        }();
        T* stage_rows[Geometry::kQueries] = {};
        if constexpr (kNarrow)
            for (int t = 0; t < Geometry::kQueries; ++t) stage_rows[t] = scratch.stage.data() + t * dv;
        auto to_decode_block = [&](Index g) {
            if constexpr (kNarrow)
                kernel::widen_block(blk[g], decode_blk[g], scratch.q_rows.data() + g * Geometry::kQueries * dk, dk,
                                    stage_rows);
        };
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (Index task = 0; task < tasks; ++task) {
            if (task >= tile_tasks) {
                const Index chunk_task = task - tile_tasks;
                const Index b = static_cast<Index>(
                    std::upper_bound(chunk_begin.begin(), chunk_begin.end(), chunk_task) - chunk_begin.begin() - 1);
                const Index chunk = chunk_task - at(chunk_begin, b);
                const SequenceRows<KVElem> r = sequence_rows(b);
                kernel::PartialState<T>* states = partial.data() + chunk_task * Hkv;
                for (Index g = 0; g < Hkv; ++g) {
                    describe_block(blk[g], b, g, 0);
                    to_decode_block(g);
                    states[g].reset(blk[g].count, dv);
                }
                const Index c0 = chunk * kernel::kChunkKeys,
                            c1 = std::min(lengths[static_cast<std::size_t>(b)], c0 + kernel::kChunkKeys);
                // Token-major rows: one call walks every KV head inside each key block, reading
                // the rows in address order. Head-major: one call per KV head, each reading its
                // own rows back to back.
                for (Index g0 = 0; g0 < Hkv; g0 += heads_per_call) {
                    const KVElem* keys = r.keys + g0 * kv.key_head_stride;
                    const KVElem* values = r.values + g0 * kv.value_head_stride;
                    if constexpr ((simd::avx512bf16::kEnabled || simd::neon_bf16::kEnabled) &&
                                  std::is_same_v<Scalar, bfloat16>) {
                        if (decode_dot) {
                            // The bf16 query rows as given: VDPBF16PS or BFDOT on them and the cache rows.
                            const Scalar** q16 = scratch.q_ptrs.data();
                            for (Index g = g0; g < g0 + heads_per_call; ++g)
                                for (int t = 0; t < blk[g].count; ++t) q16[g * Geometry::kQueries + t] = blk[g].q[t];
                            kernel::decode_chunk<T, Scalar, true>(decode_blk + g0, states + g0, heads_per_call, c0, c1,
                                                                  keys, kv.key_stride, values, kv.value_stride, dk, dv,
                                                                  scale, decode_from_memory,
                                                                  q16 + g0 * Geometry::kQueries, {}, Int8Kernel::Vnni,
                                                                  r.map);
                            continue;
                        }
                    }
                    kernel::decode_chunk<T, KVElem>(decode_blk + g0, states + g0, heads_per_call, c0, c1, keys,
                                                    kv.key_stride, values, kv.value_stride, dk, dv, scale,
                                                    decode_from_memory, nullptr, int8_scales(r, g0), int8_family, r.map,
                                                    decode_sve);
                }
            } else {
                // A KV head's last query blocks first: under a causal mask they see the most
                // keys, and starting the longest tasks first balances the threads.
                const Index b = static_cast<Index>(std::upper_bound(tile_begin.begin(), tile_begin.end(), task) -
                                                   tile_begin.begin() - 1);
                const Index blocks = query_blocks(b), block_tasks = (blocks + per_task - 1) / per_task;
                const Index local = task - at(tile_begin, b);
                const Index first = (block_tasks - 1 - local % block_tasks) * per_task, g = local / block_tasks;
                const int count = static_cast<int>(std::min(per_task, blocks - first));
                for (int i = 0; i < count; ++i) describe_block(blk[i], b, g, (first + i) * Geometry::kQueries);
                // Each block's epilogue, on its rows (staged: before they go to the output rows).
                auto on_block = [&](int i, T* const* rows) {
                    finish_block(blk[i].count, rows, b, g, (first + i) * Geometry::kQueries);
                };
                const SequenceRows<KVElem> r = sequence_rows(b);
                const KVElem* keys = r.keys + g * kv.key_head_stride;
                const KVElem* values = r.values + g * kv.value_head_stride;
                if constexpr (kNarrow)
                    kernel::narrow_attention_blocks(bf16_family, blk, count, keys, kv.key_stride, values,
                                                    kv.value_stride, dk, dv, scale, scratch, on_block, r.map);
                else
                    kernel::flash_attention_blocks<Scalar>(blk, count, keys, kv.key_stride, values, kv.value_stride, dk,
                                                           dv, scale, scratch, writes, on_block, int8_scales(r, g),
                                                           r.map);
            }
        }
        if (any_decode) {
            // Merge each decoding (sequence, KV head)'s chunks in order (after the implicit barrier).
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (Index bg = 0; bg < B * Hkv; ++bg) {
                const Index b = bg / Hkv, g = bg % Hkv;
                if (!decodes(b)) continue;
                describe_block(blk[0], b, g, 0);
                to_decode_block(0);
                // State of (b, chunk c, g) sits at (chunk_begin[b] + c)·H_kv + g.
                const Index first = chunk_begin[static_cast<std::size_t>(b)],
                            chunks = chunk_begin[static_cast<std::size_t>(b) + 1] - first;  // 0: no keys
                kernel::decode_finish<T>(decode_blk[0], chunks > 0 ? partial.data() + first * Hkv + g : nullptr, Hkv,
                                         chunks, dv);
                finish_block(blk[0].count, decode_blk[0].out, b, g, 0);
                if constexpr (kNarrow)
                    for (int t = 0; t < blk[0].count; ++t) kernel::narrow_row(stage_rows[t], blk[0].out[t], dv);
            }
        }
    }
}

/// Whether the head counts and query columns are ones validate_sdpa accepts. The head-major
/// checks below leave the others to it, so that it names them first.
inline bool head_layout_accepted(Index query_cols, const HeadLayout& heads) noexcept {
    const Index H = heads.num_heads, Hkv = heads.num_kv_heads;
    return heads.batch >= 0 && H >= 1 && Hkv >= 1 && H % Hkv == 0 && query_cols % H == 0 && query_cols > 0;
}

/// Checks head-major keys of `rows` × `cols` against the query's columns and the head layout,
/// throwing shape_error; returns the B·N_k token rows they hold.
inline Index head_major_key_rows(const char* fn, Index rows, Index cols, Index query_cols, const HeadLayout& heads) {
    if (!head_layout_accepted(query_cols, heads)) return rows;
    const Index B = heads.batch, Hkv = heads.num_kv_heads, dk = query_cols / heads.num_heads;
    // rows a multiple of B·H_kv, without forming B·H_kv (which may overflow).
    if (cols != dk || (B == 0 ? rows != 0 : rows % B != 0 || (rows / B) % Hkv != 0)) {
        const bool fits = B == 0 || Hkv <= std::numeric_limits<Index>::max() / B;
        const std::string multiple = fits ? std::to_string(B * Hkv) : std::to_string(B) + "*" + std::to_string(Hkv);
        throw_shape(fn, "key",
                    "head-major [B*num_kv_heads*N_k, head_dim] = [" +
                        (B == 0 ? std::string("0 (batch 0)") : "multiple of " + multiple) + ", " + std::to_string(dk) +
                        "]",
                    shape_string({rows, cols}));
    }
    return rows / Hkv;
}

/// Checks head-major values of `rows` × `cols`: the keys' `key_rows` rows, at least one column
/// (throws shape_error); returns the B·N_k token rows they hold.
inline Index head_major_value_rows(const char* fn, Index rows, Index cols, Index key_rows, Index query_cols,
                                   const HeadLayout& heads) {
    if (!head_layout_accepted(query_cols, heads)) return rows;
    if (rows != key_rows || cols < 1)
        throw_shape(fn, "value", "head-major [" + std::to_string(key_rows) + ", value_head_dim >= 1]",
                    shape_string({rows, cols}));
    return rows / heads.num_kv_heads;
}

/// Query row i of sequence b, head h's logits as the kernels form them, for the passes that
/// recompute them one key at a time (the probabilities and logits outputs, the backward's
/// log-sum-exp fixes): key j is hidden by a false boolean mask entry or a −∞ bias; a visible
/// key's logit is softcap(x) for x = q·k_j·scale, minus slope·|position − j| (ALiBi), plus the
/// bias, in that order (docs/conventions.md, "Masks").
template <class T>
struct RowLogits {
    const bool* bool_row;  // null: no boolean mask
    const T* bias_row;     // null: no bias
    T softcap, inv_cap, slope;
    Index position;  // the query's position on the key axis (ALiBi's distance)

    RowLogits(const AttentionMask<T>& mask, const SdpaOptions<T>& options, T cap, Index b, Index h, Index i, Index Nq,
              Index Nk)
        : bool_row(mask.bool_mask.empty() ? nullptr : mask.bool_mask.row(b, h, i)),
          bias_row(mask.bias.empty() ? nullptr : mask.bias.row(b, h, i)),
          softcap(cap),
          inv_cap(cap > T(0) ? T(1) / cap : T(0)),
          slope(options.alibi_slopes.empty() ? T(0) : options.alibi_slopes[h]),
          position(aligned_position(mask, b, i, Nq, Nk)) {}

    bool hidden(Index j) const noexcept {
        return (bool_row && !bool_row[j]) || (bias_row && bias_row[j] == -std::numeric_limits<T>::infinity());
    }
    /// softcap(x), or x without a softcap.
    T capped(T x) const noexcept { return softcap > T(0) ? simd::softcap_scalar<T>(x, softcap, inv_cap) : x; }
    /// Key j's logit from x = q·k_j·scale.
    T operator()(T x, Index j) const noexcept {
        x = capped(x);
        if (slope != T(0)) x = std::fma(-slope, static_cast<T>(position > j ? position - j : j - position), x);
        if (bias_row) x += bias_row[j];
        return x;
    }
};

/// scaled_dot_product_attention (same arguments, shapes and exceptions, all thrown before
/// anything is written), then epilogue(row, head, y) once for every row in [0, B·N_q) and head
/// in [0, H), y pointing at that row's d_v outputs of that head, as soon as they are final and
/// while they are in cache (the layer's G1 gate is applied this way). y may point at a staging
/// copy that is written to `out` after the epilogue (large outputs, see kStreamOutputBytes).
/// The epilogue runs on the OpenMP threads: it must not throw, may modify only y's d_v values
/// (and must not read `out`), must give the same result on any thread, and must not call SDPA
/// (the thread's kernel scratch is in use).
/// With 16-bit storage (bf16, fp16) the epilogue gets each row in float before it is rounded,
/// and the output may be float (Out) instead of the storage type.
/// KV: what keys and values are read from: ConstMatrixRef<Scalar>, or Int8Rows (int8 codes and
/// their scales, ops/int8_rows.hpp) with float queries.
template <class Scalar, class Out, class Epilogue, class KV = ConstMatrixRef<Scalar>>
void sdpa_with_epilogue_to(ConstMatrixRef<Scalar> query, const identity_t<KV>& key, const identity_t<KV>& value,
                           const HeadLayout& heads, MatrixRef<Out> out, const SdpaOptions<compute_t<Scalar>>& options,
                           const SdpaOutputs<compute_t<Scalar>>& extra, const Epilogue& epilogue) {
    static_assert(is_supported_storage_v<Scalar>, "GATTN_SCALAR_MUST_BE_FLOAT_DOUBLE_BFLOAT16_OR_HALF");
    using T = compute_t<Scalar>;
    constexpr bool kInt8 = std::is_same_v<KV, Int8Rows>;
    constexpr bool kHeadMajor = std::is_same_v<KV, HeadMajorRows<Scalar>>;
    static_assert(kInt8 || kHeadMajor || std::is_same_v<KV, ConstMatrixRef<Scalar>>,
                  "keys and values: a matrix, HeadMajorRows or Int8Rows");
    static_assert(!kInt8 || std::is_same_v<Scalar, float>, "int8 keys and values take float queries");
    using KVElem = std::conditional_t<kInt8, std::int8_t, Scalar>;  // what K and V rows hold
    static_assert(std::is_same_v<Out, Scalar> || (is_narrow_storage_v<Scalar> && std::is_same_v<Out, T>),
                  "GATTN_OUTPUT_MUST_BE_THE_INPUT_TYPE_OR_FLOAT_FOR_16_BIT_INPUTS");
    constexpr bool kNarrow = is_narrow_storage_v<Scalar>;
    constexpr const char* fn = "gattn::scaled_dot_product_attention";
    // Head-major keys and values: their shapes checked here, then the rest as for the
    // token-major [B·N_k, H_kv·d] rows they hold.
    Index key_rows = key.rows(), key_cols = key.cols(), value_rows = value.rows(), value_cols = value.cols();
    if constexpr (kHeadMajor) {
        key_rows = gattn::detail::head_major_key_rows(fn, key.rows(), key.cols(), query.cols(), heads);
        value_rows =
            gattn::detail::head_major_value_rows(fn, value.rows(), value.cols(), key.rows(), query.cols(), heads);
        key_cols *= heads.num_kv_heads;
        value_cols *= heads.num_kv_heads;
    }
    // Plain variables, not a structured binding: C++17 lambdas cannot capture those.
    const auto head_dims = gattn::detail::validate_sdpa<T>(fn, query.rows(), query.cols(), key_rows, key_cols,
                                                           value_rows, value_cols, heads, options);
    const Index dk = head_dims.first, dv = head_dims.second;
    const Index B = heads.batch, H = heads.num_heads, Hkv = heads.num_kv_heads;
    const Index Nq = B == 0 ? 0 : query.rows() / B;
    const Index Nk = B == 0 ? 0 : key_rows / B;
    if constexpr (kInt8)
        for (const auto& [rows, name] : {std::pair<const Int8Rows*, const char*>{&key, "key"}, {&value, "value"}})
            if (rows->rows() > 0 && (!rows->scales || rows->scale_stride < Hkv))
                gattn::detail::throw_invalid(fn, std::string(name) + ".scales",
                                             "must hold H_kv = " + std::to_string(Hkv) + " scales per row, got " +
                                                 (rows->scales ? "a row stride of " + std::to_string(rows->scale_stride)
                                                               : std::string("none")));
    gattn::detail::check_output(fn, "out", out, B * Nq, H * dv);
    const Index out_span = gattn::detail::span_of(out);
    if (gattn::detail::views_overlap(out, query) || gattn::detail::views_overlap(out, key) ||
        gattn::detail::views_overlap(out, value))
        gattn::detail::throw_invalid(fn, "out", "must not share an element with query, key or value");
    const auto& mask = options.mask;
    if (!mask.bias.empty() &&
        gattn::detail::overlaps_any(out.data(), out_span, mask.bias.data, gattn::detail::numel(mask.bias)))
        gattn::detail::throw_invalid(fn, "out", "must not overlap mask.bias");
    // Optional outputs are resized, which frees their storage: they must not be, or hold, an input.
    const RowMatrix<T>* extras[] = {extra.log_sum_exp, extra.probabilities, extra.first_key_probability, extra.logits};
    const char* extra_names[] = {"extra.log_sum_exp", "extra.probabilities", "extra.first_key_probability",
                                 "extra.logits"};
    for (int a = 0; a < 4; ++a) {
        const RowMatrix<T>* e = extras[a];
        if (!e) continue;
        for (int b2 = a + 1; b2 < 4; ++b2)
            if (extras[b2] == e)
                gattn::detail::throw_invalid(fn, extra_names[a], std::string("must not be ") + extra_names[b2]);
        using gattn::detail::resized_output_holds;
        if (resized_output_holds(e, query) || resized_output_holds(e, key) || resized_output_holds(e, value) ||
            resized_output_holds(e, out) || resized_output_holds(e, mask.bias))
            gattn::detail::throw_invalid(fn, extra_names[a], "must not hold query, key, value, out or mask.bias");
    }

    if (extra.logits && extra.logits_stage != LogitStage::Scaled && extra.logits_stage != LogitStage::Softcapped &&
        extra.logits_stage != LogitStage::Final)
        gattn::detail::throw_invalid(fn, "extra.logits_stage", "must be Scaled, Softcapped or Final");

    const T scale = static_cast<T>(options.scale ? *options.scale : 1.0 / std::sqrt(double(dk)));
    const T softcap = options.logit_softcap ? static_cast<T>(*options.logit_softcap) : T(0);
    if (extra.log_sum_exp) extra.log_sum_exp->resize(B * Nq, H);
    if (extra.probabilities) extra.probabilities->setZero(B * H * Nq, Nk);
    if (extra.first_key_probability) extra.first_key_probability->setZero(B * Nq, H);
    if (extra.logits) extra.logits->resize(B * H * Nq, Nk);

    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    if (B * Nq == 0) return;
    if (Nk == 0) {  // no keys: every row is fully masked
        for (Index r = 0; r < out.rows(); ++r) out.row(r).setZero();
        if (extra.log_sum_exp)
            for (Index h = 0; h < H; ++h)
                extra.log_sum_exp->col(h).setConstant(options.sinks.empty() ? kNegInf : options.sinks[h]);
        std::vector<T> zeros(kNarrow ? static_cast<std::size_t>(dv) : 0);
        for (Index r = 0; r < out.rows(); ++r)
            for (Index h = 0; h < H; ++h) {
                Out* y = out.data() + r * out.outerStride() + h * dv;
                if constexpr (kNarrow) {
                    std::fill(zeros.begin(), zeros.end(), T(0));
                    epilogue(r, h, zeros.data());
                    kernel::narrow_row(zeros.data(), y, dv);
                } else {
                    epilogue(r, h, y);
                }
            }
        return;
    }
    // Probabilities are derived from the log-sum-exp, so they need it even when not requested.
    RowMatrix<T> lse_scratch;
    RowMatrix<T>* lse = extra.log_sum_exp;
    if (extra.probabilities && !lse) {
        lse_scratch.resize(B * Nq, H);
        lse = &lse_scratch;
    }

    // Every sequence has N_q queries and N_k keys (the mask's lengths may show fewer).
    const std::vector<Index> lengths(static_cast<std::size_t>(B), Nk);
    std::vector<Index> q_begin(static_cast<std::size_t>(B) + 1);
    for (Index b = 0; b <= B; ++b) q_begin[static_cast<std::size_t>(b)] = b * Nq;
    // Token-major: a KV head is d columns further along the row; head-major: N_k rows further,
    // and sequence b starts H_kv·N_k rows after the last.
    KeyValueLayout kv{key.outerStride(), value.outerStride(), 0, false, dk, dv};
    if constexpr (kHeadMajor) {
        kv.key_head_stride = Nk * key.outerStride();
        kv.value_head_stride = Nk * value.outerStride();
    }
    if constexpr (kInt8) {
        GATTN_DEBUG_ASSERT(key.scale_stride == value.scale_stride);
        kv.scale_stride = key.scale_stride;
    }
    auto rows = [&](Index b) {
        const Index first = kHeadMajor ? b * Hkv * Nk : b * Nk;  // sequence b's first row
        SequenceRows<KVElem> r{key.data() + first * key.outerStride(), value.data() + first * value.outerStride()};
        if constexpr (kInt8) {
            r.key_scales = key.scales + b * Nk * key.scale_stride;
            r.value_scales = value.scales + b * Nk * value.scale_stride;
        }
        return r;
    };
    attention_tasks<Scalar, Out, KVElem>(query, out, heads, dk, dv, q_begin, Nk, lengths, kv, rows, options, lse,
                                         extra.first_key_probability, epilogue);

    if (!extra.probabilities && !extra.logits) return;
    // Analysis outputs, recomputed row by row; probabilities in three passes (max, sum,
    // normalise) so that they are exact even when every visible logit is huge (the log-sum-exp
    // alone would lose log n).
    std::vector<T> logits(static_cast<std::size_t>(Nk));
    std::vector<T> q_wide(kNarrow ? static_cast<std::size_t>(dk) : 0), k_wide(kNarrow || kInt8 ? dk : 0);
    // Decoding an int8 cache with integer logits: the query as the kernel took it (16-bit codes
    // and residual codes), so that the probabilities agree with the output and log-sum-exp.
    // (decoding and the kernel family as attention_tasks chose them; SDOT: the codes' two bytes
    // each, in the same space.)
    const Index group = H / Hkv, ldq = query.outerStride();
    const bool decode = runs_decoding<T>(Nq, group);
    const Int8Kernel int8_family = kInt8 ? gattn::detail::int8_kernel_family() : Int8Kernel::Vnni;
    const bool rounded_query =
        kInt8 && decode &&
        ((((simd::avx512vnni::kEnabled && int8_family == Int8Kernel::Vnni) ||
           (simd::avxvnni::kEnabled && int8_family == Int8Kernel::AvxVnni)) &&
          kernel::decode_int8::takes(dk)) ||
         (simd::neon_dotprod::kEnabled && int8_family == Int8Kernel::Sdot && kernel::decode_sdot::takes(dk)));
    std::vector<std::int16_t> q_codes(rounded_query ? 2 * static_cast<std::size_t>(dk) : 0);
    std::vector<float> q_rounded(rounded_query ? static_cast<std::size_t>(dk) : 0);
    // q·k for key row j of sequence b, KV head g.
    auto dot = [&](const Scalar* a, Index b, Index j, Index g) -> T {
        const SequenceRows<KVElem> r = rows(b);  // addressed as the kernels address it
        const KVElem* b2 = r.keys + g * kv.key_head_stride + j * key.outerStride();
        if constexpr (kNarrow) {
            kernel::widen_row(a, q_wide.data(), dk);
            kernel::widen_row(b2, k_wide.data(), dk);
            return simd::dot(q_wide.data(), k_wide.data(), static_cast<std::size_t>(dk));
        } else if constexpr (kInt8) {
            dequantize_int8_row(b2, r.key_scales[j * key.scale_stride + g], k_wide.data(), dk);
            return simd::dot(a, k_wide.data(), static_cast<std::size_t>(dk));
        } else {
            return simd::dot(a, b2, static_cast<std::size_t>(dk));
        }
    };
    const LogitStage stage = extra.logits_stage;
    for (Index b = 0; b < B; ++b)
        for (Index h = 0; h < H; ++h)
            for (Index i = 0; i < Nq; ++i) {
                const Scalar* q = query.data() + (b * Nq + i) * ldq + h * dk;
                if constexpr (kInt8)
                    if (rounded_query) {
                        std::int16_t *codes = q_codes.data(), *residual = codes + dk;
                        const auto qs = kernel::quantize_query_for(int8_family, q, dk, codes, residual);
                        kernel::dequantize_query_for(int8_family, codes, residual, qs, dk, q_rounded.data());
                        q = q_rounded.data();
                    }
                const Index g = h / group;
                const Index prow = (b * H + h) * Nq + i;
                const RowLogits<T> row(mask, options, softcap, b, h, i, Nq, Nk);
                T* lg = extra.logits ? extra.logits->data() + prow * Nk : nullptr;
                if (lg && stage != LogitStage::Final)
                    for (Index j = 0; j < Nk; ++j) {
                        const T x = dot(q, b, j, g) * scale;
                        lg[j] = stage == LogitStage::Softcapped ? row.capped(x) : x;
                    }
                if (lg && stage == LogitStage::Final) std::fill(lg, lg + Nk, kNegInf);
                const bool probabilities = extra.probabilities && (*lse)(b * Nq + i, h) != kNegInf;
                if (!probabilities && !(lg && stage == LogitStage::Final)) continue;
                const auto range = gattn::detail::visible_key_range(mask, b, i, Nq, Nk);
                const T sink = options.sinks.empty() ? kNegInf : options.sinks[h];  // in the sum, no value
                T m = sink;
                for (Index j = range.begin; j < range.end; ++j) {
                    logits[j] = kNegInf;
                    if (row.hidden(j)) continue;
                    logits[j] = row(dot(q, b, j, g) * scale, j);
                    m = std::max(m, logits[j]);
                }
                if (lg && stage == LogitStage::Final)
                    std::copy(logits.begin() + range.begin, logits.begin() + range.end, lg + range.begin);
                if (!probabilities) continue;
                T* p = extra.probabilities->data() + prow * Nk;
                T l = sink == kNegInf ? T(0) : simd::exp_scalar<T>(sink - m);
                for (Index j = range.begin; j < range.end; ++j)
                    if (logits[j] != kNegInf) l += (p[j] = simd::exp_scalar<T>(logits[j] - m));
                for (Index j = range.begin; j < range.end; ++j)
                    if (logits[j] != kNegInf) p[j] /= l;
            }
}

/// sdpa_with_epilogue_to with the output in the input's type.
template <class Scalar, class Epilogue>
void sdpa_with_epilogue(ConstMatrixRef<Scalar> query, ConstMatrixRef<Scalar> key, ConstMatrixRef<Scalar> value,
                        const HeadLayout& heads, MatrixRef<Scalar> out, const SdpaOptions<compute_t<Scalar>>& options,
                        const SdpaOutputs<compute_t<Scalar>>& extra, const Epilogue& epilogue) {
    sdpa_with_epilogue_to<Scalar, Scalar>(query, key, value, heads, out, options, extra, epilogue);
}

}  // namespace detail

/// Scaled dot-product attention with GQA/MQA, masks and optional log-sum-exp.
///
/// \param query  [B·N_q, H·d_k] row-major, any row stride.
/// \param key    [B·N_k, H_kv·d_k].
/// \param value  [B·N_k, H_kv·d_v] (d_v may differ from d_k).
/// \param heads  batch B, H and H_kv (H_kv divides H).
/// \param out    [B·N_q, H·d_v], written; must share no element with query, key or value
///               (column blocks of one matrix are fine).
/// \param options scale (default 1/√d_k) and masks (ops/mask.hpp).
/// \param extra  optional log-sum-exp, probabilities, first-key probability.
/// \throws shape_error when a shape disagrees with the others (message names the argument,
///         the expected and the actual shape); std::invalid_argument for a negative batch, bad
///         head counts, key lengths outside [0, N_k] or query lengths outside [0, N_q], a
///         window < 1, a scale not finite in Scalar, a sink that is NaN or +∞, a softcap or an
///         ALiBi slope outside its range (SdpaOptions), out sharing an element with an input or
///         the bias or with rows that overlap (row stride < H·d_v), or optional outputs that are
///         or hold an input or are one another. Nothing is written before validation passes.
/// Scalar: float, double, or 16-bit storage (gattn::bfloat16, gattn::half) whose options and
/// optional outputs are float and whose output (Out) is the storage type or float; 16-bit inputs
/// run the kernels of ops/bf16_flash_kernel.hpp (gattn::bf16_kernel() says which, and what is
/// rounded where is in docs/conventions.md, "16-bit storage"); the same exceptions.
/// Accumulation and softmax run in Scalar (float or double). Two kernels, chosen by shape:
/// query tiles (ops/flash_kernel.hpp) when a KV head serves more than Br/4 (head, query) pairs,
/// else the decoding kernel with split-KV chunks (ops/decode_kernel.hpp). Compiled with OpenMP,
/// the work is split over (sequence, KV head, group of query tiles) or (sequence, key chunk)
/// tasks; the result is bitwise the same for any thread count and whatever else shares the
/// batch.
/// Probabilities, when requested, are recomputed row by row from the log-sum-exp (O(N_q·N_k·d)).
/// An output of 8 MiB or more (detail::kStreamOutputBytes) is written with streaming stores and
/// is therefore not left in cache.
/// Extra memory: a few tiles per thread, which each thread keeps for its next call (up to about
/// half of the L2 cache: 1.1 MiB at d = 128 with a 2 MiB L2; docs/conventions.md).
template <class Scalar, class Out = Scalar>
void scaled_dot_product_attention(ConstMatrixRef<Scalar> query, ConstMatrixRef<Scalar> key,
                                  ConstMatrixRef<Scalar> value, const HeadLayout& heads,
                                  MatrixRef<typename gattn::detail::identity<Out>::type> out,
                                  const SdpaOptions<compute_t<Scalar>>& options = {},
                                  const SdpaOutputs<compute_t<Scalar>>& extra = {}) {
    gattn::detail::sdpa_with_epilogue_to<Scalar, Out>(query, key, value, heads, out, options, extra,
                                                      gattn::detail::NoEpilogue{});
}

/// Scaled dot-product attention over head-major keys and values (ops/head_major_rows.hpp):
/// PyTorch's and ONNX's [B, H_kv, N_k, d] tensors, read in place. The same math, kernels and
/// bits as the token-major call over the same keys and values; decoding reads each KV head's
/// rows as one stream, which is faster than token-major rows from memory (docs/benchmarks.md).
/// \param query [B·N_q, H·d_k] token-major, as for the token-major call.
/// \param key   [B·H_kv·N_k, d_k]: row (b·H_kv + g)·N_k + j is key j of sequence b, KV head g.
/// \param value [B·H_kv·N_k, d_v], in the same order.
/// \param heads batch B, H and H_kv.
/// \param out   [B·N_q, H·d_v] token-major, written.
/// \param options, extra as for the token-major call.
/// \throws what the token-major call throws; shape_error when key does not have B·H_kv·N_k
///         rows of d_k = query.cols() / H, or value not key's rows.
template <class Scalar, class Out = Scalar>
void scaled_dot_product_attention(ConstMatrixRef<Scalar> query, const HeadMajorRows<Scalar>& key,
                                  const HeadMajorRows<Scalar>& value, const HeadLayout& heads,
                                  MatrixRef<typename gattn::detail::identity<Out>::type> out,
                                  const SdpaOptions<compute_t<Scalar>>& options = {},
                                  const SdpaOutputs<compute_t<Scalar>>& extra = {}) {
    gattn::detail::sdpa_with_epilogue_to<Scalar, Out, gattn::detail::NoEpilogue, HeadMajorRows<Scalar>>(
        query, key, value, heads, out, options, extra, gattn::detail::NoEpilogue{});
}

/// Scaled dot-product attention over int8 keys and values (an int8 KV cache): the same as the
/// float call with K and V the values their codes stand for (ops/int8_rows.hpp), read in place.
/// Decoding widens the codes as they are loaded and applies each key's scales to its logit and
/// its weight; prefill dequantizes one key block at a time into the thread's scratch.
/// \param query [B·N_q, H·d_k] float.
/// \param key   int8 keys [B·N_k, H_kv·d_k] with H_kv scales per row.
/// \param value int8 values [B·N_k, H_kv·d_v] with H_kv scales per row, the same scale row
///              stride as key.
/// \param heads batch B, H and H_kv.
/// \param out   [B·N_q, H·d_v] float, written.
/// \param options, extra as for the float call.
/// \throws what the float call throws, and std::invalid_argument when key or value has rows
///         but no scales or fewer than H_kv per row.
inline void scaled_dot_product_attention(ConstMatrixRef<float> query, const Int8Rows& key, const Int8Rows& value,
                                         const HeadLayout& heads, MatrixRef<float> out,
                                         const SdpaOptions<float>& options = {}, const SdpaOutputs<float>& extra = {}) {
    if (key.scale_stride != value.scale_stride)
        gattn::detail::throw_invalid("gattn::scaled_dot_product_attention", "value.scale_stride",
                                     "must equal key.scale_stride = " + std::to_string(key.scale_stride) + ", got " +
                                         std::to_string(value.scale_stride));
    gattn::detail::sdpa_with_epilogue_to<float, float, gattn::detail::NoEpilogue, Int8Rows>(
        query, key, value, heads, out, options, extra, gattn::detail::NoEpilogue{});
}

/// Merges two attention results for the same queries over disjoint key sets (split-KV, or
/// context parallelism across processes) into the result over their union, exactly:
/// with m = max(lse_a, lse_b), w_a = e^(lse_a − m), w_b = e^(lse_b − m),
///     out = (w_a·out_a + w_b·out_b) / (w_a + w_b),   lse = m + log(w_a + w_b)
/// (FlashDecoding's reduction). A side with lse −∞ (no visible key) is skipped; a row where
/// both are −∞ gives 0 and −∞. Any other side is multiplied by its weight even when that
/// underflows to 0, as one call over all keys multiplies a visible key's underflowed weight
/// (0·NaN = NaN), and a NaN log-sum-exp gives NaN, so NaN survives any number of merges.
/// The weights are only as exact as the log-sum-exps: a side's lse carries its log n only
/// while |lse|·ε/2 is well below 1, so a row whose every logit is near −FLT_MAX (each key
/// biased by Hugging Face's padding value; both lse round to −FLT_MAX) merges with equal
/// weights whatever each side's key count. Mask such keys with −∞ or a boolean mask instead.
/// \param out_a, out_b [R, H·d_v] partial outputs; \param lse_a, lse_b [R, H] their log-sum-exp.
/// \param out [R, H·d_v] and \param lse [R, H], written; out may be out_a or out_b and lse may
///        be lse_a or lse_b (the same view); otherwise they share no element with the inputs or
///        with each other.
/// \throws shape_error when the shapes disagree; std::invalid_argument when out or lse
///         overlaps an input (other than being it) or the other, or has rows that overlap.
template <class Scalar>
void merge_attention(ConstMatrixRef<Scalar> out_a, ConstMatrixRef<Scalar> lse_a, ConstMatrixRef<Scalar> out_b,
                     ConstMatrixRef<Scalar> lse_b, MatrixRef<Scalar> out, MatrixRef<Scalar> lse) {
    constexpr const char* fn = "gattn::merge_attention";
    const Index R = out_a.rows(), H = lse_a.cols();
    if (H < 1 || out_a.cols() % H != 0)
        gattn::detail::throw_shape(fn, "out_a", "[rows, H*d_v] with H = lse_a.cols() = " + std::to_string(H),
                                   gattn::detail::shape_string({out_a.rows(), out_a.cols()}));
    gattn::detail::check_shape(fn, "lse_a", lse_a.rows(), lse_a.cols(), R, H);
    gattn::detail::check_shape(fn, "out_b", out_b.rows(), out_b.cols(), R, out_a.cols());
    gattn::detail::check_shape(fn, "lse_b", lse_b.rows(), lse_b.cols(), R, H);
    gattn::detail::check_output(fn, "out", out, R, out_a.cols());
    gattn::detail::check_output(fn, "lse", lse, R, H);
    // Element by element in place is exact when a result is an input; any other overlap would
    // read entries already overwritten.
    auto clash = [](const auto& result, const auto& input) {
        return !(result.data() == input.data() && result.outerStride() == input.outerStride()) &&
               gattn::detail::views_overlap(result, input);
    };
    if (clash(out, out_a) || clash(out, out_b) || gattn::detail::views_overlap(out, lse_a) ||
        gattn::detail::views_overlap(out, lse_b) || gattn::detail::views_overlap(out, lse))
        gattn::detail::throw_invalid(fn, "out", "must be out_a or out_b, or share no element with the inputs and lse");
    if (clash(lse, lse_a) || clash(lse, lse_b) || gattn::detail::views_overlap(lse, out_a) ||
        gattn::detail::views_overlap(lse, out_b))
        gattn::detail::throw_invalid(fn, "lse", "must be lse_a or lse_b, or share no element with the inputs");
    constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
    const Index dv = out_a.cols() / H;
    for (Index r = 0; r < R; ++r)
        for (Index h = 0; h < H; ++h) {
            const Scalar la = lse_a(r, h), lb = lse_b(r, h);
            const bool has_a = la != kNegInf, has_b = lb != kNegInf;
            if (!has_a && !has_b) {  // no visible key on either side
                for (Index e = 0; e < dv; ++e) out(r, h * dv + e) = Scalar(0);
                lse(r, h) = kNegInf;
                continue;
            }
            const Scalar m = std::isnan(la) || std::isnan(lb) ? std::numeric_limits<Scalar>::quiet_NaN()
                                                              : std::max(la, lb);
            const Scalar wa = has_a ? std::exp(la - m) : Scalar(0), wb = has_b ? std::exp(lb - m) : Scalar(0);
            const Scalar sum = wa + wb;  // ≥ 1 (the larger side's weight is 1), or NaN
            for (Index e = 0; e < dv; ++e) {
                const Index c = h * dv + e;
                Scalar v = 0;
                if (has_a) v += wa * out_a(r, c);
                if (has_b) v += wb * out_b(r, c);
                out(r, c) = v / sum;
            }
            lse(r, h) = m + std::log(sum);
        }
}

/// Convenience form: returns out [B·N_q, H·d_v]. Same contract as the core form.
template <class Scalar>
RowMatrix<Scalar> scaled_dot_product_attention(ConstMatrixRef<Scalar> query, ConstMatrixRef<Scalar> key,
                                               ConstMatrixRef<Scalar> value, const HeadLayout& heads,
                                               const SdpaOptions<compute_t<Scalar>>& options = {},
                                               const SdpaOutputs<compute_t<Scalar>>& extra = {}) {
    const Index H = heads.num_heads, Hkv = heads.num_kv_heads;
    // Validate first so that a bad head count is reported before the output is sized.
    gattn::detail::validate_sdpa<compute_t<Scalar>>("gattn::scaled_dot_product_attention", query.rows(), query.cols(),
                                                    key.rows(), key.cols(), value.rows(), value.cols(), heads, options);
    RowMatrix<Scalar> out(query.rows(), H * (value.cols() / Hkv));
    scaled_dot_product_attention<Scalar>(query, key, value, heads, out, options, extra);
    return out;
}

GATTN_END_ISA_NAMESPACE
