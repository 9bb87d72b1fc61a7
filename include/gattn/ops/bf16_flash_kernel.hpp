// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// SDPA kernels for query, key and value stored in 16 bits (bf16, fp16), computing in float.
///
/// Four kernels run a group of query blocks of one KV head against its keys, with the same
/// blocking, masks and online softmax as the float kernel (ops/flash_kernel.hpp): queries in
/// the SIMD lanes, Sᵀ[key][query] and Oᵀ[feature][query] tiles, Br = FlashGeometry<float>'s
/// queries per block, Bc = 64 keys per block.
///
///  - AVX512-BF16 (bf16 only): both products as VDPBF16PS, which multiplies pairs of bf16
///    values and adds both products to a float accumulator. Q is packed once per query block
///    as pairs of features [d_k/2][Br]; K is read where it lies (a KV-cache row), one pair of
///    features broadcast per instruction; each key block's V is packed once per group as pairs
///    of keys [d_v][Bc/2] (Vᵀ); the probabilities P are rounded to bf16 (round to nearest even)
///    and packed as pairs of keys [Bc/2][Br] in registers. The softmax runs in float, in natural
///    units as the float kernel's (2^((s − m)·log₂e): log₂e is not folded into the scale, where
///    a logit in (FLT_MAX/log₂e, FLT_MAX] or a bias of −FLT_MAX, Hugging Face's padding, would
///    overflow); the row sum l adds the rounded P that multiply V, so the
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
///  - BFDOT (ARM64 with BF16, bf16 only): the AVX512-BF16 kernel's steps on NEON's block of 8
///    queries, with BFDOT by element for both products (simd/arm_neon_bf16.hpp); l adds the
///    rounded weights in float.
///  - Widened float (bf16 without a dot-product kernel, and fp16 always): each key block's K and V rows
///    and each query block's Q rows are widened to float in a per-thread scratch, then run
///    through the float kernel's steps unchanged. Exact widening; results equal the float
///    kernel on the widened inputs.
/// All write each output row in float to a staging row, run the caller's epilogue there, and
/// round it once to the storage type (round to nearest even), or copy it to a float output.
///
/// Decoding (few queries per KV head) has its own kernel, ops/decode_kernel.hpp, with a
/// VDPBF16PS variant for bf16 caches (decode_bf16).
/// This file drives the kernels (blocks, masks, online softmax); their instruction-set code is
/// in the tiers' headers: simd/x86_avx512bf16.hpp (VDPBF16PS), simd/x86_amx.hpp (tiles) and
/// simd/arm_neon_bf16.hpp (BFDOT).
///
/// Masked keys: keys outside every lane's range are not read. Inside a partial block, VDPBF16PS
/// cannot skip a key per lane, so a key hidden from a lane has P = −0 there; when one of the
/// query block's own keys in a partial key block has a non-finite value (±∞, NaN: garbage in an
/// unused cache slot), that block's PV product runs lane by lane and skips such keys, so masking
/// never lets it through. The products read only the query block's own keys of a key block (an
/// odd last one alone, not in a pair with the next), so a block's result does not depend on the
/// blocks grouped with it, which the thread count sets.

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

