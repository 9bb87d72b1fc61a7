// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// SDPA for few queries per KV head (token-by-token decoding): keys in the SIMD lanes, and the
/// keys split into fixed chunks whose partial results merge exactly through the log-sum-exp
/// (split-KV, as FlashDecoding), so one long KV cache is shared by all threads.
///
/// Per chunk and query row: for each block of L keys (L = SIMD lanes), L dot products over d_k
/// (features in lanes) reduce into one register of L logits, then the online
/// softmax runs on that register and Σ p_j v_j is accumulated over d_v. All query rows of a GQA
/// group walk the same key block while it is in L1, so K and V stream from memory once, and
/// up to kDecodeRows rows at a time share each K and V register load.
/// A masked key is skipped in the value sum (never multiplied by 0).
/// With one query row per KV head (multi-head attention) over a float cache read from memory,
/// each key block is read in address order instead: every head's products key row by key row
/// (for kDecodeOrderBlocks blocks at a time), then each head's softmax, then every
/// head's value sums key row by key row (the same sums in the same order).
/// Chunks are cut at fixed key positions (multiples of kChunkKeys), never by thread count, and
/// merged in order, so results do not depend on the number of threads.
///
/// A bf16 cache is read in place: either each register is widened exactly to float as it is
/// loaded, or (AVX512-BF16, head sizes multiples of 32) both products run as VDPBF16PS on the
/// bf16 rows, with P rounded to bf16 (decode_bf16): half the instructions, no widening; on
/// ARM64 with BF16 (head sizes multiples of 8) the same with BFDOT (decode_bfdot).
/// An int8 cache (ops/int8_rows.hpp) is read in place too: each key's scales multiply its logit
/// and its weight in the value sum. With AVX512-VNNI, or AVX-VNNI on an AVX2 machine, the
/// logits (d_k a multiple of 32) are integer products (VPDPWSSD) of the key codes and the query
/// rounded to 16-bit integers, and the value sum (d_v a multiple of 64) integer products of the
/// value codes and the weights rounded to 16-bit integers per block (decode_int8,
/// decode_int8_ymm); otherwise the codes are widened to float as they load.
/// A float cache on ARM64 with SVE vectors wider than 128 bits runs both products in SVE
/// (decode_sve): the same blocks of 4 keys, features in vectors of the CPU's length.
/// The VDPBF16PS, BFDOT, VPDPWSSD, SDOT and SVE micro-kernels live in their tiers' headers
/// (simd/x86_avx512bf16.hpp, simd/arm_neon_bf16.hpp, simd/x86_avx512vnni.hpp,
/// simd/x86_avxvnni.hpp, simd/arm_neon_dotprod.hpp, simd/arm_sve.hpp); this file drives them.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "gattn/ops/bf16_flash_kernel.hpp"
#include "gattn/ops/flash_kernel.hpp"
#include "gattn/ops/int8_rows.hpp"
#include "gattn/simd/math.hpp"
#include "gattn/simd/tiers.hpp"
#include "gattn/types.hpp"

