// GatedMultiHeadAttention against fixtures produced by an independent PyTorch implementation
// (scripts/make_fixtures.py), plus the layer's forward contract: errors, views, threads.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "gattn/gattn.hpp"
#include "gattn/io/safetensors.hpp"
#include "support/compare.hpp"
#include "support/fixtures.hpp"
#include "support/reference.hpp"

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
            if (!(std::abs(g - w) <= Tolerance<Scalar>::atol + Tolerance<Scalar>::rtol * std::abs(w)) && ++bad <= 5)
                ADD_FAILURE() << what << " at (" << r << ", " << c << "): got " << g << ", want " << w;
        }
    EXPECT_EQ(bad, 0) << what;
    const double nmse_bound = std::is_same_v<Scalar, float> ? 1e-10 : 1e-24;
    EXPECT_LE(num / std::max(den, 1e-300), nmse_bound) << what << " NMSE";
}

const char* kFixtures[] = {"g1_elementwise_gqa_causal", "g1_headwise", "g1_fused_interleaved_mqa_causal",
                           "ungated_gqa_causal", "demo_layer",
                           // gpt-oss (sinks, window), Gemma 2 (softcap) and BLOOM (ALiBi) layers
                           "gpt_oss_sinks_window", "gemma2_softcap_gated", "bloom_alibi",
                           // Qwen3-style (q/k norm, RoPE) and GPT-J-style (partial interleaved RoPE)
                           "qwen3_rope_qk_norm_gated", "gptj_partial_rope_headwise"};

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
    // Bitwise: Q, K and V come from the same GEMM with and without a gate, and y·1 = y.
    EXPECT_EQ(a, b);
    // and a gate of exactly 0 (σ(−1000)) silences the attention: output is o_proj's bias (none).
    w.gate_proj_bias.setConstant(-1000.0f);
    const auto z = gattn::GatedMultiHeadAttention<float>(gated, w).forward(x, 3);
    EXPECT_EQ(z.cwiseAbs().maxCoeff(), 0.0f);
}

TEST(RandomWeights, NormGainsAreTheModelsInitialValues) {
    // Qwen3 initialises its q/k RMSNorm gains to ones, Qwen3-Next its zero-centred gains
    // (y = x̂·(1 + w)) to zeros: both leave each normalised head at RMS 1.
    gattn::AttentionConfig c = small_config();
    c.qk_norm = gattn::QkNorm::RmsNorm;
    auto w = gattn::make_random_weights<float>(c, 11);
    ASSERT_EQ(w.q_norm_weight.size(), c.head_dim);
    ASSERT_EQ(w.k_norm_weight.size(), c.head_dim);
    EXPECT_TRUE((w.q_norm_weight.array() == 1.0f).all());
    EXPECT_TRUE((w.k_norm_weight.array() == 1.0f).all());
    c.qk_norm = gattn::QkNorm::ZeroCentredRmsNorm;
    w = gattn::make_random_weights<float>(c, 11);
    EXPECT_TRUE((w.q_norm_weight.array() == 0.0f).all());
    EXPECT_TRUE((w.k_norm_weight.array() == 0.0f).all());
    // The projections stay nn.Linear's U(±1/√fan_in), and not all one value.
    const float bound = 1.0f / std::sqrt(float(c.d_model));
    EXPECT_LE(w.q_proj_weight.cwiseAbs().maxCoeff(), bound);
    EXPECT_GT(w.q_proj_weight.maxCoeff() - w.q_proj_weight.minCoeff(), bound);
}

TEST(LayerForward, CheckFiniteNamesTheFirstNonFiniteInputAndWritesNothing) {
    const auto c = small_config();  // D = 16
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 5));
    RowMatrix<float> x = RowMatrix<float>::Random(12, 16);  // 3 sequences of 4 tokens
    x(6, 9) = std::numeric_limits<float>::infinity();       // sequence 1, token 2
    x(7, 1) = std::numeric_limits<float>::quiet_NaN();
    RowMatrix<float> out = RowMatrix<float>::Constant(12, 16, 7.0f);
    gattn::ForwardOptions<float> options;
    // Off by default: IEEE propagation, the infinity's row comes out non-finite.
    layer.forward(x, 3, out, options);
    EXPECT_FALSE(out.row(6).allFinite());
    out.setConstant(7.0f);
    options.check_finite = true;
    try {
        layer.forward(x, 3, out, options);
        ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("gattn::GatedMultiHeadAttention::forward"), std::string::npos) << m;
        EXPECT_NE(m.find("row 6 (sequence 1, token 2), feature 9 is inf"), std::string::npos) << m;
    }
    EXPECT_TRUE((out.array() == 7.0f).all());
    // A finite x passes and gives what the unchecked call gives.
    x(6, 9) = 0.5f;
    x(7, 1) = -0.25f;
    options.check_finite = false;
    const RowMatrix<float> expected = layer.forward(x, 3, options);
    options.check_finite = true;
    EXPECT_EQ(layer.forward(x, 3, options), expected);
    // −∞ in the bias is a mask; NaN is refused.
    std::vector<float> bias(4 * 4, 0.0f);
    bias[1] = -std::numeric_limits<float>::infinity();
    options.bias = {bias.data(), 1, 1, 4, 4};
    EXPECT_NO_THROW(layer.forward(x, 3, options));
    bias[5] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_THROW(layer.forward(x, 3, options), std::invalid_argument);
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

TEST(LayerForward, GateInSdpaEpilogueEqualsGatePass) {
    // Without a trace, a head-specific G1 input gate is applied inside SDPA, to each (token, head)
    // output as soon as it is final; with a trace, by a pass over U afterwards. Both must give
    // the same output bitwise, on the tiled path (N = 200: full and partial query blocks), the
    // decoding path (N = 1) and for a sequence whose keys are all masked (key length 0), and
    // match the float64 layer. head_dim 12 is not a multiple of the SIMD width, so the gate runs
    // a head at a time with a tail in the epilogue and a row at a time in the pass.
    gattn::AttentionConfig c = small_config();  // 4 heads, 2 KV heads, causal
    c.d_model = 48;
    c.head_dim = 12;
    gattn::GateSpec additive = gattn::GateSpec::g1_elementwise(), silu = gattn::GateSpec::g1_elementwise(),
                    biased = gattn::GateSpec::g1_elementwise();
    additive.combine = gattn::GateCombine::Additive;
    silu.activation = gattn::GateActivation::SiLU;
    biased.bias = true;
    struct Shape {
        Index B, N;
        std::vector<Index> key_lengths;
    };
    for (const gattn::GateSpec& gate :
         {gattn::GateSpec::g1_elementwise(), gattn::GateSpec::g1_headwise(), additive, silu, biased,
          gattn::GateSpec::g1_elementwise(gattn::GateLayout::PerHeadInterleaved)}) {
        c.gate = gate;
        const auto w = gattn::make_random_weights<float>(c, 41);
        const gattn::GatedMultiHeadAttention<float> layer(c, w);
        for (const Shape& sh : {Shape{2, 200, {}}, Shape{3, 1, {}}, Shape{2, 5, {5, 0}}}) {
            const std::string what = gattn::describe(gate) + ", B = " + std::to_string(sh.B) +
                                     ", N = " + std::to_string(sh.N);
            const RowMatrix<float> x = gattn_test::random_matrix(sh.B * sh.N, c.d_model, 42).cast<float>();
            gattn::ForwardOptions<float> opt;
            opt.key_lengths = sh.key_lengths;
            gattn::ForwardTrace<float> trace;
            const RowMatrix<float> fused = layer.forward(x, sh.B, opt);
            const RowMatrix<float> pass = layer.forward(x, sh.B, opt, &trace);
            EXPECT_EQ(fused, pass) << what;
            expect_close<float>(fused,
                                gattn_test::layer_reference(c, gattn_test::weights_to_double(w), x.cast<double>(), sh.B,
                                                            sh.key_lengths)
                                    .y,
                                what);
        }
    }
}

/// The projections' linear(): x·wᵀ + b against float64 math for row counts on both sides of
/// kLinearGemvRows (matrix-vector products up to it, Eigen's GEMM above), with and without a
/// bias, for a strided x, an input width that is no multiple of the SIMD width and an output
/// count that is no multiple of the 64-output blocks.
TEST(Linear, MatchesDoubleOnBothSidesOfTheGemvLimit) {
    const Index in = 333, outputs = 200;
    const RowMatrix<double> w64 = gattn_test::random_matrix(outputs, in, 41);
    const gattn::Vector<double> b64 = gattn_test::random_matrix(outputs, 1, 42).col(0);
    const RowMatrix<float> w = w64.cast<float>();
    const RowMatrix<double> wf = w.cast<double>();  // the float weights, exactly
    for (const Index rows : {Index(0), Index(1), Index(2), Index(7), gattn::detail::kLinearGemvRows,
                             gattn::detail::kLinearGemvRows + 1, Index(40)}) {
        for (const bool bias : {false, true}) {
            // At least one row, so that the view of zero rows does not offset a null pointer.
            const RowMatrix<float> wide =
                gattn_test::random_matrix(std::max<Index>(rows, 1), in + 5, 43 + rows).cast<float>();
            const auto x = wide.topRows(rows).middleCols(2, in);
            const gattn::Vector<float> b = bias ? gattn::Vector<float>(b64.cast<float>()) : gattn::Vector<float>();
            RowMatrix<float> out = RowMatrix<float>::Constant(rows, outputs, 7.0f);
            gattn::detail::linear<float>(x, w, b, out);
            const RowMatrix<double> xd = x.cast<double>();
            for (Index r = 0; r < rows; ++r)
                for (Index o = 0; o < outputs; ++o) {
                    double want = 0, magnitude = 0;
                    for (Index c = 0; c < in; ++c) {
                        want += xd(r, c) * wf(o, c);
                        magnitude += std::abs(xd(r, c) * wf(o, c));
                    }
                    if (bias) {
                        want += double(b[o]);
                        magnitude += std::abs(double(b[o]));
                    }
                    // float accumulation of `in` products: a few ε of Σ|x·w| at most.
                    ASSERT_NEAR(out(r, o), want, 4e-7 * magnitude + 1e-7)
                        << "rows = " << rows << ", bias = " << bias << ", at (" << r << ", " << o << ")";
                }
        }
    }
}

