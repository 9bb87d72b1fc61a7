// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// GatedMultiHeadAttention: projections, gate, SDPA and output projection in one layer.
///
/// Math (arXiv:2505.06708 §2, Eq. 1–5; docs/conventions.md): for the input X [B·N, D],
///     Q = X W_qᵀ + b_q, K = X W_kᵀ + b_k, V = X W_vᵀ + b_v,  U = SDPA(Q, K, V),
///     Y = U W_oᵀ + b_o,
/// with the gate G = act(X W_gᵀ + b_g) combined with V (G2), K (G3), Q (G4), U (G1) or Y (G5).
/// For the recommended G1 elementwise sigmoid gate, Y = (U ⊙ σ(X W_gᵀ + b_g)) W_oᵀ + b_o.
/// A config without a gate is the ungated baseline, so both run through the same code.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "gattn/cache/kv_cache.hpp"
#include "gattn/cache/paged_kv_pool.hpp"
#include "gattn/gates/gate_apply.hpp"
#include "gattn/layers/attention_config.hpp"
#include "gattn/layers/call_scratch.hpp"
#include "gattn/ops/linear.hpp"
#include "gattn/ops/packed_linear.hpp"
#include "gattn/ops/paged_sdpa.hpp"
#include "gattn/ops/rms_norm.hpp"
#include "gattn/ops/rope.hpp"
#include "gattn/ops/sdpa.hpp"
#include "gattn/ops/sdpa_backward.hpp"

namespace gattn {

/// Per-call options of GatedMultiHeadAttention::forward (masks beyond the config's causal flag
/// and window, which always apply).
template <class Scalar>
struct ForwardOptions {
    /// Valid tokens per sequence (B entries, each in [0, N]), padding at the end. A padding
    /// token is neither a key nor a query: no token attends to it, its attention output U is 0
    /// (so its output row is what the layer makes of U = 0), and causal and window masks align
    /// on token positions (token i sees token j ≤ i). Empty = all N tokens.
    std::vector<Index> key_lengths;
    MaskView<bool> bool_mask;  ///< [B|1, H|1, N|1, N], true = attend
    MaskView<Scalar> bias;     ///< [B|1, H|1, N|1, N] additive
    /// RoPE position of each token ([B·N], row order), e.g. for a left-padded batch; empty =
    /// its index t within its sequence. Used only with config.rotary_dim > 0.
    std::vector<Index> positions;
    /// Refuse NaN and ±∞ in x (and NaN in `bias`, where −∞ is a mask) with an error naming
    /// the row, sequence, token and feature, before anything is written, instead of letting
    /// them propagate as IEEE arithmetic does. Off by default: it reads x once more. (The
    /// weights are always checked, at construction.)
    bool check_finite = false;
};

}  // namespace gattn

GATTN_BEGIN_ISA_NAMESPACE

/// Weights of one layer in nn.Linear layout ([out_features, in_features], y = x Wᵀ + b) and
/// HF names. Unused members stay empty. Fused gate layouts keep the gate rows inside
/// q_proj_weight in their checkpoint order.
template <class Scalar>
struct AttentionWeights {
    RowMatrix<Scalar> q_proj_weight;     ///< [H·d_k, D] (with a fused gate: [H·d_k + gate rows, D])
    RowMatrix<Scalar> k_proj_weight;     ///< [H_kv·d_k, D] (G3 key gate: its rows follow as with q)
    RowMatrix<Scalar> v_proj_weight;     ///< [H_kv·d_v, D]
    RowMatrix<Scalar> o_proj_weight;     ///< [D, H·d_v]
    Vector<Scalar> q_proj_bias;          ///< [rows of q_proj_weight] when qkv_bias, else empty
    Vector<Scalar> k_proj_bias;          ///< [H_kv·d_k] when qkv_bias, else empty
    Vector<Scalar> v_proj_bias;          ///< [H_kv·d_v] when qkv_bias, else empty
    Vector<Scalar> o_proj_bias;          ///< [D] when o_bias, else empty
    RowMatrix<Scalar> gate_proj_weight;  ///< separate gate: [gate_width, D], query gate: [H, d_k]
    Vector<Scalar> gate_proj_bias;       ///< [gate_width] when the gate spec has a bias, else empty
    RowMatrix<Scalar> gate_theta;        ///< input-independent gate: [H, d_v]
    Vector<Scalar> sinks;                ///< [H] sink logits when config.sinks, else empty
    Vector<Scalar> q_norm_weight;        ///< [d_k] when config.qk_norm, else empty
    Vector<Scalar> k_norm_weight;        ///< [d_k] when config.qk_norm, else empty

    /// Visits (HF name, pointer to matrix or vector) for every member.
    template <class F>
    void for_each(F&& f) {
        f("q_proj.weight", &q_proj_weight);
        f("k_proj.weight", &k_proj_weight);
        f("v_proj.weight", &v_proj_weight);
        f("o_proj.weight", &o_proj_weight);
        f("q_proj.bias", &q_proj_bias);
        f("k_proj.bias", &k_proj_bias);
        f("v_proj.bias", &v_proj_bias);
        f("o_proj.bias", &o_proj_bias);
        f("gate_proj.weight", &gate_proj_weight);
        f("gate_proj.bias", &gate_proj_bias);
        f("gate_theta", &gate_theta);
        f("sinks", &sinks);
        f("q_norm.weight", &q_norm_weight);
        f("k_norm.weight", &k_norm_weight);
    }
    /// Visits (HF name, const reference to matrix or vector) for every member.
    template <class F>
    void for_each(F&& f) const {
        const_cast<AttentionWeights*>(this)->for_each(
            [&](const char* name, auto* p) { f(name, static_cast<const decltype(*p)&>(*p)); });
    }
    /// The same weights converted to To (rounded to nearest even when To is narrower), e.g.
    /// float weights to bf16 for a GatedMultiHeadAttention<gattn::bfloat16>.
    template <class To>
    AttentionWeights<To> cast() const {
        AttentionWeights<To> out;
        out.q_proj_weight = q_proj_weight.template cast<To>();
        out.k_proj_weight = k_proj_weight.template cast<To>();
        out.v_proj_weight = v_proj_weight.template cast<To>();
        out.o_proj_weight = o_proj_weight.template cast<To>();
        out.q_proj_bias = q_proj_bias.template cast<To>();
        out.k_proj_bias = k_proj_bias.template cast<To>();
        out.v_proj_bias = v_proj_bias.template cast<To>();
        out.o_proj_bias = o_proj_bias.template cast<To>();
        out.gate_proj_weight = gate_proj_weight.template cast<To>();
        out.gate_proj_bias = gate_proj_bias.template cast<To>();
        out.gate_theta = gate_theta.template cast<To>();
        out.sinks = sinks.template cast<To>();
        out.q_norm_weight = q_norm_weight.template cast<To>();
        out.k_norm_weight = k_norm_weight.template cast<To>();
        return out;
    }
};

/// Random weights of the right shapes, deterministic for a seed, for benchmarks, tests and
/// examples: projections, biases and sinks U(−1/√fan_in, 1/√fan_in) (PyTorch's nn.Linear
/// initialisation; fan_in = d_model for biases and sinks), gate_theta U(−1, 1), and the q/k
/// norm gains as the models initialise them: 1 for QkNorm::RmsNorm (Qwen3's nn.Parameter of
/// ones), 0 for QkNorm::ZeroCentredRmsNorm (Qwen3-Next's zeros, a gain of 1 + 0), so that the
/// norm leaves each head's query and key at unit RMS.
/// \throws std::invalid_argument for a config the layer's constructor would refuse.
template <class Scalar>
AttentionWeights<Scalar> make_random_weights(const AttentionConfig& config, std::uint64_t seed) {
    validate_config(config, "gattn::make_random_weights");
    std::mt19937_64 rng(seed);
    AttentionWeights<Scalar> w;
    const auto shapes = expected_weight_shapes(config);
    w.for_each([&](const char* name, auto* p) {
        for (const auto& s : shapes) {
            if (s.name != name) continue;
            const Index rows = s.shape[0], cols = s.shape.size() > 1 ? s.shape[1] : 1;
            const double fan_in = s.name == "gate_theta" ? 1.0
                                  : s.shape.size() > 1   ? double(cols)
                                                         : double(config.d_model);
            std::uniform_real_distribution<double> u(-1.0 / std::sqrt(fan_in), 1.0 / std::sqrt(fan_in));
            p->resize(rows, p->ColsAtCompileTime == 1 ? 1 : cols);
            if (s.name == "q_norm.weight" || s.name == "k_norm.weight") {
                p->setConstant(Scalar(config.qk_norm == QkNorm::ZeroCentredRmsNorm ? 0 : 1));
                continue;
            }
            for (Index k = 0; k < p->size(); ++k) p->data()[k] = static_cast<Scalar>(u(rng));
        }
    });
    return w;
}

/// What a forward pass can record for analysis (paper Table 4 and Figure 2 statistics).
template <class Scalar>
struct ForwardTrace {
    bool record_probabilities = false;  ///< also fill `probabilities` (O(N²) memory)
    /// Activated gate values: [B·N, gate width] for input and query gates (head-shared gates:
    /// the one shared vector, width d), [1, H·d_v] for input-independent gates; empty ungated.
    RowMatrix<Scalar> gate_scores;
    /// [B·N, H]: attention probability each query of each head puts on the first key (0 for a
    /// padding token, which attends to nothing).
    RowMatrix<Scalar> first_key_attention;
    /// [B·H·N, N] attention probabilities, when record_probabilities.
    RowMatrix<Scalar> probabilities;
    /// Largest |Y| of the layer output (M-Act of this layer's contribution).
    Scalar max_abs_output = 0;

    /// Mean gate score (paper Table 4 "Gate Score"); NaN without a gate. Both means run over all
    /// B·N rows, padding tokens included: for a padded batch, average the valid rows instead.
    double mean_gate_score() const {
        return gate_scores.size() ? gate_scores.template cast<double>().mean()
                                  : std::numeric_limits<double>::quiet_NaN();
    }
    /// Mean first-key attention over queries and heads (paper Table 4 "F-Attn").
    double first_token_attention_share() const {
        return first_key_attention.size() ? first_key_attention.template cast<double>().mean()
                                          : std::numeric_limits<double>::quiet_NaN();
    }
};

