// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Head parallelism (tensor parallelism over attention heads) over MPI, for the generic layer
/// (HeadParallelAttention) and Qwen3-Next's (HeadParallelQwen3Next): rank p of P holds H / P
/// query heads, the KV heads they read, their rows of q_proj (query and gate), k_proj and
/// v_proj, the gate rows of its heads, and their columns of o_proj, so it computes its heads'
/// share of the output, o_proj(U_p ⊙ σ(gate_p)); one MPI_Allreduce sums the shares
/// (Megatron-LM's row-parallel output projection, Shoeybi et al. 2019; vLLM and
/// xFasterTransformer split attention heads the same way). KV heads are split when P divides H_kv and replicated
/// otherwise (each rank's query heads then read one KV head), as vLLM does. Each rank's KV
/// cache holds only its KV heads, so the cache is sharded with the heads.
///
/// Only for programs that link MPI (this header includes <mpi.h>; the rest of gattn never does).

#include <mpi.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gattn/dist/ring_attention.hpp"
#include "gattn/gates/gate_apply.hpp"
#include "gattn/layers/gated_multi_head_attention.hpp"
#include "gattn/layers/head_shard.hpp"
#include "gattn/models/qwen3_next_attention.hpp"

GATTN_BEGIN_ISA_NAMESPACE

/// The config and weights of one shard of a Qwen3-Next layer (see the file comment): the
/// shard's heads, q_proj's rows of its query heads (each head's query and gate rows together),
/// k_proj and v_proj's rows of its KV heads, o_proj's columns of its query heads, the sinks of
/// its heads, q_norm and k_norm whole; o_proj's bias on the rank with first_head 0 only (the
/// shares are summed).
/// \throws std::invalid_argument for an invalid config (validate_qwen3_next_config) or a shard
///         outside it; shape_error for weights of the wrong shapes.
template <class Scalar>
std::pair<Qwen3NextConfig, Qwen3NextAttentionWeights<Scalar>> shard_qwen3_next(
    const Qwen3NextConfig& c, const Qwen3NextAttentionWeights<Scalar>& w, const HeadShard& s) {
    constexpr const char* fn = "gattn::shard_qwen3_next";
    validate_qwen3_next_config(c, fn);
    const auto shapes = qwen3_next_weight_shapes(c);
    w.for_each([&](const char* name, const auto& t) {
        gattn::detail::check_weight_shape(fn, name, t, shapes, "not used by this config");
    });
    const auto [sc, blocks] = qwen3_next_shard(c, s);
    // Each weight's block of the shard (qwen3_next_shard), or nothing when the config has none.
    auto cut = [&, &blocks = blocks](const auto& whole, const char* name) {
        using M = std::decay_t<decltype(whole)>;
        const auto it = blocks.find(name);
        if (it == blocks.end()) return M();
        const WeightBlock& k = it->second;
        if constexpr (M::ColsAtCompileTime == 1)
            return k.zero ? M(M::Zero(k.rows)) : M(whole.segment(k.first_row, k.rows));
        else
            return k.zero ? M(M::Zero(k.rows, k.cols)) : M(whole.block(k.first_row, k.first_col, k.rows, k.cols));
    };
    Qwen3NextAttentionWeights<Scalar> sw;
    sw.q_proj_weight = cut(w.q_proj_weight, "q_proj.weight");
    sw.k_proj_weight = cut(w.k_proj_weight, "k_proj.weight");
    sw.v_proj_weight = cut(w.v_proj_weight, "v_proj.weight");
    sw.o_proj_weight = cut(w.o_proj_weight, "o_proj.weight");
    sw.q_norm_weight = cut(w.q_norm_weight, "q_norm.weight");
    sw.k_norm_weight = cut(w.k_norm_weight, "k_norm.weight");
    sw.q_proj_bias = cut(w.q_proj_bias, "q_proj.bias");
    sw.k_proj_bias = cut(w.k_proj_bias, "k_proj.bias");
    sw.v_proj_bias = cut(w.v_proj_bias, "v_proj.bias");
    sw.o_proj_bias = cut(w.o_proj_bias, "o_proj.bias");
    sw.sinks = cut(w.sinks, "sinks");
    return {sc, sw};
}

