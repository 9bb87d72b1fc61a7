// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The full-attention layer of Qwen3-Next and Qwen3.5 (G1 elementwise sigmoid gate), matching
/// Hugging Face transformers' Qwen3NextAttention, with a KV cache for prefill and decoding.
///
/// For new tokens X [B·N, D] at positions p (source: transformers models/qwen3_next):
///   [q | gate] = q_proj(X) split per head (PerHeadInterleaved: rows [h·2d, h·2d + d) query
///   head h, the next d its gate); q = RoPE(q_norm(q)), k = RoPE(k_norm(k_proj(X))),
///   v = v_proj(X); q_norm/k_norm are zero-centred RMSNorms over head_dim, x̂·(1 + w);
///   RoPE is NeoX rotate_half on the first head_dim·partial_rotary_factor dims;
///   U = SDPA(q, cache k, cache v), causal, scale 1/√head_dim, GQA ⌊h / (H / H_kv)⌋;
///   Y = o_proj(U ⊙ σ(gate)).
/// The gate is the raw q_proj output (before norm and RoPE) and is never cached; the cache holds
/// k after norm and RoPE, and v as it enters SDPA. With attn_output_gate = false (the ungated
/// baseline of the same architecture, as in vLLM's Qwen3-Next config flag) q_proj has H·d rows
/// and Y = o_proj(U). With attention_sinks (a gattn extension, for comparing the gate with
/// gpt-oss's answer to the attention sink) each query head h has a learned logit sinks[h] that
/// joins its softmax denominator without a value (SdpaOptions::sinks).

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gattn/cache/kv_cache.hpp"
#include "gattn/cache/paged_kv_pool.hpp"
#include "gattn/gates/gate_apply.hpp"
#include "gattn/layers/attention_config.hpp"
#include "gattn/layers/call_scratch.hpp"
#include "gattn/layers/head_shard.hpp"
#include "gattn/ops/linear.hpp"
#include "gattn/ops/packed_linear.hpp"
#include "gattn/ops/paged_sdpa.hpp"
#include "gattn/ops/rms_norm.hpp"
#include "gattn/ops/rope.hpp"
#include "gattn/ops/sdpa.hpp"

GATTN_BEGIN_ISA_NAMESPACE

/// The attention part of a Qwen3-Next / Qwen3.5 config.json. (In the instruction-set namespace:
/// rotary_dim() is floating-point code, which the instruction set changes.)
struct Qwen3NextConfig {
    Index hidden_size = 0;                ///< D
    Index num_attention_heads = 0;        ///< H
    Index num_key_value_heads = 0;        ///< H_kv
    Index head_dim = 0;                   ///< d
    double rms_norm_eps = 1e-6;           ///< ε of q_norm and k_norm
    double rope_theta = 10000.0;          ///< RoPE base (θ_i = rope_theta^(−2i/rotary_dim))
    double partial_rotary_factor = 0.25;  ///< fraction of head_dim that RoPE rotates
    bool attention_bias = false;          ///< q/k/v/o projections have biases
    bool attn_output_gate = true;         ///< false: no gate rows in q_proj, Y = o_proj(U)
    /// Learned attention sinks as in gpt-oss: weight "sinks" [H], one logit per query head in
    /// each softmax denominator (config.json key "attention_sinks", a gattn extension).
    bool attention_sinks = false;

    /// Features per head that RoPE rotates: head_dim · partial_rotary_factor.
    Index rotary_dim() const noexcept { return static_cast<Index>(double(head_dim) * partial_rotary_factor); }
};

/// Throws std::invalid_argument naming the field when the config cannot describe a layer.
inline void validate_qwen3_next_config(const Qwen3NextConfig& c, const char* fn) {
    auto positive = [&](Index v, const char* name) {
        if (v < 1 || v > (Index(1) << 24))
            detail::throw_invalid(fn, std::string("config.") + name, "must be in [1, 2^24], got " + std::to_string(v));
    };
    positive(c.hidden_size, "hidden_size");
    positive(c.num_attention_heads, "num_attention_heads");
    positive(c.num_key_value_heads, "num_key_value_heads");
    positive(c.head_dim, "head_dim");
    if (c.num_attention_heads % c.num_key_value_heads != 0)
        detail::throw_invalid(fn, "config.num_key_value_heads",
                              "must divide num_attention_heads = " + std::to_string(c.num_attention_heads) + ", got " +
                                  std::to_string(c.num_key_value_heads));
    // The factor's range first: rotary_dim() of a factor far above 1 would not fit an Index.
    if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1))
        detail::throw_invalid(fn, "config.partial_rotary_factor",
                              "must be in (0, 1], got " + detail::number_string(c.partial_rotary_factor));
    const Index r = c.rotary_dim();
    if (r % 2 != 0 || r < 2)
        detail::throw_invalid(fn, "config.partial_rotary_factor",
                              "must give an even rotary_dim in [2, head_dim], got " + std::to_string(r));
    if (!(c.rope_theta > 0) || !std::isfinite(c.rope_theta))
        detail::throw_invalid(fn, "config.rope_theta",
                              "must be finite and > 0, got " + detail::number_string(c.rope_theta));
    if (!(c.rms_norm_eps >= 0) || !std::isfinite(c.rms_norm_eps))
        detail::throw_invalid(fn, "config.rms_norm_eps",
                              "must be finite and >= 0, got " + detail::number_string(c.rms_norm_eps));
}

