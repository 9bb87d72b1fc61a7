// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Scaled dot-product attention over a paged KV pool (cache/paged_kv_pool.hpp), reading the
/// keys and values in place through the page table: decoding and prefill (or appended chunks).
///
/// The work is split as the contiguous call splits it (ops/sdpa.hpp), with the same kernel for
/// the same shapes. Decoding: tasks (sequence, chunk of kChunkKeys keys), each over all KV
/// heads, then each (sequence, KV head)'s chunks merged in order; the decoding kernel
/// (ops/decode_kernel.hpp) finds each key block's rows through a kernel::PageMap. Pages start
/// at multiples of 16 keys, so the kernel's key blocks (16 keys or fewer) each lie in one page,
/// fall on the same positions as in a contiguous cache and take the same arithmetic. Prefill:
/// tasks (sequence, KV head, group of query blocks) of the tile kernels (ops/flash_kernel.hpp,
/// ops/bf16_flash_kernel.hpp), which find each key block's rows through a kernel::PageMap: in
/// place when the block's 64 keys lie in one page (page sizes that are multiples of 64), else
/// copied side by side into the thread's scratch (as the kernels copy a contiguous cache's rows
/// where that helps); the arithmetic does not depend on where the rows lie. The result is bitwise that of
/// scaled_dot_product_attention over a KVCache holding the same tokens, on every kernel tier,
/// and does not depend on the thread count or the rest of the batch.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "gattn/cache/page_table.hpp"
#include "gattn/cache/paged_kv_pool.hpp"
#include "gattn/ops/sdpa.hpp"

GATTN_BEGIN_ISA_NAMESPACE

