// SPDX-License-Identifier: Apache-2.0
#pragma once

// A small byte-level decoder-only language model around gattn's Qwen3-Next attention layer:
// the embedding, RMSNorm and SwiGLU code a model needs besides attention, written plainly so
// it can be copied. The models in assets/tiny_lm were trained by scripts/train_tiny_lm.py;
// this file computes exactly what that script's PyTorch model computes.
//
//   h_0 = embed_tokens[token]
//   a   = h + self_attn(input_layernorm(h))                     (gattn::Qwen3NextAttention)
//   h'  = a + down_proj(silu(gate_proj(z)) ⊙ up_proj(z)),  z = post_attention_layernorm(a)
//   logits = lm_head(norm(h_L))
// Every norm is the zero-centred RMSNorm x / √(mean(x²) + ε) · (1 + w).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <gattn/gattn.hpp>
#include <gattn/io/hf_checkpoint.hpp>

#include "sampling.hpp"

namespace tiny_lm {

using gattn::Index;
template <class S>
using Matrix = gattn::RowMatrix<S>;
template <class S>
using Vector = gattn::Vector<S>;

/// Per-layer statistics of one forward call (the paper's §4 measures), all optional.
template <class Scalar>
struct LayerStats {
    std::vector<Matrix<Scalar>> first_token_attention;  ///< per layer [B·N, H]
    std::vector<Matrix<Scalar>> gate_scores;            ///< per layer [B·N, H·d] ([B·N, 0] ungated)
    std::vector<double> max_abs_hidden;                 ///< per layer: max |h| of its output (M-Act)
};

/// Scalar: embedding, norms, MLP and logits. Attention: the attention layers' weights (Scalar,
/// or gattn::bfloat16 with a float Scalar: the checkpoint's weights rounded to bf16 on load, the
/// attention computed as gattn's bf16 layers do). Cache: what the KV caches store (Attention, or
/// std::int8_t with float compute: int8 codes and scales).
template <class Scalar, class Attention = Scalar, class Cache = Attention>
class TinyLM {
    static_assert(std::is_same_v<gattn::compute_t<Attention>, Scalar>, "attention computes in Scalar");

public:
    /// Loads config.json and model.safetensors from `dir`.
    /// Throws gattn::io_error / gattn::shape_error for missing or malformed files.
    explicit TinyLM(const std::string& dir) {
        const std::string config_path = (std::filesystem::path(dir) / "config.json").string();
        attention_ = gattn::load_qwen3_next_config(config_path);  // refuses a file that is not a JSON config
        std::ifstream in(config_path);
        const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
        auto field = [&](const char* key, bool integer) -> const nlohmann::json& {
            if (!j.contains(key) || !(integer ? j[key].is_number_integer() : j[key].is_number()))
                throw gattn::io_error("tiny_lm: " + config_path + ": \"" + key + "\" is missing or not " +
                                      (integer ? "an integer" : "a number"));
            return j[key];
        };
        vocab_size_ = field("vocab_size", true).template get<Index>();
        hidden_size_ = field("hidden_size", true).template get<Index>();
        context_ = field("max_position_embeddings", true).template get<Index>();
        eps_ = field("rms_norm_eps", false).template get<double>();
        const Index num_layers = field("num_hidden_layers", true).template get<Index>();

        const gattn::SafetensorsFile file((std::filesystem::path(dir) / "model.safetensors").string());
        embed_ = file.matrix<Scalar>("model.embed_tokens.weight");
        norm_ = file.vector<Scalar>("model.norm.weight");
        lm_head_ = file.matrix<Scalar>("lm_head.weight");
        for (Index l = 0; l < num_layers; ++l) {
            const std::string p = "model.layers." + std::to_string(l) + ".";
            Block b{gattn::Qwen3NextAttention<Attention>(
                        attention_, gattn::load_qwen3_next_attention_weights<Attention>(dir, l, attention_)),
                    file.vector<Scalar>(p + "input_layernorm.weight"),
                    file.vector<Scalar>(p + "post_attention_layernorm.weight"),
                    file.matrix<Scalar>(p + "mlp.gate_proj.weight"),
                    file.matrix<Scalar>(p + "mlp.up_proj.weight"),
                    file.matrix<Scalar>(p + "mlp.down_proj.weight")};
            blocks_.push_back(std::move(b));
        }
    }

    Index vocab_size() const { return vocab_size_; }
    Index context() const { return context_; }
    Index num_layers() const { return static_cast<Index>(blocks_.size()); }
    const gattn::Qwen3NextConfig& attention_config() const { return attention_; }

    /// One KV cache per layer for `batch` sequences of up to `capacity` tokens.
    gattn::KVCacheSet<Cache> make_caches(Index batch, Index capacity) const {
        std::vector<const gattn::Qwen3NextAttention<Attention>*> layers;
        for (const Block& b : blocks_) layers.push_back(&b.attn);
        return gattn::KVCacheSet<Cache>(layers, batch, capacity);
    }