/// What GatedMultiHeadAttention::forward_train keeps for backward: the intermediate tensors
/// of one full-sequence forward pass, in the compute type, so that backward recomputes
/// nothing but the attention probabilities (which SDPA's backward rebuilds tile by tile from
/// the log-sum-exp). The input x is not kept: backward takes it again. Members a
/// configuration does not use stay empty; bytes() says what the rest holds.
template <class T>
struct ForwardActivations {
    LayerId layer = 0;             ///< the layer that filled it (backward refuses another layer's)
    Index batch = 0;               ///< B of the call
    SdpaOptions<T> sdpa;           ///< the attention call's options (its mask views: the caller's buffers)
    std::vector<Index> positions;  ///< RoPE position of each row (config.rotary_dim > 0)
    /// Gate logits before the activation: [B·N, gate width] (input gates), [B·N, H] (query gate).
    RowMatrix<T> gate_logits;
    /// [Q | K | V] projections before the q/k norm, [B·N, H·d_k + H_kv·d_k + H_kv·d_v] (qk_norm).
    RowMatrix<T> projection;
    /// [Q | K | V] as SDPA reads them (after norm, RoPE and a G2–G4 gate).
    RowMatrix<T> qkv;
    /// A G2, G3 or G4 gate's target before the gate: V, K or Q after norm and RoPE.
    RowMatrix<T> pre_gate;
    RowMatrix<T> attention;        ///< U = SDPA(Q, K, V) [B·N, H·d_v], before a G1 gate
    RowMatrix<T> log_sum_exp;      ///< [B·N, H] SDPA's log-sum-exp per row and head
    RowMatrix<T> gated;            ///< U after a G1 gate (the input of o_proj); empty without one
    RowMatrix<T> output_pre_gate;  ///< A = U W_oᵀ + b_o before a G5 gate [B·N, D]

    /// Bytes of the tensors held (what a training forward keeps per layer).
    std::size_t bytes() const noexcept {
        std::size_t n = 0;
        for (const RowMatrix<T>* m :
             {&gate_logits, &projection, &qkv, &pre_gate, &attention, &log_sum_exp, &gated, &output_pre_gate})
            n += static_cast<std::size_t>(m->size());
        return sizeof(T) * n + sizeof(Index) * positions.size();
    }
};

/// Gated multi-head attention layer (arXiv:2505.06708).
///
/// Construct from an AttentionConfig and AttentionWeights (nn.Linear layout, HF names); call
/// forward on X [B·N, D] row-major (B sequences of N tokens) to get Y [B·N, D]. The layer is
/// immutable after construction: concurrent forward calls on one layer are safe.
///
/// Scalar: the type of the weights and of the KV cache, float, double, or 16-bit
/// (gattn::bfloat16, gattn::half). With 16-bit weights the projections run in PackedLinear
/// (weights packed once, float accumulation), Q, K and V are rounded once to Scalar for SDPA
/// and the cache (after a G2–G4 gate, which acts in float), and the gate, U, the biases, masks'
/// bias and the trace are float (compute_t<Scalar>). Activation: the type of x and out, the
/// compute type (default) or Scalar (16-bit x is widened on entry, out rounded once at the end).
template <class Scalar, class Activation = compute_t<Scalar>>
class GatedMultiHeadAttention {
    static_assert(is_supported_storage_v<Scalar>, "GATTN_SCALAR_MUST_BE_FLOAT_DOUBLE_BFLOAT16_OR_HALF");
    static_assert(std::is_same_v<Activation, compute_t<Scalar>> || std::is_same_v<Activation, Scalar>,
                  "GATTN_ACTIVATION_MUST_BE_THE_COMPUTE_TYPE_OR_THE_STORAGE_TYPE");
    using T = compute_t<Scalar>;

public:
    /// Everything forward would refuse about the config and the weights is refused here: the
    /// calls then only check their own arguments.
    /// \throws std::invalid_argument for an invalid config (validate_config, and the scale,
    ///         softcap and ALiBi slopes in the compute type as SDPA takes them), and for a weight
    ///         holding NaN or ±∞ (a sink may be −∞, no sink; the message names the HF parameter
    ///         and the element); shape_error when a weight is missing, has the wrong shape, or is
    ///         given although the config does not use it (message names the HF parameter).
    GatedMultiHeadAttention(const AttentionConfig& config, const AttentionWeights<Scalar>& weights) : m_config(config) {
        constexpr const char* fn = "gattn::GatedMultiHeadAttention";
        gattn::detail::warn_once_if_slow_build();
        validate_config(config, fn);
        const auto shapes = expected_weight_shapes(config);
        const std::string unused = "this config (gate " + describe(config.gate) + ") does not use it";
        weights.for_each(
            [&](const char* name, const auto& t) { gattn::detail::check_weight_shape(fn, name, t, shapes, unused); });
        weights.for_each([&](const char* name, const auto& t) { gattn::detail::check_weight_values(fn, name, t); });
        pack(weights);
        gattn::detail::validate_sdpa_options(fn, sdpa_options(), config.num_heads);
    }

    /// The configuration the layer was built with.
    const AttentionConfig& config() const noexcept { return m_config; }
    /// This layer's identity: the caches of make_cache carry it and no other layer takes them.
    LayerId layer_id() const noexcept { return m_id; }

    /// Bytes of the weights the layer holds (projections as packed or kept, biases, gate
    /// parameters): for 16-bit weights about their checkpoint's bytes, never a widened copy.
    std::size_t weight_bytes() const noexcept {
        return m_in.bytes() + m_gate.bytes() + m_o.bytes() +
               sizeof(T) *
                   static_cast<std::size_t>(m_gate_query.size() + m_gate_query_bias.size() + m_gate_theta.size() +
                                            m_sinks.size() + m_q_norm.size() + m_k_norm.size());
    }

    /// Forward pass, core form.
    /// \param x     [B·N, D] layer input, row-major, any row stride.
    /// \param batch B ≥ 0; x.rows() must be a multiple of it (B = 0 requires 0 rows).
    /// \param out   [B·N, D], written; must share no element with x (column blocks of one
    ///              matrix are fine).
    /// \param options per-call token counts of a right-padded batch (key_lengths), boolean mask,
    ///        additive bias ([B|1, H|1, N|1, N]), RoPE positions ([B·N]), and the opt-in
    ///        check_finite.
    /// \param trace optional statistics (gate scores, first-key attention, probabilities).
    /// \throws shape_error / std::invalid_argument as scaled_dot_product_attention does, for x,
    ///         out or options.positions of the wrong shape, out overlapping x or with rows
    ///         that overlap, a trace matrix that holds x, out or options.bias, and (with
    ///         options.check_finite) a NaN or ±∞ in x or a NaN in options.bias; nothing is
    ///         written before validation passes.
    void forward(ConstMatrixRef<Activation> x, Index batch, MatrixRef<Activation> out,
                 const ForwardOptions<T>& options = {}, ForwardTrace<T>* trace = nullptr) const {
        constexpr const char* fn = "gattn::GatedMultiHeadAttention::forward";
        auto [sdpa, positions] = prepare_full_sequence(fn, x, batch, out, options, trace);
        run_activations(x, HeadLayout{batch, m_config.num_heads, m_config.num_kv_heads}, out, sdpa, trace,
                        static_cast<KVCache<Scalar>*>(nullptr), {}, positions);
    }

    /// Forward pass, convenience form: returns Y [B·N, D]. Same contract as the core form.
    RowMatrix<Activation> forward(ConstMatrixRef<Activation> x, Index batch, const ForwardOptions<T>& options = {},
                                  ForwardTrace<T>* trace = nullptr) const {
        RowMatrix<Activation> out(x.rows(), m_config.d_model);
        forward(x, batch, out, options, trace);
        return out;
    }

    /// Training forward pass: forward(x, batch, out, options) that also fills `saved` with what
    /// backward needs (ForwardActivations; nothing is recomputed but the attention
    /// probabilities). out equals forward's output. float and double layers only.
    /// \param x     [B·N, D] layer input, as forward.
    /// \param batch B, as forward.
    /// \param out   [B·N, D], written, as forward.
    /// \param saved filled (replaced) on success; its matrices must not hold x or out.
    /// \param options as forward's (check_finite included); its mask views must stay valid
    ///        until backward has run.
    /// \throws what forward throws for x, out and options, and std::invalid_argument when a
    ///         matrix of saved holds x or out; nothing is written before validation passes.
    void forward_train(ConstMatrixRef<Activation> x, Index batch, MatrixRef<Activation> out,
                       ForwardActivations<T>& saved, const ForwardOptions<T>& options = {}) const {
        static_assert(std::is_same_v<Scalar, T> && std::is_same_v<Activation, T>,
                      "GATTN_TRAINING_NEEDS_A_FLOAT_OR_DOUBLE_LAYER");
        constexpr const char* fn = "gattn::GatedMultiHeadAttention::forward_train";
        auto [sdpa, positions] = prepare_full_sequence(fn, x, batch, out, options, nullptr);
        for (const RowMatrix<T>* m : {&saved.gate_logits, &saved.projection, &saved.qkv, &saved.pre_gate,
                                      &saved.attention, &saved.log_sum_exp, &saved.gated, &saved.output_pre_gate})
            if (gattn::detail::resized_output_holds(m, x) || gattn::detail::resized_output_holds(m, out))
                gattn::detail::throw_invalid(fn, "saved", "must not hold x or out");
        ForwardActivations<T> s;
        s.layer = m_id;
        s.batch = batch;
        s.sdpa = std::move(sdpa);
        s.positions = std::move(positions);
        if (x.rows() > 0) {
            run_train(x, out, s);
        } else {  // no rows: empty activations of the right widths (no views of empty storage)
            s.attention.resize(0, m_config.num_heads * m_config.d_v());
            s.log_sum_exp.resize(0, m_config.num_heads);
        }
        saved = std::move(s);
    }

