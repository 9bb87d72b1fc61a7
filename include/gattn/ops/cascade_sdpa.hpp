// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Shared-prefix (cascade) decoding over a paged KV pool: B sequences whose tokens begin with
/// the same pages each attend with N_q new query rows. The shared prefix is read once for the
/// whole batch: the B·N_q query rows are stacked as the rows of one sequence over the prefix's
/// page table and run non-causally through paged_attention (ops/paged_sdpa.hpp), which takes
/// the tile (matrix-product) path once the rows of a KV head fill its query blocks; each
/// sequence's own suffix pages then run through paged_attention, and the two results merge
/// exactly through their log-sum-exp (merge_attention, ops/sdpa.hpp). The sharing is given
/// explicitly (a prefix table and per-sequence suffix tables, as FlashInfer's cascade API takes
/// it); shared_prefix_pages and split_shared_prefix find it from a batch's full page tables.
///
/// The result equals paged_attention over each sequence's full table within float rounding,
/// not bitwise: the keys are summed in a different order (prefix and suffix apart, then merged).
/// A bf16 pool on the AVX512-BF16 or BF16 kernels rounds the softmax weights to bf16 before the
/// value sums (docs/conventions.md, "16-bit storage"), and the stacked prefix rows may take
/// the tiles where paged_attention decodes, so there the two agree within that rounding
/// (1.5e-3 of the output's largest element seen), not within float rounding.

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "gattn/cache/page_table.hpp"
#include "gattn/cache/paged_kv_pool.hpp"
#include "gattn/ops/paged_sdpa.hpp"
#include "gattn/ops/sdpa.hpp"

GATTN_BEGIN_ISA_NAMESPACE

/// The number of leading pages that every sequence of `table` holds in common (the same page
/// indices), counting only pages that are full in every sequence that holds them (a sequence's
/// last page counts only when it holds page_size tokens) and that leave every sequence at least
/// min_suffix_tokens tokens after them. 0 for an empty batch.
/// \param table             the batch's page tables (PagedKVPool::page_table).
/// \param page_size         the pool's page size, in tokens.
/// \param min_suffix_tokens the tokens each sequence keeps out of the prefix: N_q − 1 for a
///        causal cascade_attention of N_q new query rows a sequence, whose new tokens must
///        follow the prefix (the new tokens of a batch of one sequence, or of forks made after
///        they were appended, lie in shared pages); 0 (the default) counts every shared full page.
/// \throws shape_error or std::invalid_argument for a table whose indptr does not have
///         batch() + 1 entries running from 0 to indices.size() without decreasing, or whose
///         last_page_len[b] is outside [1, page_size] for a sequence with pages (not 0 for one
///         without), or for page_size < 1 (detail::check_table_layout); std::invalid_argument
///         for min_suffix_tokens < 0.
inline Index shared_prefix_pages(const PageTable& table, Index page_size, Index min_suffix_tokens = 0) {
    constexpr const char* fn = "gattn::shared_prefix_pages";
    detail::check_table_layout(fn, table, page_size);
    if (min_suffix_tokens < 0)
        detail::throw_invalid(fn, "min_suffix_tokens", "must be >= 0, got " + std::to_string(min_suffix_tokens));
    const Index B = table.batch();
    if (B == 0) return 0;
    Index n = table.pages(0);
    for (Index b = 0; b < B; ++b) {  // whole pages before the last min_suffix_tokens tokens
        const Index length = table.length(b, page_size);
        n = std::min(n, length > min_suffix_tokens ? (length - min_suffix_tokens) / page_size : Index(0));
    }
    const Index* first = table.indices.data() + table.indptr[0];
    for (Index b = 1; b < B; ++b) {
        const Index* row = table.indices.data() + table.indptr[static_cast<std::size_t>(b)];
        Index k = 0;
        while (k < n && row[k] == first[k]) ++k;
        n = k;
    }
    return n;
}