/// A Qwen3-Next layer whose heads are split over the ranks of a communicator (see the file
/// comment). Every rank constructs it with the whole layer's config and weights (it keeps only
/// its shard) and calls forward with the same arguments; each gets the whole output.
/// Scalar: the weights' type, as for Qwen3NextAttention; activations are in its compute type.
template <class Scalar>
class HeadParallelQwen3Next {
    using T = compute_t<Scalar>;

public:
    /// \throws std::invalid_argument when the heads cannot be split over comm's ranks
    ///         (head_shard), and what the Qwen3NextAttention constructor throws.
    HeadParallelQwen3Next(const Qwen3NextConfig& config, const Qwen3NextAttentionWeights<Scalar>& weights,
                          MPI_Comm comm)
        : m_comm(comm),
          m_config(config),
          m_shard(shard_of(config, comm)),
          m_local(local_layer(config, weights, m_shard)) {}

    /// From this rank's shard alone, e.g. as load_qwen3_next_attention_shard read it from a
    /// checkpoint (each rank reads only its rows):
    /// \code
    /// const auto config = gattn::load_qwen3_next_config(dir + "/config.json", layer);
    /// const auto shard = gattn::HeadParallelQwen3Next<float>::shard_of(config, comm);
    /// const auto part = gattn::load_qwen3_next_attention_shard<float>(dir, layer, config, shard);
    /// gattn::HeadParallelQwen3Next<float> attention(config, shard, part.second, comm);
    /// \endcode
    /// \param config        the whole layer's config.
    /// \param shard         this rank's heads: shard_of(config, comm).
    /// \param shard_weights the shard's weights (shapes of qwen3_next_shard's config).
    /// \param comm          the ranks that hold the layer's shards.
    /// \throws std::invalid_argument when shard is not this rank's (shard_of), and what the
    ///         Qwen3NextAttention constructor throws.
    HeadParallelQwen3Next(const Qwen3NextConfig& config, const HeadShard& shard,
                          const Qwen3NextAttentionWeights<Scalar>& shard_weights, MPI_Comm comm)
        : m_comm(comm),
          m_config(config),
          m_shard(checked_shard(config, shard, comm)),
          m_local(qwen3_next_shard(config, shard).first, shard_weights) {}

    /// The heads rank `rank` of comm holds (head_shard of the config's heads).
    /// \throws std::invalid_argument as head_shard.
    static HeadShard shard_of(const Qwen3NextConfig& c, MPI_Comm comm) {
        int rank = 0, size = 1;
        MPI_Comm_rank(comm, &rank);
        MPI_Comm_size(comm, &size);
        return head_shard(c.num_attention_heads, c.num_key_value_heads, rank, size);
    }

    /// The whole layer's config.
    const Qwen3NextConfig& config() const noexcept { return m_config; }
    /// This rank's heads.
    const HeadShard& shard() const noexcept { return m_shard; }
    /// This rank's layer: its heads' share of the output (before the sum over ranks).
    const Qwen3NextAttention<Scalar>& local() const noexcept { return m_local; }

    /// This rank's cache: its KV heads for `batch` sequences of up to `capacity` tokens
    /// (CacheScalar: Scalar, or std::int8_t as for Qwen3NextAttention::make_cache).
    /// \throws as KVCache's constructor.
    template <class CacheScalar = Scalar>
    KVCache<CacheScalar> make_cache(Index batch, Index capacity) const {
        return m_local.template make_cache<CacheScalar>(batch, capacity);
    }

