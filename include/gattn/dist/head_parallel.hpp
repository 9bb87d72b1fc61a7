// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Head parallelism (tensor parallelism over attention heads) over MPI for Qwen3-Next's layer:
/// rank p of P holds H / P query heads, the KV heads they read, their rows of q_proj (query and
/// gate), k_proj and v_proj, and their columns of o_proj, so it computes its heads' share of
/// the output, o_proj(U_p ⊙ σ(gate_p)); one MPI_Allreduce sums the shares (Megatron-LM's
/// row-parallel output projection, Shoeybi et al. 2019; vLLM and xFasterTransformer split
/// attention heads the same way). KV heads are split when P divides H_kv and replicated
/// otherwise (each rank's query heads then read one KV head), as vLLM does. Each rank's KV
/// cache holds only its KV heads, so the cache is sharded with the heads.
///
/// Only for programs that link MPI (this header includes <mpi.h>; the rest of gattn never does).

#include <mpi.h>

#include <string>
#include <utility>
#include <vector>

#include "gattn/dist/ring_attention.hpp"
#include "gattn/models/qwen3_next_attention.hpp"

namespace gattn {

/// The heads one rank of a head-parallel layer holds (head_shard).
struct HeadShard {
    Index first_head = 0;     ///< its first query head
    Index num_heads = 0;      ///< query heads it holds (H / P)
    Index first_kv_head = 0;  ///< the first KV head its query heads read
    Index num_kv_heads = 0;   ///< KV heads it holds (H_kv / P, or 1 replicated)
};

}  // namespace gattn

GATTN_BEGIN_ISA_NAMESPACE

/// Rank `rank` of `size`'s heads: query heads [rank·H/P, (rank + 1)·H/P), and either KV heads
/// [rank·H_kv/P, …) when P divides H_kv, or the one KV head its query heads read when H_kv
/// divides P (replicated on P / H_kv ranks).
/// \throws std::invalid_argument when P does not divide H, or neither of P and H_kv divides the
///         other, or the counts are not positive (the message gives H, H_kv and P).
inline HeadShard head_shard(Index num_heads, Index num_kv_heads, int rank, int size) {
    const Index H = num_heads, Hkv = num_kv_heads, P = size;
    const bool split = P > 0 && Hkv > 0 && Hkv % P == 0, replicate = P > 0 && Hkv > 0 && P % Hkv == 0;
    if (P < 1 || H < 1 || Hkv < 1 || H % Hkv != 0 || H % P != 0 || !(split || replicate) || rank < 0 || rank >= P)
        gattn::detail::throw_invalid("gattn::head_shard", "size",
                                     "must divide the " + std::to_string(H) + " query heads and divide or be a " +
                                         "multiple of the " + std::to_string(Hkv) + " KV heads, got " +
                                         std::to_string(P) + " ranks (rank " + std::to_string(rank) + ")");
    HeadShard s;
    s.num_heads = H / P;
    s.first_head = rank * s.num_heads;
    s.num_kv_heads = split ? Hkv / P : 1;
    s.first_kv_head = split ? rank * s.num_kv_heads : s.first_head / (H / Hkv);
    return s;
}

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
    const Index d = c.head_dim, q_stride = c.attn_output_gate ? 2 * d : d;
    if (s.num_heads < 1 || s.first_head < 0 || s.first_head + s.num_heads > c.num_attention_heads ||
        s.num_kv_heads < 1 || s.first_kv_head < 0 || s.first_kv_head + s.num_kv_heads > c.num_key_value_heads)
        gattn::detail::throw_invalid(fn, "shard", "must lie within the config's heads");
    Qwen3NextConfig sc = c;
    sc.num_attention_heads = s.num_heads;
    sc.num_key_value_heads = s.num_kv_heads;
    Qwen3NextAttentionWeights<Scalar> sw;
    sw.q_proj_weight = w.q_proj_weight.middleRows(s.first_head * q_stride, s.num_heads * q_stride);
    sw.k_proj_weight = w.k_proj_weight.middleRows(s.first_kv_head * d, s.num_kv_heads * d);
    sw.v_proj_weight = w.v_proj_weight.middleRows(s.first_kv_head * d, s.num_kv_heads * d);
    sw.o_proj_weight = w.o_proj_weight.middleCols(s.first_head * d, s.num_heads * d);
    sw.q_norm_weight = w.q_norm_weight;
    sw.k_norm_weight = w.k_norm_weight;
    if (c.attention_bias) {
        sw.q_proj_bias = w.q_proj_bias.segment(s.first_head * q_stride, s.num_heads * q_stride);
        sw.k_proj_bias = w.k_proj_bias.segment(s.first_kv_head * d, s.num_kv_heads * d);
        sw.v_proj_bias = w.v_proj_bias.segment(s.first_kv_head * d, s.num_kv_heads * d);
        sw.o_proj_bias = s.first_head == 0 ? w.o_proj_bias : Vector<Scalar>::Zero(w.o_proj_bias.size());
    }
    if (c.attention_sinks) sw.sinks = w.sinks.segment(s.first_head, s.num_heads);
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
    static HeadShard shard_of(const Qwen3NextConfig& c, MPI_Comm comm) {
        int rank = 0, size = 1;
        MPI_Comm_rank(comm, &rank);
        MPI_Comm_size(comm, &size);
        return head_shard(c.num_attention_heads, c.num_key_value_heads, rank, size);
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

GATTN_END_ISA_NAMESPACE
