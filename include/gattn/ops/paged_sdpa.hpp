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

/// Scaled dot-product attention of B sequences' new queries over the tokens the page table
/// gives them in a paged pool: for sequence b, keys 0 … L_b − 1 are its tokens (L_b =
/// table.length(b, P)), read in place. The result is bitwise that of
/// scaled_dot_product_attention over a KVCache holding the same tokens (key_lengths = L_b).
///
/// Queries are the sequences' last N_q tokens (bottom-right causal alignment; fewer with
/// mask.query_lengths): a decoding step (N_q = 1), or a chunk of a prompt whose keys and values
/// were appended to the pool before the call.
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
///         options; std::invalid_argument for mask.key_lengths given, or extra.probabilities or
///         extra.logits requested. Nothing is written before validation passes.
template <class Storage, class Query, class Out = Query>
void paged_attention(ConstMatrixRef<Query> query, const PagedKVPool<Storage>& pool, const PageTable& table,
                     Index num_heads, MatrixRef<gattn::detail::identity_t<Out>> out,
                     const SdpaOptions<compute_t<Query>>& options = {},
                     const SdpaOutputs<compute_t<Query>>& extra = {}) {
    constexpr bool kInt8 = std::is_same_v<Storage, std::int8_t>;
    static_assert(kInt8 ? std::is_same_v<Query, float> : std::is_same_v<Query, Storage>,
                  "GATTN_QUERIES_OF_THE_POOL_TYPE_OR_FLOAT_FOR_INT8");
    using Scalar = Query;
    using T = compute_t<Scalar>;
    using KVElem = Storage;
    constexpr bool kNarrow = is_narrow_storage_v<Scalar>;
    static_assert(std::is_same_v<Out, Scalar> || (kNarrow && std::is_same_v<Out, T>),
                  "GATTN_OUTPUT_MUST_BE_THE_INPUT_TYPE_OR_FLOAT_FOR_16_BIT_INPUTS");
    constexpr const char* fn = "gattn::paged_attention";
    pool.check_table(fn, table);
    const Index B = table.batch(), P = pool.page_size(), Hkv = pool.num_kv_heads(), H = num_heads;
    std::vector<Index> lengths(static_cast<std::size_t>(B));
    Index Nk = 0;
    for (Index b = 0; b < B; ++b) Nk = std::max(Nk, lengths[static_cast<std::size_t>(b)] = table.length(b, P));
    if (!options.mask.key_lengths.empty())
        gattn::detail::throw_invalid(fn, "options.mask.key_lengths",
                                     "must be empty: the page table gives each sequence's length");
    if (extra.probabilities || extra.logits)
        gattn::detail::throw_invalid(fn, extra.probabilities ? "extra.probabilities" : "extra.logits",
                                     "is not produced over pages: run scaled_dot_product_attention on the tokens");
    if (H >= 1 && query.cols() != H * pool.head_dim())
        gattn::detail::throw_shape(fn, "query",
                                   "[B*N_q, num_heads*head_dim] with head_dim = pool.head_dim() = " +
                                       std::to_string(pool.head_dim()) + " and num_heads = " + std::to_string(H),
                                   gattn::detail::shape_string({query.rows(), query.cols()}));
    SdpaOptions<T> opts = options;
    opts.mask.key_lengths = lengths;
    const HeadLayout heads{B, H, Hkv};
    const auto dims = gattn::detail::validate_sdpa<T>(fn, query.rows(), query.cols(), B * Nk, Hkv * pool.head_dim(),
                                                      B * Nk, Hkv * pool.value_head_dim(), heads, opts);
    const Index dk = dims.first, dv = dims.second;
    const Index Nq = B == 0 ? 0 : query.rows() / B;
    gattn::detail::check_shape(fn, "out", out.rows(), out.cols(), B * Nq, H * dv);
    auto holds = [&](const auto& view) {
        return gattn::detail::views_overlap(view, pool.keys()) || gattn::detail::views_overlap(view, pool.values()) ||
               gattn::detail::views_overlap(view, pool.key_scales()) ||
               gattn::detail::views_overlap(view, pool.value_scales());
    };
    if (gattn::detail::views_overlap(out, query) || holds(out))
        gattn::detail::throw_invalid(fn, "out", "must not share an element with query or the pool");
    const auto& mask = opts.mask;
    if (!mask.bias.empty() && gattn::detail::overlaps_any(out.data(), gattn::detail::span_of(out), mask.bias.data,
                                                          gattn::detail::numel(mask.bias)))
        gattn::detail::throw_invalid(fn, "out", "must not overlap mask.bias");
    const RowMatrix<T>* extras[] = {extra.log_sum_exp, extra.first_key_probability};
    const char* extra_names[] = {"extra.log_sum_exp", "extra.first_key_probability"};
    for (int a = 0; a < 2; ++a) {
        const RowMatrix<T>* e = extras[a];
        if (!e) continue;
        if (a == 0 && e == extras[1])
            gattn::detail::throw_invalid(fn, extra_names[0], "must not be extra.first_key_probability");
        using gattn::detail::resized_output_holds;
        if (resized_output_holds(e, query) || resized_output_holds(e, out) || resized_output_holds(e, mask.bias) ||
            (e->size() > 0 && holds(*e)))
            gattn::detail::throw_invalid(fn, extra_names[a], "must not hold query, out, mask.bias or the pool");
    }
    if (extra.log_sum_exp) extra.log_sum_exp->resize(B * Nq, H);
    if (extra.first_key_probability) extra.first_key_probability->setZero(B * Nq, H);
    if (B * Nq == 0) return;
    // Every sequence reads the pool's rows through its pages; a prefill key block that spans
    // two pages (P not a multiple of the block's keys) is copied into the thread's scratch.
    const gattn::detail::KeyValueLayout kv{pool.keys().outerStride(), pool.values().outerStride(), Hkv,
                                           P % kernel::FlashGeometry<T>::kKeys != 0};
    auto rows = [&](Index b) {
        gattn::detail::SequenceRows<KVElem> r{pool.keys().data(), pool.values().data()};
        if constexpr (kInt8) {
            r.key_scales = pool.key_scales().data();
            r.value_scales = pool.value_scales().data();
        }
        r.map = {table.indices.data() + table.indptr[static_cast<std::size_t>(b)], P};
        return r;
    };
    gattn::detail::attention_tasks<Scalar, Out, KVElem>(query, out, heads, dk, dv, Nk, lengths, kv, rows, opts,
                                                        extra.log_sum_exp, extra.first_key_probability,
                                                        gattn::detail::NoEpilogue{});
}

GATTN_END_ISA_NAMESPACE