#ifdef _OPENMP
TEST(Linear, GemvPathIsBitwiseIndependentOfThreadCount) {
    const int saved_threads = omp_get_max_threads();
    // 16 rows × 200 outputs × 333 inputs: above the size at which the blocks run in parallel.
    const Index rows = gattn::detail::kLinearGemvRows, in = 333, outputs = 200;
    const RowMatrix<float> w = gattn_test::random_matrix(outputs, in, 51).cast<float>();
    const gattn::Vector<float> b = gattn_test::random_matrix(outputs, 1, 52).col(0).cast<float>();
    const RowMatrix<float> x = gattn_test::random_matrix(rows, in, 53).cast<float>();
    std::vector<RowMatrix<float>> results;
    for (int threads : {1, 2, 3}) {
        omp_set_num_threads(threads);
        RowMatrix<float> out(rows, outputs);
        gattn::detail::linear<float>(x, w, b, out);
        results.push_back(out);
    }
    omp_set_num_threads(saved_threads);
    EXPECT_EQ(results[0], results[1]);
    EXPECT_EQ(results[0], results[2]);
}
#endif

#ifdef _OPENMP
TEST(SdpaDeterminism, ResultIsBitwiseIndependentOfThreadCount) {
    const int saved_threads = omp_get_max_threads();
    // Prefill tiles and decoding's split-KV chunks are cut by shape, never by thread count;
    // more threads only group fewer query tiles per task (these shapes are grouped differently
    // for 1, 2 and 3 threads at every instruction set).
    struct Case {
        Index B, H, Hkv, nq;
    };
    for (const Case c : {Case{2, 8, 2, 300}, Case{2, 8, 2, 1}, Case{1, 4, 1, 128}}) {
        const Index nk = 5000, d = 64;
        const RowMatrix<float> q = RowMatrix<float>::Random(c.B * c.nq, c.H * d);
        const RowMatrix<float> k = RowMatrix<float>::Random(c.B * nk, c.Hkv * d);
        const RowMatrix<float> v = RowMatrix<float>::Random(c.B * nk, c.Hkv * d);
        gattn::SdpaOptions<float> opt;
        opt.mask.causal = true;
        opt.mask.key_lengths = c.B == 2 ? std::vector<Index>{nk, 3001} : std::vector<Index>{4000};
        std::vector<RowMatrix<float>> results;
        for (int threads : {1, 2, 3}) {
            omp_set_num_threads(threads);
            results.push_back(gattn::scaled_dot_product_attention<float>(q, k, v, {c.B, c.H, c.Hkv}, opt));
        }
        omp_set_num_threads(saved_threads);
        EXPECT_EQ(results[0], results[1]) << "N_q = " << c.nq;
        EXPECT_EQ(results[0], results[2]) << "N_q = " << c.nq;
    }
}

TEST(LayerDeterminism, GatePassIsBitwiseIndependentOfThreadCount) {
    const int saved_threads = omp_get_max_threads();
    // 1024 rows × 64 gated values: large enough for the gate pass to run its rows in parallel.
    // Every branch of that pass (elementwise, head-shared mean, headwise, G2 on V, G5 with the
    // residual mix, input-independent, query-sourced) at 1, 2 and 3 threads: outputs and gate
    // scores equal bitwise, and the output matches the float64 layer.
    using gattn::GatePosition;
    gattn::AttentionConfig c;
    c.d_model = 64;
    c.num_heads = 8;
    c.num_kv_heads = 2;
    c.head_dim = 8;
    c.causal = true;
    auto at = [](GatePosition p) {
        gattn::GateSpec g = gattn::GateSpec::g1_elementwise();
        g.position = p;
        return g;
    };
    gattn::GateSpec shared = gattn::GateSpec::g1_elementwise(), mix = at(GatePosition::G5),
                    theta = gattn::GateSpec::g1_elementwise();
    shared.sharing = gattn::GateSharing::HeadShared;
    mix.combine = gattn::GateCombine::ResidualMix;
    theta.source = gattn::GateSource::InputIndependent;
    theta.bias = false;
    gattn::GateSpec query = gattn::GateSpec::g1_headwise();
    query.source = gattn::GateSource::Query;
    const Index B = 4, N = 256;
    const RowMatrix<float> x = gattn_test::random_matrix(B * N, c.d_model, 31).cast<float>();
    for (const gattn::GateSpec& gate : {gattn::GateSpec::g1_elementwise(), shared, gattn::GateSpec::g1_headwise(),
                                        at(GatePosition::G2), mix, theta, query}) {
        c.gate = gate;
        const std::string what = gattn::describe(gate);
        const auto w = gattn::make_random_weights<float>(c, 32);
        const gattn::GatedMultiHeadAttention<float> layer(c, w);
        std::vector<RowMatrix<float>> y, scores;
        for (int threads : {1, 2, 3}) {
            omp_set_num_threads(threads);
            gattn::ForwardTrace<float> trace;
            y.push_back(layer.forward(x, B, {}, &trace));
            scores.push_back(trace.gate_scores);
        }
        omp_set_num_threads(saved_threads);
        EXPECT_EQ(y[0], y[1]) << what;
        EXPECT_EQ(y[0], y[2]) << what;
        EXPECT_EQ(scores[0], scores[1]) << what;
        EXPECT_EQ(scores[0], scores[2]) << what;
        expect_close<float>(y[0],
                            gattn_test::layer_reference(c, gattn_test::weights_to_double(w), x.cast<double>(), B).y,
                            what);
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

TEST(SdpaMerge, NaNAndUnderflowedWeightsSurviveAsInOneCall) {
    // Keys with logits 0 and 200 (scale 1): in float e^(−200) underflows to 0, and one call over
    // both keys still multiplies key 0's NaN value by it, giving NaN. Merging the two one-key
    // shards must give the same. And a shard with NaN in its log-sum-exp (NaN in a key) keeps
    // the row NaN through further merges, as one call over all the keys does.
    const RowMatrix<float> q = RowMatrix<float>::Constant(1, 1, 1.0f);
    RowMatrix<float> k(3, 1), v(3, 1);
    k << 0.0f, 200.0f, 1.0f;
    v << std::nanf(""), 3.0f, 5.0f;
    gattn::SdpaOptions<float> opt;
    opt.scale = 1.0;
    auto shard = [&](Index j, RowMatrix<float>& lse) {
        gattn::SdpaOutputs<float> extra;
        extra.log_sum_exp = &lse;
        return gattn::scaled_dot_product_attention<float>(q, k.middleRows(j, 1), v.middleRows(j, 1), {1, 1, 1}, opt,
                                                          extra);
    };
    const RowMatrix<float> one_call =
        gattn::scaled_dot_product_attention<float>(q, k.topRows(2), v.topRows(2), {1, 1, 1}, opt);
    ASSERT_TRUE(std::isnan(one_call(0, 0)));
    RowMatrix<float> lse0, lse1, lse2, out(1, 1), lse(1, 1);
    const RowMatrix<float> out0 = shard(0, lse0), out1 = shard(1, lse1), out2 = shard(2, lse2);
    gattn::merge_attention<float>(out0, lse0, out1, lse1, out, lse);
    EXPECT_TRUE(std::isnan(out(0, 0))) << out(0, 0);
    EXPECT_EQ(lse(0, 0), 200.0f);

    RowMatrix<float> k_nan = k;
    k_nan(1, 0) = std::nanf("");
    RowMatrix<float> lse_nan;
    gattn::SdpaOutputs<float> extra;
    extra.log_sum_exp = &lse_nan;
    const RowMatrix<float> out_nan = gattn::scaled_dot_product_attention<float>(q, k_nan.middleRows(1, 1),
                                                                                v.middleRows(1, 1), {1, 1, 1}, opt,
                                                                                extra);
    gattn::merge_attention<float>(out_nan, lse_nan, out2, lse2, out, lse);
    EXPECT_TRUE(std::isnan(lse(0, 0))) << lse(0, 0);
    RowMatrix<float> out_again(1, 1), lse_again(1, 1);
    gattn::merge_attention<float>(out, lse, out2, lse2, out_again, lse_again);
    EXPECT_TRUE(std::isnan(out_again(0, 0)) && std::isnan(lse_again(0, 0)))
        << out_again(0, 0) << " " << lse_again(0, 0);
}

TEST(SdpaMerge, ResultsOverlappingTheInputsAreRejected) {
    // out may be out_a (in place) but not rows shifted into it: entries would be read after
    // being overwritten.
    RowMatrix<double> buffer = RowMatrix<double>::Random(5, 4), lse_a = RowMatrix<double>::Random(4, 2),
                      out_b = RowMatrix<double>::Random(4, 4), lse_b = RowMatrix<double>::Random(4, 2), lse(4, 2);
    const RowMatrix<double> before = buffer;
    try {
        gattn::merge_attention<double>(buffer.topRows(4), lse_a, out_b, lse_b, buffer.bottomRows(4), lse);
        ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("gattn::merge_attention: out must be out_a or out_b"), std::string::npos)
            << e.what();
    }
    EXPECT_EQ(buffer, before);
    RowMatrix<double> wide = RowMatrix<double>::Random(4, 6);  // [out | lse] side by side is fine
    gattn::merge_attention<double>(out_b, lse_b, out_b, lse_b, wide.leftCols(4), wide.rightCols(2));
    EXPECT_THROW(gattn::merge_attention<double>(out_b, wide.middleCols(3, 2), out_b, lse_b, wide.leftCols(4), lse),
                 std::invalid_argument);
    EXPECT_THROW(gattn::merge_attention<double>(out_b, lse_b, out_b, lse_b, wide.leftCols(4), wide.middleCols(3, 2)),
                 std::invalid_argument);
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

TEST(LayerForward, TraceHoldingXOutOrBiasIsRejected) {
    // The trace's matrices are resized, which frees their storage: x, out or the bias living in
    // one of them would be read or written after it is freed.
    const auto c = small_config();
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 5));
    const RowMatrix<float> x = RowMatrix<float>::Random(8, 16);
    gattn::ForwardTrace<float> trace;
    trace.gate_scores = RowMatrix<float>::Constant(8, 16, 3.0f);
    const RowMatrix<float> before = trace.gate_scores;
    try {
        layer.forward(x, 2, trace.gate_scores, {}, &trace);
        ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("trace->gate_scores must not hold x, out or options.bias"),
                  std::string::npos)
            << e.what();
    }
    EXPECT_EQ(trace.gate_scores, before);
    trace.probabilities = x;
    try {
        layer.forward(trace.probabilities, 2, trace.gate_scores.middleCols(0, 16), {}, &trace);
        ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("must not hold x, out or options.bias"), std::string::npos) << e.what();
    }
    EXPECT_EQ(trace.probabilities, x);
    // A bias inside a trace matrix: refused before the trace is touched.
    trace.probabilities = RowMatrix<float>::Zero(2 * 4 * 4, 4);  // holds a [2, 4, 4, 4] bias
    const RowMatrix<float> probabilities = trace.probabilities;
    gattn::ForwardOptions<float> opt;
    opt.bias = {trace.probabilities.data(), 2, 4, 4, 4};
    RowMatrix<float> out = RowMatrix<float>::Constant(8, 16, 5.0f);
    try {
        layer.forward(x, 2, out, opt, &trace);
        ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("trace->probabilities must not hold x, out or options.bias"),
                  std::string::npos)
            << e.what();
    }
    EXPECT_EQ(trace.probabilities, probabilities);
    EXPECT_EQ(trace.gate_scores, before);
    EXPECT_TRUE((out.array() == 5.0f).all());
}

