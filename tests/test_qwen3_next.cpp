// Qwen3-Next full attention against a fixture computed by an independent PyTorch implementation
// of Hugging Face's Qwen3NextAttention (scripts/make_qwen3_next_fixture.py): prefill of a ragged
// batch, token-by-token decoding and a two-token chunk through the KV cache, plus the loader's
// errors and the pitfalls that shipped in other ports, bad arguments, and NaN or ±∞ in unused cache
// slots and padding.

#include <gtest/gtest.h>

#include <cstdio>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__unix__) || defined(__APPLE__)
#include <sys/stat.h>
#endif

#include "gattn/gattn.hpp"
#include "gattn/io/hf_checkpoint.hpp"
#include "support/compare.hpp"
#include "support/safetensors_writer.hpp"

namespace {

using gattn::Index;
using gattn::RowMatrix;

const std::string kDir = std::string(GATTN_TEST_DATA_DIR) + "/qwen3_next";
constexpr Index kLayer = 3;

template <class Scalar>
struct Fixture {
    gattn::SafetensorsFile cases{kDir + "/cases.safetensors"};
    gattn::Qwen3NextAttention<Scalar> layer = gattn::load_qwen3_next_attention<Scalar>(kDir, kLayer);

    /// [B, n, D] tensor as [B·n, D] rows.
    RowMatrix<Scalar> rows(const std::string& name) const { return cases.matrix<Scalar>(name); }
    std::vector<Index> indices(const std::string& name) const {
        std::vector<Index> out;
        for (double v : cases.values<double>(name)) out.push_back(static_cast<Index>(v));
        return out;
    }
};

template <class Scalar>
double tolerance() {
    return std::is_same_v<Scalar, float> ? 1e-5 : 1e-12;
}

/// |got − want| ≤ tol·(1 + |want|) on the rows whose slot holds a token (t < counts[b]).
template <class Scalar>
void expect_rows_close(const RowMatrix<Scalar>& got, const RowMatrix<double>& want, Index batch,
                       const std::vector<Index>& counts, const std::string& what) {
    ASSERT_EQ(got.rows(), want.rows()) << what;
    const Index n = got.rows() / batch;
    int bad = 0;
    for (Index b = 0; b < batch; ++b)
        for (Index t = 0; t < counts[b]; ++t)
            for (Index c = 0; c < got.cols(); ++c) {
                const double g = got(b * n + t, c), w = want(b * n + t, c);
                if (!(std::abs(g - w) <= tolerance<Scalar>() * (1 + std::abs(w))) && ++bad <= 3)
                    ADD_FAILURE() << what << " sequence " << b << " token " << t << " col " << c << ": got " << g
                                  << ", want " << w;
            }
    EXPECT_EQ(bad, 0) << what;
}

template <class Scalar>
class Qwen3Next : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Qwen3Next, Scalars);

TYPED_TEST(Qwen3Next, PrefillDecodeAndChunkMatchPyTorch) {
    using S = TypeParam;
    Fixture<S> f;
    auto cache = f.layer.make_cache(2, 16);
    const std::vector<Index> lengths = f.indices("prefill.lengths");
    RowMatrix<S> out(14, 64), gates;
    f.layer.forward(f.rows("prefill.hidden"), f.indices("prefill.positions"), cache, out, lengths, &gates);
    expect_rows_close<S>(out, f.cases.template matrix<double>("prefill.output"), 2, lengths, "prefill");
    expect_rows_close<S>(gates, f.cases.template matrix<double>("prefill.gate"), 2, lengths, "prefill gate");
    EXPECT_EQ(cache.lengths(), (std::vector<Index>{7, 5}));
    EXPECT_TRUE((out.row(13).array() == 0).all()) << "padding slot output";

    for (int s = 0; s < 3; ++s) {
        const std::string step = "decode." + std::to_string(s) + ".";
        RowMatrix<S> y(2, 64);
        f.layer.forward(f.rows(step + "hidden"), f.indices(step + "positions"), cache, y);
        expect_rows_close<S>(y, f.cases.template matrix<double>(step + "output"), 2, {1, 1}, step);
    }
    RowMatrix<S> y(4, 64);
    f.layer.forward(f.rows("chunk.hidden"), f.indices("chunk.positions"), cache, y);
    expect_rows_close<S>(y, f.cases.template matrix<double>("chunk.output"), 2, {2, 2}, "chunk");
    EXPECT_EQ(cache.lengths(), (std::vector<Index>{12, 10}));
}

TYPED_TEST(Qwen3Next, PrefillEqualsTokenByTokenDecoding) {
    using S = TypeParam;
    Fixture<S> f;
    const RowMatrix<S> x = f.rows("prefill.hidden");
    const std::vector<Index> lengths = f.indices("prefill.lengths"), positions = f.indices("prefill.positions");
    auto prefill_cache = f.layer.make_cache(2, 8);
    RowMatrix<S> prefill(14, 64);
    f.layer.forward(x, positions, prefill_cache, prefill, lengths);
    auto step_cache = f.layer.make_cache(2, 8);
    for (Index t = 0; t < 7; ++t) {
        RowMatrix<S> xt(2, 64), yt(2, 64);
        xt.row(0) = x.row(t);
        xt.row(1) = x.row(7 + t);
        const std::vector<Index> counts{1, t < lengths[1] ? 1 : 0};
        f.layer.forward(xt, {positions[t], positions[7 + t]}, step_cache, yt, counts);
        for (Index b = 0; b < 2; ++b) {
            if (t >= lengths[b]) continue;
            const double err = (yt.row(b) - prefill.row(b * 7 + t)).cwiseAbs().maxCoeff();
            const double scale = prefill.row(b * 7 + t).cwiseAbs().maxCoeff();
            EXPECT_LE(err, tolerance<S>() * std::max(1.0, scale)) << "sequence " << b << " token " << t;
        }
    }
    EXPECT_EQ(step_cache.lengths(), prefill_cache.lengths());
}

/// The layer with bf16 weights (the F32 checkpoint rounded on load) and a bf16 cache, float
/// activations, against PyTorch's float64 outputs for the F32 weights: prefill, decoding and a
/// chunk. The bound covers the rounding of the weights, x, Q, K, V, P and U to bf16 (each a
/// relative 2⁻⁹ at most); worst observed |err| / (1 + |want|) ≈ 1.6e-3, NMSE ≈ 1.1e-6.
/// Storage: the weights' type; Cache: the KV cache's (Storage, or int8). Returns the worst
/// |err| / (1 + |want|) and the NMSE over every output and gate row with a token.
template <class Storage, class Cache>
std::pair<double, double> error_against_pytorch() {
    gattn::SafetensorsFile cases{kDir + "/cases.safetensors"};
    const auto layer = gattn::load_qwen3_next_attention<Storage>(kDir, kLayer);
    auto indices = [&](const std::string& name) {
        std::vector<Index> out;
        for (double v : cases.values<double>(name)) out.push_back(static_cast<Index>(v));
        return out;
    };
    double err2 = 0, ref2 = 0, worst = 0;
    auto check = [&](const RowMatrix<float>& got, const std::string& name, Index batch,
                     const std::vector<Index>& counts) {
        const RowMatrix<double> want = cases.matrix<double>(name);
        const Index n = got.rows() / batch;
        for (Index b = 0; b < batch; ++b)
            for (Index t = 0; t < counts[b]; ++t)
                for (Index c = 0; c < got.cols(); ++c) {
                    const double g = got(b * n + t, c), w = want(b * n + t, c);
                    worst = std::max(worst, std::abs(g - w) / (1 + std::abs(w)));
                    err2 += (g - w) * (g - w);
                    ref2 += w * w;
                }
    };
    auto cache = layer.template make_cache<Cache>(2, 16);
    const std::vector<Index> lengths = indices("prefill.lengths");
    RowMatrix<float> out(14, 64), gates;
    layer.forward(cases.matrix<float>("prefill.hidden"), indices("prefill.positions"), cache, out, lengths, &gates);
    check(out, "prefill.output", 2, lengths);
    check(gates, "prefill.gate", 2, lengths);
    for (int s = 0; s < 3; ++s) {
        const std::string step = "decode." + std::to_string(s) + ".";
        RowMatrix<float> y(2, 64);
        layer.forward(cases.matrix<float>(step + "hidden"), indices(step + "positions"), cache, y);
        check(y, step + "output", 2, {1, 1});
    }
    RowMatrix<float> y(4, 64);
    layer.forward(cases.matrix<float>("chunk.hidden"), indices("chunk.positions"), cache, y);
    check(y, "chunk.output", 2, {2, 2});
    EXPECT_EQ(cache.lengths(), (std::vector<Index>{12, 10}));
    return {worst, err2 / ref2};
}

