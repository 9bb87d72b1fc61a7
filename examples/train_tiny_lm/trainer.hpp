// SPDX-License-Identifier: Apache-2.0
#pragma once

// Trains the demo's tiny byte-level language models (examples/tiny_lm) as
// scripts/train_tiny_lm.py does: the embedding, zero-centred RMSNorm, SwiGLU MLP, LM head,
// softmax cross-entropy, gradient clipping and AdamW with warmup and cosine decay are written
// here plainly with Eigen, forward and backward; attention is gattn's GatedMultiHeadAttention
// (forward_train / backward) built from each layer's Qwen3-Next weights
// (gattn/models/qwen3_next_training.hpp). Scalar is double (the check against the script's
// float64 run) or float (training).
//
//   x_0 = embed_tokens[token]
//   per layer:  h = x + self_attn(input_layernorm(x))
//               x = h + down_proj(silu(gate_proj(z)) ⊙ up_proj(z)),  z = post_attention_layernorm(h)
//   logits = lm_head(norm(x)),  loss = mean over tokens of −log softmax(logits)[next byte]
//   RMSNorm(x) = x / √(mean(x²) + ε) · (1 + w)

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <gattn/gattn.hpp>
#include <gattn/io/hf_checkpoint.hpp>
#include <gattn/models/qwen3_next_training.hpp>

namespace train_tiny_lm {

using gattn::Index;
template <class S>
using Matrix = gattn::RowMatrix<S>;

/// The model's shape, from the config.json keys examples/tiny_lm reads.
struct ModelConfig {
    Index vocab = 0, hidden = 0, intermediate = 0, layers = 0, context = 0;
    double eps = 1e-6;
    gattn::Qwen3NextConfig attention;  ///< the layers' attention (gate, sinks, heads, RoPE)
    nlohmann::json json;               ///< the file as read, written back beside trained weights

    /// Reads `path` (config.json). Throws gattn::io_error for a missing or malformed file.
    static ModelConfig load(const std::string& path) {
        ModelConfig c;
        c.attention = gattn::load_qwen3_next_config(path);  // refuses a file that is not a JSON config
        std::ifstream in(path);
        c.json = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
        auto field = [&](const char* key, bool integer) -> const nlohmann::json& {
            if (!c.json.contains(key) || !(integer ? c.json[key].is_number_integer() : c.json[key].is_number()))
                throw gattn::io_error("train_tiny_lm: " + path + ": \"" + key + "\" is missing or not " +
                                      (integer ? "an integer" : "a number"));
            return c.json[key];
        };
        c.vocab = field("vocab_size", true).get<Index>();
        c.hidden = field("hidden_size", true).get<Index>();
        c.intermediate = field("intermediate_size", true).get<Index>();
        c.layers = field("num_hidden_layers", true).get<Index>();
        c.context = field("max_position_embeddings", true).get<Index>();
        c.eps = field("rms_norm_eps", false).get<double>();
        return c;
    }

    /// Every parameter's HF name and shape ({n} for a vector), in the script's order.
    std::vector<std::pair<std::string, std::vector<Index>>> parameter_shapes() const {
        const auto& a = attention;
        const Index H = a.num_attention_heads, Hkv = a.num_key_value_heads, d = a.head_dim, D = hidden;
        std::vector<std::pair<std::string, std::vector<Index>>> s{{"model.embed_tokens.weight", {vocab, D}}};
        for (Index l = 0; l < layers; ++l) {
            const std::string p = "model.layers." + std::to_string(l) + ".";
            s.push_back({p + "input_layernorm.weight", {D}});
            s.push_back({p + "self_attn.q_proj.weight", {(a.attn_output_gate ? 2 : 1) * H * d, D}});
            s.push_back({p + "self_attn.k_proj.weight", {Hkv * d, D}});
            s.push_back({p + "self_attn.v_proj.weight", {Hkv * d, D}});
            s.push_back({p + "self_attn.o_proj.weight", {D, H * d}});
            s.push_back({p + "self_attn.q_norm.weight", {d}});
            s.push_back({p + "self_attn.k_norm.weight", {d}});
            if (a.attention_sinks) s.push_back({p + "self_attn.sinks", {H}});
            s.push_back({p + "post_attention_layernorm.weight", {D}});
            s.push_back({p + "mlp.gate_proj.weight", {intermediate, D}});
            s.push_back({p + "mlp.up_proj.weight", {intermediate, D}});
            s.push_back({p + "mlp.down_proj.weight", {D, intermediate}});
        }
        s.push_back({"model.norm.weight", {D}});
        s.push_back({"lm_head.weight", {vocab, D}});
        return s;
    }
};

/// The optimiser and its schedule (scripts/train_tiny_lm.py's constants).
struct Hyper {
    Index steps = 1500;  ///< length of the schedule
    Index batch = 16;    ///< windows per step
    Index window = 257;  ///< bytes per window (context + 1)
    double peak_lr = 3e-3, min_lr_ratio = 0.1;
    Index warmup_steps = 100;
    double weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, adam_eps = 1e-8, grad_clip = 1.0;