TEST(LayerForward, RightPaddedBatchMatchesEachSequenceAlone) {
    // A right-padded batch with key_lengths is the same self-attention as each sequence run
    // alone: token i of a sequence of L tokens sees tokens j ≤ i (causal) or |i − j| < w (window)
    // of its own sequence, whatever N is. Valid rows are checked against the float64 layer on the
    // unpadded sequence (no lengths, no masks); padding rows against the layer for U = 0, which
    // with an elementwise G1 gate and o_proj bias is that bias.
    auto causal = small_config();
    causal.o_bias = true;
    auto window = causal;
    window.causal = false;
    window.sliding_window = 2;
    for (const auto& c : {causal, window}) {
        SCOPED_TRACE(c.causal ? "causal" : "window 2");
        const auto w = gattn::make_random_weights<float>(c, 23);
        const auto wd = gattn_test::weights_to_double(w);
        const gattn::GatedMultiHeadAttention<float> layer(c, w);
        const Index B = 3, N = 7;
        const std::vector<Index> lengths = {7, 4, 0};
        const RowMatrix<float> x = gattn_test::random_matrix(B * N, c.d_model, 24).cast<float>();
        gattn::ForwardOptions<float> opt;
        opt.key_lengths = lengths;
        const RowMatrix<float> y = layer.forward(x, B, opt);
        for (Index b = 0; b < B; ++b) {
            const Index L = lengths[static_cast<std::size_t>(b)];
            if (L > 0) {
                const gattn_test::Mat alone = x.middleRows(b * N, L).cast<double>();
                expect_close<float>(RowMatrix<float>(y.middleRows(b * N, L)),
                                    gattn_test::layer_reference(c, wd, alone, 1).y,
                                    "sequence " + std::to_string(b) + " alone");
            }
            for (Index i = L; i < N; ++i)
                expect_close<float>(RowMatrix<float>(y.row(b * N + i)), RowMatrix<double>(wd.o_proj_bias.transpose()),
                                    "padding row " + std::to_string(i) + " of sequence " + std::to_string(b));
        }
    }
}

/// Expects `f` to throw exactly E (shape_error, or a std::invalid_argument that is not a
/// shape_error) with a message holding `function` and each of `parts` (argument, expected and
/// actual values), and `out` unchanged.
TEST(LayerForward, HugeLogitsMatchFloat64Reference) {
    // Logits of ±1e30 reach the softmax two ways: an additive bias of ±1e30 (finite, so not a
    // mask: +1e30 keys share all the weight, a row of −1e30 keys averages them) and inputs so
    // large that Q·K is about 1e30. Both against the float64 layer_reference.
    const auto c = small_config();  // causal, G1 elementwise gate
    const auto w = gattn::make_random_weights<float>(c, 17);
    const gattn::GatedMultiHeadAttention<float> layer(c, w);
    const auto wd = gattn_test::weights_to_double(w);
    const Index B = 2, N = 9, H = c.num_heads;
    const RowMatrix<float> x = gattn_test::random_matrix(B * N, c.d_model, 18).cast<float>();
    std::vector<float> bias(static_cast<std::size_t>(B * N * N));
    std::vector<double> dense(static_cast<std::size_t>(B * H * N * N));
    for (Index b = 0; b < B; ++b)
        for (Index i = 0; i < N; ++i)
            for (Index j = 0; j < N; ++j) {
                const Index kind = (i + 2 * j + b) % 5;
                const float value = kind == 0   ? 1e30f
                                    : kind == 1 ? -1e30f
                                    : kind == 2 ? -std::numeric_limits<float>::infinity()
                                                : 0.25f * float(j - i);
                bias[static_cast<std::size_t>((b * N + i) * N + j)] = value;
                for (Index h = 0; h < H; ++h) dense[static_cast<std::size_t>(((b * H + h) * N + i) * N + j)] = value;
            }
    gattn::ForwardOptions<float> opt;
    opt.bias = {bias.data(), B, 1, N, N};
    const RowMatrix<float> y = layer.forward(x, B, opt);
    EXPECT_TRUE(y.allFinite());
    expect_close<float>(y, gattn_test::layer_reference(c, wd, x.cast<double>(), B, {}, {}, dense).y, "bias of 1e30");

    const RowMatrix<float> huge = x * 1e15f;
    const RowMatrix<float> y_huge = layer.forward(huge, B);
    EXPECT_TRUE(y_huge.allFinite());
    const auto ref = gattn_test::layer_reference(c, wd, huge.cast<double>(), B);
    EXPECT_GT(ref.probabilities.rowwise().maxCoeff().mean(), 0.99) << "the huge logits should give one-hot rows";
    expect_close<float>(y_huge, ref.y, "Q.K of 1e30");
}

TEST(LayerForward, NonFinitePaddedTokensDoNotReachValidTokens) {
    // Padding tokens full of NaN and ±∞ give NaN keys, values and gates; key_lengths masks them,
    // so every valid token's output is bitwise the one computed with zeros there, for gates on
    // the keys' side (G2, G3) and on the queries' side alike.
    auto specs = std::vector<gattn::GateSpec>{gattn::GateSpec{}, gattn::GateSpec::g1_elementwise(),
                                              gattn::GateSpec::g1_headwise()};
    for (auto pos : {gattn::GatePosition::G2, gattn::GatePosition::G3, gattn::GatePosition::G5}) {
        gattn::GateSpec g;
        g.position = pos;
        specs.push_back(g);
    }
    for (const auto& spec : specs) {
        SCOPED_TRACE(gattn::describe(spec));
        auto c = small_config();
        c.causal = false;
        c.gate = spec;
        const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 13));
        RowMatrix<float> x = RowMatrix<float>::Random(12, 16);  // 2 sequences of 6 tokens
        gattn::ForwardOptions<float> opt;
        opt.key_lengths = {4, 5};
        x.row(4).setZero();
        x.row(5).setZero();
        x.row(11).setZero();
        const auto clean = layer.forward(x, 2, opt);
        x.row(4).setConstant(std::numeric_limits<float>::quiet_NaN());
        x.row(5).setConstant(std::numeric_limits<float>::infinity());
        x(11, 0) = -std::numeric_limits<float>::infinity();
        x(11, 1) = std::numeric_limits<float>::quiet_NaN();
        const auto dirty = layer.forward(x, 2, opt);
        for (Index r : {0, 1, 2, 3, 6, 7, 8, 9, 10}) {
            EXPECT_TRUE(dirty.row(r).allFinite()) << "row " << r;
            EXPECT_EQ(RowMatrix<float>(dirty.row(r)), RowMatrix<float>(clean.row(r))) << "row " << r;
        }
    }
}

template <class E, class F>
void expect_rejected(F&& f, const std::string& function, const std::vector<std::string>& parts,
                     const RowMatrix<float>& out) {
    const RowMatrix<float> before = out;
    try {
        f();
        ADD_FAILURE() << "no exception; expected one mentioning " << parts.front();
    } catch (const std::invalid_argument& e) {
        const std::string what = e.what();
        const bool is_shape_error = dynamic_cast<const gattn::shape_error*>(&e) != nullptr;
        EXPECT_EQ(is_shape_error, (std::is_same_v<E, gattn::shape_error>)) << what;
        EXPECT_EQ(what.rfind(function + ": ", 0), 0u) << what;
        for (const auto& part : parts) EXPECT_NE(what.find(part), std::string::npos) << "'" << part << "' in " << what;
    }
    EXPECT_EQ(out, before) << "output written although the call was rejected";
}