namespace detail {

/// paged_attention after the mask and query-row checks: sequence b's query rows are
/// [q_begin[b], q_begin[b + 1]), its L_b = lengths[b] keys are in the pool through the table
/// (checked), opts.mask.key_lengths = lengths and N_k = max L_b. Checks out and extra, then
/// runs detail::attention_tasks.
template <class Storage, class Query, class Out>
void paged_attention_rows(const char* fn, ConstMatrixRef<Query> query, const std::vector<Index>& q_begin,
                          const PagedKVPool<Storage>& pool, const PageTable& table, const HeadLayout& heads, Index dk,
                          Index dv, Index Nk, const std::vector<Index>& lengths, MatrixRef<Out> out,
                          const SdpaOptions<compute_t<Query>>& opts, const SdpaOutputs<compute_t<Query>>& extra) {
    constexpr bool kInt8 = std::is_same_v<Storage, std::int8_t>;
    using T = compute_t<Query>;
    const Index B = heads.batch, H = heads.num_heads, Hkv = heads.num_kv_heads, P = pool.page_size();
    const Index rows = q_begin.back();
    check_output(fn, "out", out, rows, H * dv);
    auto holds = [&](const auto& view) { return holds_pool_storage(view, pool); };
    if (views_overlap(out, query) || holds(out))
        throw_invalid(fn, "out", "must not share an element with query or the pool");
    const auto& mask = opts.mask;
    if (!mask.bias.empty() && overlaps_any(out.data(), span_of(out), mask.bias.data, numel(mask.bias)))
        throw_invalid(fn, "out", "must not overlap mask.bias");
    const RowMatrix<T>* extras[] = {extra.log_sum_exp, extra.first_key_probability};
    const char* extra_names[] = {"extra.log_sum_exp", "extra.first_key_probability"};
    for (int a = 0; a < 2; ++a) {
        const RowMatrix<T>* e = extras[a];
        if (!e) continue;
        if (a == 0 && e == extras[1]) throw_invalid(fn, extra_names[0], "must not be extra.first_key_probability");
        if (resized_output_holds(e, query) || resized_output_holds(e, out) || resized_output_holds(e, mask.bias) ||
            (e->size() > 0 && holds(*e)))
            throw_invalid(fn, extra_names[a], "must not hold query, out, mask.bias or the pool");
    }
    if (extra.log_sum_exp) extra.log_sum_exp->resize(rows, H);
    if (extra.first_key_probability) extra.first_key_probability->setZero(rows, H);
    if (rows == 0) return;
    // Every sequence reads the pool's rows through its pages; a prefill key block that spans
    // two pages (P not a multiple of the block's keys) is copied into the thread's scratch.
    const KeyValueLayout kv{
        pool.keys().outerStride(), pool.values().outerStride(), Hkv, P % kernel::FlashGeometry<T>::kKeys != 0, dk, dv};
    auto sequence_rows = [&](Index b) {
        SequenceRows<Storage> r{pool.keys().data(), pool.values().data()};
        if constexpr (kInt8) {
            r.key_scales = pool.key_scales().data();
            r.value_scales = pool.value_scales().data();
        }
        r.map = {table.indices.data() + table.indptr[static_cast<std::size_t>(b)], P};
        return r;
    };
    attention_tasks<Query, Out, Storage>(query, out, {B, H, Hkv}, dk, dv, q_begin, Nk, lengths, kv, sequence_rows, opts,
                                         extra.log_sum_exp, extra.first_key_probability, NoEpilogue{});
}

/// Throws std::invalid_argument naming num_heads unless it is a positive multiple of
/// pool.num_kv_heads() (paged_attention, cascade_attention).
template <class Storage>
void check_pool_heads(const char* fn, Index num_heads, const PagedKVPool<Storage>& pool) {
    if (num_heads < 1 || num_heads % pool.num_kv_heads() != 0)
        throw_invalid(fn, "num_heads",
                      "must be a positive multiple of pool.num_kv_heads() = " + std::to_string(pool.num_kv_heads()) +
                          ", got " + std::to_string(num_heads));
}

/// The checks both paged_attention calls make first: the table against the pool, the
/// query's columns, no key lengths and no analysis outputs. Returns each sequence's L_b.
template <class Storage, class T>
std::vector<Index> checked_paged_lengths(const char* fn, Index query_rows, Index query_cols,
                                         const PagedKVPool<Storage>& pool, const PageTable& table, Index H,
                                         const SdpaOptions<T>& options, const SdpaOutputs<T>& extra) {
    pool.check_table(fn, table);
    check_pool_heads(fn, H, pool);
    std::vector<Index> lengths(static_cast<std::size_t>(table.batch()));
    for (Index b = 0; b < table.batch(); ++b) lengths[static_cast<std::size_t>(b)] = table.length(b, pool.page_size());
    if (!options.mask.key_lengths.empty())
        throw_invalid(fn, "options.mask.key_lengths", "must be empty: the page table gives each sequence's length");
    if (extra.probabilities || extra.logits)
        throw_invalid(fn, extra.probabilities ? "extra.probabilities" : "extra.logits",
                      "is not produced over pages: run scaled_dot_product_attention on the tokens");
    if (H >= 1 && query_cols != H * pool.head_dim())
        throw_shape(fn, "query",
                    "[rows, num_heads*head_dim] with head_dim = pool.head_dim() = " + std::to_string(pool.head_dim()) +
                        " and num_heads = " + std::to_string(H),
                    shape_string({query_rows, query_cols}));
    return lengths;
}

/// Both paged_attention calls: a uniform batch (qo_indptr null: N_q = query.rows() / B rows
/// each) or a ragged one (qo_indptr), checked in full, then paged_attention_rows.
template <class Storage, class Query, class Out>
void paged_attention_call(ConstMatrixRef<Query> query, const std::vector<Index>* qo_indptr,
                          const PagedKVPool<Storage>& pool, const PageTable& table, Index num_heads, MatrixRef<Out> out,
                          const SdpaOptions<compute_t<Query>>& options, const SdpaOutputs<compute_t<Query>>& extra) {
    constexpr bool kInt8 = std::is_same_v<Storage, std::int8_t>;
    static_assert(kInt8 ? std::is_same_v<Query, float> : std::is_same_v<Query, Storage>,
                  "GATTN_QUERIES_OF_THE_POOL_TYPE_OR_FLOAT_FOR_INT8");
    using T = compute_t<Query>;
    static_assert(std::is_same_v<Out, Query> || (is_narrow_storage_v<Query> && std::is_same_v<Out, T>),
                  "GATTN_OUTPUT_MUST_BE_THE_INPUT_TYPE_OR_FLOAT_FOR_16_BIT_INPUTS");
    constexpr const char* fn = "gattn::paged_attention";
    const std::vector<Index> lengths =
        checked_paged_lengths(fn, query.rows(), query.cols(), pool, table, num_heads, options, extra);
    const Index B = table.batch(), Hkv = pool.num_kv_heads();
    // The rows of the uniform batch that validate_sdpa checks; for a ragged batch, the longest
    // N_q,b for every sequence (each N_q,b is within it).
    Index checked_rows = query.rows();
    if (qo_indptr) {
        check_qo_indptr(fn, *qo_indptr, B, query.rows(), "query.rows()");
        Index max_rows = 0;
        for (std::size_t b = 0; b + 1 < qo_indptr->size(); ++b)
            max_rows = std::max(max_rows, (*qo_indptr)[b + 1] - (*qo_indptr)[b]);
        const auto& m = options.mask;
        const char* per_row = !m.bool_mask.empty()       ? "options.mask.bool_mask"
                              : !m.bias.empty()          ? "options.mask.bias"
                              : !m.query_lengths.empty() ? "options.mask.query_lengths"
                                                         : nullptr;
        if (per_row) throw_invalid(fn, per_row, "must be empty (qo_indptr gives each sequence's queries)");
        checked_rows = B * max_rows;
    }
    const Index Nk = lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
    SdpaOptions<T> opts = options;
    opts.mask.key_lengths = lengths;
    const HeadLayout heads{B, num_heads, Hkv};
    const auto dims = validate_sdpa<T>(fn, checked_rows, query.cols(), B * Nk, Hkv * pool.head_dim(), B * Nk,
                                       Hkv * pool.value_head_dim(), heads, opts);
    std::vector<Index> uniform;
    if (!qo_indptr) {
        const Index Nq = B == 0 ? 0 : query.rows() / B;
        uniform.resize(static_cast<std::size_t>(B) + 1);
        for (Index b = 0; b <= B; ++b) uniform[static_cast<std::size_t>(b)] = b * Nq;
    }
    paged_attention_rows<Storage, Query, Out>(fn, query, qo_indptr ? *qo_indptr : uniform, pool, table, heads,
                                              dims.first, dims.second, Nk, lengths, out, opts, extra);
}

}  // namespace detail