    /// Linear warmup to peak_lr, then cosine decay to peak_lr · min_lr_ratio; step is 1-based.
    double learning_rate(Index step) const {
        if (step <= warmup_steps) return peak_lr * static_cast<double>(step) / static_cast<double>(warmup_steps);
        const double progress = static_cast<double>(step - warmup_steps) /
                                static_cast<double>(std::max<Index>(1, steps - warmup_steps));
        const double pi = 3.14159265358979323846;
        return peak_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + std::cos(pi * progress)));
    }

    /// Reads the keys training.json of a fixture holds (those absent keep their defaults).
    static Hyper from_json(const nlohmann::json& j) {
        Hyper h;
        h.steps = j.value("steps", h.steps);
        h.batch = j.value("batch", h.batch);
        h.window = j.value("window", h.window);
        h.peak_lr = j.value("peak_lr", h.peak_lr);
        h.min_lr_ratio = j.value("min_lr_ratio", h.min_lr_ratio);
        h.warmup_steps = j.value("warmup_steps", h.warmup_steps);
        h.weight_decay = j.value("weight_decay", h.weight_decay);
        if (j.contains("betas")) {
            h.beta1 = j["betas"][0].get<double>();
            h.beta2 = j["betas"][1].get<double>();
        }
        h.adam_eps = j.value("adam_eps", h.adam_eps);
        h.grad_clip = j.value("grad_clip", h.grad_clip);
        return h;
    }
};

/// One named parameter (a vector is a [1, n] matrix) with its gradient and AdamW moments.
template <class S>
struct Parameter {
    std::string name;
    bool is_vector = false;  ///< 1-D in the checkpoint: not decayed
    Matrix<S> value, grad, exp_avg, exp_avg_sq;
};

/// RMSNorm forward over rows: y = x · r · (1 + w), r = 1 / √(mean(x²) + ε); returns r per row.
template <class S>
gattn::Vector<S> rms_norm(const Matrix<S>& x, const Matrix<S>& w, double eps, Matrix<S>& y) {
    const Index D = x.cols();
    gattn::Vector<S> r(x.rows());
    y.resize(x.rows(), D);
    const auto scale = (w.row(0).array() + S(1)).matrix();
    for (Index i = 0; i < x.rows(); ++i) {
        r(i) = S(1) / std::sqrt(x.row(i).squaredNorm() / static_cast<S>(D) + static_cast<S>(eps));
        y.row(i) = (x.row(i) * r(i)).cwiseProduct(scale);
    }
    return r;
}

/// RMSNorm backward: adds ∂L/∂x to dx and ∂L/∂w to dw, from dy and the forward's x and r.
template <class S>
void rms_norm_backward(const Matrix<S>& x, const gattn::Vector<S>& r, const Matrix<S>& w, const Matrix<S>& dy,
                       Matrix<S>& dx, Matrix<S>& dw) {
    const Index D = x.cols();
    const auto scale = (w.row(0).array() + S(1)).matrix();
    for (Index i = 0; i < x.rows(); ++i) {
        const auto g = dy.row(i).cwiseProduct(scale);  // ∂L/∂(x·r)
        const S dot = g.dot(x.row(i));
        dx.row(i) += r(i) * g - x.row(i) * (r(i) * r(i) * r(i) * dot / static_cast<S>(D));
        dw.row(0) += dy.row(i).cwiseProduct(x.row(i)) * r(i);
    }
}

