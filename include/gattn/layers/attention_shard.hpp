// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// One head-parallel shard of a GatedMultiHeadAttention layer: the config and weights of its
/// query heads and the KV heads they read (head_shard), cut from the whole layer's weights in
/// memory (shard_attention) or read block by block from a checkpoint (load_attention_shard in
/// io/safetensors.hpp), so that a rank never holds the whole layer. Free of MPI; the ranks run
/// their shards in gattn/dist/head_parallel.hpp (HeadParallelAttention).

#include <string>
#include <utility>

#include "gattn/layers/attention_config.hpp"
#include "gattn/layers/gated_multi_head_attention.hpp"
#include "gattn/layers/head_shard.hpp"

GATTN_BEGIN_ISA_NAMESPACE

namespace detail {

/// The shard's config (see shard_attention). \throws std::invalid_argument for ALiBi or a
/// shard outside the config's heads.
inline AttentionConfig shard_attention_config(const AttentionConfig& c, const HeadShard& s, const char* fn) {
    if (c.alibi)
        throw_invalid(fn, "config.alibi",
                      "is not supported across ranks: ALiBi's slope of a head depends on its index among all "
                      "num_heads heads");
    check_shard_heads(fn, s, c.num_heads, c.num_kv_heads);
    AttentionConfig sc = c;
    sc.num_heads = s.num_heads;
    sc.num_kv_heads = s.num_kv_heads;
    sc.o_bias = c.o_bias && s.first_head == 0;
    if (c.gate.position == GatePosition::G5) sc.gate = GateSpec{};
    return sc;
}

/// The shard's config and weights from `read(name, first_row, rows, first_col, cols)`, which
/// returns that block of the whole layer's weight `name` as a RowMatrix<Scalar> (a vector as
/// [elements, 1], its elements [first_row, first_row + rows)). See shard_attention.
template <class Scalar, class Read>
std::pair<AttentionConfig, AttentionWeights<Scalar>> shard_attention_from(const AttentionConfig& c, const HeadShard& s,
                                                                          Read&& read, const char* fn) {
    const AttentionConfig sc = shard_attention_config(c, s, fn);
    const Index D = c.d_model, H = c.num_heads, Hkv = c.num_kv_heads, dk = c.d_k(), dv = c.d_v();
    const GateSpec& g = c.gate;
    const GateSpec& sg = sc.gate;
    auto vector = [](const RowMatrix<Scalar>& m) {
        return Vector<Scalar>(Eigen::Map<const Vector<Scalar>>(m.data(), m.size()));
    };
    // Rows [first·width, (first + count)·width) of a gate weight, or for a head-shared gate
    // `count` copies of the mean of all `total` blocks of `width` rows.
    auto gate_rows = [&](const char* name, Index first, Index count, Index width, Index total, Index cols) {
        if (g.sharing != GateSharing::HeadShared) return read(name, first * width, count * width, 0, cols);
        const RowMatrix<double> all = read(name, 0, total * width, 0, cols).template cast<double>();
        RowMatrix<double> mean = RowMatrix<double>::Zero(width, cols);
        for (Index h = 0; h < total; ++h) mean += all.middleRows(h * width, width);
        mean /= double(total);
        return RowMatrix<Scalar>(mean.template cast<Scalar>().replicate(count, 1));
    };

    AttentionWeights<Scalar> sw;
    const bool input_gate = sg.enabled() && sg.source == GateSource::Input;
    const bool fused = input_gate && sg.layout != GateLayout::Separate;
    if (fused) {
        // Each head's query rows and gw gate rows, from where the whole layout keeps them to
        // where the shard's layout does.
        const Index gw = gate_width(c) / H;
        sw.q_proj_weight.resize(s.num_heads * (dk + gw), D);
        if (c.qkv_bias) sw.q_proj_bias.resize(sw.q_proj_weight.rows());
        for (Index h = 0; h < s.num_heads; ++h) {
            const auto [q_src, g_src] = fused_q_proj_rows(g.layout, s.first_head + h, H / Hkv, dk, gw);
            const auto [q_dst, g_dst] = fused_q_proj_rows(g.layout, h, s.num_heads / s.num_kv_heads, dk, gw);
            sw.q_proj_weight.middleRows(q_dst, dk) = read("q_proj.weight", q_src, dk, 0, D);
            sw.q_proj_weight.middleRows(g_dst, gw) = read("q_proj.weight", g_src, gw, 0, D);
            if (c.qkv_bias) {
                sw.q_proj_bias.segment(q_dst, dk) = vector(read("q_proj.bias", q_src, dk, 0, 1));
                sw.q_proj_bias.segment(g_dst, gw) = vector(read("q_proj.bias", g_src, gw, 0, 1));
            }
        }
    } else {
        sw.q_proj_weight = read("q_proj.weight", s.first_head * dk, s.num_heads * dk, 0, D);
        if (c.qkv_bias) sw.q_proj_bias = vector(read("q_proj.bias", s.first_head * dk, s.num_heads * dk, 0, 1));
    }
    sw.k_proj_weight = read("k_proj.weight", s.first_kv_head * dk, s.num_kv_heads * dk, 0, D);
    sw.v_proj_weight = read("v_proj.weight", s.first_kv_head * dv, s.num_kv_heads * dv, 0, D);
    sw.o_proj_weight = read("o_proj.weight", 0, D, s.first_head * dv, s.num_heads * dv);
    if (c.qkv_bias) {
        sw.k_proj_bias = vector(read("k_proj.bias", s.first_kv_head * dk, s.num_kv_heads * dk, 0, 1));
        sw.v_proj_bias = vector(read("v_proj.bias", s.first_kv_head * dv, s.num_kv_heads * dv, 0, 1));
    }
    if (sc.o_bias) sw.o_proj_bias = vector(read("o_proj.bias", 0, D, 0, 1));
    if (c.sinks) sw.sinks = vector(read("sinks", s.first_head, s.num_heads, 0, 1));
    if (c.qk_norm != QkNorm::None) {
        sw.q_norm_weight = vector(read("q_norm.weight", 0, dk, 0, 1));
        sw.k_norm_weight = vector(read("k_norm.weight", 0, dk, 0, 1));
    }
    if (g.position == GatePosition::G5) {  // whole: every rank gates the summed output
        sw.gate_proj_weight = read("gate_proj.weight", 0, D, 0, D);
        if (g.bias) sw.gate_proj_bias = vector(read("gate_proj.bias", 0, D, 0, 1));
    } else if (sg.enabled() && !fused) {
        if (sg.source == GateSource::Input) {
            // Gate rows per head: d_v (G1), d_k (G4), per KV head: d_v (G2), d_k (G3); one headwise.
            const bool elem = sg.granularity == GateGranularity::Elementwise;
            const bool kv = sg.position == GatePosition::G2 || sg.position == GatePosition::G3;
            const Index width = !elem                                                                  ? 1
                                : (sg.position == GatePosition::G1 || sg.position == GatePosition::G2) ? dv
                                                                                                       : dk;
            const Index first = kv ? s.first_kv_head : s.first_head, count = kv ? s.num_kv_heads : s.num_heads;
            sw.gate_proj_weight = gate_rows("gate_proj.weight", first, count, width, kv ? Hkv : H, D);
            if (sg.bias) sw.gate_proj_bias = vector(gate_rows("gate_proj.bias", first, count, width, kv ? Hkv : H, 1));
        } else if (sg.source == GateSource::Query) {
            sw.gate_proj_weight = read("gate_proj.weight", s.first_head, s.num_heads, 0, dk);
            if (sg.bias) sw.gate_proj_bias = vector(read("gate_proj.bias", s.first_head, s.num_heads, 0, 1));
        } else {
            sw.gate_theta = read("gate_theta", s.first_head, s.num_heads, 0, dv);
        }
    }
    return {sc, sw};
}

/// Throws std::invalid_argument from `fn` when `given` is not `expected`, this rank's shard.
inline void check_rank_shard(const char* fn, const HeadShard& expected, const HeadShard& given) {
    auto text = [](const HeadShard& h) {
        return "query heads from " + std::to_string(h.first_head) + " (" + std::to_string(h.num_heads) +
               "), KV heads from " + std::to_string(h.first_kv_head) + " (" + std::to_string(h.num_kv_heads) + ")";
    };
    if (given.first_head != expected.first_head || given.num_heads != expected.num_heads ||
        given.first_kv_head != expected.first_kv_head || given.num_kv_heads != expected.num_kv_heads)
        throw_invalid(fn, "shard", "must be this rank's heads (shard_of): " + text(expected) + ", got " + text(given));
}

}  // namespace detail

