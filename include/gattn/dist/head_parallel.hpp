// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Head parallelism (tensor parallelism over attention heads) over MPI, for the generic layer
/// (HeadParallelAttention) and Qwen3-Next's (HeadParallelQwen3Next): rank p of P holds H / P
/// query heads, the KV heads they read, their rows of q_proj (query and gate), k_proj and
/// v_proj, the gate rows of its heads, and their columns of o_proj, so it computes its heads'
/// share of the output, o_proj(U_p ⊙ σ(gate_p)); one MPI_Allreduce sums the shares
/// (Megatron-LM's row-parallel output projection, Shoeybi et al. 2019; vLLM and
/// xFasterTransformer split attention heads the same way). KV heads are split when P divides
/// H_kv and replicated otherwise (each rank's query heads then read one KV head), as vLLM does.
/// Each rank's KV cache holds only its KV heads, so the cache is sharded with the heads. A rank
/// can read its shard alone from a checkpoint (load_attention_shard,
/// load_qwen3_next_attention_shard).
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
#include "gattn/layers/attention_shard.hpp"
#include "gattn/layers/gated_multi_head_attention.hpp"
#include "gattn/layers/head_shard.hpp"
#include "gattn/models/qwen3_next_attention.hpp"

GATTN_BEGIN_ISA_NAMESPACE

namespace detail {

/// "" when out is [rows, cols] with its rows apart, else the message that says why not.
template <class T>
std::string out_shape_error(const MatrixRef<T>& out, Index rows, Index cols) {
    if (out.rows() != rows || out.cols() != cols)
        return "out must have shape " + shape_string({rows, cols}) + ", got " + shape_string({out.rows(), out.cols()});
    const std::string apart = rows_apart_error(out);
    return apart.empty() ? apart : "out " + apart;
}

/// Runs `call` (this rank's share of a layer call) unless `error` already holds an error, then
/// makes every rank throw when any rank's call threw or had one (agree_or_throw).
template <class Call>
void call_on_every_rank(const char* fn, MPI_Comm comm, std::string error, Call&& call) {
    if (error.empty()) {
        try {
            call();
        } catch (const std::exception& e) {
            error = e.what();
        }
    }
    agree_or_throw(fn, error, comm);
}

/// The same for a call that appends to `cache`: when any rank fails, every rank's cache is left
/// as it was before the call (a window cache, which truncate cannot restore once it has dropped
/// a token, from a copy of its 2w rows per sequence).
template <class CacheScalar, class Call>
void call_on_every_rank(const char* fn, MPI_Comm comm, std::string error, KVCache<CacheScalar>& cache, Call&& call) {
    const std::vector<Index> before = cache.lengths();
    std::optional<KVCache<CacheScalar>> saved;
    if (cache.window() > 0) saved.emplace(cache);
    try {
        call_on_every_rank(fn, comm, std::move(error), call);
    } catch (...) {
        if (saved)
            cache = std::move(*saved);
        else
            cache.truncate(before);
        throw;
    }
}

}  // namespace detail

/// The config and weights of one shard of a Qwen3-Next layer (see the file comment): the
/// shard's heads, q_proj's rows of its query heads (each head's query and gate rows together),
/// k_proj and v_proj's rows of its KV heads, o_proj's columns of its query heads, the sinks of
/// its heads, q_norm and k_norm whole; o_proj's bias on the rank with first_head 0 only (the
/// shares are summed).
/// \throws std::invalid_argument for an invalid config (validate_qwen3_next_config), a shard
///         outside it, or a weight holding NaN or ±∞ anywhere in the whole layer (a sink may be
///         −∞, as for the Qwen3NextAttention constructor); shape_error for weights of the wrong
///         shapes.
template <class Scalar>
std::pair<Qwen3NextConfig, Qwen3NextAttentionWeights<Scalar>> shard_qwen3_next(
    const Qwen3NextConfig& c, const Qwen3NextAttentionWeights<Scalar>& w, const HeadShard& s) {
    constexpr const char* fn = "gattn::shard_qwen3_next";
    validate_qwen3_next_config(c, fn);
    const auto shapes = qwen3_next_weight_shapes(c);
    w.for_each([&](const char* name, const auto& t) {
        gattn::detail::check_weight_shape(fn, name, t, shapes, "not used by this config");
    });
    // The whole layer's values, so that every shard (rank) refuses the same weights.
    w.for_each([&](const char* name, const auto& t) { gattn::detail::check_weight_values(fn, name, t); });
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
        // The sum below needs the same row count on every rank.
        gattn::detail::agree_on_values(fn, {"x rows"}, {double(x.rows())}, m_comm);
        RowMatrix<T> partial(x.rows(), m_config.hidden_size);
        gattn::detail::call_on_every_rank(fn, m_comm,
                                          gattn::detail::out_shape_error(out, x.rows(), m_config.hidden_size), cache,
                                          [&] { m_local.forward(x, positions, cache, partial, counts); });
        MPI_Allreduce(MPI_IN_PLACE, partial.data(), static_cast<int>(partial.size()), gattn::detail::mpi_type<T>(),
                      MPI_SUM, m_comm);
        out = partial;
    }