/// The model's weights, gradients and AdamW state; forward, backward and the optimiser step.
template <class S>
class Model {
public:
    /// Reads every parameter from a safetensors file (any float dtype, converted to S).
    /// Throws gattn::io_error / gattn::shape_error for a missing tensor or a wrong shape.
    Model(ModelConfig config, const std::string& weights_path) : m_config(std::move(config)) {
        const gattn::SafetensorsFile file(weights_path);
        for (const auto& [name, shape] : m_config.parameter_shapes()) {
            Parameter<S> p;
            p.name = name;
            p.is_vector = shape.size() == 1;
            if (p.is_vector) {
                const gattn::Vector<S> v = file.vector<S>(name);
                if (v.size() != shape[0])
                    throw gattn::shape_error("train_tiny_lm: " + name + ": expected " + std::to_string(shape[0]) +
                                             " entries, got " + std::to_string(v.size()));
                p.value = v.transpose();
            } else {
                p.value = file.matrix<S>(name);
                if (p.value.rows() != shape[0] || p.value.cols() != shape[1])
                    throw gattn::shape_error("train_tiny_lm: " + name + ": expected [" + std::to_string(shape[0]) +
                                             ", " + std::to_string(shape[1]) + "], got [" +
                                             std::to_string(p.value.rows()) + ", " + std::to_string(p.value.cols()) +
                                             "]");
            }
            p.grad = Matrix<S>::Zero(p.value.rows(), p.value.cols());
            p.exp_avg = p.grad;
            p.exp_avg_sq = p.grad;
            m_index[name] = m_params.size();
            m_params.push_back(std::move(p));
        }
    }

    /// Reads the AdamW moments NAME.exp_avg and NAME.exp_avg_sq of every parameter from a
    /// checkpoint (checkpoint_tensors) and sets the step count. Throws gattn::io_error for a
    /// missing tensor and gattn::shape_error for a wrong shape.
    void load_moments(const std::string& path, Index step) {
        const gattn::SafetensorsFile file(path);
        for (Parameter<S>& p : m_params)
            for (auto [suffix, target] : {std::pair{".exp_avg", &p.exp_avg}, std::pair{".exp_avg_sq", &p.exp_avg_sq}}) {
                Matrix<S> m = p.is_vector ? Matrix<S>(file.vector<S>(p.name + suffix).transpose())
                                          : file.matrix<S>(p.name + suffix);
                if (m.rows() != p.value.rows() || m.cols() != p.value.cols())
                    throw gattn::shape_error("train_tiny_lm: " + p.name + suffix + ": shape differs from the weight's");
                *target = std::move(m);
            }
        m_step = step;
    }

    const ModelConfig& config() const { return m_config; }
    std::vector<Parameter<S>>& parameters() { return m_params; }
    const std::vector<Parameter<S>>& parameters() const { return m_params; }
    Index step() const { return m_step; }
    void set_step(Index step) { m_step = step; }
    Parameter<S>& param(const std::string& name) { return m_params[m_index.at(name)]; }
    const Parameter<S>& param(const std::string& name) const { return m_params[m_index.at(name)]; }

