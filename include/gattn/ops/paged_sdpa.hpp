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
    using Geometry = kernel::FlashGeometry<T>;
    const Index group = H / Hkv, pairs = group * Nq;
    const bool decode = pairs <= Geometry::kQueries / 4;

    const T scale = static_cast<T>(options.scale ? *options.scale : 1.0 / std::sqrt(double(dk)));
    const T softcap = options.logit_softcap ? static_cast<T>(*options.logit_softcap) : T(0);
    if (extra.log_sum_exp) extra.log_sum_exp->resize(B * Nq, H);
    if (extra.first_key_probability) extra.first_key_probability->setZero(B * Nq, H);
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    if (B * Nq == 0) return;
    RowMatrix<T>* lse = extra.log_sum_exp;

    // Decoding tasks (sequence b, chunk c): chunk_begin[b] + c, as the contiguous call numbers
    // them per sequence (its chunks past L_b see no key and add nothing to the merge).
    std::vector<Index> chunk_begin(static_cast<std::size_t>(B) + 1, 0);
    for (Index b = 0; b < B; ++b)
        chunk_begin[static_cast<std::size_t>(b) + 1] = chunk_begin[static_cast<std::size_t>(b)] +
                                                       (lengths[static_cast<std::size_t>(b)] + kernel::kChunkKeys - 1) /
                                                           kernel::kChunkKeys;
    // Prefill tasks (sequence, KV head, group of per_task query blocks), grouped as the
    // contiguous call groups them (which changes no result).
    const Index blocks = decode ? 1 : (pairs + Geometry::kQueries - 1) / Geometry::kQueries;
    Index per_task = 1;
    if (!decode) {
#ifdef _OPENMP
        const Index threads = omp_get_max_threads();
#else
        const Index threads = 1;
#endif
        const Index block_bytes = Geometry::kQueries * (dk + dv) * Index(sizeof(T));
        while (per_task * 2 <= Geometry::kGroupBlocks && per_task * 2 * block_bytes <= Geometry::group_bytes() &&
               B * Hkv * ((blocks + per_task * 2 - 1) / (per_task * 2)) >= 4 * threads)
            per_task *= 2;
    }
    const Index block_tasks = (blocks + per_task - 1) / per_task;
    const Index tasks = decode ? chunk_begin[static_cast<std::size_t>(B)] : B * Hkv * block_tasks;
    std::vector<kernel::PartialState<T>> partial(decode ? static_cast<std::size_t>(tasks * Hkv) : 0);
    const bool stream_outputs = !kNarrow &&
                                B * Nq * H * dv * Index(sizeof(Scalar)) >= gattn::detail::kStreamOutputBytes;
    const auto writes = stream_outputs ? kernel::OutputWrites::Streaming : kernel::OutputWrites::Direct;
    // Prefill key blocks over several pages are copied into the scratch rows.
    const bool copies_blocks = P % Geometry::kKeys != 0;
    Index total_keys = 0;
    for (Index l : lengths) total_keys += l;
    const bool decode_from_memory = total_keys * Hkv * (dk + dv) * Index(sizeof(KVElem)) >
                                    kernel::kDecodeFromMemoryBytes;
    const Index ldq = query.outerStride(), ldo = out.outerStride();
    const Index key_stride = pool.keys().outerStride(), value_stride = pool.values().outerStride();
    const KVElem* keys = pool.keys().data();
    const KVElem* values = pool.values().data();

    // Pairs [t0, t0 + count) of KV head g in sequence b: pair p is query p mod N_q of head
    // g·(H / H_kv) + ⌊p / N_q⌋.
    auto describe_block = [&](auto& blk, Index b, Index g, Index t0) {
        blk.count = static_cast<int>(std::min<Index>(Geometry::kQueries, pairs - t0));
        blk.softcap = softcap;
        for (int t = 0; t < blk.count; ++t) {
            const Index pair = t0 + t, h = g * group + pair / Nq, i = pair % Nq, row = b * Nq + i;
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
            blk.first_key[t] = extra.first_key_probability ? &(*extra.first_key_probability)(row, h) : nullptr;
        }
    };
    const Bf16Kernel narrow_kernel = std::is_same_v<Scalar, bfloat16> ? gattn::detail::bf16_kernel_family()
                                                                      : Bf16Kernel::WidenedFloat;
    [[maybe_unused]] const Int8Kernel int8_family = kInt8 ? gattn::detail::int8_kernel_family() : Int8Kernel::Vnni;
    [[maybe_unused]] const bool decode_dot = simd::avx512bf16::kEnabled && narrow_kernel != Bf16Kernel::WidenedFloat &&
                                             kernel::decode_bf16::takes(dk, dv);
