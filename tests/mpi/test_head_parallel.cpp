// SPDX-License-Identifier: Apache-2.0
// Head parallelism under MPI (run with mpirun -np 2 and -np 3): every rank builds the same
// Qwen3-Next layer, keeps its heads, and checks the summed output of a ragged prefill and of
// decoding steps against the whole layer in one process, for KV heads split and replicated,
// gated and ungated, with biases and sinks, double and float, a float and an int8 cache; and the
// same for the generic layer with every gate position, layout and granularity. Bad arguments on
// one rank make every rank throw the same error and leave every cache as it was.

#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gattn/dist/head_parallel.hpp"
#include "gattn/io/hf_checkpoint.hpp"
#include "gattn/io/safetensors.hpp"
#include "support/mpi_test.hpp"
#include "support/safetensors_writer.hpp"

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

/// A NaN sink of the last rank's head and an infinite weight in another rank's rows: given the
/// whole layer's weights, every rank checks all of them and refuses alike (a rank that went on
/// would wait forever for the others in its first call).
TEST(HeadParallel, NonFiniteWeightsAreRefusedOnEveryRank) {
    const Index P = size_of();
    const auto c = config(2 * P, P, true, false, true);
    auto w = random_weights<double>(c);
    w.sinks[2 * P - 1] = std::numeric_limits<double>::quiet_NaN();
    try {
        gattn::HeadParallelQwen3Next<double> layer(c, w, MPI_COMM_WORLD);
        ADD_FAILURE() << "a NaN sink accepted on rank " << rank_of();
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("sinks[" + std::to_string(2 * P - 1) + "] must be finite or -inf"),
                  std::string::npos)
            << e.what();
    }
    w.sinks[2 * P - 1] = -std::numeric_limits<double>::infinity();  // no sink for that head: fine
    gattn::HeadParallelQwen3Next<double> fine(c, w, MPI_COMM_WORLD);
    w.k_proj_weight(w.k_proj_weight.rows() - 1, 0) = std::numeric_limits<double>::infinity();
    EXPECT_THROW(gattn::HeadParallelQwen3Next<double>(c, w, MPI_COMM_WORLD), std::invalid_argument);
}

TEST(HeadParallel, EachRankReadsItsShardOfACheckpoint) {
    // The Qwen3-Next fixture (4 heads, 2 KV heads): its shards read from the file on 2 ranks
    // equal the whole layer's weights cut in memory, and the layer built from them computes what
    // the whole layer computes.
    if (4 % size_of() != 0) GTEST_SKIP() << "4 heads on " << size_of() << " ranks";
    const std::string dir = std::string(GATTN_TEST_DATA_DIR) + "/qwen3_next";
    const auto config = gattn::load_qwen3_next_config(dir + "/config.json", 3);
    const auto whole_weights = gattn::load_qwen3_next_attention_weights<double>(dir, 3, config);
    const auto shard = gattn::HeadParallelQwen3Next<double>::shard_of(config, MPI_COMM_WORLD);
    const auto [shard_config, read] = gattn::load_qwen3_next_attention_shard<double>(dir, 3, config, shard);
    const auto [cut_config, cut] = gattn::shard_qwen3_next(config, whole_weights, shard);
    EXPECT_EQ(shard_config.num_attention_heads, cut_config.num_attention_heads);
    read.for_each([&, &cut = cut](const char* name, const auto& t) {
        cut.for_each([&](const char* other, const auto& u) {
            if constexpr (std::is_same_v<decltype(t), decltype(u)>) {
                if (std::string(name) == other) {
                    EXPECT_TRUE(t == u) << name;
                }
            }
        });
    });
    const gattn::HeadParallelQwen3Next<double> parallel(config, shard, read, MPI_COMM_WORLD);
    const gattn::Qwen3NextAttention<double> whole(config, whole_weights);
    std::mt19937 rng(3);
    const RowMatrix<double> x = random_rows<double>(5, config.hidden_size, rng, 1.0);
    const std::vector<Index> positions{0, 1, 2, 3, 4};
    auto cache = parallel.make_cache(1, 8);
    auto whole_cache = whole.make_cache(1, 8);
    RowMatrix<double> got(5, config.hidden_size), want(5, config.hidden_size);
    parallel.forward(x, positions, cache, got);
    whole.forward(x, positions, whole_cache, want);
    EXPECT_LE((got - want).cwiseAbs().maxCoeff(), 1e-12);
    // Another rank's shard is refused.
    gattn::HeadShard other = shard;
    other.first_head = (shard.first_head + shard.num_heads) % config.num_attention_heads;
    EXPECT_THROW(gattn::HeadParallelQwen3Next<double>(config, other, read, MPI_COMM_WORLD), std::invalid_argument);
}