    /// Qwen3NextAttention::forward over all ranks: this rank's heads on its cache, then the
    /// shares summed into `out` on every rank (one MPI_Allreduce of B·N·D values). Equal to the
    /// whole layer up to the order of the sum over ranks. Every rank passes the same x,
    /// positions and counts.
    /// \throws std::invalid_argument on every rank when any rank's arguments are invalid (the
    ///         lowest such rank's message, as Qwen3NextAttention::forward words it, prefixed
    ///         "rank k of P"); every cache is then left as it was.
    template <class CacheScalar>
    void forward(ConstMatrixRef<T> x, const std::vector<Index>& positions, KVCache<CacheScalar>& cache,
                 MatrixRef<T> out, const std::vector<Index>& counts = {}) const {
        constexpr const char* fn = "gattn::HeadParallelQwen3Next::forward";
        RowMatrix<T> partial(x.rows(), m_config.hidden_size);
        const std::vector<Index> before = cache.lengths();
        std::string error;
        if (out.rows() != x.rows() || out.cols() != m_config.hidden_size)
            error = "out must have shape " + gattn::detail::shape_string({x.rows(), m_config.hidden_size}) + ", got " +
                    gattn::detail::shape_string({out.rows(), out.cols()});
        if (error.empty()) {
            try {
                m_local.forward(x, positions, cache, partial, counts);
            } catch (const std::exception& e) {
                error = e.what();
            }
        }
        try {
            gattn::detail::agree_or_throw(fn, error, m_comm);
        } catch (...) {
            if (error.empty()) cache.truncate(before);  // this rank appended; the call did not happen
            throw;
        }
        MPI_Allreduce(MPI_IN_PLACE, partial.data(), static_cast<int>(partial.size()), gattn::detail::mpi_type<T>(),
                      MPI_SUM, m_comm);
        out = partial;
    }

private:
    static HeadShard checked_shard(const Qwen3NextConfig& c, const HeadShard& s, MPI_Comm comm) {
        const HeadShard mine = shard_of(c, comm);
        if (s.first_head != mine.first_head || s.num_heads != mine.num_heads || s.first_kv_head != mine.first_kv_head ||
            s.num_kv_heads != mine.num_kv_heads)
            gattn::detail::throw_invalid("gattn::HeadParallelQwen3Next", "shard",
                                         "must be this rank's heads (shard_of): query heads from " +
                                             std::to_string(mine.first_head) + ", " + std::to_string(mine.num_heads) +
                                             " of them, got from " + std::to_string(s.first_head) + ", " +
                                             std::to_string(s.num_heads));
        return s;
    }
    static Qwen3NextAttention<Scalar> local_layer(const Qwen3NextConfig& c, const Qwen3NextAttentionWeights<Scalar>& w,
                                                  const HeadShard& s) {
        const auto [config, weights] = shard_qwen3_next(c, w, s);
        return Qwen3NextAttention<Scalar>(config, weights);
    }

    MPI_Comm m_comm;
    Qwen3NextConfig m_config;
    HeadShard m_shard;
    Qwen3NextAttention<Scalar> m_local;
};

