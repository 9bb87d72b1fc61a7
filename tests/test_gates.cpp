// SPDX-License-Identifier: Apache-2.0
// Gate variants (arXiv:2505.06708 Tables 1 and 4): every valid GateSpec run through the whole
// layer against the float64 reference, the table of valid combinations, weight-shape errors,
// the paper's "Added Param" counts, and the gate kernels at extreme logits.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "gattn/gates/gate_apply.hpp"
#include "gattn/gates/gate_spec.hpp"
#include "gattn/layers/attention_config.hpp"
#include "gattn/layers/gated_multi_head_attention.hpp"
#include "support/compare.hpp"
#include "support/reference.hpp"

namespace {

using gattn::GateActivation;
using gattn::GateCombine;
using gattn::GateGranularity;
using gattn::GateLayout;
using gattn::GatePosition;
using gattn::GateSharing;
using gattn::GateSource;
using gattn::GateSpec;
using gattn::Index;
using gattn_test::expect_close;
using gattn_test::Mat;

/// Layer tolerances against the float64 reference: float per element atol 1e-5, rtol 1e-5
/// (observed worst |err| ≈ 3e-7, NMSE ≈ 6e-14); double observed worst |err| ≈ 6e-16.
template <class S>
struct LayerTol;
template <>
struct LayerTol<float> {
    static constexpr double atol = 1e-5, rtol = 1e-5, nmse = 1e-11;
};
template <>
struct LayerTol<double> {
    static constexpr double atol = 1e-12, rtol = 1e-11, nmse = 1e-24;
};
/// bf16 weights and cache (float activations): the reference runs on the same rounded weights;
/// the layer also rounds x (in the AVX512-BF16 projections), Q, K and V, the attention weights
/// and U (in the output projection) to bf16, each a relative 2⁻⁹ at most. Observed worst
/// |err| ≈ 3.6e-3 per element, NMSE ≈ 2e-5 over a layer's output.
template <>
struct LayerTol<gattn::bfloat16> {
    static constexpr double atol = 2e-2, rtol = 2e-2, nmse = 1e-4;
};

using gattn_test::ScalarNames;
using gattn_test::type_label;

// ---------------------------------------------------------------------------------------------
// Spec naming and the table of valid combinations, written from gate_spec.hpp's documentation.

std::string spec_name(const GateSpec& s) {
    if (!s.enabled()) return "Ungated";
    std::string n = gattn::to_string(s.position);
    n += s.granularity == GateGranularity::Elementwise ? "Elem" : "Head";
    n += s.sharing == GateSharing::HeadSpecific ? "Specific" : "Shared";
    switch (s.combine) {
        case GateCombine::Multiplicative: n += "Mul"; break;
        case GateCombine::Additive: n += "Add"; break;
        case GateCombine::ResidualMix: n += "Mix"; break;
    }
    switch (s.activation) {
        case GateActivation::Sigmoid: n += "Sigmoid"; break;
        case GateActivation::SiLU: n += "Silu"; break;
        case GateActivation::NonSparseSigmoid: n += "NonSparse"; break;
    }
    switch (s.source) {
        case GateSource::Input: n += "Input"; break;
        case GateSource::InputIndependent: n += "Indep"; break;
        case GateSource::Query: n += "Query"; break;
    }
    switch (s.layout) {
        case GateLayout::Separate: n += "Separate"; break;
        case GateLayout::PerHeadInterleaved: n += "Interleaved"; break;
        case GateLayout::GroupedByKV: n += "Grouped"; break;
    }
    if (s.bias) n += "Bias";
    return n;
}

/// The table of valid combinations in gate_spec.hpp, row by row (every activation is valid).
bool table_allows(const GateSpec& s) {
    if (!s.enabled()) return true;
    const bool elem = s.granularity == GateGranularity::Elementwise;
    const bool specific = s.sharing == GateSharing::HeadSpecific;
    const bool shared_elem = !specific && elem;
    const bool mul = s.combine == GateCombine::Multiplicative;
    const bool add = s.combine == GateCombine::Additive;
    const bool mix = s.combine == GateCombine::ResidualMix;
    const bool input = s.source == GateSource::Input;
    const bool separate = s.layout == GateLayout::Separate;
    switch (s.position) {
        case GatePosition::None: return true;
        case GatePosition::G1:
            if ((specific || shared_elem) && (mul || add) && input && separate) return true;
            if (specific && (mul || add) && input && !separate && !s.bias) return true;
            if (elem && specific && mul && s.source == GateSource::InputIndependent && separate && !s.bias) return true;
            if (!elem && specific && mul && s.source == GateSource::Query && separate) return true;
            return false;
        case GatePosition::G2: return (specific || shared_elem) && mul && input && separate;
        case GatePosition::G3:
        case GatePosition::G4: return specific && mul && input && separate;
        case GatePosition::G5: return elem && specific && (mul || mix) && input && separate;
    }
    return false;
}

/// Every GateSpec the enums can express (positions × all fields × bias).
std::vector<GateSpec> all_gate_specs() {
    std::vector<GateSpec> out;
    for (auto pos :
         {GatePosition::None, GatePosition::G1, GatePosition::G2, GatePosition::G3, GatePosition::G4, GatePosition::G5})
        for (auto gran : {GateGranularity::Elementwise, GateGranularity::Headwise})
            for (auto share : {GateSharing::HeadSpecific, GateSharing::HeadShared})
                for (auto comb : {GateCombine::Multiplicative, GateCombine::Additive, GateCombine::ResidualMix})
                    for (auto act : {GateActivation::Sigmoid, GateActivation::SiLU, GateActivation::NonSparseSigmoid})
                        for (auto src : {GateSource::Input, GateSource::InputIndependent, GateSource::Query})
                            for (auto lay :
                                 {GateLayout::Separate, GateLayout::PerHeadInterleaved, GateLayout::GroupedByKV})
                                for (bool bias : {false, true}) {
                                    GateSpec s;
                                    s.position = pos;
                                    s.granularity = gran;
                                    s.sharing = share;
                                    s.combine = comb;
                                    s.activation = act;
                                    s.source = src;
                                    s.layout = lay;
                                    s.bias = bias;
                                    out.push_back(s);
                                }
    return out;
}

bool in_valid_list(const GateSpec& s) {
    static const std::vector<GateSpec> valid = gattn::all_valid_gate_specs();
    for (const auto& v : valid)
        if (v == s) return true;
    return false;
}

// ---------------------------------------------------------------------------------------------
// Every valid spec through the whole layer, against layer_reference.

struct LayerShape {
    const char* name;
    Index D, H, Hkv, dk, dv_preferred, B, N;
    bool causal, qkv_bias, o_bias;
    std::optional<Index> window;
    std::optional<double> scale;
    std::vector<Index> key_lengths;
    bool record_probabilities;
    bool sinks = false;    ///< learned attention sinks beside the gate
    double softcap = 0;    ///< logit softcap (0: none)
    bool alibi = false;    ///< ALiBi with the standard slopes
    Index rotary_dim = 0;  ///< RoPE (0: none)
    gattn::RopeStyle rope_style = gattn::RopeStyle::NeoX;
    gattn::QkNorm qk_norm = gattn::QkNorm::None;
};

const LayerShape kGqaCausal{"GqaCausal", 24, 4, 2, 6, 5, 2, 5, true, true, true, {}, {}, {}, false};
const LayerShape kMhaKeyLengths{"MhaKeyLengths", 24, 4, 4, 6, 5, 1, 7, false, false, false, 3, 0.3, {5}, true};
const LayerShape kGqaCausalSinks{"GqaCausalSinks", 24, 4, 2, 6, 5, 2, 5, true, true, true, {}, {}, {}, false, true};
// Softcap 0.25 bends the logits of these random weights (mostly within ±1); ALiBi's slopes for 4 heads
// (1/4 … 1/256) are exact in every storage type.
const LayerShape kGqaCausalSoftcapAlibi{
    "GqaCausalSoftcapAlibi", 24, 4, 2, 6, 5, 2, 5, true, true, true, {}, {}, {}, true, false, 0.25, true};
// Llama/Qwen3-style (full NeoX RoPE, plain q/k RMSNorm) and GPT-J-style (partial interleaved
// RoPE, Qwen3-Next's zero-centred norm) queries and keys.
const LayerShape kGqaCausalRopeNorm{"GqaCausalRopeNorm",
                                    24,
                                    4,
                                    2,
                                    6,
                                    5,
                                    2,
                                    5,
                                    true,
                                    true,
                                    true,
                                    {},
                                    {},
                                    {},
                                    true,
                                    false,
                                    0,
                                    false,
                                    6,
                                    gattn::RopeStyle::NeoX,
                                    gattn::QkNorm::RmsNorm};
const LayerShape kMhaKeyLengthsGptJ{"MhaKeyLengthsGptJ",
                                    24,
                                    4,
                                    4,
                                    6,
                                    5,
                                    1,
                                    7,
                                    false,
                                    false,
                                    false,
                                    3,
                                    0.3,
                                    {5},
                                    true,
                                    false,
                                    0,
                                    false,
                                    4,
                                    gattn::RopeStyle::GptJ,
                                    gattn::QkNorm::ZeroCentredRmsNorm};
const LayerShape kMhaKeyLengthsSinks{
    "MhaKeyLengthsSinks", 24, 4, 4, 6, 5, 1, 7, false, false, false, 3, 0.3, {5}, true, true};

/// The config for a spec and shape; d_v differs from d_k unless the spec fuses an elementwise
/// gate into q_proj (which requires d_v = d_k).
gattn::AttentionConfig make_config(const GateSpec& spec, const LayerShape& sh) {
    gattn::AttentionConfig c;
    c.d_model = sh.D;
    c.num_heads = sh.H;
    c.num_kv_heads = sh.Hkv;
    c.head_dim = sh.dk;
    const bool fused_elem = spec.enabled() && spec.layout != GateLayout::Separate &&
                            spec.granularity == GateGranularity::Elementwise;
    c.value_head_dim = fused_elem ? 0 : sh.dv_preferred;
    c.qkv_bias = sh.qkv_bias;
    c.o_bias = sh.o_bias;
    c.gate = spec;
    c.causal = sh.causal;
    c.sliding_window = sh.window;
    c.scale = sh.scale;
    c.sinks = sh.sinks;
    c.logit_softcap = sh.softcap;
    c.alibi = sh.alibi;
    c.rotary_dim = sh.rotary_dim;
    c.rope_theta = 100;  // short sequences: a small base turns every pair noticeably
    c.rope_style = sh.rope_style;
    c.qk_norm = sh.qk_norm;
    return c;
}

template <class S>
void run_layer_case(const GateSpec& spec, const LayerShape& sh) {
    const std::string label = std::string("Layer") + type_label<S>() + "/" + sh.name + "/" + spec_name(spec);
    SCOPED_TRACE(label + " (" + gattn::describe(spec) + ")");
    const gattn::AttentionConfig c = make_config(spec, sh);
    using A = gattn::compute_t<S>;  // activations
    auto w = gattn::make_random_weights<S>(c, 20250509u);
    if (c.qk_norm != gattn::QkNorm::None) {
        // Gains that differ per feature (make_random_weights gives the models' 1 or 0), so
        // that a gain applied to the wrong feature, or not at all, shows.
        const Mat g = gattn_test::random_matrix(2, c.head_dim, 20250512u);
        w.q_norm_weight = (1.0 + 0.5 * g.row(0).array()).matrix().transpose().cast<S>();
        w.k_norm_weight = (1.0 + 0.5 * g.row(1).array()).matrix().transpose().cast<S>();
    }
    const gattn::GatedMultiHeadAttention<S> layer(c, w);

    const Mat x = gattn_test::rounded<A>(gattn_test::random_matrix(sh.B * sh.N, sh.D, 4242u));
    const gattn::RowMatrix<A> xs = x.cast<A>();
    gattn::ForwardOptions<A> opt;
    opt.key_lengths = sh.key_lengths;
    gattn::ForwardTrace<A> trace;
    trace.record_probabilities = sh.record_probabilities;
    const gattn::RowMatrix<A> y = layer.forward(xs, sh.B, opt, &trace);

    const auto ref = gattn_test::layer_reference(c, gattn_test::weights_to_double(w), x, sh.B, sh.key_lengths);
    using T = LayerTol<S>;
    expect_close(y, ref.y, T::atol, T::rtol, label + "/y", T::nmse);
    if (spec.enabled()) {
        expect_close(trace.gate_scores, ref.gate_scores, T::atol, T::rtol, label + "/gate_scores");
        EXPECT_NEAR(trace.mean_gate_score(), ref.gate_scores.mean(), T::atol);
    } else {
        EXPECT_EQ(trace.gate_scores.size(), 0);
        EXPECT_TRUE(std::isnan(trace.mean_gate_score()));
    }
    expect_close(trace.first_key_attention, ref.first_key_attention, T::atol, T::rtol, label + "/first_key_attention");
    EXPECT_NEAR(trace.first_token_attention_share(), ref.first_key_attention.mean(), T::atol);
    if (sh.record_probabilities)
        expect_close(trace.probabilities, ref.probabilities, T::atol, T::rtol, label + "/probabilities");
    EXPECT_EQ(trace.max_abs_output, y.cwiseAbs().maxCoeff());

    // Recording a trace does not change the output.
    const gattn::RowMatrix<A> y_plain = layer.forward(xs, sh.B, opt);
    EXPECT_TRUE(y_plain == y) << "forward with and without a trace differ";
}

/// Every valid spec decoded with a KV cache: two sequences of 7 and 5 tokens fed in ragged
/// pieces (prefill, chunks, single tokens, sequences that sit a call out), each output row
/// against the float64 layer_reference on the whole padded batch (causal, key lengths {7, 5}).
/// Padding slots of a call, where the gate does not act on the output, give o_proj's bias.
template <class S>
void run_decode_case(const GateSpec& spec, std::optional<Index> window, bool sinks = false, bool softcap_alibi = false,
                     bool rope = false) {
    const std::string label = std::string("Decode") + type_label<S>() + (window ? "/Window" : "") +
                              (sinks ? "/Sinks" : "") + (softcap_alibi ? "/SoftcapAlibi" : "") +
                              (rope ? "/RopeNorm" : "") + "/" + spec_name(spec);
    SCOPED_TRACE(label + " (" + gattn::describe(spec) + ")");
    LayerShape sh = kGqaCausal;
    sh.window = window;
    sh.sinks = sinks;
    if (softcap_alibi) {
        sh.softcap = kGqaCausalSoftcapAlibi.softcap;
        sh.alibi = true;
    }
    if (rope) {
        sh.rotary_dim = kGqaCausalRopeNorm.rotary_dim;
        sh.qk_norm = kGqaCausalRopeNorm.qk_norm;
    }
    const Index B = 2, N = 7;
    const std::vector<Index> lengths = {7, 5};
    const gattn::AttentionConfig c = make_config(spec, sh);
    using A = gattn::compute_t<S>;  // activations
    const auto w = gattn::make_random_weights<S>(c, 20250510u);
    const gattn::GatedMultiHeadAttention<S> layer(c, w);
    const Mat x = gattn_test::rounded<A>(gattn_test::random_matrix(B * N, sh.D, 4343u));
    const auto ref = gattn_test::layer_reference(c, gattn_test::weights_to_double(w), x, B, lengths);
    using T = LayerTol<S>;
    const bool u_zero_gives_bias =
        spec.position != gattn::GatePosition::G5 &&
        !(spec.position == gattn::GatePosition::G1 && spec.combine == gattn::GateCombine::Additive);

    const Mat o_bias = gattn_test::weights_to_double(w).o_proj_bias.transpose();
    auto cache = layer.make_cache(B, 8);
    const std::vector<std::vector<Index>> schedule = {{3, 2}, {1, 1}, {2, 0}, {1, 1}, {0, 1}};
    for (const auto& counts : schedule) {
        const Index n = *std::max_element(counts.begin(), counts.end());
        // Slot t of sequence b holds its next token; padding slots hold some other token.
        gattn::RowMatrix<A> xs(B * n, sh.D);
        for (Index b = 0; b < B; ++b)
            for (Index t = 0; t < n; ++t) {
                const Index pos = std::min(cache.tokens_seen()[b] + t, lengths[b] - 1);
                xs.row(b * n + t) = x.row(b * N + pos).cast<A>();
            }
        const std::vector<Index> before = cache.tokens_seen();
        gattn::RowMatrix<A> out(B * n, sh.D);
        gattn::ForwardTrace<A> trace;
        layer.forward(xs, cache, out, counts, &trace);
        for (Index b = 0; b < B; ++b) {
            EXPECT_EQ(cache.tokens_seen()[b], before[b] + counts[b]);
            for (Index t = 0; t < n; ++t) {
                const std::string where = label + " sequence " + std::to_string(b) + " slot " + std::to_string(t) +
                                          " after " + std::to_string(before[b]) + " tokens";
                if (t >= counts[b]) {
                    if (u_zero_gives_bias)
                        expect_close(out.row(b * n + t), o_bias, T::atol, T::rtol, where + " (padding)");
                    continue;
                }
                const Index row = b * N + before[b] + t;
                expect_close(out.row(b * n + t), ref.y.row(row), T::atol, T::rtol, where);
                expect_close(trace.first_key_attention.row(b * n + t), ref.first_key_attention.row(row), T::atol,
                             T::rtol, where + " first_key_attention");
                if (spec.enabled() && spec.source != gattn::GateSource::InputIndependent)
                    expect_close(trace.gate_scores.row(b * n + t), ref.gate_scores.row(row), T::atol, T::rtol,
                                 where + " gate_scores");
            }
        }
    }
    EXPECT_EQ(cache.tokens_seen(), lengths);
    // A windowed layer's cache keeps 2·window rows, not the 8 asked for.
    if (window) {
        EXPECT_EQ(cache.window(), *window);
        EXPECT_EQ(cache.capacity(), 2 * *window);
        EXPECT_GT(cache.first_positions()[0], 0);
    }
}

/// Checks that row `row_other` of a narrow cache holds exactly row `row` of the float cache in
/// its storage: int8 codes and scales of quantize_int8_row (ops/int8_rows.hpp), or bf16/fp16
/// rounded to nearest even (Eigen's conversion).
void expect_row_stored(const gattn::KVCache<float>& exact, const gattn::KVCache<std::int8_t>& int8, Index row,
                       Index row8, Index num_kv_heads) {
    const Index dk = exact.keys().cols() / num_kv_heads, dv = exact.values().cols() / num_kv_heads;
    std::vector<std::int8_t> codes(static_cast<std::size_t>(num_kv_heads * std::max(dk, dv)));
    std::vector<float> scales(static_cast<std::size_t>(num_kv_heads));
    gattn::quantize_int8_row(exact.keys().row(row).data(), num_kv_heads, dk, codes.data(), scales.data());
    for (Index e = 0; e < num_kv_heads * dk; ++e) ASSERT_EQ(int8.keys()(row8, e), codes[e]) << "key element " << e;
    for (Index g = 0; g < num_kv_heads; ++g) ASSERT_EQ(int8.key_scales()(row8, g), scales[g]) << "key scale " << g;
    gattn::quantize_int8_row(exact.values().row(row).data(), num_kv_heads, dv, codes.data(), scales.data());
    for (Index e = 0; e < num_kv_heads * dv; ++e) ASSERT_EQ(int8.values()(row8, e), codes[e]) << "value element " << e;
    for (Index g = 0; g < num_kv_heads; ++g) ASSERT_EQ(int8.value_scales()(row8, g), scales[g]) << "value scale " << g;
}

template <class Narrow>
void expect_row_stored(const gattn::KVCache<float>& exact, const gattn::KVCache<Narrow>& narrow, Index row, Index row16,
                       Index /*num_kv_heads*/) {
    for (Index e = 0; e < exact.keys().cols(); ++e)
        ASSERT_EQ(float(narrow.keys()(row16, e)), float(Narrow(exact.keys()(row, e)))) << "key element " << e;
    for (Index e = 0; e < exact.values().cols(); ++e)
        ASSERT_EQ(float(narrow.values()(row16, e)), float(Narrow(exact.values()(row, e)))) << "value element " << e;
}

/// A float layer's narrow cache (int8, bf16 or fp16) beside its float cache, fed the same ragged
/// schedule (window 3 or none): after every call the narrow cache holds exactly the float
/// cache's rows in its storage (expect_row_stored), so a G2 or G3 gate acts before the rounding,
/// and the outputs differ from the float cache's only by that rounding. Tolerances, relative to
/// the output's scale: int8 1 % (measured over every spec: at most 0.12 %), bf16 0.4 % (0.08 %),
/// fp16 0.05 % (0.009 %).
template <class Store>
void run_narrow_cache_case(const GateSpec& spec, std::optional<Index> window) {
    SCOPED_TRACE(std::string("NarrowCache/") + type_label<Store>() + (window ? "/Window" : "") + "/" + spec_name(spec) +
                 " (" + gattn::describe(spec) + ")");
    constexpr bool kInt8 = std::is_same_v<Store, std::int8_t>;
    const double tolerance = kInt8 ? 1e-2 : std::is_same_v<Store, gattn::bfloat16> ? 4e-3 : 5e-4;
    LayerShape sh = kGqaCausal;
    sh.window = window;
    const Index B = 2, N = 7;
    const gattn::AttentionConfig c = make_config(spec, sh);
    const auto w = gattn::make_random_weights<float>(c, kInt8 ? 20250511u : 20250513u);
    const gattn::GatedMultiHeadAttention<float> layer(c, w);
    const gattn::RowMatrix<float> x = gattn_test::random_matrix(B * N, sh.D, kInt8 ? 4344u : 4345u).cast<float>();
    auto exact = layer.make_cache(B, 8);
    gattn::KVCache<Store> narrow = layer.make_cache<Store>(B, 8);
    const std::vector<std::vector<Index>> schedule = {{3, 2}, {1, 1}, {2, 0}, {1, 1}, {0, 1}};
    Index fed = 0;
    double worst = 0;
    for (const auto& counts : schedule) {
        const Index n = *std::max_element(counts.begin(), counts.end());
        gattn::RowMatrix<float> xs(B * n, sh.D), y_exact(B * n, sh.D), y_narrow(B * n, sh.D);
        for (Index r = 0; r < B * n; ++r) xs.row(r) = x.row((fed + r) % (B * N));
        fed += B * n;
        layer.forward(xs, exact, y_exact, counts);
        layer.forward(xs, narrow, y_narrow, counts);
        ASSERT_EQ(narrow.lengths(), exact.lengths());
        ASSERT_EQ(narrow.first_positions(), exact.first_positions());
        for (Index b = 0; b < B; ++b)
            for (Index t = 0; t < exact.lengths()[b]; ++t) {
                SCOPED_TRACE("sequence " + std::to_string(b) + ", token " + std::to_string(t));
                expect_row_stored(exact, narrow, b * exact.capacity() + t, b * narrow.capacity() + t, c.num_kv_heads);
                if (::testing::Test::HasFatalFailure()) return;
            }
        for (Index b = 0; b < B; ++b)
            for (Index t = 0; t < counts[b]; ++t) {
                const double scale = 1 + y_exact.row(b * n + t).cwiseAbs().maxCoeff();
                worst = std::max(
                    worst, double((y_narrow.row(b * n + t) - y_exact.row(b * n + t)).cwiseAbs().maxCoeff()) / scale);
            }
    }
    EXPECT_LE(worst, tolerance);
}

class GateSpecs : public ::testing::TestWithParam<GateSpec> {};

TEST_P(GateSpecs, FloatDecodeWithCache) { run_decode_case<float>(GetParam(), std::nullopt); }
TEST_P(GateSpecs, DoubleDecodeWithCache) { run_decode_case<double>(GetParam(), std::nullopt); }
TEST_P(GateSpecs, FloatDecodeWithCacheWindow) { run_decode_case<float>(GetParam(), 3); }

TEST_P(GateSpecs, Bf16DecodeWithCache) { run_decode_case<gattn::bfloat16>(GetParam(), std::nullopt); }
// Every gate beside learned attention sinks: prefill, decoding, probabilities, bf16.
TEST_P(GateSpecs, FloatGqaCausalSinks) { run_layer_case<float>(GetParam(), kGqaCausalSinks); }
TEST_P(GateSpecs, FloatMhaKeyLengthsSinks) { run_layer_case<float>(GetParam(), kMhaKeyLengthsSinks); }
TEST_P(GateSpecs, Bf16GqaCausalSinks) { run_layer_case<gattn::bfloat16>(GetParam(), kGqaCausalSinks); }
TEST_P(GateSpecs, FloatDecodeWithCacheSinks) { run_decode_case<float>(GetParam(), std::nullopt, true); }
// Every gate beside softcap and ALiBi (Gemma 2, BLOOM): prefill with probabilities, decoding
// with a window, bf16.
TEST_P(GateSpecs, FloatGqaCausalSoftcapAlibi) { run_layer_case<float>(GetParam(), kGqaCausalSoftcapAlibi); }
TEST_P(GateSpecs, Bf16GqaCausalSoftcapAlibi) { run_layer_case<gattn::bfloat16>(GetParam(), kGqaCausalSoftcapAlibi); }
TEST_P(GateSpecs, FloatDecodeWithCacheWindowSoftcapAlibi) { run_decode_case<float>(GetParam(), 3, false, true); }
// Every gate with RoPE and q/k norm (Llama, Qwen3, GPT-J styles): prefill, decoding, bf16.
TEST_P(GateSpecs, FloatGqaCausalRopeNorm) { run_layer_case<float>(GetParam(), kGqaCausalRopeNorm); }
TEST_P(GateSpecs, DoubleMhaKeyLengthsGptJ) { run_layer_case<double>(GetParam(), kMhaKeyLengthsGptJ); }
TEST_P(GateSpecs, Bf16GqaCausalRopeNorm) { run_layer_case<gattn::bfloat16>(GetParam(), kGqaCausalRopeNorm); }
TEST_P(GateSpecs, FloatDecodeWithCacheWindowRopeNorm) { run_decode_case<float>(GetParam(), 3, false, false, true); }

// Every gate with an int8 KV cache, with and without a window.
TEST_P(GateSpecs, Int8CacheDecode) { run_narrow_cache_case<std::int8_t>(GetParam(), std::nullopt); }
TEST_P(GateSpecs, Int8CacheDecodeWindow) { run_narrow_cache_case<std::int8_t>(GetParam(), 3); }
// Every gate with a float layer's bf16 or fp16 cache (16-bit storage, float compute).
TEST_P(GateSpecs, Bf16CacheOnFloatLayerDecode) { run_narrow_cache_case<gattn::bfloat16>(GetParam(), std::nullopt); }
TEST_P(GateSpecs, Bf16CacheOnFloatLayerDecodeWindow) { run_narrow_cache_case<gattn::bfloat16>(GetParam(), 3); }
TEST_P(GateSpecs, HalfCacheOnFloatLayerDecode) { run_narrow_cache_case<gattn::half>(GetParam(), std::nullopt); }

TEST_P(GateSpecs, FloatGqaCausal) { run_layer_case<float>(GetParam(), kGqaCausal); }
TEST_P(GateSpecs, Bf16GqaCausal) { run_layer_case<gattn::bfloat16>(GetParam(), kGqaCausal); }
TEST_P(GateSpecs, Bf16MhaKeyLengths) { run_layer_case<gattn::bfloat16>(GetParam(), kMhaKeyLengths); }
TEST_P(GateSpecs, DoubleGqaCausal) { run_layer_case<double>(GetParam(), kGqaCausal); }
TEST_P(GateSpecs, FloatMhaKeyLengths) { run_layer_case<float>(GetParam(), kMhaKeyLengths); }
TEST_P(GateSpecs, DoubleMhaKeyLengths) { run_layer_case<double>(GetParam(), kMhaKeyLengths); }

/// bf16 activations are the float path on the widened input, rounded once at the end.
TEST(Bf16Layer, Bf16ActivationsAreTheFloatPathRoundedOnce) {
    const gattn::AttentionConfig c = make_config(GateSpec::g1_elementwise(), kGqaCausal);
    const auto w = gattn::make_random_weights<gattn::bfloat16>(c, 7u);
    const gattn::GatedMultiHeadAttention<gattn::bfloat16> layer(c, w);
    const gattn::GatedMultiHeadAttention<gattn::bfloat16, gattn::bfloat16> layer16(c, w);
    const gattn::RowMatrix<gattn::bfloat16> x16 = gattn_test::random_matrix(10, c.d_model, 8u).cast<gattn::bfloat16>();
    const gattn::RowMatrix<float> y = layer.forward(x16.cast<float>(), 2);
    const gattn::RowMatrix<gattn::bfloat16> y16 = layer16.forward(x16, 2);
    EXPECT_TRUE(y16 == y.cast<gattn::bfloat16>());
}

INSTANTIATE_TEST_SUITE_P(AllValid, GateSpecs, ::testing::ValuesIn(gattn::all_valid_gate_specs()),
                         [](const ::testing::TestParamInfo<GateSpec>& info) { return spec_name(info.param); });

// ---------------------------------------------------------------------------------------------
// The table of valid combinations.

TEST(GateSpecTable, ValidListMatchesDocumentedTable) {
    const auto valid = gattn::all_valid_gate_specs();
    std::set<std::string> names;
    for (const auto& s : valid) {
        EXPECT_TRUE(names.insert(spec_name(s)).second) << "duplicate spec " << gattn::describe(s);
        EXPECT_TRUE(table_allows(s)) << "listed but not in the documented table: " << gattn::describe(s);
        EXPECT_EQ(gattn::gate_spec_error(s), "") << gattn::describe(s);
    }
    long table_count = 1;  // the "none" spec
    for (const auto& s : all_gate_specs())
        if (s.enabled() && table_allows(s)) {
            ++table_count;
            EXPECT_TRUE(in_valid_list(s)) << "documented as valid but not listed: " << gattn::describe(s);
        }
    EXPECT_EQ(static_cast<long>(valid.size()), table_count);
    EXPECT_EQ(valid.front(), GateSpec{});
}

/// Every combination of enum values: exactly the listed ones (and "none", whose other fields are
/// ignored) construct; the rest throw std::invalid_argument mentioning the gate.
TEST(GateSpecTable, InvalidCombinationsThrowOnConstruction) {
    gattn::AttentionConfig base;
    base.d_model = 24;
    base.num_heads = 4;
    base.num_kv_heads = 2;
    base.head_dim = 6;
    const auto ungated_weights = gattn::make_random_weights<float>(base, 1);
    long valid = 0, invalid = 0;
    for (const auto& s : all_gate_specs()) {
        gattn::AttentionConfig c = base;
        c.gate = s;
        const bool expect_valid = !s.enabled() || in_valid_list(s);
        EXPECT_EQ(expect_valid, table_allows(s)) << gattn::describe(s);
        if (expect_valid) {
            ++valid;
            EXPECT_NO_THROW({
                const auto w = gattn::make_random_weights<float>(c, 2);
                gattn::GatedMultiHeadAttention<float> layer(c, w);
            }) << gattn::describe(s);
            continue;
        }
        ++invalid;
        try {
            gattn::GatedMultiHeadAttention<float> layer(c, ungated_weights);
            ADD_FAILURE() << "accepted an invalid spec: " << gattn::describe(s);
        } catch (const gattn::shape_error& e) {
            ADD_FAILURE() << "shape_error instead of a gate error for " << gattn::describe(s) << ": " << e.what();
        } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find("gate"), std::string::npos) << e.what();
        }
        EXPECT_THROW(gattn::make_random_weights<float>(c, 3), std::invalid_argument) << gattn::describe(s);
    }
    EXPECT_GT(valid, 100);
    EXPECT_GT(invalid, 3000);
}

