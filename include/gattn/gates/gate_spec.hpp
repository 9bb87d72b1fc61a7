// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The gate specification: where a gate sits, how wide it is, how it combines with its target.
///
/// Source: Qiu et al., "Gated Attention for Large Language Models", arXiv:2505.06708, §2.2 and
/// Tables 1 and 4. A gate computes G = act(X W_gᵀ + b_g) from the layer input X (token-local)
/// and combines it with a target tensor:
///
/// | position | target (before combining)           | elementwise width | headwise width |
/// |----------|-------------------------------------|-------------------|----------------|
/// | G1       | SDPA output, per query head         | H·d_v             | H              |
/// | G2       | value projection, per KV head       | H_kv·d_v          | H_kv           |
/// | G3       | key projection, per KV head         | H_kv·d_k          | H_kv           |
/// | G4       | query projection, per query head    | H·d_k             | H              |
/// | G5       | o_proj output incl. its bias        | D                 | —              |
///
/// G2–G4 gate the projection output; with the layer's q/k norm and RoPE (AttentionConfig), G3 and
/// G4 act after them, on the key and query SDPA reads (before an RMSNorm, a headwise gate would
/// be divided out again). The width above is the
/// number of gate logits (rows of gate_proj.weight). Valid combinations (anything else throws
/// std::invalid_argument from validate_gate_spec):
///
/// | position | granularity  | sharing              | combine                  | source            | layout            |
/// |----------|--------------|----------------------|--------------------------|-------------------|-------------------|
/// | None     | (ignored)    | (ignored)            | (ignored)                | (ignored)         | (ignored)         |
/// | G1       | elem, head   | specific; shared: elem | multiplicative, additive | input             | separate          |
/// | G1       | elem, head   | specific             | multiplicative, additive | input             | interleaved, grouped (no gate bias; q_proj's bias rows carry it) |
/// | G1       | elem         | specific             | multiplicative           | input-independent | separate, no bias |
/// | G1       | head         | specific             | multiplicative           | query             | separate          |
/// | G2       | elem, head   | specific; shared: elem | multiplicative         | input             | separate          |
/// | G3, G4   | elem, head   | specific             | multiplicative           | input             | separate          |
/// | G5       | elem         | specific             | multiplicative, residual mix | input         | separate          |
///
/// Every activation (sigmoid, SiLU, non-sparse sigmoid) is valid in every row.

#include <string>
#include <vector>

#include "gattn/errors.hpp"

namespace gattn {

/// Where the gate is applied (paper Fig. 1 / Table 1).
enum class GatePosition {
    None,  ///< no gate: the ungated baseline
    G1,    ///< after SDPA, before o_proj (the paper's recommended position)
    G2,    ///< after the value projection
    G3,    ///< after the key projection
    G4,    ///< after the query projection
    G5,    ///< after the output projection
};

/// One gate value per element, or one per head broadcast over its head_dim.
enum class GateGranularity { Elementwise, Headwise };

/// Head-specific gates, or one gate vector shared by all heads (logits averaged over heads).
enum class GateSharing { HeadSpecific, HeadShared };

/// How the gate combines with its target Y.
enum class GateCombine {
    Multiplicative,  ///< Y ⊙ g
    Additive,        ///< Y + g (G1 only)
    ResidualMix,     ///< g ⊙ Y + (1 − g) ⊙ X, X the layer input (G5 only)
};

/// Gate activation.
enum class GateActivation {
    Sigmoid,           ///< σ(z) = 1 / (1 + e^−z)
    SiLU,              ///< z · σ(z)
    NonSparseSigmoid,  ///< 0.5 + 0.5 · σ(z) (paper Eq. 9)
};

/// What the gate logits are computed from.
enum class GateSource {
    Input,             ///< z = X W_gᵀ + b_g (token-local, from the layer input)
    InputIndependent,  ///< z = θ, a learned [H, d_v] tensor `gate_theta` (G1 only)
    Query,             ///< z_h = w_h · q_h + b_h from head h's query as SDPA reads it (G1 headwise only)
};

/// Where the gate's weight rows live.
enum class GateLayout {
    Separate,            ///< own gate_proj.weight
    PerHeadInterleaved,  ///< fused into q_proj: per head [d_k query rows | gate rows] (Qwen3-Next)
    GroupedByKV,         ///< fused into q_proj: per KV group [queries of its heads | their gates]
};

/// A gate configuration. The default is "no gate".
struct GateSpec {
    GatePosition position = GatePosition::None;                  ///< where the gate acts (G1–G5), or none
    GateGranularity granularity = GateGranularity::Elementwise;  ///< a gate per feature or per head
    GateSharing sharing = GateSharing::HeadSpecific;             ///< per head, or shared by all heads
    GateCombine combine = GateCombine::Multiplicative;           ///< how the gate meets its target
    GateActivation activation = GateActivation::Sigmoid;         ///< the gate's non-linearity
    GateSource source = GateSource::Input;                       ///< what the gate is computed from
    GateLayout layout = GateLayout::Separate;                    ///< where its weight rows live
    bool bias = false;  ///< gate_proj has a bias b_g (separate layouts only)