    /// Backward pass of forward_train: from the same x, what forward_train saved and the
    /// upstream gradient dY = ∂L/∂out, the gradient of the input and of every weight the layer
    /// has, in the layout and HF names of AttentionWeights (fused gate rows inside
    /// q_proj_weight in their checkpoint order; members the config does not use stay empty).
    /// The chain, from the output back: G5 gate (residual mix included), o_proj, G1 gate
    /// (input, query-sourced or input-independent), SDPA (scaled_dot_product_attention_backward,
    /// sinks included), G2–G4 gate, RoPE (the inverse rotation), q/k RMSNorm, the input and
    /// gate projections. float and double layers only.
    /// \param x       [B·N, D] the input forward_train was given.
    /// \param saved   what forward_train saved for x.
    /// \param d_out   [B·N, D] ∂L/∂out, finite.
    /// \param grads   filled (replaced): ∂L/∂ each weight, shaped as the weights.
    /// \param d_x     [B·N, D] written: ∂L/∂x; must share no element with x or d_out.
    /// \throws shape_error for x, d_out or d_x of the wrong shape (or x not the rows saved), or
    ///         a tensor of `saved` whose shape is not the one forward_train gave it;
    ///         std::invalid_argument for `saved` from another layer (or never filled), d_x
    ///         overlapping x or d_out or with rows that overlap, a matrix of grads holding x,
    ///         d_out or d_x, and a NaN or ±∞ in d_out (naming its row and column). Nothing is
    ///         written on error.
    void backward(ConstMatrixRef<Activation> x, const ForwardActivations<T>& saved, ConstMatrixRef<Activation> d_out,
                  AttentionWeights<Scalar>& grads, MatrixRef<Activation> d_x) const {
        static_assert(std::is_same_v<Scalar, T> && std::is_same_v<Activation, T>,
                      "GATTN_TRAINING_NEEDS_A_FLOAT_OR_DOUBLE_LAYER");
        constexpr const char* fn = "gattn::GatedMultiHeadAttention::backward";
        const Index D = m_config.d_model;
        if (saved.layer != m_id)
            gattn::detail::throw_invalid(fn, "saved",
                                         "must come from this layer's forward_train (layer id " + std::to_string(m_id) +
                                             "), got layer id " + std::to_string(saved.layer));
        const Index rows = saved.attention.rows();
        check_saved(fn, saved);
        gattn::detail::check_shape(fn, "x", x.rows(), x.cols(), rows, D);
        gattn::detail::check_shape(fn, "d_out", d_out.rows(), d_out.cols(), rows, D);
        gattn::detail::check_output(fn, "d_x", d_x, rows, D);
        if (gattn::detail::views_overlap(d_x, x) || gattn::detail::views_overlap(d_x, d_out))
            gattn::detail::throw_invalid(fn, "d_x", "must not share an element with x or d_out");
        grads.for_each([&](const char* name, const auto* m) {
            const auto holds = [&](const auto& v) {
                return gattn::detail::overlaps_any(m->data(), m->size(), v.data(), gattn::detail::span_of(v));
            };
            if (holds(x) || holds(d_out) || holds(d_x))
                gattn::detail::throw_invalid(fn, std::string("grads.") + name, "must not hold x, d_out or d_x");
        });
        for (Index r = 0; r < rows; ++r)
            for (Index c = 0; c < D; ++c)
                if (!std::isfinite(d_out(r, c)))
                    gattn::detail::throw_invalid(fn, "d_out",
                                                 "must be finite, got " +
                                                     gattn::detail::number_string(double(d_out(r, c))) + " at (" +
                                                     std::to_string(r) + ", " + std::to_string(c) + ")");
        RowMatrix<T> dx(rows, D);
        AttentionWeights<T> g;
        if (rows > 0) {
            run_backward(x, saved, d_out, g, dx);
        } else {  // no rows: every gradient is 0, shaped as the weights
            g = make_random_weights<T>(m_config, 0);
            g.for_each([](const char*, auto* p) { p->setZero(); });
        }
        grads = std::move(g);
        d_x = dx;
    }

    /// A paged pool of this layer's KV heads and head dims (cache/paged_kv_pool.hpp):
    /// num_pages pages of page_size tokens in PoolScalar (the caches make_cache takes).
    /// \throws as the PagedKVPool constructor.
    template <class PoolScalar = Scalar>
    PagedKVPool<PoolScalar> make_pool(Index num_pages, Index page_size) const {
        static_assert(takes_cache_v<PoolScalar>,
                      "GATTN_CACHE_MUST_BE_THE_LAYER_SCALAR_INT8_WITH_FLOAT_COMPUTE_OR_16_BIT_FOR_A_FLOAT_LAYER");
        return PagedKVPool<PoolScalar>(num_pages, page_size, m_config.num_kv_heads, m_config.d_k(), m_config.d_v());
    }

    /// A KV cache for this layer: `batch` sequences of up to `capacity` tokens, keys
    /// [batch·capacity, H_kv·d_k] and values [batch·capacity, H_kv·d_v]. A causal layer with a
    /// sliding window w where 2w < capacity gets a window cache instead (KVCache, window w):
    /// 2w rows per sequence that keep the tokens the window still sees, for any number of tokens.
    /// CacheScalar: the layer's Scalar; std::int8_t for an int8 cache (float compute: Scalar
    /// float or 16-bit; keys and values quantized as they are appended, after a G2 or G3 gate;
    /// ops/int8_rows.hpp); or, for a float layer, gattn::bfloat16 or gattn::half: 16-bit storage
    /// with float compute, where the layer's attention runs as a bf16 layer's does (Q, K and V
    /// rounded to the cache's type once, float softmax, accumulation and output).
    /// \throws as the KVCache constructor.
    template <class CacheScalar = Scalar>
    KVCache<CacheScalar> make_cache(Index batch, Index capacity) const {
        static_assert(takes_cache_v<CacheScalar>,
                      "GATTN_CACHE_MUST_BE_THE_LAYER_SCALAR_INT8_WITH_FLOAT_COMPUTE_OR_16_BIT_FOR_A_FLOAT_LAYER");
        const Index w = m_config.causal && m_config.sliding_window ? *m_config.sliding_window : 0;
        if (w > 0 && w < capacity - w)  // 2w < capacity
            return KVCache<CacheScalar>(batch, 2 * w, m_config.num_kv_heads, m_config.d_k(), m_config.d_v(), m_id, w);
        return KVCache<CacheScalar>(batch, capacity, m_config.num_kv_heads, m_config.d_k(), m_config.d_v(), m_id);
    }

    /// Incremental forward pass with a KV cache (prefill, then decoding a token or a few at a
    /// time): runs new tokens through the layer, appends their keys and values to the cache, and
    /// lets them attend to every cached token of their sequence and to each other. A G2 or G3
    /// gate belongs to the key token, so the cache holds the gated values or keys; G1, G4 and G5
    /// gates act on the new tokens. The config's causal and window masks align the new tokens
    /// with the end of their sequence (query t of sequence b sits at position
    /// cache.tokens_seen()[b] + t), so with a causal config, feeding a sequence in pieces gives what
    /// forward(x, batch) gives on the whole sequence (up to rounding). The math is that of
    /// forward (arXiv:2505.06708 §2) over the cached and the new tokens; caching K and V is the
    /// decoding scheme of HF transformers' Cache and llama.cpp's KV cache.
    /// \param x      [B·N, D]: N new token slots per sequence, row b·N + t, B = cache.batch().
    /// \param cache  this layer's cache, made by its make_cache (or a KVCache of its heads made
    ///               without an owner); grows by counts. A cache made by another layer's
    ///               make_cache is refused, even with the same heads, and so is a window cache
    ///               whose window is not this layer's sliding window.
    /// \param out    [B·N, D], written; must share no element with x. A padding slot
    ///               (t ≥ counts[b]) gets what the layer makes of U = 0, as in forward.
    /// \param counts new tokens per sequence, each in [0, N]; empty = N for every sequence.
    /// \param trace  optional statistics of the new tokens (probabilities are over the cache's
    ///               rows: [B·H·N, capacity after the call], column j the stored token j, at
    ///               position first_positions()[b] + j; first_key_attention is on token 0,
    ///               0 once a window cache has dropped it).
    /// \throws shape_error for x, out or counts of the wrong shape and a cache whose heads are
    ///         not this layer's; std::invalid_argument for a cache made by another layer's
    ///         make_cache or keeping another window, a count outside [0, N], a sequence
    ///         that would exceed the cache's capacity, out overlapping x or with rows that
    ///         overlap, x or out sharing an element with the cache's storage, or a trace matrix
    ///         holding x or out; and, from KVCache::append, for a new token's key or value that
    ///         is NaN or ±∞ in an int8 cache. Nothing is written (cache included) before
    ///         validation passes, and the cache, out and the trace are as they were when it
    ///         throws.
    template <class CacheScalar>
    void forward(ConstMatrixRef<Activation> x, KVCache<CacheScalar>& cache, MatrixRef<Activation> out,
                 std::vector<Index> counts = {}, ForwardTrace<T>* trace = nullptr) const {
        static_assert(takes_cache_v<CacheScalar>,
                      "GATTN_CACHE_MUST_BE_THE_LAYER_SCALAR_INT8_WITH_FLOAT_COMPUTE_OR_16_BIT_FOR_A_FLOAT_LAYER");
        constexpr const char* fn = "gattn::GatedMultiHeadAttention::forward";
        const AttentionConfig& c = m_config;
        const Index D = c.d_model, H = c.num_heads, Hkv = c.num_kv_heads, dk = c.d_k(), dv = c.d_v();
        const Index B = cache.batch(), rows = x.rows();
        std::vector<Index> lengths = gattn::detail::validate_cache_call(fn, m_id, cache, x, out, "d_model", D, Hkv, dk,
                                                                        dv, c.sliding_window ? *c.sliding_window : 0,
                                                                        counts);
        check_trace(fn, trace, x, out, nullptr);
        SdpaOptions<T> sdpa = sdpa_options();
        sdpa.mask.key_lengths = std::move(lengths);
        sdpa.mask.query_lengths = counts;
        const Index cache_rows = B * cache.capacity_after(counts);  // a window cache may grow
        gattn::detail::validate_sdpa<T>(fn, rows, H * dk, cache_rows, Hkv * dk, cache_rows, Hkv * dv,
                                        HeadLayout{B, H, Hkv}, sdpa, "");
        std::vector<Index> positions;  // RoPE: after the sequence's tokens so far
        if (c.rotary_dim > 0) {
            const std::vector<Index> seen = cache.tokens_seen();
            for (Index r = 0; r < rows; ++r) positions.push_back(seen[r / (rows / B)] + r % (rows / B));
        }
        run_activations(x, HeadLayout{B, H, Hkv}, out, sdpa, trace, &cache, counts, positions);
    }