TEST(GateSpecTable, FusedElementwiseGateRequiresEqualHeadDims) {
    gattn::AttentionConfig c;
    c.d_model = 24;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 6;
    c.value_head_dim = 5;
    for (auto layout : {GateLayout::PerHeadInterleaved, GateLayout::GroupedByKV}) {
        c.gate = GateSpec::g1_elementwise(layout);
        try {
            gattn::validate_config(c, "test");
            ADD_FAILURE() << "fused elementwise gate with d_v != d_k accepted";
        } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find("value_head_dim"), std::string::npos) << e.what();
        }
        c.gate = GateSpec::g1_headwise(layout);  // headwise fused gates allow d_v != d_k
        EXPECT_NO_THROW(gattn::validate_config(c, "test"));
    }
}

// ---------------------------------------------------------------------------------------------
// Weights of the wrong shape.

gattn::AttentionConfig small_config(const GateSpec& g) {
    gattn::AttentionConfig c;
    c.d_model = 24;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 6;
    c.value_head_dim = 5;
    c.qkv_bias = true;
    c.o_bias = true;
    c.gate = g;
    return c;
}

template <class Mutate>
void expect_weight_error(const gattn::AttentionConfig& c, Mutate mutate, const std::string& name) {
    auto w = gattn::make_random_weights<float>(c, 5);
    mutate(w);
    try {
        gattn::GatedMultiHeadAttention<float> layer(c, w);
        ADD_FAILURE() << "wrong " << name << " accepted";
    } catch (const gattn::shape_error& e) {
        EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    } catch (const std::exception& e) {
        ADD_FAILURE() << "expected gattn::shape_error naming " << name << ", got: " << e.what();
    }
}