    /// Mean cross-entropy of predicting tokens[b][t + 1] from tokens[b][0..t] over windows
    /// (B windows of N + 1 tokens, row-major [B, N + 1]); with `train`, also fills every
    /// parameter's gradient (replacing what it held).
    /// Throws std::invalid_argument, before anything changes, for batch < 1, windows not
    /// [batch, N + 1] with N ≥ 1, or a token outside [0, vocab).
    double loss(const std::vector<std::int64_t>& windows, Index batch, bool train) {
        const Index D = m_config.hidden, V = m_config.vocab, L = m_config.layers;
        const Index size = static_cast<Index>(windows.size());
        if (batch < 1)
            throw std::invalid_argument("train_tiny_lm::Model::loss: batch: expected >= 1, got " +
                                        std::to_string(batch));
        if (size % batch != 0 || size / batch < 2)
            throw std::invalid_argument("train_tiny_lm::Model::loss: windows: expected batch (" +
                                        std::to_string(batch) + ") x (N + 1) tokens with N >= 1, got " +
                                        std::to_string(size));
        for (std::size_t i = 0; i < windows.size(); ++i)
            if (windows[i] < 0 || windows[i] >= V)
                throw std::invalid_argument("train_tiny_lm::Model::loss: windows: expected tokens in [0, " +
                                            std::to_string(V) + "), got " + std::to_string(windows[i]) + " at " +
                                            std::to_string(i));
        const Index span = size / batch, N = span - 1, rows = batch * N;
        const double eps = m_config.eps;
        std::vector<Index> inputs(static_cast<std::size_t>(rows)), targets(inputs.size());
        for (Index b = 0; b < batch; ++b)
            for (Index t = 0; t < N; ++t) {
                inputs[b * N + t] = windows[b * span + t];
                targets[b * N + t] = windows[b * span + t + 1];
            }
        gattn::ForwardOptions<S> options;
        options.positions.resize(static_cast<std::size_t>(rows));
        for (Index r = 0; r < rows; ++r) options.positions[r] = r % N;

        const gattn::AttentionConfig attention_config = gattn::to_attention_config(m_config.attention);
        struct Saved {
            Matrix<S> x, z1, h, z2, g, u, m;
            gattn::Vector<S> r1, r2;
            gattn::ForwardActivations<S> attention;
        };
        std::vector<Saved> saved(static_cast<std::size_t>(L));
        std::vector<gattn::GatedMultiHeadAttention<S>> layers;
        layers.reserve(static_cast<std::size_t>(L));

        const Matrix<S>& embed = param("model.embed_tokens.weight").value;
        Matrix<S> x(rows, D), a(rows, D);
        for (Index r = 0; r < rows; ++r) x.row(r) = embed.row(inputs[r]);
        for (Index l = 0; l < L; ++l) {
            const std::string p = "model.layers." + std::to_string(l) + ".";
            Saved& s = saved[l];
            layers.emplace_back(attention_config, gattn::to_attention_weights(attention_weights(l)));
            s.r1 = rms_norm(x, param(p + "input_layernorm.weight").value, eps, s.z1);
            layers.back().forward_train(s.z1, batch, a, s.attention, options);
            s.h = x + a;
            s.r2 = rms_norm(s.h, param(p + "post_attention_layernorm.weight").value, eps, s.z2);
            s.g.noalias() = s.z2 * param(p + "mlp.gate_proj.weight").value.transpose();
            s.u.noalias() = s.z2 * param(p + "mlp.up_proj.weight").value.transpose();
            s.m = silu(s.g).cwiseProduct(s.u);
            s.x = std::move(x);
            x = s.h;
            x.noalias() += s.m * param(p + "mlp.down_proj.weight").value.transpose();
            if (!train) s = Saved{};  // nothing to keep
        }
        Matrix<S> zf;
        const gattn::Vector<S> rf = rms_norm(x, param("model.norm.weight").value, eps, zf);
        Matrix<S> logits(rows, V);
        logits.noalias() = zf * param("lm_head.weight").value.transpose();

        // Cross-entropy, and its gradient (softmax − one-hot) / rows in place of the logits.
        double total = 0;
        for (Index r = 0; r < rows; ++r) {
            auto row = logits.row(r);
            const S top = row.maxCoeff();
            const S sum = (row.array() - top).exp().sum();
            const S lse = top + std::log(sum);
            total += static_cast<double>(lse - row(targets[r]));
            if (train) {
                row = ((row.array() - lse).exp() / static_cast<S>(rows)).matrix();
                row(targets[r]) -= S(1) / static_cast<S>(rows);
            }
        }
        if (!train) return total / static_cast<double>(rows);

        for (Parameter<S>& p : m_params) p.grad.setZero();
        const Matrix<S>& d_logits = logits;
        param("lm_head.weight").grad.noalias() = d_logits.transpose() * zf;
        Matrix<S> dz(rows, D);
        dz.noalias() = d_logits * param("lm_head.weight").value;
        Matrix<S> dx = Matrix<S>::Zero(rows, D);
        rms_norm_backward(x, rf, param("model.norm.weight").value, dz, dx, param("model.norm.weight").grad);

        Matrix<S> dm, dg, du, dh, dz1(rows, D);
        for (Index l = L - 1; l >= 0; --l) {
            const std::string p = "model.layers." + std::to_string(l) + ".";
            Saved& s = saved[l];
            // MLP: x = h + m W_dᵀ, m = silu(g) ⊙ u.
            Parameter<S>& down = param(p + "mlp.down_proj.weight");
            Parameter<S>& gate = param(p + "mlp.gate_proj.weight");
            Parameter<S>& up = param(p + "mlp.up_proj.weight");
            down.grad.noalias() = dx.transpose() * s.m;
            dm.noalias() = dx * down.value;
            const auto sig = (S(1) / (S(1) + (-s.g.array()).exp())).eval();
            du = dm.cwiseProduct((s.g.array() * sig).matrix());
            dg = (dm.array() * s.u.array() * sig * (S(1) + s.g.array() * (S(1) - sig))).matrix();
            gate.grad.noalias() = dg.transpose() * s.z2;
            up.grad.noalias() = du.transpose() * s.z2;
            dz.noalias() = dg * gate.value;
            dz.noalias() += du * up.value;
            dh = dx;
            rms_norm_backward(s.h, s.r2, param(p + "post_attention_layernorm.weight").value, dz, dh,
                              param(p + "post_attention_layernorm.weight").grad);
            // Attention: h = x + self_attn(z1).
            gattn::AttentionWeights<S> grads;
            layers[l].backward(s.z1, s.attention, dh, grads, dz1);
            gattn::to_qwen3_next_weights(grads).for_each([&](const char* name, const auto* m) {
                if (m->size() == 0) return;
                Matrix<S>& target = param(p + "self_attn." + name).grad;
                if (target.rows() == 1 && m->cols() == 1)
                    target = m->transpose();
                else
                    target = *m;
            });
            dx = dh;
            rms_norm_backward(s.x, s.r1, param(p + "input_layernorm.weight").value, dz1, dx,
                              param(p + "input_layernorm.weight").grad);
            s = Saved{};
        }
        Matrix<S>& d_embed = param("model.embed_tokens.weight").grad;
        for (Index r = 0; r < rows; ++r) d_embed.row(inputs[r]) += dx.row(r);
        return total / static_cast<double>(rows);
    }