    /// One step of continuous batching over a paged pool (cache/paged_kv_pool.hpp): sequence
    /// seqs[b] brings rows [qo_indptr[b], qo_indptr[b + 1]) of x as its next tokens (one for a
    /// decoding step, a chunk of its prompt, or none). Their keys and values are appended to
    /// the pool (append_ragged), then each new token attends to its sequence's tokens through
    /// the page table (paged_attention's mixed batch: decoding and prompt chunks in one
    /// parallel region). The config's causal and window masks align each sequence's new tokens
    /// with its end, and RoPE puts them at positions pool.length(seq) + t, so each sequence's
    /// rows equal forward(x, cache, out) with a KVCache holding the same tokens (up to the
    /// rounding of a batch's projections, docs/conventions.md). A G1 gate is applied after
    /// SDPA rather than inside it (the same arithmetic). With a causal sliding window w, each
    /// sequence of the step then releases the pages that no token of the step or later sees
    /// (PagedKVPool::release_outside_window from its first new token), so a sequence holds about
    /// (w + n) / P + 1 pages after a step of n tokens, and a rollback to its length before the
    /// step (PagedKVPoolSet::restore or truncate, after a later layer refused the step) stays possible.
    /// \param x         [qo_indptr[B], D]; \param out [qo_indptr[B], D], written, sharing no
    ///                  element with x or the pool.
    /// \param qo_indptr B + 1 row offsets from 0, non-decreasing, ending at x.rows().
    /// \param pool      this layer's pool: num_kv_heads, head_dim and value_head_dim of the
    ///                  config; grows by each sequence's rows.
    /// \param seqs      B distinct sequences of the pool.
    /// \throws shape_error for x, out, qo_indptr or a pool of the wrong shape;
    ///         std::invalid_argument for offsets that do not fit x, out overlapping x or the
    ///         pool or with rows that overlap, and as PagedKVPool::append_ragged (a sequence
    ///         not in the pool or given twice, a non-finite key or value in an int8 pool);
    ///         gattn::out_of_pages when the step needs more pages than are free. Nothing is
    ///         written (pool included) before validation passes.
    template <class PoolScalar>
    void forward(ConstMatrixRef<Activation> x, const std::vector<Index>& qo_indptr, PagedKVPool<PoolScalar>& pool,
                 const std::vector<SequenceId>& seqs, MatrixRef<Activation> out) const {
        static_assert(takes_cache_v<PoolScalar>,
                      "GATTN_CACHE_MUST_BE_THE_LAYER_SCALAR_INT8_WITH_FLOAT_COMPUTE_OR_16_BIT_FOR_A_FLOAT_LAYER");
        constexpr const char* fn = "gattn::GatedMultiHeadAttention::forward";
        const AttentionConfig& c = m_config;
        const Index D = c.d_model, H = c.num_heads, Hkv = c.num_kv_heads, dk = c.d_k(), dv = c.d_v();
        const auto B = static_cast<Index>(seqs.size());
        if (x.cols() != D)
            gattn::detail::throw_shape(fn, "x", "[rows, d_model] with d_model = " + std::to_string(D),
                                       gattn::detail::shape_string({x.rows(), x.cols()}));
        gattn::detail::check_output(fn, "out", out, x.rows(), D);
        if (pool.num_kv_heads() != Hkv || pool.head_dim() != dk || pool.value_head_dim() != dv)
            gattn::detail::throw_shape(
                fn, "pool", "[num_kv_heads, head_dim, value_head_dim] = " + gattn::detail::shape_string({Hkv, dk, dv}),
                gattn::detail::shape_string({pool.num_kv_heads(), pool.head_dim(), pool.value_head_dim()}));
        const std::vector<Index> positions = gattn::detail::paged_step_positions(fn, x.rows(), qo_indptr, pool, seqs);
        auto in_pool = [&](const auto& view) { return gattn::detail::holds_pool_storage(view, pool); };
        if (gattn::detail::views_overlap(out, x) || in_pool(out) || in_pool(x))
            gattn::detail::throw_invalid(fn, gattn::detail::views_overlap(out, x) || in_pool(out) ? "out" : "x",
                                         "must not share an element with x or the pool");
        const PagedStep<PoolScalar> step{&pool, &seqs, &qo_indptr};
        run_activations(x, HeadLayout{B, H, Hkv}, out, sdpa_options(), nullptr,
                        static_cast<KVCache<PoolScalar>*>(nullptr), {}, positions, &step);
        // The pages that no token of this step or later sees: hidden from the step's first token,
        // so that a model whose later layer refuses the step can still roll this one back.
        if (c.causal && c.sliding_window)
            for (std::size_t b = 0; b < seqs.size(); ++b)
                if (const Index n = qo_indptr[b + 1] - qo_indptr[b]; n > 0)
                    pool.release_outside_window(seqs[b], *c.sliding_window, pool.length(seqs[b]) - n);
    }

private:
    /// A forward step over a paged pool: the sequences and their rows of x.
    template <class PoolScalar>
    struct PagedStep {
        PagedKVPool<PoolScalar>* pool;
        const std::vector<SequenceId>* seqs;
        const std::vector<Index>* qo_indptr;
    };

    /// Validates a full-sequence forward call (forward's contract) and returns its SDPA options
    /// and RoPE positions.
    std::pair<SdpaOptions<T>, std::vector<Index>> prepare_full_sequence(const char* fn,
                                                                        const ConstMatrixRef<Activation>& x,
                                                                        Index batch, const MatrixRef<Activation>& out,
                                                                        const ForwardOptions<T>& options,
                                                                        const ForwardTrace<T>* trace) const {
        const AttentionConfig& c = m_config;
        const Index D = c.d_model, H = c.num_heads, Hkv = c.num_kv_heads, dk = c.d_k(), dv = c.d_v();
        if (batch < 0) gattn::detail::throw_invalid(fn, "batch", "must be >= 0, got " + std::to_string(batch));
        if (x.cols() != D || (batch == 0 ? x.rows() != 0 : x.rows() % batch != 0))
            gattn::detail::throw_shape(fn, "x",
                                       batch == 0 ? "[0, " + std::to_string(D) + "] (batch 0 has no rows)"
                                                  : "[B*N, d_model] = [multiple of " + std::to_string(batch) + ", " +
                                                        std::to_string(D) + "]",
                                       gattn::detail::shape_string({x.rows(), x.cols()}));
        gattn::detail::check_output(fn, "out", out, x.rows(), D);
        if (gattn::detail::views_overlap(out, x)) gattn::detail::throw_invalid(fn, "out", "must not overlap x");
        check_trace(fn, trace, x, out, &options.bias);
        SdpaOptions<T> sdpa = sdpa_options();
        sdpa.mask.key_lengths = options.key_lengths;
        // Self-attention: the padding tokens are padding queries too, so the causal and window
        // masks align on token positions (i' = i) rather than on the key count's end.
        sdpa.mask.query_lengths = options.key_lengths;
        sdpa.mask.bool_mask = options.bool_mask;
        sdpa.mask.bias = options.bias;
        const Index rows = x.rows();
        // Validate the attention call before anything is written.
        gattn::detail::validate_sdpa<T>(fn, rows, H * dk, rows, Hkv * dk, rows, Hkv * dv, HeadLayout{batch, H, Hkv},
                                        sdpa, "options.");
        if (options.check_finite) check_finite_input(fn, x, batch, options.bias);
        if (!options.positions.empty() && static_cast<Index>(options.positions.size()) != rows)
            gattn::detail::throw_shape(fn, "options.positions", gattn::detail::shape_string({rows}),
                                       gattn::detail::shape_string({static_cast<Index>(options.positions.size())}));
        std::vector<Index> positions;  // RoPE: given, or each token's index in its sequence
        if (c.rotary_dim > 0) {
            positions = options.positions;
            if (positions.empty())
                for (Index r = 0; r < rows; ++r) positions.push_back(r % (rows / batch));
        }
        return {std::move(sdpa), std::move(positions)};
    }

    /// ForwardOptions::check_finite: the first NaN or ±∞ of x, or NaN of the bias, is refused.
    static void check_finite_input(const char* fn, const ConstMatrixRef<Activation>& x, Index batch,
                                   const MaskView<T>& bias) {
        const Index n = batch > 0 ? x.rows() / batch : 0;
        for (Index r = 0; r < x.rows(); ++r)
            for (Index c = 0; c < x.cols(); ++c)
                if (!std::isfinite(static_cast<T>(x(r, c))))
                    gattn::detail::throw_invalid(fn, "x",
                                                 "row " + std::to_string(r) + " (sequence " + std::to_string(r / n) +
                                                     ", token " + std::to_string(r % n) + "), feature " +
                                                     std::to_string(c) + " is " +
                                                     gattn::detail::number_string(double(static_cast<T>(x(r, c)))) +
                                                     " (ForwardOptions::check_finite: the input must be finite)");
        const Index bias_size = bias.empty() ? 0 : bias.batch * bias.heads * bias.query_len * bias.key_len;
        for (Index i = 0; i < bias_size; ++i)
            if (std::isnan(bias.data[i]))
                gattn::detail::throw_invalid(fn, "options.bias",
                                             "element " + std::to_string(i) +
                                                 " is nan (ForwardOptions::check_finite; -inf masks a key)");
    }

    /// The caches the layer takes: its Scalar, int8 when it computes in float, and bf16 or fp16
    /// when Scalar is float.
    template <class CacheScalar>
    static constexpr bool takes_cache_v = std::is_same_v<CacheScalar, Scalar> ||
                                          (std::is_same_v<CacheScalar, std::int8_t> && std::is_same_v<T, float>) ||
                                          (is_narrow_storage_v<CacheScalar> && std::is_same_v<Scalar, float>);

    /// Refuses a trace matrix that holds x, out or the bias: the trace's matrices are resized,
    /// which frees their storage.
    static void check_trace(const char* fn, const ForwardTrace<T>* trace, const ConstMatrixRef<Activation>& x,
                            const MatrixRef<Activation>& out, const MaskView<T>* bias) {
        if (!trace) return;
        for (const auto& [m, name] :
             {std::pair<const RowMatrix<T>*, const char*>{&trace->gate_scores, "trace->gate_scores"},
              {&trace->first_key_attention, "trace->first_key_attention"},
              {&trace->probabilities, "trace->probabilities"}})
            if (gattn::detail::resized_output_holds(m, x) || gattn::detail::resized_output_holds(m, out) ||
                (bias && gattn::detail::resized_output_holds(m, *bias)))
                gattn::detail::throw_invalid(fn, name,
                                             bias ? "must not hold x, out or options.bias" : "must not hold x or out");
    }

    /// SDPA options of the config: scale, causal and window masks, sinks, softcap, ALiBi.
    SdpaOptions<T> sdpa_options() const {
        SdpaOptions<T> sdpa;
        sdpa.scale = m_config.scale;
        sdpa.mask.causal = m_config.causal;
        sdpa.mask.sliding_window = m_config.sliding_window;
        sdpa.sinks = m_sinks;
        if (m_config.logit_softcap > 0) sdpa.logit_softcap = m_config.logit_softcap;
        if (m_config.alibi) sdpa.alibi_slopes = alibi_slopes<T>(m_config.num_heads);
        return sdpa;
    }

