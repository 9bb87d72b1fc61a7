// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Configuration of a gated multi-head attention layer, its weight shapes (PyTorch nn.Linear
/// layout [out_features, in_features], Hugging Face parameter names) and the gate's parameter
/// count (paper arXiv:2505.06708 Table 1, "Added Param").

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gattn/gates/gate_spec.hpp"
#include "gattn/ops/logit_limits.hpp"
#include "gattn/types.hpp"

namespace gattn {

/// How rotary position embedding pairs a head's features (AttentionConfig::rope_style).
enum class RopeStyle {
    NeoX,  ///< feature i with i + r/2, "rotate_half" (HF Llama, Qwen2/3, Qwen3-Next)
    GptJ,  ///< feature 2i with 2i + 1, interleaved (GPT-J, Meta's original Llama)
};

/// RMSNorm of each query and key head before RoPE (AttentionConfig::qk_norm; HF q_norm, k_norm).
enum class QkNorm {
    None,
    RmsNorm,             ///< y = x / √(mean(x²) + ε) · w (Qwen3, OLMo 2)
    ZeroCentredRmsNorm,  ///< y = x / √(mean(x²) + ε) · (1 + w) (Qwen3-Next)
};

}  // namespace gattn

GATTN_BEGIN_ISA_NAMESPACE

/// Layer configuration. Shapes: D = d_model, H = num_heads, H_kv = num_kv_heads,
/// d_k = head_dim, d_v = value_head_dim (0 means d_k). (In the instruction-set namespace: its
/// default constructor stores floating-point values, whose instructions the instruction set
/// changes.)
struct AttentionConfig {
    Index d_model = 0;                    ///< D: width of the layer's input and output rows (HF hidden_size)
    Index num_heads = 0;                  ///< H: query heads (HF num_attention_heads)
    Index num_kv_heads = 0;               ///< H_kv: key/value heads, dividing H (H_kv = H: MHA, 1: MQA, else GQA)
    Index head_dim = 0;                   ///< d_k: features per query/key head
    Index value_head_dim = 0;             ///< 0 = head_dim
    bool qkv_bias = false;                ///< q_proj, k_proj, v_proj have biases (HF attention_bias)
    bool o_bias = false;                  ///< o_proj has a bias
    GateSpec gate;                        ///< default: no gate (the ungated baseline)
    bool causal = false;                  ///< bottom-right aligned causal mask
    std::optional<Index> sliding_window;  ///< window in keys, counting the diagonal
    std::optional<double> scale;          ///< logit scale; empty = 1/√head_dim
    /// Learned attention sinks (gpt-oss): one logit per query head, HF name "sinks" [H], that
    /// joins each row's softmax denominator without a value (SdpaOptions::sinks). Composes
    /// with any gate, so gated, sink and gated-plus-sink layers compare like for like.
    bool sinks = false;
    /// Logit soft-capping c > 0 (Gemma 2's attn_logit_softcapping, 50 there): each scaled
    /// logit ℓ becomes c·tanh(ℓ/c) (SdpaOptions::logit_softcap); 0 = none.
    double logit_softcap = 0;
    /// ALiBi with the standard slopes alibi_slopes(H) (BLOOM, MPT; SdpaOptions::alibi_slopes).
    bool alibi = false;
    /// RMSNorm of every query and key head (weights q_norm.weight, k_norm.weight [d_k]), before
    /// RoPE, as Qwen3 and Qwen3-Next.
    QkNorm qk_norm = QkNorm::None;
    double rms_norm_eps = 1e-6;  ///< ε of qk_norm (HF rms_norm_eps)
    /// Rotary position embedding (Su et al. 2021) of the first rotary_dim features of every
    /// query and key head (even, ≤ head_dim; HF head_dim · partial_rotary_factor), after
    /// qk_norm; 0 = none. Positions come from ForwardOptions::positions or the cache.
    Index rotary_dim = 0;
    double rope_theta = 10000;               ///< RoPE base θ: pair i turns by position · θ^(−2i/r)
    RopeStyle rope_style = RopeStyle::NeoX;  ///< which features RoPE pairs