// ---- The generic layer (HeadParallelAttention) ----

gattn::AttentionConfig generic_config(Index H, Index Hkv, gattn::GateSpec gate) {
    gattn::AttentionConfig c;
    c.d_model = 40;
    c.num_heads = H;
    c.num_kv_heads = Hkv;
    c.head_dim = 16;
    c.gate = gate;
    c.causal = true;
    return c;
}

gattn::GateSpec spec(gattn::GatePosition position,
                     gattn::GateGranularity granularity = gattn::GateGranularity::Elementwise) {
    gattn::GateSpec g;
    g.position = position;
    g.granularity = granularity;
    return g;
}

/// Every gate the layer takes, each with some of the layer's other features, so that each
/// shard's rows are checked: (name, config) for H query and Hkv KV heads.
std::vector<std::pair<std::string, gattn::AttentionConfig>> generic_cases(Index H, Index Hkv) {
    using gattn::GateCombine;
    using gattn::GateGranularity;
    using gattn::GateLayout;
    using gattn::GatePosition;
    using gattn::GateSource;
    std::vector<std::pair<std::string, gattn::AttentionConfig>> cases;
    auto add = [&](std::string name, gattn::GateSpec g, auto&& tweak) {
        gattn::AttentionConfig c = generic_config(H, Hkv, g);
        tweak(c);
        cases.emplace_back(std::move(name), c);
    };
    auto none = [](gattn::AttentionConfig&) {};
    add("ungated, q/k norm, RoPE, biases", gattn::GateSpec{}, [](gattn::AttentionConfig& c) {
        c.qk_norm = gattn::QkNorm::ZeroCentredRmsNorm;
        c.rotary_dim = 8;
        c.qkv_bias = c.o_bias = true;
    });
    gattn::GateSpec g1 = gattn::GateSpec::g1_elementwise();
    g1.bias = true;
    add("G1 elementwise, bias, sinks, softcap", g1, [](gattn::AttentionConfig& c) {
        c.sinks = true;
        c.logit_softcap = 5;
    });
    add("G1 headwise, SiLU, not causal", gattn::GateSpec::g1_headwise(), [](gattn::AttentionConfig& c) {
        c.gate.activation = gattn::GateActivation::SiLU;
        c.causal = false;
    });
    add("G1 interleaved in q_proj, biases", gattn::GateSpec::g1_elementwise(GateLayout::PerHeadInterleaved),
        [](gattn::AttentionConfig& c) { c.qkv_bias = true; });
    add("G1 headwise grouped by KV head, biases", gattn::GateSpec::g1_headwise(GateLayout::GroupedByKV),
        [](gattn::AttentionConfig& c) { c.qkv_bias = true; });
    add("G1 elementwise grouped by KV head", gattn::GateSpec::g1_elementwise(GateLayout::GroupedByKV), none);
    gattn::GateSpec shared = gattn::GateSpec::g1_elementwise();
    shared.sharing = gattn::GateSharing::HeadShared;
    shared.bias = true;
    add("G1 head-shared, bias", shared, none);
    gattn::GateSpec additive = gattn::GateSpec::g1_headwise();
    additive.combine = GateCombine::Additive;
    add("G1 additive, window", additive, [](gattn::AttentionConfig& c) { c.sliding_window = 4; });
    gattn::GateSpec query = gattn::GateSpec::g1_headwise();
    query.source = GateSource::Query;
    query.bias = true;
    add("G1 from the query", query, none);
    gattn::GateSpec theta = gattn::GateSpec::g1_elementwise();
    theta.source = GateSource::InputIndependent;
    add("G1 input-independent", theta, none);
    add("G2 elementwise", spec(GatePosition::G2), none);
    gattn::GateSpec g2_shared = spec(GatePosition::G2);
    g2_shared.sharing = gattn::GateSharing::HeadShared;
    add("G2 head-shared", g2_shared, none);
    add("G3 headwise, RoPE", spec(GatePosition::G3, GateGranularity::Headwise),
        [](gattn::AttentionConfig& c) { c.rotary_dim = 16; });
    add("G4 elementwise, q/k norm", spec(GatePosition::G4),
        [](gattn::AttentionConfig& c) { c.qk_norm = gattn::QkNorm::RmsNorm; });
    gattn::GateSpec g5 = spec(GatePosition::G5);
    g5.bias = true;
    add("G5, o_proj bias", g5, [](gattn::AttentionConfig& c) { c.o_bias = true; });
    gattn::GateSpec mix = spec(GatePosition::G5);
    mix.combine = GateCombine::ResidualMix;
    add("G5 residual mix, o_proj bias", mix, [](gattn::AttentionConfig& c) { c.o_bias = true; });
    return cases;
}