TEST(Qwen3NextBf16, PrefillDecodeAndChunkMatchPyTorch) {
    const auto [worst, nmse] = error_against_pytorch<gattn::bfloat16, gattn::bfloat16>();
    EXPECT_LE(worst, 6e-3);
    EXPECT_LE(nmse, 1e-5);
    std::printf("bf16 Qwen3-Next layer against PyTorch float64: worst %.3g, NMSE %.3g\n", worst, nmse);
}

/// An int8 KV cache (keys and values quantized per token and KV head, ops/int8_rows.hpp) with
/// float and with bf16 weights, against PyTorch's float64 outputs for the F32 weights: the
/// quantization error (at most max|x| / 254 per element of a head row) is what remains.
/// Bounds: a few times what was measured (float weights: worst 3.0e-3, NMSE 1.3e-6).
TEST(Qwen3NextInt8Cache, PrefillDecodeAndChunkStayNearPyTorch) {
    const auto [worst, nmse] = error_against_pytorch<float, std::int8_t>();
    EXPECT_LE(worst, 1e-2);
    EXPECT_LE(nmse, 1e-5);
    EXPECT_GT(nmse, 0.0);
    std::printf("Qwen3-Next layer, int8 cache, against PyTorch float64: worst %.3g, NMSE %.3g\n", worst, nmse);
    const auto [worst16, nmse16] = error_against_pytorch<gattn::bfloat16, std::int8_t>();
    EXPECT_LE(worst16, 1.5e-2);
    EXPECT_LE(nmse16, 2e-5);
    std::printf("bf16 weights, int8 cache: worst %.3g, NMSE %.3g\n", worst16, nmse16);
}

/// A Qwen3-Next-sized layer with bf16 weights holds its weights' bf16 bytes (plus the float
/// norm weights), half of the float layer's: no widened copy is kept.
TEST(Qwen3NextBf16, HoldsItsBf16Bytes) {
    gattn::Qwen3NextConfig c;
    c.hidden_size = 2048;
    c.num_attention_heads = 16;
    c.num_key_value_heads = 2;
    c.head_dim = 256;
    c.partial_rotary_factor = 0.25;
    gattn::Qwen3NextAttentionWeights<float> w;
    w.q_proj_weight = RowMatrix<float>::Zero(2 * 16 * 256, 2048);
    w.k_proj_weight = RowMatrix<float>::Zero(2 * 256, 2048);
    w.v_proj_weight = RowMatrix<float>::Zero(2 * 256, 2048);
    w.o_proj_weight = RowMatrix<float>::Zero(2048, 16 * 256);
    w.q_norm_weight = gattn::Vector<float>::Zero(256);
    w.k_norm_weight = gattn::Vector<float>::Zero(256);
    const std::size_t params = std::size_t(2 * 16 * 256 + 4 * 256) * 2048 + std::size_t(2048) * 16 * 256;
    const gattn::Qwen3NextAttention<gattn::bfloat16> layer16(c, w.cast<gattn::bfloat16>());
    const gattn::Qwen3NextAttention<float> layer32(c, w);
    EXPECT_EQ(layer16.weight_bytes(), 2 * params + 4 * 512);  // 52 MiB of bf16 projections
    EXPECT_EQ(layer32.weight_bytes(), 4 * params + 4 * 512);
}

/// NaN and ±∞ in the cache rows past each sequence's length (left there by a rolled-back
/// speculative step, say) and in the input rows of padding slots are never read into a result:
/// prefill and decoding give bitwise the outputs and first-token attention of a zeroed cache and
/// finite padding, and padding rows stay exactly 0.
TYPED_TEST(Qwen3Next, NonFiniteUnusedCacheSlotsNeverReachTheOutput) {
    using S = TypeParam;
    Fixture<S> f;
    const std::vector<Index> lengths = f.indices("prefill.lengths"), positions = f.indices("prefill.positions");
    const RowMatrix<S> x = f.rows("prefill.hidden");
    const Index capacity = 16, B = 2, N = x.rows() / B;
    constexpr S kNaN = std::numeric_limits<S>::quiet_NaN(), kInf = std::numeric_limits<S>::infinity();
    auto clean = f.layer.make_cache(B, capacity), dirty = f.layer.make_cache(B, capacity);
    const Index kv_cols = dirty.keys().cols();
    RowMatrix<S> junk_k(B * capacity, kv_cols), junk_v(B * capacity, dirty.values().cols());
    for (Index r = 0; r < junk_k.rows(); ++r) {
        junk_k.row(r).setConstant(r % 3 == 0 ? kNaN : r % 3 == 1 ? kInf : -kInf);
        junk_v.row(r).setConstant(r % 3 == 0 ? -kInf : r % 3 == 1 ? kNaN : kInf);
    }
    dirty.append(junk_k, junk_v, {capacity, capacity});
    dirty.truncate({0, 0});
    clean.append(RowMatrix<S>::Zero(B * capacity, kv_cols), RowMatrix<S>::Zero(B * capacity, kv_cols),
                 {capacity, capacity});
    clean.truncate({0, 0});

    RowMatrix<S> x_dirty = x;
    for (Index b = 0; b < B; ++b)
        for (Index t = lengths[b]; t < N; ++t) x_dirty.row(b * N + t).setConstant(t % 2 ? kNaN : -kInf);
    ASSERT_LT(lengths[1], N) << "the case should have padding slots";
    RowMatrix<S> out_clean(B * N, 64), out_dirty(B * N, 64), first_clean, first_dirty;
    f.layer.forward(x, positions, clean, out_clean, lengths, nullptr, &first_clean);
    f.layer.forward(x_dirty, positions, dirty, out_dirty, lengths, nullptr, &first_dirty);
    EXPECT_TRUE(out_dirty.allFinite());
    EXPECT_EQ(out_dirty, out_clean);
    EXPECT_EQ(first_dirty, first_clean);
    for (Index b = 0; b < B; ++b) {
        for (Index t = lengths[b]; t < N; ++t) EXPECT_TRUE((out_dirty.row(b * N + t).array() == S(0)).all());
        // The slots past the new length still hold the junk: it was there to be read.
        EXPECT_FALSE(dirty.keys().row(b * capacity + lengths[b]).allFinite());
        EXPECT_FALSE(dirty.values().row(b * capacity + capacity - 1).allFinite());
    }
    for (int s = 0; s < 3; ++s) {
        const std::string step = "decode." + std::to_string(s) + ".";
        RowMatrix<S> y_clean(B, 64), y_dirty(B, 64);
        f.layer.forward(f.rows(step + "hidden"), f.indices(step + "positions"), clean, y_clean);
        f.layer.forward(f.rows(step + "hidden"), f.indices(step + "positions"), dirty, y_dirty);
        EXPECT_TRUE(y_dirty.allFinite()) << step;
        EXPECT_EQ(y_dirty, y_clean) << step;
    }
}