    /// Scales every gradient so that their joint L2 norm is at most max_norm (as
    /// torch.nn.utils.clip_grad_norm_: coefficient min(1, max_norm / (norm + 1e-6)), always
    /// applied). Returns the norm before clipping.
    double clip_gradients(double max_norm) {
        S sum = 0;
        for (const Parameter<S>& p : m_params) {
            const S n = p.grad.norm();
            sum += n * n;
        }
        const S total = std::sqrt(sum);
        const S coef = std::min(static_cast<S>(max_norm) / (total + static_cast<S>(1e-6)), S(1));
        for (Parameter<S>& p : m_params) p.grad *= coef;
        return static_cast<double>(total);
    }

    /// One AdamW step at learning rate lr (torch.optim.AdamW's arithmetic: decoupled decay on
    /// matrices and the embedding only, bias-corrected moments).
    void adamw_step(const Hyper& hp, double lr) {
        ++m_step;
        const double bc1 = 1 - std::pow(hp.beta1, static_cast<double>(m_step));
        const double bc2 = 1 - std::pow(hp.beta2, static_cast<double>(m_step));
        const S step_size = static_cast<S>(lr / bc1), bc2_sqrt = static_cast<S>(std::sqrt(bc2));
        const S b1 = static_cast<S>(hp.beta1), b2 = static_cast<S>(hp.beta2);
        for (Parameter<S>& p : m_params) {
            if (!p.is_vector) p.value *= static_cast<S>(1 - lr * hp.weight_decay);
            p.exp_avg = p.exp_avg * b1 + p.grad * static_cast<S>(1 - hp.beta1);
            p.exp_avg_sq.array() = p.exp_avg_sq.array() * b2 + p.grad.array().square() * static_cast<S>(1 - hp.beta2);
            p.value.array() -= step_size * p.exp_avg.array() /
                               (p.exp_avg_sq.array().sqrt() / bc2_sqrt + static_cast<S>(hp.adam_eps));
        }
    }

    /// One training step on B windows: loss, gradients, clipping, AdamW at step m_step + 1's
    /// learning rate. Returns the loss before the step.
    double train_step(const std::vector<std::int64_t>& windows, Index batch, const Hyper& hp) {
        const double value = loss(windows, batch, true);
        clip_gradients(hp.grad_clip);
        adamw_step(hp, hp.learning_rate(m_step + 1));
        return value;
    }

private:
    static Matrix<S> silu(const Matrix<S>& g) { return (g.array() / (S(1) + (-g.array()).exp())).matrix(); }

    gattn::Qwen3NextAttentionWeights<S> attention_weights(Index l) const {
        const std::string p = "model.layers." + std::to_string(l) + ".self_attn.";
        gattn::Qwen3NextAttentionWeights<S> w;
        w.q_proj_weight = param(p + "q_proj.weight").value;
        w.k_proj_weight = param(p + "k_proj.weight").value;
        w.v_proj_weight = param(p + "v_proj.weight").value;
        w.o_proj_weight = param(p + "o_proj.weight").value;
        w.q_norm_weight = param(p + "q_norm.weight").value.row(0).transpose();
        w.k_norm_weight = param(p + "k_norm.weight").value.row(0).transpose();
        if (m_config.attention.attention_sinks) w.sinks = param(p + "sinks").value.row(0).transpose();
        return w;
    }

    ModelConfig m_config;
    std::vector<Parameter<S>> m_params;
    std::map<std::string, std::size_t> m_index;
    Index m_step = 0;  ///< optimiser steps taken
};

// ---------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------

