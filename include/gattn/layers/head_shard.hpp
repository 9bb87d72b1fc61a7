// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Which heads one of P shards of an attention layer holds (head parallelism, as vLLM and
/// Megatron-LM split attention heads), and which block of each weight goes with them. Free of
/// MPI: checkpoint loaders read a shard's blocks with it, gattn/dist/head_parallel.hpp runs the
/// shards over MPI.

#include <string>

#include "gattn/errors.hpp"
#include "gattn/types.hpp"

namespace gattn {

/// The heads one rank of a head-parallel layer holds (head_shard).
struct HeadShard {
    Index first_head = 0;     ///< its first query head
    Index num_heads = 0;      ///< query heads it holds (H / P)
    Index first_kv_head = 0;  ///< the first KV head its query heads read
    Index num_kv_heads = 0;   ///< KV heads it holds (H_kv / P, or 1 replicated)
};

/// The part of one weight that a shard holds: rows [first_row, first_row + rows) and columns
/// [first_col, first_col + cols) of a matrix in nn.Linear layout ([out, in]), or elements
/// [first_row, first_row + rows) of a vector (cols 1); `zero`: the shard holds zeros of that
/// shape instead (a bias that only one shard adds before the shares are summed).
struct WeightBlock {
    Index first_row = 0;  ///< first row (vector: first element)
    Index rows = 0;       ///< rows (vector: elements)
    Index first_col = 0;  ///< first column (vector: 0)
    Index cols = 0;       ///< columns (vector: 1)
    bool zero = false;    ///< zeros of shape [rows, cols] instead of the weight's values
};

}  // namespace gattn

GATTN_BEGIN_ISA_NAMESPACE

namespace detail {

/// Throws std::invalid_argument from `fn` unless `s` is a shard that head_shard could give for
/// H query and H_kv KV heads: whole KV groups (G = H / H_kv query heads each) with their KV
/// heads, or part of one group with its one KV head, so that the shard's query head h reads
/// its KV head h / (num_heads / num_kv_heads) as in the whole layer.
inline void check_shard_heads(const char* fn, const HeadShard& s, Index H, Index Hkv) {
    const Index G = Hkv > 0 ? H / Hkv : 0;
    const bool inside = s.num_heads >= 1 && s.first_head >= 0 && s.first_head + s.num_heads <= H &&
                        s.num_kv_heads >= 1 && s.first_kv_head >= 0 && s.first_kv_head + s.num_kv_heads <= Hkv && G > 0;
    const bool groups = inside && s.num_heads == s.num_kv_heads * G && s.first_head == s.first_kv_head * G;
    const bool part = inside && s.num_kv_heads == 1 && s.first_head / G == s.first_kv_head &&
                      (s.first_head + s.num_heads - 1) / G == s.first_kv_head;
    if (!groups && !part)
        throw_invalid(fn, "shard",
                      "must hold whole KV groups with their KV heads, or part of one group with its KV head, "
                      "within the config's " +
                          std::to_string(H) + " query and " + std::to_string(Hkv) + " KV heads; got query heads from " +
                          std::to_string(s.first_head) + " (" + std::to_string(s.num_heads) + ") and KV heads from " +
                          std::to_string(s.first_kv_head) + " (" + std::to_string(s.num_kv_heads) + ")");
}

}  // namespace detail

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

GATTN_END_ISA_NAMESPACE