#ifdef _OPENMP
#pragma omp parallel if (tasks > 1 && B * H * Nq * Nk * (dk + dv) > (Index(1) << 18))
#endif
    {
        auto& scratch = []() -> auto& {
            if constexpr (kNarrow)
                return kernel::NarrowScratch<Scalar, Out>::for_this_thread();
            else
                return kernel::FlashScratch<Scalar>::for_this_thread();
        }
        ();
        if constexpr (kNarrow) {
            if (decode)
                scratch.reserve_decode(dk, dv, Hkv);
            else
                scratch.reserve(dk, dv, static_cast<int>(per_task), narrow_kernel != Bf16Kernel::WidenedFloat);
        } else {
            if (decode)
                scratch.reserve_blocks(Hkv);
            else
                scratch.reserve(dk, dv, static_cast<int>(per_task), value_stride, false, kInt8 || copies_blocks);
        }
        auto* const blk = scratch.blocks.data();
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
            if (!decode) {
                // A KV head's last query blocks first (the longest under a causal mask).
                const Index first = (block_tasks - 1 - task % block_tasks) * per_task, g = (task / block_tasks) % Hkv,
                            b = task / (block_tasks * Hkv);
                const int count = static_cast<int>(std::min(per_task, blocks - first));
                for (int i = 0; i < count; ++i) describe_block(blk[i], b, g, (first + i) * Geometry::kQueries);
                const kernel::PageMap map{table.indices.data() + table.indptr[static_cast<std::size_t>(b)], P};
                auto on_block = [](int, auto* const*) {};
                if constexpr (kNarrow) {
                    kernel::narrow_attention_blocks(narrow_kernel, blk, count, keys + g * dk, key_stride,
                                                    values + g * dv, value_stride, dk, dv, scale, scratch, on_block,
                                                    map);
                } else {
                    kernel::Int8Scales sc;
                    if constexpr (kInt8) sc = {pool.key_scales().data() + g, pool.value_scales().data() + g, Hkv};
                    kernel::flash_attention_blocks<Scalar>(blk, count, keys + g * dk, key_stride, values + g * dv,
                                                           value_stride, dk, dv, scale, scratch, writes, on_block, sc,
                                                           map);
                }
                continue;
            }
            const Index b = static_cast<Index>(std::upper_bound(chunk_begin.begin(), chunk_begin.end(), task) -
                                               chunk_begin.begin() - 1);
            const Index chunk = task - chunk_begin[static_cast<std::size_t>(b)];
            kernel::PartialState<T>* states = partial.data() + task * Hkv;
            for (Index g = 0; g < Hkv; ++g) {
                describe_block(blk[g], b, g, 0);
                to_decode_block(g);
                states[g].reset(blk[g].count, dv);
            }
            const Index c0 = chunk * kernel::kChunkKeys,
                        c1 = std::min(lengths[static_cast<std::size_t>(b)], c0 + kernel::kChunkKeys);
            const kernel::PageMap map{table.indices.data() + table.indptr[static_cast<std::size_t>(b)], P};
            kernel::Int8Scales sc;
            if constexpr (kInt8) sc = {pool.key_scales().data(), pool.value_scales().data(), Hkv};
            if constexpr (simd::avx512bf16::kEnabled && std::is_same_v<Scalar, bfloat16>) {
                if (decode_dot) {
                    const Scalar** q16 = scratch.q_ptrs.data();
                    for (Index g = 0; g < Hkv; ++g)
                        for (int t = 0; t < blk[g].count; ++t) q16[g * Geometry::kQueries + t] = blk[g].q[t];
                    kernel::decode_chunk<T, Scalar, true>(decode_blk, states, Hkv, c0, c1, keys, key_stride, values,
                                                          value_stride, dk, dv, scale, decode_from_memory, q16, {},
                                                          Int8Kernel::Vnni, map);
                    continue;
                }
            }
            kernel::decode_chunk<T, KVElem>(decode_blk, states, Hkv, c0, c1, keys, key_stride, values, value_stride, dk,
                                            dv, scale, decode_from_memory, nullptr, sc, int8_family, map);
        }
        // Decoding: merge each (sequence, KV head)'s chunks in order (after the implicit barrier).
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (Index bg = 0; bg < (decode ? B * Hkv : 0); ++bg) {
            const Index b = bg / Hkv, g = bg % Hkv;
            describe_block(blk[0], b, g, 0);
            to_decode_block(0);
            kernel::decode_finish<T>(
                decode_blk[0], partial.data() + chunk_begin[static_cast<std::size_t>(b)] * Hkv + g, Hkv,
                chunk_begin[static_cast<std::size_t>(b) + 1] - chunk_begin[static_cast<std::size_t>(b)], dv);
            if constexpr (kNarrow)
                for (int t = 0; t < blk[0].count; ++t) kernel::narrow_row(stage_rows[t], blk[0].out[t], dv);
        }
    }
}

GATTN_END_ISA_NAMESPACE