/// Weights of the fixture layer, for the pitfall tests.
gattn::Qwen3NextAttentionWeights<double> fixture_weights(gattn::Qwen3NextConfig& config) {
    config = gattn::load_qwen3_next_config(kDir + "/config.json", kLayer);
    return gattn::load_qwen3_next_attention_weights<double>(kDir, kLayer, config);
}

/// A shard read from the checkpoint holds exactly its heads' rows and columns of the whole
/// layer's tensors, cut here by hand: head h's query and gate rows [2dh, 2d(h + 1)) of q_proj,
/// KV head g's rows [dg, d(g + 1)) of k_proj and v_proj, and columns [dh, d(h + 1)) of o_proj.
TEST(Qwen3Next, AShardReadFromTheCheckpointHoldsItsHeadsRows) {
    gattn::Qwen3NextConfig config;
    const auto whole = fixture_weights(config);
    const Index d = config.head_dim;
    ASSERT_TRUE(config.attn_output_gate);
    gattn::HeadShard shard;  // query heads 2 and 3, KV head 1 (of 4 and 2)
    shard.first_head = 2;
    shard.num_heads = 2;
    shard.first_kv_head = 1;
    shard.num_kv_heads = 1;
    const auto [shard_config, w] = gattn::load_qwen3_next_attention_shard<double>(kDir, kLayer, config, shard);
    EXPECT_EQ(shard_config.num_attention_heads, 2);
    EXPECT_EQ(shard_config.num_key_value_heads, 1);
    EXPECT_EQ(w.q_proj_weight, whole.q_proj_weight.middleRows(2 * 2 * d, 2 * 2 * d));
    EXPECT_EQ(w.k_proj_weight, whole.k_proj_weight.middleRows(d, d));
    EXPECT_EQ(w.v_proj_weight, whole.v_proj_weight.middleRows(d, d));
    EXPECT_EQ(w.o_proj_weight, whole.o_proj_weight.middleCols(2 * d, 2 * d));
    EXPECT_EQ(w.q_norm_weight, whole.q_norm_weight);
    EXPECT_EQ(w.k_norm_weight, whole.k_norm_weight);
    shard.first_kv_head = 2;  // past the config's 2 KV heads
    EXPECT_THROW((gattn::load_qwen3_next_attention_shard<double>(kDir, kLayer, config, shard)), std::invalid_argument);
}

double prefill_error(const gattn::Qwen3NextConfig& config, const gattn::Qwen3NextAttentionWeights<double>& w) {
    const gattn::SafetensorsFile cases(kDir + "/cases.safetensors");
    const gattn::Qwen3NextAttention<double> layer(config, w);
    auto cache = layer.make_cache(2, 8);
    RowMatrix<double> out(14, 64);
    std::vector<Index> positions;
    for (double p : cases.values<double>("prefill.positions")) positions.push_back(static_cast<Index>(p));
    layer.forward(cases.matrix<double>("prefill.hidden"), positions, cache, out, {7, 5});
    const RowMatrix<double> want = cases.matrix<double>("prefill.output");
    return (out.topRows(12) - want.topRows(12)).cwiseAbs().maxCoeff();  // rows 12, 13 are padding
}

TEST(Qwen3NextPitfalls, FlatQGateSplitIsCaught) {
    // Reading q_proj as [all queries | all gates] instead of per-head [q_h | gate_h].
    gattn::Qwen3NextConfig c;
    auto w = fixture_weights(c);
    ASSERT_LT(prefill_error(c, w), 1e-12);
    const Index H = c.num_attention_heads, d = c.head_dim;
    RowMatrix<double> flat = w.q_proj_weight;
    for (Index h = 0; h < H; ++h) {  // what the fused layout would hold if the split were flat
        flat.middleRows(h * 2 * d, d) = w.q_proj_weight.middleRows(h * d, d);
        flat.middleRows(h * 2 * d + d, d) = w.q_proj_weight.middleRows(H * d + h * d, d);
    }
    auto wrong = w;
    wrong.q_proj_weight = flat;
    EXPECT_GT(prefill_error(c, wrong), 1e-3);
}

TEST(Qwen3NextPitfalls, QProjOfAnotherLayoutIsNamed) {
    // q_proj without gate rows for a gated layer, or with them for an ungated one: the shape
    // error says which layout the rows fit.
    gattn::Qwen3NextConfig c;
    const auto w = fixture_weights(c);
    const Index H = c.num_attention_heads, d = c.head_dim, D = c.hidden_size;
    auto shape = [](Index r, Index k) { return "[" + std::to_string(r) + ", " + std::to_string(k) + "]"; };
    auto message = [&](const gattn::Qwen3NextConfig& config, const gattn::Qwen3NextAttentionWeights<double>& weights) {
        try {
            gattn::Qwen3NextAttention<double> layer(config, weights);
        } catch (const gattn::shape_error& e) {
            return std::string(e.what());
        }
        return std::string("no exception");
    };
    auto without_gate = w;
    without_gate.q_proj_weight = w.q_proj_weight.topRows(H * d);
    const std::string a = message(c, without_gate);
    EXPECT_NE(a.find("q_proj.weight must have shape " + shape(2 * H * d, D) + ", got " + shape(H * d, D) +
                     " (no gate rows:"),
              std::string::npos)
        << a;
    auto ungated = c;
    ungated.attn_output_gate = false;
    const std::string b = message(ungated, w);
    EXPECT_NE(b.find("got " + shape(2 * H * d, D) + " (query and gate rows: this config has attn_output_gate = false)"),
              std::string::npos)
        << b;
}

TEST(Qwen3NextPitfalls, InfiniteEpsilonOrThetaIsRefused) {
    // A config built in code (JSON cannot say ∞): ε = ∞ would zero every query and key, θ = ∞
    // every rotation; both are refused, as the layer of to_attention_config(c) refuses them.
    gattn::Qwen3NextConfig fixture;
    const auto w = fixture_weights(fixture);
    const double inf = std::numeric_limits<double>::infinity();
    for (const bool eps : {true, false}) {
        gattn::Qwen3NextConfig c = fixture;
        (eps ? c.rms_norm_eps : c.rope_theta) = inf;
        const std::string expected = eps ? "config.rms_norm_eps must be finite and >= 0, got inf"
                                         : "config.rope_theta must be finite and > 0, got inf";
        try {
            gattn::Qwen3NextAttention<double> layer(c, w);
            ADD_FAILURE() << expected << ": accepted";
        } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
        }
        EXPECT_THROW(gattn::to_attention_config(c), std::invalid_argument);
    }
}

TEST(Qwen3NextPitfalls, GqaUsesContiguousGroupsNotModulo) {
    // With h mod H_kv, heads 1 and 2 would swap KV heads; swapping the KV heads' weights emulates
    // that mistake and must change the output.
    gattn::Qwen3NextConfig c;
    auto w = fixture_weights(c);
    const Index d = c.head_dim;
    auto wrong = w;
    wrong.k_proj_weight.topRows(d) = w.k_proj_weight.bottomRows(d);
    wrong.k_proj_weight.bottomRows(d) = w.k_proj_weight.topRows(d);
    wrong.v_proj_weight.topRows(d) = w.v_proj_weight.bottomRows(d);
    wrong.v_proj_weight.bottomRows(d) = w.v_proj_weight.topRows(d);
    EXPECT_GT(prefill_error(c, wrong), 1e-3);
}