/// Weights of one layer, HF names (model.layers.N.self_attn.*), nn.Linear layout.
template <class Scalar>
struct Qwen3NextAttentionWeights {
    RowMatrix<Scalar> q_proj_weight;  ///< [H·2d, D], query and gate per head ([H·d, D] ungated)
    RowMatrix<Scalar> k_proj_weight;  ///< [H_kv·d, D]
    RowMatrix<Scalar> v_proj_weight;  ///< [H_kv·d, D]
    RowMatrix<Scalar> o_proj_weight;  ///< [D, H·d]
    Vector<Scalar> q_norm_weight;     ///< [d]
    Vector<Scalar> k_norm_weight;     ///< [d]
    Vector<Scalar> q_proj_bias;       ///< [rows of q_proj_weight] when attention_bias, else empty
    Vector<Scalar> k_proj_bias;       ///< [H_kv·d] when attention_bias, else empty
    Vector<Scalar> v_proj_bias;       ///< [H_kv·d] when attention_bias, else empty
    Vector<Scalar> o_proj_bias;       ///< [D] when attention_bias, else empty
    Vector<Scalar> sinks;             ///< [H] sink logits when attention_sinks, else empty

    /// Visits (HF name, pointer) for every member.
    template <class F>
    void for_each(F&& f) {
        f("q_proj.weight", &q_proj_weight);
        f("k_proj.weight", &k_proj_weight);
        f("v_proj.weight", &v_proj_weight);
        f("o_proj.weight", &o_proj_weight);
        f("q_norm.weight", &q_norm_weight);
        f("k_norm.weight", &k_norm_weight);
        f("q_proj.bias", &q_proj_bias);
        f("k_proj.bias", &k_proj_bias);
        f("v_proj.bias", &v_proj_bias);
        f("o_proj.bias", &o_proj_bias);
        f("sinks", &sinks);
    }
    /// Visits (HF name, const reference) for every member.
    template <class F>
    void for_each(F&& f) const {
        const_cast<Qwen3NextAttentionWeights*>(this)->for_each(
            [&](const char* name, auto* p) { f(name, static_cast<const decltype(*p)&>(*p)); });
    }
    /// The same weights converted to To (rounded to nearest even when To is narrower), e.g.
    /// float weights to bf16 for a Qwen3NextAttention<gattn::bfloat16>.
    template <class To>
    Qwen3NextAttentionWeights<To> cast() const {
        Qwen3NextAttentionWeights<To> out;
        out.q_proj_weight = q_proj_weight.template cast<To>();
        out.k_proj_weight = k_proj_weight.template cast<To>();
        out.v_proj_weight = v_proj_weight.template cast<To>();
        out.o_proj_weight = o_proj_weight.template cast<To>();
        out.q_norm_weight = q_norm_weight.template cast<To>();
        out.k_norm_weight = k_norm_weight.template cast<To>();
        out.q_proj_bias = q_proj_bias.template cast<To>();
        out.k_proj_bias = k_proj_bias.template cast<To>();
        out.v_proj_bias = v_proj_bias.template cast<To>();
        out.o_proj_bias = o_proj_bias.template cast<To>();
        out.sinks = sinks.template cast<To>();
        return out;
    }
};

/// Shapes the layer expects, by HF name (biases only with attention_bias, sinks only with
/// attention_sinks).
inline std::vector<TensorShape> qwen3_next_weight_shapes(const Qwen3NextConfig& c) {
    const Index D = c.hidden_size, H = c.num_attention_heads, Hkv = c.num_key_value_heads, d = c.head_dim;
    const Index q_rows = c.attn_output_gate ? 2 * H * d : H * d;
    std::vector<TensorShape> s{{"q_proj.weight", {q_rows, D}},  {"k_proj.weight", {Hkv * d, D}},
                               {"v_proj.weight", {Hkv * d, D}}, {"o_proj.weight", {D, H * d}},
                               {"q_norm.weight", {d}},          {"k_norm.weight", {d}}};
    if (c.attention_bias) {
        s.push_back({"q_proj.bias", {q_rows}});
        s.push_back({"k_proj.bias", {Hkv * d}});
        s.push_back({"v_proj.bias", {Hkv * d}});
        s.push_back({"o_proj.bias", {D}});
    }
    if (c.attention_sinks) s.push_back({"sinks", {H}});
    return s;
}