GATTN_BEGIN_ISA_NAMESPACE
namespace kernel {

/// Bytes of K and V a decoding call reads above which they come from memory, not from cache:
/// the kernel then asks for the rows two blocks ahead with prefetch instructions spread over
/// the work (decode_chunk). Below it (caches that fit L3) prefetch instructions one block
/// ahead, at once, were 5–9 % faster than plain loads ahead; above it the loads were (measured
/// at 4k and 8k keys, d = 256, 2 KV heads), and the spread prefetches are faster still.
inline constexpr Index kDecodeFromMemoryBytes = Index(12) << 20;

/// A query row rounded to 16-bit codes (and residual codes) as the integer logits of `family`
/// take it, into two buffers of d_k 16-bit slots: decode_int8_ymm::quantize_query for AvxVnni,
/// decode_int8::quantize_query for Vnni (the same rounding; the outlier test sums in another
/// order), decode_sdot::quantize_query for Sdot (each code as two bytes, all high bytes then all
/// low bytes, in the same 2·d_k bytes). Only for a family compiled in.
inline decode_int8::QueryScales quantize_query_for(Int8Kernel family, const float* q, Index dk, std::int16_t* codes,
                                                   std::int16_t* residual) noexcept {
    if constexpr (simd::neon_dotprod::kEnabled)
        if (family == Int8Kernel::Sdot) {
            const auto s = decode_sdot::quantize_query(q, dk, reinterpret_cast<std::int8_t*>(codes),
                                                       reinterpret_cast<std::int8_t*>(residual));
            return {s.scale, s.residual_scale};
        }
    if constexpr (simd::avxvnni::kEnabled)
        if (family == Int8Kernel::AvxVnni) return decode_int8_ymm::quantize_query(q, dk, codes, residual);
    if constexpr (simd::avx512vnni::kEnabled)
        if (family == Int8Kernel::Vnni) return decode_int8::quantize_query(q, dk, codes, residual);
    (void)family, (void)q, (void)dk, (void)codes, (void)residual;
    return {};
}

/// The query that quantize_query_for(family, …)'s codes stand for, out [d_k] in float: what the
/// integer logits multiply the keys by (decode_sdot::dequantize_query for Sdot,
/// decode_int8::dequantize_query otherwise).
inline void dequantize_query_for(Int8Kernel family, const std::int16_t* codes, const std::int16_t* residual,
                                 decode_int8::QueryScales scales, Index dk, float* out) noexcept {
    if (family == Int8Kernel::Sdot)
        decode_sdot::dequantize_query(reinterpret_cast<const std::int8_t*>(codes),
                                      reinterpret_cast<const std::int8_t*>(residual),
                                      {scales.scale, scales.residual_scale}, dk, out);
    else
        decode_int8::dequantize_query(codes, residual, scales, dk, out);
}

/// Keys per split-KV chunk: short enough that a 1k-key cache already gives two threads work
/// (1.7× one thread measured at N_k = 1024), long enough that merging, d_v + 3 values per row
/// and chunk, stays negligible.
inline constexpr Index kChunkKeys = 512;

/// Online-softmax state of `rows` query rows over one chunk: m, l and the unnormalised output.
template <class T>
struct PartialState {
    std::vector<T> m, l, first;  // first: logit of key 0 (−∞ if unseen)
    // rows × d_v, aligned to the register (Eigen's allocator): a value sum read and written
    // every key (values_in_address_order) then never straddles two cache lines.
    std::vector<T, Eigen::aligned_allocator<T>> acc;
    void reset(int rows, Index dv) {
        m.assign(static_cast<std::size_t>(rows), -std::numeric_limits<T>::infinity());
        l.assign(static_cast<std::size_t>(rows), T(0));
        acc.assign(static_cast<std::size_t>(rows * dv), T(0));
        first.assign(static_cast<std::size_t>(rows), -std::numeric_limits<T>::infinity());
    }
};

/// Query rows of one KV head that share each load of K and V: 4 with 32 vector registers
/// (AVX-512), 2 with 16. Loading a key block once per group instead of once per row matters
/// for GQA, whose rows (8 in Qwen3-Next) would otherwise each stream the block through L1.
/// The value sum keeps up to kDecodeValueRegisters accumulators.
/// (simd::DecodeTiles: the tier's.)
inline constexpr int kDecodeRows = simd::DecodeTiles::kRows, kDecodeValueRegisters = simd::DecodeTiles::kValueRegisters;

/// One register of T from L values of type KV at p: a plain load, or 16-bit values or int8
/// codes widened exactly (the keys and values of a 16-bit or int8 KV cache are read in place;
/// the tiers' widen: simd/x86_avx512.hpp, simd/x86_avx2.hpp, simd/arm_neon.hpp).
template <class T, class KV>
inline simd::Batch<T> load_widened(const KV* p) noexcept {
    using B = simd::Batch<T>;
    if constexpr (std::is_same_v<T, KV>) {
        return B::load_unaligned(p);
    } else {  // each tier's widen takes int8 codes and 16-bit floats alike
        if constexpr (simd::avx512::kEnabled && std::is_same_v<T, float> && sizeof(B) == 64)
            return simd::avx512::widen<B>(p);
        if constexpr (simd::avx2::kEnabled && std::is_same_v<T, float> && sizeof(B) == 32)
            return simd::avx2::widen<B>(p);
        if constexpr (simd::neon::kEnabled && std::is_same_v<T, float> && sizeof(B) == 16)
            return simd::neon::widen<B>(p);
        alignas(64) T w[simd::kLanes<T>];
        for (std::size_t i = 0; i < simd::kLanes<T>; ++i) w[i] = static_cast<T>(p[i]);
        return B::load_aligned(w);
    }
}

/// dots[r][kk] = Σ over vector steps of q_r[d]·K[kk][d] (one register of partial sums per
/// row and key, d < dk_vec), for R rows and keys kk < nk; registers for kk in [nk, L) are 0.
/// Four keys at a time, each K vector feeding the R rows, so that 4·R independent FMA chains
/// hide the FMA latency; a single row (MHA: a KV head per query head) takes eight keys at a
/// time instead, for eight chains. Each (row, key) chain runs over d in order, as for one row
/// alone, so the results are the same in either grouping.
template <class T, int R, class KV = T>
inline void group_logits(const T* const* q, const KV* key, Index key_stride, Index nk, Index dk_vec,
                         simd::Batch<T> (*dots)[simd::kLanes<T>]) noexcept {
    using B = simd::Batch<T>;
    constexpr Index L = static_cast<Index>(simd::kLanes<T>);
    constexpr int G = R == 1 && L >= 8 ? 8 : L >= 4 ? 4 : static_cast<int>(L);  // keys at a time, at most a block
    Index kk = 0;
    for (; kk + G <= nk; kk += G) {
        const KV* k = key + kk * key_stride;
        B a[R][G];
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            GATTN_UNROLL
            for (int i = 0; i < G; ++i) a[r][i] = B(T(0));
        }
        for (Index d = 0; d < dk_vec; d += L) {
            // Each K and q vector is loaded once into a register (opaque): g++ would otherwise
            // fold the loads into the FMAs, loading each vector once per use, R or 4 times;
            // one 512-bit load per cycle (AMD Zen 4) then bounds the loop (1.2–1.3× at 4k–32k keys).
            // A single row uses each K vector once: folded into its FMA, it takes no register.
            if constexpr (G == 8) {
                const B qd = simd::opaque<T>(B::load_unaligned(q[0] + d));
                GATTN_UNROLL
                for (int i = 0; i < G; ++i) a[0][i] = simd::fma(qd, load_widened<T>(k + i * key_stride + d), a[0][i]);
            } else {
                B kv[G];
                GATTN_UNROLL
                for (int i = 0; i < G; ++i) kv[i] = simd::opaque<T>(load_widened<T>(k + i * key_stride + d));
                GATTN_UNROLL
                for (int r = 0; r < R; ++r) {
                    const B qd = simd::opaque<T>(B::load_unaligned(q[r] + d));
                    GATTN_UNROLL
                    for (int i = 0; i < G; ++i) a[r][i] = simd::fma(qd, kv[i], a[r][i]);
                }
            }
        }
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            GATTN_UNROLL
            for (int i = 0; i < G; ++i) dots[r][kk + i] = a[r][i];
        }
    }
    for (; kk + 4 <= nk && G == 8; kk += 4) {  // four keys left of eight
        const KV* k = key + kk * key_stride;
        B a[4] = {B(T(0)), B(T(0)), B(T(0)), B(T(0))};
        for (Index d = 0; d < dk_vec; d += L) {
            const B qd = simd::opaque<T>(B::load_unaligned(q[0] + d));
            GATTN_UNROLL
            for (int i = 0; i < 4; ++i) a[i] = simd::fma(qd, load_widened<T>(k + i * key_stride + d), a[i]);
        }
        GATTN_UNROLL
        for (int i = 0; i < 4; ++i) dots[0][kk + i] = a[i];
    }
    for (; kk < L; ++kk) {
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            B a(T(0));
            if (kk < nk) {
                const KV* k = key + kk * key_stride;
                for (Index d = 0; d < dk_vec; d += L)
                    a = simd::fma(B::load_unaligned(q[r] + d), load_widened<T>(k + d), a);
            }
            dots[r][kk] = a;
        }
    }
}