    /// Features per query and key head.
    Index d_k() const noexcept { return head_dim; }
    /// Features per value head (value_head_dim, or head_dim when that is 0).
    Index d_v() const noexcept { return value_head_dim > 0 ? value_head_dim : head_dim; }
};

/// Shape of one named parameter; `shape` has one entry for a bias, two for a weight.
/// (In the instruction-set namespace: std::vector<TensorShape>'s code differs by instruction set.)
struct TensorShape {
    std::string name;          ///< HF parameter name relative to the layer, e.g. "q_proj.weight"
    std::vector<Index> shape;  ///< [out_features, in_features] or [features]
};

/// Throws std::invalid_argument (naming `function` and the field) when the config is invalid:
/// sizes < 1, H not divisible by H_kv, window < 1, non-finite scale, a logit_softcap other
/// than 0 outside float's range (detail::softcap_min, softcap_max: a normal float whose
/// product with log₂e stays within half the largest float), rotary_dim odd or outside
/// [0, head_dim], rope_theta ≤ 0, rms_norm_eps < 0,
/// invalid gate spec, or a
/// fused gate layout with d_v ≠ d_k for an elementwise gate.
inline void validate_config(const AttentionConfig& c, const char* function) {
    auto positive = [&](Index v, const char* name) {
        if (v < 1)
            detail::throw_invalid(function, std::string("config.") + name, "must be >= 1, got " + std::to_string(v));
    };
    positive(c.d_model, "d_model");
    positive(c.num_heads, "num_heads");
    positive(c.num_kv_heads, "num_kv_heads");
    positive(c.head_dim, "head_dim");
    // Sizes beyond 2^24 per dimension are rejected so that every weight shape and row width
    // (products of two or three sizes) fits an Index without overflow.
    constexpr Index kMaxSize = Index(1) << 24;
    auto bounded = [&](Index v, const char* name) {
        if (v > kMaxSize)
            detail::throw_invalid(function, std::string("config.") + name, "must be <= 2^24, got " + std::to_string(v));
    };
    bounded(c.d_model, "d_model");
    bounded(c.num_heads, "num_heads");
    bounded(c.num_kv_heads, "num_kv_heads");
    bounded(c.head_dim, "head_dim");
    bounded(c.value_head_dim, "value_head_dim");
    if (c.value_head_dim < 0)
        detail::throw_invalid(function, "config.value_head_dim",
                              "must be >= 0 (0 = head_dim), got " + std::to_string(c.value_head_dim));
    if (c.num_heads % c.num_kv_heads != 0)
        detail::throw_invalid(function, "config.num_kv_heads",
                              "must divide num_heads = " + std::to_string(c.num_heads) + ", got " +
                                  std::to_string(c.num_kv_heads));
    if (c.sliding_window && *c.sliding_window < 1)
        detail::throw_invalid(function, "config.sliding_window",
                              "must be >= 1 (it counts the diagonal), got " + std::to_string(*c.sliding_window));
    if (c.scale && !std::isfinite(*c.scale)) detail::throw_invalid(function, "config.scale", "must be finite");
    // In float's range (the narrowest compute type), as SDPA checks it (ops/logit_limits.hpp).
    if (c.logit_softcap != 0) {
        const double cap = double(float(c.logit_softcap));
        if (!(cap >= detail::softcap_min<float>() && cap <= detail::softcap_max<float>()))
            detail::throw_invalid(function, "config.logit_softcap",
                                  "must be 0 (none) or in [" + detail::number_string(detail::softcap_min<float>()) +
                                      ", " + detail::number_string(detail::softcap_max<float>()) +
                                      "] (a normal float whose product with log2(e) stays within half the "
                                      "largest float), got " +
                                      detail::number_string(c.logit_softcap));
    }
    if (c.rotary_dim < 0 || c.rotary_dim % 2 != 0 || c.rotary_dim > c.head_dim)
        detail::throw_invalid(function, "config.rotary_dim",
                              "must be even and in [0, head_dim = " + std::to_string(c.head_dim) + "], got " +
                                  std::to_string(c.rotary_dim));
    if (c.rotary_dim > 0 && !(std::isfinite(c.rope_theta) && c.rope_theta > 0))
        detail::throw_invalid(function, "config.rope_theta",
                              "must be finite and > 0, got " + detail::number_string(c.rope_theta));
    if (c.qk_norm != QkNorm::None && !(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps >= 0))
        detail::throw_invalid(function, "config.rms_norm_eps",
                              "must be finite and >= 0, got " + detail::number_string(c.rms_norm_eps));
    validate_gate_spec(c.gate, function);
    if (c.gate.enabled() && c.gate.layout != GateLayout::Separate &&
        c.gate.granularity == GateGranularity::Elementwise && c.d_v() != c.d_k())
        detail::throw_invalid(function, "config.value_head_dim",
                              "must equal head_dim for an elementwise gate fused into q_proj, got " +
                                  std::to_string(c.d_v()) + " vs " + std::to_string(c.d_k()));
}