TEST(GateWeights, WrongShapesNameTheParameter) {
    GateSpec biased = GateSpec::g1_elementwise();
    biased.bias = true;
    const auto c = small_config(biased);
    expect_weight_error(
        c, [](auto& w) { w.gate_proj_weight.resize(w.gate_proj_weight.rows() + 1, w.gate_proj_weight.cols()); },
        "gate_proj.weight");
    expect_weight_error(
        c, [](auto& w) { w.gate_proj_weight.resize(0, 0); }, "gate_proj.weight");
    expect_weight_error(
        c, [](auto& w) { w.gate_proj_weight.transposeInPlace(); }, "gate_proj.weight");
    expect_weight_error(
        c, [](auto& w) { w.gate_proj_bias.resize(3); }, "gate_proj.bias");
    expect_weight_error(
        c, [](auto& w) { w.o_proj_weight.transposeInPlace(); }, "o_proj.weight");
    expect_weight_error(
        c, [](auto& w) { w.k_proj_bias.resize(0); }, "k_proj.bias");

    // A given but unused parameter is refused too.
    const auto ungated = small_config(GateSpec{});
    expect_weight_error(
        ungated, [](auto& w) { w.gate_theta = gattn::RowMatrix<float>::Ones(4, 5); }, "gate_theta");

    // Fused layout: q_proj must carry the gate rows.
    const auto fused = small_config(GateSpec::g1_headwise(GateLayout::PerHeadInterleaved));
    expect_weight_error(
        fused, [](auto& w) { w.q_proj_weight.conservativeResize(4 * 6, 24); }, "q_proj.weight");
    expect_weight_error(
        fused, [](auto& w) { w.q_proj_bias.conservativeResize(4 * 6); }, "q_proj.bias");

    // Query-sourced gate: gate_proj is [H, d_k], not [H, D].
    GateSpec query = GateSpec::g1_headwise();
    query.source = GateSource::Query;
    const auto qc = small_config(query);
    expect_weight_error(
        qc, [](auto& w) { w.gate_proj_weight = gattn::RowMatrix<float>::Ones(4, 24); }, "gate_proj.weight");

    // Input-independent gate: gate_theta is [H, d_v].
    GateSpec indep = GateSpec::g1_elementwise();
    indep.source = GateSource::InputIndependent;
    const auto ic = small_config(indep);
    expect_weight_error(
        ic, [](auto& w) { w.gate_theta = gattn::RowMatrix<float>::Ones(4, 6); }, "gate_theta");
}