TEST(LayerForward, BadInputThrowsAndLeavesOutputUntouched) {
    const auto c = small_config();  // D = 16, H = 4, H_kv = 2
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 1));
    const RowMatrix<float> x = RowMatrix<float>::Random(6, 16);  // B = 2 sequences of N = 3
    RowMatrix<float> out = RowMatrix<float>::Constant(6, 16, 7.0f);
    const std::string fn = "gattn::GatedMultiHeadAttention::forward";
    using gattn::shape_error;
    using std::invalid_argument;
    expect_rejected<shape_error>([&] { layer.forward(RowMatrix<float>::Random(6, 15), 2, out); }, fn,
                                 {"x must have shape [B*N, d_model] = [multiple of 2, 16]", "got [6, 15]"}, out);
    expect_rejected<shape_error>([&] { layer.forward(x, 4, out); }, fn,
                                 {"x must have shape", "[multiple of 4, 16]", "got [6, 16]"}, out);
    expect_rejected<invalid_argument>([&] { layer.forward(x, -1, out); }, fn, {"batch must be >= 0, got -1"}, out);
    expect_rejected<shape_error>([&] { layer.forward(x, 0, out); }, fn,
                                 {"x must have shape [0, 16] (batch 0 has no rows), got [6, 16]"}, out);
    RowMatrix<float> narrow = RowMatrix<float>::Constant(6, 8, 7.0f);
    expect_rejected<shape_error>([&] { layer.forward(x, 2, narrow); }, fn, {"out must have shape [6, 16], got [6, 8]"},
                                 narrow);

    gattn::ForwardOptions<float> opt;
    opt.key_lengths = {3, 4};
    expect_rejected<invalid_argument>([&] { layer.forward(x, 2, out, opt); }, fn,
                                      {"options.key_lengths[1] must be in [0, N_k = 3], got 4"}, out);
    opt.key_lengths = {-1, 3};
    expect_rejected<invalid_argument>([&] { layer.forward(x, 2, out, opt); }, fn,
                                      {"options.key_lengths[0] must be in [0, N_k = 3], got -1"}, out);
    opt.key_lengths = {3};
    expect_rejected<shape_error>([&] { layer.forward(x, 2, out, opt); }, fn,
                                 {"options.key_lengths must have shape [2], got [1]"}, out);
    opt.key_lengths = {3, 3, 3};
    expect_rejected<shape_error>([&] { layer.forward(x, 2, out, opt); }, fn,
                                 {"options.key_lengths must have shape [2], got [3]"}, out);

    // Masks are [B|1, H|1, N|1, N]: here [1|2, 1|4, 1|3, 3].
    std::unique_ptr<bool[]> allow(new bool[256]);
    std::fill(allow.get(), allow.get() + 256, true);
    std::vector<float> bias(256, 0.0f);
    const std::string mask_shape = "must have shape [1|2, 1|4, 1|3, 3], got ";
    const gattn::MaskView<bool> bad_bool[] = {
        {allow.get(), 1, 3, 1, 3}, {allow.get(), 3, 1, 1, 3}, {allow.get(), 1, 1, 2, 3}, {allow.get(), 1, 1, 1, 4}};
    const char* bad_dims[] = {"[1, 3, 1, 3]", "[3, 1, 1, 3]", "[1, 1, 2, 3]", "[1, 1, 1, 4]"};
    for (int i = 0; i < 4; ++i) {
        gattn::ForwardOptions<float> o;
        o.bool_mask = bad_bool[i];
        expect_rejected<shape_error>([&] { layer.forward(x, 2, out, o); }, fn,
                                     {"options.bool_mask " + mask_shape + bad_dims[i]}, out);
        gattn::ForwardOptions<float> ob;
        ob.bias = {bias.data(), bad_bool[i].batch, bad_bool[i].heads, bad_bool[i].query_len, bad_bool[i].key_len};
        expect_rejected<shape_error>([&] { layer.forward(x, 2, out, ob); }, fn,
                                     {"options.bias " + mask_shape + bad_dims[i]}, out);
    }
    RowMatrix<float> same = x;
    expect_rejected<invalid_argument>([&] { layer.forward(same, 2, same); }, fn, {"out must not overlap x"}, same);
    // x and out side by side in one matrix share no element: accepted, the same output as with
    // separate matrices, x left as it was. Shifted by one column, out reaches into x: refused.
    RowMatrix<float> work(6, 33);
    work.leftCols(16) = x;
    work.rightCols(17).setConstant(7.0f);
    layer.forward(work.leftCols(16), 2, work.middleCols(16, 16));
    EXPECT_TRUE(work.middleCols(16, 16) == layer.forward(x, 2)) << "out beside x in one matrix";
    const auto ref = gattn_test::layer_reference(c,
                                                 gattn_test::weights_to_double(gattn::make_random_weights<float>(c, 1)),
                                                 x.cast<double>(), 2);
    expect_close<float>(RowMatrix<float>(work.middleCols(16, 16)), ref.y, "out beside x in one matrix");
    EXPECT_TRUE(work.leftCols(16) == x) << "x was written";
    EXPECT_TRUE((work.rightCols(1).array() == 7.0f).all()) << "a column right of out was written";
    expect_rejected<invalid_argument>([&] { layer.forward(work.leftCols(16), 2, work.middleCols(15, 16)); }, fn,
                                      {"out must not overlap x"}, work);
}

/// Batched ragged decoding (serving): sequences whose caches hold 1 to 1500 tokens (across the
/// decoding kernel's 512-key chunks) decoded in one call give bitwise what decoding each
/// sequence alone gives, on 1 and 2 threads. S: the weights' and cache's storage.
template <class S>
void check_ragged_decoding() {
    gattn::AttentionConfig c;
    c.d_model = 64;
    c.num_heads = 8;
    c.num_kv_heads = 2;
    c.head_dim = 32;  // a multiple of 32: bf16 caches take the VDPBF16PS kernel where it runs
    c.causal = true;
    c.gate = gattn::GateSpec::g1_elementwise();
    const gattn::GatedMultiHeadAttention<S> layer(c, gattn::make_random_weights<float>(c, 11).template cast<S>());
    const std::vector<Index> lengths = {1, 700, 1500, 33, 512};
    const Index B = static_cast<Index>(lengths.size()), capacity = 1501, width = c.num_kv_heads * c.head_dim;
    const Index longest = *std::max_element(lengths.begin(), lengths.end());
    const RowMatrix<S> keys = RowMatrix<float>::Random(B * longest, width).cast<S>();
    const RowMatrix<S> values = RowMatrix<float>::Random(B * longest, width).cast<S>();
    const RowMatrix<float> x = RowMatrix<float>::Random(B, c.d_model);
    auto batched = layer.make_cache(B, capacity);
    batched.append(keys, values, lengths);
    std::vector<RowMatrix<float>> outs;
#ifdef _OPENMP
    const int saved = omp_get_max_threads();
    for (int threads : {1, 2}) {
        omp_set_num_threads(threads);
#endif
        RowMatrix<float> out(B, c.d_model);
        layer.forward(x, batched, out);
        batched.truncate(lengths);
        outs.push_back(out);
#ifdef _OPENMP
    }
    omp_set_num_threads(saved);
#endif
    for (Index b = 0; b < B; ++b) {
        auto alone = layer.make_cache(1, capacity);
        alone.append(keys.middleRows(b * longest, longest), values.middleRows(b * longest, longest),
                     {lengths[static_cast<std::size_t>(b)]});
        RowMatrix<float> out(1, c.d_model);
        layer.forward(x.row(b), alone, out);
        for (const auto& batch_out : outs)
            EXPECT_TRUE(batch_out.row(b) == out.row(0))
                << "sequence " << b << " of " << lengths[static_cast<std::size_t>(b)] << " cached tokens";
    }
}

TEST(LayerDecode, BatchedRaggedDecodingEqualsEachSequenceAlone) {
    check_ragged_decoding<float>();
    check_ragged_decoding<gattn::bfloat16>();
}

/// A model's caches: one per layer from the layers' make_cache, each refused by the other
/// layers, truncated all or none.
TEST(LayerDecode, CacheSetHoldsEachLayersOwnCache) {
    const auto c = small_config();  // D = 16, H = 4, H_kv = 2, d = 4
    const gattn::GatedMultiHeadAttention<float> first(c, gattn::make_random_weights<float>(c, 1));
    const gattn::GatedMultiHeadAttention<float> second(c, gattn::make_random_weights<float>(c, 2));
    gattn::KVCacheSet<float> caches(std::vector<const gattn::GatedMultiHeadAttention<float>*>{&first, &second}, 2, 4);
    ASSERT_EQ(caches.size(), 2u);
    EXPECT_EQ(caches[0].owner(), first.layer_id());
    EXPECT_EQ(caches[1].owner(), second.layer_id());
    RowMatrix<float> out2(2, 16), out4(4, 16);
    first.forward(RowMatrix<float>::Random(2, 16), caches[0], out2);   // 1 token each
    second.forward(RowMatrix<float>::Random(4, 16), caches[1], out4);  // 2 tokens each
    EXPECT_THROW(first.forward(RowMatrix<float>::Random(2, 16), caches[1], out2), std::invalid_argument);
    // {2, 2} fits the second cache, not the first: nothing changes.
    EXPECT_THROW(caches.truncate({2, 2}), std::invalid_argument);
    EXPECT_EQ(caches[0].lengths(), std::vector<Index>({1, 1}));
    EXPECT_EQ(caches[1].lengths(), std::vector<Index>({2, 2}));
    caches.truncate({1, 0});
    EXPECT_EQ(caches[0].lengths(), std::vector<Index>({1, 0}));
    EXPECT_EQ(caches[1].lengths(), std::vector<Index>({1, 0}));
    EXPECT_EQ(caches.lengths(), std::vector<Index>({1, 0}));
    caches.clear();
    EXPECT_EQ(caches[1].lengths(), std::vector<Index>({0, 0}));
    EXPECT_THROW(caches[2], std::out_of_range);
}

