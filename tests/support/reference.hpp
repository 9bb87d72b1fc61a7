// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Float64 reference implementations for the tests, written from the math alone (paper
/// arXiv:2505.06708 §2–3 and docs/conventions.md) with plain loops and a three-pass
/// softmax (max, exp-sum, normalise). Nothing here shares code with the library's kernels, so a
/// mistake in the library shows up as a disagreement.
///
/// Shapes follow the library: activations are row-major [B·N, heads·d] matrices, weights are
/// nn.Linear [out_features, in_features] with y = x Wᵀ + b.

#include <cmath>
#include <cstddef>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "gattn/gates/gate_spec.hpp"
#include "gattn/layers/attention_config.hpp"
#include "gattn/layers/gated_multi_head_attention.hpp"
#include "gattn/types.hpp"

namespace gattn_test {

using gattn::Index;
using Mat = gattn::RowMatrix<double>;
using Vec = gattn::Vector<double>;

inline constexpr double kInf = std::numeric_limits<double>::infinity();

/// Masks of one reference attention call. The boolean mask and the bias are dense
/// [B, H, N_q, N_k] (row-major); broadcasting is done by the caller. Empty = not given.
struct RefMasks {
    bool causal = false;                  ///< j ≤ i', the aligned query position:
    bool top_left = false;                ///< i' = i (else i + L_b − Q_b, bottom-right)
    std::vector<Index> query_offsets;     ///< B entries: i' = query_offsets[b] + i (over the above)
    std::optional<Index> sliding_window;  ///< w ≥ 1, counting the diagonal
    std::vector<Index> key_lengths;       ///< B entries; empty = N_k for every sequence
    std::vector<Index> query_lengths;     ///< B entries; rows past Q_b see nothing; empty = N_q
    std::vector<bool> bool_mask;          ///< true = attend
    std::vector<double> bias;             ///< added to the scaled logit; −∞ masks the key
    std::vector<double> sinks;            ///< H learned sink logits (gpt-oss); empty = none
    std::optional<double> softcap;        ///< c: logit ← c·tanh(logit / c) before ALiBi and bias
    std::vector<double> alibi_slopes;     ///< H slopes m_h: logit −= m_h·|i' − j|; empty = none
};

/// Results of sdpa_reference.
struct SdpaRefResult {
    Mat out;            ///< [B·N_q, H·d_v]
    Mat log_sum_exp;    ///< [B·N_q, H], −∞ for a row with no visible key
    Mat probabilities;  ///< [B·H·N_q, N_k], row (b·H + h)·N_q + i
    Mat first_key;      ///< [B·N_q, H], probability on key 0
};

/// The aligned position i' of query i of sequence b (where the causal diagonal sits).
inline Index aligned_position(const RefMasks& m, Index b, Index i, Index Nq, Index Nk) {
    const Index L = m.key_lengths.empty() ? Nk : m.key_lengths[static_cast<std::size_t>(b)];
    const Index Q = m.query_lengths.empty() ? Nq : m.query_lengths[static_cast<std::size_t>(b)];
    return !m.query_offsets.empty() ? m.query_offsets[static_cast<std::size_t>(b)] + i : m.top_left ? i : i + L - Q;
}

/// Whether key j is visible to query i of head h in sequence b. With include_bias = false an
/// −∞ bias entry does not count as masking (used to find keys that structural masks hide).
inline bool key_visible(const RefMasks& m, Index H, Index b, Index h, Index i, Index j, Index Nq,
                        Index Nk, bool include_bias = true) {
    const Index L = m.key_lengths.empty() ? Nk : m.key_lengths[static_cast<std::size_t>(b)];
    const Index Q = m.query_lengths.empty() ? Nq : m.query_lengths[static_cast<std::size_t>(b)];
    if (j >= L || i >= Q) return false;
    const Index ip = aligned_position(m, b, i, Nq, Nk);
    if (m.causal && j > ip) return false;
    if (m.sliding_window) {
        const Index w = *m.sliding_window;
        if (!(ip - w < j)) return false;
        if (!m.causal && !(j < ip + w)) return false;
    }
    const std::size_t at = static_cast<std::size_t>(((b * H + h) * Nq + i) * Nk + j);
    if (!m.bool_mask.empty() && !m.bool_mask[at]) return false;
    if (include_bias && !m.bias.empty() && m.bias[at] == -kInf) return false;
    return true;
}

/// softmax(ALiBi(softcap(scale · Q Kᵀ)) + bias) V per head, query head h reading KV head h / (H / H_kv).
/// query [B·N_q, H·d_k], key [B·N_k, H_kv·d_k], value [B·N_k, H_kv·d_v]. Masked keys are
/// skipped (their K and V are never read); a row with no visible key gives 0 and lse −∞.
inline SdpaRefResult sdpa_reference(const Mat& query, const Mat& key, const Mat& value, Index B,
                                    Index H, Index Hkv, std::optional<double> scale = {},
                                    const RefMasks& masks = {}) {
    if (B < 1 || H < 1 || Hkv < 1 || H % Hkv != 0)
        throw std::invalid_argument("sdpa_reference: bad batch or head counts");
    const Index dk = query.cols() / H;
    const Index dv = value.cols() / Hkv;
    const Index Nq = query.rows() / B;
    const Index Nk = key.rows() / B;
    if (query.cols() != H * dk || key.cols() != Hkv * dk || value.rows() != key.rows() ||
        value.cols() != Hkv * dv || query.rows() != B * Nq || key.rows() != B * Nk)
        throw std::invalid_argument("sdpa_reference: inconsistent shapes");
    const std::size_t dense = static_cast<std::size_t>(B * H * Nq * Nk);
    if ((!masks.bool_mask.empty() && masks.bool_mask.size() != dense) ||
        (!masks.bias.empty() && masks.bias.size() != dense))
        throw std::invalid_argument("sdpa_reference: dense masks must be [B, H, Nq, Nk]");
    const double s = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(dk));
    const Index group = H / Hkv;