/// A tensor to write: dtype "F32", "F64" or "I64", its shape and little-endian bytes.
struct TensorBytes {
    std::string dtype;
    std::vector<Index> shape;
    std::string bytes;
};

/// Little-endian bytes of `values` as To (F32 from float or double, F64, I64).
template <class To, class From>
std::string to_bytes(const From* values, std::size_t count) {
    std::string out(count * sizeof(To), '\0');
    for (std::size_t i = 0; i < count; ++i) {
        const To v = static_cast<To>(values[i]);
        std::memcpy(&out[i * sizeof(To)], &v, sizeof(To));  // x86-64: little-endian
    }
    return out;
}

/// Writes a safetensors file (tensors in name order, 8-byte aligned header). Throws
/// gattn::io_error when the file cannot be written.
inline void write_safetensors(const std::string& path, const std::map<std::string, TensorBytes>& tensors,
                              const std::map<std::string, std::string>& metadata = {}) {
    nlohmann::json header = nlohmann::json::object();
    if (!metadata.empty()) header["__metadata__"] = metadata;
    std::size_t offset = 0;
    for (const auto& [name, t] : tensors) {
        header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
        offset += t.bytes.size();
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    std::ofstream out(path, std::ios::binary);
    if (!out) throw gattn::io_error("train_tiny_lm: cannot write " + path);
    const std::uint64_t n = text.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& [name, t] : tensors) out.write(t.bytes.data(), static_cast<std::streamsize>(t.bytes.size()));
    if (!out) throw gattn::io_error("train_tiny_lm: cannot write " + path);
}

/// The parameters as F32 tensors under their HF names (what examples/tiny_lm loads).
template <class S>
std::map<std::string, TensorBytes> weight_tensors(const Model<S>& model) {
    std::map<std::string, TensorBytes> out;
    for (const Parameter<S>& p : model.parameters())
        out[p.name] = {"F32",
                       p.is_vector ? std::vector<Index>{p.value.cols()}
                                   : std::vector<Index>{p.value.rows(), p.value.cols()},
                       to_bytes<float>(p.value.data(), static_cast<std::size_t>(p.value.size()))};
    return out;
}

/// A resumable checkpoint's tensors in the model's precision: each parameter under its HF name
/// and its AdamW moments under NAME.exp_avg and NAME.exp_avg_sq.
template <class S>
std::map<std::string, TensorBytes> checkpoint_tensors(const Model<S>& model) {
    const std::string dtype = std::is_same_v<S, double> ? "F64" : "F32";
    std::map<std::string, TensorBytes> out;
    for (const Parameter<S>& p : model.parameters()) {
        const std::vector<Index> shape = p.is_vector ? std::vector<Index>{p.value.cols()}
                                                     : std::vector<Index>{p.value.rows(), p.value.cols()};
        const auto n = static_cast<std::size_t>(p.value.size());
        out[p.name] = {dtype, shape, to_bytes<S>(p.value.data(), n)};
        out[p.name + ".exp_avg"] = {dtype, shape, to_bytes<S>(p.exp_avg.data(), n)};
        out[p.name + ".exp_avg_sq"] = {dtype, shape, to_bytes<S>(p.exp_avg_sq.data(), n)};
    }
    return out;
}

// ---------------------------------------------------------------------------
// Corpus (as scripts/train_tiny_lm.py's split_corpus)
// ---------------------------------------------------------------------------

/// CPython's random.Random(seed) for a small non-negative seed: MT19937 seeded by
/// init_by_array({seed}); below(n) is random._randbelow (getrandbits with rejection).
class PythonRandom {
public:
    explicit PythonRandom(std::uint32_t seed) {
        init_genrand(19650218u);
        std::size_t i = 1;
        for (int k = 624; k > 0; --k) {  // init_by_array with a key of one word, j always 0
            m_mt[i] = (m_mt[i] ^ ((m_mt[i - 1] ^ (m_mt[i - 1] >> 30)) * 1664525u)) + seed;
            if (++i >= 624) {
                m_mt[0] = m_mt[623];
                i = 1;
            }
        }
        for (int k = 623; k > 0; --k) {
            m_mt[i] = (m_mt[i] ^ ((m_mt[i - 1] ^ (m_mt[i - 1] >> 30)) * 1566083941u)) - static_cast<std::uint32_t>(i);
            if (++i >= 624) {
                m_mt[0] = m_mt[623];
                i = 1;
            }
        }
        m_mt[0] = 0x80000000u;
    }