// ---------------------------------------------------------------------------------------------
// Paper Table 1, "Added Param" of the 15A2B MoE model: 24 layers, D = 2048, H = 32, H_kv = 4,
// head_dim = 128, no biases.

Index added_params_15a2b(GatePosition pos, GateGranularity gran, GateSharing share = GateSharing::HeadSpecific) {
    gattn::AttentionConfig c;
    c.d_model = 2048;
    c.num_heads = 32;
    c.num_kv_heads = 4;
    c.head_dim = 128;
    c.gate.position = pos;
    c.gate.granularity = gran;
    c.gate.sharing = share;
    gattn::validate_config(c, "test");
    return 24 * gattn::gate_parameter_count(c);
}

/// value rounded to `decimals` decimals of a million, as the paper prints it.
double in_millions(Index n, int decimals) {
    const double scale = std::pow(10.0, decimals);
    return std::round(static_cast<double>(n) / 1e6 * scale) / scale;
}

TEST(GateParameterCount, ReproducesPaperTable1) {
    using E = GateGranularity;
    EXPECT_DOUBLE_EQ(in_millions(added_params_15a2b(GatePosition::G1, E::Elementwise), 1), 201.3);
    EXPECT_DOUBLE_EQ(in_millions(added_params_15a2b(GatePosition::G2, E::Elementwise), 1), 25.2);
    EXPECT_DOUBLE_EQ(in_millions(added_params_15a2b(GatePosition::G5, E::Elementwise), 1), 100.7);
    EXPECT_DOUBLE_EQ(in_millions(added_params_15a2b(GatePosition::G1, E::Headwise), 2), 1.57);
    EXPECT_DOUBLE_EQ(in_millions(added_params_15a2b(GatePosition::G2, E::Headwise), 3), 0.197);
    // Exact counts behind the printed values.
    EXPECT_EQ(added_params_15a2b(GatePosition::G1, E::Elementwise), 201326592);
    EXPECT_EQ(added_params_15a2b(GatePosition::G2, E::Elementwise), 25165824);
    EXPECT_EQ(added_params_15a2b(GatePosition::G5, E::Elementwise), 100663296);
    EXPECT_EQ(added_params_15a2b(GatePosition::G1, E::Headwise), 1572864);
    EXPECT_EQ(added_params_15a2b(GatePosition::G2, E::Headwise), 196608);
    // Head-shared gates keep the head-specific projection size (logits averaged afterwards).
    EXPECT_EQ(added_params_15a2b(GatePosition::G1, E::Elementwise, GateSharing::HeadShared), 201326592);
    EXPECT_EQ(added_params_15a2b(GatePosition::G2, E::Elementwise, GateSharing::HeadShared), 25165824);
    gattn::AttentionConfig none;
    none.d_model = 2048;
    none.num_heads = 32;
    none.num_kv_heads = 4;
    none.head_dim = 128;
    EXPECT_EQ(gattn::gate_parameter_count(none), 0);
}