    SdpaRefResult r;
    r.out = Mat::Zero(B * Nq, H * dv);
    r.log_sum_exp = Mat::Constant(B * Nq, H, -kInf);
    r.probabilities = Mat::Zero(B * H * Nq, Nk);
    r.first_key = Mat::Zero(B * Nq, H);

    std::vector<double> logit(static_cast<std::size_t>(Nk));
    std::vector<char> visible(static_cast<std::size_t>(Nk));
    for (Index b = 0; b < B; ++b) {
        for (Index h = 0; h < H; ++h) {
            const Index g = h / group;
            for (Index i = 0; i < Nq; ++i) {
                const Index qrow = b * Nq + i;
                bool any = false;
                for (Index j = 0; j < Nk; ++j) {
                    visible[j] = key_visible(masks, H, b, h, i, j, Nq, Nk);
                    if (!visible[j]) continue;
                    any = true;
                    double dot = 0.0;
                    for (Index d = 0; d < dk; ++d)
                        dot += query(qrow, h * dk + d) * key(b * Nk + j, g * dk + d);
                    double z = dot * s;
                    if (masks.softcap) z = *masks.softcap * std::tanh(z / *masks.softcap);
                    if (!masks.alibi_slopes.empty())
                        z -= masks.alibi_slopes[static_cast<std::size_t>(h)] *
                             std::abs(static_cast<double>(aligned_position(masks, b, i, Nq, Nk) - j));
                    if (!masks.bias.empty())
                        z += masks.bias[static_cast<std::size_t>(((b * H + h) * Nq + i) * Nk + j)];
                    logit[j] = z;
                }
                // A sink joins the softmax's denominator with no value: e^(s_h − m) more in the sum.
                const double sink = masks.sinks.empty() ? -kInf : masks.sinks[static_cast<std::size_t>(h)];
                if (!any) {  // all-zero output; lse −∞, or the sink's logit alone
                    r.log_sum_exp(qrow, h) = sink;
                    continue;
                }
                // Pass 1: max.
                double mx = sink;
                for (Index j = 0; j < Nk; ++j)
                    if (visible[j] && logit[j] > mx) mx = logit[j];
                // Pass 2: sum of exponentials.
                double sum = sink == -kInf ? 0.0 : std::exp(sink - mx);
                for (Index j = 0; j < Nk; ++j)
                    if (visible[j]) sum += std::exp(logit[j] - mx);
                // Pass 3: normalise and accumulate V.
                const Index prow = (b * H + h) * Nq + i;
                for (Index j = 0; j < Nk; ++j) {
                    if (!visible[j]) continue;
                    const double p = std::exp(logit[j] - mx) / sum;
                    r.probabilities(prow, j) = p;
                    for (Index d = 0; d < dv; ++d)
                        r.out(qrow, h * dv + d) += p * value(b * Nk + j, g * dv + d);
                }
                r.log_sum_exp(qrow, h) = mx + std::log(sum);
                r.first_key(qrow, h) = r.probabilities(prow, 0);
            }
        }
    }
    return r;
}