/// A window cache by hand: window 3, 4 rows per sequence. Token t's key row is (t, b) so that
/// every stored row names its token. Appends that do not fit keep the last w − 1 = 2 tokens at
/// the front; a call bringing more than fits beside them grows the rows to w − 1 + count.
TEST(WindowCache, KeepsTheWindowsTokensInOrder) {
    gattn::KVCache<float> cache(2, 4, 1, 2, 0, 0, 3);
    EXPECT_EQ(cache.window(), 3);
    Index next[2] = {0, 0};
    auto append = [&](std::vector<Index> counts) {
        const Index n = *std::max_element(counts.begin(), counts.end());
        RowMatrix<float> k = RowMatrix<float>::Constant(2 * n, 2, -1.0f);
        for (Index b = 0; b < 2; ++b)
            for (Index t = 0; t < counts[static_cast<std::size_t>(b)]; ++t) {
                k(b * n + t, 0) = static_cast<float>(next[b]++);
                k(b * n + t, 1) = static_cast<float>(b);
            }
        cache.append(k, k, counts);
    };
    // The stored tokens of sequence b, by the position their rows name.
    auto stored = [&](Index b) {
        std::vector<Index> tokens;
        for (Index t = 0; t < cache.lengths()[static_cast<std::size_t>(b)]; ++t) {
            EXPECT_EQ(cache.keys()(b * cache.capacity() + t, 1), float(b));
            EXPECT_EQ(cache.values()(b * cache.capacity() + t, 0), cache.keys()(b * cache.capacity() + t, 0));
            tokens.push_back(static_cast<Index>(cache.keys()(b * cache.capacity() + t, 0)));
        }
        return tokens;
    };
    append({3, 1});
    EXPECT_EQ(stored(0), std::vector<Index>({0, 1, 2}));
    EXPECT_EQ(cache.lengths_after({2, 0}), std::vector<Index>({4, 1}));  // tokens 1, 2 kept, 3 and 4 added
    append({2, 0});                                                      // 3 + 2 > 4: tokens 1, 2 move to the front
    EXPECT_EQ(stored(0), std::vector<Index>({1, 2, 3, 4}));
    EXPECT_EQ(stored(1), std::vector<Index>({0}));
    EXPECT_EQ(cache.first_positions(), std::vector<Index>({1, 0}));
    EXPECT_EQ(cache.tokens_seen(), std::vector<Index>({5, 1}));
    EXPECT_EQ(cache.capacity(), 4);
    EXPECT_EQ(cache.capacity_after({5, 1}), 7);  // 2 kept + 5 new: the rows grow
    append({5, 1});
    EXPECT_EQ(cache.capacity(), 7);
    EXPECT_EQ(cache.keys().rows(), 14);
    EXPECT_EQ(stored(0), std::vector<Index>({3, 4, 5, 6, 7, 8, 9}));
    EXPECT_EQ(stored(1), std::vector<Index>({0, 1}));  // kept in place
    EXPECT_EQ(cache.tokens_seen(), std::vector<Index>({10, 2}));
    cache.truncate({6, 2});  // reject the last token of sequence 0
    EXPECT_EQ(cache.tokens_seen(), std::vector<Index>({9, 2}));
    // Sequence 0 has dropped tokens: it keeps at least w − 1 = 2 (token 3 is gone, which a
    // length of 1 would need); sequence 1 has dropped none and may go back to 0.
    try {
        cache.truncate({1, 0});
        ADD_FAILURE() << "truncating below the window was accepted";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("lengths[0] must be in [2, 6], got 1"), std::string::npos) << e.what();
    }
    EXPECT_EQ(cache.tokens_seen(), std::vector<Index>({9, 2}));
    cache.truncate({2, 0});
    EXPECT_EQ(cache.tokens_seen(), std::vector<Index>({5, 0}));
    EXPECT_THROW(cache.lengths_after({1}), gattn::shape_error);
    EXPECT_THROW(gattn::KVCache<float>(1, 4, 1, 2, 0, 0, Index(1) << 41), std::invalid_argument);
    EXPECT_THROW(gattn::KVCache<float>(1, 4, 1, 2, 0, 0, -1), std::invalid_argument);
    cache.clear();
    EXPECT_EQ(cache.tokens_seen(), std::vector<Index>({0, 0}));
    EXPECT_EQ(cache.first_positions(), std::vector<Index>({0, 0}));
}

/// A sliding-window layer (window 4, ALiBi and sinks beside the gate) decoding two ragged
/// sequences for 108 and 87 tokens, in calls of 1 to 11 tokens: its window cache (make_cache, 8 rows per
/// sequence, more only for the 11-token call) gives what a full cache of every token gives, and
/// its memory stays O(window).
TEST(WindowCache, DecodingEqualsTheFullCache) {
    gattn::AttentionConfig c = small_config();
    c.sliding_window = 4;
    c.alibi = true;
    c.sinks = true;
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 5));
    auto window_cache = layer.make_cache(2, 1000);
    ASSERT_EQ(window_cache.window(), 4);
    ASSERT_EQ(window_cache.capacity(), 8);
    gattn::KVCache<float> full(2, 128, c.num_kv_heads, c.head_dim);
    const std::vector<std::vector<Index>> schedule = {{11, 3}, {1, 1}, {1, 0}, {3, 5}, {1, 1}, {7, 2},
                                                      {1, 1},  {2, 9}, {1, 1}, {1, 1}, {6, 4}, {1, 1}};
    for (int round = 0; round < 3; ++round)
        for (const auto& counts : schedule) {
            const Index n = *std::max_element(counts.begin(), counts.end());
            const RowMatrix<float> x = RowMatrix<float>::Random(2 * n, c.d_model);
            RowMatrix<float> y_window(2 * n, c.d_model), y_full(2 * n, c.d_model);
            gattn::ForwardTrace<float> trace_window, trace_full;
            layer.forward(x, window_cache, y_window, counts, &trace_window);
            layer.forward(x, full, y_full, counts, &trace_full);
            for (Index b = 0; b < 2; ++b)
                for (Index t = 0; t < counts[static_cast<std::size_t>(b)]; ++t) {
                    const std::string where = "sequence " + std::to_string(b) + " token " +
                                              std::to_string(full.lengths()[static_cast<std::size_t>(b)] -
                                                             counts[static_cast<std::size_t>(b)] + t);
                    const RowMatrix<double> want = y_full.row(b * n + t).cast<double>();
                    expect_close<float>(RowMatrix<float>(y_window.row(b * n + t)), want, where);
                    EXPECT_NEAR(trace_window.first_key_attention(b * n + t, 0),
                                trace_full.first_key_attention(b * n + t, 0), 1e-6)
                        << where;
                }
            EXPECT_EQ(window_cache.tokens_seen(), full.lengths());
            EXPECT_LE(window_cache.capacity(), 3 + 11) << "w − 1 kept + the longest call";
        }
    EXPECT_EQ(full.lengths()[0], 108);
}

/// One step of continuous batching: sequence b brings counts[b] random new rows, all in one
/// forward over the pool, and each sequence's rows must equal the same rows run alone through
/// its own KVCache (alone[b]) within atol. With a twin (a pool holding the same tokens), the
/// same step over it on one thread gives the same bits and pages as over the pool on two.
template <class PoolScalar>
void paged_step_equals_alone(const gattn::GatedMultiHeadAttention<float>& layer, gattn::PagedKVPool<PoolScalar>& pool,
                             const std::vector<gattn::SequenceId>& seqs, std::vector<gattn::KVCache<PoolScalar>>& alone,
                             const std::vector<Index>& counts, std::mt19937& rng, double atol,
                             gattn::PagedKVPool<PoolScalar>* twin = nullptr) {
    const Index D = layer.config().d_model;
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<Index> indptr{0};
    for (Index n : counts) indptr.push_back(indptr.back() + n);
    RowMatrix<float> x(indptr.back(), D), out(indptr.back(), D);
    for (Index i = 0; i < x.size(); ++i) x.data()[i] = dist(rng);
#ifdef _OPENMP
    const int saved_threads = omp_get_max_threads();
    if (twin) omp_set_num_threads(2);
#endif
    layer.forward(x, indptr, pool, seqs, out);
    if (twin) {
#ifdef _OPENMP
        omp_set_num_threads(1);
#endif
        RowMatrix<float> one_thread(indptr.back(), D);
        layer.forward(x, indptr, *twin, seqs, one_thread);
        EXPECT_TRUE(gattn_test::same_bytes(one_thread, out)) << "1 and 2 threads";
        for (gattn::SequenceId seq : seqs) EXPECT_EQ(twin->pages(seq), pool.pages(seq)) << "1 and 2 threads";
    }
#ifdef _OPENMP
    omp_set_num_threads(saved_threads);
#endif
    for (std::size_t b = 0; b < seqs.size(); ++b) {
        const Index n = counts[b], r0 = indptr[b];
        if (n == 0) continue;
        RowMatrix<float> y(n, D);
        layer.forward(x.middleRows(r0, n), alone[b], y);
        const std::string where = "sequence " + std::to_string(b) + ", tokens from " +
                                  std::to_string(alone[b].tokens_seen()[0] - n);
        gattn_test::expect_close(out.middleRows(r0, n), y.cast<double>(), atol, 1e-5, where);
        EXPECT_EQ(pool.length(seqs[b]), alone[b].tokens_seen()[0]) << where;
    }
}