    /// Whether there is a gate at all.
    bool enabled() const noexcept { return position != GatePosition::None; }

    /// The paper's recommended gate: G1, elementwise, head-specific, multiplicative sigmoid,
    /// with no bias on gate_proj (set `bias` for one).
    static GateSpec g1_elementwise(GateLayout layout = GateLayout::Separate) {
        GateSpec s;
        s.position = GatePosition::G1;
        s.layout = layout;
        return s;
    }
    /// G1 headwise (one sigmoid per head).
    static GateSpec g1_headwise(GateLayout layout = GateLayout::Separate) {
        GateSpec s = g1_elementwise(layout);
        s.granularity = GateGranularity::Headwise;
        return s;
    }
    /// Every field equal.
    bool operator==(const GateSpec& o) const noexcept {
        return position == o.position && granularity == o.granularity && sharing == o.sharing &&
               combine == o.combine && activation == o.activation && source == o.source &&
               layout == o.layout && bias == o.bias;
    }
    /// Some field differs.
    bool operator!=(const GateSpec& o) const noexcept { return !(*this == o); }
};

}  // namespace gattn

GATTN_BEGIN_ISA_NAMESPACE

/// Names of the gate spec's values as the docs and messages write them ("G1", "elementwise",
/// "head-specific", "multiplicative", "sigmoid", "input", "separate", …).
inline const char* to_string(GatePosition p) {
    switch (p) {
        case GatePosition::None: return "none";
        case GatePosition::G1: return "G1";
        case GatePosition::G2: return "G2";
        case GatePosition::G3: return "G3";
        case GatePosition::G4: return "G4";
        case GatePosition::G5: return "G5";
    }
    return "?";
}
/// The granularity's name, as in messages and docs.
inline const char* to_string(GateGranularity g) {
    return g == GateGranularity::Elementwise ? "elementwise" : "headwise";
}
/// The sharing's name, as in messages and docs.
inline const char* to_string(GateSharing s) {
    return s == GateSharing::HeadSpecific ? "head-specific" : "head-shared";
}
/// The combine's name, as in messages and docs.
inline const char* to_string(GateCombine c) {
    switch (c) {
        case GateCombine::Multiplicative: return "multiplicative";
        case GateCombine::Additive: return "additive";
        case GateCombine::ResidualMix: return "residual-mix";
    }
    return "?";
}
/// The activation's name, as in messages and docs.
inline const char* to_string(GateActivation a) {
    switch (a) {
        case GateActivation::Sigmoid: return "sigmoid";
        case GateActivation::SiLU: return "silu";
        case GateActivation::NonSparseSigmoid: return "non-sparse-sigmoid";
    }
    return "?";
}
/// The source's name, as in messages and docs.
inline const char* to_string(GateSource s) {
    switch (s) {
        case GateSource::Input: return "input";
        case GateSource::InputIndependent: return "input-independent";
        case GateSource::Query: return "query";
    }
    return "?";
}
/// The layout's name, as in messages and docs.
inline const char* to_string(GateLayout l) {
    switch (l) {
        case GateLayout::Separate: return "separate";
        case GateLayout::PerHeadInterleaved: return "per-head-interleaved";
        case GateLayout::GroupedByKV: return "grouped-by-kv";
    }
    return "?";
}