// ---------------------------------------------------------------------------------------------
// Gate kernels at extreme logits.

template <class S>
class GateKernels : public ::testing::Test {};

using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(GateKernels, Scalars, ScalarNames);

/// Extreme values placed at every lane position of full registers and of the tail.
template <class S>
std::vector<S> extreme_array(std::size_t n) {
    const S v[] = {S(-1000),
                   S(1000),
                   -std::numeric_limits<S>::infinity(),
                   std::numeric_limits<S>::infinity(),
                   std::numeric_limits<S>::quiet_NaN(),
                   S(0)};
    std::vector<S> z(n);
    for (std::size_t i = 0; i < n; ++i) z[i] = v[i % 6];
    return z;
}

TYPED_TEST(GateKernels, SigmoidSaturatesExactly) {
    using S = TypeParam;
    for (std::size_t n : {1u, 6u, 7u, 37u, 64u}) {
        const auto z = extreme_array<S>(n);
        std::vector<S> out(n, S(-5));
        gattn::activate<S>(GateActivation::Sigmoid, z.data(), out.data(), n);
        for (std::size_t i = 0; i < n; ++i) {
            SCOPED_TRACE("n = " + std::to_string(n) + ", i = " + std::to_string(i) + ", z = " + std::to_string(z[i]));
            switch (i % 6) {
                case 0: EXPECT_EQ(out[i], S(0)); break;  // σ(−1000)
                case 1: EXPECT_EQ(out[i], S(1)); break;  // σ(1000)
                case 2: EXPECT_EQ(out[i], S(0)); break;  // σ(−∞)
                case 3: EXPECT_EQ(out[i], S(1)); break;  // σ(+∞)
                case 4: EXPECT_TRUE(std::isnan(out[i])); break;
                case 5: EXPECT_EQ(out[i], S(0.5)); break;
            }
        }
    }
}