/// Continuous batching over a paged pool: three sequences that start, decode and prefill in
/// chunks at different steps, in one call per step, against each sequence run alone through a
/// KVCache of its own (the same tokens in the same chunks). int8 pools quantize the keys and
/// values of the batch's projection, which may differ from one sequence's in the last bit.
template <class PoolScalar>
void check_layer_over_pool(const gattn::AttentionConfig& c, unsigned seed, double atol) {
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, seed));
    gattn::PagedKVPool<PoolScalar> pool(64, 16, c.num_kv_heads, c.d_k(), c.d_v()), twin = pool;
    const std::vector<gattn::SequenceId> seqs{pool.allocate(), pool.allocate(), pool.allocate()};
    for (int b = 0; b < 3; ++b) twin.allocate();
    std::vector<gattn::KVCache<PoolScalar>> alone;
    for (int b = 0; b < 3; ++b) alone.push_back(layer.template make_cache<PoolScalar>(1, 200));
    const std::vector<std::vector<Index>> schedule = {{5, 9, 0}, {1, 1, 7},  {1, 0, 1},
                                                      {3, 1, 1}, {1, 1, 20}, {1, 1, 1}};
    std::mt19937 rng(seed);
    for (const std::vector<Index>& counts : schedule)
        paged_step_equals_alone(layer, pool, seqs, alone, counts, rng, atol, &twin);
}

TEST(LayerPaged, MixedBatchStepsEqualEachSequenceAlone) {
    gattn::AttentionConfig c = small_config();  // causal, G1 elementwise, GQA 4 on 2
    c.rotary_dim = 4;
    c.qk_norm = gattn::QkNorm::RmsNorm;
    check_layer_over_pool<float>(c, 21, 1e-6);
    check_layer_over_pool<gattn::bfloat16>(c, 22, 1e-6);
    check_layer_over_pool<std::int8_t>(c, 23, 2e-2);
    gattn::AttentionConfig w = small_config();  // a window, sinks, ALiBi, a headwise G2 gate
    w.sliding_window = 6;
    w.sinks = true;
    w.alibi = true;
    w.gate = gattn::GateSpec{};
    w.gate.position = gattn::GatePosition::G2;
    w.gate.granularity = gattn::GateGranularity::Headwise;
    check_layer_over_pool<float>(w, 24, 1e-6);
}

/// A causal sliding window over a pool: each step releases the pages no later token sees, so a
/// long decoding keeps at most ceil((P + w − 1) / P) pages of P tokens per sequence (3 for
/// w = 20, P = 16: after a release fewer than P + w − 1 tokens stay, plus the next token), in a
/// pool far smaller than the tokens; every step equals the same tokens through a window KVCache.
/// RoPE uses the tokens' positions in their sequence, released tokens included.
TEST(LayerPaged, SlidingWindowReleasesPagesAndEqualsAWindowCache) {
    gattn::AttentionConfig c = small_config();
    c.sliding_window = 20;
    c.rotary_dim = 4;
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 31));
    gattn::PagedKVPool<float> pool(7, 16, c.num_kv_heads, c.d_k(), c.d_v());
    const std::vector<gattn::SequenceId> seqs{pool.allocate(), pool.allocate()};
    std::vector<gattn::KVCache<float>> alone;
    for (int b = 0; b < 2; ++b) alone.push_back(layer.make_cache<float>(1, 200));
    ASSERT_EQ(alone[0].window(), 20);
    std::mt19937 rng(31);
    for (int step = 0; step < 130; ++step) {
        // Sequence 0: a 30-token prompt, then one token a step; sequence 1 joins at step 40 with
        // a 17-token chunk.
        const std::vector<Index> counts{step == 0 ? 30 : 1, step < 40 ? 0 : step == 40 ? 17 : 1};
        SCOPED_TRACE("step " + std::to_string(step));
        paged_step_equals_alone(layer, pool, seqs, alone, counts, rng, 1e-6);
        for (gattn::SequenceId seq : seqs) EXPECT_LE(pool.pages(seq).size(), 3u);
    }
    EXPECT_EQ(pool.length(seqs[0]), 159);
    EXPECT_EQ(pool.first_position(seqs[0]), 128);  // pages 0..7 released: token 159 sees 140..159
}

/// Rolling a sequence back after its front pages were released: as far back as the window of
/// its next token still finds every key stored (PagedKVPool::min_truncate_length), the next
/// steps equal a full KVCache rolled back the same; one token further is refused, unchanged.
TEST(LayerPaged, RollbackAfterReleaseKeepsTheNextTokensWindow) {
    gattn::AttentionConfig c = small_config();
    c.sliding_window = 20;
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 37));
    gattn::PagedKVPool<float> pool(8, 16, c.num_kv_heads, c.d_k(), c.d_v());
    const std::vector<gattn::SequenceId> seqs{pool.allocate()};
    std::vector<gattn::KVCache<float>> full;
    full.emplace_back(1, 200, c.num_kv_heads, c.d_k(), c.d_v());  // no window: keeps every token
    std::mt19937 rng(37);
    // A step releases what its first token no longer sees: the prompt's step keeps all 64
    // tokens; token 64 sees 45..64, so its step releases tokens 0..31 (pages 0 and 1). After a
    // rollback to L the next token sees L − 19..L: L ≥ 32 + 19 = 51.
    paged_step_equals_alone(layer, pool, seqs, full, {64}, rng, 1e-6);
    EXPECT_EQ(pool.first_position(seqs[0]), 0);
    paged_step_equals_alone(layer, pool, seqs, full, {1}, rng, 1e-6);
    ASSERT_EQ(pool.first_position(seqs[0]), 32);
    EXPECT_EQ(pool.min_truncate_length(seqs[0]), 51);
    const std::vector<Index> pages = pool.pages(seqs[0]);
    try {
        pool.truncate(seqs[0], 50);
        ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
        for (const std::string w : {"PagedKVPool::truncate", "length", "[51, 65]", "first 32 tokens are released",
                                    "window of 20 keys", "got 50"})
            EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what() << " lacks " << w;
    }
    EXPECT_EQ(pool.length(seqs[0]), 65);
    EXPECT_EQ(pool.pages(seqs[0]), pages);
    pool.truncate(seqs[0], 51);
    full[0].truncate({51});
    for (int step = 0; step < 3; ++step) paged_step_equals_alone(layer, pool, seqs, full, {1}, rng, 1e-6);
}

/// A model's pools where one layer has a sliding window: a rollback that layer's window cannot
/// take is refused before any pool changes, naming the layer.
TEST(LayerPaged, PoolSetRollbackIsCheckedInEveryLayerFirst) {
    gattn::AttentionConfig full_config = small_config(), window_config = small_config();
    window_config.sliding_window = 20;
    const gattn::GatedMultiHeadAttention<float> full_layer(full_config,
                                                           gattn::make_random_weights<float>(full_config, 41));
    const gattn::GatedMultiHeadAttention<float> window_layer(window_config,
                                                             gattn::make_random_weights<float>(window_config, 43));
    const std::vector<const gattn::GatedMultiHeadAttention<float>*> layers{&full_layer, &window_layer};
    gattn::PagedKVPoolSet<float> pools(layers, 8, 16);
    const gattn::SequenceId seq = pools.allocate();
    std::mt19937 rng(41);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    RowMatrix<float> x(64, full_config.d_model), h(64, full_config.d_model), y(64, full_config.d_model);
    for (Index i = 0; i < x.size(); ++i) x.data()[i] = dist(rng);
    full_layer.forward(x, {0, 64}, pools[0], {seq}, h);
    window_layer.forward(h, {0, 64}, pools[1], {seq}, y);
    full_layer.forward(x.topRows(1), {0, 1}, pools[0], {seq}, h.topRows(1));  // token 64 sees 45..64
    window_layer.forward(h.topRows(1), {0, 1}, pools[1], {seq}, y.topRows(1));
    ASSERT_EQ(pools[1].first_position(seq), 32);
    try {
        pools.truncate(seq, 40);
        ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
        for (const std::string w : {"PagedKVPoolSet::truncate", "[51, 65]", "layer 1", "got 40"})
            EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what() << " lacks " << w;
    }
    EXPECT_EQ(pools[0].length(seq), 65);
    EXPECT_EQ(pools[1].length(seq), 65);
    pools.truncate(seq, 51);
    EXPECT_EQ(pools[0].length(seq), 51);
    EXPECT_EQ(pools[1].length(seq), 51);
}

/// A window layer before a full one, whose pool runs out of pages in the middle of a step:
/// the window layer has appended (and released what the step's first token no longer sees),
/// the full layer refused; the documented rollback to the length before the step succeeds in
/// both pools, and the next step runs. free_pages() is what every pool can give (the full
/// layer's, here fewer than the window layer's).
TEST(LayerPaged, PoolSetRollsBackAStepALaterLayerRefused) {
    gattn::AttentionConfig window_config = small_config(), full_config = small_config();
    window_config.sliding_window = 4;
    const gattn::GatedMultiHeadAttention<float> window_layer(window_config,
                                                             gattn::make_random_weights<float>(window_config, 47));
    const gattn::GatedMultiHeadAttention<float> full_layer(full_config,
                                                           gattn::make_random_weights<float>(full_config, 53));
    gattn::PagedKVPoolSet<float> pools(
        std::vector<const gattn::GatedMultiHeadAttention<float>*>{&window_layer, &full_layer}, 4, 16);
    const gattn::SequenceId seq = pools.allocate();
    std::mt19937 rng(47);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    auto step = [&](Index n) {
        RowMatrix<float> x(n, window_config.d_model), h(n, window_config.d_model), y(n, window_config.d_model);
        for (Index i = 0; i < x.size(); ++i) x.data()[i] = dist(rng);
        window_layer.forward(x, {0, n}, pools[0], {seq}, h);
        full_layer.forward(h, {0, n}, pools[1], {seq}, y);
    };
    step(40);  // 3 pages in each pool
    step(1);   // token 40 sees 37..40: the window layer keeps page 2 only
    EXPECT_EQ(pools[0].first_position(seq), 32);
    EXPECT_EQ(pools[0].free_pages(), 3);
    EXPECT_EQ(pools[1].free_pages(), 1);
    EXPECT_EQ(pools.free_pages(), 1);
    try {
        step(24);  // 65 tokens: the window layer's 3 pages fit, the full layer's 5 do not
        ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("needs more pages than the pool has free"), std::string::npos) << e.what();
    }
    EXPECT_EQ(pools[0].length(seq), 65);
    EXPECT_EQ(pools[1].length(seq), 41);
    pools.truncate(seq, 41);
    EXPECT_EQ(pools[0].length(seq), 41);
    EXPECT_EQ(pools[0].first_position(seq), 32);
    step(7);  // within every pool's pages
    EXPECT_EQ(pools[0].length(seq), 48);
    EXPECT_EQ(pools[1].length(seq), 48);
}

