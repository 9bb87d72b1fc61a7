// Loads the PyTorch-generated layer fixtures in tests/data (see tests/data/README.md).
#pragma once

#include <string>

#include "gattn/gattn.hpp"
#include "gattn/io/safetensors.hpp"

namespace gattn_test {

/// Layer config from a fixture's __metadata__.
inline gattn::AttentionConfig fixture_config(const gattn::SafetensorsFile& f) {
    const auto& m = f.metadata();
    auto num = [&](const char* k) { return static_cast<gattn::Index>(std::stol(m.at(k))); };
    gattn::AttentionConfig c;
    c.d_model = num("d_model");
    c.num_heads = num("num_heads");
    c.num_kv_heads = num("num_kv_heads");
    c.head_dim = num("head_dim");
    c.causal = m.at("causal") == "true";
    c.qkv_bias = c.o_bias = m.at("bias") == "true";
    const std::string gate = m.at("gate");
    const auto layout = m.at("gate_layout") == "per_head_interleaved"
                            ? gattn::GateLayout::PerHeadInterleaved
                            : gattn::GateLayout::Separate;
    if (gate == "g1_elementwise") c.gate = gattn::GateSpec::g1_elementwise(layout);
    if (gate == "g1_headwise") c.gate = gattn::GateSpec::g1_headwise(layout);
    c.gate.bias = m.at("gate_bias") == "true";
    // Attention variants, present only when on.
    auto text = [&](const char* k) { return m.count(k) ? m.at(k) : std::string(); };
    c.sinks = text("sinks") == "true";
    if (!text("sliding_window").empty()) c.sliding_window = num("sliding_window");
    if (!text("logit_softcap").empty()) c.logit_softcap = std::stod(text("logit_softcap"));
    c.alibi = text("alibi") == "true";
    if (text("qk_norm") == "rms") c.qk_norm = gattn::QkNorm::RmsNorm;
    if (text("qk_norm") == "zero_centred_rms") c.qk_norm = gattn::QkNorm::ZeroCentredRmsNorm;
    if (!text("rms_norm_eps").empty()) c.rms_norm_eps = std::stod(text("rms_norm_eps"));
    if (!text("rotary_dim").empty()) {
        c.rotary_dim = num("rotary_dim");
        c.rope_theta = std::stod(text("rope_theta"));
        c.rope_style = text("rope_style") == "gptj" ? gattn::RopeStyle::GptJ : gattn::RopeStyle::NeoX;
    }
    return c;
}

inline std::string fixture_path(const std::string& name) {
    return std::string(GATTN_TEST_DATA_DIR) + "/" + name + ".safetensors";
}

}  // namespace gattn_test