/// A ragged batch without a cache, then the same tokens as a prefill into a cache and three
/// decoding steps, through the head-parallel layer and through the whole layer.
template <class S, class Cache = S>
double generic_worst(const gattn::AttentionConfig& c) {
    using T = gattn::compute_t<S>;
    const auto w = gattn::make_random_weights<S>(c, 5);
    const gattn::GatedMultiHeadAttention<S> whole(c, w);
    const gattn::HeadParallelAttention<S> parallel(c, w, MPI_COMM_WORLD);
    std::mt19937 rng(11);
    const Index N = 7, D = c.d_model;
    const RowMatrix<T> x = random_rows<T>(2 * N, D, rng, 1.0);
    gattn::ForwardOptions<T> options;
    options.key_lengths = {7, 5};
    RowMatrix<T> want = whole.forward(x, 2, options), got(2 * N, D);
    parallel.forward(x, 2, got, options);
    double worst = (got - want).cwiseAbs().maxCoeff();

    auto whole_cache = whole.template make_cache<Cache>(2, 12);
    auto shard_cache = parallel.template make_cache<Cache>(2, 12);
    const std::vector<Index> counts{7, 5};
    whole.forward(x, whole_cache, want, counts);
    parallel.forward(x, shard_cache, got, counts);
    worst = std::max(worst, double((got - want).cwiseAbs().maxCoeff()));
    for (int step = 0; step < 3; ++step) {
        const RowMatrix<T> xt = random_rows<T>(2, D, rng, 1.0);
        RowMatrix<T> w1(2, D), g1(2, D);
        whole.forward(xt, whole_cache, w1);
        parallel.forward(xt, shard_cache, g1);
        worst = std::max(worst, double((g1 - w1).cwiseAbs().maxCoeff()));
    }
    EXPECT_EQ(shard_cache.tokens_seen(), (std::vector<Index>{10, 8}));
    EXPECT_EQ(shard_cache.num_kv_heads(), parallel.shard().num_kv_heads);
    return worst;
}

TEST(HeadParallelAttention, EveryGateMatchesTheWholeLayerWithKvHeadsSplit) {
    const Index P = size_of();
    for (const auto& [name, c] : generic_cases(2 * P, P)) EXPECT_LE(generic_worst<double>(c), 1e-12) << name;
}