/// Gate activations in float64.
inline double ref_sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

inline double ref_activation(gattn::GateActivation a, double z) {
    switch (a) {
        case gattn::GateActivation::Sigmoid: return ref_sigmoid(z);
        case gattn::GateActivation::SiLU: return z * ref_sigmoid(z);
        case gattn::GateActivation::NonSparseSigmoid: return 0.5 + 0.5 * ref_sigmoid(z);
    }
    return std::numeric_limits<double>::quiet_NaN();
}

/// y = x Wᵀ + b with W [out, in] (b may be empty).
inline Mat ref_linear(const Mat& x, const Mat& W, const Vec& b) {
    if (x.cols() != W.cols() || (b.size() != 0 && b.size() != W.rows()))
        throw std::invalid_argument("ref_linear: shape mismatch");
    Mat y(x.rows(), W.rows());
    for (Index t = 0; t < x.rows(); ++t)
        for (Index o = 0; o < W.rows(); ++o) {
            double acc = b.size() ? b(o) : 0.0;
            for (Index k = 0; k < x.cols(); ++k) acc += x(t, k) * W(o, k);
            y(t, o) = acc;
        }
    return y;
}

/// The weights converted to float64 (so that the reference sees exactly the library's inputs).
template <class Scalar>
gattn::AttentionWeights<double> weights_to_double(const gattn::AttentionWeights<Scalar>& w) {
    return w.template cast<double>();
}

/// Results of layer_reference.
struct LayerRefResult {
    Mat y;                    ///< [B·N, D]
    Mat gate_scores;          ///< activated gate values, layout of ForwardTrace::gate_scores
    Mat first_key_attention;  ///< [B·N, H]
    Mat probabilities;        ///< [B·H·N, N]
    Mat gate_logits;          ///< logits before sharing and activation (diagnostics)
};