TEST(Qwen3NextPitfalls, NormUsesOnePlusWeight) {
    // A norm computing x̂·w would equal ours with weights w − 1: the fixture must reject it.
    gattn::Qwen3NextConfig c;
    auto w = fixture_weights(c);
    auto wrong = w;
    wrong.q_norm_weight.array() -= 1.0;
    wrong.k_norm_weight.array() -= 1.0;
    EXPECT_GT(prefill_error(c, wrong), 1e-3);
}

TEST(Qwen3NextPitfalls, GateIgnoresQueryNormAndPositions) {
    gattn::Qwen3NextConfig c;
    auto w = fixture_weights(c);
    const gattn::SafetensorsFile cases(kDir + "/cases.safetensors");
    const RowMatrix<double> x = cases.matrix<double>("prefill.hidden").topRows(7);
    auto gates_of = [&](const gattn::Qwen3NextAttentionWeights<double>& weights, Index offset) {
        const gattn::Qwen3NextAttention<double> layer(c, weights);
        auto cache = layer.make_cache(1, 8);
        RowMatrix<double> out(7, 64), gates;
        std::vector<Index> positions(7);
        for (Index t = 0; t < 7; ++t) positions[t] = t + offset;
        layer.forward(x, positions, cache, out, {}, &gates);
        return std::make_pair(gates, out);
    };
    auto other = w;
    other.q_norm_weight.setConstant(0.7);
    const auto base = gates_of(w, 0), renormed = gates_of(other, 0), shifted = gates_of(w, 1000);
    EXPECT_EQ(base.first, renormed.first);
    EXPECT_EQ(base.first, shifted.first);
    EXPECT_GT((base.second - renormed.second).cwiseAbs().maxCoeff(), 1e-6) << "q_norm must still act on the query";
}

/// Continuous batching over a paged pool: three sequences starting, decoding and prefilling
/// in chunks at different steps, against each sequence alone through a KVCache (positions
/// after its tokens). The gate scores of the step's rows come out in the step's row order. The
/// same steps over a twin pool on one thread give the same bits and pages as over the pool on
/// two.
template <class S, class PoolScalar>
void check_qwen3_next_over_pool(double atol) {
    gattn::Qwen3NextConfig c = gattn::load_qwen3_next_config(kDir + "/config.json", kLayer);
    const gattn::Qwen3NextAttention<S> layer(c, gattn::load_qwen3_next_attention_weights<S>(kDir, kLayer, c));
    gattn::PagedKVPool<PoolScalar> pool(32, 16, c.num_key_value_heads, c.head_dim), twin = pool;
    const std::vector<gattn::SequenceId> seqs{pool.allocate(), pool.allocate(), pool.allocate()};
    for (int b = 0; b < 3; ++b) twin.allocate();
    std::vector<gattn::KVCache<PoolScalar>> alone;
    for (int b = 0; b < 3; ++b) alone.push_back(layer.template make_cache<PoolScalar>(1, 64));
    const std::vector<std::vector<Index>> schedule = {{5, 9, 0}, {1, 1, 7}, {1, 0, 1}, {3, 1, 17}, {1, 1, 1}};
    std::mt19937 rng(26);
    std::uniform_real_distribution<double> dist(-1.0, 1.0);
    for (const std::vector<Index>& counts : schedule) {
        std::vector<Index> indptr{0};
        for (Index n : counts) indptr.push_back(indptr.back() + n);
        RowMatrix<S> x(indptr.back(), c.hidden_size), out(indptr.back(), c.hidden_size);
        for (Index i = 0; i < x.size(); ++i) x.data()[i] = static_cast<S>(dist(rng));
        RowMatrix<S> gates;
#ifdef _OPENMP
        const int saved_threads = omp_get_max_threads();
        omp_set_num_threads(2);
#endif
        layer.forward(x, indptr, pool, seqs, out, &gates);
#ifdef _OPENMP
        omp_set_num_threads(1);
#endif
        RowMatrix<S> one_thread(indptr.back(), c.hidden_size);
        layer.forward(x, indptr, twin, seqs, one_thread);
#ifdef _OPENMP
        omp_set_num_threads(saved_threads);
#endif
        EXPECT_TRUE(gattn_test::same_bytes(one_thread, out)) << "1 and 2 threads";
        for (gattn::SequenceId seq : seqs) EXPECT_EQ(twin.pages(seq), pool.pages(seq)) << "1 and 2 threads";
        for (std::size_t b = 0; b < 3; ++b) {
            const Index n = counts[b], r0 = indptr[b];
            if (n == 0) continue;
            std::vector<Index> positions;
            for (Index t = 0; t < n; ++t) positions.push_back(alone[b].lengths()[0] + t);
            RowMatrix<S> y(n, c.hidden_size), gates_alone;
            layer.forward(x.middleRows(r0, n), positions, alone[b], y, {}, &gates_alone);
            const std::string where = "sequence " + std::to_string(b) + ", tokens from " + std::to_string(positions[0]);
            gattn_test::expect_close(out.middleRows(r0, n), y, atol, 1e-6, where);
            gattn_test::expect_close(gates.middleRows(r0, n), gates_alone, 1e-12, 1e-6, where + ", gate scores");
        }
    }
    for (std::size_t b = 0; b < 3; ++b) EXPECT_EQ(pool.length(seqs[b]), alone[b].lengths()[0]);
}

TEST(Qwen3NextPaged, MixedBatchStepsEqualEachSequenceAlone) {
    check_qwen3_next_over_pool<double, double>(1e-12);
    check_qwen3_next_over_pool<float, float>(1e-5);
    check_qwen3_next_over_pool<float, std::int8_t>(2e-2);
}

TEST(Qwen3NextSinks, SinkLogitJoinsTheDenominatorPerHead) {
    // A sequence's first token attends only to itself, with probability e^ℓ / (e^ℓ + e^s) =
    // σ(ℓ − s) for sink logit s. So logit(p) = ℓ − s: moving head h's sink by δ moves logit(p)
    // by −δ whatever ℓ is, and an absent sink (−∞) gives p = 1. Later tokens spread over more
    // keys, so the first-key share falls with a larger sink too.
    gattn::Qwen3NextConfig c;
    auto w = fixture_weights(c);
    const Index H = c.num_attention_heads;
    const gattn::SafetensorsFile cases(kDir + "/cases.safetensors");
    const RowMatrix<double> x = cases.matrix<double>("prefill.hidden").topRows(7);
    auto first_key = [&](const std::vector<double>& sinks) {
        auto config = c;
        config.attention_sinks = true;
        auto weights = w;
        weights.sinks = Eigen::Map<const gattn::Vector<double>>(sinks.data(), H);
        const gattn::Qwen3NextAttention<double> layer(config, weights);
        auto cache = layer.make_cache(1, 8);
        RowMatrix<double> out(7, c.hidden_size), probability;
        layer.forward(x, {0, 1, 2, 3, 4, 5, 6}, cache, out, {}, nullptr, &probability);
        return probability;
    };
    std::vector<double> a(H), b(H), none(H, -std::numeric_limits<double>::infinity());
    for (Index h = 0; h < H; ++h) {
        a[h] = -1.0 + 0.5 * double(h);
        b[h] = a[h] + 0.25 + 0.5 * double(h);
    }
    const RowMatrix<double> pa = first_key(a), pb = first_key(b), p0 = first_key(none);
    auto logit = [](double p) { return std::log(p / (1 - p)); };
    for (Index h = 0; h < H; ++h) {
        EXPECT_DOUBLE_EQ(p0(0, h), 1.0) << "head " << h;
        EXPECT_NEAR(logit(pa(0, h)) - logit(pb(0, h)), b[h] - a[h], 1e-12) << "head " << h;
        for (Index t = 1; t < 7; ++t) EXPECT_LT(pb(t, h), pa(t, h)) << "head " << h << " token " << t;
    }
}