    /// A uniform integer in [0, n), n ≥ 1 and below 2^32.
    std::uint32_t below(std::uint32_t n) {
        int k = 0;
        while ((std::uint64_t(1) << k) <= n) ++k;  // n.bit_length()
        std::uint32_t r = next() >> (32 - k);
        while (r >= n) r = next() >> (32 - k);
        return r;
    }

    /// random.shuffle.
    template <class T>
    void shuffle(std::vector<T>& x) {
        if (x.size() < 2) return;
        for (std::size_t i = x.size() - 1; i >= 1; --i) std::swap(x[i], x[below(static_cast<std::uint32_t>(i + 1))]);
    }

private:
    void init_genrand(std::uint32_t s) {
        m_mt[0] = s;
        for (std::uint32_t i = 1; i < 624; ++i) m_mt[i] = 1812433253u * (m_mt[i - 1] ^ (m_mt[i - 1] >> 30)) + i;
        m_index = 624;
    }
    std::uint32_t next() {
        if (m_index >= 624) {
            for (int k = 0; k < 624; ++k) {
                const std::uint32_t y = (m_mt[k] & 0x80000000u) | (m_mt[(k + 1) % 624] & 0x7fffffffu);
                m_mt[k] = m_mt[(k + 397) % 624] ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u);
            }
            m_index = 0;
        }
        std::uint32_t y = m_mt[m_index++];
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c5680u;
        y ^= (y << 15) & 0xefc60000u;
        return y ^ (y >> 18);
    }
    std::uint32_t m_mt[624];
    std::size_t m_index = 624;
};

/// True when s is valid UTF-8 (as Python's bytes.decode("utf-8") accepts it).
inline bool valid_utf8(const std::string& s) {
    std::size_t i = 0;
    const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
    while (i < s.size()) {
        const unsigned c = byte(i);
        std::size_t n = 0;
        unsigned lo = 0x80, hi = 0xBF;
        if (c < 0x80) {
            ++i;
            continue;
        } else if (c >= 0xC2 && c <= 0xDF) {
            n = 1;
        } else if (c >= 0xE0 && c <= 0xEF) {
            n = 2;
            if (c == 0xE0) lo = 0xA0;
            if (c == 0xED) hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            n = 3;
            if (c == 0xF0) lo = 0x90;
            if (c == 0xF4) hi = 0x8F;
        } else {
            return false;
        }
        for (std::size_t k = 1; k <= n; ++k) {
            if (i + k >= s.size()) return false;
            const unsigned b = byte(i + k);
            if (b < (k == 1 ? lo : 0x80u) || b > (k == 1 ? hi : 0xBFu)) return false;
        }
        i += n + 1;
    }
    return true;
}

/// The training and held-out text of scripts/train_tiny_lm.py: every file of `dir` with a
/// .dat index (not .dat or .u8 files), in name order, split into fortunes on lines that are
/// exactly "%", trailing whitespace stripped, empty and non-UTF-8 fortunes dropped, each
/// followed by "\n%\n"; shuffled by random.Random(5001), the last 5 % held out.
/// Throws gattn::io_error when the directory has no fortune file.
struct Corpus {
    std::string train, heldout;
    std::size_t train_fortunes = 0, heldout_fortunes = 0;

    static Corpus load(const std::string& dir = "/usr/share/games/fortunes") {
        namespace fs = std::filesystem;
        std::vector<fs::path> files;
        if (fs::is_directory(dir))
            for (const auto& e : fs::directory_iterator(dir)) {
                const fs::path p = e.path();
                if (!e.is_regular_file() || p.extension() == ".dat" || p.extension() == ".u8") continue;
                if (fs::is_regular_file(fs::path(p.string() + ".dat"))) files.push_back(p);
            }
        if (files.empty()) throw gattn::io_error("train_tiny_lm: no fortune files in " + dir);
        std::sort(files.begin(), files.end());  // byte order of the paths, as Python's sorted
        std::vector<std::string> fortunes;
        for (const auto& path : files) {
            std::ifstream in(path, std::ios::binary);
            std::stringstream ss;
            ss << in.rdbuf();
            std::string text = ss.str();
            std::vector<std::string> lines;
            std::size_t start = 0;
            while (true) {
                const std::size_t nl = text.find('\n', start);
                if (nl == std::string::npos) {
                    lines.push_back(text.substr(start));
                    break;
                }
                lines.push_back(text.substr(start, nl - start));
                start = nl + 1;
            }
            lines.push_back("%");
            std::string current;
            bool any = false;
            for (const std::string& line : lines) {
                if (line != "%") {
                    if (any) current += '\n';
                    current += line;
                    any = true;
                    continue;
                }
                std::size_t end = current.size();  // bytes.rstrip(): ASCII whitespace
                while (end > 0 && std::strchr(" \t\n\r\x0b\x0c", current[end - 1]) && current[end - 1] != '\0') --end;
                current.resize(end);
                if (!current.empty() && valid_utf8(current)) fortunes.push_back(current);
                current.clear();
                any = false;
            }
        }
        PythonRandom(5001).shuffle(fortunes);
        const auto n_heldout = static_cast<std::size_t>(std::nearbyint(static_cast<double>(fortunes.size()) * 0.05));
        Corpus c;
        c.train_fortunes = fortunes.size() - n_heldout;
        c.heldout_fortunes = n_heldout;
        for (std::size_t i = 0; i < fortunes.size(); ++i)
            (i < c.train_fortunes ? c.train : c.heldout) += fortunes[i] + "\n%\n";
        return c;
    }
};

