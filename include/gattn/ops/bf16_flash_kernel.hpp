// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// SDPA kernels for query, key and value stored in 16 bits (bf16, fp16), computing in float.
///
/// Three kernels run a group of query blocks of one KV head against its keys, with the same
/// blocking, masks and online softmax as the float kernel (ops/flash_kernel.hpp): queries in
/// the SIMD lanes, Sᵀ[key][query] and Oᵀ[feature][query] tiles, Br = FlashGeometry<float>'s
/// queries per block, Bc = 64 keys per block.
///
///  - AVX512-BF16 (bf16 only): both products as VDPBF16PS, which multiplies pairs of bf16
///    values and adds both products to a float accumulator. Q is packed once per query block
///    as pairs of features [d_k/2][Br]; K is read where it lies (a KV-cache row), one pair of
///    features broadcast per instruction; each key block's V is packed once per group as pairs
///    of keys [d_v][Bc/2] (Vᵀ); the probabilities P are rounded to bf16 (round to nearest even)
///    and packed as pairs of keys [Bc/2][Br] in registers. The softmax runs in float, in base 2
///    (log₂e folded into the scale); the row sum l adds the rounded P that multiply V, so the
///    output is a convex combination of V rows with exactly the weights it divides by.
///    VDPBF16PS treats bf16 subnormals as 0 and flushes subnormal results (its definition).
///  - AMX (bf16 only): the AVX512-BF16 kernel with both products moved to the tile unit
///    (TDPBF16PS, 16 × 16 float tiles): Sᵀ = K·Qᵀ with the key rows (copied side by side once
///    per key block and group) as the left operand and the packed Q pairs as the right one,
///    over whole 16-key tiles and whole 32-feature chunks (the vector code adds the features
///    past the last chunk and scores the keys past the last tile); Oᵀ += Vᵀ·Pᵀ with the packed
///    Vᵀ and Pᵀ, for whole key blocks (partial blocks run VDPBF16PS). The tiles cannot scale
///    Oᵀ: it is scaled in vectors before the product, only when a lane's max moved.
///    TDPBF16PS also treats bf16 subnormals as 0 and
///    flushes subnormal results; its sums run in another order than VDPBF16PS's, so the two
///    kernels agree to float rounding, not bitwise.
///  - Widened float (bf16 without AVX512-BF16, and fp16 always): each key block's K and V rows
///    and each query block's Q rows are widened to float in a per-thread scratch, then run
///    through the float kernel's steps unchanged. Exact widening; results equal the float
///    kernel on the widened inputs.
/// Both write each output row in float to a staging row, run the caller's epilogue there, and
/// round it once to the storage type (round to nearest even), or copy it to a float output.
///
/// Decoding (few queries per KV head) has its own kernel, ops/decode_kernel.hpp, with a
/// VDPBF16PS variant for bf16 caches (decode_bf16).
///
/// Masked keys: keys outside every lane's range are not read. Inside a partial block, VDPBF16PS
/// cannot skip a key per lane, so a key hidden from a lane has P = −0 there; when a partial
/// key block's V holds a non-finite value (±∞, NaN: garbage in an unused cache slot), that
/// block's PV product runs lane by lane and skips such keys, so masking never lets it through.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "gattn/ops/flash_kernel.hpp"
#include "gattn/simd/cpu.hpp"
#include "gattn/simd/tiers.hpp"
#include "gattn/types.hpp"

#if defined(GATTN_HAS_AVX512BF16_KERNEL) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define GATTN_HAS_AMX_KERNEL 1
#endif