TEST(Qwen3NextSinks, SinksMustMatchTheConfig) {
    gattn::Qwen3NextConfig c;
    auto w = fixture_weights(c);
    auto message = [](const gattn::Qwen3NextConfig& config, const gattn::Qwen3NextAttentionWeights<double>& weights) {
        try {
            gattn::Qwen3NextAttention<double> layer(config, weights);
        } catch (const gattn::shape_error& e) {
            return std::string(e.what());
        }
        return std::string("no exception");
    };
    auto with_sinks = w;
    with_sinks.sinks = gattn::Vector<double>::Zero(c.num_attention_heads);
    EXPECT_NE(message(c, with_sinks).find("sinks must be empty: attention_sinks is false, got [4]"), std::string::npos)
        << message(c, with_sinks);
    auto sink_config = c;
    sink_config.attention_sinks = true;
    EXPECT_NE(message(sink_config, w).find("sinks must have shape [4], got [0] (missing: this config uses it)"),
              std::string::npos)
        << message(sink_config, w);
}

TEST(Qwen3NextPitfalls, ScaleIsOneOverRootHeadDim) {
    gattn::Qwen3NextConfig c;
    fixture_weights(c);
    EXPECT_NE(c.head_dim, c.hidden_size / c.num_attention_heads) << "the fixture must tell the two scales apart";
    EXPECT_EQ(c.rotary_dim(), 8);
}

TEST(Qwen3NextLoader, ReportsBadCheckpoints) {
    namespace fs = std::filesystem;
    EXPECT_THROW(gattn::load_qwen3_next_config(kDir + "/config.json", 1), std::invalid_argument);  // linear layer
    EXPECT_THROW(gattn::load_qwen3_next_config(kDir + "/config.json", 9), std::invalid_argument);  // out of range
    EXPECT_THROW(gattn::load_qwen3_next_config(kDir + "/missing.json"), gattn::io_error);
    const fs::path dir = fs::temp_directory_path() / "gattn_qwen3_next_bad";
    fs::create_directories(dir);
    std::ofstream(dir / "config.json") << "{\"hidden_size\": 64,";
    EXPECT_THROW(gattn::load_qwen3_next_config((dir / "config.json").string()), gattn::io_error);
    fs::copy_file(kDir + "/config.json", dir / "config.json", fs::copy_options::overwrite_existing);
    EXPECT_THROW(gattn::load_qwen3_next_attention<float>(dir.string(), kLayer), gattn::io_error);  // no weights
    // A path the system cannot examine (a name over NAME_MAX) is an io_error too.
    EXPECT_THROW(gattn::load_qwen3_next_attention_weights<float>((dir / std::string(300, 'x')).string(), kLayer,
                                                                 gattn::load_qwen3_next_config(kDir + "/config.json",
                                                                                               kLayer)),
                 gattn::io_error);
    // A config that disagrees with the checkpoint: the message names the tensor and both shapes.
    try {
        auto c = gattn::load_qwen3_next_config(kDir + "/config.json", kLayer);
        c.num_key_value_heads = 4;  // k_proj in the file has 2 heads
        gattn::load_qwen3_next_attention_weights<float>(kDir, kLayer, c);
        ADD_FAILURE() << "no exception";
    } catch (const gattn::shape_error& e) {
        EXPECT_NE(std::string(e.what()).find(
                      "model.layers.3.self_attn.k_proj.weight must have shape [128, 64], got [64, 64]"),
                  std::string::npos)
            << e.what();
    }
}

/// A checkpoint directory holding the fixture's config and layer 3 as `tensors` (HF names).
std::string write_checkpoint(const std::string& name, const std::vector<gattn_test::RawTensor>& tensors,
                             std::size_t truncate = 0) {
    namespace fs = std::filesystem;
    const fs::path dir = fs::temp_directory_path() / ("gattn_qwen3_next_" + name);
    fs::create_directories(dir);
    fs::copy_file(kDir + "/config.json", dir / "config.json", fs::copy_options::overwrite_existing);
    gattn_test::write_safetensors((dir / "model.safetensors").string(), tensors, "", truncate);
    return dir.string();
}

std::vector<gattn_test::RawTensor> fixture_tensors(const std::string& skip = "") {
    gattn::Qwen3NextConfig c;
    const auto w = fixture_weights(c);
    std::vector<gattn_test::RawTensor> t;
    auto add = [&](const char* name, const auto& m, bool vec) {
        if (name != skip)
            t.push_back(
                gattn_test::f32_tensor(std::string("model.layers.3.self_attn.") + name, m.template cast<float>(), vec));
    };
    add("q_proj.weight", w.q_proj_weight, false);
    add("k_proj.weight", w.k_proj_weight, false);
    add("v_proj.weight", w.v_proj_weight, false);
    add("o_proj.weight", w.o_proj_weight, false);
    add("q_norm.weight", RowMatrix<double>(w.q_norm_weight.transpose()), true);
    add("k_norm.weight", RowMatrix<double>(w.k_norm_weight.transpose()), true);
    return t;
}