/// The whole gated attention layer in float64 for any valid gate spec:
///   Q = X W_qᵀ + b_q, K = X W_kᵀ + b_k, V = X W_vᵀ + b_v (fused gate rows split out of q_proj),
///   q/k RMSNorm and RoPE of Q and K when configured (positions: given, or t within the sequence),
///   G2/G3/G4 gate V/K/Q, U = SDPA(Q, K, V) with the config's causal flag, window and scale plus
///   the given token lengths (padding tokens are neither keys nor queries: their U is 0) and
///   dense [B, H, N, N] masks, G1 gates U, A = U W_oᵀ + b_o, G5 gates A.
inline LayerRefResult layer_reference(const gattn::AttentionConfig& c,
                                      const gattn::AttentionWeights<double>& w, const Mat& x,
                                      Index batch, const std::vector<Index>& key_lengths = {},
                                      const std::vector<bool>& bool_mask = {},
                                      const std::vector<double>& bias = {},
                                      const std::vector<Index>& positions = {}) {
    using namespace gattn;
    const GateSpec& gs = c.gate;
    const Index D = c.d_model, H = c.num_heads, Hkv = c.num_kv_heads;
    const Index dk = c.head_dim, dv = c.value_head_dim > 0 ? c.value_head_dim : c.head_dim;
    const Index T = x.rows();
    const Index group = H / Hkv;
    const bool gated = gs.position != GatePosition::None;
    const bool elem = gs.granularity == GateGranularity::Elementwise;
    const bool shared = gs.sharing == GateSharing::HeadShared;
    if (x.cols() != D) throw std::invalid_argument("layer_reference: x has the wrong width");

    // Projections. q_all holds every q_proj output row (query and, when fused, gate rows).
    const Mat q_all = ref_linear(x, w.q_proj_weight, w.q_proj_bias);
    Mat K = ref_linear(x, w.k_proj_weight, w.k_proj_bias);
    Mat V = ref_linear(x, w.v_proj_weight, w.v_proj_bias);

    // Split q_proj output into the query [T, H·dk] and, for fused layouts, gate logits
    // [T, H·gw] in head order, gw = dv (elementwise) or 1 (headwise).
    Mat Q(T, H * dk);
    Mat z;  // gate logits, head order
    const bool fused = gated && gs.layout != GateLayout::Separate;
    if (!fused) {
        if (q_all.cols() != H * dk) throw std::invalid_argument("layer_reference: q_proj rows");
        Q = q_all;
    } else {
        const Index gw = elem ? dv : 1;
        if (q_all.cols() != H * (dk + gw)) throw std::invalid_argument("layer_reference: q_proj rows");
        z.resize(T, H * gw);
        for (Index t = 0; t < T; ++t) {
            if (gs.layout == GateLayout::PerHeadInterleaved) {
                // Per head h: [dk query rows | gw gate rows].
                for (Index h = 0; h < H; ++h) {
                    const Index base = h * (dk + gw);
                    for (Index d = 0; d < dk; ++d) Q(t, h * dk + d) = q_all(t, base + d);
                    for (Index e = 0; e < gw; ++e) z(t, h * gw + e) = q_all(t, base + dk + e);
                }
            } else {
                // Per KV group g: [G·dk query rows of heads gG..gG+G-1 | their G·gw gate rows].
                for (Index g = 0; g < Hkv; ++g) {
                    const Index base = g * group * (dk + gw);
                    for (Index r = 0; r < group; ++r) {
                        const Index h = g * group + r;
                        for (Index d = 0; d < dk; ++d) Q(t, h * dk + d) = q_all(t, base + r * dk + d);
                        for (Index e = 0; e < gw; ++e)
                            z(t, h * gw + e) = q_all(t, base + group * dk + r * gw + e);
                    }
                }
            }
        }
    }

    // q/k RMSNorm per head, then RoPE (NeoX pairs (i, i + r/2), GPT-J pairs (2i, 2i + 1)),
    // θ_i = θ^(−2i/r), at each token's position (given, or t within its sequence).
    if (c.qk_norm != QkNorm::None) {
        const double offset = c.qk_norm == QkNorm::ZeroCentredRmsNorm ? 1.0 : 0.0;
        auto norm = [&](Mat& m, Index heads, const Vec& weight) {
            for (Index t = 0; t < T; ++t)
                for (Index h = 0; h < heads; ++h) {
                    double ms = 0.0;
                    for (Index d = 0; d < dk; ++d) ms += m(t, h * dk + d) * m(t, h * dk + d);
                    const double inv = 1.0 / std::sqrt(ms / static_cast<double>(dk) + c.rms_norm_eps);
                    for (Index d = 0; d < dk; ++d) m(t, h * dk + d) *= inv * (offset + weight(d));
                }
        };
        norm(Q, H, w.q_norm_weight);
        norm(K, Hkv, w.k_norm_weight);
    }
    if (c.rotary_dim > 0) {
        const Index r = c.rotary_dim, N = T / batch;
        auto rotate = [&](Mat& m, Index heads) {
            for (Index t = 0; t < T; ++t) {
                const double p = positions.empty() ? static_cast<double>(t % N) : static_cast<double>(positions[t]);
                for (Index h = 0; h < heads; ++h)
                    for (Index i = 0; i < r / 2; ++i) {
                        const double angle = p * std::pow(c.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(r));
                        const Index a = h * dk + (c.rope_style == RopeStyle::GptJ ? 2 * i : i);
                        const Index b = a + (c.rope_style == RopeStyle::GptJ ? 1 : r / 2);
                        const double xa = m(t, a), xb = m(t, b);
                        m(t, a) = xa * std::cos(angle) - xb * std::sin(angle);
                        m(t, b) = xb * std::cos(angle) + xa * std::sin(angle);
                    }
            }
        };
        rotate(Q, H);
        rotate(K, Hkv);
    }

    // Separate gate logits.
    if (gated && !fused) {
        switch (gs.source) {
            case GateSource::Input: z = ref_linear(x, w.gate_proj_weight, w.gate_proj_bias); break;
            case GateSource::Query:
                // z[t, h] = w_h · q_h(t) + b_h from the query (q_proj output incl. its bias,
                // after qk_norm and RoPE when configured).
                z.resize(T, H);
                for (Index t = 0; t < T; ++t)
                    for (Index h = 0; h < H; ++h) {
                        double acc = w.gate_proj_bias.size() ? w.gate_proj_bias(h) : 0.0;
                        for (Index d = 0; d < dk; ++d) acc += w.gate_proj_weight(h, d) * Q(t, h * dk + d);
                        z(t, h) = acc;
                    }
                break;
            case GateSource::InputIndependent:
                z.resize(1, H * dv);
                for (Index h = 0; h < H; ++h)
                    for (Index d = 0; d < dv; ++d) z(0, h * dv + d) = w.gate_theta(h, d);
                break;
        }
    }

    // Activated gate values. Head-shared gates average their logits over the heads first.
    Mat gate;  // as reported: shared → [rows, width of one head]
    LayerRefResult res;
    if (gated) {
        res.gate_logits = z;
        Mat zz = z;
        if (shared) {
            const Index nh = gs.position == GatePosition::G1 ? H : Hkv;
            const Index width = z.cols() / nh;
            zz = Mat::Zero(z.rows(), width);
            for (Index t = 0; t < z.rows(); ++t)
                for (Index e = 0; e < width; ++e) {
                    double acc = 0.0;
                    for (Index h = 0; h < nh; ++h) acc += z(t, h * width + e);
                    zz(t, e) = acc / static_cast<double>(nh);
                }
        }
        gate.resize(zz.rows(), zz.cols());
        for (Index t = 0; t < zz.rows(); ++t)
            for (Index e = 0; e < zz.cols(); ++e) gate(t, e) = ref_activation(gs.activation, zz(t, e));
        res.gate_scores = gate;
    }

    // Gate value for token t, head h, element d of a target with `width` per head.
    auto gate_at = [&](Index t, Index h, Index d, Index width) {
        const Index row = gate.rows() == 1 ? 0 : t;
        if (shared) return gate(row, d);
        if (!elem) return gate(row, h);
        return gate(row, h * width + d);
    };
    auto multiply_heads = [&](Mat& target, Index heads, Index width) {
        for (Index t = 0; t < T; ++t)
            for (Index h = 0; h < heads; ++h)
                for (Index d = 0; d < width; ++d) target(t, h * width + d) *= gate_at(t, h, d, width);
    };

    if (gs.position == GatePosition::G2) multiply_heads(V, Hkv, dv);
    if (gs.position == GatePosition::G3) multiply_heads(K, Hkv, dk);
    if (gs.position == GatePosition::G4) multiply_heads(Q, H, dk);

    RefMasks masks;
    masks.causal = c.causal;
    masks.sliding_window = c.sliding_window;
    masks.key_lengths = key_lengths;  // the layer's lengths count tokens: keys and queries
    masks.query_lengths = key_lengths;
    masks.bool_mask = bool_mask;
    masks.bias = bias;
    if (c.sinks) masks.sinks.assign(w.sinks.data(), w.sinks.data() + w.sinks.size());
    if (c.logit_softcap > 0) masks.softcap = c.logit_softcap;
    if (c.alibi) masks.alibi_slopes = gattn::alibi_slopes<double>(H);  // powers of 2 for H = 2^k: exact in float
    const SdpaRefResult att = sdpa_reference(Q, K, V, batch, H, Hkv, c.scale, masks);
    Mat U = att.out;
    res.first_key_attention = att.first_key;
    res.probabilities = att.probabilities;

    if (gs.position == GatePosition::G1) {
        for (Index t = 0; t < T; ++t)
            for (Index h = 0; h < H; ++h)
                for (Index d = 0; d < dv; ++d) {
                    const double g = gate_at(t, h, d, dv);
                    double& u = U(t, h * dv + d);
                    u = gs.combine == GateCombine::Additive ? u + g : u * g;
                }
    }

    Mat Y = ref_linear(U, w.o_proj_weight, w.o_proj_bias);

    if (gs.position == GatePosition::G5) {
        for (Index t = 0; t < T; ++t)
            for (Index o = 0; o < D; ++o) {
                const double g = gate(t, o);
                Y(t, o) = gs.combine == GateCombine::ResidualMix ? g * Y(t, o) + (1.0 - g) * x(t, o)
                                                                : Y(t, o) * g;
            }
    }
    res.y = Y;
    return res;
}

}  // namespace gattn_test