/// The config and weights of one shard of a GatedMultiHeadAttention layer (see the file
/// comment): the shard's query heads and the KV heads they read; q_proj's rows of its query
/// heads (with a fused gate, each head's query and gate rows, rearranged into the shard's own
/// per-head or per-KV-group layout), k_proj and v_proj's rows of its KV heads, o_proj's columns
/// of its query heads; the gate's rows of its heads (G1, G4) or KV heads (G2, G3), gate_theta
/// and a query gate's rows of its heads; a head-shared gate's logits, which average over all
/// heads, from the average of every head's gate rows (equal up to rounding); sinks of its heads,
/// q_norm and k_norm whole; o_proj's bias only in the shard with first_head 0 (the shares are
/// summed). A G5 gate is left out of the shard's config: it acts on the summed output
/// (HeadParallelAttention).
/// \throws std::invalid_argument for an invalid config (validate_config), ALiBi (its slopes
///         depend on a head's index among all H heads), or a shard outside the config's heads;
///         shape_error for weights of the wrong shapes (as the layer's constructor).
template <class Scalar>
std::pair<AttentionConfig, AttentionWeights<Scalar>> shard_attention(const AttentionConfig& c,
                                                                     const AttentionWeights<Scalar>& w,
                                                                     const HeadShard& s) {
    constexpr const char* fn = "gattn::shard_attention";
    validate_config(c, fn);
    const auto shapes = expected_weight_shapes(c);
    const std::string unused = "this config (gate " + describe(c.gate) + ") does not use it";
    w.for_each(
        [&](const char* name, const auto& t) { gattn::detail::check_weight_shape(fn, name, t, shapes, unused); });
    if (c.alibi)
        gattn::detail::throw_invalid(fn, "config.alibi",
                                     "is not supported across ranks: ALiBi's slope of a head depends on its index "
                                     "among all num_heads heads");
    const Index H = c.num_heads, Hkv = c.num_kv_heads, dk = c.d_k(), dv = c.d_v();
    if (s.num_heads < 1 || s.first_head < 0 || s.first_head + s.num_heads > H || s.num_kv_heads < 1 ||
        s.first_kv_head < 0 || s.first_kv_head + s.num_kv_heads > Hkv || s.num_heads % s.num_kv_heads != 0 ||
        s.first_head / (H / Hkv) < s.first_kv_head ||
        (s.first_head + s.num_heads - 1) / (H / Hkv) >= s.first_kv_head + s.num_kv_heads)
        gattn::detail::throw_invalid(fn, "shard",
                                     "must lie within the config's heads, its query heads reading its KV heads");
    const GateSpec& g = c.gate;
    AttentionConfig sc = c;
    sc.num_heads = s.num_heads;
    sc.num_kv_heads = s.num_kv_heads;
    sc.o_bias = c.o_bias && s.first_head == 0;
    if (g.position == GatePosition::G5) sc.gate = GateSpec{};
    const GateSpec& sg = sc.gate;

    // Rows [first·width, (first + count)·width) of m, or for a head-shared gate `count` copies of
    // the mean over all `total` blocks of `width` rows.
    auto blocks = [&](const auto& m, Index first, Index count, Index width, Index total) {
        if (g.sharing != GateSharing::HeadShared) return RowMatrix<Scalar>(m.middleRows(first * width, count * width));
        RowMatrix<double> mean = RowMatrix<double>::Zero(width, m.cols());
        for (Index h = 0; h < total; ++h) mean += m.middleRows(h * width, width).template cast<double>();
        mean /= double(total);
        return RowMatrix<Scalar>(mean.template cast<Scalar>().replicate(count, 1));
    };

    AttentionWeights<Scalar> sw;
    const bool input_gate = sg.enabled() && sg.source == GateSource::Input;
    const bool fused = input_gate && sg.layout != GateLayout::Separate;
    if (fused) {
        // Each head's query rows and gw gate rows, from where the whole layout keeps them to
        // where the shard's layout does (pack() in GatedMultiHeadAttention reads the same way).
        const Index gw = gate_width(c) / H;
        auto offsets = [&](Index h, Index heads, Index kv_heads) {
            const Index group = heads / kv_heads;
            if (g.layout == GateLayout::PerHeadInterleaved)
                return std::pair<Index, Index>{h * (dk + gw), h * (dk + gw) + dk};
            const Index block = (h / group) * group * (dk + gw), local = h % group;
            return std::pair<Index, Index>{block + local * dk, block + group * dk + local * gw};
        };
        sw.q_proj_weight.resize(s.num_heads * (dk + gw), c.d_model);
        if (c.qkv_bias) sw.q_proj_bias.resize(sw.q_proj_weight.rows());
        for (Index h = 0; h < s.num_heads; ++h) {
            const auto [q_src, g_src] = offsets(s.first_head + h, H, Hkv);
            const auto [q_dst, g_dst] = offsets(h, s.num_heads, s.num_kv_heads);
            sw.q_proj_weight.middleRows(q_dst, dk) = w.q_proj_weight.middleRows(q_src, dk);
            sw.q_proj_weight.middleRows(g_dst, gw) = w.q_proj_weight.middleRows(g_src, gw);
            if (c.qkv_bias) {
                sw.q_proj_bias.segment(q_dst, dk) = w.q_proj_bias.segment(q_src, dk);
                sw.q_proj_bias.segment(g_dst, gw) = w.q_proj_bias.segment(g_src, gw);
            }
        }
    } else {
        sw.q_proj_weight = w.q_proj_weight.middleRows(s.first_head * dk, s.num_heads * dk);
        if (c.qkv_bias) sw.q_proj_bias = w.q_proj_bias.segment(s.first_head * dk, s.num_heads * dk);
    }
    sw.k_proj_weight = w.k_proj_weight.middleRows(s.first_kv_head * dk, s.num_kv_heads * dk);
    sw.v_proj_weight = w.v_proj_weight.middleRows(s.first_kv_head * dv, s.num_kv_heads * dv);
    sw.o_proj_weight = w.o_proj_weight.middleCols(s.first_head * dv, s.num_heads * dv);
    if (c.qkv_bias) {
        sw.k_proj_bias = w.k_proj_bias.segment(s.first_kv_head * dk, s.num_kv_heads * dk);
        sw.v_proj_bias = w.v_proj_bias.segment(s.first_kv_head * dv, s.num_kv_heads * dv);
    }
    if (sc.o_bias) sw.o_proj_bias = w.o_proj_bias;
    if (c.sinks) sw.sinks = w.sinks.segment(s.first_head, s.num_heads);
    sw.q_norm_weight = w.q_norm_weight;
    sw.k_norm_weight = w.k_norm_weight;
    if (sg.enabled() && !fused) {
        if (sg.source == GateSource::Input) {
            // Gate rows per head: d_v (G1), d_k (G4), per KV head: d_v (G2), d_k (G3); one headwise.
            const bool elem = sg.granularity == GateGranularity::Elementwise;
            const bool kv = sg.position == GatePosition::G2 || sg.position == GatePosition::G3;
            const Index width = !elem                                                                  ? 1
                                : (sg.position == GatePosition::G1 || sg.position == GatePosition::G2) ? dv
                                                                                                       : dk;
            const Index first = kv ? s.first_kv_head : s.first_head, count = kv ? s.num_kv_heads : s.num_heads;
            sw.gate_proj_weight = blocks(w.gate_proj_weight, first, count, width, kv ? Hkv : H);
            if (sg.bias) {
                const RowMatrix<Scalar> b =
                    blocks(RowMatrix<Scalar>(w.gate_proj_bias), first, count, width, kv ? Hkv : H);
                sw.gate_proj_bias = Eigen::Map<const Vector<Scalar>>(b.data(), b.size());
            }
        } else if (sg.source == GateSource::Query) {
            sw.gate_proj_weight = w.gate_proj_weight.middleRows(s.first_head, s.num_heads);
            if (sg.bias) sw.gate_proj_bias = w.gate_proj_bias.segment(s.first_head, s.num_heads);
        } else {
            sw.gate_theta = w.gate_theta.middleRows(s.first_head, s.num_heads);
        }
    }
    return {sc, sw};
}