TYPED_TEST(GateKernels, NonSparseSigmoidAndSiluAtExtremes) {
    using S = TypeParam;
    const std::size_t n = 37;
    const auto z = extreme_array<S>(n);
    std::vector<S> ns(n), si(n);
    gattn::activate<S>(GateActivation::NonSparseSigmoid, z.data(), ns.data(), n);
    gattn::activate<S>(GateActivation::SiLU, z.data(), si.data(), n);
    for (std::size_t i = 0; i < n; ++i) {
        SCOPED_TRACE("i = " + std::to_string(i) + ", z = " + std::to_string(z[i]));
        switch (i % 6) {
            case 0:
                EXPECT_EQ(ns[i], S(0.5));
                EXPECT_EQ(si[i], S(0));  // −1000 · 0 (a negative zero compares equal)
                break;
            case 1:
                EXPECT_EQ(ns[i], S(1));
                EXPECT_EQ(si[i], S(1000));
                break;
            case 2: EXPECT_EQ(ns[i], S(0.5)); break;  // SiLU(−∞) = −∞ · 0 is NaN under IEEE
            case 3:
                EXPECT_EQ(ns[i], S(1));
                EXPECT_EQ(si[i], std::numeric_limits<S>::infinity());
                break;
            case 4:
                EXPECT_TRUE(std::isnan(ns[i]));
                EXPECT_TRUE(std::isnan(si[i]));
                break;
            case 5:
                EXPECT_EQ(ns[i], S(0.75));
                EXPECT_EQ(si[i], S(0));
                break;
        }
    }
}