/// One shard's part of a Qwen3-Next layer (head parallelism): its config (the shard's heads)
/// and, per HF weight name the config uses, the block it holds (WeightBlock): q_proj's rows of
/// its query heads (each head's query and gate rows together), k_proj and v_proj's rows of its
/// KV heads, o_proj's columns of its query heads, the sinks of its heads, q_norm and k_norm
/// whole; o_proj's bias only in the shard with first_head 0, zeros elsewhere (the shares are
/// summed). shard_qwen3_next cuts weights in memory with it, load_qwen3_next_attention_shard
/// reads the blocks from a checkpoint.
/// \throws std::invalid_argument for an invalid config (validate_qwen3_next_config) or a shard
///         head_shard could not give (detail::check_shard_heads).
inline std::pair<Qwen3NextConfig, std::map<std::string, WeightBlock>> qwen3_next_shard(const Qwen3NextConfig& c,
                                                                                       const HeadShard& s) {
    constexpr const char* fn = "gattn::qwen3_next_shard";
    validate_qwen3_next_config(c, fn);
    detail::check_shard_heads(fn, s, c.num_attention_heads, c.num_key_value_heads);
    const Index d = c.head_dim, q_stride = c.attn_output_gate ? 2 * d : d;
    std::map<std::string, WeightBlock> blocks;
    for (const TensorShape& t : qwen3_next_weight_shapes(c))  // whole, unless cut below
        blocks[t.name] = WeightBlock{0, t.shape[0], 0, t.shape.size() > 1 ? t.shape[1] : 1, false};
    auto rows = [&](const char* name, Index first, Index count) {
        auto it = blocks.find(name);
        if (it != blocks.end()) it->second.first_row = first, it->second.rows = count;
    };
    rows("q_proj.weight", s.first_head * q_stride, s.num_heads * q_stride);
    rows("q_proj.bias", s.first_head * q_stride, s.num_heads * q_stride);
    for (const char* name : {"k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"})
        rows(name, s.first_kv_head * d, s.num_kv_heads * d);
    rows("sinks", s.first_head, s.num_heads);
    WeightBlock& o = blocks.at("o_proj.weight");
    o.first_col = s.first_head * d;
    o.cols = s.num_heads * d;
    if (blocks.count("o_proj.bias")) blocks["o_proj.bias"].zero = s.first_head != 0;
    Qwen3NextConfig sc = c;
    sc.num_attention_heads = s.num_heads;
    sc.num_key_value_heads = s.num_kv_heads;
    return {sc, blocks};
}

/// Why a q_proj.weight of `rows` rows does not fit `c`, when the rows match another layout:
/// appended to the shape error by the constructor and the checkpoint loader; "" otherwise.
inline std::string qwen3_next_q_proj_hint(const Qwen3NextConfig& c, Index rows) {
    const Index H = c.num_attention_heads, d = c.head_dim;
    if (c.attn_output_gate && rows == H * d + H)
        return " (a headwise gate checkpoint: H·d + H rows; this layer has an elementwise gate, 2·H·d rows)";
    if (c.attn_output_gate && rows == H * d)
        return " (no gate rows: Qwen3-Next's q_proj holds each head's d query rows followed by its d gate "
               "rows; a layer without a gate has attn_output_gate = false)";
    if (!c.attn_output_gate && rows == 2 * H * d)
        return " (query and gate rows: this config has attn_output_gate = false)";
    return "";
}