/// acc_r[j] += Σ_kk p[r][kk]·V[kk][j] for R rows, over kk < nk in order, one fused
/// multiply-add per key, in registers across the keys; each V vector feeds the R rows. A
/// masked key (score −∞) is skipped, its V row may be garbage, even NaN; a visible key whose
/// weight underflowed to 0 is not (0·NaN = NaN). A block whose keys are all visible to the R
/// rows (the common case) runs without the per-key test.
template <class T, int R, class KV = T>
inline void group_values(const T (*score)[simd::kLanes<T>], const T (*p)[simd::kLanes<T>], Index nk, const KV* value,
                         Index value_stride, T* const* acc, Index dv) noexcept {
    using B = simd::Batch<T>;
    constexpr Index L = static_cast<Index>(simd::kLanes<T>);
    constexpr int C = std::min(8, kDecodeValueRegisters / (R > 2 ? 4 : R));  // registers of d_v per row
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    bool skips = false;
    GATTN_UNROLL
    for (int r = 0; r < R; ++r)
        for (Index kk = 0; kk < nk; ++kk) skips = skips || score[r][kk] == kNegInf;
    Index j = 0;
    auto blocks = [&](auto tests) {
        for (; j + C * L <= dv; j += C * L) {
            B a[R][C];
            GATTN_UNROLL
            for (int r = 0; r < R; ++r) {
                GATTN_UNROLL
                for (int c = 0; c < C; ++c) a[r][c] = B::load_unaligned(acc[r] + j + c * L);
            }
            for (Index kk = 0; kk < nk; ++kk) {
                const KV* v = value + kk * value_stride + j;
                B vb[C];
                // Loaded once for the R rows (opaque, as in group_logits); a single row's loads
                // fold into its FMAs (C accumulators and C loaded vectors would not fit in 16
                // registers, and an accumulator would go through memory every key).
                GATTN_UNROLL
                for (int c = 0; c < C; ++c)
                    vb[c] = R == 1 ? load_widened<T>(v + c * L) : simd::opaque<T>(load_widened<T>(v + c * L));
                GATTN_UNROLL
                for (int r = 0; r < R; ++r) {
                    if (decltype(tests)::value && score[r][kk] == kNegInf) continue;
                    const B pk(p[r][kk]);
                    GATTN_UNROLL
                    for (int c = 0; c < C; ++c) a[r][c] = simd::fma(pk, vb[c], a[r][c]);
                }
            }
            GATTN_UNROLL
            for (int r = 0; r < R; ++r) {
                GATTN_UNROLL
                for (int c = 0; c < C; ++c) a[r][c].store_unaligned(acc[r] + j + c * L);
            }
        }
    };
    if (skips)
        blocks(std::true_type{});
    else
        blocks(std::false_type{});
    for (; j + L <= dv; j += L) {
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            B a = B::load_unaligned(acc[r] + j);
            for (Index kk = 0; kk < nk; ++kk)
                if (score[r][kk] != kNegInf)
                    a = simd::fma(B(p[r][kk]), load_widened<T>(value + kk * value_stride + j), a);
            a.store_unaligned(acc[r] + j);
        }
    }
    for (; j < dv; ++j) {
        GATTN_UNROLL
        for (int r = 0; r < R; ++r)
            for (Index kk = 0; kk < nk; ++kk)
                if (score[r][kk] != kNegInf)
                    acc[r][j] = std::fma(p[r][kk], static_cast<T>(value[kk * value_stride + j]), acc[r][j]);
    }
}

/// Address-order decoding (logits_in_address_order, values_in_address_order): while a key
/// row is read, lines of the row kRowsAhead further are asked for (into L2). Rows are 4 KiB at
/// 8 KV heads, d = 128: one memory page each, and the hardware prefetchers, which do not cross
/// a page, start on each row only once it is read. Either the first kRowLeadLines lines of the
/// row ahead, at once (1.49× at 8k keys and 1.29× at 32k against none, AMD Zen 5), or, where
/// the tier says so (simd::DecodeTiles::kLeadWholeRow), one line in every kLeadLineStep of the
/// whole row, each head's lines asked for as that head's slice of the current row is read.
inline constexpr Index kRowsAhead = 8, kRowLeadLines = 4, kLeadLineStep = 4;

/// Address-order decoding reads the K rows of kDecodeOrderBlocks key blocks before their V
/// rows (float, 8 KV heads, d = 128: on AVX-512, 16 blocks of 16 keys, 1 MiB of K; on AVX2, 16
/// blocks of 8 keys, 512 KiB), keeping each head's logits of those blocks. Phases of 16 blocks
/// instead of one block, 8 on 8 KV heads, d = 128, one thread, AMD Zen 4, 15 pairs of runs,
/// new / old time, medians: 0.944 (8k keys) and 0.936 (32k) with AVX-512, 0.964 and 0.893 with
/// AVX2 (single pairs 0.74–1.10: busy neighbours); phases of 64 blocks were 1.05–1.09× slower
/// than 16. A plain read of K and V rows in 2 MiB pages streamed 24–27 GB/s in phases of 16
/// rows, 28–29 in phases of 256 (in 4 KiB pages 15–18 GB/s, little changed by the phase).
inline constexpr Index kDecodeOrderBlocks = 16;

/// Asks for the first kRowLeadLines lines of the row at p (see kRowsAhead), unless the tier
/// leads whole rows (lead_slice).
template <class T>
inline void lead_row(const T* p) noexcept {
    if constexpr (!simd::DecodeTiles::kLeadWholeRow)
        for (Index e = 0; e < kRowLeadLines; ++e) simd::prefetch_outer(p + e * Index(simd::kLineElems<T>));
}

/// Asks for one line in every kLeadLineStep of the n values at p, one head's slice of the row
/// ahead, where the tier leads whole rows (see kRowsAhead).
template <class T>
inline void lead_slice(const T* p, Index n) noexcept {
    constexpr Index kStep = kLeadLineStep * Index(simd::kLineElems<T>);
    if constexpr (simd::DecodeTiles::kLeadWholeRow)
        for (Index e = 0; e < n; e += kStep) simd::prefetch_outer(p + e);
}

/// Calls f(std::integral_constant<int, V>{}) with V = n when n is 4, 8 or 16 (whole registers
/// of d = 64, 128 or 256 floats with AVX-512), else with V = 0: the usual head sizes get loops
/// of a constant trip count, which the compiler unrolls.
template <class F>
inline void with_register_count(Index n, F&& f) {
    if (n == 8)
        f(std::integral_constant<int, 8>{});
    else if (n == 16)
        f(std::integral_constant<int, 16>{});
    else if (n == 4)
        f(std::integral_constant<int, 4>{});
    else
        f(std::integral_constant<int, 0>{});
}

