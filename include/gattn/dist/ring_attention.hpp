// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Ring attention (context parallelism) over MPI: a batch of long sequences split by position
/// across the P ranks of a communicator, each rank holding the same number of query, key and
/// value tokens of every sequence (rank r: tokens [r·n, (r + 1)·n)). The key/value blocks travel
/// around the ring (rank r sends to r + 1 and receives from r − 1), each rank attends its queries
/// to every block it receives, and the partial results merge exactly through the log-sum-exp
/// (merge_attention), as in Liu et al., "Ring Attention with Blockwise Transformers" (2023) and
/// PyTorch's context-parallel SDPA. Each transfer overlaps the attention over the block received
/// before it.
///
/// Only for programs that link MPI (this header includes <mpi.h>; the rest of gattn never does).

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gattn/ops/sdpa.hpp"

namespace gattn {

/// Which positions each rank holds in ring_attention.
enum class RingLayout {
    /// Rank r holds one chunk: positions [r·n, (r + 1)·n) of every sequence.
    Contiguous,
    /// The sequence cut into 2P chunks of n/2; rank r holds chunks r and 2P − 1 − r, in that
    /// order (rows [0, n/2) and [n/2, n) of each sequence): under a causal mask every rank then
    /// does the same work (Striped/zigzag context parallelism, as Llama 3's training and
    /// PyTorch's context_parallel load-balance it).
    Zigzag,
};

}  // namespace gattn

GATTN_BEGIN_ISA_NAMESPACE
namespace detail {

template <class T>
inline MPI_Datatype mpi_type() noexcept {
    return std::is_same_v<T, float> ? MPI_FLOAT : MPI_DOUBLE;
}

/// Makes every rank throw when any rank's arguments are invalid (instead of leaving the others
/// waiting in a transfer): the lowest failing rank's message goes to all, as
/// std::invalid_argument "<fn>: rank <k> of <P>: <message>".
inline void agree_or_throw(const char* fn, const std::string& error, MPI_Comm comm) {
    int rank = 0, size = 1;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    int failing = error.empty() ? size : rank;
    MPI_Allreduce(MPI_IN_PLACE, &failing, 1, MPI_INT, MPI_MIN, comm);
    if (failing == size) return;
    std::string message = rank == failing ? error : std::string();
    // A message from `fn` itself already starts with its name: said once, before the rank.
    const std::string own = std::string(fn) + ": ";
    if (message.compare(0, own.size(), own) == 0) message.erase(0, own.size());
    int length = static_cast<int>(message.size());
    MPI_Bcast(&length, 1, MPI_INT, failing, comm);
    message.resize(static_cast<std::size_t>(length));
    MPI_Bcast(message.data(), length, MPI_CHAR, failing, comm);
    throw std::invalid_argument(std::string(fn) + ": rank " + std::to_string(failing) + " of " + std::to_string(size) +
                                ": " + message);
}

/// The name of the first option set that places keys by their index in one call (a sliding
/// window, per-call lengths or offsets, a boolean mask, a bias, ALiBi), or nullptr: the calls
/// across ranks see each rank's keys from index 0, so these would be misplaced.
template <class Scalar>
const char* positional_option(const SdpaOptions<Scalar>& options) noexcept {
    const auto& m = options.mask;
    return m.sliding_window                ? "mask.sliding_window"
           : !m.key_lengths.empty()        ? "mask.key_lengths"
           : !m.query_lengths.empty()      ? "mask.query_lengths"
           : !m.query_offsets.empty()      ? "mask.query_offsets"
           : !m.bool_mask.empty()          ? "mask.bool_mask"
           : !m.bias.empty()               ? "mask.bias"
           : !options.alibi_slopes.empty() ? "alibi_slopes"
                                           : nullptr;
}

/// Makes every rank throw the same std::invalid_argument "<fn>: the ranks disagree on <name>
/// (<lowest> to <highest>)" when any of `values` differs between ranks (the first such name).
inline void agree_on_values(const char* fn, const std::vector<std::string>& names, const std::vector<double>& values,
                            MPI_Comm comm) {
    const int n = static_cast<int>(values.size());
    std::vector<double> lo(values.size()), hi(values.size());
    MPI_Allreduce(values.data(), lo.data(), n, MPI_DOUBLE, MPI_MIN, comm);
    MPI_Allreduce(values.data(), hi.data(), n, MPI_DOUBLE, MPI_MAX, comm);
    for (std::size_t f = 0; f < values.size(); ++f)
        if (lo[f] != hi[f])
            throw std::invalid_argument(std::string(fn) + ": the ranks disagree on " + names[f] + " (" +
                                        gattn::detail::number_string(lo[f]) + " to " +
                                        gattn::detail::number_string(hi[f]) + ")");
}

}  // namespace detail