/// Mean NLL in nats per byte over every full non-overlapping window of `context` bytes of
/// `text`, each its own sequence, bytes 1.. predicted (scripts/train_tiny_lm.py's mean_nll),
/// `batch` windows per forward pass. Returns {mean, predictions}.
template <class S>
std::pair<double, Index> mean_nll(Model<S>& model, const std::string& text, Index context, Index batch = 32) {
    const Index count = static_cast<Index>(text.size()) / context;
    double total = 0;
    Index predictions = 0;
    for (Index start = 0; start < count; start += batch) {
        const Index b = std::min(batch, count - start);
        std::vector<std::int64_t> windows(static_cast<std::size_t>(b * context));
        for (Index i = 0; i < b * context; ++i)
            windows[i] = static_cast<unsigned char>(text[static_cast<std::size_t>(start * context + i)]);
        const Index n = b * (context - 1);
        total += model.loss(windows, b, false) * static_cast<double>(n);
        predictions += n;
    }
    return {total / static_cast<double>(predictions), predictions};
}

/// What scripts/train_tiny_lm.py --trainer-fixture wrote for one model: config, initial
/// weights, the windows of the first steps and the script's losses on them.
struct Fixture {
    ModelConfig config;
    std::string initial_weights;                     ///< path of initial.safetensors
    Hyper hyper;                                     ///< the schedule of the script's run
    std::vector<double> learning_rates;              ///< the script's learning rate per step
    std::vector<std::vector<std::int64_t>> windows;  ///< per step [batch, window], row-major
    std::vector<double> losses_float64, losses_float32;

    /// Reads `dir` (DIR/MODEL of the script's output). Throws gattn::io_error for a missing or
    /// malformed file.
    static Fixture load(const std::string& dir) {
        namespace fs = std::filesystem;
        Fixture f;
        f.config = ModelConfig::load((fs::path(dir) / "config.json").string());
        f.initial_weights = (fs::path(dir) / "initial.safetensors").string();
        const std::string training = (fs::path(dir) / "training.json").string();
        std::ifstream in(training);
        if (!in) throw gattn::io_error("train_tiny_lm: cannot open " + training);
        const nlohmann::json j = nlohmann::json::parse(in);
        f.hyper = Hyper::from_json(j);
        f.learning_rates = j.at("learning_rates").get<std::vector<double>>();
        const gattn::SafetensorsFile file((fs::path(dir) / "fixture.safetensors").string());
        const std::vector<double> all = file.values<double>("windows");
        const std::size_t per_step = static_cast<std::size_t>(f.hyper.batch * f.hyper.window);
        f.losses_float64 = file.values<double>("losses_float64");
        f.losses_float32 = file.values<double>("losses_float32");
        if (all.size() != per_step * f.losses_float64.size())
            throw gattn::io_error("train_tiny_lm: " + dir + ": windows: expected " +
                                  std::to_string(per_step * f.losses_float64.size()) + " tokens, got " +
                                  std::to_string(all.size()));
        for (std::size_t s = 0; s < f.losses_float64.size(); ++s)
            f.windows.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(s * per_step),
                                   all.begin() + static_cast<std::ptrdiff_t>((s + 1) * per_step));
        return f;
    }

    /// Trains a model of Scalar S from the initial weights on the fixture's windows and returns
    /// the loss of each step.
    template <class S>
    std::vector<double> run() const {
        Model<S> model(config, initial_weights);
        std::vector<double> losses;
        for (const auto& w : windows) losses.push_back(model.train_step(w, hyper.batch, hyper));
        return losses;
    }
};

}  // namespace train_tiny_lm