/// Multi-head attention decoding (one query row per KV head), the logits' dot products of a
/// key block read in address order: logits[g·L + kk] is the dot product over d < dk_vec of key
/// kk and KV head g's row blks[g].q[0] (kk < nk; 0 for kk in [nk, L)), key kk's row of all
/// heads at key + kk·key_stride; dots (H_kv·L·L elements) holds the partial sums. A head
/// without a row (its sums go unused) multiplies its own K row. Each (head, key) chain runs
/// over d in order and is reduced across lanes by simd::reduce_sum_rows, as in group_logits,
/// so the sums are bitwise those of group_logits; eight heads at a time give eight independent
/// chains, which run side by side out of order while the row is read front to back. Rows
/// [0, rows) lie at that stride (the lead stays among them).
template <class T>
inline void logits_in_address_order(const FlashBlock<T>* blks, Index heads, const T* key, Index key_stride, Index dk,
                                    Index nk, Index dk_vec, Index rows, T* dots, T* logits) noexcept {
    using B = simd::Batch<T>;
    constexpr Index L = static_cast<Index>(simd::kLanes<T>);
    with_register_count(dk_vec % L == 0 ? dk_vec / L : 0, [&](auto vecs) {
        constexpr int V = decltype(vecs)::value;
        const Index dkv = V > 0 ? V * L : dk_vec;  // a constant for the usual head sizes: unrolled
        for (Index kk = 0; kk < L; ++kk) {
            const T* k = key + kk * key_stride;
            const T* ahead = kk + kRowsAhead < rows ? k + kRowsAhead * key_stride : nullptr;
            if (ahead) lead_row(ahead);
            for (Index g0 = 0; g0 < heads; g0 += 8)
                with_constant<9>(static_cast<int>(std::min<Index>(8, heads - g0)), [&](auto count) {
                    constexpr int N = decltype(count)::value;
                    if constexpr (N > 0) {
                        B a[N];
                        const T* q[N];
                        GATTN_UNROLL
                        for (int i = 0; i < N; ++i) {
                            a[i] = B(T(0));
                            q[i] = blks[g0 + i].count > 0 ? blks[g0 + i].q[0] : k + (g0 + i) * dk;
                        }
                        // Head after head, so that the row's lines load in address order: by d
                        // first (every head's slice in turn, 512 bytes apart) the same row took
                        // 1.3–1.6× the time on AMD Zen 4, whose prefetchers did not follow.
                        if (kk < nk) {
                            GATTN_UNROLL
                            for (int i = 0; i < N; ++i) {
                                if (ahead) lead_slice(ahead + (g0 + i) * dk, dkv);
                                for (Index d = 0; d < dkv; d += L)
                                    a[i] = simd::fma(B::load_unaligned(q[i] + d),
                                                     B::load_unaligned(k + (g0 + i) * dk + d), a[i]);
                            }
                        }
                        GATTN_UNROLL
                        for (int i = 0; i < N; ++i) a[i].store_unaligned(dots + ((g0 + i) * L + kk) * L);
                    }
                });
        }
    });
    // Reduced here, in L1, so that a phase keeps L logits a head and block, not L registers.
    for (Index g = 0; g < heads; ++g) {
        B sums[L];
        GATTN_UNROLL
        for (Index kk = 0; kk < L; ++kk) sums[kk] = B::load_unaligned(dots + (g * L + kk) * L);
        simd::reduce_sum_rows<T>(sums).store_unaligned(logits + g * L);
    }
}

/// Multi-head attention decoding, the value sums of a key block read in address order:
/// states[g].acc[j] += p[g·L + kk]·V[kk][g·dv + j] for every KV head g (its one row), over
/// the keys kk < nk in order, skipping a key whose score s[g·L + kk] is −∞ (its V row may be
/// garbage), key kk's row of all heads at value + kk·value_stride; d_v a multiple of the
/// register. One fused multiply-add per key, in key order, as group_values adds them: the
/// same bits. Rows [0, rows) lie at that stride (the lead stays among them).
template <class T>
inline void values_in_address_order(const T* s, const T* p, Index heads, Index nk, const T* value, Index value_stride,
                                    Index rows, PartialState<T>* states, Index dv) noexcept {
    using B = simd::Batch<T>;
    constexpr Index L = static_cast<Index>(simd::kLanes<T>);
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    auto sums = [&](auto vecs) {
        constexpr int V = decltype(vecs)::value;
        const Index dvv = V > 0 ? V * L : dv;  // d_v, a constant for the usual head sizes
        for (Index kk = 0; kk < nk; ++kk) {
            const T* v = value + kk * value_stride;
            const T* ahead = kk + kRowsAhead < rows ? v + kRowsAhead * value_stride : nullptr;
            if (ahead) lead_row(ahead);
            for (Index g = 0; g < heads; ++g) {
                if (ahead) lead_slice(ahead + g * dv, dvv);
                if (s[g * L + kk] == kNegInf) continue;
                const B pk(p[g * L + kk]);
                T* a = states[g].acc.data();
                const T* vg = v + g * dv;
                if constexpr (V > 0) {
                    GATTN_UNROLL
                    for (int u = 0; u < V; ++u)
                        simd::fma(pk, B::load_unaligned(vg + u * L), B::load_unaligned(a + u * L))
                            .store_unaligned(a + u * L);
                } else {
                    for (Index j = 0; j < dv; j += L)
                        simd::fma(pk, B::load_unaligned(vg + j), B::load_unaligned(a + j)).store_unaligned(a + j);
                }
            }
        }
    };
    if constexpr (simd::DecodeTiles::kConstantValueWidth)
        with_register_count(dv / L, sums);
    else
        sums(std::integral_constant<int, 0>{});
}