/// Splits a batch's full page tables into the prefix table (one sequence: the first
/// shared_prefix_pages(table, page_size, min_suffix_tokens) pages, all full) and the suffix
/// tables (B sequences: each one's remaining pages, possibly none), the arguments
/// cascade_attention takes (causal: min_suffix_tokens = N_q − 1, see shared_prefix_pages).
/// \throws as shared_prefix_pages.
inline std::pair<PageTable, PageTable> split_shared_prefix(const PageTable& table, Index page_size,
                                                           Index min_suffix_tokens = 0) {
    const Index n = shared_prefix_pages(table, page_size, min_suffix_tokens), B = table.batch();
    PageTable prefix, suffix;
    if (n > 0) {
        prefix.indices.assign(table.indices.begin() + table.indptr[0], table.indices.begin() + table.indptr[0] + n);
        prefix.indptr = {0, n};
        prefix.last_page_len = {page_size};
    } else {
        prefix.indptr = {0, 0};
        prefix.last_page_len = {0};
    }
    for (Index b = 0; b < B; ++b) {
        const auto from = table.indices.begin() + table.indptr[static_cast<std::size_t>(b)] + n,
                   to = table.indices.begin() + table.indptr[static_cast<std::size_t>(b) + 1];
        suffix.indices.insert(suffix.indices.end(), from, to);
        suffix.indptr.push_back(static_cast<Index>(suffix.indices.size()));
        suffix.last_page_len.push_back(from == to ? 0 : table.last_page_len[static_cast<std::size_t>(b)]);
    }
    return {std::move(prefix), std::move(suffix)};
}