/// Qwen3-Next gated full attention with a KV cache.
/// Scalar: the weights' and the cache's type, float, double, or 16-bit (gattn::bfloat16 as the
/// checkpoints ship, gattn::half): then the projections run in PackedLinear, Q, K and V are
/// rounded once to Scalar after q/k norm and RoPE (which run in float), and the gate, U, norms
/// and optional outputs are float, as in GatedMultiHeadAttention. Activation: the type of x and
/// out, the compute type (default) or Scalar.
template <class Scalar, class Activation = compute_t<Scalar>>
class Qwen3NextAttention {
    static_assert(is_supported_storage_v<Scalar>, "GATTN_SCALAR_MUST_BE_FLOAT_DOUBLE_BFLOAT16_OR_HALF");
    static_assert(std::is_same_v<Activation, compute_t<Scalar>> || std::is_same_v<Activation, Scalar>,
                  "GATTN_ACTIVATION_MUST_BE_THE_COMPUTE_TYPE_OR_THE_STORAGE_TYPE");
    using T = compute_t<Scalar>;

public:
    /// Everything forward would refuse about the config and the weights is refused here: the
    /// calls then only check their own arguments.
    /// \throws std::invalid_argument for an invalid config and for a weight holding NaN or ±∞
    ///         (a sink may be −∞, no sink; the message names the HF parameter and the element);
    ///         shape_error for a weight of the wrong shape, a bias given while attention_bias is
    ///         false or sinks while attention_sinks is false (naming the HF parameter, and for
    ///         q_proj the layout its rows fit, see qwen3_next_q_proj_hint: a headwise gate's
    ///         H·d + H rows, no gate rows, or gate rows in an ungated config).
    Qwen3NextAttention(const Qwen3NextConfig& config, const Qwen3NextAttentionWeights<Scalar>& w) : m_config(config) {
        constexpr const char* fn = "gattn::Qwen3NextAttention";
        gattn::detail::warn_once_if_slow_build();
        validate_qwen3_next_config(config, fn);
        const auto shapes = qwen3_next_weight_shapes(config);
        w.for_each([&](const char* name, const auto& t) {
            try {
                gattn::detail::check_weight_shape(fn, name, t, shapes,
                                                  std::string(name) == "sinks" ? "attention_sinks is false"
                                                                               : "attention_bias is false");
            } catch (const shape_error& e) {
                if (std::string(name) != "q_proj.weight") throw;
                throw shape_error(e.what() + qwen3_next_q_proj_hint(config, t.rows()));
            }
        });
        w.for_each([&](const char* name, const auto& t) { gattn::detail::check_weight_values(fn, name, t); });
        // One input GEMM [Q | gate | K | V]: q_proj's per-head interleaved rows are reordered here.
        const Index D = config.hidden_size, H = config.num_attention_heads, Hkv = config.num_key_value_heads;
        const Index d = config.head_dim, G = gate_width();
        const Index q_stride = config.attn_output_gate ? 2 * d : d;  // q_proj rows per head
        RowMatrix<Scalar> w_in(H * d + G + 2 * Hkv * d, D);
        Vector<T> bias = Vector<T>::Zero(w_in.rows());
        for (Index h = 0; h < H; ++h) {
            w_in.middleRows(h * d, d) = w.q_proj_weight.middleRows(h * q_stride, d);
            if (config.attention_bias)
                bias.segment(h * d, d) = w.q_proj_bias.segment(h * q_stride, d).template cast<T>();
            if (G == 0) continue;
            w_in.middleRows(H * d + h * d, d) = w.q_proj_weight.middleRows(h * q_stride + d, d);
            if (config.attention_bias)
                bias.segment(H * d + h * d, d) = w.q_proj_bias.segment(h * q_stride + d, d).template cast<T>();
        }
        w_in.middleRows(H * d + G, Hkv * d) = w.k_proj_weight;
        w_in.middleRows(H * d + G + Hkv * d, Hkv * d) = w.v_proj_weight;
        if (config.attention_bias) {
            bias.segment(H * d + G, Hkv * d) = w.k_proj_bias.template cast<T>();
            bias.segment(H * d + G + Hkv * d, Hkv * d) = w.v_proj_bias.template cast<T>();
        }
        m_in = Projection<Scalar>(std::move(w_in), config.attention_bias ? bias : Vector<T>());
        m_o = Projection<Scalar>(w.o_proj_weight,
                                 config.attention_bias ? Vector<T>(w.o_proj_bias.template cast<T>()) : Vector<T>());
        m_q_norm = w.q_norm_weight.template cast<T>();
        m_k_norm = w.k_norm_weight.template cast<T>();
        if (config.attention_sinks) {
            const Vector<T> sinks = w.sinks.template cast<T>();
            m_sinks.assign(sinks.data(), sinks.data() + sinks.size());
        }
        gattn::detail::validate_sdpa_options(fn, sdpa_options({}, {}), H);
    }

    /// The configuration the layer was built with.
    const Qwen3NextConfig& config() const noexcept { return m_config; }
    /// This layer's identity: the caches of make_cache carry it and no other layer takes them.
    LayerId layer_id() const noexcept { return m_id; }