    /// run() on activations in the compute type: 16-bit x is widened first, and out is rounded
    /// once from the float result.
    /// The trace is filled in a copy that replaces *trace once the call has succeeded (an int8
    /// cache may still refuse a NaN key or value after the gate scores are recorded).
    template <class CacheScalar = Scalar>
    void run_activations(ConstMatrixRef<Activation> x, const HeadLayout& layout, MatrixRef<Activation> out,
                         const SdpaOptions<T>& sdpa, ForwardTrace<T>* trace, KVCache<CacheScalar>* cache,
                         const std::vector<Index>& counts, const std::vector<Index>& positions,
                         const PagedStep<CacheScalar>* paged = nullptr) const {
        ForwardTrace<T> recorded;
        if (trace) recorded.record_probabilities = trace->record_probabilities;
        ForwardTrace<T>* const record = trace ? &recorded : nullptr;
        if constexpr (std::is_same_v<Activation, T>) {
            run(x, layout, out, sdpa, record, cache, counts, positions, paged);
        } else {
            const RowMatrix<T> x_wide = x.template cast<T>();
            RowMatrix<T> y(x.rows(), out.cols());
            run(x_wide, layout, y, sdpa, record, cache, counts, positions, paged);
            out = y.template cast<Activation>();
        }
        if (trace) {
            trace->gate_scores.swap(recorded.gate_scores);
            trace->first_key_attention.swap(recorded.first_key_attention);
            trace->probabilities.swap(recorded.probabilities);
            trace->max_abs_output = recorded.max_abs_output;
        }
    }

    /// The layer's arithmetic on validated arguments. Without a cache, SDPA reads this call's
    /// keys and values; with one, they are appended to it (counts per sequence) and SDPA reads
    /// the cache. positions: each row's RoPE position (with config.rotary_dim > 0).
    template <class CacheScalar = Scalar>
    void run(ConstMatrixRef<T> x, const HeadLayout& layout, MatrixRef<T> out, const SdpaOptions<T>& sdpa,
             ForwardTrace<T>* trace, KVCache<CacheScalar>* cache, const std::vector<Index>& counts,
             const std::vector<Index>& positions, const PagedStep<CacheScalar>* paged = nullptr) const {
        constexpr bool kInt8Cache = std::is_same_v<CacheScalar, std::int8_t>;
        const AttentionConfig& c = m_config;
        const Index D = c.d_model, H = c.num_heads, Hkv = c.num_kv_heads, dk = c.d_k(), dv = c.d_v();
        const Index rows = x.rows();
        if (rows == 0) {
            if (trace) {
                trace->gate_scores.resize(0, 0);
                trace->first_key_attention.resize(0, H);
                // [B·H·N, N_k]: N_k is the cache's capacity with a cache, N = 0 without.
                trace->probabilities.resize(0, cache && trace->record_probabilities ? cache->capacity() : 0);
                trace->max_abs_output = 0;
            }
            return;
        }

        // One GEMM for Q, K and V, exactly as without a gate, and one for the gate logits of an
        // input-sourced gate, run first so that SDPA reads Q, K and V while they are in cache.
        // One GEMM for both measured slower (+3–7 % over ungated + gate GEMM at D = 2048,
        // N = 2048: a wider GEMM, Q read from wider rows, a buffer above glibc's mmap threshold
        // mapped afresh in every call).
        const GateSpec& g = c.gate;
        const bool input_gate = g.enabled() && g.source == GateSource::Input;
        // The call's activations live in the thread's kept buffers (layers/call_scratch.hpp).
        gattn::detail::CallScratch<T, 0> z_buffer(rows, input_gate ? m_gate.out_features() : 0);
        auto z = z_buffer.matrix();  // gate logits [B·N, gate_width]
        if (input_gate) m_gate.template forward<T, T>(x, z);
        gattn::detail::CallScratch<T, 1> proj_buffer(rows, m_in.out_features());
        auto proj = proj_buffer.matrix();
        m_in.template forward<T, T>(x, proj);
        auto q = proj.middleCols(0, H * dk);
        auto k = proj.middleCols(H * dk, Hkv * dk);
        auto v = proj.middleCols(H * dk + Hkv * dk, Hkv * dv);
        RowMatrix<T>* scores = trace ? &trace->gate_scores : nullptr;
        if (trace) {
            trace->gate_scores.resize(0, 0);
            trace->probabilities.resize(0, 0);
        }

        // q/k RMSNorm, then RoPE, as Llama, Qwen3 and Qwen3-Next compute the query and key; the
        // gates below see them so.
        if (c.qk_norm != QkNorm::None) {
            const bool zero_centred = c.qk_norm == QkNorm::ZeroCentredRmsNorm;
            rms_norm_heads(q.data(), rows, q.outerStride(), H, dk, m_q_norm.data(), c.rms_norm_eps, zero_centred);
            rms_norm_heads(k.data(), rows, k.outerStride(), Hkv, dk, m_k_norm.data(), c.rms_norm_eps, zero_centred);
        }
        if (c.rotary_dim > 0) {
            const bool gptj = c.rope_style == RopeStyle::GptJ;
            apply_rope(q.data(), rows, q.outerStride(), H, dk, c.rotary_dim, positions.data(), c.rope_theta, gptj);
            apply_rope(k.data(), rows, k.outerStride(), Hkv, dk, c.rotary_dim, positions.data(), c.rope_theta, gptj);
        }

        // Gates on the projections (G2 value, G3 key, G4 query) gate the projection output.
        if (input_gate && g.position != GatePosition::G1 && g.position != GatePosition::G5) {
            if (g.position == GatePosition::G2)
                gate_heads(v.data(), v.outerStride(), Hkv, dv, z, nullptr, scores, rows);
            if (g.position == GatePosition::G3)
                gate_heads(k.data(), k.outerStride(), Hkv, dk, z, nullptr, scores, rows);
            if (g.position == GatePosition::G4) gate_heads(q.data(), q.outerStride(), H, dk, z, nullptr, scores, rows);
        }

        // Q, K and V in the storage type (the layer's, or a float layer's 16-bit cache's): the
        // projection itself, or (16-bit) rounded from it once.
        using Store = std::conditional_t<kInt8Cache, Scalar, CacheScalar>;
        constexpr bool kRound = is_narrow_storage_v<Store>;
        gattn::detail::CallScratch<Store, 2> rounded_buffer(kRound ? rows : 0, proj.cols());
        auto rounded = rounded_buffer.matrix();
        if constexpr (kRound) rounded = proj.template cast<Store>();
        const ConstMatrixRef<Store> qkv = [&]() -> ConstMatrixRef<Store> {
            if constexpr (kRound)
                return rounded;
            else
                return proj;
        }();
        const ConstMatrixRef<Store> q_s = qkv.middleCols(0, H * dk);
        const ConstMatrixRef<Store> k_s = qkv.middleCols(H * dk, Hkv * dk);
        const ConstMatrixRef<Store> v_s = qkv.middleCols(H * dk + Hkv * dk, Hkv * dv);
        // Keys and values: this call's, or the cache's once this call's are appended (an int8
        // cache quantizes the float K and V, and SDPA reads the float Q).
        using Operand = std::conditional_t<kInt8Cache, Int8Rows, ConstMatrixRef<Store>>;
        using Q = std::conditional_t<kInt8Cache, T, Store>;
        if (cache) {
            if constexpr (kInt8Cache)
                cache->append(k, v, counts);
            else
                cache->append(k_s, v_s, counts);
        }
        if (paged) {
            if constexpr (kInt8Cache)
                paged->pool->append_ragged(*paged->seqs, k, v, *paged->qo_indptr);
            else
                paged->pool->append_ragged(*paged->seqs, k_s, v_s, *paged->qo_indptr);
        }
        auto operand = [&](bool key) -> Operand {  // (not called for a paged step)
            if constexpr (kInt8Cache)
                return key ? cache->key_operand() : cache->value_operand();  // int8: always cached
            else
                return cache ? (key ? cache->key_operand() : cache->value_operand()) : (key ? k_s : v_s);
        };
        const ConstMatrixRef<Q> q_in = [&] {
            if constexpr (kInt8Cache)
                return ConstMatrixRef<Q>(q);
            else
                return q_s;
        }();

        gattn::detail::CallScratch<T, 3> u_buffer(rows, H * dv);
        auto u = u_buffer.matrix();
        SdpaOutputs<T> extra;
        if (trace) {
            extra.first_key_probability = &trace->first_key_attention;
            if (trace->record_probabilities) extra.probabilities = &trace->probabilities;
        }
        // A head-specific G1 gate on the input is applied to each (token, head) output as soon as
        // SDPA has written it, while it is in cache, instead of in a pass over U afterwards
        // (with a trace, the pass records the gate scores). Same arithmetic, same result.
        const bool fused_g1 = input_gate && g.position == GatePosition::G1 && g.sharing == GateSharing::HeadSpecific &&
                              !scores && !paged;
        if (paged) {
            paged_attention<CacheScalar, Q, T>(q_in, *paged->qo_indptr, *paged->pool,
                                               paged->pool->page_table(*paged->seqs), H, u, sdpa, extra);
        } else if (fused_g1) {
            const Operand keys = operand(true), values = operand(false);
            const Index zw = gate_logits_per_head(dv);
            const auto gate_epilogue = [&](Index row, Index h, T* y) {
                // SDPA finishes a head's rows in order; the logits of row + 8 are fetched now
                // (rows are H·d_v apart: a page each, which hardware prefetchers skip).
                if (row + 8 < rows)
                    for (Index e = 0; e < zw; e += static_cast<Index>(simd::kLineElems<T>))
                        simd::prefetch(z.data() + (row + 8) * z.outerStride() + h * zw + e);
                gate_head(y, z.data() + row * z.outerStride(), h, dv);
            };
            gattn::detail::sdpa_with_epilogue_to<Q, T, std::decay_t<decltype(gate_epilogue)>, Operand>(
                q_in, keys, values, layout, u, sdpa, extra, gate_epilogue);
        } else {
            const Operand keys = operand(true), values = operand(false);
            gattn::detail::sdpa_with_epilogue_to<Q, T, gattn::detail::NoEpilogue, Operand>(q_in, keys, values, layout,
                                                                                           u, sdpa, extra,
                                                                                           gattn::detail::NoEpilogue{});
        }

        // A window cache that dropped a sequence's first token: no new token sees token 0 (row 0
        // holds a later one).
        if (cache && trace)
            for (Index b = 0; b < layout.batch; ++b)
                if (cache->first_positions()[b] > 0)
                    trace->first_key_attention.middleRows(b * (rows / layout.batch), rows / layout.batch).setZero();

        if (g.position == GatePosition::G1) {
            if (g.source == GateSource::Input) {
                if (!fused_g1) gate_heads(u.data(), u.outerStride(), H, dv, z, nullptr, scores, rows);
            } else if (g.source == GateSource::Query) {
                // z[r, h] = w_h · q_h + b_h from the query as SDPA reads it (after qk_norm and RoPE).
                gattn::detail::CallScratch<T, 4> zq_buffer(rows, H);
                auto zq = zq_buffer.matrix();
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (rows * H * dk >= (Index(1) << 16))
#endif
                for (Index r = 0; r < rows; ++r)
                    for (Index h = 0; h < H; ++h)
                        zq(r, h) = simd::dot(q.data() + r * q.outerStride() + h * dk, m_gate_query.data() + h * dk,
                                             static_cast<std::size_t>(dk)) +
                                   (m_gate_query_bias.size() ? m_gate_query_bias[h] : T(0));
                gate_heads(u.data(), u.outerStride(), H, dv, zq, nullptr, scores, rows);
            } else {
                // Input-independent σ(θ): activate once, then multiply every row.
                RowMatrix<T> gate(1, H * dv);
                activate(g.activation, m_gate_theta.data(), gate.data(), static_cast<std::size_t>(H * dv));
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (rows * H * dv >= (Index(1) << 16))
#endif
                for (Index r = 0; r < rows; ++r)
                    apply_gate(g.activation, GateCombine::Multiplicative, u.data() + r * u.outerStride(), gate.data(),
                               static_cast<const T*>(nullptr), static_cast<T*>(nullptr),
                               static_cast<std::size_t>(H * dv), /*activated=*/true);
                if (scores) *scores = gate;
            }
        }

        m_o.template forward<T, T>(u, out);

        if (g.position == GatePosition::G5) gate_heads(out.data(), out.outerStride(), 1, D, z, &x, scores, rows);

        if (trace) trace->max_abs_output = out.cwiseAbs().maxCoeff();
    }

