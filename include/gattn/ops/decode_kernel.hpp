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
/// group walk the same key block while it is in L1, so K and V stream from memory once.
/// A masked key gets p = 0 and is skipped in the value sum (never multiplied by 0).
/// Chunks are cut at fixed key positions (multiples of kChunkKeys), never by thread count, and
/// merged in order, so results do not depend on the number of threads.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "gattn/ops/flash_kernel.hpp"
#include "gattn/simd/math.hpp"

GATTN_BEGIN_ISA_NAMESPACE
namespace kernel {

/// Keys per split-KV chunk: short enough that a 1k-key cache already gives two threads work
/// (1.7× one thread measured at N_k = 1024), long enough that merging, d_v + 3 values per row
/// and chunk, stays negligible.
inline constexpr Index kChunkKeys = 512;

/// Online-softmax state of `rows` query rows over one chunk: m, l and the unnormalised output.
template <class T>
struct PartialState {
    std::vector<T> m, l, acc, first;  // acc: rows × d_v; first: logit of key 0 (−∞ if unseen)
    void reset(int rows, Index dv) {
        m.assign(static_cast<std::size_t>(rows), -std::numeric_limits<T>::infinity());
        l.assign(static_cast<std::size_t>(rows), T(0));
        acc.assign(static_cast<std::size_t>(rows * dv), T(0));
        first.assign(static_cast<std::size_t>(rows), -std::numeric_limits<T>::infinity());
    }
};

/// acc[j] += Σ_kk p[kk]·V[kk][j] over kk < nk in order, one fused multiply-add per key, in
/// registers across the keys (8 at a time). A masked key (score −∞) is skipped, its V row may
/// be garbage, even NaN; a visible key whose weight underflowed to 0 is not (0·NaN = NaN).
template <class T>
inline void accumulate_values(const T* score, const T* p, Index nk, const T* value, Index value_stride, T* acc,
                              Index dv) noexcept {
    using B = simd::Batch<T>;
    constexpr Index L = static_cast<Index>(simd::kLanes<T>), R = 8;
    auto skipped = [&](Index kk) { return score[kk] == -std::numeric_limits<T>::infinity(); };
    Index j = 0;
    for (; j + R * L <= dv; j += R * L) {
        B a[R];
        for (Index r = 0; r < R; ++r) a[r] = B::load_unaligned(acc + j + r * L);
        for (Index kk = 0; kk < nk; ++kk) {
            if (skipped(kk)) continue;
            const B pk(p[kk]);
            const T* v = value + kk * value_stride + j;
            for (Index r = 0; r < R; ++r) a[r] = xsimd::fma(pk, B::load_unaligned(v + r * L), a[r]);
        }
        for (Index r = 0; r < R; ++r) a[r].store_unaligned(acc + j + r * L);
    }
    for (; j + L <= dv; j += L) {
        B a = B::load_unaligned(acc + j);
        for (Index kk = 0; kk < nk; ++kk)
            if (!skipped(kk)) a = xsimd::fma(B(p[kk]), B::load_unaligned(value + kk * value_stride + j), a);
        a.store_unaligned(acc + j);
    }
    for (; j < dv; ++j)
        for (Index kk = 0; kk < nk; ++kk)
            if (!skipped(kk)) acc[j] = std::fma(p[kk], value[kk * value_stride + j], acc[j]);
}

/// Runs the rows of every KV head's block blks[g] (g < num_kv_heads) against keys
/// [k_begin, k_end), accumulating into states[g]. key/value point at key 0, head 0 of the
/// sequence. The KV heads are walked inside each key block, so a [N, H_kv·d] cache is read
/// row after row (rows of one head alone would each sit in another page).
template <class T>
void decode_chunk(const FlashBlock<T>* blks, PartialState<T>* states, Index num_kv_heads, Index k_begin,
                  Index k_end, const T* key_base, Index key_stride, const T* value_base, Index value_stride,
                  Index dk, Index dv, T scale) {
    using B = simd::Batch<T>;
    constexpr Index L = static_cast<Index>(simd::kLanes<T>);
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    const Index dk_vec = dk / L * L;
    alignas(64) T s[L], p[L];
    B dots[L];
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
    for (Index j0 = k_begin; j0 < k_end; j0 += L) {
        const Index nk = std::min(L, k_end - j0);
        // The next block's K and V rows (all KV heads), a block ahead of their use: decoding
        // streams the cache once, from memory when it is long.
        for (Index kk = j0 + L; kk < std::min(j0 + 2 * L, k_end); ++kk) {
            const T* k = key_base + kk * key_stride;
            const T* v = value_base + kk * value_stride;
            for (Index e = 0; e < num_kv_heads * dk; e += simd::kLineElems<T>) simd::prefetch(k + e);
            for (Index e = 0; e < num_kv_heads * dv; e += simd::kLineElems<T>) simd::prefetch(v + e);
        }
        for (Index g = 0; g < num_kv_heads; ++g) {
        const FlashBlock<T>& blk = blks[g];
        PartialState<T>& st = states[g];
        const T* key = key_base + g * dk;
        const T* value = value_base + g * dv;
        for (int t = 0; t < blk.count; ++t) {
            const Index lo = std::max(j0, blk.begin[t]), hi = std::min(j0 + nk, blk.end[t]);
            if (lo >= hi) continue;  // no visible key of this block for this row
            const T* q = blk.q[t];
            // Four keys at a time: four independent FMA chains instead of one chain per key.
            Index kk = 0;
            for (; kk + 4 <= nk; kk += 4) {
                const T* k = key + (j0 + kk) * key_stride;
                B a0(T(0)), a1(T(0)), a2(T(0)), a3(T(0));
                for (Index d = 0; d < dk_vec; d += L) {
                    const B qd = B::load_unaligned(q + d);
                    a0 = xsimd::fma(qd, B::load_unaligned(k + d), a0);
                    a1 = xsimd::fma(qd, B::load_unaligned(k + key_stride + d), a1);
                    a2 = xsimd::fma(qd, B::load_unaligned(k + 2 * key_stride + d), a2);
                    a3 = xsimd::fma(qd, B::load_unaligned(k + 3 * key_stride + d), a3);
                }
                dots[kk] = a0;
                dots[kk + 1] = a1;
                dots[kk + 2] = a2;
                dots[kk + 3] = a3;
            }
            for (; kk < L; ++kk) {
                B a(T(0));
                if (kk < nk) {
                    const T* k = key + (j0 + kk) * key_stride;
                    for (Index d = 0; d < dk_vec; d += L) a = xsimd::fma(B::load_unaligned(q + d), B::load_unaligned(k + d), a);
                }
                dots[kk] = a;
            }
            (simd::reduce_sum_rows<T>(dots) * B(scale)).store_aligned(s);
            if (dk_vec < dk)
                for (Index kk = 0; kk < nk; ++kk) {
                    const T* k = key + (j0 + kk) * key_stride;
                    T tail = 0;
                    for (Index d = dk_vec; d < dk; ++d) tail += q[d] * k[d];
                    s[kk] += tail * scale;
                }
            if (lo == j0 && hi == j0 + nk && !blk.bool_row[t] && !blk.bias_row[t]) {
                for (Index kk = nk; kk < L; ++kk) s[kk] = kNegInf;  // every key of the block visible
            } else {
                for (Index kk = 0; kk < L; ++kk) {
                    const Index j = j0 + kk;
                    bool visible = j >= lo && j < hi;
                    if (visible && blk.bool_row[t] && !blk.bool_row[t][j]) visible = false;
                    if (visible && blk.bias_row[t]) {
                        if (blk.bias_row[t][j] == kNegInf) visible = false;
                        else s[kk] += blk.bias_row[t][j];
                    }
                    if (!visible) s[kk] = kNegInf;
                }
            }
            if (j0 == 0) st.first[t] = s[0];
            const B sv = B::load_aligned(s);
            // A NaN score (NaN in a visible key) must reach the row: reduce_max skips NaN lanes.
            const T bmax = xsimd::any(xsimd::isnan(sv)) ? std::numeric_limits<T>::quiet_NaN() : simd::reduce_max(sv);
            if (bmax == kNegInf) continue;
            T& m = st.m[t];
            T* acc = st.acc.data() + t * dv;
            const T m_new = std::isnan(bmax) ? bmax : std::max(m, bmax);
            if (m != kNegInf && m_new != m) {
                const T alpha = simd::exp_scalar<T>(m - m_new);
                st.l[t] *= alpha;
                simd::scale(alpha, acc, static_cast<std::size_t>(dv));
            }
            m = m_new;
            const B pv = simd::exp_nonpositive<T>(sv - B(m_new));
            pv.store_aligned(p);
            st.l[t] += simd::reduce_sum(pv);
            accumulate_values(s, p, nk, value + j0 * value_stride, value_stride, acc, dv);
        }
        }
    }
}

/// Merges the states chunks[c·chunk_stride], c < num_chunks, in chunk order and writes the rows' outputs, log-sum-exp and first-key
/// probability (FlashDecoding's reduction: weights e^(m_c − max m)).
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
        const bool empty = !(l > 0) && !std::isnan(l);
        if (empty) {
            for (Index j = 0; j < dv; ++j) o[j] = 0;
        } else {
            simd::scale(T(1) / l, o, static_cast<std::size_t>(dv));
        }
        if (blk.lse[t]) *blk.lse[t] = empty ? kNegInf : m + std::log(l);
        if (blk.first_key[t]) *blk.first_key[t] = empty ? T(0) : simd::exp_scalar<T>(first - m) / l;
    }
}

}  // namespace kernel
GATTN_END_ISA_NAMESPACE