/// Runs the rows of every KV head's block blks[g] (g < num_kv_heads) against keys
/// [k_begin, k_end), accumulating into states[g]. key/value point at key 0, head 0 of the
/// sequence. The KV heads are walked inside each key block, so a [N, H_kv·d] cache is read
/// row after row (rows of one head alone would each sit in another page). from_memory: the
/// call reads more than kDecodeFromMemoryBytes of K and V. KV: the type K and V
/// are stored in (T, or bf16/fp16 widened as they are loaded, or int8 codes); the queries are T.
/// int8 (KV = std::int8_t, T = float): key row j of head g stands for
/// scales.key[j·scales.stride + g] times its codes, value rows likewise (ops/int8_rows.hpp);
/// int8_family: Vnni (decode_int8) or AvxVnni (decode_int8_ymm) runs the integer products where
/// decode_int8 takes the head sizes, WidenedFloat widens the codes (set_int8_kernel_limit),
/// chosen once per SDPA call; a family this unit was not compiled with widens too.
///
/// kDot (bf16 cache; AVX512-BF16 and decode_bf16::takes(dk, dv), or ARM64 BF16 and
/// decode_bfdot::takes(dk, dv)): both products with VDPBF16PS or BFDOT on the bf16 query rows
/// q16[g·kQueries + t] (row t of blks[g]); P is rounded to bf16 and the row sums l add the
/// rounded weights. The states' sums are in feature order on return.
///
/// pages (a paged cache, ops/paged_sdpa.hpp): key j's K and V rows, and its int8 scales, are
/// row pages.row(j) of key_base and value_base; a page holds a multiple of the lanes, so that
/// each key block lies in one page.
///
/// sve (ARM64, float cache, the caller's run-time choice): both products in SVE vectors of the
/// CPU's length (decode_sve), over all of d_k and d_v.
template <class T, class KV = T, bool kDot = false>
void decode_chunk(const FlashBlock<T>* blks, PartialState<T>* states, Index num_kv_heads, Index k_begin, Index k_end,
                  const KV* key_base, Index key_stride, const KV* value_base, Index value_stride, Index dk, Index dv,
                  T scale, bool from_memory, [[maybe_unused]] const KV* const* q16 = nullptr,
                  [[maybe_unused]] const Int8Scales& scales = {},
                  [[maybe_unused]] Int8Kernel int8_family = Int8Kernel::Vnni, const PageMap& pages = {},
                  [[maybe_unused]] bool sve = false) {
    using B = simd::Batch<T>;
    constexpr Index L = static_cast<Index>(simd::kLanes<T>);
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    constexpr bool kInt8 = std::is_same_v<KV, std::int8_t>;
    static_assert(!kInt8 || (std::is_same_v<T, float> && !kDot), "int8 keys and values: float queries");
    // int8: the block's key and value scales of the current KV head (0 past the block), and the
    // weights times the value scales.
    alignas(64) T key_scale[L], value_scale[L], pv_scaled[kDecodeRows][L];
    // int8 with VNNI (decode_int8 on zmm, decode_int8_ymm on ymm) or SDOT (decode_sdot, ARM64,
    // chosen at run time): the query rows as 16-bit codes (SDOT: two bytes each, in the same
    // space) and their scales.
    constexpr bool kInt8Zmm = kInt8 && simd::avx512vnni::kEnabled, kInt8Ymm = kInt8 && simd::avxvnni::kEnabled;
    constexpr bool kSdot = kInt8 && simd::neon_dotprod::kEnabled;
    constexpr bool kInt8Dot = kInt8Zmm || kInt8Ymm || kSdot;
    constexpr Index kRowsPerHead = FlashGeometry<T>::kQueries;
    const bool int8_ymm = kInt8Ymm && int8_family == Int8Kernel::AvxVnni;
    const bool int8_vnni = (kInt8Zmm && int8_family == Int8Kernel::Vnni) || int8_ymm;
    const bool int8_sdot = kSdot && int8_family == Int8Kernel::Sdot;
    const bool int8_dot = (int8_vnni && decode_int8::takes(dk)) || (int8_sdot && decode_sdot::takes(dk));
    [[maybe_unused]] const bool int8_values = int8_vnni && decode_int8::takes_values(dv);
    // Row i = g·kRowsPerHead + t: codes at i·d_k, residual codes at (rows + i)·d_k; scale at i,
    // residual scale at rows + i.
    [[maybe_unused]] const Index q_rows = num_kv_heads * kRowsPerHead;
    [[maybe_unused]] std::int16_t* q_codes = nullptr;
    [[maybe_unused]] float* q_scales = nullptr;
    bool any_residual = false;  // some row has residual codes (a second integer pass)
    if constexpr (kInt8Dot) {
        thread_local std::vector<std::int16_t> codes_kept;  // kept between calls, grown only
        thread_local std::vector<float> scales_kept;
        // Each grown for its own need: codes scale with d_k, scales with the KV heads alone (a
        // call with more heads and a smaller d_k needs more scales and no more codes).
        if (int8_dot && codes_kept.size() < static_cast<std::size_t>(2 * q_rows * dk))
            codes_kept.resize(static_cast<std::size_t>(2 * q_rows * dk));
        if (int8_dot && scales_kept.size() < static_cast<std::size_t>(2 * q_rows))
            scales_kept.resize(static_cast<std::size_t>(2 * q_rows));
        q_codes = codes_kept.data();
        q_scales = scales_kept.data();
        for (Index g = 0; g < num_kv_heads && int8_dot; ++g)
            for (int t = 0; t < blks[g].count; ++t) {
                const Index i = g * kRowsPerHead + t;
                const auto qs =
                    quantize_query_for(int8_family, blks[g].q[t], dk, q_codes + i * dk, q_codes + (q_rows + i) * dk);
                q_scales[i] = qs.scale;
                q_scales[q_rows + i] = qs.residual_scale;
                any_residual = any_residual || qs.residual_scale != 0;
            }
    }
    // kDot: BFDOT on ARM64, else VDPBF16PS.
    constexpr bool kBfdot = kDot && simd::neon_bf16::kEnabled;
    static_assert(!kDot || simd::avx512bf16::kEnabled || kBfdot, "the bf16 decoding kernel needs AVX512-BF16 or BF16");
    static_assert(!kDot || (std::is_same_v<T, float> && std::is_same_v<KV, bfloat16>), "bf16 products: float, bf16");
    [[maybe_unused]] alignas(64) std::uint16_t pw[kDecodeRows][16];  // kDot: P rounded to bf16
    // sve: a float cache with SVE (decode_sve, chosen at run time by the caller).
    static_assert(simd::sve::kEnabled == compiled_with_sve(), "simd/arm_sve.hpp and simd/cpu.hpp disagree");
    constexpr bool kSve = simd::sve::kEnabled && std::is_same_v<T, float> && std::is_same_v<KV, float>;
    sve = kSve && sve;
    const Index dk_vec = kDot || int8_dot || sve ? dk : dk / L * L;
    alignas(64) T s[kDecodeRows][L], p[kDecodeRows][L];  // logits (−∞: skipped) and weights
    B dots[kDecodeRows][L], row_logits[kDecodeRows];
    const bool capped = blks[0].softcap > T(0);  // one softcap per call
    const T inv_cap = capped ? T(1) / blks[0].softcap : T(0);
    alignas(64) T lane_index[L];
    for (Index i = 0; i < L; ++i) lane_index[i] = static_cast<T>(i);
    const B lane = B::load_aligned(lane_index);
    // Only the key blocks some row can see (a sliding window or short lengths leave most of a
    // long cache unread); blocks stay at k_begin + multiples of L, so nothing else changes.
    Index visible_begin = k_end, visible_end = k_begin;
    for (Index g = 0; g < num_kv_heads; ++g)
        for (int t = 0; t < blks[g].count; ++t) {
            const Index lo = std::max(k_begin, blks[g].begin[t]), hi = std::min(k_end, blks[g].end[t]);
            if (lo >= hi) continue;
            visible_begin = std::min(visible_begin, lo);
            visible_end = std::max(visible_end, hi);
        }
    if (visible_begin >= visible_end) return;
    k_begin += (visible_begin - k_begin) / L * L;
    k_end = visible_end;
    // A cache read from memory: prefetch instructions two blocks ahead, spread over the
    // block's work (SpreadPrefetch). int8 into L1: 1.2–1.3× over plain loads two blocks ahead
    // in address order at 32k keys, d = 256, 2 KV heads, 1 and 2 threads, AMD Zen 4. Float and
    // bf16 into L2: into L1 they ran 1.2× slower than those loads (two blocks of their rows
    // fill a 32 KiB L1), into L2 faster, because a plain load that misses holds up retirement
    // until its line arrives, which a prefetch does not. One token, one thread, Zen 4, time
    // with loads / time spread into L2 at 32k keys (8k): 8 query heads on 2 KV heads, d = 128,
    // float 1.33 (1.29), bf16 1.64; 16 on 2, d = 256, float 1.13; bf16 with a KV head per query
    // head 1.18 (1.18). Paged / contiguous stays 0.91–1.03 (pages of 16–256).
    SpreadPrefetch<KV> spread = SpreadPrefetch<KV>::over(key_base, key_stride, value_base, value_stride,
                                                         num_kv_heads * dk, num_kv_heads * dv, pages);
    // A float cache with one query row per KV head (multi-head attention decoding a token) uses
    // each K and V line once, with little arithmetic to hide a burst of loads behind: the
    // hardware prefetchers alone stream it faster than plain loads ahead (0.81–0.85 of the
    // time at 32k keys, 0.95 at 8k, 8 KV heads, d = 128, AVX2 and AVX-512 builds, AMD Zen 5).
    bool one_row_per_head = std::is_same_v<KV, T>;
    for (Index g = 0; g < num_kv_heads; ++g) one_row_per_head = one_row_per_head && blks[g].count <= 1;
    const bool spread_prefetch = from_memory && !one_row_per_head;  // int8: never one_row_per_head
    // With both integer kernels, the prefetches spread over their loops: smoother than a share
    // per row (6.6 -> 6.4 ms one thread, 3.5 -> 3.4 ms two, at 32k keys, medians of 8 runs).
    const bool prefetch_in_kernels = spread_prefetch && int8_dot && int8_values;
    // With one row per KV head and a float cache read from memory, each key block is read in
    // address order: the logits' products of all heads key row by key row (of a phase of
    // kDecodeOrderBlocks blocks), then the softmax of each head, then the value sums key row by
    // key row (logits_in_address_order, values_in_address_order; the same bits). Head after
    // head, each row's 4 KiB ([N, H·d], 8 KV heads, d = 128) was read as eight 512-byte pieces,
    // each in turn for every row of the block, which the memory streams more slowly. In cache,
    // with no memory stream to keep, the order costs more than it gains (8 MiB of K and V,
    // bench_revisions, AMD Zen 4: 32 heads at 256 keys 1.30× the time with AVX-512, 1.39× with
    // AVX2; 8 heads at 1024 keys 1.02× and 1.06×), so there the heads run one after another.
    // A single KV head's rows lie back to back; there the phases and row leads are what let
    // the memory stream them: head after head its K and V rows alternated every 16 keys (8 KiB
    // at d = 128) and a step at 32k keys took 2.2× the time (AVX-512; 1.9× AVX2; AMD Zen 4).
    const bool in_order = from_memory && one_row_per_head && std::is_same_v<KV, T> && !kDot && !sve && dv % L == 0;
    // in_order: the logits' dot products of every head and key of a phase of blocks (their K
    // rows read before their V rows), one block's partial sums, and each head's logits and
    // weights of a block (kept by the thread, grown only; aligned to the register, as
    // PartialState::acc, so that no partial sum stored a key straddles two lines).
    thread_local std::vector<T, Eigen::aligned_allocator<T>> order_buffer;
    T *order_dots = nullptr, *order_logits = nullptr, *order_s = nullptr, *order_p = nullptr;
    const Index block_logits_size = num_kv_heads * L;
    if (in_order) {
        const auto need = static_cast<std::size_t>((L + kDecodeOrderBlocks + 2) * block_logits_size);
        if (order_buffer.size() < need) order_buffer.resize(need);
        order_dots = order_buffer.data();
        order_logits = order_dots + L * block_logits_size;
        order_s = order_logits + kDecodeOrderBlocks * block_logits_size;
        order_p = order_s + block_logits_size;
    }
    Index steps_per_block = 0;
    const Index steps_per_group = int8_ymm ? decode_int8_ymm::prefetch_steps(L, dv) : L / 4 + dv / 64 * (L / 2);
    for (Index g = 0; g < num_kv_heads; ++g)
        steps_per_block += prefetch_in_kernels ? (blks[g].count + kDecodeRows - 1) / kDecodeRows * steps_per_group
                                               : blks[g].count;
    // Prefetch instructions for the K and V rows (all KV heads) of keys [first, last), which lie
    // in one block and so in one page.
    auto prefetch_rows = [&](Index first, Index last) {
        const Index shift = first < last ? pages.row(first) - first : 0;
        for (Index kk = first; kk < last; ++kk) {
            const KV* k = key_base + (kk + shift) * key_stride;
            const KV* v = value_base + (kk + shift) * value_stride;
            for (Index e = 0; e < num_kv_heads * dk; e += simd::kLineElems<KV>) simd::prefetch(k + e);
            for (Index e = 0; e < num_kv_heads * dv; e += simd::kLineElems<KV>) simd::prefetch(v + e);
        }
    };
    // in_order: the rows from key j's row on that lie at the stride (to the sequence's last key,
    // or to the end of j's page), which the row leads stay within.
    [[maybe_unused]] const auto rows_at_stride = [&](Index j) {
        return pages.pages ? pages.page_size - j % pages.page_size : k_end - j;
    };
    for (Index j0 = k_begin; j0 < k_end; j0 += L) {
        const Index nk = std::min(L, k_end - j0);
        const Index r0 = pages.row(j0);  // the block's first row; the others follow it
        if (spread_prefetch) {
            spread.step(-1);  // what rows that saw no key of the last block left
            spread.start(std::min(j0 + 2 * L, k_end), std::min(j0 + 3 * L, k_end), steps_per_block);
            if constexpr (kInt8) {
                // Their scales too: in a paged cache each page's scales lie apart from the
                // last page's, and the hardware prefetchers do not follow (a block lies in one
                // page, so its rows' scales are contiguous).
                if (pages.pages && spread.next < spread.end) {
                    const Index first = pages.row(spread.next) * scales.stride;
                    const Index count = (spread.end - spread.next) * scales.stride;
                    for (Index e = 0; e < count; e += simd::kLineElems<float>) {
                        simd::prefetch(scales.key + first + e);
                        simd::prefetch(scales.value + first + e);
                    }
                    simd::prefetch(scales.key + first + count - 1);  // the last line, when not aligned
                    simd::prefetch(scales.value + first + count - 1);
                }
            }
        } else if (!from_memory) {
            prefetch_rows(std::min(j0 + L, k_end), std::min(j0 + 2 * L, k_end));  // a block ahead of its use
        }
        [[maybe_unused]] const T* block_logits = order_logits;  // in_order: this block's dot products
        if (in_order) {
            const Index slot = (j0 - k_begin) / L % kDecodeOrderBlocks;
            block_logits = order_logits + slot * block_logits_size;
            if constexpr (std::is_same_v<KV, T>)
                if (slot == 0)  // the logits of the phase's blocks, before any of their V rows
                    for (Index b = 0; b < kDecodeOrderBlocks && j0 + b * L < k_end; ++b) {
                        const Index jb = j0 + b * L;
                        logits_in_address_order<T>(blks, num_kv_heads, key_base + pages.row(jb) * key_stride,
                                                   key_stride, dk, std::min(L, k_end - jb), dk_vec, rows_at_stride(jb),
                                                   order_dots, order_logits + b * block_logits_size);
                    }
            std::fill(order_s, order_s + num_kv_heads * L, kNegInf);  // a head that sees no key adds nothing
        }
        for (Index g = 0; g < num_kv_heads; ++g) {
            const FlashBlock<T>& blk = blks[g];
            PartialState<T>& st = states[g];
            const KV* key = key_base + g * dk;
            const KV* value = value_base + g * dv;
            if constexpr (kInt8)
                for (Index kk = 0; kk < L; ++kk) {
                    key_scale[kk] = kk < nk ? scales.key[(r0 + kk) * scales.stride + g] : T(0);
                    value_scale[kk] = kk < nk ? scales.value[(r0 + kk) * scales.stride + g] : T(0);
                }
            for (int t0 = 0; t0 < blk.count; t0 += kDecodeRows) {
                const int rows = std::min(kDecodeRows, blk.count - t0);
                bool any = false;
                for (int t = t0; t < t0 + rows; ++t)
                    any = any || std::max(j0, blk.begin[t]) < std::min(j0 + nk, blk.end[t]);
                if (!any) continue;  // no row of the group sees a key of this block
                T* acc[kDecodeRows];
                for (int r = 0; r < rows; ++r) acc[r] = st.acc.data() + (t0 + r) * dv;
                with_constant<kDecodeRows + 1>(rows, [&](auto rows_constant) {
                    constexpr int R = decltype(rows_constant)::value;
                    if constexpr (R > 0) {
                        // The logits' dot products: VDPBF16PS or BFDOT (bf16; BFDOT reduced
                        // across lanes into row_logits), VPDPWSSD (int8, reduced), or FMAs.
                        bool products_done = false, reduced = false;
                        if constexpr (kBfdot) {
                            decode_bfdot::logits<R>(q16 + g * FlashGeometry<T>::kQueries + t0, key + r0 * key_stride,
                                                    key_stride, nk, dk, row_logits);
                            products_done = reduced = true;
                        } else if constexpr (kDot) {
                            decode_bf16::logits<R>(q16 + g * FlashGeometry<T>::kQueries + t0, key + r0 * key_stride,
                                                   key_stride, nk, dk, dots);
                            products_done = true;
                        }
                        if constexpr (kSve) {
                            if (sve) {
                                decode_sve::logits<R>(blk.q + t0, key + r0 * key_stride, key_stride, nk, dk,
                                                      row_logits);
                                products_done = reduced = true;
                            }
                        }
                        if constexpr (kInt8Dot) {
                            if (int8_dot) {
                                const std::int16_t* qc[R];
                                GATTN_UNROLL
                                for (int r = 0; r < R; ++r) qc[r] = q_codes + (g * kRowsPerHead + t0 + r) * dk;
                                // Logits of R rows by the family's kernel (zmm, ymm or SDOT).
                                auto int8_logits = [&](const float* qs, B* out, SpreadPrefetch<KV>* pf) {
                                    const KV* kb = key + r0 * key_stride;
                                    if constexpr (kSdot) {
                                        const std::int8_t* qb[R];
                                        GATTN_UNROLL
                                        for (int r = 0; r < R; ++r) qb[r] = reinterpret_cast<const std::int8_t*>(qc[r]);
                                        return decode_sdot::logits<R>(qb, qs, kb, key_stride, nk, dk, out, pf);
                                    }
                                    if constexpr (kInt8Ymm)
                                        if (int8_ymm || !kInt8Zmm)
                                            return decode_int8_ymm::logits<R>(qc, qs, kb, key_stride, nk, dk, out, pf);
                                    if constexpr (kInt8Zmm)
                                        decode_int8::logits<R>(qc, qs, kb, key_stride, nk, dk, out, pf);
                                };
                                int8_logits(q_scales + g * kRowsPerHead + t0, row_logits,
                                            prefetch_in_kernels ? &spread : nullptr);
                                const float* rs = q_scales + q_rows + g * kRowsPerHead + t0;
                                if (any_residual && std::any_of(rs, rs + R, [](float x) { return x != 0; })) {
                                    // The residual codes' pass (K is in L1); 0 for rows without.
                                    GATTN_UNROLL
                                    for (int r = 0; r < R; ++r) qc[r] += q_rows * dk;
                                    B residual_logits[R];
                                    int8_logits(rs, residual_logits, nullptr);
                                    GATTN_UNROLL
                                    for (int r = 0; r < R; ++r) row_logits[r] += residual_logits[r];
                                }
                                products_done = reduced = true;
                            }
                        }
                        if constexpr (R == 1) {  // in_order: one row per KV head
                            if (!products_done && in_order) {
                                row_logits[0] = B::load_unaligned(block_logits + g * L);
                                products_done = reduced = true;
                            }
                        }
                        if (!products_done)
                            group_logits<T, R, KV>(blk.q + t0, key + r0 * key_stride, key_stride, nk, dk_vec, dots);
                        GATTN_UNROLL
                        for (int r = 0; r < R; ++r) {
                            // Logits of row t from its dot-product registers, masked (−∞: key
                            // skipped), then the online-softmax update of the row's m, l, acc.
                            const int t = t0 + r;
                            if (spread_prefetch && !prefetch_in_kernels) spread.step(spread.per_step);
                            T* sr = s[r];
                            if constexpr (kDot) std::memset(pw[r], 0, sizeof pw[r]);
                            const Index lo = std::max(j0, blk.begin[t]), hi = std::min(j0 + nk, blk.end[t]);
                            if (lo >= hi) {  // no visible key of this block for this row
                                std::fill(sr, sr + L, kNegInf);
                                continue;
                            }
                            ((reduced ? row_logits[r] : simd::reduce_sum_rows<T>(dots[r])) * B(scale))
                                .store_aligned(sr);
                            if (dk_vec < dk)
                                for (Index kk = 0; kk < nk; ++kk) {
                                    const KV* k = key + (r0 + kk) * key_stride;
                                    T tail = 0;
                                    for (Index d = dk_vec; d < dk; ++d) tail += blk.q[t][d] * static_cast<T>(k[d]);
                                    sr[kk] += tail * scale;
                                }
                            if constexpr (kInt8) (B::load_aligned(sr) * B::load_aligned(key_scale)).store_aligned(sr);
                            // Softcap, then ALiBi's −m·|i' − j| (keys j0 + lane), before the masks.
                            if (capped || blk.alibi_slope[t] != T(0)) {
                                B v = B::load_aligned(sr);
                                if (capped) v = simd::softcap<T>(v, blk.softcap, inv_cap);
                                if (blk.alibi_slope[t] != T(0))
                                    v = simd::fnma(B(blk.alibi_slope[t]),
                                                   xsimd::abs(B(static_cast<T>(blk.position[t] - j0)) - lane), v);
                                v.store_aligned(sr);
                            }
                            if (lo == j0 && hi == j0 + nk && !blk.bool_row[t] && !blk.bias_row[t]) {
                                for (Index kk = nk; kk < L; ++kk) sr[kk] = kNegInf;  // every key visible
                            } else {
                                for (Index kk = 0; kk < L; ++kk) {
                                    const Index j = j0 + kk;
                                    bool visible = j >= lo && j < hi;
                                    if (visible && blk.bool_row[t] && !blk.bool_row[t][j]) visible = false;
                                    if (visible && blk.bias_row[t]) {
                                        if (blk.bias_row[t][j] == kNegInf)
                                            visible = false;
                                        else
                                            sr[kk] += blk.bias_row[t][j];
                                    }
                                    if (!visible) sr[kk] = kNegInf;
                                }
                            }
                            if (j0 == 0) st.first[t] = sr[0];
                            const B sv = B::load_aligned(sr);
                            // A NaN logit must reach the row: reduce_max skips NaN lanes.
                            const T bmax = xsimd::any(xsimd::isnan(sv)) ? std::numeric_limits<T>::quiet_NaN()
                                                                        : simd::reduce_max(sv);
                            if (bmax == kNegInf) continue;  // every logit −∞: every key skipped
                            T& m = st.m[t];
                            const T m_new = std::isnan(bmax) ? bmax : std::max(m, bmax);
                            if (m != kNegInf && m_new != m) {
                                const T alpha = simd::exp_scalar<T>(m - m_new);
                                st.l[t] *= alpha;
                                simd::scale(alpha, acc[r], static_cast<std::size_t>(dv));
                            }
                            m = m_new;
                            B pv = simd::exp_nonpositive<T>(sv - B(m_new));
                            // P rounded to bf16 once: the value sum and l use the same weights.
                            if constexpr (kBfdot)
                                pv = decode_bfdot::round_weights(pv, pw[r]);
                            else if constexpr (kDot)
                                pv = decode_bf16::round_weights(pv, pw[r]);
                            pv.store_aligned(p[r]);
                            st.l[t] += simd::reduce_sum(pv);
                            if constexpr (kInt8) (pv * B::load_aligned(value_scale)).store_aligned(pv_scaled[r]);
                        }
                        // The value sum: BFDOT or VDPBF16PS (bf16), VPDPWSSD (int8), or FMAs.
                        bool values_done = false;
                        if constexpr (kBfdot) {
                            const bfloat16* vb = value + r0 * value_stride;
                            if (!decode_bfdot::any_skipped<R>(s, nk) ||
                                decode_bfdot::skipped_values_finite<R>(s, nk, vb, value_stride, dv))
                                decode_bfdot::values<R>(pw, nk, vb, value_stride, acc, dv);
                            else
                                decode_bfdot::values_skipping<R>(s, pw, nk, vb, value_stride, acc, dv);
                            values_done = true;
                        } else if constexpr (kDot) {
                            const bfloat16* vb = value + r0 * value_stride;
                            if (!decode_bf16::any_skipped<R>(s, nk) ||
                                decode_bf16::skipped_values_finite<R>(s, nk, vb, value_stride, dv))
                                decode_bf16::values<R>(pw, nk, vb, value_stride, acc, dv);
                            else
                                decode_bf16::values_skipping<R>(s, pw, nk, vb, value_stride, acc, dv);
                            values_done = true;
                        }
                        if constexpr (kSve) {
                            if (sve) {
                                decode_sve::values<R>(s, p, nk, value + r0 * value_stride, value_stride, acc, dv);
                                values_done = true;
                            }
                        }
                        if constexpr (kInt8Dot && !kSdot) {
                            if (int8_values) {
                                // A row with a weight that is not finite takes the float sum.
                                auto float_values = [](auto... a) { group_values<float, 1, std::int8_t>(a...); };
                                const KV* vb = value + r0 * value_stride;
                                auto* pf = prefetch_in_kernels ? &spread : nullptr;
                                if constexpr (kInt8Ymm)
                                    if (int8_ymm || !kInt8Zmm)
                                        decode_int8_ymm::values<R>(s, pv_scaled, nk, vb, value_stride, acc, dv, pf,
                                                                   float_values);
                                if constexpr (kInt8Zmm)
                                    if (!int8_ymm)
                                        decode_int8::values<R>(s, pv_scaled, nk, vb, value_stride, acc, dv, pf,
                                                               float_values);
                                values_done = true;
                            }
                        }
                        if (!values_done && in_order) {  // after every head's softmax
                            std::copy(s[0], s[0] + L, order_s + g * L);
                            std::copy(p[0], p[0] + L, order_p + g * L);
                        } else if (!values_done) {
                            group_values<T, R, KV>(s, kInt8 ? pv_scaled : p, nk, value + r0 * value_stride,
                                                   value_stride, acc, dv);
                        }
                    }
                });
            }
        }
        if constexpr (std::is_same_v<KV, T>)
            if (in_order)
                values_in_address_order<T>(order_s, order_p, num_kv_heads, nk, value_base + r0 * value_stride,
                                           value_stride, rows_at_stride(j0), states, dv);
    }
    if constexpr (kDot && !kBfdot)
        for (Index g = 0; g < num_kv_heads; ++g)
            for (int t = 0; t < blks[g].count; ++t) decode_bf16::unpermute(states[g].acc.data() + t * dv, dv);
}