TEST(LayerPaged, BadStepsWriteNothing) {
    const gattn::AttentionConfig c = small_config();
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 25));
    gattn::PagedKVPool<float> pool(2, 16, c.num_kv_heads, c.head_dim);
    const std::vector<gattn::SequenceId> seqs{pool.allocate(), pool.allocate()};
    const RowMatrix<float> x = RowMatrix<float>::Random(40, c.d_model);
    RowMatrix<float> out = RowMatrix<float>::Constant(40, c.d_model, 7.0f);
    auto expect_refused = [&](const std::vector<Index>& indptr, const std::vector<std::string>& words) {
        try {
            layer.forward(x, indptr, pool, seqs, out);
            ADD_FAILURE() << "no exception";
        } catch (const std::invalid_argument& e) {
            for (const std::string& w : words)
                EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what() << " lacks " << w;
        }
        EXPECT_TRUE((out.array() == 7.0f).all());
        EXPECT_EQ(pool.length(seqs[0]) + pool.length(seqs[1]), 0);
        EXPECT_EQ(pool.free_pages(), 2);
    };
    expect_refused({0, 40}, {"GatedMultiHeadAttention::forward", "qo_indptr", "[3]", "[2]"});
    // A step without rows still names sequences of the pool, each once.
    for (const auto& [bad, words] : std::vector<std::pair<std::vector<gattn::SequenceId>, std::string>>{
             {{12345, seqs[0]}, "seqs[0] must be a sequence of the pool"},
             {{seqs[0], seqs[0]}, "seqs[1] is sequence 0, also seqs[0]"}}) {
        try {
            layer.forward(x.topRows(0), {0, 0, 0}, pool, bad, out.topRows(0));
            ADD_FAILURE() << "no exception for " << words;
        } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find("GatedMultiHeadAttention::forward: seqs["), std::string::npos)
                << e.what();
            EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
        }
    }
    expect_refused({0, 10, 30}, {"qo_indptr", "x.rows() = 40", "0 ... 30"});
    expect_refused({0, 41, 40}, {"qo_indptr[2]", "must be >= qo_indptr[1] = 41"});
    // 33 tokens need 3 pages of 16, and the pool has 2.
    expect_refused({0, 33, 40}, {"append_ragged", "more pages than the pool has free"});
    gattn::PagedKVPool<float> other(4, 16, 1, c.head_dim);
    try {
        layer.forward(x, {0, 20, 40}, other, seqs, out);
        ADD_FAILURE() << "no exception";
    } catch (const gattn::shape_error& e) {
        EXPECT_NE(std::string(e.what()).find("pool"), std::string::npos) << e.what();
    }
    EXPECT_TRUE((out.array() == 7.0f).all());
}

/// Rolling a model's caches back after a window cache dropped tokens: to where the window's
/// tokens are still stored, it gives what a full cache gives; further back it is refused, in
/// tokens seen, and nothing changes. make_cache gives a window cache from a capacity of 2w + 1.
TEST(WindowCache, RollbackStaysWithinTheWindow) {
    gattn::AttentionConfig c = small_config();
    c.sliding_window = 4;
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 3));
    EXPECT_EQ(layer.make_cache(1, 8).window(), 0);
    EXPECT_EQ(layer.make_cache(1, 9).window(), 4);
    gattn::KVCacheSet<float> caches(std::vector<const gattn::GatedMultiHeadAttention<float>*>{&layer}, 1, 100);
    gattn::KVCache<float> full(1, 100, c.num_kv_heads, c.head_dim);
    const RowMatrix<float> x = RowMatrix<float>::Random(11, 16);
    RowMatrix<float> a(1, 16), b(1, 16);
    for (Index t = 0; t < 10; ++t) {
        layer.forward(x.row(t), caches[0], a);
        layer.forward(x.row(t), full, b);
    }
    ASSERT_EQ(caches.lengths(), std::vector<Index>({10}));
    const Index first = caches[0].first_positions()[0];  // tokens [first, 10) stored
    ASSERT_GT(first, 0);
    try {
        caches.truncate({first + 2});
        ADD_FAILURE() << "a rollback past the window's tokens was accepted";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("gattn::KVCacheSet::truncate: lengths[0] must be in [" +
                                             std::to_string(first + 3) + ", 10] tokens seen, got " +
                                             std::to_string(first + 2)),
                  std::string::npos)
            << e.what();
    }
    EXPECT_EQ(caches.lengths(), std::vector<Index>({10}));
    EXPECT_THROW(caches.truncate({11}), std::invalid_argument);
    caches.truncate({first + 3});
    full.truncate({first + 3});
    layer.forward(x.row(10), caches[0], a);
    layer.forward(x.row(10), full, b);
    expect_close<float>(a, b.cast<double>(), "after the rollback");
}

/// A window cache is refused by a layer with another window or none, and by Qwen3-Next (whose
/// attention sees every token); nothing is written.
TEST(WindowCache, LayersRefuseAnotherWindow) {
    gattn::AttentionConfig c = small_config();
    const gattn::GatedMultiHeadAttention<float> full_layer(c, gattn::make_random_weights<float>(c, 1));
    c.sliding_window = 5;
    const gattn::GatedMultiHeadAttention<float> window5(c, gattn::make_random_weights<float>(c, 1));
    gattn::KVCache<float> cache(1, 8, c.num_kv_heads, c.head_dim, 0, 0, 3);
    RowMatrix<float> out = RowMatrix<float>::Constant(1, 16, 7.0f);
    const RowMatrix<float> x = RowMatrix<float>::Random(1, 16);
    for (const auto* layer : {&full_layer, &window5}) {
        try {
            layer->forward(x, cache, out);
            ADD_FAILURE() << "a window-3 cache was accepted";
        } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find("cache keeps only a window of 3 tokens; this layer's window is "),
                      std::string::npos)
                << e.what();
        }
    }
    EXPECT_EQ(cache.tokens_seen(), std::vector<Index>({0}));
    EXPECT_TRUE((out.array() == 7.0f).all());
    // A full cache serves a windowed layer (it keeps more than needed).
    gattn::KVCache<float> full(1, 8, c.num_kv_heads, c.head_dim);
    window5.forward(x, full, out);
    EXPECT_EQ(full.lengths(), std::vector<Index>({1}));
}