    /// Copies the weights into the input projection [W_q; W_k; W_v] and the gate projection W_g
    /// (the gate rows of a fused q_proj reordered to one block per head), and the output
    /// projection.
    void pack(const AttentionWeights<Scalar>& w) {
        const AttentionConfig& c = m_config;
        const Index D = c.d_model, H = c.num_heads, Hkv = c.num_kv_heads, dk = c.d_k(), dv = c.d_v();
        const GateSpec& g = c.gate;
        const bool input_gate = g.enabled() && g.source == GateSource::Input;
        const Index gw = input_gate ? gate_width(c) : 0;
        RowMatrix<Scalar> w_in(H * dk + Hkv * dk + Hkv * dv, D), w_gate;
        Vector<T> bias = Vector<T>::Zero(w_in.rows());
        if (input_gate) w_gate.resize(gw, D);
        Vector<T> gate_bias = Vector<T>::Zero(gw);
        const bool fused = input_gate && g.layout != GateLayout::Separate;
        if (fused) {
            // Per head, gw_h gate rows (d_v elementwise, 1 headwise) follow or are grouped.
            const Index gwh = gw / H, group = H / Hkv;
            for (Index h = 0; h < H; ++h) {
                const auto [q_src, g_src] = gattn::detail::fused_q_proj_rows(g.layout, h, group, dk, gwh);
                w_in.middleRows(h * dk, dk) = w.q_proj_weight.middleRows(q_src, dk);
                w_gate.middleRows(h * gwh, gwh) = w.q_proj_weight.middleRows(g_src, gwh);
                if (c.qkv_bias) {
                    bias.segment(h * dk, dk) = w.q_proj_bias.segment(q_src, dk).template cast<T>();
                    gate_bias.segment(h * gwh, gwh) = w.q_proj_bias.segment(g_src, gwh).template cast<T>();
                }
            }
        } else {
            w_in.middleRows(0, H * dk) = w.q_proj_weight;
            if (c.qkv_bias) bias.segment(0, H * dk) = w.q_proj_bias.template cast<T>();
            if (input_gate) {
                w_gate = w.gate_proj_weight;
                if (g.bias) gate_bias = w.gate_proj_bias.template cast<T>();
            }
        }
        w_in.middleRows(H * dk, Hkv * dk) = w.k_proj_weight;
        w_in.middleRows(H * dk + Hkv * dk, Hkv * dv) = w.v_proj_weight;
        if (c.qkv_bias) {
            bias.segment(H * dk, Hkv * dk) = w.k_proj_bias.template cast<T>();
            bias.segment(H * dk + Hkv * dk, Hkv * dv) = w.v_proj_bias.template cast<T>();
        }
        m_in = Projection<Scalar>(std::move(w_in), c.qkv_bias ? bias : Vector<T>());
        if (input_gate)
            m_gate = Projection<Scalar>(std::move(w_gate), (fused ? c.qkv_bias : g.bias) ? gate_bias : Vector<T>());
        m_o = Projection<Scalar>(w.o_proj_weight, c.o_bias ? Vector<T>(w.o_proj_bias.template cast<T>()) : Vector<T>());
        if (g.enabled() && g.source == GateSource::Query) {
            m_gate_query = w.gate_proj_weight.template cast<T>();
            if (g.bias) m_gate_query_bias = w.gate_proj_bias.template cast<T>();
        }
        if (g.enabled() && g.source == GateSource::InputIndependent) m_gate_theta = w.gate_theta.template cast<T>();
        if (c.sinks) m_sinks.assign(w.sinks.data(), w.sinks.data() + w.sinks.size());
        if (c.qk_norm != QkNorm::None) {
            m_q_norm = w.q_norm_weight.template cast<T>();
            m_k_norm = w.k_norm_weight.template cast<T>();
        }
    }

    /// Applies the gate to `rows` rows of a target holding `heads` heads of `width` each.
    /// z: logits [rows, heads·width] (elementwise), [rows, heads] (headwise); head-shared gates
    /// average the logits over heads first. residual: the layer input (G5 residual mix).
    template <class Logits>
    void gate_heads(T* target, Index stride, Index heads, Index width, const Logits& z,
                    const ConstMatrixRef<T>* residual, RowMatrix<T>* scores, Index rows) const {
        const GateSpec& g = m_config.gate;
        const bool elem = g.granularity == GateGranularity::Elementwise;
        const bool shared = g.sharing == GateSharing::HeadShared;
        const Index score_width = !elem ? heads : (shared ? width : heads * width);
        if (scores) scores->resize(rows, score_width);
            // Rows in parallel, like the GEMMs and SDPA around this pass (a serial pass would grow
            // into a large share of the layer on many cores). Each row's arithmetic is the same on
            // any thread, so the result does not depend on the thread count.
#ifdef _OPENMP
        const int threads = omp_get_max_threads();
#else
        const int threads = 1;
#endif
        const std::size_t per_thread = static_cast<std::size_t>(width);  // head-shared mean
        std::vector<T> scratch(static_cast<std::size_t>(threads) * per_thread);
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (threads > 1 && rows * heads * width >= (Index(1) << 16))
#endif
        for (Index r = 0; r < rows; ++r) {
#ifdef _OPENMP
            T* const mean = scratch.data() + static_cast<std::size_t>(omp_get_thread_num()) * per_thread;
#else
            T* const mean = scratch.data();
#endif
            T* y = target + r * stride;
            const T* zr = z.data() + r * z.outerStride();
            T* s = scores ? scores->data() + r * score_width : nullptr;
            const T* xr = residual ? residual->data() + r * residual->outerStride() : nullptr;
            // Gate scores for a trace come from a separate activation pass, so that the gate pass
            // itself (and its floating-point contraction) is the same with and without a trace.
            if (elem && !shared) {
                if (s) activate(g.activation, zr, s, static_cast<std::size_t>(heads * width));
                apply_gate(g.activation, g.combine, y, zr, xr, static_cast<T*>(nullptr),
                           static_cast<std::size_t>(heads * width));
            } else if (elem) {
                for (Index e = 0; e < width; ++e) {
                    T acc = 0;
                    for (Index h = 0; h < heads; ++h) acc += zr[h * width + e];
                    mean[e] = acc / T(heads);
                }
                if (s) activate(g.activation, mean, s, static_cast<std::size_t>(width));
                for (Index h = 0; h < heads; ++h)
                    apply_gate(g.activation, g.combine, y + h * width, mean, xr ? xr + h * width : nullptr,
                               static_cast<T*>(nullptr), static_cast<std::size_t>(width));
            } else {
                for (Index h = 0; h < heads; ++h) {
                    if (s) activate(g.activation, zr + h, s + h, 1);
                    gate_head(y + h * width, zr, h, width);
                }
            }
        }
    }

    /// Checks that every tensor of `saved` (its members are public) has the shape this layer's
    /// forward_train gives it for saved.attention.rows() rows: backward reads them unchecked
    /// (none for 0 rows).
    void check_saved(const char* fn, const ForwardActivations<T>& saved) const {
        if (saved.attention.rows() == 0) return;
        const AttentionConfig& c = m_config;
        const GateSpec& g = c.gate;
        const Index rows = saved.attention.rows(), H = c.num_heads, dv = c.d_v(), qkv = m_in.out_features();
        const bool input_gate = g.enabled() && g.source == GateSource::Input;
        const bool query_gate = g.position == GatePosition::G1 && g.source == GateSource::Query;
        Index pre_gate = -1;  // a G2–G4 gate's target columns
        if (input_gate && g.position != GatePosition::G1 && g.position != GatePosition::G5) {
            const auto [offset, heads, width] = projection_gate_target();
            (void)offset;
            pre_gate = heads * width;
        }
        auto expect = [&](const char* name, const RowMatrix<T>& m, bool kept, Index cols) {
            const Index want_rows = kept ? rows : 0, want_cols = kept ? cols : 0;
            if (m.rows() != want_rows || m.cols() != want_cols)
                gattn::detail::throw_shape(fn, std::string("saved.") + name,
                                           gattn::detail::shape_string({want_rows, want_cols}) +
                                               " (as this layer's forward_train keeps it)",
                                           gattn::detail::shape_string({m.rows(), m.cols()}));
        };
        expect("gate_logits", saved.gate_logits, input_gate || query_gate, input_gate ? m_gate.out_features() : H);
        expect("projection", saved.projection, c.qk_norm != QkNorm::None, qkv);
        expect("qkv", saved.qkv, true, qkv);
        expect("pre_gate", saved.pre_gate, pre_gate >= 0, pre_gate);
        expect("attention", saved.attention, true, H * dv);
        expect("log_sum_exp", saved.log_sum_exp, true, H);
        expect("gated", saved.gated, g.position == GatePosition::G1, H * dv);
        expect("output_pre_gate", saved.output_pre_gate, g.position == GatePosition::G5, c.d_model);
        if (saved.batch < 1 || rows % saved.batch != 0)
            gattn::detail::throw_invalid(fn, "saved.batch",
                                         "must divide the rows saved (" + std::to_string(rows) + "), got " +
                                             std::to_string(saved.batch));
        if (c.rotary_dim > 0 && static_cast<Index>(saved.positions.size()) != rows)
            gattn::detail::throw_shape(fn, "saved.positions", gattn::detail::shape_string({rows}),
                                       gattn::detail::shape_string({static_cast<Index>(saved.positions.size())}));
    }