    /// Bytes of the weights the layer holds (projections as packed or kept, biases, norm
    /// weights): for bf16 weights about the checkpoint's bytes, never a widened copy.
    std::size_t weight_bytes() const noexcept {
        return m_in.bytes() + m_o.bytes() +
               sizeof(T) * (static_cast<std::size_t>(m_q_norm.size() + m_k_norm.size()) + m_sinks.size());
    }

    /// Gate columns per token: H·d with the output gate, 0 without.
    Index gate_width() const noexcept {
        return m_config.attn_output_gate ? m_config.num_attention_heads * m_config.head_dim : 0;
    }

    /// A paged pool of this layer's KV heads and head_dim (cache/paged_kv_pool.hpp): num_pages
    /// pages of page_size tokens in PoolScalar (the caches make_cache takes).
    /// \throws as the PagedKVPool constructor.
    template <class PoolScalar = Scalar>
    PagedKVPool<PoolScalar> make_pool(Index num_pages, Index page_size) const {
        static_assert(takes_cache_v<PoolScalar>, "GATTN_CACHE_MUST_BE_THE_LAYER_SCALAR_OR_INT8_WITH_FLOAT_COMPUTE");
        return PagedKVPool<PoolScalar>(num_pages, page_size, m_config.num_key_value_heads, m_config.head_dim);
    }

    /// A cache sized for this layer: `batch` sequences of up to `capacity` tokens. CacheScalar:
    /// the layer's Scalar, or std::int8_t (float compute: Scalar float or 16-bit) for an int8
    /// cache (keys and values quantized as they are appended, ops/int8_rows.hpp).
    /// \throws std::invalid_argument as the KVCache constructor does (a size < 1, an overflow).
    template <class CacheScalar = Scalar>
    KVCache<CacheScalar> make_cache(Index batch, Index capacity) const {
        static_assert(takes_cache_v<CacheScalar>, "GATTN_CACHE_MUST_BE_THE_LAYER_SCALAR_OR_INT8_WITH_FLOAT_COMPUTE");
        return KVCache<CacheScalar>(batch, capacity, m_config.num_key_value_heads, m_config.head_dim, 0, m_id);
    }

    /// Runs new tokens through the layer and appends their keys and values to the cache.
    /// \param x         [B·N, D]: N new token slots per sequence (B = cache.batch()).
    /// \param positions [B·N] position of each token (RoPE), e.g. cache.lengths()[b] + t.
    /// \param cache     the sequences' cache, made by this layer's make_cache (or a KVCache of
    ///                  its heads made without an owner); counts[b] tokens are appended to
    ///                  sequence b. An int8 cache (KVCache<std::int8_t>, float compute) holds
    ///                  their keys and values quantized, and SDPA reads the codes in place.
    /// \param out       [B·N, D], written; rows of padding slots (t ≥ counts[b]) are 0.
    /// \param counts    new tokens per sequence (≤ N; padding at the end); empty = N each.
    /// \param gate_scores optional [B·N, H·d] σ(gate) for statistics (paper §4.2 gate scores);
    ///        resized to [B·N, 0] when attn_output_gate is false.
    /// \param first_key_probability optional [B·N, H]: attention each query puts on its
    ///        sequence's first cached token (paper §4.3 first-token attention); 0 on padding rows.
    /// Prefill of N tokens equals N single-token steps: each token attends, causally, to its
    /// sequence's cached tokens and the new tokens before it (bottom-right alignment per sequence).
    /// \throws shape_error / std::invalid_argument for bad shapes, counts, a cache of other heads,
    ///         a cache made by another layer's make_cache or a full cache, for out overlapping x
    ///         or with rows that overlap, x or out sharing an element with the cache's storage,
    ///         and for an optional output that holds x or out or is the other optional output;
    ///         std::invalid_argument from KVCache::append for a new token's key or value that is
    ///         NaN or ±∞ in an int8 cache. Everything, the attention call over the cache as the
    ///         append will leave it included, is checked before the first write: nothing is
    ///         written (cache included) when it throws.
    template <class CacheScalar>
    void forward(ConstMatrixRef<Activation> x, const std::vector<Index>& positions, KVCache<CacheScalar>& cache,
                 MatrixRef<Activation> out, std::vector<Index> counts = {}, RowMatrix<T>* gate_scores = nullptr,
                 RowMatrix<T>* first_key_probability = nullptr) const {
        static_assert(takes_cache_v<CacheScalar>, "GATTN_CACHE_MUST_BE_THE_LAYER_SCALAR_OR_INT8_WITH_FLOAT_COMPUTE");
        constexpr const char* fn = "gattn::Qwen3NextAttention::forward";
        const Qwen3NextConfig& c = m_config;
        const Index D = c.hidden_size, H = c.num_attention_heads, Hkv = c.num_key_value_heads, d = c.head_dim;
        const Index rows = x.rows();
        std::vector<Index> lengths =
            gattn::detail::validate_cache_call(fn, m_id, cache, x, out, "hidden_size", D, Hkv, d, d, 0, counts);
        if (static_cast<Index>(positions.size()) != rows)
            gattn::detail::throw_shape(fn, "positions", gattn::detail::shape_string({rows}),
                                       gattn::detail::shape_string({static_cast<Index>(positions.size())}));
        // The optional outputs are resized, which frees their storage.
        if (gate_scores && gate_scores == first_key_probability)
            gattn::detail::throw_invalid(fn, "gate_scores", "must not be first_key_probability");
        for (const auto& [m, name] : {std::pair<const RowMatrix<T>*, const char*>{gate_scores, "gate_scores"},
                                      {first_key_probability, "first_key_probability"}})
            if (gattn::detail::resized_output_holds(m, x) || gattn::detail::resized_output_holds(m, out))
                gattn::detail::throw_invalid(fn, name, "must not hold x or out");
        // The attention call over the cache as the append leaves it, checked before the append.
        const SdpaOptions<T> opt = sdpa_options(std::move(lengths), counts);
        const Index cache_rows = cache.batch() * cache.capacity();
        gattn::detail::validate_sdpa<T>(fn, rows, H * d, cache_rows, Hkv * d, cache_rows, Hkv * d,
                                        HeadLayout{cache.batch(), H, Hkv}, opt, "");
        if constexpr (std::is_same_v<Activation, T>) {
            run(x, positions, &cache, static_cast<const PagedStep<CacheScalar>*>(nullptr), out, counts, opt,
                gate_scores, first_key_probability);
        } else {  // 16-bit activations: widened on entry, rounded once at the end
            const RowMatrix<T> x_wide = x.template cast<T>();
            RowMatrix<T> y(rows, D);
            run(x_wide, positions, &cache, static_cast<const PagedStep<CacheScalar>*>(nullptr), y, counts, opt,
                gate_scores, first_key_probability);
            out = y.template cast<Activation>();
        }
    }

