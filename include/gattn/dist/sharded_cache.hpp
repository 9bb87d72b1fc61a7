// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Decoding against a KV cache split by position across the ranks of an MPI communicator
/// (context parallelism after a ring prefill, as PyTorch's context-parallel decoding and
/// FlashDecoding's split-KV do within one process): each rank holds a slice of every sequence's
/// cached tokens in its own KVCache, every rank receives the same new query tokens, attends them
/// to its slice, and the P partial results merge exactly through their log-sum-exp
/// (merge_attention) in rank order, so every rank gets the same output, equal to attention over
/// the whole cache up to rounding. One MPI_Allgather of the partial outputs and log-sum-exps
/// (P·B·N_q·H·(d_v + 1) values) per call; no key or value crosses ranks.
///
/// Only for programs that link MPI (this header includes <mpi.h>; the rest of gattn never does).

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "gattn/cache/kv_cache.hpp"
#include "gattn/dist/ring_attention.hpp"
#include "gattn/ops/sdpa.hpp"

GATTN_BEGIN_ISA_NAMESPACE

/// Attention of new query tokens to a KV cache whose tokens are split by position across the
/// ranks of `comm` (see the file comment): softmax(scale·QKᵀ)V over the union of the slices,
/// from each slice's partial output and log-sum-exp merged exactly (merge_attention,
/// FlashDecoding's split-KV reduction).
///
/// \param query [B·N_q, H·d_k]: the same new tokens on every rank; query t of sequence b sits
///              at position query_positions[b] + t.
/// \param cache this rank's slice: B sequences, sequence b's lengths()[b] stored tokens at
///              positions [key_positions[b], key_positions[b] + lengths()[b]) (a float,
///              double or int8 KVCache; int8 with float queries). Slices of different ranks
///              hold disjoint positions; a rank may hold none of a sequence.
/// \param key_positions B entries ≥ 0: the position of this rank's first token of each sequence.
/// \param query_positions B entries ≥ 0, the same on every rank.
/// \param num_heads H, a multiple of the cache's H_kv.
/// \param out   [B·N_q, H·d_v], written (the same on every rank).
/// \param options scale; causal (query t of sequence b sees the keys at positions up to
///              query_positions[b] + t, whichever rank holds them); sinks (joined once, on rank
///              0); logit_softcap. Masks given per call (key or query lengths, query offsets,
///              boolean mask, bias), the sliding window and ALiBi are refused: their positions
///              are those of one process's keys.
/// \param comm  the ranks holding the cache's slices.
/// \param log_sum_exp optional [B·N_q, H] output, resized: the log-sum-exp over all ranks' keys.
/// \throws std::invalid_argument on every rank, naming the lowest failing rank, when any rank's
///         arguments are invalid (as scaled_dot_product_attention would reject its call, the
///         options above, a position vector of the wrong length or negative entries, a cache
///         whose window dropped tokens, or shapes, options or query positions that differ
///         between ranks); nothing is written then.
template <class Scalar, class CacheScalar>
void sharded_cache_attention(ConstMatrixRef<Scalar> query, const KVCache<CacheScalar>& cache,
                             const std::vector<Index>& key_positions, const std::vector<Index>& query_positions,
                             Index num_heads, MatrixRef<typename gattn::detail::identity<Scalar>::type> out,
                             const SdpaOptions<typename gattn::detail::identity<Scalar>::type>& options, MPI_Comm comm,
                             RowMatrix<typename gattn::detail::identity<Scalar>::type>* log_sum_exp = nullptr) {
    static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                  "sharded_cache_attention: float or double queries");
    static_assert(std::is_same_v<CacheScalar, Scalar> ||
                      (std::is_same_v<CacheScalar, std::int8_t> && std::is_same_v<Scalar, float>),
                  "sharded_cache_attention: a cache of the query's type, or int8 with float queries");
    constexpr const char* fn = "gattn::sharded_cache_attention";
    int rank = 0, size = 1;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    const Index B = cache.batch(), Hkv = cache.num_kv_heads(), dv = cache.value_head_dim();
    const HeadLayout heads{B, num_heads, Hkv};
    const Index n_q = B > 0 ? query.rows() / B : 0, n_k = cache.capacity();

    // This rank's call: its keys, the masks that place them, sinks on rank 0 only.
    SdpaOptions<Scalar> local = options;
    std::string error;
    try {
        if (const char* unsupported = gattn::detail::positional_option(options))
            gattn::detail::throw_invalid(fn, std::string("options.") + unsupported,
                                         "is not supported across ranks (positions are per slice)");
        for (const auto& [v, name] :
             {std::pair<const std::vector<Index>*, const char*>{&key_positions, "key_positions"},
              {&query_positions, "query_positions"}}) {
            if (static_cast<Index>(v->size()) != B)
                gattn::detail::throw_shape(fn, name, gattn::detail::shape_string({B}),
                                           gattn::detail::shape_string({static_cast<Index>(v->size())}));
            for (Index p : *v)
                if (p < 0) gattn::detail::throw_invalid(fn, name, "must be >= 0, got " + std::to_string(p));
        }
        for (Index first : cache.first_positions())
            if (first != 0)
                gattn::detail::throw_invalid(fn, "cache",
                                             "must hold every token of its slice (a window cache dropped some)");
        if (B > 0 && query.rows() % B != 0)
            gattn::detail::throw_shape(fn, "query", "[multiple of " + std::to_string(B) + ", H*d_k]",
                                       gattn::detail::shape_string({query.rows(), query.cols()}));
        gattn::detail::check_output(fn, "out", out, query.rows(), num_heads * dv);
        local.mask.key_lengths = cache.lengths();
        if (options.mask.causal) {
            // Query t of sequence b against this slice's key j: visible iff key_positions[b] + j ≤
            // query_positions[b] + t, i.e. j ≤ i' = offset + t. Clamping the offset into the range
            // SDPA takes changes no mask: from N_k on every stored key is visible, up to −N_q none.
            local.mask.query_offsets.resize(static_cast<std::size_t>(B));
            for (Index b = 0; b < B; ++b)
                local.mask.query_offsets[b] = std::clamp(query_positions[b] - key_positions[b], -n_q, n_k);
        }
        if (rank != 0) local.sinks.clear();
        gattn::detail::validate_sdpa<Scalar>(fn, query.rows(), query.cols(), B * n_k, Hkv * cache.head_dim(), B * n_k,
                                             Hkv * dv, heads, local, "options.mask.");
        if (out.size() > INT_MAX / std::max(size, 1))
            gattn::detail::throw_invalid(fn, "out", "holds more values than one MPI message can gather");
    } catch (const std::exception& e) {
        error = e.what();
    }
    gattn::detail::agree_or_throw(fn, error, comm);
    // Every rank's shapes, options and query positions must agree.
    std::vector<double> mine{double(query.rows()),
                             double(query.cols()),
                             double(B),
                             double(num_heads),
                             double(Hkv),
                             double(dv),
                             double(options.mask.causal),
                             options.scale ? double(*options.scale) : -1.0,
                             options.logit_softcap ? double(*options.logit_softcap) : -1.0,
                             double(options.sinks.size())};
    std::vector<std::string> names{"query rows", "query columns", "batch", "num_heads",     "num_kv_heads",
                                   "d_v",        "causal",        "scale", "logit_softcap", "sinks"};
    gattn::detail::agree_on_values(fn, names, mine, comm);
    // Then (B agreed) the query positions.
    names.clear();
    mine.clear();
    for (Index b = 0; b < B; ++b) {
        mine.push_back(double(query_positions[b]));
        names.push_back("query_positions[" + std::to_string(b) + "]");
    }
    gattn::detail::agree_on_values(fn, names, mine, comm);

    // This rank's part, then every rank's part gathered and merged in rank order.
    const Index rows = query.rows();
    RowMatrix<Scalar> part(rows, num_heads * dv), part_lse;
    SdpaOutputs<Scalar> extra;
    extra.log_sum_exp = &part_lse;
    scaled_dot_product_attention(query, cache.key_operand(), cache.value_operand(), heads, part, local, extra);
    RowMatrix<Scalar> parts(size * rows, num_heads * dv), lses(size * rows, num_heads);
    MPI_Allgather(part.data(), static_cast<int>(part.size()), gattn::detail::mpi_type<Scalar>(), parts.data(),
                  static_cast<int>(part.size()), gattn::detail::mpi_type<Scalar>(), comm);
    MPI_Allgather(part_lse.data(), static_cast<int>(part_lse.size()), gattn::detail::mpi_type<Scalar>(), lses.data(),
                  static_cast<int>(part_lse.size()), gattn::detail::mpi_type<Scalar>(), comm);
    RowMatrix<Scalar> acc = parts.topRows(rows), lse = lses.topRows(rows);
    for (int r = 1; r < size; ++r)
        merge_attention<Scalar>(acc, lse, parts.middleRows(r * rows, rows), lses.middleRows(r * rows, rows), acc, lse);
    out = acc;
    if (log_sum_exp) *log_sum_exp = lse;
}

GATTN_END_ISA_NAMESPACE
