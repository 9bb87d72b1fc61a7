// GatedMultiHeadAttention against fixtures produced by an independent PyTorch implementation
// (scripts/make_fixtures.py), plus the layer's forward contract: errors, views, threads.

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "gattn/gattn.hpp"
#include "gattn/io/safetensors.hpp"
#include "support/fixtures.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using gattn::Index;
using gattn::RowMatrix;

template <class Scalar>
struct Tolerance;
template <>
struct Tolerance<float> {
    static constexpr double atol = 1e-5, rtol = 1e-4;
};
template <>
struct Tolerance<double> {
    static constexpr double atol = 1e-12, rtol = 1e-10;
};

template <class Scalar>
void expect_close(const RowMatrix<Scalar>& got, const RowMatrix<double>& want, const std::string& what) {
    ASSERT_EQ(got.rows(), want.rows()) << what;
    ASSERT_EQ(got.cols(), want.cols()) << what;
    int bad = 0;
    double num = 0, den = 0;
    for (Index r = 0; r < want.rows(); ++r)
        for (Index c = 0; c < want.cols(); ++c) {
            const double g = static_cast<double>(got(r, c)), w = want(r, c);
            num += (g - w) * (g - w);
            den += w * w;
            if (!(std::abs(g - w) <= Tolerance<Scalar>::atol + Tolerance<Scalar>::rtol * std::abs(w)) &&
                ++bad <= 5)
                ADD_FAILURE() << what << " at (" << r << ", " << c << "): got " << g << ", want " << w;
        }
    EXPECT_EQ(bad, 0) << what;
    const double nmse_bound = std::is_same_v<Scalar, float> ? 1e-10 : 1e-24;
    EXPECT_LE(num / std::max(den, 1e-300), nmse_bound) << what << " NMSE";
}

const char* kFixtures[] = {"g1_elementwise_gqa_causal", "g1_headwise", "g1_fused_interleaved_mqa_causal",
                           "ungated_gqa_causal", "demo_layer"};

template <class Scalar>
class PyTorchFixture : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(PyTorchFixture, Scalars);

TYPED_TEST(PyTorchFixture, OutputAndStatisticsMatchPyTorch) {
    using Scalar = TypeParam;
    for (const char* name : kFixtures) {
        SCOPED_TRACE(name);
        const gattn::SafetensorsFile file(gattn_test::fixture_path(name));
        const gattn::AttentionConfig config = gattn_test::fixture_config(file);
        const auto weights = gattn::load_attention_weights<Scalar>(file, config);
        const gattn::GatedMultiHeadAttention<Scalar> layer(config, weights);
        const Index batch = std::stol(file.metadata().at("batch"));
        gattn::ForwardTrace<Scalar> trace;
        const RowMatrix<Scalar> y = layer.forward(file.matrix<Scalar>("input"), batch, {}, &trace);
        expect_close<Scalar>(y, file.matrix<double>("output"), "output");
        expect_close<Scalar>(trace.first_key_attention, file.matrix<double>("first_key_attention"),
                             "first_key_attention");
        if (config.gate.enabled())
            expect_close<Scalar>(trace.gate_scores, file.matrix<double>("gate_scores"), "gate_scores");
        else
            EXPECT_EQ(trace.gate_scores.size(), 0);
    }
}

gattn::AttentionConfig small_config() {
    gattn::AttentionConfig c;
    c.d_model = 16;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 4;
    c.causal = true;
    c.gate = gattn::GateSpec::g1_elementwise();
    return c;
}