/// Tolerances of the activations against float64 on a grid: a few ulps relative, and an
/// absolute floor for results near the smallest normal number (σ below it saturates to exactly 0,
/// so SiLU z·σ(z) may be 0 where the exact value is |z|·σ(z) ≈ 1e-37 for z ≈ −88).
template <class S>
struct KernelTol;
template <>
struct KernelTol<float> {
    static constexpr double atol = 1e-35, rtol = 1e-6;
};
template <>
struct KernelTol<double> {
    static constexpr double atol = 1e-304, rtol = 1e-14;
};

template <class S>
std::vector<double> logit_grid() {
    std::vector<double> g;
    for (double z = -120.0; z <= 120.0; z += 0.173) g.push_back(static_cast<double>(static_cast<S>(z)));
    for (double z : {-1000.0, -745.0, -710.0, -104.0, -89.0, -88.7, -88.0, -87.0, -30.0, -1e-3, -1e-7,
                     0.0,     1e-7,   1e-3,   17.0,   30.0,  88.0,  89.0,  710.0, 745.0, 1000.0})
        g.push_back(static_cast<double>(static_cast<S>(z)));
    return g;
}

TYPED_TEST(GateKernels, ActivationsMatchReferenceOnGrid) {
    using S = TypeParam;
    const auto grid = logit_grid<S>();
    const std::size_t n = grid.size();
    std::vector<S> z(grid.begin(), grid.end()), out(n);
    for (auto act : {GateActivation::Sigmoid, GateActivation::SiLU, GateActivation::NonSparseSigmoid}) {
        gattn::activate<S>(act, z.data(), out.data(), n);
        Mat got(1, static_cast<Index>(n)), ref(1, static_cast<Index>(n));
        for (std::size_t i = 0; i < n; ++i) {
            got(0, static_cast<Index>(i)) = out[i];
            ref(0, static_cast<Index>(i)) = gattn_test::ref_activation(act, grid[i]);
        }
        expect_close(got, ref, KernelTol<S>::atol, KernelTol<S>::rtol,
                     std::string("GateKernel") + type_label<S>() + "/" + gattn::to_string(act));
        // In place (out == z) gives the same values.
        std::vector<S> inplace = z;
        gattn::activate<S>(act, inplace.data(), inplace.data(), n);
        for (std::size_t i = 0; i < n; ++i)
            EXPECT_TRUE(inplace[i] == out[i] || (std::isnan(inplace[i]) && std::isnan(out[i]))) << i;
    }
}