    /// Runs N new tokens of each of B sequences (tokens [B·N], sequence-major) after what the
    /// caches hold, appends them to the caches and returns the logits [B·N, vocab].
    /// Throws std::invalid_argument for a wrong number of caches or tokens, a token outside the
    /// vocabulary, or a full cache.
    Matrix<Scalar> forward(const std::vector<int>& tokens, gattn::KVCacheSet<Cache>& caches,
                           LayerStats<Scalar>* stats = nullptr) const {
        if (caches.size() != blocks_.size())
            throw std::invalid_argument("tiny_lm::forward: caches: expected one per layer (" +
                                        std::to_string(blocks_.size()) + "), got " + std::to_string(caches.size()));
        const Index B = caches[0].batch(), rows = static_cast<Index>(tokens.size()), N = rows / B;
        if (rows == 0 || rows % B != 0)
            throw std::invalid_argument("tiny_lm::forward: tokens: expected B*N > 0 entries for B = " +
                                        std::to_string(B) + ", got " + std::to_string(rows));
        for (int t : tokens)
            if (t < 0 || t >= vocab_size_)
                throw std::invalid_argument("tiny_lm::forward: token " + std::to_string(t) + " outside [0, " +
                                            std::to_string(vocab_size_) + ")");
        std::vector<Index> positions(static_cast<std::size_t>(rows));
        for (Index r = 0; r < rows; ++r) positions[r] = caches[0].tokens_seen()[r / N] + r % N;

        Matrix<Scalar> h(rows, hidden_size_), z(rows, hidden_size_), a(rows, hidden_size_);
        for (Index r = 0; r < rows; ++r) h.row(r) = embed_.row(tokens[r]);
        if (stats) *stats = LayerStats<Scalar>{};
        for (std::size_t l = 0; l < blocks_.size(); ++l) {
            const Block& b = blocks_[l];
            rms_norm(h, b.input_norm, z);
            Matrix<Scalar> first, gates;
            b.attn.forward(z, positions, caches[l], a, {}, stats ? &gates : nullptr, stats ? &first : nullptr);
            h += a;
            mlp(b, h, z);
            if (stats) {
                stats->first_token_attention.push_back(std::move(first));
                stats->gate_scores.push_back(std::move(gates));
                stats->max_abs_hidden.push_back(static_cast<double>(h.cwiseAbs().maxCoeff()));
            }
        }
        rms_norm(h, norm_, z);
        return z * lm_head_.transpose();
    }

    /// One paged pool per layer, num_pages pages of page_size tokens each (a server's cache).
    gattn::PagedKVPoolSet<Cache> make_pools(Index num_pages, Index page_size) const {
        std::vector<const gattn::Qwen3NextAttention<Attention>*> layers;
        for (const Block& b : blocks_) layers.push_back(&b.attn);
        return gattn::PagedKVPoolSet<Cache>(layers, num_pages, page_size);
    }

    /// One step of continuous batching: sequence seqs[b] brings tokens [qo_indptr[b],
    /// qo_indptr[b + 1]) (a prompt chunk, one decoding token, or none), appended to the pools
    /// after its tokens so far. Returns the logits [qo_indptr[B], vocab], rows as tokens.
    /// Throws std::invalid_argument for a token outside the vocabulary, or as the layers'
    /// forward over a pool (a wrong qo_indptr, an unknown sequence, too few free pages).
    Matrix<Scalar> forward(const std::vector<int>& tokens, const std::vector<Index>& qo_indptr,
                           gattn::PagedKVPoolSet<Cache>& pools, const std::vector<gattn::SequenceId>& seqs) const {
        if (pools.size() != blocks_.size())
            throw std::invalid_argument("tiny_lm::forward: pools: expected one per layer (" +
                                        std::to_string(blocks_.size()) + "), got " + std::to_string(pools.size()));
        for (int t : tokens)
            if (t < 0 || t >= vocab_size_)
                throw std::invalid_argument("tiny_lm::forward: token " + std::to_string(t) + " outside [0, " +
                                            std::to_string(vocab_size_) + ")");
        const Index rows = static_cast<Index>(tokens.size());
        Matrix<Scalar> h(rows, hidden_size_), z(rows, hidden_size_), a(rows, hidden_size_);
        for (Index r = 0; r < rows; ++r) h.row(r) = embed_.row(tokens[r]);
        for (std::size_t l = 0; l < blocks_.size(); ++l) {
            const Block& b = blocks_[l];
            rms_norm(h, b.input_norm, z);
            b.attn.forward(z, qo_indptr, pools[l], seqs, a);
            h += a;
            mlp(b, h, z);
        }
        rms_norm(h, norm_, z);
        return z * lm_head_.transpose();
    }

    /// Greedy decoding: prefills `prompt` into fresh caches, then appends the arg-max token
    /// (the lower id on a tie) `count` times. Returns the generated tokens. Throws
    /// std::invalid_argument for an empty prompt, or as forward.
    std::vector<int> generate(const std::vector<int>& prompt, Index count) const {
        Sampler greedy(Sampling{0, 0, 1}, 0);
        return generate(prompt, count, greedy);
    }