/// Gate logits per token: the rows the gate adds to gate_proj (or to q_proj when fused).
/// 0 without a gate and for input-independent gates (which have gate_theta instead).
inline Index gate_width(const AttentionConfig& c) {
    const GateSpec& g = c.gate;
    if (!g.enabled() || g.source == GateSource::InputIndependent) return 0;
    const bool elem = g.granularity == GateGranularity::Elementwise;
    switch (g.position) {
        case GatePosition::None: return 0;
        case GatePosition::G1: return elem ? c.num_heads * c.d_v() : c.num_heads;
        case GatePosition::G2: return elem ? c.num_kv_heads * c.d_v() : c.num_kv_heads;
        case GatePosition::G3: return elem ? c.num_kv_heads * c.d_k() : c.num_kv_heads;
        case GatePosition::G4: return elem ? c.num_heads * c.d_k() : c.num_heads;
        case GatePosition::G5: return c.d_model;
    }
    return 0;
}

/// Every parameter the layer expects, with its shape, in HF names:
/// q_proj.weight [H·d_k (+ gate rows when fused), D], k_proj.weight [H_kv·d_k, D],
/// v_proj.weight [H_kv·d_v, D], o_proj.weight [D, H·d_v], biases when configured,
/// gate_proj.weight [gate_width, D] (input gates) or [H, d_k] (query-sourced gates),
/// gate_proj.bias, gate_theta [H, d_v] (input-independent gates), sinks [H],
/// q_norm.weight and k_norm.weight [d_k] (qk_norm).
inline std::vector<TensorShape> expected_weight_shapes(const AttentionConfig& c) {
    const Index D = c.d_model, H = c.num_heads, Hkv = c.num_kv_heads, dk = c.d_k(), dv = c.d_v();
    const GateSpec& g = c.gate;
    const bool fused = g.enabled() && g.layout != GateLayout::Separate;
    const Index q_rows = H * dk + (fused ? gate_width(c) : 0);
    std::vector<TensorShape> s{{"q_proj.weight", {q_rows, D}},
                               {"k_proj.weight", {Hkv * dk, D}},
                               {"v_proj.weight", {Hkv * dv, D}},
                               {"o_proj.weight", {D, H * dv}}};
    if (c.qkv_bias) {
        s.push_back({"q_proj.bias", {q_rows}});
        s.push_back({"k_proj.bias", {Hkv * dk}});
        s.push_back({"v_proj.bias", {Hkv * dv}});
    }
    if (c.o_bias) s.push_back({"o_proj.bias", {D}});
    if (c.sinks) s.push_back({"sinks", {H}});
    if (c.qk_norm != QkNorm::None) {
        s.push_back({"q_norm.weight", {dk}});
        s.push_back({"k_norm.weight", {dk}});
    }
    if (g.enabled() && !fused) {
        if (g.source == GateSource::Input) {
            s.push_back({"gate_proj.weight", {gate_width(c), D}});
            if (g.bias) s.push_back({"gate_proj.bias", {gate_width(c)}});
        } else if (g.source == GateSource::Query) {
            s.push_back({"gate_proj.weight", {H, dk}});
            if (g.bias) s.push_back({"gate_proj.bias", {H}});
        } else {
            s.push_back({"gate_theta", {H, dv}});
        }
    }
    return s;
}