TEST(LayerForward, SaturatedGateEqualsUngatedLayer) {
    // σ(1000) is exactly 1, so a G1 gate with logits ≥ 1000 must reproduce the ungated layer.
    gattn::AttentionConfig gated = small_config();
    gated.gate.bias = true;
    auto w = gattn::make_random_weights<float>(gated, 7);
    w.gate_proj_weight.setZero();
    w.gate_proj_bias.setConstant(1000.0f);
    gattn::AttentionConfig plain = gated;
    plain.gate = {};
    gattn::AttentionWeights<float> wp = w;
    wp.gate_proj_weight.resize(0, 0);
    wp.gate_proj_bias.resize(0);
    const RowMatrix<float> x = RowMatrix<float>::Random(12, 16);
    const auto a = gattn::GatedMultiHeadAttention<float>(gated, w).forward(x, 3);
    const auto b = gattn::GatedMultiHeadAttention<float>(plain, wp).forward(x, 3);
    // Not bitwise: the gated layer's projection GEMM is wider, and Eigen's blocking (so its
    // rounding) depends on the matrix sizes.
    EXPECT_LE((a - b).cwiseAbs().maxCoeff(), 1e-6f);
    // and a gate of exactly 0 (σ(−1000)) silences the attention: output is o_proj's bias (none).
    w.gate_proj_bias.setConstant(-1000.0f);
    const auto z = gattn::GatedMultiHeadAttention<float>(gated, w).forward(x, 3);
    EXPECT_EQ(z.cwiseAbs().maxCoeff(), 0.0f);
}

TEST(LayerForward, CoreFormWritesIntoStridedBlock) {
    const auto c = small_config();
    const gattn::GatedMultiHeadAttention<double> layer(c, gattn::make_random_weights<double>(c, 3));
    RowMatrix<double> wide = RowMatrix<double>::Random(10, 40);
    const RowMatrix<double> x = wide.middleCols(5, 16);
    RowMatrix<double> out_wide = RowMatrix<double>::Constant(10, 30, 42.0);
    layer.forward(wide.middleCols(5, 16), 2, out_wide.middleCols(7, 16));
    EXPECT_EQ(RowMatrix<double>(out_wide.middleCols(7, 16)), layer.forward(x, 2));
    EXPECT_TRUE((out_wide.leftCols(7).array() == 42.0).all());
    EXPECT_TRUE((out_wide.rightCols(7).array() == 42.0).all());
}

TEST(LayerForward, SequencesInABatchAreIndependent) {
    // Eigen's GEMM blocking depends on the row count, so projections of a batch may round
    // differently from those of one sequence: equal to float rounding, not bitwise.
    const auto c = small_config();
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 5));
    const RowMatrix<float> x = RowMatrix<float>::Random(15, 16);
    const auto all = layer.forward(x, 3);
    for (Index b = 0; b < 3; ++b) {
        const RowMatrix<float> one = layer.forward(x.middleRows(b * 5, 5), 1);
        EXPECT_LE((all.middleRows(b * 5, 5) - one).cwiseAbs().maxCoeff(), 1e-6f) << "sequence " << b;
    }
}

#ifdef _OPENMP
TEST(SdpaDeterminism, ResultIsBitwiseIndependentOfThreadCount) {
    // Prefill tiles and decoding's split-KV chunks are cut by shape, never by thread count.
    for (const Index nq : {Index(300), Index(1)}) {
        const Index nk = 5000, H = 8, Hkv = 2, d = 64;
        const RowMatrix<float> q = RowMatrix<float>::Random(2 * nq, H * d);
        const RowMatrix<float> k = RowMatrix<float>::Random(2 * nk, Hkv * d);
        const RowMatrix<float> v = RowMatrix<float>::Random(2 * nk, Hkv * d);
        gattn::SdpaOptions<float> opt;
        opt.mask.causal = true;
        opt.mask.key_lengths = {nk, 3001};
        std::vector<RowMatrix<float>> results;
        for (int threads : {1, 2, 3}) {
            omp_set_num_threads(threads);
            results.push_back(gattn::scaled_dot_product_attention<float>(q, k, v, {2, H, Hkv}, opt));
        }
        omp_set_num_threads(omp_get_num_procs());
        EXPECT_EQ(results[0], results[1]) << "N_q = " << nq;
        EXPECT_EQ(results[0], results[2]) << "N_q = " << nq;
    }
}
#endif

