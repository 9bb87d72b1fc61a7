// SPDX-License-Identifier: Apache-2.0
// GatedMultiHeadAttention's backward pass: central finite differences of the double forward
// against the double backward for every valid gate spec and for the layer's other options
// (q/k RMSNorm of both kinds, RoPE in both styles, sinks, softcap, ALiBi, masks, padding, GQA,
// MQA, d_v ≠ d_k, biases); the float backward against the double one; the training forward
// against forward; the error cases, with nothing written.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gattn/gattn.hpp"
#include "support/compare.hpp"

namespace {

using gattn::Index;
using gattn::RowMatrix;
using Mat = RowMatrix<double>;

/// One layer problem: config, batch, tokens and per-call options.
struct Problem {
    Problem(std::string n, const gattn::AttentionConfig& c) : name(std::move(n)), config(c) {}
    std::string name;
    gattn::AttentionConfig config;
    Index batch = 2, tokens = 5;
    std::vector<Index> key_lengths;
    bool bool_mask = false, bias = false;
};

gattn::AttentionConfig base_config() {
    gattn::AttentionConfig c;
    c.d_model = 8;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 4;
    c.qkv_bias = true;
    c.o_bias = true;
    c.causal = true;
    return c;
}

/// Random weights with the norm gains moved off their initial values, so that their gradient
/// reaches every term.
gattn::AttentionWeights<double> weights_for(const gattn::AttentionConfig& c, std::uint64_t seed) {
    auto w = gattn::make_random_weights<double>(c, seed);
    gattn_test::UniformSource src(seed + 99);
    for (auto* v : {&w.q_norm_weight, &w.k_norm_weight})
        for (Index i = 0; i < v->size(); ++i) (*v)[i] += src.next(0.5);
    return w;
}

/// The masks of a problem (kept alive by the caller).
struct Masks {
    std::unique_ptr<bool[]> bools;
    std::vector<double> bias;
    gattn::ForwardOptions<double> options;
};

void make_masks(const Problem& p, Masks& m) {
    const Index B = p.batch, N = p.tokens, H = p.config.num_heads;
    m.options.key_lengths = p.key_lengths;
    if (p.bool_mask) {
        m.bools.reset(new bool[static_cast<std::size_t>(B * N)]);
        std::fill(m.bools.get(), m.bools.get() + B * N, true);
        m.bools[static_cast<std::size_t>(N + 1)] = false;  // sequence 1 hides its key 1
        m.options.bool_mask = gattn::MaskView<bool>{m.bools.get(), B, 1, 1, N};
    }
    if (p.bias) {
        gattn_test::UniformSource src(7);
        m.bias.resize(static_cast<std::size_t>(B * H * N * N));
        for (auto& v : m.bias) v = src.next(1.0);
        m.options.bias = gattn::MaskView<double>{m.bias.data(), B, H, N, N};
    }
}

/// Σ dY ⊙ forward(x): a loss whose gradient with respect to the output is dY.
double loss(const gattn::GatedMultiHeadAttention<double>& layer, const Mat& x, Index batch, const Mat& d_y,
            const gattn::ForwardOptions<double>& options) {
    return (layer.forward(x, batch, options).array() * d_y.array()).sum();
}

/// Up to `count` spread indices of [0, n), and the index of the largest |g|.
std::vector<Index> probe_indices(const double* g, Index n, Index count) {
    std::vector<Index> out;
    const Index m = std::min(n, count);
    for (Index k = 0; k < m; ++k) out.push_back(k * n / m);
    if (n > 0)
        out.push_back(static_cast<Index>(
            std::max_element(g, g + n, [](double a, double b) { return std::abs(a) < std::abs(b); }) - g));
    return out;
}

// kFloor: the differences' own rounding (ε·|L|/step, L of order 10) for a gradient that is 0 in
// exact arithmetic (k_proj.bias without a q/k norm, RoPE, a G3 gate or a softcap).
constexpr double kStep = 1e-5, kTolerance = 1e-6, kFloor = 1e-9;
int g_tensors_checked = 0;  // weight tensors compared with finite differences

/// Checks each gradient element in `idx` against central differences of `at` (the loss with
/// element i moved by ±kStep), relative to the tensor's largest gradient.
template <class Loss>
void check_tensor(const std::string& what, const double* grad, Index n, double* value, Loss&& at, Index probes = 10) {
    double largest = 0;
    for (Index i = 0; i < n; ++i) largest = std::max(largest, std::abs(grad[i]));
    for (Index i : probe_indices(grad, n, probes)) {
        const double old = value[i];
        value[i] = old + kStep;
        const double up = at();
        value[i] = old - kStep;
        const double down = at();
        value[i] = old;
        const double fd = (up - down) / (2 * kStep);
        EXPECT_LE(std::abs(fd - grad[i]), kTolerance * largest + kFloor)
            << what << "[" << i << "]: backward " << grad[i] << ", central differences " << fd << " (largest "
            << largest << ")";
    }
}

/// A weight or gradient tensor of AttentionWeights: its data and shape.
template <class S>
struct TensorOf {
    S* data;
    Index rows, cols;
};
using Tensor = TensorOf<double>;

/// The tensors of weights or gradients by HF name.
template <class S, template <class> class Weights>
std::map<std::string, TensorOf<S>> tensors(Weights<S>& w) {
    std::map<std::string, TensorOf<S>> out;
    w.for_each([&](const char* name, auto* t) { out[name] = TensorOf<S>{t->data(), t->rows(), t->cols()}; });
    return out;
}

/// Finite differences of the double forward against backward, for x and every weight.
void check_problem(const Problem& p, std::uint64_t seed, Index probes = 10) {
    SCOPED_TRACE(p.name + " (gate " + gattn::describe(p.config.gate) + ")");
    const Index rows = p.batch * p.tokens, D = p.config.d_model;
    auto w = weights_for(p.config, seed);
    Mat x = gattn_test::random_matrix(rows, D, seed + 1);
    const Mat d_y = gattn_test::random_matrix(rows, D, seed + 2);
    Masks masks;
    make_masks(p, masks);
    const gattn::GatedMultiHeadAttention<double> layer(p.config, w);
    gattn::ForwardActivations<double> saved;
    Mat y(rows, D), d_x(rows, D);
    layer.forward_train(x, p.batch, y, saved, masks.options);
    EXPECT_EQ(y, layer.forward(x, p.batch, masks.options)) << "forward_train's output is forward's";
    gattn::AttentionWeights<double> grads;
    layer.backward(x, saved, d_y, grads, d_x);

    check_tensor(
        "d_x", d_x.data(), d_x.size(), x.data(), [&] { return loss(layer, x, p.batch, d_y, masks.options); }, probes);
    const auto grad_tensors = tensors(grads);
    for (const auto& [name, value] : tensors(w)) {
        const Tensor& grad = grad_tensors.at(name);
        ASSERT_EQ(grad.rows, value.rows) << name;
        ASSERT_EQ(grad.cols, value.cols) << name;
        if (value.rows * value.cols == 0) continue;
        double largest = 0;
        for (Index i = 0; i < grad.rows * grad.cols; ++i) largest = std::max(largest, std::abs(grad.data[i]));
        // Every gradient but k_proj.bias's is far from 0 (see FloatAgreesWithDouble).
        if (name != "k_proj.bias") {
            EXPECT_GT(largest, 1e-3) << name << ": a gradient of about 0 checks little";
        }
        ++g_tensors_checked;
        check_tensor(
            name, grad.data, grad.rows * grad.cols, value.data,
            [&] {
                const gattn::GatedMultiHeadAttention<double> moved(p.config, w);
                return loss(moved, x, p.batch, d_y, masks.options);
            },
            probes);
    }
}

TEST(LayerBackward, EveryGateSpecAgreesWithFiniteDifferences) {
    std::uint64_t seed = 100;
    for (const auto& spec : gattn::all_valid_gate_specs()) {
        Problem p{"gate", base_config()};
        p.config.gate = spec;
        if (spec.layout != gattn::GateLayout::Separate) p.config.qkv_bias = true;  // the fused bias rows
        check_problem(p, seed += 10, 4);
    }
    std::printf("%zu gate specs, %d weight tensors checked\n", gattn::all_valid_gate_specs().size(), g_tensors_checked);
}

std::vector<Problem> option_problems() {
    std::vector<Problem> out;
    auto g1 = [](const char* name) {
        Problem p{name, base_config()};
        p.config.gate = gattn::GateSpec::g1_elementwise();
        p.config.gate.bias = true;
        return p;
    };
    {
        Problem p = g1("ungated, no biases, MHA, not causal");
        p.config.gate = {};
        p.config.qkv_bias = p.config.o_bias = p.config.causal = false;
        p.config.num_kv_heads = 4;
        out.push_back(p);
    }
    {
        Problem p = g1("rms norm, NeoX RoPE (partial)");
        p.config.qk_norm = gattn::QkNorm::RmsNorm;
        p.config.rotary_dim = 2;
        out.push_back(p);
    }
    {
        Problem p = g1("zero-centred rms norm, GPT-J RoPE, G4 headwise");
        p.config.qk_norm = gattn::QkNorm::ZeroCentredRmsNorm;
        p.config.rotary_dim = 4;
        p.config.rope_style = gattn::RopeStyle::GptJ;
        p.config.gate.position = gattn::GatePosition::G4;
        p.config.gate.granularity = gattn::GateGranularity::Headwise;
        out.push_back(p);
    }
    {
        Problem p = g1("norm and RoPE under a G3 gate");
        p.config.qk_norm = gattn::QkNorm::ZeroCentredRmsNorm;
        p.config.rotary_dim = 4;
        p.config.gate.position = gattn::GatePosition::G3;
        out.push_back(p);
    }
    {
        Problem p = g1("query-sourced gate after norm and RoPE");
        p.config.qk_norm = gattn::QkNorm::RmsNorm;
        p.config.rotary_dim = 4;
        p.config.gate.source = gattn::GateSource::Query;
        p.config.gate.granularity = gattn::GateGranularity::Headwise;
        out.push_back(p);
    }
    {
        Problem p = g1("sinks, softcap, ALiBi, window");
        p.config.sinks = true;
        p.config.logit_softcap = 0.8;
        p.config.alibi = true;
        p.config.sliding_window = 3;
        out.push_back(p);
    }
    {
        Problem p = g1("MQA, d_v != d_k, scale, not causal, padding");
        p.config.num_kv_heads = 1;
        p.config.value_head_dim = 3;
        p.config.scale = 0.7;
        p.config.causal = false;
        p.key_lengths = {5, 3};
        out.push_back(p);
    }
    {
        Problem p = g1("boolean mask and bias, G2 head-shared, padding");
        p.bool_mask = p.bias = true;
        p.config.gate.position = gattn::GatePosition::G2;
        p.config.gate.sharing = gattn::GateSharing::HeadShared;
        p.key_lengths = {4, 5};
        out.push_back(p);
    }
    {
        Problem p = g1("G5 residual mix, SiLU, sinks");
        p.config.gate.position = gattn::GatePosition::G5;
        p.config.gate.combine = gattn::GateCombine::ResidualMix;
        p.config.gate.activation = gattn::GateActivation::SiLU;
        p.config.sinks = true;
        out.push_back(p);
    }
    return out;
}

TEST(LayerBackward, LayerOptionsAgreeWithFiniteDifferences) {
    std::uint64_t seed = 5000;
    for (const auto& p : option_problems()) check_problem(p, seed += 10);
}

/// The float backward against the double one on the same (float-representable) weights and
/// inputs: each gradient within 1e-4 of its tensor's largest.
TEST(LayerBackward, FloatAgreesWithDouble) {
    std::uint64_t seed = 9000;
    double worst = 0;  // largest error relative to the tensor's largest gradient
    int compared = 0;  // weight tensors compared
    std::vector<Problem> problems = option_problems();
    for (auto spec : {gattn::GateSpec::g1_elementwise(gattn::GateLayout::PerHeadInterleaved),
                      gattn::GateSpec::g1_headwise(gattn::GateLayout::GroupedByKV)}) {
        Problem p{"fused", base_config()};
        p.config.gate = spec;
        problems.push_back(p);
    }
    for (auto& p : problems) {
        SCOPED_TRACE(p.name);
        p.tokens = 70;  // SDPA's backward tiles are 64 rows
        const Index rows = p.batch * p.tokens, D = p.config.d_model;
        if (!p.key_lengths.empty()) p.key_lengths = {70, 41};
        const auto wf = weights_for(p.config, seed += 10).cast<float>();
        const auto wd = wf.cast<double>();
        const Mat x = gattn_test::rounded<float>(gattn_test::random_matrix(rows, D, seed + 1));
        const Mat d_y = gattn_test::rounded<float>(gattn_test::random_matrix(rows, D, seed + 2));
        Masks md;
        make_masks(p, md);
        gattn::ForwardOptions<float> of;
        of.key_lengths = md.options.key_lengths;
        of.bool_mask = md.options.bool_mask;
        std::vector<float> bias_f(md.bias.begin(), md.bias.end());
        if (p.bias) of.bias = gattn::MaskView<float>{bias_f.data(), p.batch, p.config.num_heads, p.tokens, p.tokens};

        const gattn::GatedMultiHeadAttention<double> ld(p.config, wd);
        const gattn::GatedMultiHeadAttention<float> lf(p.config, wf);
        gattn::ForwardActivations<double> sd;
        gattn::ForwardActivations<float> sf;
        Mat yd(rows, D), dxd(rows, D);
        RowMatrix<float> yf(rows, D), dxf(rows, D);
        ld.forward_train(x, p.batch, yd, sd, md.options);
        lf.forward_train(x.cast<float>(), p.batch, yf, sf, of);
        EXPECT_EQ(yf, lf.forward(x.cast<float>(), p.batch, of));
        gattn::AttentionWeights<double> gd;
        gattn::AttentionWeights<float> gf;
        ld.backward(x, sd, d_y, gd, dxd);
        lf.backward(x.cast<float>(), sf, d_y.cast<float>(), gf, dxf);
        auto compare = [&](const std::string& name, const auto& got, const auto& want) {
            ASSERT_EQ(got.rows(), want.rows()) << name;
            ASSERT_EQ(got.cols(), want.cols()) << name;
            if (want.size() == 0) return;
            const double largest = want.cwiseAbs().maxCoeff();
            const double err = (got.template cast<double>() - want).cwiseAbs().maxCoeff();
            // (k_proj.bias: 0 in exact arithmetic unless a q/k norm, RoPE, a G3 gate or a softcap
            // acts on the key, as adding one vector to every key shifts a row's logits alike; the
            // floor covers its rounding.)
            EXPECT_LE(err, 1e-4 * largest + 1e-6) << name << ": largest gradient " << largest;
            if (largest > 1e-3) worst = std::max(worst, err / largest);
        };
        compare("d_x", dxf, dxd);
        const auto got = tensors(gf);
        for (const auto& [name, want] : tensors(gd)) {
            const TensorOf<float>& g = got.at(name);
            using MapD = Eigen::Map<const Mat>;
            using MapF = Eigen::Map<const RowMatrix<float>>;
            compare(name, Mat(MapF(g.data, g.rows, g.cols).cast<double>()), Mat(MapD(want.data, want.rows, want.cols)));
            ++compared;
        }
    }
    EXPECT_GT(compared, 100);
    std::printf("float against double: worst error %.2g of the tensor's largest gradient\n", worst);
}

/// Qwen3-Next: the layer of to_attention_config computes Qwen3NextAttention's prefill, and its
/// backward, with the gradients renamed by to_qwen3_next_weights, agrees with central
/// differences of Qwen3NextAttention's own forward (zero-centred q/k RMSNorm, partial RoPE at
/// given positions, the gate fused into q_proj per head, biases, sinks).
TEST(LayerBackward, Qwen3NextAgreesWithFiniteDifferencesOfItsForward) {
    for (const bool full : {true, false}) {
        SCOPED_TRACE(full ? "gate, biases, sinks" : "ungated, no biases");
        gattn::Qwen3NextConfig q;
        q.hidden_size = 8;
        q.num_attention_heads = 4;
        q.num_key_value_heads = 2;
        q.head_dim = 4;
        q.partial_rotary_factor = 0.5;
        q.rope_theta = 100;
        q.attn_output_gate = q.attention_bias = q.attention_sinks = full;
        const auto config = gattn::to_attention_config(q);
        auto w = gattn::to_qwen3_next_weights(weights_for(config, full ? 21 : 22));
        const Index B = 2, N = 5, rows = B * N, D = q.hidden_size;
        std::vector<Index> positions;
        for (Index r = 0; r < rows; ++r) positions.push_back(3 * (r / N) + r % N);  // sequence 1 from 3
        Mat x = gattn_test::random_matrix(rows, D, 23);
        const Mat d_y = gattn_test::random_matrix(rows, D, 24);
        const auto qwen_forward = [&](const Mat& input) {
            const gattn::Qwen3NextAttention<double> layer(q, w);
            auto cache = layer.make_cache(B, N);
            Mat y(rows, D);
            layer.forward(input, positions, cache, y);
            return y;
        };

        const gattn::GatedMultiHeadAttention<double> layer(config, gattn::to_attention_weights(w));
        gattn::ForwardOptions<double> options;
        options.positions = positions;
        gattn::ForwardActivations<double> saved;
        Mat y(rows, D), d_x(rows, D);
        layer.forward_train(x, B, y, saved, options);
        const Mat want = qwen_forward(x);
        EXPECT_LE((y - want).cwiseAbs().maxCoeff(), 1e-13 * (1 + want.cwiseAbs().maxCoeff()));
        gattn::AttentionWeights<double> grads;
        layer.backward(x, saved, d_y, grads, d_x);
        auto d_w = gattn::to_qwen3_next_weights(grads);

        const auto loss_at = [&] { return (qwen_forward(x).array() * d_y.array()).sum(); };
        check_tensor("d_x", d_x.data(), d_x.size(), x.data(), loss_at);
        const auto grad_tensors = tensors(d_w);
        int checked = 0;
        for (const auto& [name, value] : tensors(w)) {
            const auto& g = grad_tensors.at(name);
            ASSERT_EQ(g.rows, value.rows) << name;
            ASSERT_EQ(g.cols, value.cols) << name;
            if (value.rows * value.cols == 0) continue;
            check_tensor(name, g.data, g.rows * g.cols, value.data, loss_at);
            ++checked;
        }
        EXPECT_EQ(checked, full ? 11 : 6);
    }
}

TEST(LayerBackward, ErrorsNameTheArgumentAndWriteNothing) {
    auto c = base_config();
    c.gate = gattn::GateSpec::g1_elementwise();
    const auto w = weights_for(c, 3);
    const gattn::GatedMultiHeadAttention<double> layer(c, w), other(c, w);
    const Index rows = 10, D = c.d_model;
    const Mat x = gattn_test::random_matrix(rows, D, 4);
    Mat d_y = gattn_test::random_matrix(rows, D, 5), y(rows, D);
    gattn::ForwardActivations<double> saved;
    layer.forward_train(x, 2, y, saved);
    gattn::AttentionWeights<double> grads;
    grads.o_proj_weight.setConstant(3, 3, 7.0);
    Mat d_x = Mat::Constant(rows, D, 7.0);
    auto unchanged = [&] {
        EXPECT_EQ(d_x, Mat::Constant(rows, D, 7.0));
        EXPECT_EQ(grads.o_proj_weight, Mat::Constant(3, 3, 7.0));
        EXPECT_EQ(grads.q_proj_weight.size(), 0);
    };
    auto expect_error = [&](auto&& call, const std::string& part) {
        try {
            call();
            ADD_FAILURE() << "no error; expected one naming " << part;
        } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find("GatedMultiHeadAttention::backward"), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
        }
        unchanged();
    };
    const Mat short_d_y = d_y.topRows(rows - 1);
    expect_error([&] { layer.backward(x, saved, short_d_y, grads, d_x); }, "d_out");
    expect_error([&] { layer.backward(x.topRows(rows - 2), saved, d_y, grads, d_x); }, "x");
    Mat small_d_x(rows, D - 1);
    expect_error([&] { layer.backward(x, saved, d_y, grads, small_d_x); }, "d_x");
    expect_error([&] { other.backward(x, saved, d_y, grads, d_x); }, "saved");
    expect_error([&] { layer.backward(x, gattn::ForwardActivations<double>{}, d_y, grads, d_x); }, "saved");
    d_y(3, 2) = std::numeric_limits<double>::quiet_NaN();
    expect_error([&] { layer.backward(x, saved, d_y, grads, d_x); }, "d_out");
    d_y(3, 2) = 0;
    Mat both = Mat::Constant(rows, D, 7.0);
    try {
        layer.backward(x, saved, both, grads, both);
        ADD_FAILURE() << "d_x overlapping d_out was taken";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("d_x"), std::string::npos) << e.what();
    }
    EXPECT_EQ(both, Mat::Constant(rows, D, 7.0));
    unchanged();
    // saved's tensors are public: one of another shape, or a batch that does not divide its
    // rows, is refused before backward reads it.
    for (const std::string member : {"qkv", "gate_logits", "log_sum_exp", "gated", "batch"}) {
        gattn::ForwardActivations<double> edited = saved;
        if (member == "qkv") edited.qkv.resize(0, 0);
        if (member == "gate_logits") edited.gate_logits.conservativeResize(rows - 1, Eigen::NoChange);
        if (member == "log_sum_exp") edited.log_sum_exp.resize(rows, 1);
        if (member == "gated") edited.gated.resize(0, 0);
        if (member == "batch") edited.batch = 3;
        expect_error([&] { layer.backward(x, edited, d_y, grads, d_x); }, "saved." + member);
    }

    // forward_train: what forward refuses, and a saved matrix holding x; saved stays as it was.
    const gattn::ForwardActivations<double> before = saved;
    Mat y2 = Mat::Constant(rows, D, 7.0);
    try {
        layer.forward_train(x, 3, y2, saved);  // 10 rows are no 3 sequences
        ADD_FAILURE() << "a batch that does not divide the rows was taken";
    } catch (const gattn::shape_error& e) {
        EXPECT_NE(std::string(e.what()).find("GatedMultiHeadAttention::forward_train"), std::string::npos);
    }
    EXPECT_EQ(y2, Mat::Constant(rows, D, 7.0));
    EXPECT_EQ(saved.attention, before.attention);
    try {
        layer.forward_train(saved.attention.leftCols(D), 2, y2, saved);
        ADD_FAILURE() << "x inside saved was taken";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("saved"), std::string::npos) << e.what();
    }
    EXPECT_EQ(y2, Mat::Constant(rows, D, 7.0));
    EXPECT_EQ(saved.attention, before.attention);
}

TEST(LayerBackward, EmptyBatch) {
    auto c = base_config();
    c.gate = gattn::GateSpec::g1_elementwise();
    c.sinks = true;
    const gattn::GatedMultiHeadAttention<double> layer(c, weights_for(c, 3));
    const Mat x(0, c.d_model), d_y(0, c.d_model);
    Mat y(0, c.d_model), d_x(0, c.d_model);
    gattn::ForwardActivations<double> saved;
    layer.forward_train(x, 0, y, saved);
    gattn::AttentionWeights<double> grads;
    layer.backward(x, saved, d_y, grads, d_x);
    EXPECT_EQ(grads.q_proj_weight, Mat::Zero(c.num_heads * c.head_dim, c.d_model));
    EXPECT_EQ(grads.sinks, gattn::Vector<double>::Zero(c.num_heads));
}

}  // namespace