    /// forward_train's arithmetic on validated arguments: the steps of run() without a cache,
    /// each intermediate kept in s.
    void run_train(ConstMatrixRef<T> x, MatrixRef<T> out, ForwardActivations<T>& s) const {
        const AttentionConfig& c = m_config;
        const Index D = c.d_model, H = c.num_heads, Hkv = c.num_kv_heads, dk = c.d_k(), dv = c.d_v();
        const Index rows = x.rows();
        const GateSpec& g = c.gate;
        const bool input_gate = g.enabled() && g.source == GateSource::Input;
        if (input_gate) {
            s.gate_logits.resize(rows, m_gate.out_features());
            m_gate.template forward<T, T>(x, s.gate_logits);
        }
        RowMatrix<T> proj(rows, m_in.out_features());
        m_in.template forward<T, T>(x, proj);
        auto q = proj.middleCols(0, H * dk);
        auto k = proj.middleCols(H * dk, Hkv * dk);
        if (c.qk_norm != QkNorm::None) {
            s.projection = proj;
            const bool zero_centred = c.qk_norm == QkNorm::ZeroCentredRmsNorm;
            rms_norm_heads(q.data(), rows, q.outerStride(), H, dk, m_q_norm.data(), c.rms_norm_eps, zero_centred);
            rms_norm_heads(k.data(), rows, k.outerStride(), Hkv, dk, m_k_norm.data(), c.rms_norm_eps, zero_centred);
        }
        if (c.rotary_dim > 0) {
            const bool gptj = c.rope_style == RopeStyle::GptJ;
            apply_rope(q.data(), rows, q.outerStride(), H, dk, c.rotary_dim, s.positions.data(), c.rope_theta, gptj);
            apply_rope(k.data(), rows, k.outerStride(), Hkv, dk, c.rotary_dim, s.positions.data(), c.rope_theta, gptj);
        }
        if (input_gate && g.position != GatePosition::G1 && g.position != GatePosition::G5) {
            const auto [offset, heads, width] = projection_gate_target();
            s.pre_gate = proj.middleCols(offset, heads * width);
            gate_heads(proj.data() + offset, proj.outerStride(), heads, width, s.gate_logits, nullptr, nullptr, rows);
        }
        s.qkv = std::move(proj);
        s.attention.resize(rows, H * dv);
        s.log_sum_exp.resize(rows, H);
        SdpaOutputs<T> extra;
        extra.log_sum_exp = &s.log_sum_exp;
        scaled_dot_product_attention<T>(s.qkv.middleCols(0, H * dk), s.qkv.middleCols(H * dk, Hkv * dk),
                                        s.qkv.middleCols(H * dk + Hkv * dk, Hkv * dv), HeadLayout{s.batch, H, Hkv},
                                        s.attention, s.sdpa, extra);
        if (g.position == GatePosition::G1) {
            s.gated = s.attention;
            RowMatrix<T>& u = s.gated;
            if (g.source == GateSource::Input) {
                gate_heads(u.data(), u.outerStride(), H, dv, s.gate_logits, nullptr, nullptr, rows);
            } else if (g.source == GateSource::Query) {
                s.gate_logits.resize(rows, H);
                for (Index r = 0; r < rows; ++r)
                    for (Index h = 0; h < H; ++h)
                        s.gate_logits(r, h) = simd::dot(s.qkv.data() + r * s.qkv.outerStride() + h * dk,
                                                        m_gate_query.data() + h * dk, static_cast<std::size_t>(dk)) +
                                              (m_gate_query_bias.size() ? m_gate_query_bias[h] : T(0));
                gate_heads(u.data(), u.outerStride(), H, dv, s.gate_logits, nullptr, nullptr, rows);
            } else {
                RowMatrix<T> gate(1, H * dv);
                activate(g.activation, m_gate_theta.data(), gate.data(), static_cast<std::size_t>(H * dv));
                for (Index r = 0; r < rows; ++r)
                    apply_gate(g.activation, GateCombine::Multiplicative, u.data() + r * u.outerStride(), gate.data(),
                               static_cast<const T*>(nullptr), static_cast<T*>(nullptr),
                               static_cast<std::size_t>(H * dv), /*activated=*/true);
            }
        }
        m_o.template forward<T, T>(g.position == GatePosition::G1 ? s.gated : s.attention, out);
        if (g.position == GatePosition::G5) {
            s.output_pre_gate = out;
            gate_heads(out.data(), out.outerStride(), 1, D, s.gate_logits, &x, nullptr, rows);
        }
    }

    /// Where a G2, G3 or G4 gate's target lies in [Q | K | V]: first column, heads, width.
    std::tuple<Index, Index, Index> projection_gate_target() const {
        const AttentionConfig& c = m_config;
        const Index H = c.num_heads, Hkv = c.num_kv_heads, dk = c.d_k(), dv = c.d_v();
        switch (c.gate.position) {
            case GatePosition::G2: return {H * dk + Hkv * dk, Hkv, dv};
            case GatePosition::G3: return {H * dk, Hkv, dk};
            default: return {0, H, dk};  // G4
        }
    }

    /// backward's arithmetic on validated arguments; g and dx are the caller's fresh outputs.
    void run_backward(ConstMatrixRef<T> x, const ForwardActivations<T>& s, ConstMatrixRef<T> d_out,
                      AttentionWeights<T>& grad, RowMatrix<T>& dx) const {
        const AttentionConfig& c = m_config;
        const Index D = c.d_model, H = c.num_heads, Hkv = c.num_kv_heads, dk = c.d_k(), dv = c.d_v();
        const Index rows = x.rows();
        const GateSpec& g = c.gate;
        const bool input_gate = g.enabled() && g.source == GateSource::Input;
        const bool query_gate = g.enabled() && g.source == GateSource::Query;
        dx.setZero();
        RowMatrix<T> dz;  // ∂L/∂ gate logits
        if (input_gate || query_gate) dz.setZero(rows, s.gate_logits.cols());

        // G5: Y = combine(A, act(z)), A = U W_oᵀ + b_o (the residual mix adds (1 − g)·x).
        RowMatrix<T> d_a = d_out;
        if (g.position == GatePosition::G5)
            gate_heads_backward(s.output_pre_gate, 1, D, s.gate_logits, &x, d_a, dz, &dx);

        // o_proj.
        const RowMatrix<T>& o_in = g.position == GatePosition::G1 ? s.gated : s.attention;
        grad.o_proj_weight.noalias() = d_a.transpose() * o_in;
        if (c.o_bias) grad.o_proj_bias = d_a.colwise().sum().transpose();
        RowMatrix<T> d_u(rows, H * dv);
        d_u.noalias() = d_a * m_o.weight();

        // G1.
        if (g.position == GatePosition::G1) {
            if (input_gate || query_gate) {
                gate_heads_backward(s.attention, H, dv, s.gate_logits, nullptr, d_u, dz, nullptr);
            } else {  // input-independent σ(θ): one gate for every row
                const Index n = H * dv;
                std::vector<T> gate(static_cast<std::size_t>(n)), slope(static_cast<std::size_t>(n));
                activation_and_slope(g.activation, m_gate_theta.data(), gate.data(), slope.data(), n);
                grad.gate_theta.setZero(H, dv);
                T* dt = grad.gate_theta.data();
                for (Index r = 0; r < rows; ++r) {
                    T* du = d_u.data() + r * d_u.outerStride();
                    const T* u = s.attention.data() + r * s.attention.outerStride();
                    for (Index e = 0; e < n; ++e) {
                        dt[e] += du[e] * u[e] * slope[static_cast<std::size_t>(e)];
                        du[e] *= gate[static_cast<std::size_t>(e)];
                    }
                }
            }
        }

        // SDPA.
        RowMatrix<T> d_proj(rows, m_in.out_features());
        auto dq = d_proj.middleCols(0, H * dk);
        auto dk_ = d_proj.middleCols(H * dk, Hkv * dk);
        auto dv_ = d_proj.middleCols(H * dk + Hkv * dk, Hkv * dv);
        std::vector<T> d_sinks;
        scaled_dot_product_attention_backward<T>(s.qkv.middleCols(0, H * dk), s.qkv.middleCols(H * dk, Hkv * dk),
                                                 s.qkv.middleCols(H * dk + Hkv * dk, Hkv * dv),
                                                 HeadLayout{s.batch, H, Hkv}, s.attention, s.log_sum_exp, d_u, dq, dk_,
                                                 dv_, s.sdpa, c.sinks ? &d_sinks : nullptr);
        if (c.sinks) grad.sinks = Eigen::Map<const Vector<T>>(d_sinks.data(), H);

        // Query-sourced G1 gate: z_h = w_h·q_h + b_h from the query SDPA read.
        if (query_gate) {
            grad.gate_proj_weight.setZero(H, dk);
            for (Index r = 0; r < rows; ++r)
                for (Index h = 0; h < H; ++h) {
                    const T dzh = dz(r, h);
                    const T* qh = s.qkv.data() + r * s.qkv.outerStride() + h * dk;
                    T* dqh = dq.data() + r * dq.outerStride() + h * dk;
                    for (Index e = 0; e < dk; ++e) {
                        dqh[e] += dzh * m_gate_query(h, e);
                        grad.gate_proj_weight(h, e) += dzh * qh[e];
                    }
                }
            if (g.bias) grad.gate_proj_bias = dz.colwise().sum().transpose();
        }

        // G2–G4 on the projection, after norm and RoPE.
        if (input_gate && g.position != GatePosition::G1 && g.position != GatePosition::G5) {
            const auto [offset, heads, width] = projection_gate_target();
            auto target = d_proj.middleCols(offset, heads * width);
            gate_heads_backward(s.pre_gate, heads, width, s.gate_logits, nullptr, target, dz, nullptr);
        }

        // RoPE: a rotation, whose inverse (the rotation by −angle) is its transpose.
        if (c.rotary_dim > 0) {
            std::vector<Index> back(s.positions.size());
            for (std::size_t i = 0; i < back.size(); ++i) back[i] = -s.positions[i];
            const bool gptj = c.rope_style == RopeStyle::GptJ;
            apply_rope(dq.data(), rows, dq.outerStride(), H, dk, c.rotary_dim, back.data(), c.rope_theta, gptj);
            apply_rope(dk_.data(), rows, dk_.outerStride(), Hkv, dk, c.rotary_dim, back.data(), c.rope_theta, gptj);
        }

        // q/k RMSNorm.
        if (c.qk_norm != QkNorm::None) {
            grad.q_norm_weight.setZero(dk);
            grad.k_norm_weight.setZero(dk);
            rms_norm_heads_backward(s.projection.data(), s.projection.outerStride(), dq.data(), dq.outerStride(), rows,
                                    H, m_q_norm, grad.q_norm_weight);
            rms_norm_heads_backward(s.projection.data() + H * dk, s.projection.outerStride(), dk_.data(),
                                    dk_.outerStride(), rows, Hkv, m_k_norm, grad.k_norm_weight);
        }

        // Input projections.
        const RowMatrix<T> dw_in = d_proj.transpose() * x;
        Vector<T> db_in;
        if (c.qkv_bias) db_in = d_proj.colwise().sum().transpose();
        dx.noalias() += d_proj * m_in.weight();
        RowMatrix<T> dw_gate;
        Vector<T> db_gate;
        if (input_gate) {
            dw_gate = dz.transpose() * x;
            db_gate = dz.colwise().sum().transpose();
            dx.noalias() += dz * m_gate.weight();
        }

        // Back to the checkpoint's layout.
        const bool fused = input_gate && g.layout != GateLayout::Separate;
        if (fused) {
            const Index gw = dw_gate.rows(), gwh = gw / H, group = H / Hkv;
            grad.q_proj_weight.resize(H * dk + gw, D);
            if (c.qkv_bias) grad.q_proj_bias.resize(H * dk + gw);
            for (Index h = 0; h < H; ++h) {
                const auto [q_src, g_src] = gattn::detail::fused_q_proj_rows(g.layout, h, group, dk, gwh);
                grad.q_proj_weight.middleRows(q_src, dk) = dw_in.middleRows(h * dk, dk);
                grad.q_proj_weight.middleRows(g_src, gwh) = dw_gate.middleRows(h * gwh, gwh);
                if (c.qkv_bias) {
                    grad.q_proj_bias.segment(q_src, dk) = db_in.segment(h * dk, dk);
                    grad.q_proj_bias.segment(g_src, gwh) = db_gate.segment(h * gwh, gwh);
                }
            }
        } else {
            grad.q_proj_weight = dw_in.middleRows(0, H * dk);
            if (c.qkv_bias) grad.q_proj_bias = db_in.segment(0, H * dk);
            if (input_gate) {
                grad.gate_proj_weight = std::move(dw_gate);
                if (g.bias) grad.gate_proj_bias = std::move(db_gate);
            }
        }
        grad.k_proj_weight = dw_in.middleRows(H * dk, Hkv * dk);
        grad.v_proj_weight = dw_in.middleRows(H * dk + Hkv * dk, Hkv * dv);
        if (c.qkv_bias) {
            grad.k_proj_bias = db_in.segment(H * dk, Hkv * dk);
            grad.v_proj_bias = db_in.segment(H * dk + Hkv * dk, Hkv * dv);
        }
    }