TEST(SdpaMerge, TwoKeyShardsMergeToTheFullResult) {
    // Keys [0, 700) and [700, 1500) attended separately, then merged, equal attention over all.
    const Index nq = 40, nk = 1500, split = 700, H = 4, Hkv = 2, dk = 32, dv = 24;
    const RowMatrix<double> q = RowMatrix<double>::Random(nq, H * dk);
    const RowMatrix<double> k = RowMatrix<double>::Random(nk, Hkv * dk);
    const RowMatrix<double> v = RowMatrix<double>::Random(nk, Hkv * dv);
    RowMatrix<double> lse_full, lse_a, lse_b;
    gattn::SdpaOutputs<double> ea, eb, ef;
    ea.log_sum_exp = &lse_a;
    eb.log_sum_exp = &lse_b;
    ef.log_sum_exp = &lse_full;
    const auto full = gattn::scaled_dot_product_attention<double>(q, k, v, {1, H, Hkv}, {}, ef);
    auto a = gattn::scaled_dot_product_attention<double>(q, k.topRows(split), v.topRows(split), {1, H, Hkv}, {}, ea);
    const auto b = gattn::scaled_dot_product_attention<double>(q, k.bottomRows(nk - split), v.bottomRows(nk - split),
                                                               {1, H, Hkv}, {}, eb);
    gattn::merge_attention<double>(a, lse_a, b, lse_b, a, lse_a);  // in place
    EXPECT_LT((a - full).cwiseAbs().maxCoeff(), 1e-13);
    EXPECT_LT((lse_a - lse_full).cwiseAbs().maxCoeff(), 1e-12);

    // A shard that sees no key (lse −∞, output 0) leaves the other unchanged, even with NaN in it.
    RowMatrix<double> nan_out = RowMatrix<double>::Constant(nq, H * dv, std::nan(""));
    RowMatrix<double> empty_lse = RowMatrix<double>::Constant(nq, H, -std::numeric_limits<double>::infinity());
    RowMatrix<double> merged(nq, H * dv), merged_lse(nq, H);
    gattn::merge_attention<double>(full, lse_full, nan_out, empty_lse, merged, merged_lse);
    EXPECT_EQ(merged, full);
    EXPECT_THROW(gattn::merge_attention<double>(full, lse_full, b.leftCols(8), lse_b, merged, merged_lse),
                 gattn::shape_error);
}

TEST(SdpaDeterminism, SequenceResultIsBitwiseIndependentOfItsBatch) {
    // Key blocks start at fixed multiples of the tile, so a sequence's SDPA result is the same
    // bits whether it runs alone or beside others of different lengths.
    const Index Nq = 37, Nk = 150, H = 4, Hkv = 2, d = 24;
    const RowMatrix<float> q = RowMatrix<float>::Random(3 * Nq, H * d);
    const RowMatrix<float> k = RowMatrix<float>::Random(3 * Nk, Hkv * d);
    const RowMatrix<float> v = RowMatrix<float>::Random(3 * Nk, Hkv * d);
    gattn::SdpaOptions<float> opt;
    opt.mask.causal = true;
    opt.mask.key_lengths = {150, 61, 99};
    const auto all = gattn::scaled_dot_product_attention<float>(q, k, v, {3, H, Hkv}, opt);
    for (Index b = 0; b < 3; ++b) {
        gattn::SdpaOptions<float> one = opt;
        one.mask.key_lengths = {opt.mask.key_lengths[b]};
        const auto r = gattn::scaled_dot_product_attention<float>(q.middleRows(b * Nq, Nq), k.middleRows(b * Nk, Nk),
                                                                  v.middleRows(b * Nk, Nk), {1, H, Hkv}, one);
        EXPECT_EQ(RowMatrix<float>(all.middleRows(b * Nq, Nq)), r) << "sequence " << b;
    }
}

TEST(LayerForward, ConcurrentCallsOnOneLayerAgree) {
    const auto c = small_config();
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 9));
    const RowMatrix<float> x = RowMatrix<float>::Random(64, 16);
    const auto want = layer.forward(x, 4);
    std::vector<RowMatrix<float>> got(4);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) threads.emplace_back([&, t] { got[t] = layer.forward(x, 4); });
    for (auto& t : threads) t.join();
    for (const auto& g : got) EXPECT_EQ(g, want);
}