    /// One step of continuous batching over a paged pool (cache/paged_kv_pool.hpp): sequence
    /// seqs[b] brings rows [qo_indptr[b], qo_indptr[b + 1]) of x as its next tokens (one for a
    /// decoding step, a chunk of its prompt, or none), at positions pool.length(seq) + t. Their
    /// keys and values are appended to the pool (append_ragged), then each new token attends
    /// causally to its sequence's tokens through the page table (paged_attention's mixed batch).
    /// Each sequence's rows equal forward(x, positions, cache, out) with a KVCache holding the
    /// same tokens (up to the rounding of a batch's projections).
    /// \param x         [qo_indptr[B], D]; \param out [qo_indptr[B], D], written, sharing no
    ///                  element with x or the pool.
    /// \param qo_indptr B + 1 row offsets from 0, non-decreasing, ending at x.rows().
    /// \param pool      a pool of this layer's KV heads and head_dim; grows by each sequence's rows.
    /// \param seqs      B distinct sequences of the pool.
    /// \param gate_scores, first_key_probability optional, as for the cache forward ([rows, ...]).
    /// \throws shape_error for x, out, qo_indptr or a pool of the wrong shape;
    ///         std::invalid_argument for offsets that do not fit x, out overlapping x or the
    ///         pool or with rows that overlap, an optional output holding x or out, and as
    ///         PagedKVPool::append_ragged (a sequence not in the pool or given twice, a
    ///         non-finite key or value in an int8 pool); gattn::out_of_pages when the step needs
    ///         more pages than are free. Nothing is written (pool included) before validation
    ///         passes.
    template <class PoolScalar>
    void forward(ConstMatrixRef<Activation> x, const std::vector<Index>& qo_indptr, PagedKVPool<PoolScalar>& pool,
                 const std::vector<SequenceId>& seqs, MatrixRef<Activation> out, RowMatrix<T>* gate_scores = nullptr,
                 RowMatrix<T>* first_key_probability = nullptr) const {
        static_assert(takes_cache_v<PoolScalar>, "GATTN_CACHE_MUST_BE_THE_LAYER_SCALAR_OR_INT8_WITH_FLOAT_COMPUTE");
        constexpr const char* fn = "gattn::Qwen3NextAttention::forward";
        const Qwen3NextConfig& c = m_config;
        const Index D = c.hidden_size, Hkv = c.num_key_value_heads, d = c.head_dim;
        if (x.cols() != D)
            gattn::detail::throw_shape(fn, "x", "[rows, hidden_size] with hidden_size = " + std::to_string(D),
                                       gattn::detail::shape_string({x.rows(), x.cols()}));
        gattn::detail::check_output(fn, "out", out, x.rows(), D);
        if (pool.num_kv_heads() != Hkv || pool.head_dim() != d || pool.value_head_dim() != d)
            gattn::detail::throw_shape(
                fn, "pool", "[num_kv_heads, head_dim, value_head_dim] = " + gattn::detail::shape_string({Hkv, d, d}),
                gattn::detail::shape_string({pool.num_kv_heads(), pool.head_dim(), pool.value_head_dim()}));
        const std::vector<Index> positions = gattn::detail::paged_step_positions(fn, x.rows(), qo_indptr, pool, seqs);
        auto in_pool = [&](const auto& view) { return gattn::detail::holds_pool_storage(view, pool); };
        if (gattn::detail::views_overlap(out, x) || in_pool(out) || in_pool(x))
            gattn::detail::throw_invalid(fn, gattn::detail::views_overlap(out, x) || in_pool(out) ? "out" : "x",
                                         "must not share an element with x or the pool");
        if (gate_scores && gate_scores == first_key_probability)
            gattn::detail::throw_invalid(fn, "gate_scores", "must not be first_key_probability");
        for (const auto& [m, name] : {std::pair<const RowMatrix<T>*, const char*>{gate_scores, "gate_scores"},
                                      {first_key_probability, "first_key_probability"}})
            if (gattn::detail::resized_output_holds(m, x) || gattn::detail::resized_output_holds(m, out))
                gattn::detail::throw_invalid(fn, name, "must not hold x or out");
        const PagedStep<PoolScalar> step{&pool, &seqs, &qo_indptr};
        const SdpaOptions<T> opt = sdpa_options({}, {});
        if constexpr (std::is_same_v<Activation, T>) {
            run(x, positions, static_cast<KVCache<PoolScalar>*>(nullptr), &step, out, {}, opt, gate_scores,
                first_key_probability);
        } else {
            const RowMatrix<T> x_wide = x.template cast<T>();
            RowMatrix<T> y(x.rows(), D);
            run(x_wide, positions, static_cast<KVCache<PoolScalar>*>(nullptr), &step, y, {}, opt, gate_scores,
                first_key_probability);
            out = y.template cast<Activation>();
        }
    }

private:
    /// A forward step over a paged pool: the sequences and their rows of x.
    template <class PoolScalar>
    struct PagedStep {
        PagedKVPool<PoolScalar>* pool;
        const std::vector<SequenceId>* seqs;
        const std::vector<Index>* qo_indptr;
    };