TEST(HeadParallelAttention, EveryGateMatchesTheWholeLayerWithKvHeadsReplicated) {
    // One KV head read by 2P query heads: each rank holds part of the KV group, so a grouped
    // q_proj layout is rebuilt for the shard's heads.
    const Index P = size_of();
    for (const auto& [name, c] : generic_cases(2 * P, 1)) EXPECT_LE(generic_worst<double>(c), 1e-12) << name;
}

TEST(HeadParallelAttention, FloatAndInt8CachesMatchTheWholeLayer) {
    const Index P = size_of();
    const auto cases = generic_cases(2 * P, P);
    EXPECT_LE(generic_worst<float>(cases[1].second), 2e-5) << cases[1].first;
    EXPECT_LE((generic_worst<float, std::int8_t>(cases[1].second)), 2e-5) << cases[1].first;
    ASSERT_EQ(cases[12].second.gate.position, gattn::GatePosition::G3);
    EXPECT_LE((generic_worst<float, std::int8_t>(cases[12].second)), 2e-5) << cases[12].first;  // gated keys
}

TEST(HeadParallelAttention, EachRankReadsItsShardOfAFile) {
    // The whole layer written to a file (one per rank), each rank reading only its shard: the
    // layer built from the shards computes what the whole layer computes.
    const Index P = size_of();
    gattn::GateSpec g5;
    g5.position = gattn::GatePosition::G5;
    g5.combine = gattn::GateCombine::ResidualMix;
    for (const auto& g : {gattn::GateSpec::g1_headwise(gattn::GateLayout::GroupedByKV), g5}) {
        const auto c = generic_config(2 * P, 1, g);
        const auto w = gattn::make_random_weights<double>(c, 23);
        const std::string path = (std::filesystem::temp_directory_path() /
                                  ("gattn_head_parallel_" + std::to_string(::getpid()) + ".safetensors"))
                                     .string();
        gattn_test::write_safetensors(path, gattn_test::f32_tensors(w, "attn."));
        const gattn::SafetensorsFile file(path);
        const auto shard = gattn::HeadParallelAttention<double>::shard_of(c, MPI_COMM_WORLD);
        const auto part = gattn::load_attention_shard<double>(file, c, shard, "attn.");
        const gattn::HeadParallelAttention<double> parallel(c, shard, part.second, MPI_COMM_WORLD);
        // The file holds the weights rounded to float: the whole layer reads them from it too.
        const gattn::GatedMultiHeadAttention<double> whole(c, gattn::load_attention_weights<double>(file, c, "attn."));
        std::mt19937 rng(2);
        const RowMatrix<double> x = random_rows<double>(6, c.d_model, rng, 1.0);
        RowMatrix<double> got(6, c.d_model);
        parallel.forward(x, 2, got);
        EXPECT_LE((got - whole.forward(x, 2)).cwiseAbs().maxCoeff(), 1e-12) << gattn::describe(g);
        std::filesystem::remove(path);
    }
}

TEST(HeadParallelAttention, APerHeadBiasMaskIsCutToEachRanksHeads) {
    const Index P = size_of(), H = 2 * P, N = 5;
    const auto c = generic_config(H, P, gattn::GateSpec::g1_elementwise());
    const auto w = gattn::make_random_weights<double>(c, 3);
    const gattn::GatedMultiHeadAttention<double> whole(c, w);
    const gattn::HeadParallelAttention<double> parallel(c, w, MPI_COMM_WORLD);
    std::mt19937 rng(4);
    const RowMatrix<double> x = random_rows<double>(2 * N, c.d_model, rng, 1.0);
    const RowMatrix<double> bias = random_rows<double>(2 * H * N, N, rng, 2.0);  // [2, H, N, N]
    gattn::ForwardOptions<double> options;
    options.bias = {bias.data(), 2, H, N, N};
    RowMatrix<double> got(2 * N, c.d_model);
    parallel.forward(x, 2, got, options);
    EXPECT_LE((got - whole.forward(x, 2, options)).cwiseAbs().maxCoeff(), 1e-12);
    // Without the mask the output differs: the mask reached every rank's heads.
    EXPECT_GT((got - whole.forward(x, 2)).cwiseAbs().maxCoeff(), 1e-3);
}

