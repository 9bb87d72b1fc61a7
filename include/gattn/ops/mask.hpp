// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Mask views and the visibility rule shared by every attention kernel (docs/conventions.md, "Masks").
///
/// Key j is visible to query i of sequence b and head h iff all given masks allow it:
///  - key lengths: j < L_b (padding at the end; L_b = N_k when no lengths are given);
///  - query lengths: i < Q_b (Q_b = N_q when no lengths are given);
///  - causal: j ≤ i', where the query's position i' among the keys is, by the mask's alignment,
///    i + (L_b − Q_b) (bottom-right, the default: FlashAttention ≥ 2.1, KV-cache decoding), i
///    (top-left: PyTorch's is_causal, ONNX's Attention without past keys), or
///    query_offsets[b] + i (an explicit offset per sequence);
///  - sliding window w (counting the diagonal): i' − w < j, and j < i' + w when not causal;
///  - boolean mask: mask[b, h, i, j] is true (true = attend);
///  - additive bias: bias[b, h, i, j] is not −∞ (it is added to the scaled logit, after the
///    softcap and ALiBi of SdpaOptions).
/// Masked keys are skipped, never multiplied by zero, so their K and V cannot reach the output
/// (keys outside every query's key range are not read at all; keys that only the boolean mask
/// or the bias hides are read with their block), and a key another mask hides ignores its bias
/// entry (NaN or +∞ there changes nothing).

#include <algorithm>
#include <optional>
#include <vector>

#include "gattn/errors.hpp"

namespace gattn {

/// Non-owning view of a row-major [batch, heads, query_len, key_len] tensor in which batch,
/// heads and query_len may each be 1 and are then broadcast. `data == nullptr` means "no mask".
template <class T>
struct MaskView {
    const T* data = nullptr;  ///< row-major, contiguous
    Index batch = 1;          ///< 1 or B
    Index heads = 1;          ///< 1 or H (query heads)
    Index query_len = 1;      ///< 1 or N_q
    Index key_len = 0;        ///< must equal N_k

    /// No mask given (data is null).
    bool empty() const noexcept { return data == nullptr; }

    /// Pointer to the key row for (b, h, i), broadcasting the dimensions of size 1.
    const T* row(Index b, Index h, Index i) const noexcept {
        const Index bb = batch == 1 ? 0 : b;
        const Index hh = heads == 1 ? 0 : h;
        const Index ii = query_len == 1 ? 0 : i;
        return data + ((bb * heads + hh) * query_len + ii) * key_len;
    }
};

/// Where the causal diagonal and the sliding window sit: the position i' of query i of sequence
/// b among its keys (L_b keys, Q_b queries; see AttentionMask::query_offsets for explicit ones).
enum class CausalAlignment {
    BottomRight,  ///< i' = i + (L_b − Q_b): the last query sees the last key (FlashAttention ≥ 2.1)
    TopLeft,      ///< i' = i: query i sees keys 0..i (PyTorch's is_causal, ONNX Attention without past)
};

/// Masks for one attention call; all given masks apply together.
template <class Scalar>
struct AttentionMask {
    /// Causal: query i sees key j iff j ≤ i', its aligned position (alignment, query_offsets).
    bool causal = false;
    /// Where the causal diagonal and the window sit; bottom-right by default. Ignored when
    /// query_offsets is given.
    CausalAlignment alignment = CausalAlignment::BottomRight;
    /// Explicit positions: query i of sequence b sits at i' = query_offsets[b] + i among the
    /// keys (B entries, each in [−N_q, N_k]). Empty = the alignment decides.
    std::vector<Index> query_offsets;
    /// Sliding window w ≥ 1 in keys, counting the diagonal; empty = no window.
    std::optional<Index> sliding_window;
    /// Valid key count per sequence (B entries, each in [0, N_k]); empty = all N_k keys.
    std::vector<Index> key_lengths;
    /// Valid query count per sequence (B entries, each in [0, N_q]); query rows past it are
    /// padding and output 0. Causal and window alignment then use i + (L_b − Q_b), as
    /// FlashAttention's variable-length API does. Empty = all N_q queries.
    std::vector<Index> query_lengths;
    /// Boolean mask [B|1, H|1, N_q|1, N_k], true = attend.
    MaskView<bool> bool_mask;
    /// Additive bias [B|1, H|1, N_q|1, N_k] added to the scaled logits (−∞ masks the key).
    MaskView<Scalar> bias;
};

}  // namespace gattn

GATTN_BEGIN_ISA_NAMESPACE
namespace detail {

/// Range [begin, end) of key positions that key lengths, causality and the window allow for one
/// query row; the boolean mask and bias are applied per key inside it.
struct KeyRange {
    Index begin = 0;
    Index end = 0;
};

/// The aligned position i' of query i of sequence b among its keys (the causal diagonal, the
/// window's centre and ALiBi's distances are measured from it).
template <class Scalar>
inline Index aligned_position(const AttentionMask<Scalar>& mask, Index b, Index i, Index query_len,
                              Index key_len) noexcept {
    if (!mask.query_offsets.empty()) return mask.query_offsets[b] + i;
    if (mask.alignment == CausalAlignment::TopLeft) return i;
    const Index len = mask.key_lengths.empty() ? key_len : mask.key_lengths[b];
    const Index queries = mask.query_lengths.empty() ? query_len : mask.query_lengths[b];
    return i + (len - queries);
}

template <class Scalar>
inline KeyRange visible_key_range(const AttentionMask<Scalar>& mask, Index b, Index i,
                                  Index query_len, Index key_len) noexcept {
    const Index len = mask.key_lengths.empty() ? key_len : mask.key_lengths[b];
    const Index queries = mask.query_lengths.empty() ? query_len : mask.query_lengths[b];
    if (i >= queries) return {0, 0};           // a padding query row sees nothing
    const Index pos = aligned_position(mask, b, i, query_len, key_len);
    Index begin = 0;
    Index end = len;
    if (mask.causal) end = std::min(end, pos + 1);
    if (mask.sliding_window) {
        // Compared before subtracting or adding, so that any w ≥ 1 (up to Index max) is safe.
        const Index w = *mask.sliding_window;
        if (w <= pos) begin = pos - w + 1;
        if (!mask.causal && w < len - pos) end = std::min(end, pos + w);
    }
    if (end < begin) end = begin;
    return {begin, end};
}

}  // namespace detail
GATTN_END_ISA_NAMESPACE