/// Scaled dot-product attention of B sequences' new queries over the tokens the page table
/// gives them in a paged pool: for sequence b, keys 0 … L_b − 1 are its tokens (L_b =
/// table.length(b, P)), read in place. The result is bitwise that of
/// scaled_dot_product_attention over a KVCache holding the same tokens (key_lengths = L_b).
///
/// Queries are the sequences' last N_q tokens (bottom-right causal alignment; fewer with
/// mask.query_lengths): a decoding step (N_q = 1), or a chunk of a prompt whose keys and values
/// were appended to the pool before the call. For sequences with different N_q (decoding
/// steps and prompt chunks in one call), see the overload with qo_indptr.
///
/// \param query  [B·N_q, H·d_k] (float for an int8 pool, else the pool's type), any row stride;
///               B = table.batch(), d_k = pool.head_dim().
/// \param pool   the keys and values.
/// \param table  B sequences' pages (pool.page_table(ids), or a table checked against the pool).
/// \param num_heads H, a multiple of pool.num_kv_heads().
/// \param out    [B·N_q, H·d_v], written; shares no element with query or the pool.
/// \param options as for scaled_dot_product_attention; the key axis is N_k = max_b L_b (the
///               boolean mask and bias are [B|1, H|1, N_q|1, N_k]); mask.key_lengths must be
///               empty (the table gives each sequence's length).
/// \param extra  log_sum_exp and first_key_probability as for the contiguous call;
///               probabilities and logits are not produced here.
/// \throws what PagedKVPool::check_table throws (a page out of range or free, a table longer
///         than the pool); what scaled_dot_product_attention throws for the shapes and
///         options; std::invalid_argument for num_heads not a positive multiple of
///         pool.num_kv_heads(), mask.key_lengths given, or extra.probabilities or extra.logits
///         requested. Nothing is written before validation passes.
template <class Storage, class Query, class Out = Query>
void paged_attention(ConstMatrixRef<Query> query, const PagedKVPool<Storage>& pool, const PageTable& table,
                     Index num_heads, MatrixRef<gattn::detail::identity_t<Out>> out,
                     const SdpaOptions<compute_t<Query>>& options = {},
                     const SdpaOutputs<compute_t<Query>>& extra = {}) {
    gattn::detail::paged_attention_call<Storage, Query, Out>(query, nullptr, pool, table, num_heads, out, options,
                                                             extra);
}

/// paged_attention over a mixed batch: sequence b brings its own number of new query rows,
/// N_q,b = qo_indptr[b + 1] − qo_indptr[b] (FlashInfer's qo_indptr): 1 for a decoding step,
/// a chunk of its prompt for chunked prefill, 0 to sit the step out. Each sequence runs the
/// kernel its shape takes (decoding or tiles) and all of them share one parallel region, so a
/// prompt chunk and decoding steps keep both cores busy. Each sequence's rows are bitwise
/// those of a paged_attention call over that sequence alone.
///
/// \param query     [Σ N_q,b, H·d_k]: sequence b's rows from qo_indptr[b], its last N_q,b
///                  tokens (appended to the pool before the call), any row stride.
/// \param qo_indptr B + 1 row offsets: 0, non-decreasing, ending at query.rows().
/// \param pool, table, num_heads as for paged_attention.
/// \param out       [Σ N_q,b, H·d_v], rows as query's.
/// \param options   as for paged_attention, without per-row masks: causal (either alignment,
///                  or mask.query_offsets), sliding_window, sinks, logit softcap, ALiBi and
///                  scale apply per sequence; mask.bool_mask, mask.bias, mask.key_lengths and
///                  mask.query_lengths must be empty.
/// \param extra     log_sum_exp and first_key_probability, [Σ N_q,b, H].
/// \throws std::invalid_argument (shape_error for its length) for a qo_indptr that does not
///         fit query (not starting at 0, decreasing, or not ending at query.rows()), or a mask
///         above given; otherwise as paged_attention. Nothing is written before validation
///         passes.
template <class Storage, class Query, class Out = Query>
void paged_attention(ConstMatrixRef<Query> query, const std::vector<Index>& qo_indptr, const PagedKVPool<Storage>& pool,
                     const PageTable& table, Index num_heads, MatrixRef<gattn::detail::identity_t<Out>> out,
                     const SdpaOptions<compute_t<Query>>& options = {},
                     const SdpaOutputs<compute_t<Query>>& extra = {}) {
    gattn::detail::paged_attention_call<Storage, Query, Out>(query, &qo_indptr, pool, table, num_heads, out, options,
                                                             extra);
}

GATTN_END_ISA_NAMESPACE