TEST(LayerForward, KeyLengthsMaskPaddedTokens) {
    // With key_lengths, garbage in padded tokens must not change the valid tokens' outputs.
    auto c = small_config();
    c.causal = false;
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 11));
    RowMatrix<float> x = RowMatrix<float>::Random(12, 16);
    gattn::ForwardOptions<float> opt;
    opt.key_lengths = {4, 6};
    const auto a = layer.forward(x, 2, opt);
    x.row(4).setConstant(1e6f);
    x.row(5).setConstant(-3.0f);
    const auto b = layer.forward(x, 2, opt);
    EXPECT_EQ(RowMatrix<float>(a.topRows(4)), RowMatrix<float>(b.topRows(4)));
    EXPECT_EQ(RowMatrix<float>(a.bottomRows(6)), RowMatrix<float>(b.bottomRows(6)));
}

template <class F>
void expect_throw_untouched(F&& f, const std::string& needle, RowMatrix<float>& out) {
    const RowMatrix<float> before = out;
    try {
        f();
        ADD_FAILURE() << "no exception; expected one mentioning " << needle;
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("gattn::"), std::string::npos) << e.what();
    }
    EXPECT_EQ(out, before) << "output written although the call was rejected";
}

TEST(LayerForward, BadInputThrowsAndLeavesOutputUntouched) {
    const auto c = small_config();
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 1));
    const RowMatrix<float> x = RowMatrix<float>::Random(6, 16);
    RowMatrix<float> out = RowMatrix<float>::Constant(6, 16, 7.0f);
    expect_throw_untouched([&] { layer.forward(RowMatrix<float>::Random(6, 15), 2, out); }, "x must have shape", out);
    expect_throw_untouched([&] { layer.forward(x, 4, out); }, "x must have shape", out);
    expect_throw_untouched([&] { layer.forward(x, -1, out); }, "batch", out);
    RowMatrix<float> small(6, 8);
    EXPECT_THROW(layer.forward(x, 2, small), gattn::shape_error);
    gattn::ForwardOptions<float> opt;
    opt.key_lengths = {3, 4};
    expect_throw_untouched([&] { layer.forward(x, 2, out, opt); }, "key_lengths[1]", out);
    opt.key_lengths = {3};
    expect_throw_untouched([&] { layer.forward(x, 2, out, opt); }, "key_lengths", out);
    RowMatrix<float> same = x;
    EXPECT_THROW(layer.forward(same, 2, same), std::invalid_argument);
    EXPECT_EQ(same, x);
}

TEST(LayerForward, EmptyBatchGivesEmptyOutput) {
    const auto c = small_config();
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 1));
    EXPECT_EQ(layer.forward(RowMatrix<float>(0, 16), 0).rows(), 0);
    EXPECT_EQ(layer.forward(RowMatrix<float>(0, 16), 2).rows(), 0);
}

TEST(LayerConstruction, RejectsUnusedOrMisshapenWeights) {
    auto c = small_config();
    auto w = gattn::make_random_weights<float>(c, 1);
    auto bad = w;
    bad.k_proj_weight.resize(8, 15);
    try {
        gattn::GatedMultiHeadAttention<float> l(c, bad);
        ADD_FAILURE() << "no exception";
    } catch (const gattn::shape_error& e) {
        EXPECT_NE(std::string(e.what()).find("k_proj.weight must have shape [8, 16], got [8, 15]"), std::string::npos)
            << e.what();
    }
    c.gate = {};  // ungated config but a gate_proj given: a config/checkpoint mismatch
    EXPECT_THROW((gattn::GatedMultiHeadAttention<float>(c, w)), gattn::shape_error);
    c.num_kv_heads = 3;
    EXPECT_THROW((gattn::GatedMultiHeadAttention<float>(c, w)), std::invalid_argument);
}

}  // namespace