/// Attention of B sequences' new queries over a shared prefix and their own suffixes in a
/// paged pool: sequence b's keys are the prefix's tokens followed by its suffix's tokens, as
/// paged_attention over the concatenated table would see them. The prefix is read once for
/// all B·N_q query rows of each KV head (see the file comment).
///
/// Options that carry over exactly: scale, logit_softcap, sinks (given to the prefix call only)
/// and mask.causal (the whole prefix is visible to every new row; the suffix holds the new
/// tokens, bottom-right aligned), with GQA/MQA and every storage type of the pool. Options that
/// cannot be split are rejected: mask.bool_mask, mask.bias, mask.sliding_window,
/// mask.query_offsets, mask.query_lengths, mask.key_lengths, mask.alignment other than
/// BottomRight under causal, and alibi_slopes.
///
/// \param query   [B·N_q, H·d_k] (float for an int8 pool, else the pool's type); B = suffix.batch().
/// \param pool    the keys and values.
/// \param prefix  one sequence's pages: the shared prefix (every page full but the last).
/// \param suffix  B sequences' own pages after the prefix (a sequence may have none).
/// \param num_heads H, a multiple of pool.num_kv_heads().
/// \param out     [B·N_q, H·d_v], written only after every check and both calls succeed.
/// \param options see above.
/// \throws std::invalid_argument naming the argument: prefix.batch() ≠ 1, an empty prefix,
///         query rows not a multiple of suffix.batch(), under mask.causal a suffix shorter
///         than N_q − 1 tokens (the prefix would hold new tokens that earlier rows must not
///         see), a rejected option, out sharing an
///         element with the pool's storage; what PagedKVPool::check_table and paged_attention
///         throw. On any error `out` is unchanged.
template <class Storage, class Query, class Out = Query>
void cascade_attention(ConstMatrixRef<Query> query, const PagedKVPool<Storage>& pool, const PageTable& prefix,
                       const PageTable& suffix, Index num_heads, MatrixRef<gattn::detail::identity_t<Out>> out,
                       const SdpaOptions<compute_t<Query>>& options = {}) {
    using T = compute_t<Query>;
    constexpr const char* fn = "gattn::cascade_attention";
    if (prefix.batch() != 1)
        gattn::detail::throw_invalid(fn, "prefix", "must hold 1 sequence, holds " + std::to_string(prefix.batch()));
    pool.check_table(fn, prefix);
    pool.check_table(fn, suffix);
    const Index P = pool.page_size(), B = suffix.batch();
    detail::check_pool_heads(fn, num_heads, pool);
    if (prefix.length(0, P) == 0) gattn::detail::throw_invalid(fn, "prefix", "must hold at least 1 token, holds 0");
    if (B < 1 || query.rows() % B != 0)
        gattn::detail::throw_invalid(fn, "suffix",
                                     "batch must divide query.rows() = " + std::to_string(query.rows()) + ", is " +
                                         std::to_string(B));
    const auto& m = options.mask;
    const char* rejected = !m.bool_mask.empty()                                        ? "options.mask.bool_mask"
                           : !m.bias.empty()                                           ? "options.mask.bias"
                           : m.sliding_window.has_value()                              ? "options.mask.sliding_window"
                           : !m.query_offsets.empty()                                  ? "options.mask.query_offsets"
                           : !m.query_lengths.empty()                                  ? "options.mask.query_lengths"
                           : !m.key_lengths.empty()                                    ? "options.mask.key_lengths"
                           : (m.causal && m.alignment != CausalAlignment::BottomRight) ? "options.mask.alignment"
                           : !options.alibi_slopes.empty()                             ? "options.alibi_slopes"
                                                                                       : nullptr;
    if (rejected)
        gattn::detail::throw_invalid(fn, rejected,
                                     "cannot be split between the shared prefix and the suffixes: must be "
                                     "empty (or BottomRight causal alignment)");
    // Causal: query row i of N_q sees keys up to L − N_q + i, so the whole prefix is visible to
    // every row only when each suffix holds the new tokens but the last (at least N_q − 1).
    const Index new_rows = query.rows() / B;
    if (m.causal)
        for (Index b = 0; b < B; ++b)
            if (suffix.length(b, P) < new_rows - 1)
                gattn::detail::throw_invalid(
                    fn, "suffix",
                    "sequence " + std::to_string(b) + " holds " + std::to_string(suffix.length(b, P)) +
                        " tokens after the prefix; causal attention of " + std::to_string(new_rows) +
                        " new query rows needs at least " + std::to_string(new_rows - 1) +
                        " (their tokens must follow it; split_shared_prefix(table, page_size, " +
                        std::to_string(new_rows - 1) + ") leaves them)");
    const Index H = num_heads, dv = pool.value_head_dim(), rows = query.rows();
    gattn::detail::check_output(fn, "out", out, rows, H * dv);
    // out may hold query (both calls read it before out is written), never the pool's storage.
    if (gattn::detail::holds_pool_storage(out, pool))
        gattn::detail::throw_invalid(fn, "out", "must not share an element with the pool's keys, values or scales");

    // Prefix: all rows as one non-causal sequence, with the sinks.
    SdpaOptions<T> prefix_options = options;
    prefix_options.mask = {};
    RowMatrix<T> out_a(rows, H * dv), lse_a;
    paged_attention<Storage, Query, T>(query, pool, prefix, H, out_a, prefix_options, {&lse_a});
    bool any_suffix = false;
    for (Index b = 0; b < B; ++b) any_suffix = any_suffix || suffix.pages(b) > 0;
    if (any_suffix) {
        SdpaOptions<T> suffix_options = options;
        suffix_options.sinks.clear();
        RowMatrix<T> out_b(rows, H * dv), lse_b;
        paged_attention<Storage, Query, T>(query, pool, suffix, H, out_b, suffix_options, {&lse_b});
        RowMatrix<T> lse(rows, H);
        merge_attention<T>(out_a, lse_a, out_b, lse_b, out_a, lse);
    }
    for (Index r = 0; r < rows; ++r)
        for (Index c = 0; c < H * dv; ++c) out(r, c) = static_cast<Out>(out_a(r, c));
}

GATTN_END_ISA_NAMESPACE