GATTN_BEGIN_ISA_NAMESPACE
namespace kernel {

/// Bits of a 16-bit value.
template <class S>
inline std::uint16_t bits16(const S& x) noexcept {
    static_assert(sizeof(S) == 2, "16-bit storage");
    std::uint16_t b;
    std::memcpy(&b, &x, 2);
    return b;
}

/// dst[i] = float(src[i]) for i < n (exact).
template <class S>
inline void widen_row(const S* src, float* dst, Index n) noexcept {
    if constexpr (std::is_same_v<S, bfloat16>) {
        // A bf16 is the top half of a float: a shift, which compilers vectorise.
        for (Index i = 0; i < n; ++i) {
            const std::uint32_t w = std::uint32_t(bits16(src[i])) << 16;
            std::memcpy(dst + i, &w, 4);
        }
    } else {
        if constexpr (simd::neon::kEnabled && std::is_same_v<S, half>)
            return simd::neon::widen_row(src, dst, n);  // FCVTL
        for (Index i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
    }
}

/// dst[i] = S(src[i]) for i < n, rounded to nearest even (Eigen's conversions; NaN stays NaN);
/// a copy when S is float.
template <class S>
inline void narrow_row(const float* src, S* dst, Index n) noexcept {
    if constexpr (std::is_same_v<S, float>)
        std::copy(src, src + n, dst);
    else
        for (Index i = 0; i < n; ++i) dst[i] = S(src[i]);
}

/// Row-major matrix of packed bf16 pairs (the low half holds the first of the pair).
using PairMatrix = Eigen::Matrix<std::uint32_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Per-thread scratch of the 16-bit kernels; grows only, kept between calls (see FlashScratch).
template <class S, class O = S>
struct NarrowScratch {
    using G = FlashGeometry<float>;
    static constexpr int W = G::kQueries;
    std::vector<FlashBlock<float, S, O>> blocks;  // the driver's block descriptions
    std::vector<FlashBlock<float>> wide;          // widened: the same blocks over widened Q rows
    RowMatrix<float> q_rows;                      // widened: [Br·group, d_k] Q rows
    RowMatrix<float> k_rows, v_rows;              // widened: [Bc, d_k], [Bc, d_v] one key block
    RowMatrix<float> stage;                       // [Br, d_v] one block's float outputs
    PairMatrix qp[G::kGroupBlocks];               // AVX512-BF16: [⌈d_k/2⌉, Br] Q feature pairs
    PairMatrix vt;                                // AVX512-BF16: [d_v, Bc/2] Vᵀ key pairs
    RowMatrix<S> kb;                              // AMX: [Bc, d_k] one key block's rows, contiguous
    PairMatrix pt;                                // AVX512-BF16: [Bc/2, Br] Pᵀ key pairs
    RowMatrix<float> st;                          // AVX512-BF16: [Bc, Br] Sᵀ (base-2 logits)
    RowMatrix<float> ot[G::kGroupBlocks];         // AVX512-BF16: [d_v, Br] Oᵀ (unnormalised)
    std::vector<const S*> q_ptrs;                 // AVX512-BF16 decoding: [H_kv·Br] query rows

    static NarrowScratch& for_this_thread() {
        thread_local NarrowScratch scratch;
        return scratch;
    }
    /// Room for decoding num_kv_heads blocks at a time (widened queries, staged outputs).
    void reserve_decode(Index dk, Index dv, Index num_kv_heads) {
        const auto n = static_cast<std::size_t>(num_kv_heads);
        if (blocks.size() < n) blocks.resize(n);
        if (wide.size() < n) wide.resize(n);
        if (q_rows.size() < num_kv_heads * W * dk) q_rows.resize(num_kv_heads * W, dk);
        if (stage.size() < W * dv) stage.resize(W, dv);
        if (q_ptrs.size() < n * W) q_ptrs.resize(n * W);
    }
    void reserve(Index dk, Index dv, int group_blocks, bool tiles) {
        auto grow = [](auto& m, Index rows, Index cols) {
            if (m.size() < rows * cols) m.resize(rows, cols);
        };
        if (static_cast<int>(blocks.size()) < group_blocks) blocks.resize(static_cast<std::size_t>(group_blocks));
        grow(stage, W, dv);
        if (tiles) {
            const Index dv_tiles = (dv + 15) / 16 * 16;  // AMX: Oᵀ and Vᵀ in whole 16-row tiles
            for (int i = 0; i < group_blocks; ++i) {
                grow(qp[i], (dk + 1) / 2, W);
                grow(ot[i], dv_tiles, W);
            }
            grow(vt, dv_tiles, G::kKeys / 2);
            grow(kb, G::kKeys, dk);
            grow(pt, G::kKeys / 2, W);
            grow(st, G::kKeys, W);
        } else {
            if (static_cast<int>(wide.size()) < group_blocks) wide.resize(static_cast<std::size_t>(group_blocks));
            grow(q_rows, W * group_blocks, dk);
            grow(k_rows, G::kKeys, dk);
            grow(v_rows, G::kKeys, dv);
        }
    }
};

/// Writes a block's staged float outputs: epilogue on the float row, then one rounding.
template <class S, class O, class OnBlock>
inline void narrow_outputs(const FlashBlock<float, S, O>& blk, int i, float* const* rows, Index dv,
                           const OnBlock& on_block) {
    on_block(i, rows);
    for (int t = 0; t < blk.count; ++t) narrow_row(rows[t], blk.out[t], dv);
}

/// w = b with its query rows widened into q_rows (W rows of d_k floats) and its outputs going to
/// `rows` (float, or null when the caller writes them elsewhere).
template <class S, class O>
inline void widen_block(const FlashBlock<float, S, O>& b, FlashBlock<float>& w, float* q_rows, Index dk,
                        float* const* rows) noexcept {
    w.count = b.count;
    for (int t = 0; t < NarrowScratch<S, O>::W; ++t) {
        float* q = q_rows + Index(t) * dk;
        if (t < b.count) widen_row(b.q[t], q, dk);
        w.q[t] = q;
        w.out[t] = rows ? rows[t] : nullptr;
        w.begin[t] = b.begin[t];
        w.end[t] = b.end[t];
        w.bool_row[t] = b.bool_row[t];
        w.bias_row[t] = b.bias_row[t];
        w.lse[t] = b.lse[t];
        w.first_key[t] = b.first_key[t];
        w.sink[t] = b.sink[t];
        w.position[t] = b.position[t];
        w.alibi_slope[t] = b.alibi_slope[t];
    }
    w.softcap = b.softcap;
}

/// The widened-float kernel: runs the float kernel's steps on Q, K and V widened block by block.
template <class S, class O, class OnBlock>
void widened_attention_blocks(const FlashBlock<float, S, O>* blocks, int count, const S* key, Index key_stride,
                              const S* value, Index value_stride, Index dk, Index dv, float scale,
                              NarrowScratch<S, O>& ns, const OnBlock& on_block) {
    using G = FlashGeometry<float>;
    constexpr int W = G::kQueries;
    FlashScratch<float>& fs = FlashScratch<float>::for_this_thread();
    fs.reserve(dk, dv, count, dv, false);
    FlashState<float> state[G::kGroupBlocks];
    Index k_begin = std::numeric_limits<Index>::max(), k_end = 0;
    for (int i = 0; i < count; ++i) {
        FlashBlock<float>& w = ns.wide[static_cast<std::size_t>(i)];
        widen_block(blocks[i], w, ns.q_rows.data() + Index(i) * W * dk, dk, nullptr);  // outputs: staging rows
        flash_begin(w, dk, dv, scale, fs.qt[i].data(), fs.ot[i].data(), state[i]);
        if (state[i].union_begin >= state[i].union_end) continue;
        k_begin = std::min(k_begin, state[i].first_block());
        k_end = std::max(k_end, state[i].union_end);
    }
    for (Index k0 = k_begin; k0 < k_end; k0 += G::kKeys) {
        const Index nk = std::min<Index>(G::kKeys, k_end - k0);
        for (Index r = 0; r < nk; ++r) {
            widen_row(key + (k0 + r) * key_stride, ns.k_rows.data() + r * dk, dk);
            widen_row(value + (k0 + r) * value_stride, ns.v_rows.data() + r * dv, dv);
        }
        for (int i = 0; i < count; ++i)
            if (state[i].union_begin < state[i].union_end && state[i].first_block() <= k0 && k0 < state[i].union_end)
                flash_step(ns.wide[static_cast<std::size_t>(i)], state[i], k0, ns.k_rows.data(), dk, ns.v_rows.data(),
                           dv, dk, dv, fs.qt[i].data(), fs.st.data(), fs.ot[i].data());
    }
    float* rows[W];
    for (int t = 0; t < W; ++t) rows[t] = ns.stage.data() + t * dv;
    for (int i = 0; i < count; ++i) {
        flash_finish(ns.wide[static_cast<std::size_t>(i)], state[i], fs.ot[i].data(), dv, rows, false);
        narrow_outputs(blocks[i], i, rows, dv, on_block);
    }
}

#if defined(GATTN_HAS_AVX512BF16_KERNEL)

namespace bf16 {

using B = simd::Batch<float>;
static_assert(sizeof(B) == 64, "the AVX512-BF16 kernel uses 512-bit registers");
constexpr int C = FlashGeometry<float>::kCols;     // query registers per block
constexpr int L = 16;                              // lanes per register
constexpr int W = FlashGeometry<float>::kQueries;  // queries per block
constexpr int Bc = FlashGeometry<float>::kKeys;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
static_assert(W == C * L, "query block of whole registers");

/// The pair (row[2p], row[2p + 1]) as one 32-bit value; for an odd count n the last pair's
/// second half is 0 (no read past the row).
inline std::uint32_t pair_at(const bfloat16* row, Index p, Index n) noexcept {
    std::uint32_t lo = bits16(row[2 * p]);
    std::uint32_t hi = 2 * p + 1 < n ? bits16(row[2 * p + 1]) : 0u;
    return lo | (hi << 16);
}

/// Transposes the 16 × 16 matrix of 32-bit values whose rows are r[0..15] (the classic
/// unpack-32, unpack-64, 128-bit-lane shuffle sequence: 64 instructions).
inline void transpose16x16(__m512i* r) noexcept {
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // r[4i + c], 128-bit lane l: rows 4i..4i + 3 of column 4l + c.
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    // A 4 × 4 transpose of 128-bit lanes among r[c], r[4 + c], r[8 + c], r[12 + c].
    for (int c = 0; c < 4; ++c) {
        const __m512i x0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
        const __m512i y0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        const __m512i y1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
        t[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
        t[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}

/// qp[p][t] = (q_t[2p], q_t[2p + 1]) for the block's lanes, 0 in padding lanes. Whole groups
/// of 16 queries × 16 pairs are transposed in registers, the rest pair by pair.
template <class O>
inline void pack_query_pairs(const FlashBlock<float, bfloat16, O>& blk, Index dk, std::uint32_t* qp) noexcept {
    const Index pairs = (dk + 1) / 2, vector_pairs = dk / 32 * 16;
    const int vector_queries = blk.count / 16 * 16;
    for (int t0 = 0; t0 < vector_queries; t0 += 16)
        for (Index p0 = 0; p0 < vector_pairs; p0 += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(blk.q[t0 + i] + 2 * p0);
            transpose16x16(r);
            for (int j = 0; j < 16; ++j) _mm512_storeu_si512(qp + (p0 + j) * W + t0, r[j]);
        }
    for (int t = 0; t < W; ++t) {
        const Index from = t < vector_queries ? vector_pairs : 0;
        if (t < blk.count) {
            const bfloat16* q = blk.q[t];
            for (Index p = from; p < pairs; ++p) qp[p * W + t] = pair_at(q, p, dk);
        } else {
            for (Index p = from; p < pairs; ++p) qp[p * W + t] = 0;
        }
    }
}

/// vt[j][p] = (V[2p][j], V[2p + 1][j]) for keys < nk, 0 for the key past an odd nk. Returns
/// whether a value is non-finite (exponent all ones). Whole groups of 16 pairs × 16 features
/// are interleaved and transposed in registers, the rest value by value.
inline bool pack_value_pairs(const bfloat16* value, Index value_stride, Index nk, Index dv,
                             std::uint32_t* vt) noexcept {
    constexpr int P = Bc / 2;
    const Index pairs = (nk + 1) / 2, vector_pairs = nk / 32 * 16, vector_dv = dv / 16 * 16;
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                                6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i exponent = _mm512_set1_epi16(0x7F80);
    __mmask32 non_finite = 0;
    for (Index p0 = 0; p0 < vector_pairs; p0 += 16)
        for (Index j0 = 0; j0 < vector_dv; j0 += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; ++i) {
                const bfloat16* a = value + (2 * (p0 + i)) * value_stride + j0;
                const __m512i ab =
                    _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + value_stride)), 1);
                r[i] = _mm512_permutexvar_epi16(interleave, ab);
                non_finite |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(r[i], exponent), exponent);
            }
            transpose16x16(r);
            for (int j = 0; j < 16; ++j) _mm512_storeu_si512(vt + (j0 + j) * P + p0, r[j]);
        }
    std::uint16_t any = non_finite != 0;
    for (Index p = 0; p < pairs; ++p) {
        const std::uint16_t* a = reinterpret_cast<const std::uint16_t*>(value + 2 * p * value_stride);
        const std::uint16_t* b =
            2 * p + 1 < nk ? reinterpret_cast<const std::uint16_t*>(value + (2 * p + 1) * value_stride) : nullptr;
        for (Index j = p < vector_pairs ? vector_dv : 0; j < dv; ++j) {
            const std::uint16_t lo = a[j], hi = b ? b[j] : std::uint16_t(0);
            any |= static_cast<std::uint16_t>(((lo & 0x7F80u) == 0x7F80u) | ((hi & 0x7F80u) == 0x7F80u));
            vt[j * P + p] = std::uint32_t(lo) | (std::uint32_t(hi) << 16);
        }
    }
    return any != 0;
}

/// Sᵀ row of key j (relative to the block) from its dot products acc: scaled by c, transformed
/// (softcap, ALiBi), −∞ in the lanes that do not see key j; folds into the block max.
template <bool Masked>
inline void finish_scores(const __m512* acc, float* st_row, Index j0, const float* lane_begin, const float* lane_end,
                          B* bmax, float c, const LogitTransform<float>* tf) noexcept {
    const B j(static_cast<float>(j0));
    for (int q = 0; q < C; ++q) {
        B v = B(acc[q]) * B(c);
        if (tf) v = tf->apply(v, q, j);
        if constexpr (Masked) {
            const auto visible = (B::load_aligned(lane_begin + q * L) <= j) & (j < B::load_aligned(lane_end + q * L));
            v = xsimd::select(visible, v, B(kNegInf));
        }
        v.store_aligned(st_row + q * L);
        bmax[q] = xsimd::max(bmax[q], v);
    }
}

/// Sᵀ[kk][·] = c · Σ_p K[kk]·Q pairs for kk in [0, R) keys × C registers; masked lanes −∞;
/// folds into the block max. p_begin > 0: Sᵀ already holds the sums over the first p_begin
/// pairs (the AMX tiles'), to which the remaining pairs are added.
template <int R, bool Masked>
inline void scores_tile(const bfloat16* key, Index key_stride, const std::uint32_t* qp, Index dk, Index p_begin,
                        float* st, Index j0, const float* lane_begin, const float* lane_end, B* bmax, float c,
                        const bfloat16* next_key, const LogitTransform<float>* tf) noexcept {
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int q = 0; q < C; ++q) acc[r][q] = p_begin > 0 ? _mm512_load_ps(st + r * W + q * L) : _mm512_setzero_ps();
    const Index full_pairs = dk / 2;
    for (Index p = p_begin; p < full_pairs; ++p) {
        if (p % 32 == 0)
            for (int r = 0; r < R; ++r) simd::prefetch(next_key + r * key_stride + 2 * p);
        __m512i qv[C];
        for (int q = 0; q < C; ++q) qv[q] = _mm512_load_si512(qp + p * W + q * L);
        for (int r = 0; r < R; ++r) {
            std::uint32_t k;
            std::memcpy(&k, key + r * key_stride + 2 * p, 4);
            const __m512i kb = _mm512_set1_epi32(static_cast<int>(k));
            for (int q = 0; q < C; ++q) acc[r][q] = dp(acc[r][q], kb, qv[q]);
        }
    }
    if (dk % 2 != 0) {  // last feature alone, paired with 0
        const Index p = full_pairs;
        __m512i qv[C];
        for (int q = 0; q < C; ++q) qv[q] = _mm512_load_si512(qp + p * W + q * L);
        for (int r = 0; r < R; ++r) {
            const __m512i kb = _mm512_set1_epi32(static_cast<int>(bits16(key[r * key_stride + 2 * p])));
            for (int q = 0; q < C; ++q) acc[r][q] = dp(acc[r][q], kb, qv[q]);
        }
    }
    for (int r = 0; r < R; ++r) finish_scores<Masked>(acc[r], st + r * W, j0 + r, lane_begin, lane_end, bmax, c, tf);
}