template <class E>
void expect_load_error(const std::string& dir, const std::string& needle) {
    try {
        gattn::load_qwen3_next_attention<float>(dir, kLayer);
        ADD_FAILURE() << "no exception; expected one mentioning " << needle;
    } catch (const E& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
}

TEST(Qwen3NextLoader, NamesEveryCheckpointFault) {
    // The rewritten fixture loads and gives the same output as the original.
    const auto good = gattn::load_qwen3_next_attention<float>(write_checkpoint("good", fixture_tensors()), kLayer);
    (void)good;
    expect_load_error<gattn::io_error>(write_checkpoint("missing", fixture_tensors("o_proj.weight")),
                                       "missing tensor 'model.layers.3.self_attn.o_proj.weight'");
    expect_load_error<gattn::io_error>(write_checkpoint("truncated", fixture_tensors(), 100), "truncated");
    auto ints = fixture_tensors();
    for (auto& t : ints)
        if (t.name.find("v_proj") != std::string::npos) t.dtype = "I32";
    expect_load_error<gattn::io_error>(write_checkpoint("int_weight", ints), "has dtype I32");
    // A headwise-gate checkpoint: q_proj holds H·d query rows and H gate rows.
    auto headwise = fixture_tensors("q_proj.weight");
    headwise.push_back(
        gattn_test::f32_tensor("model.layers.3.self_attn.q_proj.weight", RowMatrix<float>::Random(132, 64)));
    expect_load_error<gattn::shape_error>(write_checkpoint("headwise", headwise), "headwise gate checkpoint");
    // A q_proj without gate rows (a layer whose gate has its own gate_proj).
    auto ungated = fixture_tensors("q_proj.weight");
    ungated.push_back(
        gattn_test::f32_tensor("model.layers.3.self_attn.q_proj.weight", RowMatrix<float>::Random(128, 64)));
    expect_load_error<gattn::shape_error>(write_checkpoint("no_gate_rows", ungated), "(no gate rows:");
}

/// The fixture's config.json with `edit` applied, written to a directory of its own.
std::string edited_config(const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    namespace fs = std::filesystem;
    nlohmann::json j = nlohmann::json::parse(std::ifstream(kDir + "/config.json"));
    edit(j);
    const fs::path dir = fs::temp_directory_path() / ("gattn_qwen3_next_config_" + name);
    fs::create_directories(dir);
    std::ofstream(dir / "config.json") << j.dump();
    return (dir / "config.json").string();
}

/// Expects load_qwen3_next_config(path, layer) to throw exactly E with `part` in its message.
template <class E>
void expect_config_error(const std::string& path, Index layer, const std::string& part) {
    try {
        gattn::load_qwen3_next_config(path, layer);
        ADD_FAILURE() << "no exception; expected one mentioning " << part;
    } catch (const std::exception& e) {
        EXPECT_TRUE(dynamic_cast<const E*>(&e) != nullptr) << e.what();
        EXPECT_EQ(dynamic_cast<const gattn::io_error*>(&e) != nullptr, (std::is_same_v<E, gattn::io_error>))
            << e.what();
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << "'" << part << "' in " << e.what();
    }
}

TEST(Qwen3NextLoader, ConfigFieldsOfTheWrongTypeOrRange) {
    using gattn::io_error;
    using std::invalid_argument;
    using J = nlohmann::json;
    const std::string interval0 = edited_config("interval0", [](J& j) {
        j.erase("layer_types");
        j["full_attention_interval"] = 0;
    });
    expect_config_error<io_error>(interval0, kLayer, "\"full_attention_interval\" must be at least 1, got 0");
    expect_config_error<io_error>(interval0, -1, "\"full_attention_interval\" must be at least 1, got 0");
    expect_config_error<io_error>(edited_config("interval_string",
                                                [](J& j) {
                                                    j.erase("layer_types");
                                                    j["full_attention_interval"] = "4";
                                                }),
                                  kLayer, "\"full_attention_interval\" must be an integer, got \"4\"");
    expect_config_error<io_error>(edited_config("layers_string", [](J& j) { j["num_hidden_layers"] = "4"; }), kLayer,
                                  "\"num_hidden_layers\" must be an integer");
    expect_config_error<io_error>(edited_config("type_null", [](J& j) { j["layer_types"][3] = nullptr; }), kLayer,
                                  "\"layer_types\" entry 3 must be a string, got null");
    expect_config_error<io_error>(edited_config("head_dim_fraction", [](J& j) { j["head_dim"] = 8.5; }), -1,
                                  "\"head_dim\" must be an integer, got 8.5");
    expect_config_error<io_error>(edited_config("hidden_huge", [](J& j) { j["hidden_size"] = 1e30; }), -1,
                                  "\"hidden_size\" must be an integer");
    expect_config_error<io_error>(edited_config("bias_string", [](J& j) { j["attention_bias"] = "false"; }), -1,
                                  "\"attention_bias\" must be true or false");
    expect_config_error<io_error>(edited_config("sinks_number", [](J& j) { j["attention_sinks"] = 1; }), -1,
                                  "\"attention_sinks\" must be true or false, got 1");
    EXPECT_TRUE(gattn::load_qwen3_next_config(edited_config("sinks", [](J& j) { j["attention_sinks"] = true; }), kLayer)
                    .attention_sinks);
    // Optional objects of another type are refused, not skipped.
    expect_config_error<io_error>(edited_config("rope_parameters_number", [](J& j) { j["rope_parameters"] = 5; }), -1,
                                  "\"rope_parameters\" must be an object or null, got 5");
    expect_config_error<io_error>(edited_config("text_config_number", [](J& j) { j["text_config"] = 1; }), -1,
                                  "\"text_config\" must be an object or null, got 1");
    expect_config_error<io_error>(edited_config("top_level_array",
                                                [](J& j) {
                                                    j = J::array({1, 2});
                                                }),
                                  -1, "must hold a JSON object");
#if defined(__unix__) || defined(__APPLE__)
    {  // A FIFO is refused before it is opened (opening it would block).
        const std::filesystem::path fifo = std::filesystem::temp_directory_path() / "gattn_qwen3_next_config_fifo.json";
        std::filesystem::remove(fifo);
        ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
        expect_config_error<io_error>(fifo.string(), -1, "not a regular file");
        std::filesystem::remove(fifo);
    }
#endif
    expect_config_error<invalid_argument>(edited_config("heads_zero", [](J& j) { j["num_attention_heads"] = 0; }), -1,
                                          "config.num_attention_heads must be in [1, 2^24], got 0");
    // RoPE scaling changes the rotary frequencies; gattn applies plain RoPE, so it refuses them.
    expect_config_error<invalid_argument>(
        edited_config("yarn",
                      [](J& j) {
                          j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
                      }),
        -1, "rope_scaling.rope_type must be \"default\": gattn applies unscaled RoPE, got \"yarn\"");
    expect_config_error<invalid_argument>(
        edited_config("linear",
                      [](J& j) {
                          j["rope_parameters"] = {{"type", "linear"}, {"factor", 4.0}};
                      }),
        -1, "rope_parameters.type must be \"default\"");
    const auto plain = gattn::load_qwen3_next_config(
        edited_config("default_rope",
                      [](J& j) {
                          j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e6}};
                      }),
        kLayer);
    EXPECT_EQ(plain.rope_theta, 10000.0) << "the top-level rope_theta comes first";
    const auto mrope = gattn::load_qwen3_next_config(
        edited_config("mrope",
                      [](J& j) {
                          j["rope_scaling"] = {{"type", "mrope"}, {"mrope_section", {2, 1, 1}}};
                      }),
        kLayer);
    EXPECT_EQ(mrope.rotary_dim(), plain.rotary_dim());
    // transformers' defaults: head_dim 256, and without layer_types every 4th layer is full attention.
    const std::string bare = edited_config("defaults", [](J& j) {
        j.erase("head_dim");
        j.erase("layer_types");
        j.erase("full_attention_interval");
    });
    EXPECT_EQ(gattn::load_qwen3_next_config(bare, 3).head_dim, 256);
    expect_config_error<invalid_argument>(bare, 2, "2 is a linear_attention layer");
}

TEST(Qwen3NextLoader, ReadsShardedCheckpoints) {
    namespace fs = std::filesystem;
    const fs::path dir = fs::temp_directory_path() / "gattn_qwen3_next_sharded";
    fs::create_directories(dir);
    fs::copy_file(kDir + "/config.json", dir / "config.json", fs::copy_options::overwrite_existing);
    auto tensors = fixture_tensors();
    const std::vector<gattn_test::RawTensor> first(tensors.begin(), tensors.begin() + 3),
        second(tensors.begin() + 3, tensors.end());
    gattn_test::write_safetensors((dir / "model-00001-of-00002.safetensors").string(), first);
    gattn_test::write_safetensors((dir / "model-00002-of-00002.safetensors").string(), second);
    nlohmann::json index;
    for (const auto& t : first) index["weight_map"][t.name] = "model-00001-of-00002.safetensors";
    for (const auto& t : second) index["weight_map"][t.name] = "model-00002-of-00002.safetensors";
    std::ofstream(dir / "model.safetensors.index.json") << index.dump();
    gattn::Qwen3NextConfig c;
    const auto want = fixture_weights(c);
    const auto got = gattn::load_qwen3_next_attention_weights<double>(dir.string(), kLayer, c);
    EXPECT_EQ(got.o_proj_weight, want.o_proj_weight.cast<float>().cast<double>());
    EXPECT_EQ(got.k_norm_weight, want.k_norm_weight.cast<float>().cast<double>());
    index["weight_map"][first[0].name] = 1;  // not a file name
    std::ofstream(dir / "model.safetensors.index.json") << index.dump();
    try {
        gattn::load_qwen3_next_attention_weights<double>(dir.string(), kLayer, c);
        ADD_FAILURE() << "no exception";
    } catch (const gattn::io_error& e) {
        EXPECT_NE(std::string(e.what()).find("weight_map entry '" + first[0].name + "' must be a file name, got 1"),
                  std::string::npos)
            << e.what();
    }
}