/// Scaled dot-product attention over sequences split by position across the ranks of `comm`
/// (see the file comment): the output and log-sum-exp of this rank's queries against the keys
/// and values of every rank, equal to scaled_dot_product_attention over the whole sequences up
/// to rounding (the partial results of the P blocks are merged in the order r, r − 1, …).
///
/// \param query [B·n_q, H·d_k]: this rank's n_q query tokens of each of the B sequences, at
///              positions r·n_q + i.
/// \param key   [B·n, H_kv·d_k] and \param value [B·n, H_kv·d_v]: this rank's n key/value
///              tokens of each sequence, at positions r·n + j. Every rank passes the same B, n,
///              heads and options.
/// \param heads the head layout (batch = B).
/// \param out   [B·n_q, H·d_v], written.
/// \param options scale; causal (positions as above, which needs n_q = n: a query sees the keys
///              at or before its position, so blocks from later ranks are passed on, not read);
///              sinks (joined once, to this rank's own block); logit_softcap. Masks that need
///              per-key positions beyond these (sliding window, key or query lengths, query
///              offsets, boolean mask, bias) and ALiBi are refused.
/// \param comm  the ranks holding the sequence's parts, in position order.
/// \param log_sum_exp optional [B·n_q, H] output, resized (as SdpaOutputs::log_sum_exp).
/// \param layout which positions the rank's rows hold: one chunk (above), or two chunks
///        (RingLayout::Zigzag, n even and n_q = n) so that causal work is balanced.
/// \throws std::invalid_argument on every rank, naming the rank, when any rank's arguments are
///         invalid (as scaled_dot_product_attention would reject them, the options above, or
///         shapes or options that differ between ranks); nothing is written then.
/// Scalar: float or double.
template <class Scalar>
void ring_attention(ConstMatrixRef<Scalar> query, ConstMatrixRef<Scalar> key, ConstMatrixRef<Scalar> value,
                    const HeadLayout& heads, MatrixRef<Scalar> out, const SdpaOptions<Scalar>& options, MPI_Comm comm,
                    RowMatrix<Scalar>* log_sum_exp = nullptr, RingLayout layout = RingLayout::Contiguous) {
    static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>, "ring_attention: float or double");
    constexpr const char* fn = "gattn::ring_attention";
    int rank = 0, size = 1;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);

    // Validation: this rank's arguments, then that every rank agrees on the shapes and options.
    std::string error;
    try {
        gattn::detail::validate_sdpa<Scalar>(fn, query.rows(), query.cols(), key.rows(), key.cols(), value.rows(),
                                             value.cols(), heads, options);
        gattn::detail::check_output(fn, "out", out, query.rows(),
                                    heads.num_heads * (heads.num_kv_heads ? value.cols() / heads.num_kv_heads : 0));
        const auto& m = options.mask;
        if (const char* unsupported = detail::positional_option(options))
            gattn::detail::throw_invalid(fn, unsupported, "is not supported across ranks (positions are r·n + j)");
        if ((m.causal || layout == RingLayout::Zigzag) && heads.batch > 0 && query.rows() != key.rows())
            gattn::detail::throw_invalid(fn, "query",
                                         "must hold as many tokens as key per rank for a causal mask or the "
                                         "zigzag layout, got " +
                                             std::to_string(query.rows() / heads.batch) + " and " +
                                             std::to_string(key.rows() / heads.batch));
        if (layout == RingLayout::Zigzag && heads.batch > 0 && (key.rows() / heads.batch) % 2 != 0)
            gattn::detail::throw_invalid(fn, "key",
                                         "must hold an even number of tokens per sequence (two chunks) in the "
                                         "zigzag layout, got " +
                                             std::to_string(key.rows() / heads.batch));
        if (key.size() > INT_MAX || value.size() > INT_MAX)
            gattn::detail::throw_invalid(fn, "key", "block of more than INT_MAX values cannot be sent in one message");
        if (gattn::detail::views_overlap(out, query) || gattn::detail::views_overlap(out, key) ||
            gattn::detail::views_overlap(out, value))
            gattn::detail::throw_invalid(fn, "out", "must not share an element with query, key or value");
    } catch (const std::exception& e) {
        error = e.what();
    }
    detail::agree_or_throw(fn, error, comm);
    // Every rank's shapes and options must agree.
    gattn::detail::agree_on_values(
        fn,
        {"query rows", "query columns", "key rows", "key columns", "value columns", "batch", "num_heads",
         "num_kv_heads", "causal", "scale", "logit_softcap", "sinks", "layout"},
        {double(query.rows()), double(query.cols()), double(key.rows()), double(key.cols()), double(value.cols()),
         double(heads.batch), double(heads.num_heads), double(heads.num_kv_heads), double(options.mask.causal),
         options.scale ? *options.scale : -1.0, options.logit_softcap ? *options.logit_softcap : -1.0,
         double(options.sinks.size()), double(layout)},
        comm);

    using T = Scalar;
    const Index B = heads.batch, P = size, nq = B ? query.rows() / B : 0, nk = B ? key.rows() / B : 0;
    // The chunks of positions this rank holds, as (first row within a sequence, rows, chunk
    // index in position order): one chunk of n tokens, or (zigzag) chunks r and 2P − 1 − r.
    struct Part {
        Index first, rows, chunk;
    };
    const bool zigzag = layout == RingLayout::Zigzag;
    auto parts = [&](Index n, Index r) {
        return zigzag ? std::vector<Part>{{0, n / 2, r}, {n / 2, n / 2, 2 * P - 1 - r}} : std::vector<Part>{{0, n, r}};
    };
    // Rows [first, first + rows) of every sequence of m (n rows each), as one [B·rows] matrix.
    auto rows_of = [&](const auto& m, Index n, const Part& p) {
        RowMatrix<T> x(B * p.rows, m.cols());
        for (Index b = 0; b < B; ++b) x.middleRows(b * p.rows, p.rows) = m.middleRows(b * n + p.first, p.rows);
        return x;
    };
    const std::vector<Part> query_parts = parts(nq, rank);
    std::vector<RowMatrix<T>> q(query_parts.size()), acc(q.size()), lse(q.size());
    for (std::size_t a = 0; a < q.size(); ++a) {
        q[a] = rows_of(query, nq, query_parts[a]);
        acc[a] = RowMatrix<T>::Zero(q[a].rows(), out.cols());
        lse[a] = RowMatrix<T>::Constant(q[a].rows(), heads.num_heads, -std::numeric_limits<T>::infinity());
    }
    // Each query chunk against each key chunk of rank s's block: every key visible when the key
    // chunk comes first, causal on the diagonal chunk (which also joins the sinks, once), none
    // when it comes after (causal). Results merge through the log-sum-exp (−∞: nothing yet).
    SdpaOptions<T> full = options, diagonal = options;
    full.mask.causal = false;
    full.sinks.clear();
    RowMatrix<T> part, part_lse;
    SdpaOutputs<T> part_extra;
    part_extra.log_sum_exp = &part_lse;
    auto attend = [&](ConstMatrixRef<T> k, ConstMatrixRef<T> v, Index s) {
        for (const Part& kp : parts(nk, s)) {
            const bool needed = std::any_of(query_parts.begin(), query_parts.end(),
                                            [&](const Part& p) { return p.chunk >= kp.chunk || !options.mask.causal; });
            if (!needed) continue;  // after every query of this rank: passed on, not read
            const RowMatrix<T> kc = rows_of(k, nk, kp), vc = rows_of(v, nk, kp);
            for (std::size_t a = 0; a < q.size(); ++a) {
                const Part& qp = query_parts[a];
                if (options.mask.causal && kp.chunk > qp.chunk) continue;
                part.resize(q[a].rows(), out.cols());
                scaled_dot_product_attention<T>(q[a], kc, vc, heads, part, kp.chunk == qp.chunk ? diagonal : full,
                                                part_extra);
                merge_attention<T>(acc[a], lse[a], part, part_lse, acc[a], lse[a]);
            }
        }
    };
    attend(key, value, rank);  // this rank's own block, read in place
    if (size > 1) {
        RowMatrix<T> cur_k = key, cur_v = value, next_k(key.rows(), key.cols()), next_v(value.rows(), value.cols());
        const int to = (rank + 1) % size, from = (rank + size - 1) % size;
        const int count_k = static_cast<int>(cur_k.size()), count_v = static_cast<int>(cur_v.size());
        MPI_Request requests[4];
        auto start = [&] {
            MPI_Isend(cur_k.data(), count_k, detail::mpi_type<T>(), to, 0, comm, &requests[0]);
            MPI_Isend(cur_v.data(), count_v, detail::mpi_type<T>(), to, 1, comm, &requests[1]);
            MPI_Irecv(next_k.data(), count_k, detail::mpi_type<T>(), from, 0, comm, &requests[2]);
            MPI_Irecv(next_v.data(), count_v, detail::mpi_type<T>(), from, 1, comm, &requests[3]);
        };
        start();
        for (int step = 1; step < size; ++step) {
            MPI_Waitall(4, requests, MPI_STATUSES_IGNORE);
            cur_k.swap(next_k);
            cur_v.swap(next_v);
            // The block of rank r − step: forwarded while it is read (both only read it).
            if (step + 1 < size) start();
            attend(cur_k, cur_v, (rank + size - step) % size);
        }
    }
    for (std::size_t a = 0; a < q.size(); ++a)
        for (Index b = 0; b < B; ++b)
            out.middleRows(b * nq + query_parts[a].first, query_parts[a].rows) =
                acc[a].middleRows(b * query_parts[a].rows, query_parts[a].rows);
    if (log_sum_exp) {
        log_sum_exp->resize(query.rows(), heads.num_heads);
        for (std::size_t a = 0; a < q.size(); ++a)
            for (Index b = 0; b < B; ++b)
                log_sum_exp->middleRows(b * nq + query_parts[a].first, query_parts[a].rows) =
                    lse[a].middleRows(b * query_parts[a].rows, query_parts[a].rows);
    }
}

GATTN_END_ISA_NAMESPACE