    /// Sampled decoding: prefills `prompt` into fresh caches, then appends `count` tokens, each
    /// drawn by `sampler` (sampling.hpp) from the last position's logits. Throws
    /// std::invalid_argument for an empty prompt, or as forward and Sampler::next.
    std::vector<int> generate(const std::vector<int>& prompt, Index count, Sampler& sampler) const {
        if (prompt.empty()) throw std::invalid_argument("tiny_lm::generate: prompt: expected at least one token");
        auto caches = make_caches(1, static_cast<Index>(prompt.size()) + count);
        std::vector<int> out;
        Matrix<Scalar> logits = forward(prompt, caches);
        std::vector<double> last(static_cast<std::size_t>(logits.cols()));
        for (Index t = 0; t < count; ++t) {
            for (Index v = 0; v < logits.cols(); ++v) last[v] = static_cast<double>(logits(logits.rows() - 1, v));
            out.push_back(sampler.next(last));
            if (t + 1 < count) logits = forward({out.back()}, caches);
        }
        return out;
    }

private:
    struct Block {
        gattn::Qwen3NextAttention<Attention> attn;
        Vector<Scalar> input_norm, post_norm;
        Matrix<Scalar> gate_proj, up_proj, down_proj;  // nn.Linear layout [out, in]
    };

    static Scalar silu(Scalar x) { return x / (Scalar(1) + std::exp(-x)); }

    // h += down_proj(silu(gate_proj(z)) ⊙ up_proj(z)), z = post_attention_layernorm(h).
    void mlp(const Block& b, Matrix<Scalar>& h, Matrix<Scalar>& z) const {
        rms_norm(h, b.post_norm, z);
        Matrix<Scalar> g = z * b.gate_proj.transpose(), u = z * b.up_proj.transpose();
        for (Index i = 0; i < g.size(); ++i) g.data()[i] = silu(g.data()[i]) * u.data()[i];
        h.noalias() += g * b.down_proj.transpose();
    }

    // Zero-centred RMSNorm in at least float, as the PyTorch model computes it.
    void rms_norm(const Matrix<Scalar>& x, const Vector<Scalar>& w, Matrix<Scalar>& y) const {
        y = x;
        gattn::rms_norm_heads(y.data(), y.rows(), y.cols(), 1, y.cols(), w.data(), eps_);
    }

    Index vocab_size_ = 0, hidden_size_ = 0, context_ = 0;
    double eps_ = 1e-6;
    gattn::Qwen3NextConfig attention_;
    Matrix<Scalar> embed_, lm_head_;
    Vector<Scalar> norm_;
    std::vector<Block> blocks_;
};

/// Bytes of a string as tokens (the models are byte-level: token = byte value).
inline std::vector<int> encode(const std::string& text) {
    std::vector<int> t;
    for (unsigned char c : text) t.push_back(c);
    return t;
}

inline std::string decode(const std::vector<int>& tokens) {
    std::string s;
    for (int t : tokens) s.push_back(static_cast<char>(t));
    return s;
}

/// Mean negative log-likelihood (nats per byte) of `text` cut into non-overlapping windows of
/// `window` bytes (at most `max_windows`; a final partial window is dropped). Each window is an
/// independent sequence starting at position 0; bytes 1…window−1 are predicted from their
/// prefixes. Runs `batch` windows at a time; `stats_each` (optional) sees each batch's stats.
/// Throws std::invalid_argument when the text holds no full window.
template <class Scalar, class Attention, class Cache, class F = std::nullptr_t>
double heldout_nll(const TinyLM<Scalar, Attention, Cache>& model, const std::string& text, Index window,
                   Index max_windows, Index batch = 8, F&& stats_each = nullptr) {
    const std::vector<int> all = encode(text);
    const Index windows = std::min<Index>(max_windows, static_cast<Index>(all.size()) / window);
    if (windows < 1 || window < 2)
        throw std::invalid_argument("tiny_lm::heldout_nll: text: expected at least one window of " +
                                    std::to_string(window) + " >= 2 bytes, got " + std::to_string(all.size()));
    double nll = 0;
    Index predictions = 0;
    for (Index w0 = 0; w0 < windows; w0 += batch) {
        const Index B = std::min(batch, windows - w0);
        std::vector<int> tokens(all.begin() + w0 * window, all.begin() + (w0 + B) * window);
        auto caches = model.make_caches(B, window);
        LayerStats<Scalar> stats;
        constexpr bool want_stats = !std::is_same_v<std::decay_t<F>, std::nullptr_t>;
        const Matrix<Scalar> logits = model.forward(tokens, caches, want_stats ? &stats : nullptr);
        for (Index r = 0; r < B * window; ++r) {
            if (r % window == window - 1) continue;  // the window's last byte predicts nothing
            const Eigen::RowVectorXd row = logits.row(r).template cast<double>();
            const double m = row.maxCoeff();
            const double lse = m + std::log((row.array() - m).exp().sum());
            nll += lse - row(tokens[r + 1]);
            ++predictions;
        }
        if constexpr (want_stats) stats_each(stats, B);
    }
    return nll / double(predictions);
}

}  // namespace tiny_lm