/// A GatedMultiHeadAttention layer whose heads are split over the ranks of a communicator (see
/// the file comment and shard_attention): every gate position, layout and granularity; the G5
/// gate (and its residual mix) acts on the summed output, its projection computed on every rank.
/// Every rank constructs it with the whole layer's config and weights (it keeps only its shard)
/// and calls forward with the same arguments; each gets the whole output.
/// Scalar: the weights' type, as for GatedMultiHeadAttention; x and out are in its compute type.
template <class Scalar>
class HeadParallelAttention {
    using T = compute_t<Scalar>;

public:
    /// \throws std::invalid_argument when the heads cannot be split over comm's ranks
    ///         (head_shard), and what shard_attention and the layer's constructor throw.
    HeadParallelAttention(const AttentionConfig& config, const AttentionWeights<Scalar>& weights, MPI_Comm comm)
        : m_comm(comm),
          m_config(config),
          m_shard(shard_of(config, comm)),
          m_local(local_layer(config, weights, m_shard)) {
        const GateSpec& g = config.gate;
        if (g.position == GatePosition::G5)
            m_g5 = Projection<Scalar>(weights.gate_proj_weight,
                                      g.bias ? Vector<T>(weights.gate_proj_bias.template cast<T>()) : Vector<T>());
    }