    /// act(z) and act'(z) of n logits; act(z) by the forward's kernel, so that backward
    /// multiplies by the very gate values forward used.
    static void activation_and_slope(GateActivation a, const T* z, T* gate, T* slope, Index n) {
        activate(a, z, gate, static_cast<std::size_t>(n));
        activate(GateActivation::Sigmoid, z, slope, static_cast<std::size_t>(n));
        for (Index e = 0; e < n; ++e) {
            const T sg = slope[e];
            switch (a) {
                case GateActivation::Sigmoid: slope[e] = sg * (T(1) - sg); break;
                case GateActivation::SiLU: slope[e] = sg * (T(1) + z[e] * (T(1) - sg)); break;
                case GateActivation::NonSparseSigmoid: slope[e] = T(0.5) * sg * (T(1) - sg); break;
            }
        }
    }

    /// The backward of gate_heads: `target` holds the gate's target before the gate
    /// ([rows, heads·width]), z the logits; d_target holds ∂L/∂(gated target) and becomes
    /// ∂L/∂target; ∂L/∂z is added to d_z, and (residual mix) ∂L/∂x to *d_residual.
    template <class DTarget>
    void gate_heads_backward(const RowMatrix<T>& target, Index heads, Index width, const RowMatrix<T>& z,
                             const ConstMatrixRef<T>* residual, DTarget&& d_target, RowMatrix<T>& d_z,
                             RowMatrix<T>* d_residual) const {
        const GateSpec& g = m_config.gate;
        const bool elem = g.granularity == GateGranularity::Elementwise;
        const bool shared = g.sharing == GateSharing::HeadShared;
        const GateCombine combine = g.combine;
        const Index rows = target.rows();
        const Index n = elem ? (shared ? width : heads * width) : heads;  // gate values per row
        std::vector<T> gate(static_cast<std::size_t>(n)), slope(static_cast<std::size_t>(n)),
            mean(static_cast<std::size_t>(n));
        for (Index r = 0; r < rows; ++r) {
            const T* t = target.data() + r * target.outerStride();
            const T* zr = z.data() + r * z.outerStride();
            T* dt = d_target.data() + r * d_target.outerStride();
            T* dzr = d_z.data() + r * d_z.outerStride();
            if (elem && !shared) {
                activation_and_slope(g.activation, zr, gate.data(), slope.data(), n);
                const T* xr = residual ? residual->data() + r * residual->outerStride() : nullptr;
                T* dxr = d_residual ? d_residual->data() + r * d_residual->outerStride() : nullptr;
                for (Index e = 0; e < n; ++e) {
                    const T dy = dt[e], ge = gate[static_cast<std::size_t>(e)];
                    const T sl = slope[static_cast<std::size_t>(e)];
                    if (combine == GateCombine::Multiplicative) {
                        dzr[e] += dy * t[e] * sl;
                        dt[e] = dy * ge;
                    } else if (combine == GateCombine::Additive) {
                        dzr[e] += dy * sl;
                    } else {  // g·y + (1 − g)·x
                        dzr[e] += dy * (t[e] - xr[e]) * sl;
                        dt[e] = dy * ge;
                        dxr[e] += dy * (T(1) - ge);
                    }
                }
            } else if (elem) {  // head-shared: act(mean over heads of the logits)
                for (Index e = 0; e < width; ++e) {
                    T acc = 0;
                    for (Index h = 0; h < heads; ++h) acc += zr[h * width + e];
                    mean[static_cast<std::size_t>(e)] = acc / T(heads);
                }
                activation_and_slope(g.activation, mean.data(), gate.data(), slope.data(), width);
                for (Index e = 0; e < width; ++e) {
                    T acc = 0;
                    for (Index h = 0; h < heads; ++h) {
                        const Index i = h * width + e;
                        if (combine == GateCombine::Multiplicative) {
                            acc += dt[i] * t[i];
                            dt[i] *= gate[static_cast<std::size_t>(e)];
                        } else {
                            acc += dt[i];
                        }
                    }
                    const T dm = acc * slope[static_cast<std::size_t>(e)] / T(heads);
                    for (Index h = 0; h < heads; ++h) dzr[h * width + e] += dm;
                }
            } else {  // headwise: one gate per head
                activation_and_slope(g.activation, zr, gate.data(), slope.data(), heads);
                for (Index h = 0; h < heads; ++h) {
                    T acc = 0;
                    for (Index e = 0; e < width; ++e) {
                        const Index i = h * width + e;
                        if (combine == GateCombine::Multiplicative) {
                            acc += dt[i] * t[i];
                            dt[i] *= gate[static_cast<std::size_t>(h)];
                        } else {
                            acc += dt[i];
                        }
                    }
                    dzr[h] += acc * slope[static_cast<std::size_t>(h)];
                }
            }
        }
    }

    /// The backward of rms_norm_heads for rows of `heads` heads of d_k: x the norm's input,
    /// dy (in place) ∂L/∂y becoming ∂L/∂x; ∂L/∂w is added to d_weight.
    /// y = x·r·w', r = 1/√(mean(x²) + ε), w' = w (+1 zero-centred):
    /// ∂L/∂x_e = r·w'_e·dy_e − x_e·r³/d·Σ_j dy_j·w'_j·x_j,  ∂L/∂w_e = Σ dy_e·x_e·r.
    void rms_norm_heads_backward(const T* x, Index x_stride, T* dy, Index dy_stride, Index rows, Index heads,
                                 const Vector<T>& weight, Vector<T>& d_weight) const {
        const Index d = m_config.d_k();
        const T offset = m_config.qk_norm == QkNorm::ZeroCentredRmsNorm ? T(1) : T(0);
        for (Index r = 0; r < rows; ++r)
            for (Index h = 0; h < heads; ++h) {
                const T* v = x + r * x_stride + h * d;
                T* dv = dy + r * dy_stride + h * d;
                T sum = 0, dot = 0;
                for (Index e = 0; e < d; ++e) sum += v[e] * v[e];
                const T inv = T(1) / std::sqrt(sum / T(d) + T(m_config.rms_norm_eps));
                for (Index e = 0; e < d; ++e) {
                    dot += dv[e] * (offset + weight[e]) * v[e];
                    d_weight[e] += dv[e] * v[e] * inv;
                }
                const T k = dot * inv * inv * inv / T(d);
                for (Index e = 0; e < d; ++e) dv[e] = inv * (offset + weight[e]) * dv[e] - v[e] * k;
            }
    }

    /// Gate logits of one head in a row: `width` (the head's values) elementwise, 1 headwise.
    Index gate_logits_per_head(Index width) const noexcept {
        return m_config.gate.granularity == GateGranularity::Elementwise ? width : 1;
    }

    /// Applies the head-specific gate of head h to its `width` values y; z_row holds the row's
    /// logits (gate_logits_per_head(width) per head). Elementwise, each value's result does not
    /// depend on where its run of values starts, so a head at a time equals a row at a time.
    void gate_head(T* y, const T* z_row, Index h, Index width) const {
        const GateSpec& g = m_config.gate;
        const T* zh = z_row + h * gate_logits_per_head(width);
        if (g.granularity == GateGranularity::Elementwise) {
            apply_gate(g.activation, g.combine, y, zh, static_cast<const T*>(nullptr), static_cast<T*>(nullptr),
                       static_cast<std::size_t>(width));
            return;
        }
        T gh;
        activate(g.activation, zh, &gh, 1);
        if (g.combine == GateCombine::Additive)
            for (Index e = 0; e < width; ++e) y[e] += gh;
        else
            simd::scale(gh, y, static_cast<std::size_t>(width));
    }

    AttentionConfig m_config;
    LayerId m_id = detail::next_layer_id();
    Projection<Scalar> m_in;    // [W_q; W_k; W_v]: [H·d_k + H_kv·d_k + H_kv·d_v, D], biases if any
    Projection<Scalar> m_gate;  // W_g: [gate_width, D] (input-sourced gate)
    Projection<Scalar> m_o;     // W_o: [D, H·d_v]
    RowMatrix<T> m_gate_query;  // [H, d_k] (query-sourced gate)
    Vector<T> m_gate_query_bias;
    RowMatrix<T> m_gate_theta;     // [H, d_v] (input-independent gate)
    std::vector<T> m_sinks;        // [H] sink logits (config.sinks), as SdpaOptions takes them
    Vector<T> m_q_norm, m_k_norm;  // [d_k] qk_norm weights
};

GATTN_END_ISA_NAMESPACE