namespace detail {

/// Checks one parameter against the expected shapes: a tensor the list names must have that
/// shape, any other must be empty. Throws shape_error "<fn>: <name> must ..., got [..]".
/// `unused` says why an unlisted tensor is not used (e.g. the gate spec).
template <class Tensor>
void check_weight_shape(const char* fn, const char* name, const Tensor& t, const std::vector<TensorShape>& shapes,
                        const std::string& unused) {
    const bool is_vector = Tensor::ColsAtCompileTime == 1;
    const std::string got = is_vector ? shape_string({t.rows()}) : shape_string({t.rows(), t.cols()});
    const TensorShape* want = nullptr;
    for (const auto& s : shapes)
        if (s.name == name) want = &s;
    if (!want) {
        if (t.size() != 0)
            throw shape_error(std::string(fn) + ": " + name + " must be empty: " + unused + ", got " + got);
        return;
    }
    const bool ok = is_vector ? t.rows() == want->shape[0] : t.rows() == want->shape[0] && t.cols() == want->shape[1];
    if (!ok) {
        const std::string expected = want->shape.size() == 1 ? shape_string({want->shape[0]})
                                                             : shape_string({want->shape[0], want->shape[1]});
        throw shape_error(std::string(fn) + ": " + name + " must have shape " + expected + ", got " + got +
                          (t.size() == 0 ? " (missing: this config uses it)" : ""));
    }
}

/// Checks one parameter's values: every element finite, except that a sink may be −∞ (no
/// sink). A NaN or an infinity in a weight would make every output NaN (or, in an int8 cache,
/// every append fail), and SDPA refuses a NaN or +∞ sink. Throws std::invalid_argument
/// "<fn>: <name>[row, col] must be finite, got inf" (a vector's element as <name>[i]) naming the
/// first such element.
template <class Tensor>
void check_weight_values(const char* fn, const char* name, const Tensor& t) {
    using T = compute_t<typename Tensor::Scalar>;
    const bool sinks = std::string(name) == "sinks";
    const auto* p = t.data();
    for (Index k = 0; k < t.size(); ++k) {
        const T v = static_cast<T>(p[k]);
        if (std::isfinite(v) || (sinks && v == -std::numeric_limits<T>::infinity())) continue;
        // Row-major matrices and vectors alike: element k is row k / cols, column k % cols.
        const Index cols = Tensor::ColsAtCompileTime == 1 ? 1 : t.cols();
        const std::string at = Tensor::ColsAtCompileTime == 1
                                   ? "[" + std::to_string(k) + "]"
                                   : "[" + std::to_string(k / cols) + ", " + std::to_string(k % cols) + "]";
        throw_invalid(fn, name + at,
                      std::string(sinks ? "must be finite or -inf (no sink)" : "must be finite") + ", got " +
                          number_string(double(v)));
    }
}

/// Where head h's d_k query rows and gw gate rows start in a q_proj with a fused gate, for
/// heads in KV groups of `group`: per head [query | gate] (PerHeadInterleaved, Qwen3-Next), or
/// per KV group [queries of its heads | their gates] (GroupedByKV).
inline std::pair<Index, Index> fused_q_proj_rows(GateLayout layout, Index h, Index group, Index dk, Index gw) {
    if (layout == GateLayout::PerHeadInterleaved) return {h * (dk + gw), h * (dk + gw) + dk};
    const Index block = (h / group) * group * (dk + gw), local = h % group;
    return {block + local * dk, block + group * dk + local * gw};
}

}  // namespace detail

/// Parameters the gate adds to one layer (paper Table 1 "Added Param" divided by the layer
/// count): gate weight rows × D plus gate biases, or H·d_v for gate_theta. When the gate is
/// fused into a biased q_proj, its bias rows count too.
inline Index gate_parameter_count(const AttentionConfig& c) {
    const GateSpec& g = c.gate;
    if (!g.enabled()) return 0;
    switch (g.source) {
        case GateSource::InputIndependent: return c.num_heads * c.d_v();
        case GateSource::Query: return c.num_heads * c.d_k() + (g.bias ? c.num_heads : 0);
        case GateSource::Input: break;
    }
    const Index w = gate_width(c);
    const bool fused = g.layout != GateLayout::Separate;
    return w * c.d_model + ((fused ? c.qkv_bias : g.bias) ? w : 0);
}

GATTN_END_ISA_NAMESPACE