/// "G1 elementwise head-specific multiplicative sigmoid input separate", or "none".
inline std::string describe(const GateSpec& s) {
    if (!s.enabled()) return "none";
    std::string d = std::string(to_string(s.position)) + " " + to_string(s.granularity) + " " +
                    to_string(s.sharing) + " " + to_string(s.combine) + " " +
                    to_string(s.activation) + " " + to_string(s.source) + " " +
                    to_string(s.layout);
    if (s.bias) d += " bias";
    return d;
}

/// Why a spec is invalid, or an empty string when it is valid (see the table in this file).
inline std::string gate_spec_error(const GateSpec& s) {
    if (!s.enabled()) return {};
    const bool g1 = s.position == GatePosition::G1;
    const bool elem = s.granularity == GateGranularity::Elementwise;
    const bool specific = s.sharing == GateSharing::HeadSpecific;
    if (!elem && !specific) return "headwise and head-shared together are not a valid gate";
    if (!specific && !(g1 || s.position == GatePosition::G2))
        return "head-shared gates exist at G1 and G2 only";
    if (s.combine == GateCombine::Additive && !g1) return "additive gates exist at G1 only";
    if (s.combine == GateCombine::ResidualMix && s.position != GatePosition::G5)
        return "the residual-mixing gate exists at G5 only";
    if (s.position == GatePosition::G5 && !elem) return "a G5 gate is elementwise (width d_model)";
    if (s.source == GateSource::InputIndependent) {
        if (!g1 || !elem || !specific || s.combine != GateCombine::Multiplicative)
            return "an input-independent gate is G1 elementwise head-specific multiplicative";
        if (s.layout != GateLayout::Separate || s.bias)
            return "an input-independent gate has only gate_theta (separate layout, no bias)";
    }
    if (s.source == GateSource::Query) {
        if (!g1 || elem || s.combine != GateCombine::Multiplicative)
            return "a query-sourced gate is G1 headwise head-specific multiplicative";
        if (s.layout != GateLayout::Separate) return "a query-sourced gate uses the separate layout";
    }
    if (s.layout != GateLayout::Separate) {
        if (!g1 || s.source != GateSource::Input || !specific)
            return "fused q_proj gate layouts exist for G1 head-specific input gates only";
        if (s.bias)
            return "a fused gate has no separate bias (q_proj's bias rows carry it); set bias = false";
    }
    return {};
}

/// Throws std::invalid_argument("<function>: gate <why>") when the spec is invalid.
inline void validate_gate_spec(const GateSpec& s, const char* function = "gattn::validate_gate_spec") {
    const std::string why = gate_spec_error(s);
    if (!why.empty()) detail::throw_invalid(function, "gate", "(" + describe(s) + "): " + why);
}

/// Every valid GateSpec (the "none" spec once), in a fixed order: the table above, expanded.
inline std::vector<GateSpec> all_valid_gate_specs() {
    std::vector<GateSpec> out{GateSpec{}};
    for (auto pos : {GatePosition::G1, GatePosition::G2, GatePosition::G3, GatePosition::G4,
                     GatePosition::G5})
        for (auto gran : {GateGranularity::Elementwise, GateGranularity::Headwise})
            for (auto share : {GateSharing::HeadSpecific, GateSharing::HeadShared})
                for (auto comb : {GateCombine::Multiplicative, GateCombine::Additive,
                                  GateCombine::ResidualMix})
                    for (auto act : {GateActivation::Sigmoid, GateActivation::SiLU,
                                     GateActivation::NonSparseSigmoid})
                        for (auto src : {GateSource::Input, GateSource::InputIndependent,
                                         GateSource::Query})
                            for (auto lay : {GateLayout::Separate, GateLayout::PerHeadInterleaved,
                                             GateLayout::GroupedByKV})
                                for (bool bias : {false, true}) {
                                    GateSpec s{pos, gran, share, comb, act, src, lay, bias};
                                    if (gate_spec_error(s).empty()) out.push_back(s);
                                }
    return out;
}

GATTN_END_ISA_NAMESPACE
