// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Training a Qwen3-Next full-attention layer. Qwen3NextAttention runs inference over a KV
/// cache; its arithmetic is that of a GatedMultiHeadAttention with the config
/// to_attention_config gives (G1 elementwise sigmoid gate fused into q_proj per head, causal,
/// zero-centred q/k RMSNorm, partial NeoX RoPE, biases and sinks as configured) and the same
/// weights under the same HF names. Training runs through that layer's forward_train and
/// backward (docs/conventions.md, "Backward pass (layer)"), with the token positions in
/// ForwardOptions::positions, and to_qwen3_next_weights turns the gradients back into
/// Qwen3NextAttentionWeights:
///
///     const auto config = gattn::to_attention_config(qwen_config);
///     const gattn::GatedMultiHeadAttention<float> layer(config, gattn::to_attention_weights(w));
///     layer.forward_train(x, batch, y, saved, options);   // y = Qwen3NextAttention's prefill
///     layer.backward(x, saved, d_y, grads, d_x);
///     const auto d_w = gattn::to_qwen3_next_weights(grads);
///
/// One difference: Qwen3NextAttention writes 0 to the output rows of padding slots, where the
/// layer writes what it makes of U = 0 (o_proj's bias); give such rows a zero upstream gradient.

#include "gattn/layers/gated_multi_head_attention.hpp"
#include "gattn/models/qwen3_next_attention.hpp"

GATTN_BEGIN_ISA_NAMESPACE

/// The AttentionConfig of the layer Qwen3NextAttention computes.
/// \throws std::invalid_argument for an invalid config (validate_qwen3_next_config).
inline AttentionConfig to_attention_config(const Qwen3NextConfig& q) {
    validate_qwen3_next_config(q, "gattn::to_attention_config");
    AttentionConfig c;
    c.d_model = q.hidden_size;
    c.num_heads = q.num_attention_heads;
    c.num_kv_heads = q.num_key_value_heads;
    c.head_dim = q.head_dim;
    c.qkv_bias = c.o_bias = q.attention_bias;
    if (q.attn_output_gate) c.gate = GateSpec::g1_elementwise(GateLayout::PerHeadInterleaved);
    c.causal = true;
    c.sinks = q.attention_sinks;
    c.qk_norm = QkNorm::ZeroCentredRmsNorm;
    c.rms_norm_eps = q.rms_norm_eps;
    c.rotary_dim = q.rotary_dim();
    c.rope_theta = q.rope_theta;
    c.rope_style = RopeStyle::NeoX;
    return c;
}

/// Qwen3-Next weights as AttentionWeights: every tensor under its own HF name (q_proj keeps its
/// per-head [query | gate] rows, the PerHeadInterleaved layout).
template <class Scalar>
AttentionWeights<Scalar> to_attention_weights(const Qwen3NextAttentionWeights<Scalar>& w) {
    AttentionWeights<Scalar> a;
    a.q_proj_weight = w.q_proj_weight;
    a.k_proj_weight = w.k_proj_weight;
    a.v_proj_weight = w.v_proj_weight;
    a.o_proj_weight = w.o_proj_weight;
    a.q_proj_bias = w.q_proj_bias;
    a.k_proj_bias = w.k_proj_bias;
    a.v_proj_bias = w.v_proj_bias;
    a.o_proj_bias = w.o_proj_bias;
    a.sinks = w.sinks;
    a.q_norm_weight = w.q_norm_weight;
    a.k_norm_weight = w.k_norm_weight;
    return a;
}

/// The tensors of AttentionWeights that a Qwen3-Next layer has (e.g. the gradients backward
/// gave for a layer of to_attention_config), under the same HF names; the gate_proj and
/// gate_theta members, which such a layer leaves empty, are not carried over.
template <class Scalar>
Qwen3NextAttentionWeights<Scalar> to_qwen3_next_weights(const AttentionWeights<Scalar>& a) {
    Qwen3NextAttentionWeights<Scalar> w;
    w.q_proj_weight = a.q_proj_weight;
    w.k_proj_weight = a.k_proj_weight;
    w.v_proj_weight = a.v_proj_weight;
    w.o_proj_weight = a.o_proj_weight;
    w.q_proj_bias = a.q_proj_bias;
    w.k_proj_bias = a.k_proj_bias;
    w.v_proj_bias = a.v_proj_bias;
    w.o_proj_bias = a.o_proj_bias;
    w.sinks = a.sinks;
    w.q_norm_weight = a.q_norm_weight;
    w.k_norm_weight = a.k_norm_weight;
    return w;
}

GATTN_END_ISA_NAMESPACE