TEST(LayerDecode, BadInputThrowsAndLeavesCacheAndOutputUntouched) {
    const auto c = small_config();  // D = 16, H = 4, H_kv = 2, d = 4
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 1));
    auto cache = layer.make_cache(2, 4);
    const RowMatrix<float> x = RowMatrix<float>::Random(6, 16);  // B = 2 sequences of N = 3 slots
    RowMatrix<float> out = RowMatrix<float>::Constant(6, 16, 7.0f);
    layer.forward(x.topRows(2), cache, out.topRows(2));  // one token each
    const RowMatrix<float> keys = cache.keys(), values = cache.values();
    const std::vector<Index> lengths = cache.lengths();
    const std::string fn = "gattn::GatedMultiHeadAttention::forward";
    using gattn::shape_error;
    using std::invalid_argument;
    auto untouched = [&] {
        EXPECT_EQ(cache.lengths(), lengths);
        EXPECT_TRUE(gattn_test::same_bytes(cache.keys(), keys));
        EXPECT_TRUE(gattn_test::same_bytes(cache.values(), values));
    };
    expect_rejected<shape_error>([&] { layer.forward(RowMatrix<float>::Random(6, 15), cache, out); }, fn,
                                 {"x must have shape [B*N, d_model] = [multiple of 2, 16]", "got [6, 15]"}, out);
    expect_rejected<shape_error>([&] { layer.forward(RowMatrix<float>::Random(5, 16), cache, out); }, fn,
                                 {"x must have shape", "(B = the cache's batch, 2)", "got [5, 16]"}, out);
    // Another layer of the same config (same heads): its cache is refused, and this one's too.
    const gattn::GatedMultiHeadAttention<float> twin(c, gattn::make_random_weights<float>(c, 2));
    auto twin_cache = twin.make_cache(2, 4);
    EXPECT_NE(twin.layer_id(), layer.layer_id());
    EXPECT_EQ(twin_cache.owner(), twin.layer_id());
    expect_rejected<invalid_argument>([&] { layer.forward(x, twin_cache, out); }, fn,
                                      {"cache belongs to another layer (made by make_cache of layer " +
                                           std::to_string(twin.layer_id()) + "; this is layer " +
                                           std::to_string(layer.layer_id()) + ";",
                                       "layer_id() numbers layers in the order they are constructed"},
                                      out);
    EXPECT_TRUE(twin_cache.lengths() == std::vector<Index>({0, 0}));
    RowMatrix<float> twin_out(2, 16);
    EXPECT_THROW(twin.forward(x.topRows(2), cache, twin_out), invalid_argument);
    // A copy of the layer holds the same weights: it takes the original's cache.
    const gattn::GatedMultiHeadAttention<float> copy = layer;
    EXPECT_EQ(copy.layer_id(), layer.layer_id());
    RowMatrix<float> narrow = RowMatrix<float>::Constant(6, 8, 7.0f);
    expect_rejected<shape_error>([&] { layer.forward(x, cache, narrow); }, fn,
                                 {"out must have shape [6, 16], got [6, 8]"}, narrow);
    expect_rejected<shape_error>([&] { layer.forward(x, cache, out, {3}); }, fn,
                                 {"counts must have shape [2], got [1]"}, out);
    expect_rejected<invalid_argument>(
        [&] {
            layer.forward(x, cache, out, {4, 0});
        },
        fn, {"counts[0] must be in [0, 3], got 4"}, out);
    // Each sequence holds 1 of 4 tokens: 3 more fit, 4 do not.
    RowMatrix<float> out8 = RowMatrix<float>::Constant(8, 16, 7.0f);
    expect_rejected<invalid_argument>([&] { layer.forward(RowMatrix<float>::Random(8, 16), cache, out8); }, fn,
                                      {"cache sequence 0 would exceed the capacity 4 (holds 1, adding 4)"}, out8);
    gattn::KVCache<float> other(2, 4, 2, 5);  // head_dim 5: another layer's cache
    expect_rejected<shape_error>([&] { layer.forward(x, other, out); }, fn,
                                 {"cache must hold this layer's heads (num_kv_heads 2, head_dim 4, value_head_dim 4), "
                                  "got num_kv_heads 2, head_dim 5, value_head_dim 5"},
                                 out);
    // A cache made by a layer of other heads: the heads are named, whoever made the cache.
    auto mha = c;
    mha.num_kv_heads = 4;
    const gattn::GatedMultiHeadAttention<float> mha_layer(mha, gattn::make_random_weights<float>(mha, 3));
    auto mha_cache = mha_layer.make_cache(2, 4);
    expect_rejected<shape_error>([&] { layer.forward(x, mha_cache, out); }, fn,
                                 {"cache must hold this layer's heads (num_kv_heads 2, head_dim 4, value_head_dim 4), "
                                  "got num_kv_heads 4, head_dim 4, value_head_dim 4"},
                                 out);
    gattn::KVCache<float> same_widths(2, 4, 1, 8);  // 1 KV head of 8: the widths alone match
    expect_rejected<shape_error>([&] { layer.forward(x, same_widths, out); }, fn,
                                 {"got num_kv_heads 1, head_dim 8, value_head_dim 8"}, out);
    RowMatrix<float> both = x;
    expect_rejected<invalid_argument>([&] { layer.forward(both, cache, both); }, fn, {"out must not overlap x"}, both);
    // x or out inside the cache's own rows: the layer appends to the cache before it is done with x
    // (a G5 residual gate reads x last) and writes out after reading the cache.
    const RowMatrix<float> keys_before = cache.keys();
    using Strided = Eigen::Map<const RowMatrix<float>, 0, Eigen::OuterStride<>>;
    expect_rejected<invalid_argument>(
        [&] { layer.forward(Strided(cache.keys().data(), 2, 16, Eigen::OuterStride<>(16)), cache, out.topRows(2)); },
        fn, {"x must not share an element with the cache's keys or values"}, out);
    expect_rejected<invalid_argument>(
        [&] {
            layer.forward(x.topRows(2), cache,
                          Eigen::Map<RowMatrix<float>>(const_cast<float*>(cache.values().data()), 2, 16));
        },
        fn, {"out must not share an element with the cache's keys or values"}, out);
    EXPECT_TRUE(gattn_test::same_bytes(cache.keys(), keys_before));
    untouched();
    // A call with no slots leaves the cache as it is; its probabilities are [0, capacity].
    gattn::ForwardTrace<float> trace;
    trace.record_probabilities = true;
    RowMatrix<float> none(0, 16);
    layer.forward(none, cache, none, {}, &trace);
    EXPECT_EQ(trace.probabilities.rows(), 0);
    EXPECT_EQ(trace.probabilities.cols(), 4);
    untouched();
    // A valid call after the rejected ones continues the sequences.
    layer.forward(x, cache, out, {3, 2});
    EXPECT_EQ(cache.lengths(), (std::vector<Index>{4, 3}));
}

/// RoPE, q/k norm and softcap settings out of range are refused with the field named; so are positions
/// that are not one per token, and a config with q/k norm needs its norm weights.
TEST(LayerConstruction, RopeAndQkNormSettingsAreChecked) {
    const auto w_ok = gattn::make_random_weights<float>(small_config(), 1);  // head_dim 4
    RowMatrix<float> unused;
    for (const auto& [rotary_dim, theta, message] :
         {std::tuple<Index, double, std::string>{3, 1e4,
                                                 "config.rotary_dim must be even and in [0, head_dim = 4], got 3"},
          {6, 1e4, "config.rotary_dim must be even and in [0, head_dim = 4], got 6"},
          {-2, 1e4, "config.rotary_dim must be even"},
          {4, 0.0, "config.rope_theta must be finite and > 0, got 0"}}) {
        auto c = small_config();
        c.rotary_dim = rotary_dim;
        c.rope_theta = theta;
        expect_rejected<std::invalid_argument>([&] { gattn::GatedMultiHeadAttention<float> l(c, w_ok); },
                                               "gattn::GatedMultiHeadAttention", {message}, unused);
    }
    // In float's range [FLT_MIN, FLT_MAX / (2·log₂e)] for every layer: 1e-50 is 0 in float,
    // 1e-40 subnormal, 1.2e38·log₂e past half the largest float (3e38·log₂e past all of it).
    for (double cap : {-1.0, 1e-50, 1e-40, 1.2e38, 3e38}) {
        auto c = small_config();
        c.logit_softcap = cap;
        std::ostringstream shown;
        shown << cap;
        expect_rejected<std::invalid_argument>(
            [&] { gattn::GatedMultiHeadAttention<float> l(c, w_ok); }, "gattn::GatedMultiHeadAttention",
            {"config.logit_softcap must be 0 (none) or in [1.175494e-38, 1.179329e+38] (a normal float whose product "
             "with log2(e) stays within half the largest float), got " +
             shown.str()},
            unused);
    }
    auto c = small_config();
    c.qk_norm = gattn::QkNorm::RmsNorm;
    EXPECT_THROW(gattn::GatedMultiHeadAttention<float>(c, w_ok), gattn::shape_error);  // no q_norm.weight
    c.rotary_dim = 4;
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 1));
    const RowMatrix<float> x = RowMatrix<float>::Random(6, 16);
    RowMatrix<float> out = RowMatrix<float>::Constant(6, 16, 7.0f);
    gattn::ForwardOptions<float> o;
    o.positions = {0, 1, 2};
    expect_rejected<gattn::shape_error>([&] { layer.forward(x, 2, out, o); }, "gattn::GatedMultiHeadAttention::forward",
                                        {"options.positions must have shape [6], got [3]"}, out);
    // Explicit positions 0..2 per sequence are the default ones; RoPE sees only distances, so
    // shifted ones give the same output to rounding, spread ones another.
    o.positions = {0, 1, 2, 0, 1, 2};
    layer.forward(x, 2, out, o);
    EXPECT_TRUE(out == layer.forward(x, 2));
    o.positions = {5, 6, 7, 0, 3, 7};
    layer.forward(x, 2, out, o);
    EXPECT_TRUE(out.topRows(3).isApprox(layer.forward(x, 2).topRows(3), 1e-5f));
    EXPECT_FALSE(out.bottomRows(2).isApprox(layer.forward(x, 2).bottomRows(2), 1e-3f)) << "RoPE ignored the positions";
}

TEST(LayerConstruction, WindowBelowOneIsRejected) {
    for (const Index w : {Index(0), Index(-3)}) {
        auto c = small_config();
        c.sliding_window = w;
        auto weights_config = small_config();
        const auto w_ok = gattn::make_random_weights<float>(weights_config, 1);
        RowMatrix<float> unused;
        expect_rejected<std::invalid_argument>(
            [&] { gattn::GatedMultiHeadAttention<float> l(c, w_ok); }, "gattn::GatedMultiHeadAttention",
            {"config.sliding_window must be >= 1 (it counts the diagonal), got " + std::to_string(w)}, unused);
    }
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
    auto missing = w;  // a gated config without its gate weights
    missing.gate_proj_weight.resize(0, 0);
    try {
        gattn::GatedMultiHeadAttention<float> l(c, missing);
        ADD_FAILURE() << "no exception";
    } catch (const gattn::shape_error& e) {
        EXPECT_NE(std::string(e.what()).find("gate_proj.weight must have shape [16, 16], got [0, 0] (missing"),
                  std::string::npos)
            << e.what();
    }
    c.gate = {};  // ungated config but a gate_proj given: a config/checkpoint mismatch
    EXPECT_THROW((gattn::GatedMultiHeadAttention<float>(c, w)), gattn::shape_error);
    c.num_kv_heads = 3;
    EXPECT_THROW((gattn::GatedMultiHeadAttention<float>(c, w)), std::invalid_argument);
}

/// The version string is the three version macros.
TEST(Library, VersionStringIsTheVersionMacros) {
    const std::string want = std::to_string(GATTN_VERSION_MAJOR) + "." + std::to_string(GATTN_VERSION_MINOR) + "." +
                             std::to_string(GATTN_VERSION_PATCH);
    EXPECT_EQ(std::string(gattn::version()), want);
    EXPECT_EQ(std::string(GATTN_VERSION_STRING), want);
}

/// set_num_threads sets what num_threads reports (with OpenMP) and refuses counts below 1.
TEST(Library, ThreadCount) {
    const int saved = gattn::num_threads();
    EXPECT_THROW(gattn::set_num_threads(0), std::invalid_argument);
    gattn::set_num_threads(3);
    EXPECT_EQ(gattn::num_threads(), gattn::compiled_with_openmp() ? 3 : 1);
    gattn::set_num_threads(saved);
    EXPECT_EQ(gattn::num_threads(), saved);
}

}  // namespace