    /// The whole layer's config.
    const AttentionConfig& config() const noexcept { return m_config; }
    /// This rank's heads.
    const HeadShard& shard() const noexcept { return m_shard; }
    /// This rank's layer: its heads' share of the output, before the sum over ranks (and the G5
    /// gate).
    const GatedMultiHeadAttention<Scalar>& local() const noexcept { return m_local; }

    /// This rank's cache: its KV heads (GatedMultiHeadAttention::make_cache of local()).
    /// \throws as KVCache's constructor.
    template <class CacheScalar = Scalar>
    KVCache<CacheScalar> make_cache(Index batch, Index capacity) const {
        return m_local.template make_cache<CacheScalar>(batch, capacity);
    }

    /// GatedMultiHeadAttention::forward(x, batch, out, options) over all ranks: this rank's
    /// heads, their shares summed on every rank (one MPI_Allreduce of B·N·D values), then a G5
    /// gate. Equal to the whole layer up to the order of the sum over ranks. A mask with H heads
    /// ([B|1, H, N|1, N]) is cut to each rank's heads. Every rank passes the same arguments.
    /// \throws on every rank what the whole layer's forward throws when any rank's arguments are
    ///         invalid, as std::invalid_argument (the lowest such rank's message prefixed
    ///         "rank k of P").
    void forward(ConstMatrixRef<T> x, Index batch, MatrixRef<T> out, const ForwardOptions<T>& options = {}) const {
        constexpr const char* fn = "gattn::HeadParallelAttention::forward";
        RowMatrix<T> partial(x.rows(), m_config.d_model);
        std::string error = check_out(x, out);
        if (error.empty()) {
            try {
                ForwardOptions<T> local = options;
                std::unique_ptr<bool[]> bool_heads;
                std::unique_ptr<T[]> bias_heads;
                local.bool_mask = heads_of(options.bool_mask, "options.bool_mask", bool_heads);
                local.bias = heads_of(options.bias, "options.bias", bias_heads);
                m_local.forward(x, batch, partial, local);
            } catch (const std::exception& e) {
                error = e.what();
            }
        }
        gattn::detail::agree_or_throw(fn, error, m_comm);
        finish(x, partial, out);
    }

