// SPDX-License-Identifier: Apache-2.0
// Decoding against a KV cache sharded by position (run with mpirun -np 2 and -np 3): every
// rank builds the same whole sequences, keeps a ragged slice of each in its own cache, and
// checks sharded_cache_attention against the float64 reference over the whole sequences; a ring
// prefill that leaves each rank its block as its cache slice, then decoding steps; int8 slices
// against one process's int8 cache; bad arguments on one rank fail every rank.

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gattn/dist/ring_attention.hpp"
#include "gattn/dist/sharded_cache.hpp"
#include "support/compare.hpp"
#include "support/mpi_test.hpp"
#include "support/reference.hpp"

namespace {

using gattn::Index;
using gattn::RowMatrix;

using gattn_test::random_matrix;
using gattn_test::rank_of;
using gattn_test::size_of;

/// The first position of rank r's slice of a sequence of L tokens: unequal slices,
/// L·r²/P², so that on 3 ranks rank 0 holds none of a 7-token sequence.
Index slice_start(Index L, Index r) {
    const Index P = size_of();
    return L * r * r / (P * P);
}

/// This rank's slices of whole [B·N, w] keys and values (sequence b's first L[b] rows) appended
/// to a cache of `capacity` rows per sequence; key_positions receives each slice's first
/// position.
template <class CacheScalar, class S>
gattn::KVCache<CacheScalar> slice_cache(const RowMatrix<S>& k, const RowMatrix<S>& v, const std::vector<Index>& L,
                                        Index N, Index Hkv, Index d, std::vector<Index>& key_positions) {
    const Index B = static_cast<Index>(L.size()), r = rank_of();
    gattn::KVCache<CacheScalar> cache(B, N, Hkv, d, d);
    RowMatrix<S> ks = RowMatrix<S>::Zero(B * N, k.cols()), vs = RowMatrix<S>::Zero(B * N, v.cols());
    std::vector<Index> counts;
    key_positions.clear();
    for (Index b = 0; b < B; ++b) {
        const Index first = slice_start(L[b], r), last = slice_start(L[b], r + 1);
        ks.middleRows(b * N, last - first) = k.middleRows(b * N + first, last - first);
        vs.middleRows(b * N, last - first) = v.middleRows(b * N + first, last - first);
        counts.push_back(last - first);
        key_positions.push_back(first);
    }
    cache.append(ks, vs, counts);
    return cache;
}

/// Every element the same on every rank.
bool same_on_every_rank(const RowMatrix<double>& m) {
    RowMatrix<double> lo(m.rows(), m.cols()), hi(m.rows(), m.cols());
    MPI_Allreduce(m.data(), lo.data(), static_cast<int>(m.size()), MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(m.data(), hi.data(), static_cast<int>(m.size()), MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return lo == hi;
}

TEST(ShardedCache, RaggedSlicesMatchTheReferenceOverTheWholeCache) {
    // Two sequences of 13 and 7 cached tokens; the last 2 of each are this step's queries
    // (their keys already appended to whichever rank holds those positions).
    const Index B = 2, N = 13, H = 4, Hkv = 2, d = 16, Nq = 2;
    const std::vector<Index> L{13, 7};
    const RowMatrix<double> k = random_matrix(B * N, Hkv * d, 21), v = random_matrix(B * N, Hkv * d, 22);
    const RowMatrix<double> q = random_matrix(B * Nq, H * d, 23);
    std::vector<Index> key_positions;
    const auto cache = slice_cache<double>(k, v, L, N, Hkv, d, key_positions);
    const std::vector<Index> query_positions{L[0] - Nq, L[1] - Nq};
    for (bool causal : {true, false})
        for (bool extras : {false, true}) {
            gattn::SdpaOptions<double> options;
            options.mask.causal = causal;
            gattn_test::RefMasks masks;
            masks.causal = causal;
            masks.key_lengths = L;
            masks.query_offsets = query_positions;
            if (extras) {
                options.sinks = {0.5, -1.0, 2.0, 0.0};
                options.logit_softcap = 3.0;
                masks.sinks = options.sinks;
                masks.softcap = 3.0;
            }
            RowMatrix<double> out(B * Nq, H * d), lse;
            gattn::sharded_cache_attention(gattn::ConstMatrixRef<double>(q), cache, key_positions, query_positions, H,
                                           out, options, MPI_COMM_WORLD, &lse);
            const auto want = gattn_test::sdpa_reference(q, k, v, B, H, Hkv, {}, masks);
            EXPECT_LE((out - want.out).cwiseAbs().maxCoeff(), 1e-13) << "causal " << causal << ", extras " << extras;
            EXPECT_LE((lse - want.log_sum_exp).cwiseAbs().maxCoeff(), 1e-13);
            EXPECT_TRUE(same_on_every_rank(out));
        }
}

TEST(ShardedCache, RingPrefillThenDecodingMatchesTheReference) {
    // A causal ring prefill of P·4 tokens leaves each rank its block in its cache; three decoding
    // steps then append each new token to the last rank's slice and attend across all slices.
    const Index P = size_of(), r = rank_of(), n = 4, H = 4, Hkv = 2, d = 16, steps = 3, N = P * n + steps;
    const RowMatrix<double> q = random_matrix(N, H * d, 5), k = random_matrix(N, Hkv * d, 6),
                            v = random_matrix(N, Hkv * d, 7);
    gattn::SdpaOptions<double> options;
    options.mask.causal = true;
    RowMatrix<double> prefill(n, H * d);
    gattn::ring_attention<double>(q.middleRows(r * n, n), k.middleRows(r * n, n), v.middleRows(r * n, n),
                                  gattn::HeadLayout{1, H, Hkv}, prefill, options, MPI_COMM_WORLD);
    gattn::KVCache<double> cache(1, n + steps, Hkv, d, d);
    cache.append(k.middleRows(r * n, n), v.middleRows(r * n, n), {n});
    const std::vector<Index> key_positions{r * n};
    for (Index s = 0; s < steps; ++s) {
        const Index t = P * n + s;  // the new token's position
        if (r == P - 1) cache.append(k.middleRows(t, 1), v.middleRows(t, 1), {1});
        RowMatrix<double> out(1, H * d);
        gattn::sharded_cache_attention(gattn::ConstMatrixRef<double>(q.middleRows(t, 1)), cache, key_positions, {t}, H,
                                       out, options, MPI_COMM_WORLD);
        gattn_test::RefMasks masks;
        masks.causal = true;
        const auto want =
            gattn_test::sdpa_reference(q.middleRows(t, 1), k.topRows(t + 1), v.topRows(t + 1), 1, H, Hkv, {}, masks);
        EXPECT_LE((out - want.out).cwiseAbs().maxCoeff(), 1e-13) << "step " << s;
    }
    // The prefill too, for this rank's queries.
    gattn_test::RefMasks masks;
    masks.causal = true;
    const auto whole =
        gattn_test::sdpa_reference(q.topRows(P * n), k.topRows(P * n), v.topRows(P * n), 1, H, Hkv, {}, masks);
    EXPECT_LE((prefill - whole.out.middleRows(r * n, n)).cwiseAbs().maxCoeff(), 1e-13);
}

TEST(ShardedCache, Int8SlicesMatchOneProcessesInt8Cache) {
    // Each token's row is quantized alone, so the slices hold the whole cache's codes.
    const Index B = 2, N = 13, H = 4, Hkv = 2, d = 32, Nq = 1;
    const std::vector<Index> L{13, 7};
    const RowMatrix<float> k = random_matrix(B * N, Hkv * d, 8).cast<float>(),
                           v = random_matrix(B * N, Hkv * d, 9).cast<float>();
    const RowMatrix<float> q = random_matrix(B * Nq, H * d, 10).cast<float>();
    std::vector<Index> key_positions;
    const auto cache = slice_cache<std::int8_t>(k, v, L, N, Hkv, d, key_positions);
    gattn::KVCache<std::int8_t> whole(B, N, Hkv, d, d);
    whole.append(k, v, L);
    gattn::SdpaOptions<float> options;
    options.mask.causal = true;
    RowMatrix<float> out(B * Nq, H * d), want(B * Nq, H * d);
    gattn::sharded_cache_attention(gattn::ConstMatrixRef<float>(q), cache, key_positions, {12, 6}, H, out, options,
                                   MPI_COMM_WORLD);
    options.mask.key_lengths = L;
    gattn::scaled_dot_product_attention(q, whole.key_operand(), whole.value_operand(), gattn::HeadLayout{B, H, Hkv},
                                        want, options);
    EXPECT_LE((out - want).cwiseAbs().maxCoeff(), 2e-6);
    EXPECT_GT(want.cwiseAbs().maxCoeff(), 0.1);
}

TEST(ShardedCache, OneRanksBadInputFailsEveryRank) {
    const Index P = size_of(), H = 2, d = 8;
    gattn::KVCache<double> cache(1, 4, 1, d, d);
    cache.append(RowMatrix<double>::Ones(2, d), RowMatrix<double>::Ones(2, d), {2});
    const RowMatrix<double> q = RowMatrix<double>::Ones(1, H * d);
    RowMatrix<double> out(1, H * d);
    gattn::SdpaOptions<double> options;
    auto expect_throw = [&](const std::vector<Index>& key_positions, const std::vector<Index>& query_positions,
                            const gattn::SdpaOptions<double>& o, const std::string& needle) {
        try {
            gattn::sharded_cache_attention(gattn::ConstMatrixRef<double>(q), cache, key_positions, query_positions, H,
                                           out, o, MPI_COMM_WORLD);
            ADD_FAILURE() << "no exception for " << needle << " on rank " << rank_of();
        } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
        }
    };
    // Rank 1 alone gives key positions for two sequences.
    expect_throw(rank_of() == 1 ? std::vector<Index>{0, 0} : std::vector<Index>{0}, {9}, options,
                 "rank 1 of " + std::to_string(P));
    // The ranks disagree on where the query sits.
    expect_throw({0}, {rank_of() == 0 ? Index(9) : Index(8)}, options, "disagree on query_positions[0]");
    gattn::SdpaOptions<double> window = options;
    window.mask.sliding_window = 3;
    expect_throw({0}, {9}, window, "options.mask.sliding_window");
    // And a valid call goes through on every rank afterwards.
    gattn::sharded_cache_attention(gattn::ConstMatrixRef<double>(q), cache, {Index(2) * rank_of()}, {2 * P}, H, out,
                                   options, MPI_COMM_WORLD);
    EXPECT_TRUE(out.isOnes(1e-12));  // every value is 1
}

}  // namespace

int main(int argc, char** argv) { return gattn_test::run_mpi_tests(argc, argv); }