private:
    static HeadShard checked_shard(const Qwen3NextConfig& c, const HeadShard& s, MPI_Comm comm) {
        gattn::detail::check_rank_shard("gattn::HeadParallelQwen3Next", shard_of(c, comm), s);
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
        : HeadParallelAttention(config, shard_of(config, comm),
                                shard_attention(config, weights, shard_of(config, comm)).second, comm) {}

    /// From this rank's shard alone, e.g. as load_attention_shard read it from a checkpoint
    /// (each rank reads only its rows and columns):
    /// \code
    /// const auto shard = gattn::HeadParallelAttention<float>::shard_of(config, comm);
    /// const auto part = gattn::load_attention_shard<float>(file, config, shard, prefix);
    /// gattn::HeadParallelAttention<float> attention(config, shard, part.second, comm);
    /// \endcode
    /// \param config        the whole layer's config.
    /// \param shard         this rank's heads: shard_of(config, comm).
    /// \param shard_weights the shard's weights, as shard_attention gives them (a G5 gate's
    ///                      gate_proj whole).
    /// \param comm          the ranks that hold the layer's shards.
    /// \throws std::invalid_argument when shard is not this rank's (shard_of), for ALiBi, and
    ///         for a weight holding NaN or ±∞ (as the layer's constructor; each rank checks its
    ///         shard); shape_error for weights of the wrong shapes (as the layer's constructor).
    HeadParallelAttention(const AttentionConfig& config, const HeadShard& shard,
                          const AttentionWeights<Scalar>& shard_weights, MPI_Comm comm)
        : m_comm(comm),
          m_config(config),
          m_shard(checked_shard(config, shard, comm)),
          m_local(gattn::detail::shard_attention_config(config, shard, "gattn::HeadParallelAttention"),
                  without_g5(config, shard_weights)) {
        const GateSpec& g = config.gate;
        if (g.position == GatePosition::G5) {
            const auto shapes = expected_weight_shapes(config);
            constexpr const char* fn = "gattn::HeadParallelAttention";
            const char* unused = "this config's G5 gate has no bias";
            gattn::detail::check_weight_shape(fn, "gate_proj.weight", shard_weights.gate_proj_weight, shapes, unused);
            gattn::detail::check_weight_shape(fn, "gate_proj.bias", shard_weights.gate_proj_bias, shapes, unused);
            gattn::detail::check_weight_values(fn, "gate_proj.weight", shard_weights.gate_proj_weight);
            gattn::detail::check_weight_values(fn, "gate_proj.bias", shard_weights.gate_proj_bias);
            m_g5 =
                Projection<Scalar>(shard_weights.gate_proj_weight,
                                   g.bias ? Vector<T>(shard_weights.gate_proj_bias.template cast<T>()) : Vector<T>());
        }
    }

    /// The heads rank `rank` of comm holds (head_shard of the config's heads).
    /// \throws std::invalid_argument as head_shard.
    static HeadShard shard_of(const AttentionConfig& c, MPI_Comm comm) {
        int rank = 0, size = 1;
        MPI_Comm_rank(comm, &rank);
        MPI_Comm_size(comm, &size);
        return head_shard(c.num_heads, c.num_kv_heads, rank, size);
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
    ///         "rank k of P"), and std::invalid_argument when the ranks' x rows or batch differ.
    void forward(ConstMatrixRef<T> x, Index batch, MatrixRef<T> out, const ForwardOptions<T>& options = {}) const {
        constexpr const char* fn = "gattn::HeadParallelAttention::forward";
        // The sum below needs the same row count on every rank.
        gattn::detail::agree_on_values(fn, {"x rows", "batch"}, {double(x.rows()), double(batch)}, m_comm);
        RowMatrix<T> partial(x.rows(), m_config.d_model);
        gattn::detail::call_on_every_rank(
            fn, m_comm, gattn::detail::out_shape_error(out, x.rows(), m_config.d_model), [&] {
                ForwardOptions<T> local = options;
                std::unique_ptr<bool[]> bool_heads;
                std::unique_ptr<T[]> bias_heads;
                local.bool_mask = heads_of(options.bool_mask, "options.bool_mask", bool_heads);
                local.bias = heads_of(options.bias, "options.bias", bias_heads);
                m_local.forward(x, batch, partial, local);
            });
        finish(x, partial, out);
    }

    /// GatedMultiHeadAttention::forward(x, cache, out, counts) over all ranks: this rank's heads
    /// on its cache (make_cache), then as the form above.
    /// \throws on every rank, as above; every rank's cache is then left as it was.
    template <class CacheScalar>
    void forward(ConstMatrixRef<T> x, KVCache<CacheScalar>& cache, MatrixRef<T> out,
                 const std::vector<Index>& counts = {}) const {
        constexpr const char* fn = "gattn::HeadParallelAttention::forward";
        gattn::detail::agree_on_values(fn, {"x rows"}, {double(x.rows())}, m_comm);
        RowMatrix<T> partial(x.rows(), m_config.d_model);
        gattn::detail::call_on_every_rank(fn, m_comm, gattn::detail::out_shape_error(out, x.rows(), m_config.d_model),
                                          cache, [&] { m_local.forward(x, cache, partial, counts); });
        finish(x, partial, out);
    }

private:
    static HeadShard checked_shard(const AttentionConfig& c, const HeadShard& s, MPI_Comm comm) {
        gattn::detail::check_rank_shard("gattn::HeadParallelAttention", shard_of(c, comm), s);
        return s;
    }
    /// The shard's weights without a G5 gate's, which act after the sum (m_g5).
    static AttentionWeights<Scalar> without_g5(const AttentionConfig& c, AttentionWeights<Scalar> w) {
        if (c.gate.position == GatePosition::G5) {
            w.gate_proj_weight.resize(0, 0);
            w.gate_proj_bias.resize(0);
        }
        return w;
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