    /// GatedMultiHeadAttention::forward(x, cache, out, counts) over all ranks: this rank's heads
    /// on its cache (make_cache), then as the form above.
    /// \throws on every rank, as above; every rank's cache is then left as it was.
    template <class CacheScalar>
    void forward(ConstMatrixRef<T> x, KVCache<CacheScalar>& cache, MatrixRef<T> out,
                 const std::vector<Index>& counts = {}) const {
        constexpr const char* fn = "gattn::HeadParallelAttention::forward";
        RowMatrix<T> partial(x.rows(), m_config.d_model);
        const std::vector<Index> before = cache.lengths();
        // A window cache may drop tokens as it appends, which truncate cannot undo: a copy (2w
        // rows per sequence) restores it.
        std::optional<KVCache<CacheScalar>> saved;
        if (cache.window() > 0) saved.emplace(cache);
        std::string error = check_out(x, out);
        if (error.empty()) {
            try {
                m_local.forward(x, cache, partial, counts);
            } catch (const std::exception& e) {
                error = e.what();
            }
        }
        try {
            gattn::detail::agree_or_throw(fn, error, m_comm);
        } catch (...) {
            if (error.empty()) {  // this rank appended; the call did not happen
                if (saved)
                    cache = std::move(*saved);
                else
                    cache.truncate(before);
            }
            throw;
        }
        finish(x, partial, out);
    }

private:
    static HeadShard shard_of(const AttentionConfig& c, MPI_Comm comm) {
        int rank = 0, size = 1;
        MPI_Comm_rank(comm, &rank);
        MPI_Comm_size(comm, &size);
        return head_shard(c.num_heads, c.num_kv_heads, rank, size);
    }
    static GatedMultiHeadAttention<Scalar> local_layer(const AttentionConfig& c, const AttentionWeights<Scalar>& w,
                                                       const HeadShard& s) {
        const auto [config, weights] = shard_attention(c, w, s);
        return GatedMultiHeadAttention<Scalar>(config, weights);
    }

    std::string check_out(const ConstMatrixRef<T>& x, const MatrixRef<T>& out) const {
        if (out.rows() == x.rows() && out.cols() == m_config.d_model) return {};
        return "out must have shape " + gattn::detail::shape_string({x.rows(), m_config.d_model}) + ", got " +
               gattn::detail::shape_string({out.rows(), out.cols()});
    }

    /// A mask's rows of this rank's heads: the mask itself when it has one head (or none), else
    /// a copy of its heads [first_head, first_head + num_heads) into `storage`.
    template <class M>
    MaskView<M> heads_of(const MaskView<M>& m, const char* name, std::unique_ptr<M[]>& storage) const {
        if (m.empty() || m.heads == 1) return m;
        if (m.heads != m_config.num_heads)
            gattn::detail::throw_invalid("gattn::HeadParallelAttention::forward", name,
                                         "must have 1 or num_heads = " + std::to_string(m_config.num_heads) +
                                             " heads, got " + std::to_string(m.heads));
        const Index block = m.query_len * m.key_len, n = m_shard.num_heads;
        storage.reset(new M[static_cast<std::size_t>(m.batch * n * block)]);
        for (Index b = 0; b < m.batch; ++b)
            std::copy_n(m.data + (b * m.heads + m_shard.first_head) * block, n * block, storage.get() + b * n * block);
        MaskView<M> local = m;
        local.data = storage.get();
        local.heads = n;
        return local;
    }

    /// Sums the ranks' shares into out, then applies a G5 gate (on the layer input x).
    void finish(ConstMatrixRef<T> x, RowMatrix<T>& partial, MatrixRef<T> out) const {
        MPI_Allreduce(MPI_IN_PLACE, partial.data(), static_cast<int>(partial.size()), gattn::detail::mpi_type<T>(),
                      MPI_SUM, m_comm);
        const GateSpec& g = m_config.gate;
        if (g.position == GatePosition::G5) {
            RowMatrix<T> z(x.rows(), m_config.d_model);
            m_g5.template forward<T, T>(x, z);
            for (Index r = 0; r < x.rows(); ++r)
                apply_gate(g.activation, g.combine, partial.data() + r * partial.cols(), z.data() + r * z.cols(),
                           x.data() + r * x.outerStride(), static_cast<T*>(nullptr),
                           static_cast<std::size_t>(m_config.d_model));
        }
        out = partial;
    }

    MPI_Comm m_comm;
    AttentionConfig m_config;
    HeadShard m_shard;
    GatedMultiHeadAttention<Scalar> m_local;
    Projection<Scalar> m_g5;  // the G5 gate's W_g [D, D] (and bias), on every rank
};

GATTN_END_ISA_NAMESPACE