/// The fused activation-and-combine kernel: y ⊙ g, y + g, g ⊙ y + (1 − g) ⊙ x, with gate_out.
TYPED_TEST(GateKernels, FusedCombineMatchesReference) {
    using S = TypeParam;
    const std::size_t n = 45;
    const Mat zy = gattn_test::random_matrix(3, static_cast<Index>(n), 77, 6.0);
    std::vector<S> z(n), y0(n), x(n);
    for (std::size_t i = 0; i < n; ++i) {
        z[i] = static_cast<S>(zy(0, static_cast<Index>(i)));
        y0[i] = static_cast<S>(zy(1, static_cast<Index>(i)) / 6.0);
        x[i] = static_cast<S>(zy(2, static_cast<Index>(i)) / 6.0);
    }
    z[0] = S(-1000);
    z[1] = S(1000);
    z[n - 1] = S(-1000);
    z[n - 2] = S(1000);
    for (auto act : {GateActivation::Sigmoid, GateActivation::SiLU, GateActivation::NonSparseSigmoid})
        for (auto comb : {GateCombine::Multiplicative, GateCombine::Additive, GateCombine::ResidualMix}) {
            std::vector<S> y = y0, g(n, S(-9));
            gattn::apply_gate<S>(act, comb, y.data(), z.data(), x.data(), g.data(), n);
            Mat got(2, static_cast<Index>(n)), ref(2, static_cast<Index>(n));
            for (std::size_t i = 0; i < n; ++i) {
                const Index c = static_cast<Index>(i);
                const double gv = gattn_test::ref_activation(act, static_cast<double>(z[i]));
                const double yv = y0[i], xv = x[i];
                got(0, c) = y[i];
                got(1, c) = g[i];
                ref(0, c) = comb == GateCombine::Multiplicative ? yv * gv
                            : comb == GateCombine::Additive     ? yv + gv
                                                                : gv * yv + (1.0 - gv) * xv;
                ref(1, c) = gv;
            }
            const std::string label = std::string("GateFused") + type_label<S>() + "/" + gattn::to_string(act) + "/" +
                                      gattn::to_string(comb);
            // Magnitudes here are ≤ ~1000 (SiLU of 1000): a relative tolerance a few ulps wide.
            expect_close(got, ref, 4 * std::numeric_limits<S>::epsilon(), 4 * std::numeric_limits<S>::epsilon(), label);
            if (act == GateActivation::Sigmoid) {
                if (comb == GateCombine::Multiplicative) {
                    EXPECT_EQ(y[0], S(0)) << label;
                    EXPECT_EQ(y[1], y0[1]) << label;
                    EXPECT_EQ(y[n - 1], S(0)) << label;
                    EXPECT_EQ(y[n - 2], y0[n - 2]) << label;
                }
                // The residual mix at a saturated gate is only required to be within the few-ulp
                // tolerance above (g·y + (1 − g)·x may be evaluated as x + g·(y − x)).
            }
        }
}

/// NaN logits propagate through the fused kernel and do not disturb neighbouring elements.
TYPED_TEST(GateKernels, NaNLogitPropagatesLocally) {
    using S = TypeParam;
    const std::size_t n = 19;
    std::vector<S> z(n, S(0.5)), y(n, S(2)), x(n, S(1)), g(n);
    z[3] = std::numeric_limits<S>::quiet_NaN();
    z[n - 1] = std::numeric_limits<S>::quiet_NaN();
    for (auto comb : {GateCombine::Multiplicative, GateCombine::Additive, GateCombine::ResidualMix}) {
        std::vector<S> yy = y;
        gattn::apply_gate<S>(GateActivation::Sigmoid, comb, yy.data(), z.data(), x.data(), g.data(), n);
        for (std::size_t i = 0; i < n; ++i) {
            const bool nan_expected = i == 3 || i == n - 1;
            EXPECT_EQ(std::isnan(yy[i]), nan_expected) << gattn::to_string(comb) << " at " << i;
            EXPECT_EQ(std::isnan(g[i]), nan_expected) << gattn::to_string(comb) << " at " << i;
        }
    }
}

}  // namespace