GATTN_BEGIN_ISA_NAMESPACE
namespace kernel {

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
        if constexpr (simd::avx2::kEnabled && std::is_same_v<S, half>)
            return simd::avx2::widen_row(src, dst, n);  // VCVTPH2PS, or integer operations
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
    RowMatrix<float> st;                          // AVX512-BF16: [Bc, Br] Sᵀ (scaled logits)
    RowMatrix<float> ot[G::kGroupBlocks];         // AVX512-BF16: [d_v, Br] Oᵀ (unnormalised)
    std::vector<const S*> q_ptrs;                 // VDPBF16PS or BFDOT decoding: [H_kv·Br] query rows

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
/// pages: key j is row pages.row(j) of key and value.
template <class S, class O, class OnBlock>
void widened_attention_blocks(const FlashBlock<float, S, O>* blocks, int count, const S* key, Index key_stride,
                              const S* value, Index value_stride, Index dk, Index dv, float scale,
                              NarrowScratch<S, O>& ns, const OnBlock& on_block, const PageMap& pages = {}) {
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
            widen_row(key + pages.row(k0 + r) * key_stride, ns.k_rows.data() + r * dk, dk);
            widen_row(value + pages.row(k0 + r) * value_stride, ns.v_rows.data() + r * dv, dv);
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

namespace bf16 {

static_assert(!(simd::avx512bf16::kEnabled || simd::neon_bf16::kEnabled) ||
                  (C == FlashGeometry<float>::kCols && W == FlashGeometry<float>::kQueries &&
                   Bc == FlashGeometry<float>::kKeys && L == FlashGeometry<float>::kLanes),
              "the bf16 micro-kernels' block is the float kernel's");

/// Sᵀ rows of the keys [0, nk) of a block: tiles of R keys (the tier's scores_tile), then the
/// rest with R − 1.
template <int R, bool Masked, class Transform>
inline void scores_rows(const bfloat16* key, Index key_stride, const std::uint32_t* qp, Index dk, Index p_begin,
                        float* st, Index j0, Index nk, const float* lane_begin, const float* lane_end, B* bmax, float c,
                        const Transform* tf) noexcept {
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

/// Oᵀ rows [0, d_v): tiles of R features (the tier's values_tile), then the rest with R − 1.
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

/// The bf16 of key k in a packed pair (keys 2p and 2p + 1: k even the low half, odd the high).
inline std::uint16_t pair_half(std::uint32_t pair, Index k) noexcept {
    return static_cast<std::uint16_t>(k % 2 == 0 ? pair : pair >> 16);
}

/// A bf16's bits as the float it equals (the top half of the float).
inline float bf16_bits_to_float(std::uint16_t h) noexcept {
    const std::uint32_t w = std::uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return f;
}

/// The PV product lane by lane, skipping the keys a lane does not see (P = −0, bits 0x8000):
/// for partial key blocks whose V holds a non-finite value.
inline void values_skipping(const std::uint32_t* vt, const std::uint32_t* pt, Index nk, const B* alpha, float* ot,
                            Index dv) noexcept {
    constexpr int P = Bc / 2;
    alignas(64) float a[W];
    GATTN_UNROLL
    for (int q = 0; q < C; ++q) alpha[q].store_aligned(a + q * L);
    for (int t = 0; t < W; ++t)
        for (Index j = 0; j < dv; ++j) {
            float acc = 0.0f;
            for (Index k = 0; k < nk; ++k) {
                const std::uint16_t pb = pair_half(pt[(k / 2) * W + t], k);
                if (pb == 0x8000u) continue;  // a key this lane does not see
                acc += bf16_bits_to_float(pb) * bf16_bits_to_float(pair_half(vt[j * P + k / 2], k));
            }
            float& o = ot[j * W + t];
            o = std::fma(o, a[t], acc);
        }
}

/// Oᵀ[j][·] += P[key][·]·V[key][j] in float for a block's odd last key (the low halves of its
/// pairs in pt and vt): the pair's dot product would also read the key after it, which vt holds
/// when the block is grouped with query blocks that see further (a grouping that depends on the
/// thread count). A lane that does not see the key has P = −0 and adds ±0.
inline void add_lone_key(const std::uint32_t* vt, const std::uint32_t* pt, Index key, float* ot, Index dv) noexcept {
    constexpr int P = Bc / 2;
    const Index p = key / 2;
    alignas(64) float w[W];
    for (int t = 0; t < W; ++t) w[t] = bf16_bits_to_float(pair_half(pt[p * W + t], key));
    B pw[C];
    GATTN_UNROLL
    for (int q = 0; q < C; ++q) pw[q] = B::load_aligned(w + q * L);
    for (Index j = 0; j < dv; ++j) {
        const B v(bf16_bits_to_float(pair_half(vt[j * P + p], key)));
        GATTN_UNROLL
        for (int q = 0; q < C; ++q) {
            float* o = ot + j * W + q * L;
            simd::fma(v, pw[q], B::load_aligned(o)).store_aligned(o);
        }
    }
}

/// The first of the nk value rows whose d_v bf16 values hold a non-finite one (exponent all
/// ones), nk when none does.
inline Index first_non_finite_row(const bfloat16* value, Index value_stride, Index nk, Index dv) noexcept {
    for (Index r = 0; r < nk; ++r) {
        const auto* v = reinterpret_cast<const std::uint16_t*>(value + r * value_stride);
        for (Index j = 0; j < dv; ++j)
            if ((v[j] & 0x7F80u) == 0x7F80u) return r;
    }
    return nk;
}

/// One key block [k0, k0 + nk) of a query block; vt holds its packed V, whose first key with a
/// non-finite value (±∞, NaN) is first_non_finite (at least nk when none of this block's keys).
/// Same steps as kernel::flash_step. The products read only this block's nk keys (an
/// odd last key alone, add_lone_key), so the result does not depend on the query blocks it is
/// grouped with.
template <bool Amx, class O>
inline void step(const FlashBlock<float, bfloat16, O>& blk, FlashState<float>& state, Index k0, Index nk,
                 const bfloat16* key_block, Index key_stride, const std::uint32_t* vt, Index first_non_finite, Index dk,
                 Index dv, float c, const std::uint32_t* qp, float* st, std::uint32_t* pt, float* ot) noexcept {
    const bool full = !state.elementwise && state.common_begin <= k0 && k0 + nk <= state.common_end;
    B bmax[C];
    GATTN_UNROLL
    for (int q = 0; q < C; ++q) bmax[q] = B(kNegInf);
    const LogitTransform<float>* tf = state.transform.active() ? &state.transform : nullptr;
    if (tf) state.transform.at_keys(k0);
    // AMX: the tiles sum the first 32·⌊d_k/32⌋ features of whole 16-key tiles; the vector code
    // adds the rest and finishes those rows, then runs the keys past the last whole tile.
    static_assert(!Amx || simd::amx::kEnabled, "the AMX kernel needs AMX-TILE and AMX-BF16");
    Index tiled = 0, tiled_pairs = 0;
    if constexpr (Amx) {
        tiled = dk >= 32 ? nk / amx::kTileRows * amx::kTileRows : 0;
        tiled_pairs = dk / 32 * 16;
        if (tiled > 0) amx::scores(key_block, key_stride, qp, dk, st, tiled);
    }
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
    if (state.elementwise && !full) mask_elementwise(blk, st, k0, nk, bmax);
    if (k0 == 0)
        for (int t = 0; t < W; ++t) state.first_score[t] = st[t];

    B alpha[C], shift[C], lsum[C];
    GATTN_UNROLL
    for (int q = 0; q < C; ++q) {
        // (Lazy rescaling, keeping a lane's max until a block's exceeds it by 8, saved 4 % of
        // the AMX kernel's time but raised its NMSE from 2.2e-6 to 2.6e-6: not done.)
        alpha[q] = state.rescale(q, bmax[q], shift[q]);
        lsum[q] = B(0.0f);
    }
    const B log2e(simd::detail::kLog2eF);  // e^x as 2^(x·log₂e), x = s − m ≤ 0
    // (s − m)·log₂e as one fused s·log₂e − m·log₂e. Its error, half an ulp of m·log₂e, stays
    // within a float logit's own rounding up to |m| = 2^16; a lane with a larger max (past
    // FLT_MAX/log₂e ≈ 2.36e38, m·log₂e would overflow) has m subtracted from its logits first
    // (exact near m, as in the float kernel) and 0 for m·log₂e.
    B shift_log2e[C];
    const B huge(0x1p16f);
    GATTN_UNROLL
    for (int q = 0; q < C; ++q) {
        const auto over = xsimd::abs(shift[q]) > huge;
        shift_log2e[q] = xsimd::select(over, B(0.0f), shift[q] * log2e);
        if (xsimd::any(over))
            for (Index kk = 0; kk < nk; ++kk) {
                float* row = st + kk * W + q * L;
                xsimd::select(over, B::load_aligned(row) - shift[q], B::load_aligned(row)).store_aligned(row);
            }
    }
    // P = e^(s − m) rounded to bf16, keys 2p and 2p + 1 interleaved per lane; l adds the rounded
    // pairs (a VDPBF16PS against ones). Partial blocks: a key a lane does not see gets −0.
    const Index pairs = (nk + 1) / 2;
    for (Index p = 0; p < pairs; ++p) {
        const float* ra = st + 2 * p * W;
        const float* rb = ra + W;
        const bool has_b = 2 * p + 1 < nk;
        GATTN_UNROLL
        for (int q = 0; q < C; ++q) {
            const B sa = B::load_aligned(ra + q * L);
            const B sb = has_b ? B::load_aligned(rb + q * L) : B(kNegInf);
            B pa = simd::exp2_nonpositive(simd::fma(sa, log2e, -shift_log2e[q]));
            B pb = has_b ? simd::exp2_nonpositive(simd::fma(sb, log2e, -shift_log2e[q])) : B(full ? 0.0f : -0.0f);
            if (!full) {
                pa = xsimd::select(sa == B(kNegInf), B(-0.0f), pa);
                if (has_b) pb = xsimd::select(sb == B(kNegInf), B(-0.0f), pb);
            }
            lsum[q] = pack_weight_pair(pa, pb, pt + p * W + q * L, lsum[q]);
        }
    }
    GATTN_UNROLL
    for (int q = 0; q < C; ++q) state.l[q] = simd::fma(state.l[q], alpha[q], lsum[q]);
    if (!full && first_non_finite < nk) {
        values_skipping(vt, pt, nk, alpha, ot, dv);
    } else {
        const Index whole = nk / 2;  // pairs of two of this block's keys
        if (Amx && whole == Bc / 2) {
            if constexpr (Amx) amx::values(vt, pt, alpha, ot, dv);
        } else {
            values_rows<6>(vt, pt, whole, alpha, ot, dv);
        }
        if (nk % 2 == 1) add_lone_key(vt, pt, nk - 1, ot, dv);
    }
}

}  // namespace bf16

/// The AVX512-BF16 kernel (Amx: with both products on the AMX tiles, which the caller has
/// configured, amx::Tiles): the same contract as widened_attention_blocks, for bf16 storage.
/// A key block over several pages has its rows copied side by side first.
template <bool Amx, class O, class OnBlock>
void bf16_attention_blocks(const FlashBlock<float, bfloat16, O>* blocks, int count, const bfloat16* key,
                           Index key_stride, const bfloat16* value, Index value_stride, Index dk, Index dv, float scale,
                           NarrowScratch<bfloat16, O>& ns, const OnBlock& on_block, const PageMap& pages = {}) {
    using G = FlashGeometry<float>;
    constexpr int W = G::kQueries;
    FlashState<float> state[G::kGroupBlocks];
    Index k_begin = std::numeric_limits<Index>::max(), k_end = 0;
    for (int i = 0; i < count; ++i) {
        FlashState<float>& s = state[i];
        s.reset(blocks[i]);
        bf16::pack_query_pairs(blocks[i], dk, ns.qp[i].data());
        std::fill(ns.ot[i].data(), ns.ot[i].data() + dv * W, 0.0f);
        if (!s.any_key()) continue;
        k_begin = std::min(k_begin, s.first_block());
        k_end = std::max(k_end, s.union_end);
    }
    for (Index k0 = k_begin; k0 < k_end; k0 += G::kKeys) {
        const Index nk = std::min<Index>(G::kKeys, k_end - k0);
        const bfloat16* key_block = key + pages.row(k0) * key_stride;
        const bfloat16* value_block = value + pages.row(k0) * value_stride;
        Index kstride = key_stride, vstride = value_stride;
        // Rows of several pages: copied side by side (kept between calls, grown only).
        if (!pages.consecutive(k0, nk)) {
            thread_local std::vector<bfloat16> rows;
            if (rows.size() < static_cast<std::size_t>(G::kKeys * (dk + dv)))
                rows.resize(static_cast<std::size_t>(G::kKeys * (dk + dv)));
            for (Index r = 0; r < nk; ++r) {
                const Index j = pages.row(k0 + r);
                std::memcpy(rows.data() + r * dk, key + j * key_stride, dk * 2);
                std::memcpy(rows.data() + G::kKeys * dk + r * dv, value + j * value_stride, dv * 2);
            }
            key_block = rows.data();
            value_block = rows.data() + G::kKeys * dk;
            kstride = dk;
            vstride = dv;
        }
        // The first key with a non-finite value: a query block's partial step goes key by key
        // only when that key is among its own (grouped blocks may pack keys past them).
        const Index first_non_finite = bf16::pack_value_pairs(value_block, vstride, nk, dv, ns.vt.data())
                                           ? bf16::first_non_finite_row(value_block, vstride, nk, dv)
                                           : nk;
        // AMX: the block's key rows side by side, so that a tile's 16 rows share no L1 set (rows
        // of a [N, H·d_k] layout lie whole pages apart and crowd a few sets).
        if constexpr (Amx) {
            for (Index r = 0; r < nk; ++r) std::memcpy(ns.kb.data() + r * dk, key_block + r * kstride, dk * 2);
            key_block = ns.kb.data();
            kstride = dk;
        }
        for (int i = 0; i < count; ++i) {
            FlashState<float>& s = state[i];
            if (!(s.any_key() && s.first_block() <= k0 && k0 < s.union_end)) continue;
            const Index n = std::min<Index>(G::kKeys, s.union_end - k0);
            bf16::step<Amx>(blocks[i], s, k0, n, key_block, kstride, ns.vt.data(), first_non_finite, dk, dv, scale,
                            ns.qp[i].data(), ns.st.data(), ns.pt.data(), ns.ot[i].data());
        }
    }
    // Outputs through the float kernel's finish: log-sum-exp = m + ln l, first key e^(s₀ − m) / l.
    float* rows[W];
    for (int t = 0; t < W; ++t) rows[t] = ns.stage.data() + t * dv;
    for (int i = 0; i < count; ++i) {
        FlashState<float>& s = state[i];
        flash_finish(blocks[i], s, ns.ot[i].data(), dv, rows, false);
        narrow_outputs(blocks[i], i, rows, dv, on_block);
    }
}

/// Runs up to kGroupBlocks query blocks of one KV head (16-bit storage) against its keys with
/// the kernel `which` (AVX512-BF16 where compiled and asked for, else widened float), and calls
/// on_block(i, rows) on each block's float outputs before they are rounded into its out rows.
/// pages: key j is row pages.row(j) of key and value (a paged cache).
template <class S, class O, class OnBlock>
void narrow_attention_blocks(Bf16Kernel which, const FlashBlock<float, S, O>* blocks, int count, const S* key,
                             Index key_stride, const S* value, Index value_stride, Index dk, Index dv, float scale,
                             NarrowScratch<S, O>& ns, const OnBlock& on_block, const PageMap& pages = {}) {
    if constexpr (simd::avx512bf16::kEnabled && std::is_same_v<S, bfloat16>) {
        if constexpr (simd::amx::kEnabled) {
            if (which == Bf16Kernel::Amx) {
                bf16::amx::Tiles tiles;
                bf16_attention_blocks<true>(blocks, count, key, key_stride, value, value_stride, dk, dv, scale, ns,
                                            on_block, pages);
                return;
            }
        }
        if (which != Bf16Kernel::WidenedFloat) {
            bf16_attention_blocks<false>(blocks, count, key, key_stride, value, value_stride, dk, dv, scale, ns,
                                         on_block, pages);
            return;
        }
    }
    if constexpr (simd::neon_bf16::kEnabled && std::is_same_v<S, bfloat16>) {
        if (which == Bf16Kernel::Bfdot) {
            bf16_attention_blocks<false>(blocks, count, key, key_stride, value, value_stride, dk, dv, scale, ns,
                                         on_block, pages);
            return;
        }
    }
    (void)which;
    widened_attention_blocks(blocks, count, key, key_stride, value, value_stride, dk, dv, scale, ns, on_block, pages);
}

}  // namespace kernel
GATTN_END_ISA_NAMESPACE