/// Merges the states chunks[c·chunk_stride], c < num_chunks, in chunk order and writes the rows'
/// outputs, log-sum-exp and first-key probability (FlashDecoding's reduction: weights
/// e^(m_c − max m)).
template <class T>
void decode_finish(const FlashBlock<T>& blk, const PartialState<T>* chunks, Index chunk_stride, Index num_chunks,
                   Index dv) {
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    for (int t = 0; t < blk.count; ++t) {
        T m = kNegInf;
        for (Index c = 0; c < num_chunks; ++c) m = std::max(m, chunks[c * chunk_stride].m[t]);
        T* o = blk.out[t];
        for (Index j = 0; j < dv; ++j) o[j] = 0;
        T l = 0, first = kNegInf;
        for (Index c = 0; c < num_chunks; ++c) {
            const PartialState<T>& s = chunks[c * chunk_stride];
            if (s.first[t] != kNegInf) first = s.first[t];
            if (s.m[t] == kNegInf) continue;  // chunk saw no visible key: weight 0, skipped
            const T w = simd::exp_scalar<T>(s.m[t] - m);
            l += w * s.l[t];
            simd::axpy(w, s.acc.data() + t * dv, o, static_cast<std::size_t>(dv));
        }
        T w = 1;  // weight of the merged sums
        if (blk.sink[t] != kNegInf && !std::isnan(l)) {
            // The sink joins the denominator: m' = max(m, s), l' = l·e^(m − m') + e^(s − m').
            const T mt = std::max(m, blk.sink[t]);
            w = m == kNegInf ? T(0) : simd::exp_scalar<T>(m - mt);
            l = l * w + simd::exp_scalar<T>(blk.sink[t] - mt);
            m = mt;
        }
        const bool empty = !(l > 0) && !std::isnan(l);
        if (empty) {
            for (Index j = 0; j < dv; ++j) o[j] = 0;
        } else {
            simd::scale(w / l, o, static_cast<std::size_t>(dv));
        }
        if (blk.lse[t]) *blk.lse[t] = empty ? kNegInf : m + std::log(l);
        if (blk.first_key[t]) *blk.first_key[t] = empty || first == kNegInf ? T(0) : simd::exp_scalar<T>(first - m) / l;
    }
}

}  // namespace kernel
GATTN_END_ISA_NAMESPACE