    /// The caches the layer takes: its Scalar, and int8 when it computes in float.
    template <class CacheScalar>
    static constexpr bool takes_cache_v = std::is_same_v<CacheScalar, Scalar> ||
                                          (std::is_same_v<CacheScalar, std::int8_t> && std::is_same_v<T, float>);

    /// SDPA's options: causal, scale 1/√d, the sinks, and the cache's lengths after the call's
    /// append as key lengths, the counts of new tokens as query lengths.
    SdpaOptions<T> sdpa_options(std::vector<Index> key_lengths, std::vector<Index> query_lengths) const {
        SdpaOptions<T> opt;
        opt.scale = 1.0 / std::sqrt(double(m_config.head_dim));
        opt.mask.causal = true;
        opt.mask.key_lengths = std::move(key_lengths);
        opt.mask.query_lengths = std::move(query_lengths);
        opt.sinks = m_sinks;
        return opt;
    }

    /// forward's arithmetic on validated arguments (opt: sdpa_options, validated), in the
    /// compute type, over a cache or (cache null) a paged step.
    template <class CacheScalar>
    void run(ConstMatrixRef<T> x, const std::vector<Index>& positions, KVCache<CacheScalar>* cache,
             const PagedStep<CacheScalar>* paged, MatrixRef<T> out, const std::vector<Index>& counts,
             const SdpaOptions<T>& opt, RowMatrix<T>* gate_scores, RowMatrix<T>* first_key_probability) const {
        constexpr bool kInt8Cache = std::is_same_v<CacheScalar, std::int8_t>;
        const Qwen3NextConfig& c = m_config;
        const Index H = c.num_attention_heads, Hkv = c.num_key_value_heads, d = c.head_dim;
        const Index rows = x.rows();
        // The call's activations live in the thread's kept buffers (layers/call_scratch.hpp).
        gattn::detail::CallScratch<T, 1> proj_buffer(rows, m_in.out_features());
        auto proj = proj_buffer.matrix();
        m_in.template forward<T, T>(x, proj);
        T* p = proj.data();
        const Index ld = proj.outerStride(), G = gate_width(), k0 = H * d + G;      // k0: first key column
        rms_norm_heads(p, rows, ld, H, d, m_q_norm.data(), c.rms_norm_eps);         // query
        rms_norm_heads(p + k0, rows, ld, Hkv, d, m_k_norm.data(), c.rms_norm_eps);  // key
        apply_rope(p, rows, ld, H, d, c.rotary_dim(), positions.data(), c.rope_theta);
        apply_rope(p + k0, rows, ld, Hkv, d, c.rotary_dim(), positions.data(), c.rope_theta);

        // Q, K and V in the storage type: the projection itself, or (16-bit) rounded from it once.
        // An int8 cache quantizes the float K and V, and SDPA reads the float Q.
        constexpr bool kRound = is_narrow_storage_v<Scalar> && !kInt8Cache;
        gattn::detail::CallScratch<Scalar, 2> q_buffer(kRound ? rows : 0, H * d);
        gattn::detail::CallScratch<Scalar, 4> kv_buffer(kRound ? rows : 0, 2 * Hkv * d);
        auto q_rounded = q_buffer.matrix();
        auto kv_rounded = kv_buffer.matrix();
        if constexpr (kRound) {
            q_rounded = proj.middleCols(0, H * d).template cast<Scalar>();
            kv_rounded = proj.middleCols(k0, 2 * Hkv * d).template cast<Scalar>();
        }
        using Q = std::conditional_t<kInt8Cache, T, Scalar>;  // what SDPA's queries are
        const ConstMatrixRef<Q> q = [&] {
            if constexpr (is_narrow_storage_v<Q>)
                return ConstMatrixRef<Q>(q_rounded);
            else
                return ConstMatrixRef<Q>(proj.middleCols(0, H * d));
        }();
        using KV = typename KVCache<CacheScalar>::Input;
        const ConstMatrixRef<KV> kv = [&] {
            if constexpr (is_narrow_storage_v<KV>)
                return ConstMatrixRef<KV>(kv_rounded);
            else
                return ConstMatrixRef<KV>(proj.middleCols(k0, 2 * Hkv * d));
        }();
        SdpaOutputs<T> extra;
        extra.first_key_probability = first_key_probability;
        gattn::detail::CallScratch<T, 3> u_buffer(rows, H * d);
        auto u = u_buffer.matrix();
        if (paged) {
            paged->pool->append_ragged(*paged->seqs, kv.leftCols(Hkv * d), kv.rightCols(Hkv * d), *paged->qo_indptr);
            paged_attention<CacheScalar, Q, T>(q, *paged->qo_indptr, *paged->pool,
                                               paged->pool->page_table(*paged->seqs), H, u, opt, extra);
        } else {
            cache->append(kv.leftCols(Hkv * d), kv.rightCols(Hkv * d), counts);
            GATTN_DEBUG_ASSERT(opt.mask.key_lengths == cache->lengths());
            gattn::detail::sdpa_with_epilogue_to<Q, T, gattn::detail::NoEpilogue,
                                                 typename KVCache<CacheScalar>::Operand>(
                q, cache->key_operand(), cache->value_operand(), HeadLayout{cache->batch(), H, Hkv}, u, opt, extra,
                gattn::detail::NoEpilogue{});
        }
        if (gate_scores) gate_scores->resize(rows, G);
        for (Index r = 0; r < rows && G > 0; ++r) {
            const T* z = p + r * ld + H * d;
            if (gate_scores)
                activate(GateActivation::Sigmoid, z, gate_scores->data() + r * G, static_cast<std::size_t>(G));
            apply_gate(GateActivation::Sigmoid, GateCombine::Multiplicative, u.data() + r * H * d, z,
                       static_cast<const T*>(nullptr), static_cast<T*>(nullptr), static_cast<std::size_t>(G));
        }
        m_o.template forward<T, T>(u, out);
        if (!cache) return;
        const Index B = cache->batch(), N = rows / B;
        for (Index b = 0; b < B; ++b)  // padding slots: no token, no output
            for (Index t = counts[b]; t < N; ++t) out.row(b * N + t).setZero();
    }

    Qwen3NextConfig m_config;
    LayerId m_id = detail::next_layer_id();
    Projection<Scalar> m_in;  // [H·d query | H·d gate (if gated) | H_kv·d key | H_kv·d value] × D
    Projection<Scalar> m_o;   // [D, H·d]
    Vector<T> m_q_norm, m_k_norm;
    std::vector<T> m_sinks;  // [H] (attention_sinks), as SdpaOptions takes them
};

GATTN_END_ISA_NAMESPACE