template <int R, bool Masked>
inline void scores_rows(const bfloat16* key, Index key_stride, const std::uint32_t* qp, Index dk, Index p_begin,
                        float* st, Index j0, Index nk, const float* lane_begin, const float* lane_end, B* bmax, float c,
                        const LogitTransform<float>* tf) noexcept {
    Index kk = 0;
    for (; kk + R <= nk; kk += R) {
        const bfloat16* next = kk + 2 * R <= nk ? key + (kk + R) * key_stride : key;
        scores_tile<R, Masked>(key + kk * key_stride, key_stride, qp, dk, p_begin, st + kk * W, j0 + kk, lane_begin,
                               lane_end, bmax, c, next, tf);
    }
    if constexpr (R > 1) {
        if (kk < nk)
            scores_rows<R - 1, Masked>(key + kk * key_stride, key_stride, qp, dk, p_begin, st + kk * W, j0 + kk,
                                       nk - kk, lane_begin, lane_end, bmax, c, tf);
    }
}

/// Oᵀ[j + r][·] = α·Oᵀ[j + r][·] + Σ_p Vᵀ pairs · Pᵀ pairs for r in [0, R).
template <int R>
inline void values_tile(const std::uint32_t* vt, const std::uint32_t* pt, Index pairs, const B* alpha,
                        float* ot) noexcept {
    constexpr int P = Bc / 2;
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int q = 0; q < C; ++q) acc[r][q] = _mm512_setzero_ps();
    for (Index p = 0; p < pairs; ++p) {
        __m512i pv[C];
        for (int q = 0; q < C; ++q) pv[q] = _mm512_load_si512(pt + p * W + q * L);
        for (int r = 0; r < R; ++r) {
            const __m512i vb = _mm512_set1_epi32(static_cast<int>(vt[r * P + p]));
            for (int q = 0; q < C; ++q) acc[r][q] = dp(acc[r][q], vb, pv[q]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int q = 0; q < C; ++q) {
            float* o = ot + r * W + q * L;
            simd::fma(B::load_aligned(o), alpha[q], B(acc[r][q])).store_aligned(o);
        }
}

template <int R>
inline void values_rows(const std::uint32_t* vt, const std::uint32_t* pt, Index pairs, const B* alpha, float* ot,
                        Index dv) noexcept {
    constexpr int P = Bc / 2;
    Index j = 0;
    for (; j + R <= dv; j += R) values_tile<R>(vt + j * P, pt, pairs, alpha, ot + j * W);
    if constexpr (R > 1) {
        if (j < dv) values_rows<R - 1>(vt + j * P, pt, pairs, alpha, ot + j * W, dv - j);
    }
}

/// The PV product lane by lane, skipping the keys a lane does not see (P = −0, bits 0x8000):
/// for partial key blocks whose V holds a non-finite value.
inline void values_skipping(const std::uint32_t* vt, const std::uint32_t* pt, Index nk, const B* alpha, float* ot,
                            Index dv) noexcept {
    constexpr int P = Bc / 2;
    alignas(64) float a[W];
    for (int q = 0; q < C; ++q) alpha[q].store_aligned(a + q * L);
    auto half = [](std::uint32_t pair, Index k) { return static_cast<std::uint16_t>(k % 2 == 0 ? pair : pair >> 16); };
    auto to_float = [](std::uint16_t h) {
        const std::uint32_t w = std::uint32_t(h) << 16;
        float f;
        std::memcpy(&f, &w, 4);
        return f;
    };
    for (int t = 0; t < W; ++t)
        for (Index j = 0; j < dv; ++j) {
            float acc = 0.0f;
            for (Index k = 0; k < nk; ++k) {
                const std::uint16_t pb = half(pt[(k / 2) * W + t], k);
                if (pb == 0x8000u) continue;  // a key this lane does not see
                acc += to_float(pb) * to_float(half(vt[j * P + k / 2], k));
            }
            float& o = ot[j * W + t];
            o = std::fma(o, a[t], acc);
        }
}

#if defined(GATTN_HAS_AMX_KERNEL)
/// The AMX parts of the kernel: both products on the tile unit (TDPBF16PS: a 16 × 16 float tile
/// += a 16-row bf16 tile times 16 rows of bf16 pairs), everything else as above. Every tile is
/// 16 rows × 64 bytes (palette 1); the operands are the AVX512-BF16 kernel's own buffers and
/// the key rows where they lie.
namespace amx {

constexpr int kTileRows = 16;
static_assert(C % 2 == 0 && Bc % 32 == 0, "query tiles in pairs, key blocks of whole 32-key tiles");

/// LDTILECFG's 64-byte operand: tiles 0-7 of 16 rows × 64 bytes.
struct alignas(64) TileConfig {
    std::uint8_t palette = 1, start_row = 0;
    std::uint8_t reserved[14] = {};
    std::uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    std::uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

/// Configures this thread's tiles for its lifetime and releases them at the end (so that
/// context switches do not carry the 8 KiB tile state afterwards).
struct Tiles {
    Tiles() noexcept {
        static const TileConfig config;
        _tile_loadconfig(&config);
    }
    ~Tiles() { _tile_release(); }
    Tiles(const Tiles&) = delete;
    Tiles& operator=(const Tiles&) = delete;
};

/// One step of a 2 × 2 tile product: tiles 0, 1 += A(a0)·B(b0), A(a0)·B(b1) and, when `two`,
/// tiles 2, 3 += A(a1)·B(b0), A(a1)·B(b1); A tiles in 4–5, B tiles in 6–7, strides in bytes.
inline void dot_2x2(const void* a0, const void* a1, Index a_stride, const void* b0, const void* b1, Index b_stride,
                    bool two) noexcept {
    _tile_loadd(4, a0, a_stride);
    _tile_loadd(6, b0, b_stride);
    _tile_loadd(7, b1, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
        _tile_loadd(5, a1, a_stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

/// Stores tiles 0, 1 at c and c + 16 and, when `two`, tiles 2, 3 at c + next and c + next + 16
/// (floats; stride in bytes).
inline void store_2x2(float* c, Index next, Index stride, bool two) noexcept {
    _tile_stored(0, c, stride);
    _tile_stored(1, c + 16, stride);
    if (two) {
        _tile_stored(2, c + next, stride);
        _tile_stored(3, c + next + 16, stride);
    }
}

/// Sᵀ[kk][·] = Σ K[kk]·Q over the first 32·⌊d_k/32⌋ features (raw dot products, not scaled)
/// for kk < nk, a multiple of 16. Tiles 0-3: Sᵀ, 2 key tiles × 2 query tiles; 4-5: key rows;
/// 6-7: query pairs.
inline void scores(const bfloat16* key, Index key_stride, const std::uint32_t* qp, Index dk, float* st,
                   Index nk) noexcept {
    const Index chunks = dk / 32, kstride = key_stride * Index(sizeof(bfloat16));
    constexpr Index stride = W * 4;  // bytes per row of qp and st
    for (Index kk = 0; kk < nk; kk += 2 * kTileRows) {
        const bool two = kk + kTileRows < nk;
        for (int qh = 0; qh < C; qh += 2) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (Index f = 0; f < chunks; ++f) {
                const bfloat16* k = key + kk * key_stride + f * 32;
                const std::uint32_t* q = qp + f * kTileRows * W + qh * L;
                dot_2x2(k, k + kTileRows * key_stride, kstride, q, q + L, stride, two);
            }
            store_2x2(st + kk * W + qh * L, kTileRows * W, stride, two);
        }
    }
}

/// Oᵀ = α·Oᵀ + Vᵀ·Pᵀ for a whole key block (Bc keys, every pair of vt and pt set); Oᵀ has
/// ⌈d_v/16⌉·16 rows (the rows past d_v are padding). α is applied first, in vectors, and only
/// when a lane's max moved. Tiles 0-3: Oᵀ, 2 feature tiles × 2 query tiles; 4-5: Vᵀ; 6-7: Pᵀ.
inline void values(const std::uint32_t* vt, const std::uint32_t* pt, const B* alpha, float* ot, Index dv) noexcept {
    bool rescale = false;
    for (int q = 0; q < C; ++q) rescale = rescale || xsimd::any(alpha[q] != B(1.0f));
    if (rescale)
        for (Index j = 0; j < dv; ++j)
            for (int q = 0; q < C; ++q)
                (B::load_aligned(ot + j * W + q * L) * alpha[q]).store_aligned(ot + j * W + q * L);
    constexpr int P = Bc / 2;
    constexpr Index vstride = P * 4, stride = W * 4;  // bytes per row of vt; of pt and ot
    const Index ftiles = (dv + kTileRows - 1) / kTileRows;
    for (Index f = 0; f < ftiles; f += 2) {
        const bool two = f + 1 < ftiles;
        for (int qh = 0; qh < C; qh += 2) {
            float* o = ot + f * kTileRows * W + qh * L;
            _tile_loadd(0, o, stride);
            _tile_loadd(1, o + L, stride);
            if (two) {
                _tile_loadd(2, o + kTileRows * W, stride);
                _tile_loadd(3, o + kTileRows * W + L, stride);
            }
            for (int kc = 0; kc < P; kc += kTileRows) {
                const std::uint32_t* v = vt + f * kTileRows * P + kc;
                const std::uint32_t* p = pt + kc * W + qh * L;
                dot_2x2(v, v + kTileRows * P, vstride, p, p + L, stride, two);
            }
            store_2x2(o, kTileRows * W, stride, two);
        }
    }
}

}  // namespace amx
#endif  // GATTN_HAS_AMX_KERNEL

/// One key block [k0, k0 + nk) of a query block; vt holds its packed V (non_finite_values:
/// whether any is ±∞ or NaN). Same steps as kernel::flash_step, in base 2.
/// vt holds packed_keys ≥ nk keys: with an odd nk below it, the pair past the block's last key
/// holds a key this block must not read, which the partial path skips.
template <bool Amx, class O>
inline void step(const FlashBlock<float, bfloat16, O>& blk, FlashState<float>& state, Index k0, Index nk,
                 Index packed_keys, const bfloat16* key_block, Index key_stride, const std::uint32_t* vt,
                 bool non_finite_values, Index dk, Index dv, float c, const std::uint32_t* qp, float* st,
                 std::uint32_t* pt, float* ot) noexcept {
    const bool full = !state.elementwise && state.common_begin <= k0 && k0 + nk <= state.common_end &&
                      !(nk % 2 == 1 && nk < packed_keys);
    B bmax[C];
    for (int q = 0; q < C; ++q) bmax[q] = B(kNegInf);
    const LogitTransform<float>* tf = state.transform.active() ? &state.transform : nullptr;
    if (tf) state.transform.at_keys(k0);
    // AMX: the tiles sum the first 32·⌊d_k/32⌋ features of whole 16-key tiles; the vector code
    // adds the rest and finishes those rows, then runs the keys past the last whole tile.
    Index tiled = 0, tiled_pairs = 0;
#if defined(GATTN_HAS_AMX_KERNEL)
    if constexpr (Amx) {
        tiled = dk >= 32 ? nk / amx::kTileRows * amx::kTileRows : 0;
        tiled_pairs = dk / 32 * 16;
        if (tiled > 0) amx::scores(key_block, key_stride, qp, dk, st, tiled);
    }
#endif
    auto scores = [&](auto masked, const float* lane_begin, const float* lane_end) {
        constexpr bool M = decltype(masked)::value;
        if (tiled > 0)
            scores_rows<6, M>(key_block, key_stride, qp, dk, tiled_pairs, st, 0, tiled, lane_begin, lane_end, bmax, c,
                              tf);
        if (tiled < nk)
            scores_rows<6, M>(key_block + tiled * key_stride, key_stride, qp, dk, 0, st + tiled * W, tiled, nk - tiled,
                              lane_begin, lane_end, bmax, c, tf);
    };
    if (full) {
        scores(std::false_type{}, nullptr, nullptr);
    } else {
        alignas(64) float lane_begin[W], lane_end[W];
        for (int t = 0; t < W; ++t) {
            const Index b = t < blk.count ? blk.begin[t] - k0 : 0, e = t < blk.count ? blk.end[t] - k0 : 0;
            lane_begin[t] = static_cast<float>(std::clamp<Index>(b, -1, Bc + 1));
            lane_end[t] = static_cast<float>(std::clamp<Index>(e, -1, Bc + 1));
        }
        scores(std::true_type{}, lane_begin, lane_end);
    }
    if (state.elementwise && !full) {
        // Boolean mask and bias per lane (the bias in base 2), then the block max again.
        constexpr float kLog2e = simd::detail::kLog2eF;
        for (int q = 0; q < C; ++q) bmax[q] = B(kNegInf);
        for (Index kk = 0; kk < nk; ++kk) {
            float* row = st + kk * W;
            const Index j = k0 + kk;
            for (int t = 0; t < blk.count; ++t) {
                if (row[t] == kNegInf) continue;
                if (blk.bool_row[t] && !blk.bool_row[t][j])
                    row[t] = kNegInf;
                else if (blk.bias_row[t])
                    row[t] = blk.bias_row[t][j] == kNegInf ? kNegInf : row[t] + blk.bias_row[t][j] * kLog2e;
            }
            for (int q = 0; q < C; ++q) bmax[q] = xsimd::max(bmax[q], B::load_aligned(row + q * L));
        }
    }
    if (k0 == 0)
        for (int t = 0; t < W; ++t) state.first_score[t] = st[t];

    B alpha[C], shift[C];
    __m512 lsum[C];
    for (int q = 0; q < C; ++q) {
        // (Lazy rescaling, keeping a lane's max until a block's exceeds it by 8, saved 4 % of
        // the AMX kernel's time but raised its NMSE from 2.2e-6 to 2.6e-6: not done.)
        const B m_new = xsimd::max(state.m[q], bmax[q]);
        shift[q] = xsimd::select(m_new == B(kNegInf), B(0.0f), m_new);
        alpha[q] = simd::exp2_nonpositive(state.m[q] - shift[q]);
        state.m[q] = m_new;
        lsum[q] = _mm512_setzero_ps();
    }
    // P = 2^(s − m) rounded to bf16, keys 2p and 2p + 1 interleaved per lane; l adds the rounded
    // pairs (a VDPBF16PS against ones). Partial blocks: a key a lane does not see gets −0.
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                                6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i ones = _mm512_set1_epi32(0x3F803F80);  // (1.0, 1.0) in bf16
    const Index pairs = (nk + 1) / 2;
    for (Index p = 0; p < pairs; ++p) {
        const float* ra = st + 2 * p * W;
        const float* rb = ra + W;
        const bool has_b = 2 * p + 1 < nk;
        for (int q = 0; q < C; ++q) {
            const B sa = B::load_aligned(ra + q * L);
            const B sb = has_b ? B::load_aligned(rb + q * L) : B(kNegInf);
            B pa = simd::exp2_nonpositive(sa - shift[q]);
            B pb = has_b ? simd::exp2_nonpositive(sb - shift[q]) : B(full ? 0.0f : -0.0f);
            if (!full) {
                pa = xsimd::select(sa == B(kNegInf), B(-0.0f), pa);
                if (has_b) pb = xsimd::select(sb == B(kNegInf), B(-0.0f), pb);
            }
            const __m512i packed = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(pb, pa));
            _mm512_store_si512(pt + p * W + q * L, packed);
            lsum[q] = dp(lsum[q], packed, ones);
        }
    }
    for (int q = 0; q < C; ++q) state.l[q] = simd::fma(state.l[q], alpha[q], B(lsum[q]));
    if (!full && non_finite_values) values_skipping(vt, pt, nk, alpha, ot, dv);
#if defined(GATTN_HAS_AMX_KERNEL)
    else if (Amx && pairs == Bc / 2)
        amx::values(vt, pt, alpha, ot, dv);
#endif
    else
        values_rows<6>(vt, pt, pairs, alpha, ot, dv);
}

}  // namespace bf16

/// The AVX512-BF16 kernel (Amx: with both products on the AMX tiles, which the caller has
/// configured, amx::Tiles): the same contract as widened_attention_blocks, for bf16 storage.
template <bool Amx, class O, class OnBlock>
void bf16_attention_blocks(const FlashBlock<float, bfloat16, O>* blocks, int count, const bfloat16* key,
                           Index key_stride, const bfloat16* value, Index value_stride, Index dk, Index dv, float scale,
                           NarrowScratch<bfloat16, O>& ns, const OnBlock& on_block) {
    using G = FlashGeometry<float>;
    using BF = simd::Batch<float>;
    constexpr int W = G::kQueries, C = G::kCols;
    const float c = scale * simd::detail::kLog2eF;  // logits in base 2
    FlashState<float> state[G::kGroupBlocks];
    Index k_begin = std::numeric_limits<Index>::max(), k_end = 0;
    for (int i = 0; i < count; ++i) {
        FlashState<float>& s = state[i];
        s.reset(blocks[i], simd::detail::kLog2eF);  // softcap and ALiBi in base 2
        bf16::pack_query_pairs(blocks[i], dk, ns.qp[i].data());
        std::fill(ns.ot[i].data(), ns.ot[i].data() + dv * W, 0.0f);
        if (!s.any_key()) continue;
        k_begin = std::min(k_begin, s.first_block());
        k_end = std::max(k_end, s.union_end);
    }
    for (Index k0 = k_begin; k0 < k_end; k0 += G::kKeys) {
        const Index nk = std::min<Index>(G::kKeys, k_end - k0);
        const bool non_finite = bf16::pack_value_pairs(value + k0 * value_stride, value_stride, nk, dv, ns.vt.data());
        // AMX: the block's key rows side by side, so that a tile's 16 rows share no L1 set (rows
        // of a [N, H·d_k] layout lie whole pages apart and crowd a few sets).
        const bfloat16* key_block = key + k0 * key_stride;
        Index kstride = key_stride;
        if constexpr (Amx) {
            for (Index r = 0; r < nk; ++r) std::memcpy(ns.kb.data() + r * dk, key_block + r * key_stride, dk * 2);
            key_block = ns.kb.data();
            kstride = dk;
        }
        for (int i = 0; i < count; ++i) {
            FlashState<float>& s = state[i];
            if (!(s.any_key() && s.first_block() <= k0 && k0 < s.union_end)) continue;
            const Index n = std::min<Index>(G::kKeys, s.union_end - k0);
            bf16::step<Amx>(blocks[i], s, k0, n, nk, key_block, kstride, ns.vt.data(), non_finite, dk, dv, c,
                            ns.qp[i].data(), ns.st.data(), ns.pt.data(), ns.ot[i].data());
        }
    }
    // Outputs through the float kernel's finish, with m and the first score back in natural
    // log units (·ln 2): log-sum-exp = m + ln l, first key e^(s₀ − m) / l.
    float* rows[W];
    for (int t = 0; t < W; ++t) rows[t] = ns.stage.data() + t * dv;
    const BF ln2(0.693147180559945309f);
    for (int i = 0; i < count; ++i) {
        FlashState<float>& s = state[i];
        for (int q = 0; q < C; ++q) s.m[q] = s.m[q] * ln2;
        for (int t = 0; t < W; ++t) s.first_score[t] *= 0.693147180559945309f;
        flash_finish(blocks[i], s, ns.ot[i].data(), dv, rows, false);
        narrow_outputs(blocks[i], i, rows, dv, on_block);
    }
}

#endif  // GATTN_HAS_AVX512BF16_KERNEL

/// Runs up to kGroupBlocks query blocks of one KV head (16-bit storage) against its keys with
/// the kernel `which` (AVX512-BF16 where compiled and asked for, else widened float), and calls
/// on_block(i, rows) on each block's float outputs before they are rounded into its out rows.
template <class S, class O, class OnBlock>
void narrow_attention_blocks(Bf16Kernel which, const FlashBlock<float, S, O>* blocks, int count, const S* key,
                             Index key_stride, const S* value, Index value_stride, Index dk, Index dv, float scale,
                             NarrowScratch<S, O>& ns, const OnBlock& on_block) {
#if defined(GATTN_HAS_AVX512BF16_KERNEL)
    if constexpr (std::is_same_v<S, bfloat16>) {
#if defined(GATTN_HAS_AMX_KERNEL)
        if (which == Bf16Kernel::Amx) {
            bf16::amx::Tiles tiles;
            bf16_attention_blocks<true>(blocks, count, key, key_stride, value, value_stride, dk, dv, scale, ns,
                                        on_block);
            return;
        }
#endif
        if (which != Bf16Kernel::WidenedFloat) {
            bf16_attention_blocks<false>(blocks, count, key, key_stride, value, value_stride, dk, dv, scale, ns,
                                         on_block);
            return;
        }
    }
#endif
    (void)which;
    widened_attention_blocks(blocks, count, key, key_stride, value, value_stride, dk, dv, scale, ns, on_block);
}

}  // namespace kernel
GATTN_END_ISA_NAMESPACE
