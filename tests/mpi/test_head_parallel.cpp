// SPDX-License-Identifier: Apache-2.0
// Head parallelism under MPI (run with mpirun -np 2 and -np 3): every rank builds the same
// Qwen3-Next layer, keeps its heads, and checks the summed output of a ragged prefill and of
// decoding steps against the whole layer in one process, for KV heads split and replicated,
// gated and ungated, with biases and sinks, double and float, a float and an int8 cache. Bad
// arguments on one rank make every rank throw the same error and leave every cache as it was.

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gattn/dist/head_parallel.hpp"
#include "support/mpi_test.hpp"

namespace {

using gattn::Index;
using gattn::RowMatrix;

using gattn_test::rank_of;
using gattn_test::size_of;

template <class S>
RowMatrix<S> random_rows(Index rows, Index cols, std::mt19937& rng, double scale) {
    std::normal_distribution<double> dist(0.0, scale);
    RowMatrix<S> m(rows, cols);
    for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<S>(dist(rng));
    return m;
}

/// The same random layer on every rank (a fixed seed).
template <class S>
gattn::Qwen3NextAttentionWeights<S> random_weights(const gattn::Qwen3NextConfig& c) {
    std::mt19937 rng(99);
    const Index D = c.hidden_size, H = c.num_attention_heads, Hkv = c.num_key_value_heads, d = c.head_dim;
    const Index q_rows = (c.attn_output_gate ? 2 : 1) * H * d;
    const double s = 1.0 / std::sqrt(double(D));
    gattn::Qwen3NextAttentionWeights<S> w;
    w.q_proj_weight = random_rows<S>(q_rows, D, rng, s);
    w.k_proj_weight = random_rows<S>(Hkv * d, D, rng, s);
    w.v_proj_weight = random_rows<S>(Hkv * d, D, rng, s);
    w.o_proj_weight = random_rows<S>(D, H * d, rng, s);
    w.q_norm_weight = random_rows<S>(d, 1, rng, 0.1);
    w.k_norm_weight = random_rows<S>(d, 1, rng, 0.1);
    if (c.attention_bias) {
        w.q_proj_bias = random_rows<S>(q_rows, 1, rng, 0.1);
        w.k_proj_bias = random_rows<S>(Hkv * d, 1, rng, 0.1);
        w.v_proj_bias = random_rows<S>(Hkv * d, 1, rng, 0.1);
        w.o_proj_bias = random_rows<S>(D, 1, rng, 0.1);
    }
    if (c.attention_sinks) w.sinks = random_rows<S>(H, 1, rng, 1.0);
    return w;
}

gattn::Qwen3NextConfig config(Index H, Index Hkv, bool gated, bool bias, bool sinks) {
    gattn::Qwen3NextConfig c;
    c.hidden_size = 48;
    c.num_attention_heads = H;
    c.num_key_value_heads = Hkv;
    c.head_dim = 32;
    c.partial_rotary_factor = 0.5;
    c.attn_output_gate = gated;
    c.attention_bias = bias;
    c.attention_sinks = sinks;
    return c;
}

/// Prefill of two sequences of 9 and 6 tokens, then three decoding steps, through the
/// head-parallel layer and through the whole layer; outputs within tol of each other.
template <class S, class Cache = S>
void check(const gattn::Qwen3NextConfig& c, double tol) {
    using T = gattn::compute_t<S>;
    const auto w = random_weights<S>(c);
    const gattn::Qwen3NextAttention<S> whole(c, w);
    const gattn::HeadParallelQwen3Next<S> parallel(c, w, MPI_COMM_WORLD);
    EXPECT_EQ(parallel.shard().num_heads * size_of(), c.num_attention_heads);
    auto whole_cache = whole.template make_cache<Cache>(2, 16);
    auto shard_cache = parallel.template make_cache<Cache>(2, 16);
    EXPECT_EQ(shard_cache.num_kv_heads(), parallel.shard().num_kv_heads);
    std::mt19937 rng(7);
    const Index N = 9, D = c.hidden_size;
    const std::vector<Index> counts{9, 6};
    std::vector<Index> positions(2 * N);
    for (Index r = 0; r < 2 * N; ++r) positions[r] = r % N;
    const RowMatrix<T> x = random_rows<T>(2 * N, D, rng, 1.0);
    RowMatrix<T> want(2 * N, D), got(2 * N, D);
    whole.forward(x, positions, whole_cache, want, counts);
    parallel.forward(x, positions, shard_cache, got, counts);
    double worst = (got - want).cwiseAbs().maxCoeff();
    for (int step = 0; step < 3; ++step) {
        const RowMatrix<T> xt = random_rows<T>(2, D, rng, 1.0);
        const std::vector<Index> pos{9 + step, 6 + step};
        RowMatrix<T> w1(2, D), g1(2, D);
        whole.forward(xt, pos, whole_cache, w1);
        parallel.forward(xt, pos, shard_cache, g1);
        worst = std::max(worst, double((g1 - w1).cwiseAbs().maxCoeff()));
    }
    EXPECT_EQ(shard_cache.lengths(), (std::vector<Index>{12, 9}));
    EXPECT_LE(worst, tol) << "H " << c.num_attention_heads << ", H_kv " << c.num_key_value_heads;
}

TEST(HeadParallel, KvHeadsSplitMatchTheWholeLayer) {
    const Index P = size_of();
    check<double>(config(2 * P, P, true, false, false), 1e-12);
    check<double>(config(4 * P, 2 * P, true, true, true), 1e-12);
    check<double>(config(2 * P, P, false, true, false), 1e-12);
    check<float>(config(2 * P, P, true, false, true), 2e-5);
}

TEST(HeadParallel, KvHeadsReplicatedMatchTheWholeLayer) {
    const Index P = size_of();
    check<double>(config(2 * P, 1, true, true, true), 1e-12);  // MQA: every rank reads the one KV head
    check<double>(config(P, 1, false, false, false), 1e-12);
}

TEST(HeadParallel, Int8CachesHoldTheSameCodes) {
    // Each KV head's rows are quantized alone, so the shards' int8 caches hold the whole cache's
    // codes and the outputs differ only by the order of the final sum.
    const Index P = size_of();
    check<float, std::int8_t>(config(2 * P, P, true, false, false), 2e-5);
    check<float, std::int8_t>(config(2 * P, 1, true, true, true), 2e-5);
}

TEST(HeadParallel, UnsplittableHeadsAreRefusedOnEveryRank) {
    const Index P = size_of();
    // H not a multiple of P.
    EXPECT_THROW(gattn::head_shard(P + 1, 1, rank_of(), int(P)), std::invalid_argument);
    // H_kv = 2 against 3 ranks: neither divides the other.
    if (P == 3) {
        EXPECT_THROW(gattn::head_shard(6, 2, rank_of(), 3), std::invalid_argument);
    }
}

TEST(HeadParallel, OneRanksBadInputFailsEveryRankAndChangesNoCache) {
    const Index P = size_of();
    const auto c = config(2 * P, P, true, false, false);
    const gattn::HeadParallelQwen3Next<double> parallel(c, random_weights<double>(c), MPI_COMM_WORLD);
    auto cache = parallel.make_cache(1, 8);
    // Rank 1 alone gives a position list of the wrong length.
    const RowMatrix<double> x = RowMatrix<double>::Ones(2, c.hidden_size);
    RowMatrix<double> out(2, c.hidden_size);
    const std::vector<Index> positions = rank_of() == 1 ? std::vector<Index>{0} : std::vector<Index>{0, 1};
    try {
        parallel.forward(x, positions, cache, out);
        ADD_FAILURE() << "no exception on rank " << rank_of();
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("rank 1 of " + std::to_string(P)), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("positions"), std::string::npos) << e.what();
    }
    EXPECT_EQ(cache.lengths(), std::vector<Index>{0});
    // The next call works on every rank.
    parallel.forward(x, {0, 1}, cache, out);
    EXPECT_EQ(cache.lengths(), std::vector<Index>{2});
}

}  // namespace

int main(int argc, char** argv) { return gattn_test::run_mpi_tests(argc, argv); }