TEST(HeadParallelAttention, RanksWithDifferentRowCountsAllThrow) {
    const Index P = size_of();
    const auto c = generic_config(2 * P, P, gattn::GateSpec::g1_elementwise());
    const gattn::HeadParallelAttention<double> parallel(c, gattn::make_random_weights<double>(c, 4), MPI_COMM_WORLD);
    auto cache = parallel.make_cache(1, 8);
    const Index rows = rank_of() == 1 ? 2 : 1;  // valid on each rank alone
    const RowMatrix<double> x = RowMatrix<double>::Ones(rows, c.d_model);
    RowMatrix<double> out(rows, c.d_model);
    try {
        parallel.forward(x, cache, out);
        ADD_FAILURE() << "no exception on rank " << rank_of();
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("disagree on x rows"), std::string::npos) << e.what();
    }
    EXPECT_EQ(cache.tokens_seen(), std::vector<Index>{0});
}

TEST(HeadParallelAttention, AlibiIsRefused) {
    auto c = generic_config(2 * size_of(), size_of(), gattn::GateSpec{});
    c.alibi = true;
    const auto w = gattn::make_random_weights<double>(c, 1);
    try {
        gattn::HeadParallelAttention<double> layer(c, w, MPI_COMM_WORLD);
        ADD_FAILURE() << "ALiBi accepted";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("config.alibi"), std::string::npos) << e.what();
    }
}

TEST(HeadParallelAttention, OneRanksBadInputFailsEveryRankAndRestoresAWindowCache) {
    const Index P = size_of();
    auto c = generic_config(2 * P, P, gattn::GateSpec::g1_elementwise());
    c.sliding_window = 2;
    const auto w = gattn::make_random_weights<double>(c, 8);
    const gattn::HeadParallelAttention<double> parallel(c, w, MPI_COMM_WORLD);
    auto cache = parallel.make_cache(1, 16);  // a window cache of 4 rows
    ASSERT_EQ(cache.window(), 2);
    std::mt19937 rng(9);
    RowMatrix<double> out(3, c.d_model);
    parallel.forward(random_rows<double>(3, c.d_model, rng, 1.0), cache, out);
    const RowMatrix<double> keys = cache.key_operand();
    // Rank 1 alone passes a count above N: the others append (and drop a token) before the
    // error reaches them, then restore their cache.
    const RowMatrix<double> x = random_rows<double>(2, c.d_model, rng, 1.0);
    RowMatrix<double> out2(2, c.d_model);
    const std::vector<Index> counts = rank_of() == 1 ? std::vector<Index>{3} : std::vector<Index>{2};
    try {
        parallel.forward(x, cache, out2, counts);
        ADD_FAILURE() << "no exception on rank " << rank_of();
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("rank 1 of " + std::to_string(P)), std::string::npos) << e.what();
    }
    EXPECT_EQ(cache.tokens_seen(), std::vector<Index>{3});
    EXPECT_EQ(RowMatrix<double>(cache.key_operand()), keys);
    // And the next call gives what the whole layer gives.
    const gattn::GatedMultiHeadAttention<double> whole(c, w);
    auto whole_cache = whole.make_cache(1, 16);
    RowMatrix<double> want(3, c.d_model);
    rng.seed(9);
    whole.forward(random_rows<double>(3, c.d_model, rng, 1.0), whole_cache, want);
    RowMatrix<double> w2(2, c.d_model);
    whole.forward(x, whole_cache, w2);
    parallel.forward(x, cache, out2);
    EXPECT_LE((out2 - w2).cwiseAbs().maxCoeff(), 1e-12);
}

}  // namespace

int main(int argc, char** argv) { return gattn_test::run_mpi_tests(argc, argv); }