/// A config.json is checked without undefined behaviour whatever its numbers and the layer asked
/// for; JSON nested deeper than 128 levels is refused before it is copied or printed.
TEST(Qwen3NextLoader, ConfigLimits) {
    using gattn::io_error;
    using std::invalid_argument;
    using J = nlohmann::json;
    // Without num_hidden_layers and layer_types every 4th layer is full attention, up to the
    // largest Index: 2^63 − 1 ≡ 3 (mod 4) is one, 2^63 − 2 is not.
    const std::string bare = edited_config("interval_only", [](J& j) {
        j.erase("num_hidden_layers");
        j.erase("layer_types");
    });
    constexpr Index kMax = std::numeric_limits<Index>::max();
    EXPECT_EQ(gattn::load_qwen3_next_config(bare, kMax).head_dim, 32);
    expect_config_error<invalid_argument>(bare, kMax - 1, "9223372036854775806 is a linear_attention layer");
    expect_config_error<invalid_argument>(edited_config("interval_huge",
                                                        [&](J& j) {
                                                            j.erase("num_hidden_layers");
                                                            j.erase("layer_types");
                                                            j["full_attention_interval"] = kMax;
                                                        }),
                                          kMax, "9223372036854775807 is a linear_attention layer");
    // partial_rotary_factor is checked before rotary_dim() = head_dim · factor is formed.
    expect_config_error<invalid_argument>(edited_config("rotary_huge",
                                                        [](J& j) { j["partial_rotary_factor"] = 1e300; }),
                                          -1, "config.partial_rotary_factor must be in (0, 1], got 1e+300");
    expect_config_error<invalid_argument>(edited_config("rotary_negative",
                                                        [](J& j) { j["partial_rotary_factor"] = -0.5; }),
                                          -1, "config.partial_rotary_factor must be in (0, 1], got -0.5");
    expect_config_error<invalid_argument>(edited_config("rotary_odd",
                                                        [](J& j) { j["partial_rotary_factor"] = 0.09375; }),
                                          -1, "must give an even rotary_dim in [2, head_dim], got 3");
    // A key named twice keeps its last value, as Python's json module (and so transformers) reads it.
    namespace fs = std::filesystem;
    const fs::path dir = fs::temp_directory_path() / "gattn_qwen3_next_config_text";
    fs::create_directories(dir);
    const std::string path = (dir / "config.json").string();
    std::ofstream(path) << R"({"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                              "hidden_size": 64, "partial_rotary_factor": 0.5})";
    EXPECT_EQ(gattn::load_qwen3_next_config(path).hidden_size, 64);
    // Nesting: 128 levels read (here a config whose rope_scaling.type is an array 127 deep, refused
    // for its type), 129 and 100000 are refused as the text is parsed.
    auto nested = [&](int arrays) {
        std::ofstream(path)
            << R"({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_scaling": {"type": )"
            << std::string(arrays, '[') << std::string(arrays, ']') << "}}";
        return path;
    };
    expect_config_error<io_error>(nested(126), -1, "\"rope_scaling.type\" must be a string, got [[[");
    expect_config_error<io_error>(nested(127), -1, "JSON nested deeper than 128 levels");
    expect_config_error<io_error>(nested(100000), -1, "JSON nested deeper than 128 levels");
    std::ofstream(path) << "{\"text_config\": " << std::string(100000, '[') << std::string(100000, ']') << "}";
    expect_config_error<io_error>(path, -1, "JSON nested deeper than 128 levels");
}

/// weight_map may only name files inside the checkpoint directory (as Hugging Face's shard names
/// are); such a file must be a regular file (or a link to one).
TEST(Qwen3NextLoader, ShardNamesStayInTheCheckpoint) {
    namespace fs = std::filesystem;
    const fs::path dir = fs::temp_directory_path() / "gattn_qwen3_next_shard_names";
    fs::remove_all(dir);
    fs::create_directories(dir / "sub");
    fs::copy_file(kDir + "/config.json", dir / "config.json");
    const auto tensors = fixture_tensors();
    gattn_test::write_safetensors((dir / "sub" / "all.safetensors").string(), tensors);
    auto load_with = [&](const nlohmann::json& file) {
        nlohmann::json index;
        for (const auto& t : tensors) index["weight_map"][t.name] = "sub/all.safetensors";
        index["weight_map"][tensors[0].name] = file;
        std::ofstream(dir / "model.safetensors.index.json") << index.dump();
        return gattn::load_qwen3_next_attention<float>(dir.string(), kLayer);
    };
    EXPECT_EQ(load_with("sub/all.safetensors").config().hidden_size, 64);  // a subdirectory is inside
    EXPECT_EQ(load_with("./sub/all.safetensors").config().hidden_size, 64);
    for (const std::string& bad :
         std::vector<std::string>{"", ".", "/", (dir / "sub" / "all.safetensors").string(),
                                  "../gattn_qwen3_next_shard_names/sub/all.safetensors", "sub/../sub/all.safetensors",
                                  std::string("sub/all.safetensors\0.txt", 24)}) {
        try {
            load_with(bad);
            ADD_FAILURE() << "no exception for '" << bad << "'";
        } catch (const gattn::io_error& e) {
            EXPECT_NE(std::string(e.what()).find("weight_map entry '" + tensors[0].name +
                                                 "' must name a file inside the checkpoint directory"),
                      std::string::npos)
                << e.what();
        }
    }
    try {  // a directory inside
        load_with("sub");
        ADD_FAILURE() << "no exception for a directory";
    } catch (const gattn::io_error& e) {
        EXPECT_NE(std::string(e.what()).find("sub: cannot open file: not a regular file"), std::string::npos)
            << e.what();
    }
    // With an index, only the files it names are read, even when its weight_map is empty and a
    // model.safetensors is there.
    gattn_test::write_safetensors((dir / "model.safetensors").string(), tensors);
    std::ofstream(dir / "model.safetensors.index.json") << R"({"weight_map": {}})";
    try {
        gattn::load_qwen3_next_attention<float>(dir.string(), kLayer);
        ADD_FAILURE() << "no exception for an empty weight_map";
    } catch (const gattn::io_error& e) {
        EXPECT_NE(std::string(e.what()).find("missing tensor 'model.layers.3.self_attn.q_proj.weight'"),
                  std::string::npos)
            << e.what();
    }
}

/// Expects `f` to throw exactly E (shape_error, or a std::invalid_argument that is not one) with a
/// message starting with Qwen3NextAttention::forward and holding each of `parts`.
template <class E, class F>
void expect_rejected(F&& f, const std::vector<std::string>& parts) {
    try {
        f();
        ADD_FAILURE() << "no exception; expected one mentioning " << parts.front();
    } catch (const std::invalid_argument& e) {
        const std::string what = e.what();
        EXPECT_EQ(dynamic_cast<const gattn::shape_error*>(&e) != nullptr, (std::is_same_v<E, gattn::shape_error>))
            << what;
        EXPECT_EQ(what.rfind("gattn::Qwen3NextAttention::forward: ", 0), 0u) << what;
        for (const auto& part : parts) EXPECT_NE(what.find(part), std::string::npos) << "'" << part << "' in " << what;
    }
}