/// The config and weights of one head-parallel shard of a GatedMultiHeadAttention layer: the
/// shard's query heads and the KV heads they read; q_proj's rows of its query heads (with a
/// fused gate, each head's query and gate rows, rearranged into the shard's own per-head or
/// per-KV-group layout), k_proj and v_proj's rows of its KV heads, o_proj's columns of its query
/// heads; the gate's rows of its heads (G1, G4) or KV heads (G2, G3), gate_theta and a query
/// gate's rows of its heads; a head-shared gate's logits, which average over all heads, from
/// the average of every head's gate rows (equal up to rounding); sinks of its heads, q_norm and
/// k_norm whole; o_proj's bias only in the shard with first_head 0 (the shards' outputs are
/// summed). A G5 gate acts on the summed output: it is left out of the shard's config, and its
/// gate_proj comes whole (HeadParallelAttention applies it; drop it to build the shard's
/// GatedMultiHeadAttention alone).
/// \throws std::invalid_argument for an invalid config (validate_config), ALiBi (its slopes
///         depend on a head's index among all H heads), a shard head_shard could not give, or
///         a weight holding NaN or ±∞ anywhere in the whole layer (as the layer's constructor);
///         shape_error for weights of the wrong shapes (as the layer's constructor).
template <class Scalar>
std::pair<AttentionConfig, AttentionWeights<Scalar>> shard_attention(const AttentionConfig& c,
                                                                     const AttentionWeights<Scalar>& w,
                                                                     const HeadShard& s) {
    constexpr const char* fn = "gattn::shard_attention";
    validate_config(c, fn);
    const auto shapes = expected_weight_shapes(c);
    const std::string unused = "this config (gate " + describe(c.gate) + ") does not use it";
    w.for_each([&](const char* name, const auto& t) { detail::check_weight_shape(fn, name, t, shapes, unused); });
    // The whole layer's values, so that every shard (rank) refuses the same weights.
    w.for_each([&](const char* name, const auto& t) { detail::check_weight_values(fn, name, t); });
    auto read = [&](const std::string& name, Index first_row, Index rows, Index first_col, Index cols) {
        RowMatrix<Scalar> block;
        w.for_each([&](const char* n, const auto& t) {
            if (name != n) return;
            if constexpr (std::decay_t<decltype(t)>::ColsAtCompileTime == 1)
                block = t.segment(first_row, rows);
            else
                block = t.block(first_row, first_col, rows, cols);
        });
        return block;
    };
    return detail::shard_attention_from<Scalar>(c, s, read, fn);
}

GATTN_END_ISA_NAMESPACE