TEST(Qwen3NextValidation, BadArgumentsLeaveOutputAndCacheUntouched) {
    const auto layer = gattn::load_qwen3_next_attention<float>(kDir, kLayer);  // hidden_size 64
    auto cache = layer.make_cache(2, 8);
    RowMatrix<float> first(4, 64);
    layer.forward(RowMatrix<float>::Random(4, 64), {0, 1, 0, 1}, cache, first, {2, 1});
    const RowMatrix<float> keys = cache.keys(), values = cache.values();
    const std::vector<Index> lengths = cache.lengths();
    const RowMatrix<float> x = RowMatrix<float>::Random(6, 64);  // 2 sequences of 3 slots
    const std::vector<Index> pos{2, 3, 4, 1, 2, 3};
    RowMatrix<float> out = RowMatrix<float>::Constant(6, 64, 7.0f);
    using gattn::shape_error;
    using std::invalid_argument;
    expect_rejected<shape_error>([&] { layer.forward(RowMatrix<float>::Random(6, 63), pos, cache, out); },
                                 {"x must have shape [B*N, hidden_size] = [multiple of 2, 64]", "got [6, 63]"});
    expect_rejected<shape_error>(
        [&] {
            layer.forward(RowMatrix<float>::Random(5, 64), {1, 2, 3, 4, 5}, cache, out);
        },
        {"x must have shape", "got [5, 64]"});
    RowMatrix<float> narrow = RowMatrix<float>::Constant(6, 32, 7.0f);
    expect_rejected<shape_error>([&] { layer.forward(x, pos, cache, narrow); },
                                 {"out must have shape [6, 64], got [6, 32]"});
    // Another layer's cache whose rows are as wide as this one's (H_kv·d the same).
    const auto& cfg = layer.config();
    gattn::KVCache<float> other(2, 8, cfg.num_key_value_heads * 2, cfg.head_dim / 2);
    expect_rejected<shape_error>([&] { layer.forward(x, pos, other, out); }, {"cache must hold this layer's heads"});
    // The same checkpoint loaded twice: two layers, and each refuses the other's cache.
    const auto again = gattn::load_qwen3_next_attention<float>(kDir, kLayer);
    auto again_cache = again.make_cache(2, 8);
    expect_rejected<invalid_argument>([&] { layer.forward(x, pos, again_cache, out); },
                                      {"cache belongs to another layer", "every layer needs its own cache"});
    EXPECT_TRUE((narrow.array() == 7.0f).all());
    expect_rejected<shape_error>(
        [&] {
            layer.forward(x, {2, 3, 4, 1, 2}, cache, out);
        },
        {"positions must have shape [6], got [5]"});
    expect_rejected<shape_error>([&] { layer.forward(x, pos, cache, out, {3}); },
                                 {"counts must have shape [2], got [1]"});
    expect_rejected<invalid_argument>(
        [&] {
            layer.forward(x, pos, cache, out, {3, 4});
        },
        {"counts[1] must be in [0, 3], got 4"});
    expect_rejected<invalid_argument>(
        [&] {
            layer.forward(x, pos, cache, out, {-1, 0});
        },
        {"counts[0] must be in [0, 3], got -1"});
    const RowMatrix<float> x7 = RowMatrix<float>::Random(14, 64);
    RowMatrix<float> out7 = RowMatrix<float>::Constant(14, 64, 7.0f);
    expect_rejected<invalid_argument>(
        [&] {
            layer.forward(x7, std::vector<Index>(14, 3), cache, out7, {7, 0});
        },
        {"cache sequence 0 would exceed the capacity 8 (holds "});
    EXPECT_TRUE((out7.array() == 7.0f).all());
    RowMatrix<float> same = x;
    expect_rejected<invalid_argument>([&] { layer.forward(same, pos, cache, same); }, {"out must not overlap x"});
    EXPECT_EQ(same, x);
    // The optional outputs are resized: as out (or x) they would leave the call writing freed memory.
    expect_rejected<invalid_argument>([&] { layer.forward(x, pos, cache, out, {}, nullptr, &out); },
                                      {"first_key_probability must not hold x or out"});
    expect_rejected<invalid_argument>([&] { layer.forward(x, pos, cache, out, {}, &out); },
                                      {"gate_scores must not hold x or out"});
    expect_rejected<invalid_argument>([&] { layer.forward(same, pos, cache, out, {}, &same); },
                                      {"gate_scores must not hold x or out"});
    RowMatrix<float> stats;
    expect_rejected<invalid_argument>([&] { layer.forward(x, pos, cache, out, {}, &stats, &stats); },
                                      {"gate_scores must not be first_key_probability"});
    EXPECT_EQ(same, x);
    EXPECT_TRUE((out.array() == 7.0f).all()) << "output written although the call was rejected";
    EXPECT_EQ(cache.lengths(), lengths);
    // Bytes, not values: the unused slots are uninitialised and may hold NaN.
    EXPECT_EQ(std::memcmp(cache.keys().data(), keys.data(), sizeof(float) * std::size_t(keys.size())), 0);
    EXPECT_EQ(std::memcmp(cache.values().data(), values.data(), sizeof(float) * std::size_t(values.size())), 0);
}

TEST(Qwen3NextCache, FullCacheIsRejectedAndLeftIntact) {
    auto layer = gattn::load_qwen3_next_attention<float>(kDir, kLayer);
    auto cache = layer.make_cache(1, 4);
    RowMatrix<float> x = RowMatrix<float>::Random(3, 64), out(3, 64);
    layer.forward(x, {0, 1, 2}, cache, out);
    const RowMatrix<float> keys = cache.keys();
    EXPECT_THROW(layer.forward(x, {3, 4, 5}, cache, out), std::invalid_argument);
    EXPECT_EQ(cache.lengths(), std::vector<Index>{3});
    // Bytes, not values: the unused slot is uninitialised and may hold NaN.
    EXPECT_EQ(std::memcmp(cache.keys().data(), keys.data(), sizeof(float) * std::size_t(keys.size())), 0);
}

TEST(KVCacheConstruction, SizesThatOverflowOrAreNegativeAreRejected) {
    auto message = [](auto&& make) {
        try {
            make();
        } catch (const std::invalid_argument& e) {
            return std::string(e.what());
        }
        return std::string("no exception");
    };
    const Index huge = Index(1) << 62;
    EXPECT_NE(message([&] {
                  gattn::KVCache<float>(4, huge, 1, 1);
              }).find("gattn::KVCache: capacity batch·capacity·num_kv_heads·head_dim overflows"),
              std::string::npos);
    EXPECT_NE(message([&] { gattn::KVCache<float>(1, 2, huge, 4); }).find("overflows"), std::string::npos);
    EXPECT_NE(message([&] {
                  gattn::KVCache<float>(1, 2, 1, 4, -1);
              }).find("value_head_dim must be >= 0 (0 = head_dim), got -1"),
              std::string::npos);
    EXPECT_NE(message([&] { gattn::KVCache<float>(0, 2, 1, 4); }).find("batch must be >= 1, got 0"), std::string::npos);
    const gattn::KVCache<float> ok(2, 3, 2, 4, 5);
    EXPECT_EQ(ok.keys().rows(), 6);
    EXPECT_EQ(ok.keys().cols(), 8);
    EXPECT_EQ(ok.values().cols(), 10);
}

TEST(KVCacheAppend, RowsOfTheCacheItselfAreRejected) {
    // Appending rows read from the cache's own storage would overwrite them while copying.
    gattn::KVCache<float> cache(1, 6, 1, 2);
    const RowMatrix<float> k = RowMatrix<float>::Random(3, 2), v = RowMatrix<float>::Random(3, 2);
    cache.append(k, v, {3});
    const RowMatrix<float> keys = cache.keys().topRows(3);
    try {
        cache.append(cache.keys().topRows(3), v, {3});
        ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find(
                      "gattn::KVCache::append: k must not share an element with the cache's keys or values"),
                  std::string::npos)
            << e.what();
    }
    EXPECT_THROW(cache.append(k, cache.keys().topRows(3), {3}), std::invalid_argument);
    EXPECT_EQ(cache.lengths(), std::vector<Index>{3});
    EXPECT_EQ(RowMatrix<float>(cache.keys().topRows(3)), keys);
    cache.append(keys, v, {3});  // a copy is fine
    EXPECT_EQ(RowMatrix<float>(cache.keys().middleRows(3, 3)), keys);
}

}  // namespace
