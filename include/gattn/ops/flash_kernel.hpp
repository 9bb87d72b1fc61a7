// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The tiled SDPA kernel: one block of queries against blocks of keys with an online softmax
/// (FlashAttention, Dao et al. 2022, Algorithm 1), written for CPUs.
///
/// Queries sit in the SIMD lanes: every tile is stored transposed (Sᵀ[key][query],
/// Oᵀ[feature][query]), so the running max, sum and rescale of the softmax are vertical vector
/// operations and both products are register-blocked outer products that broadcast K and V
/// from row-major rows (a key block's V rows are copied together first when the layout spreads
/// them, see flash_attention_blocks; never reordered). The query block holds the
/// queries of all heads that share one KV head (GQA), so a decoding step with one query still
/// fills lanes with the group's heads and streams K and V once.
///
/// A block of at most one register of queries that all see the same keys (a cascade's prefix
/// rows of one KV head, a prompt's last rows) runs Sᵀ in tiles of many keys and P·V with the
/// rows of queries broadcast and the value features in the lanes (flash_row_step), and its
/// softmax on Sᵀ as here: the same sums in the same order.
///
/// Per key block: Sᵀ = K·(scale·Qᵀ); mask (partial blocks only); block max; α = e^(m − m_new);
/// Pᵀ = e^(Sᵀ − m_new); l = α·l + Σ Pᵀ; Oᵀ = α·Oᵀ + Vᵀ·Pᵀ. A key block that no query of the
/// block can see is skipped, so causal attention costs about half of full attention.
/// In partial blocks a masked key is marked P = −1 and skipped in Vᵀ·Pᵀ by a select (never
/// multiplied by 0), so NaN in masked K or V cannot reach the output, while a visible key
/// whose weight underflows to 0 still carries NaN in its V, as IEEE arithmetic does.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include "gattn/ops/int8_rows.hpp"
#include "gattn/ops/mask.hpp"
#include "gattn/ops/tile_product.hpp"
#include "gattn/simd/math.hpp"
#include "gattn/simd/tiers.hpp"
#include "gattn/types.hpp"

GATTN_BEGIN_ISA_NAMESPACE
namespace kernel {

/// e^x for the softmax's x = s − m ≤ 0. float: 2^(x·log₂e) (simd::exp2_nonpositive, fewer
/// operations than exp); rounding x·log₂e adds a relative error of |x|·6e-8, at most 2e-8 of
/// the row's largest weight (which is 1), below float's resolution of the row sum. double:
/// exp_nonpositive.
template <class T>
inline simd::Batch<T> softmax_exp(const simd::Batch<T>& x) noexcept {
    if constexpr (std::is_same_v<T, float>)
        return simd::exp2_nonpositive(x * simd::Batch<float>(simd::detail::kLog2eF));
    else
        return simd::exp_nonpositive<T>(x);
}

/// Tile geometry for scalar type T on this instruction set. A tile of either product holds
/// kRows × kCols accumulators; with one register of queries per column and one broadcast K or
/// V value, it needs kRows·kCols + kCols + 1 registers. Both FMA pipes of a 4-cycle FMA need 8
/// independent accumulators; a k-step loads kCols query (or P) registers and broadcasts kRows
/// K (or V) values for kRows·kCols FMAs.
template <class T>
struct FlashGeometry {
    static constexpr int kLanes = static_cast<int>(simd::kLanes<T>);
    // The tier's tile shape (simd/tiers.hpp): kCols registers of queries per tile row, kRows
    // rows of K or V values, kMaskedRows rows of the masked PV tiles; 6 × 4 with AVX-512, 4 × 3
    // with AVX2 + FMA, 6 × 2 elsewhere (the reasons are in each tier's header).
    static constexpr int kCols = simd::FlashTiles::kCols;
    static constexpr int kRows = simd::FlashTiles::kRows;
    static constexpr int kMaskedRows = simd::FlashTiles::kMaskedRows;
    static constexpr int kQueries = kCols * kLanes;  // Br: queries per block
    // (head, query) pairs of a KV head up to which a sequence of several query rows runs the
    // decoding kernel (ops/sdpa.hpp; the tier's, see simd/tiers.hpp).
    static constexpr int kDecodePairs = simd::FlashTiles::kDecodePairs;
    // A block with only CE < kCols registers of queries (fewer queries than Br: a short prompt,
    // a cascade's prefix rows of one KV head; one register where runs_row_tiles says no) runs
    // its unmasked key blocks on tiles of CE registers and more rows: about the kRows·kCols accumulators of a whole tile, at most 12
    // rows (every extra row is one more K or V row read at once). Each (key, query) product
    // still runs over d in the same order, so the results are those of the whole tile.
    template <int CE>
    static constexpr int kLiveRows = CE == kCols ? kRows : std::min(12, kRows* kCols / CE);
    static constexpr int kKeys = 64;  // Bc: keys per block
    // Query blocks that walk the keys together: each key block (and the memory pages of its
    // rows, which in a [N, H·d] layout are one page per row) is used by all of them while it
    // is in L2 and in the TLB, so K and V come from L3 once per group instead of once per
    // block. A group holds up to 1024 queries in float (16 blocks on AVX-512, 64 on AVX2, 128
    // on SSE), 512 in double, and no more than their Qᵀ and Oᵀ fill half of L2
    // (group_bytes). Narrow blocks gain from the larger groups: AVX2, d = 128, N = 2048,
    // 8 heads, 8 → 32 blocks: 94 → 97–99 GFLOP/s (d = 256: +3–13 %, SSE2 +3–5 %); AVX-512 with
    // a 2 MiB L2, 8 → 16 blocks: d = 128 +0.4 to +0.6 %, d = 64 +1.9 %.
    static constexpr int kGroupQueries = static_cast<int>(4096 / sizeof(T));  // 1024 float, 512 double
    static constexpr int kGroupBlocks = std::max(8, kGroupQueries / kQueries);
    /// Bytes that the Qᵀ and Oᵀ tiles of a group may take: half of the L2 cache that the C
    /// library reports (glibc's sysconf), 512 KiB where it reports none.
    static Index group_bytes() noexcept {
        static const Index bytes = [] {
            long l2 = 0;
#if defined(_SC_LEVEL2_CACHE_SIZE)
            l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
            return l2 > 0 ? Index(l2 / 2) : Index(512) << 10;
        }();
        return bytes;
    }
    /// Whether the L1 cache has fewer ways than the 2·kRows lines that a QK tile's K rows and
    /// the next tile's take in one set when the rows lie 4 KiB apart ([N, H·d] with
    /// H·d = 1024 floats): AVX-512 (12 lines) and SSE2 (12) on the 8-way L1s of AMD Zen 2–4 and
    /// Intel Skylake, or where the C library reports no L1 associativity (glibc's sysconf).
    static bool narrow_l1() noexcept {
        static const bool narrow = [] {
            long ways = 0;
#if defined(_SC_LEVEL1_DCACHE_ASSOC)
            ways = sysconf(_SC_LEVEL1_DCACHE_ASSOC);
#endif
            return ways < 2 * kRows;
        }();
        return narrow;
    }
    /// Whether flash_attention_blocks copies a key block's K rows that lie `stride` apart
    /// together first (the V rows are copied whenever they are not contiguous): where they
    /// would overflow their L1 set (narrow_l1). Elsewhere they are read in place: copying cost
    /// 2 % of a call on Zen 5's 12-way L1 (AVX-512, d = 128, N = 2048, 8 heads, 1 thread) and
    /// about 3 % with AVX2 at d = 256.
    static bool copies_keys(Index stride, Index dk) noexcept { return stride != dk && narrow_l1(); }
};

/// Description of one query block: up to Br (head, query) pairs that share KV head g of
/// sequence b. Lanes past `count` are padding. T is the compute type; Storage the type the
/// query rows are stored in and Out that of the output rows (bf16 or fp16 rows are read by
/// ops/bf16_flash_kernel.hpp, whose outputs may be Storage or float).
template <class T, class Storage = T, class Out = Storage>
struct FlashBlock {
    using G = FlashGeometry<T>;
    int count = 0;
    const Storage* q[G::kQueries];  // query rows (d_k values)
    Out* out[G::kQueries];          // output rows (d_v values)
    Index begin[G::kQueries];       // visible key range per lane
    Index end[G::kQueries];
    const bool* bool_row[G::kQueries];  // null when no boolean mask
    const T* bias_row[G::kQueries];     // null when no bias
    T* lse[G::kQueries];                // null when not requested
    T* first_key[G::kQueries];          // null when not requested
    T sink[G::kQueries];                // the head's sink logit (SdpaOptions::sinks), −∞ for none
    Index position[G::kQueries];        // aligned query position i' (ALiBi's distances)
    T alibi_slope[G::kQueries];         // the head's ALiBi slope, 0 for none
    T softcap = 0;                      // logit softcap c (SdpaOptions::logit_softcap), 0 for none
};

/// Where a paged cache's keys sit (cache/paged_kv_pool.hpp): key j of the sequence is row
/// pages[j / page_size]·page_size + j mod page_size of the pool. No pages (null): key j is row j.
struct PageMap {
    const Index* pages = nullptr;  ///< the sequence's pages in token order; null: contiguous rows
    Index page_size = 0;           ///< tokens per page

    /// The row of key j.
    Index row(Index j) const noexcept { return pages ? pages[j / page_size] * page_size + j % page_size : j; }
    /// Whether keys [k0, k0 + n), n ≥ 1, lie in consecutive rows.
    bool consecutive(Index k0, Index n) const noexcept { return !pages || k0 / page_size == (k0 + n - 1) / page_size; }
};

/// Prefetch instructions for the K and V rows (all KV heads) of keys [next, end), a few lines
/// per call of step() in key order, so that they spread over a block's work instead of coming
/// as one burst: into L1 for int8 caches, into L2 (kIntoL2) for the others, read from memory.
/// Decoding (decode_chunk) steps once per query row, or inside the integer kernels' loops
/// (decode_int8), once per 4 keys of the logits and per 2 keys of each pass of the value sum;
/// few-query blocks (flash_attention_blocks) once per k-step of Sᵀ = K·Qᵀ.
template <class KV>
struct SpreadPrefetch {
    const KV* key_base;
    Index key_stride;
    const KV* value_base;
    Index value_stride;
    Index key_lines, lines_per_key;  // cache lines of one key's K rows, and of its K and V rows
    Index next = 0, end = 0, per_step = 0;
    PageMap pages = {};          // where key j's rows sit (a paged cache)
    Index shift = 0;             // pages.row(j) − j for the keys of the page aimed at
    Index page_end = 0;          // the first key past that page
    const KV* cursor = nullptr;  // the next line asked for
    Index run_left = 0;          // lines left in cursor's row of key `next` (0: nothing left at all)
    bool in_values = false;      // cursor in key next's V row, not its K row
    /// simd::prefetch_outer (L2), not simd::prefetch (L1): all but int8 rows, whose two blocks
    /// ahead fit L1 (decode_chunk).
    static constexpr bool kIntoL2 = !std::is_same_v<KV, std::int8_t>;
    static constexpr auto kLine = static_cast<Index>(simd::kLineElems<KV>);

    /// For the rows of key_elems K values and value_elems V values of each key (all KV heads)
    /// at key/value + pages.row(j)·stride; aimed at nothing until start().
    static SpreadPrefetch over(const KV* key, Index key_stride, const KV* value, Index value_stride, Index key_elems,
                               Index value_elems, const PageMap& pages) noexcept {
        const Index key_lines = (key_elems + kLine - 1) / kLine;
        SpreadPrefetch p{key,          key_stride, value,
                         value_stride, key_lines,  key_lines + (value_elems + kLine - 1) / kLine};
        p.pages = pages;
        return p;
    }

    /// Aims at keys [first, last), spread over `steps` calls of step(per_step).
    void start(Index first, Index last, Index steps) noexcept {
        next = first;
        end = last;
        shift = first < last ? pages.row(first) - first : 0;  // one division per page, not per key
        page_end = pages.pages && first < last ? (first / pages.page_size + 1) * pages.page_size : last;
        per_step = last > first ? ((last - first) * lines_per_key + steps - 1) / std::max<Index>(steps, 1) : 0;
        run_left = 0;
        if (first < last) aim(false);
    }
    /// Prefetches the next `lines` lines (all that are left when lines < 0). Inlined into a
    /// product's k-loop (tile_product's hook) with no call left in it.
    GATTN_ALWAYS_INLINE void step(Index lines) noexcept {
        for (Index e = 0; run_left > 0 && (lines < 0 || e < lines); ++e) {
            const KV* p = cursor;
            if constexpr (kIntoL2)
                simd::prefetch_outer(p);
            else
                simd::prefetch(p);
            cursor = p + kLine;
            if (--run_left == 0) next_row();
        }
    }

private:
    GATTN_ALWAYS_INLINE void aim(bool values) noexcept {
        const Index row = next + shift;
        in_values = values;
        cursor = values ? value_base + row * value_stride : key_base + row * key_stride;
        run_left = values ? lines_per_key - key_lines : key_lines;
    }
    /// After key next's K row its V row, after that key next + 1's K row.
    GATTN_ALWAYS_INLINE void next_row() noexcept {
        if (!in_values && lines_per_key > key_lines) return aim(true);
        if (++next == page_end && next < end) {
            shift = pages.row(next) - next;
            page_end += pages.page_size;
        }
        if (next < end) aim(false);
    }
};

/// Per-thread scratch of the kernel (64-byte aligned through Eigen's allocator): one Qᵀ and
/// one Oᵀ per query block of a group, one Sᵀ tile shared by them, a key block's copied V rows,
/// one block's staged outputs, and the block descriptions.
/// Each thread keeps one between calls (for_this_thread) and only ever grows it: freed and
/// allocated afresh in every call, glibc returned it to the kernel and faulted it in again
/// (13 % of a call at N = 128, d = 128, 8 heads). The kernel uses only the buffers' data(), so
/// a larger buffer serves a smaller head_dim.
template <class T>
struct FlashScratch {
    using G = FlashGeometry<T>;
    RowMatrix<T> qt[G::kGroupBlocks];   // [d_k, Br]  scale·Qᵀ
    RowMatrix<T> ot[G::kGroupBlocks];   // [d_v, Br]  Oᵀ (unnormalised)
    RowMatrix<T> st;                    // [Bc, Br]   Sᵀ, then Pᵀ
    RowMatrix<T> value_rows;            // [Bc, d_v]  one key block's V rows, copied
    RowMatrix<T> key_rows;              // [Bc, d_k]  one key block's K rows, copied (or dequantized)
    RowMatrix<T> key_t;                 // [d_k, Bc]  one key block's Kᵀ (few-query blocks, kRowKeyRows = 0)
    RowMatrix<T> row_tile;              // [L, max(Bc, d_v)]  a few-query block's S (kRowKeyRows = 0), P·V rows
    RowMatrix<T> stage;                 // [Br, d_v]  one block's outputs (OutputWrites::Staged)
    std::vector<FlashBlock<T>> blocks;  // KiBs each: heap, not stack
    /// Whether flash_attention_blocks copies V rows that lie value_stride apart.
    static bool copies_values(Index value_stride, Index dv) noexcept { return value_stride != dv; }
    /// The calling thread's scratch. Not for re-entrant use: an SDPA call must not start
    /// another on the same thread (an epilogue must not call SDPA).
    static FlashScratch& for_this_thread() {
        thread_local FlashScratch scratch;
        return scratch;
    }
    /// Room for `count` block descriptions.
    void reserve_blocks(Index count) {
        if (static_cast<Index>(blocks.size()) < count) blocks.resize(static_cast<std::size_t>(count));
    }
    /// Room for groups of up to group_blocks query blocks, a key block's K rows (copied when
    /// FlashGeometry::copies_keys says so, or dequantized) and V rows (copied when they lie
    /// value_stride apart, or dequantized), and staged outputs.
    void reserve(Index dk, Index dv, int group_blocks, Index value_stride, bool staged, bool int8 = false) {
        auto grow = [](RowMatrix<T>& m, Index rows, Index cols) {
            if (m.size() < rows * cols) m.resize(rows, cols);
        };
        if (copies_values(value_stride, dv) || int8) grow(value_rows, G::kKeys, dv);
        grow(key_rows, G::kKeys, dk);  // 64 rows: copied K rows are a small part of any call
        if constexpr (simd::FlashTiles::kRowKeyRows == 0) grow(key_t, dk, G::kKeys);
        grow(row_tile, G::kLanes, std::max<Index>(G::kKeys, dv));
        if (staged) grow(stage, G::kQueries, dv);
        for (int i = 0; i < group_blocks; ++i) {
            grow(qt[i], dk, G::kQueries);
            grow(ot[i], dv, G::kQueries);
        }
        grow(st, G::kKeys, G::kQueries);
        reserve_blocks(group_blocks);
    }
};

/// Softcap and ALiBi of a query block (FlashBlock::softcap, alibi_slope, position), applied to
/// each register of scaled logits as it leaves the product, before the masks: s ← c·tanh(s/c),
/// then s ← s − m_t·|i'_t − j| (SdpaOptions::logit_softcap, alibi_slopes). Queries are in the
/// lanes.
template <class T>
struct LogitTransform {
    using B = simd::Batch<T>;
    using G = FlashGeometry<T>;
    bool capped = false, alibi = false;
    T cap = 0, inv_cap = 0;
    alignas(64) T slope[G::kQueries];     // per lane; 0 in padding lanes
    alignas(64) T distance[G::kQueries];  // i'_t − k0 for the current key block k0
    Index position[G::kQueries];
    /// Whether any transform applies.
    bool active() const noexcept { return capped || alibi; }
    /// Takes a query block's transform (any storage of its rows).
    template <class Block>
    void reset(const Block& blk) noexcept {
        capped = blk.softcap > 0;
        cap = blk.softcap;
        inv_cap = capped ? T(1) / cap : T(0);
        alibi = false;
        for (int t = 0; t < G::kQueries; ++t) {
            slope[t] = t < blk.count ? static_cast<T>(blk.alibi_slope[t]) : T(0);
            position[t] = t < blk.count ? blk.position[t] : 0;
            alibi = alibi || slope[t] != T(0);
        }
    }
    /// Distances of the key block starting at k0 (small integers, exact in T).
    void at_keys(Index k0) noexcept {
        if (alibi)
            for (int t = 0; t < G::kQueries; ++t) distance[t] = static_cast<T>(position[t] - k0);
    }
    /// Register c (lanes c·L …) of the logits of key k0 + j.
    B apply(B v, int c, const B& j) const noexcept {
        constexpr int L = G::kLanes;
        if (capped) v = simd::softcap<T>(v, cap, inv_cap);
        if (alibi) v = simd::fnma(B::load_aligned(slope + c * L), xsimd::abs(B::load_aligned(distance + c * L) - j), v);
        return v;
    }
};

/// Sᵀ[kk][·] = Σ_c K[k0 + kk][c] · Qᵀ[c][·] for kk in [0, R): R keys × kCols registers.
/// The epilogue masks keys outside each lane's range [lane_begin, lane_end) (relative to the
/// key block, like j0) to −∞ (Masked) and folds the tile into the block max, so Sᵀ is not
/// read again for the max.
/// C0 > 0 (masked tiles only): the first C0 registers of queries see none of the R keys, so
/// their products are skipped and their Sᵀ entries set to −∞ (the diagonal blocks of causal
/// attention). CE < kCols (unmasked tiles only): registers from CE on hold no query; their
/// products are skipped and their Sᵀ entries not written.
template <class T, int R, bool Masked, int C0 = 0, int CE = FlashGeometry<T>::kCols>
inline void scores_tile(const T* key, Index key_stride, const T* qt, Index dk, T* st, Index j0, const T* lane_begin,
                        const T* lane_end, simd::Batch<T>* bmax, const T* next_key,
                        const LogitTransform<T>* tf) noexcept {
    using B = simd::Batch<T>;
    using G = FlashGeometry<T>;
    constexpr int C = CE, L = G::kLanes, W = G::kQueries;
    static_assert(C0 == 0 || Masked, "only masked tiles skip query registers");
    static_assert(CE == G::kCols || !Masked, "only unmasked tiles end early");
    B acc[R][C];
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        GATTN_UNROLL
        for (int c = C0; c < C; ++c) acc[r][c] = B(T(0));
    }
    for (Index d = 0; d < dk; ++d) {
        // The rows of the next tile, a cache line each time these rows enter a new line: rows
        // H·d apart are one page each, which the hardware prefetchers do not follow.
        if (d % simd::kLineElems<T> == 0) {
            GATTN_UNROLL
            for (int r = 0; r < R; ++r) simd::prefetch(next_key + r * key_stride + d);
        }
        B qv[C];
        GATTN_UNROLL
        for (int c = C0; c < C; ++c) qv[c] = B::load_aligned(qt + d * W + c * L);
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            const B kb(key[r * key_stride + d]);
            GATTN_UNROLL
            for (int c = C0; c < C; ++c) acc[r][c] = simd::fma(kb, qv[c], acc[r][c]);
        }
    }
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        GATTN_UNROLL
        for (int c = 0; c < C0; ++c) B(-std::numeric_limits<T>::infinity()).store_aligned(st + r * W + c * L);
    }
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        const B j(static_cast<T>(j0 + r));
        GATTN_UNROLL
        for (int c = C0; c < C; ++c) {
            B v = acc[r][c];
            if (tf) v = tf->apply(v, c, j);
            if constexpr (Masked) {
                const auto visible = (B::load_aligned(lane_begin + c * L) <= j) &
                                     (j < B::load_aligned(lane_end + c * L));
                v = xsimd::select(visible, v, B(-std::numeric_limits<T>::infinity()));
            }
            v.store_aligned(st + r * W + c * L);
            bmax[c] = xsimd::max(bmax[c], v);
        }
    }
}

/// A run of keys [begin, end) of a partial key block that the query registers see alike: the
/// first `first_live` registers see none of them, registers [first_live, first_plain) have
/// lanes that do not see some of them (their masked keys are marked P = −1 and skipped), and
/// registers [first_plain, C) see all of them in every lane (plain multiply-adds).
struct KeyRun {
    int begin, end, first_live, first_plain;
};

/// Oᵀ[j + r][·] = α·Oᵀ[j + r][·] + Σ_kk V[k0 + kk][j + r] · Pᵀ[kk][·] for r in [0, R).
/// Masked: the keys come as runs (KeyRun); a key is skipped by a select (not a multiply by 0)
/// only in the registers that have lanes it is hidden from, so the diagonal blocks of causal
/// attention pay one masked register per key, not four. CE < kCols (unmasked only): only the
/// first CE registers of queries.
template <class T, int R, bool Masked, int CE = FlashGeometry<T>::kCols>
inline void values_tile(const T* value, Index value_stride, const T* pt, Index nk, const simd::Batch<T>* alpha, T* ot,
                        const KeyRun* runs, int run_count) noexcept {
    using B = simd::Batch<T>;
    using G = FlashGeometry<T>;
    constexpr int C = CE, L = G::kLanes, W = G::kQueries;
    static_assert(CE == G::kCols || !Masked, "only unmasked tiles end early");
    B acc[R][C];
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        GATTN_UNROLL
        for (int c = 0; c < C; ++c) acc[r][c] = B(T(0));
    }
    // Keys [k_begin, k_end) into the registers of queries c ≥ C0, masked below CP (P < 0: a
    // masked key; NaN compares false and is kept).
    auto add_keys = [&](Index k_begin, Index k_end, auto first_live, auto first_plain) {
        constexpr int C0 = decltype(first_live)::value, CP = decltype(first_plain)::value;
        for (Index kk = k_begin; kk < k_end; ++kk) {
            B pv[C];
            GATTN_UNROLL
            for (int c = C0; c < C; ++c) pv[c] = B::load_aligned(pt + kk * W + c * L);
            typename B::batch_bool_type skip[C];
            GATTN_UNROLL
            for (int c = C0; c < CP; ++c) skip[c] = pv[c] < B(T(0));
            const T* v = value + kk * value_stride;
            GATTN_UNROLL
            for (int r = 0; r < R; ++r) {
                const B vb(v[r]);
                GATTN_UNROLL
                for (int c = C0; c < CP; ++c) acc[r][c] = simd::fma_unless(skip[c], vb, pv[c], acc[r][c]);
                GATTN_UNROLL
                for (int c = CP; c < C; ++c) acc[r][c] = simd::fma(vb, pv[c], acc[r][c]);
            }
        }
    };
    if constexpr (Masked) {
        for (int i = 0; i < run_count; ++i) {
            const KeyRun& run = runs[i];
            with_constant<C>(run.first_live, [&](auto first_live) {
                constexpr int C0 = decltype(first_live)::value;
                if (run.first_plain == C0)
                    add_keys(run.begin, run.end, first_live, std::integral_constant<int, C0>{});
                else if (run.first_plain == C0 + 1)
                    add_keys(run.begin, run.end, first_live, std::integral_constant<int, C0 + 1>{});
                else
                    add_keys(run.begin, run.end, first_live, std::integral_constant<int, C>{});
            });
        }
    } else {
        add_keys(0, nk, std::integral_constant<int, 0>{}, std::integral_constant<int, 0>{});
    }
    GATTN_UNROLL
    for (int r = 0; r < R; ++r) {
        GATTN_UNROLL
        for (int c = 0; c < C; ++c) {
            T* o = ot + r * W + c * L;
            simd::fma(B::load_aligned(o), alpha[c], acc[r][c]).store_aligned(o);
        }
    }
}

/// Sᵀ rows for keys [j0, j0 + nk): tiles of R keys, then the rest with R − 1. A tile prefetches
/// the next whole tile's key rows, the last ones the R rows at `after` (within the keys).
/// Masked: dead[kk] is the number of leading query registers that see no key j0 + kk.
/// tf: the block's softcap and ALiBi, or null for none. CE: as scores_tile; a run of rows
/// longer than kRows leaves its last keys to tiles of kRows and fewer.
template <class T, int R, bool Masked, int CE = FlashGeometry<T>::kCols>
inline void scores_rows(const T* key, Index key_stride, const T* qt, Index dk, T* st, Index j0, Index nk,
                        const T* lane_begin, const T* lane_end, simd::Batch<T>* bmax, const T* after, const int* dead,
                        const LogitTransform<T>* tf) noexcept {
    using G = FlashGeometry<T>;
    Index kk = 0;
    for (; kk + R <= nk; kk += R) {
        const T* next = kk + 2 * R <= nk ? key + (kk + R) * key_stride : after;  // never past the block
        if constexpr (Masked) {
            const int c0 = *std::min_element(dead + kk, dead + kk + R);
            if (c0 == G::kCols)  // no query of the block sees these keys
                std::fill(st + kk * G::kQueries, st + (kk + R) * G::kQueries, -std::numeric_limits<T>::infinity());
            with_constant<G::kCols>(c0, [&](auto first_live) {
                scores_tile<T, R, true, decltype(first_live)::value>(key + kk * key_stride, key_stride, qt, dk,
                                                                     st + kk * G::kQueries, j0 + kk, lane_begin,
                                                                     lane_end, bmax, next, tf);
            });
        } else {
            scores_tile<T, R, false, 0, CE>(key + kk * key_stride, key_stride, qt, dk, st + kk * G::kQueries, j0 + kk,
                                            lane_begin, lane_end, bmax, next, tf);
        }
    }
    if constexpr (R > 1) {
        constexpr int next_rows = R > G::kRows ? G::kRows : R - 1;
        if (kk < nk)
            scores_rows<T, next_rows, Masked, CE>(key + kk * key_stride, key_stride, qt, dk, st + kk * G::kQueries,
                                                  j0 + kk, nk - kk, lane_begin, lane_end, bmax, after,
                                                  Masked ? dead + kk : nullptr, tf);
    }
}

/// Oᵀ rows [0, d_v) by values_tile: tiles of R rows, then the rest with fewer (kRows and
/// fewer after a longer run, as scores_rows). CE: as values_tile.
template <class T, int R, bool Masked, int CE = FlashGeometry<T>::kCols>
inline void values_rows(const T* value, Index value_stride, const T* pt, Index nk, const simd::Batch<T>* alpha, T* ot,
                        Index dv, const KeyRun* runs, int run_count) noexcept {
    using G = FlashGeometry<T>;
    Index j = 0;
    for (; j + R <= dv; j += R)
        values_tile<T, R, Masked, CE>(value + j, value_stride, pt, nk, alpha, ot + j * G::kQueries, runs, run_count);
    if constexpr (R > 1) {
        constexpr int next_rows = R > G::kRows ? G::kRows : R - 1;
        if (j < dv)
            values_rows<T, next_rows, Masked, CE>(value + j, value_stride, pt, nk, alpha, ot + j * G::kQueries, dv - j,
                                                  runs, run_count);
    }
}

/// Online-softmax state of one query block: per-lane running max m and sum l, each lane's
/// first score, and the union and intersection of the lanes' visible key ranges.
template <class T>
struct FlashState {
    using B = simd::Batch<T>;
    using G = FlashGeometry<T>;
    B m[G::kCols], l[G::kCols];
    alignas(64) T first_score[G::kQueries];
    Index union_begin, union_end, common_begin, common_end;
    bool elementwise;
    LogitTransform<T> transform;  // softcap and ALiBi
    /// First key block this query block visits (key blocks start at multiples of Bc, so a
    /// lane's blocking and rounding do not depend on which other lanes share its block).
    Index first_block() const { return union_begin / G::kKeys * G::kKeys; }
    /// Starts a query block (any storage of its rows): its lanes' key ranges, m = −∞, l = 0.
    template <class Block>
    void reset(const Block& blk) noexcept {
        transform.reset(blk);
        union_begin = std::numeric_limits<Index>::max();
        union_end = 0;
        common_begin = 0;
        common_end = std::numeric_limits<Index>::max();
        elementwise = false;
        for (int t = 0; t < blk.count; ++t) {
            if (blk.bool_row[t] || blk.bias_row[t]) elementwise = true;
            common_begin = std::max(common_begin, blk.begin[t]);
            common_end = std::min(common_end, blk.end[t]);
            if (blk.begin[t] >= blk.end[t]) continue;
            union_begin = std::min(union_begin, blk.begin[t]);
            union_end = std::max(union_end, blk.end[t]);
        }
        for (int c = 0; c < G::kCols; ++c) {
            m[c] = B(-std::numeric_limits<T>::infinity());
            l[c] = B(T(0));
        }
        std::fill(first_score, first_score + G::kQueries, -std::numeric_limits<T>::infinity());
    }
    /// Whether the block sees any key.
    bool any_key() const noexcept { return union_begin < union_end; }
    /// The online softmax's rescale for query register c and a key block whose max is bmax:
    /// m ← max(m, bmax); shift ← what the block's weights subtract, the new m, or 0 for a lane
    /// that has seen no key yet (no (−∞) − (−∞) is formed; its weights and α are e^(−∞) = 0);
    /// returns α = e^(m_old − shift), the factor of l and O.
    B rescale(int c, const B& bmax, B& shift) noexcept {
        const B m_new = xsimd::max(m[c], bmax);
        shift = xsimd::select(m_new == B(-std::numeric_limits<T>::infinity()), B(T(0)), m_new);
        const B alpha = softmax_exp<T>(m[c] - shift);
        m[c] = m_new;
        return alpha;
    }
};

GATTN_EIGEN_PACKETS_BEGIN

/// dst[c][r] = scale · row(r)[c] for c < cols and r < rows, 0 for r in [rows, padded_rows)
/// (padded_rows a multiple of the packet; row(r) points at row r): square tiles transposed in
/// registers (Eigen's packet transpose), the columns past the last whole packet element by
/// element; dst's rows are dst_stride apart. A query block's scale·Qᵀ (pack_queries), and where
/// FlashTiles::kRowKeyRows is 0 a key block's Kᵀ and a few-query block's Sᵀ (row_block_scores).
template <class T, class Row>
void transpose_rows(const Row& row, Index rows, Index padded_rows, Index cols, T* dst, Index dst_stride,
                    T scale = T(1)) {
    namespace ei = Eigen::internal;
    using Packet = typename ei::packet_traits<T>::type;
    constexpr int P = ei::unpacket_traits<Packet>::size;
    const Packet s = ei::pset1<Packet>(scale), zero = ei::pset1<Packet>(T(0));
    const Index c_vec = cols / P * P;
    for (Index r0 = 0; r0 < padded_rows; r0 += P) {
        for (Index c0 = 0; c0 < c_vec; c0 += P) {
            ei::PacketBlock<Packet, P> tile;
            GATTN_UNROLL
            for (int i = 0; i < P; ++i) tile.packet[i] = r0 + i < rows ? ei::ploadu<Packet>(row(r0 + i) + c0) : zero;
            ei::ptranspose(tile);
            GATTN_UNROLL
            for (int i = 0; i < P; ++i) ei::pstoreu(dst + (c0 + i) * dst_stride + r0, ei::pmul(tile.packet[i], s));
        }
        for (Index c = c_vec; c < cols; ++c)
            for (Index r = r0; r < r0 + P; ++r) dst[c * dst_stride + r] = r < rows ? row(r)[c] * scale : T(0);
    }
}

/// Qᵀ[d][t] = scale · query_t[d] for the block's lanes, 0 in padding lanes.
template <class T>
void pack_queries(const FlashBlock<T>& blk, Index dk, T scale, T* qt) {
    constexpr int W = FlashGeometry<T>::kQueries;
    transpose_rows([&](Index t) { return blk.q[t]; }, blk.count, W, dk, qt, W, scale);
}

/// rows[t][j] = Oᵀ[j][t] · inv[t] for t < count: the transpose of pack_queries.
/// stream: rows aligned to a register are written with streaming stores (simd::stream_store),
/// which skip reading each line for ownership first.
template <class T>
void unpack_outputs(int count, T* const* rows, const T* ot, Index dv, const T* inv, bool stream) {
    namespace ei = Eigen::internal;
    using Packet = typename ei::packet_traits<T>::type;
    constexpr int P = ei::unpacket_traits<Packet>::size, W = FlashGeometry<T>::kQueries;
    const Index j_vec = dv / P * P;
    for (int t0 = 0; t0 < count; t0 += P) {
        const int lanes = std::min(P, count - t0);
        bool aligned[P] = {};
        for (int i = 0; i < lanes; ++i)
            aligned[i] = stream && reinterpret_cast<std::uintptr_t>(rows[t0 + i]) % (P * sizeof(T)) == 0;
        for (Index j0 = 0; j0 < j_vec; j0 += P) {
            ei::PacketBlock<Packet, P> tile;
            GATTN_UNROLL
            for (int i = 0; i < P; ++i) tile.packet[i] = ei::ploadu<Packet>(ot + (j0 + i) * W + t0);
            ei::ptranspose(tile);
            for (int i = 0; i < lanes; ++i) {
                const Packet y = ei::pmul(tile.packet[i], ei::pset1<Packet>(inv[t0 + i]));
                if (aligned[i])
                    simd::stream_store(rows[t0 + i] + j0, y);
                else
                    ei::pstoreu(rows[t0 + i] + j0, y);
            }
        }
        for (int t = t0; t < t0 + lanes; ++t)
            for (Index j = j_vec; j < dv; ++j) rows[t][j] = ot[j * W + t] * inv[t];
    }
    if (stream) simd::stream_fence();
}

/// dst[j] = src[j] for j < n, with streaming stores where dst is aligned to a register (the
/// rows of a staged block, see flash_attention_blocks).
template <class T>
void stream_row(T* dst, const T* src, Index n) {
    namespace ei = Eigen::internal;
    using Packet = typename ei::packet_traits<T>::type;
    constexpr int P = ei::unpacket_traits<Packet>::size;
    Index j = 0;
    if (reinterpret_cast<std::uintptr_t>(dst) % (P * sizeof(T)) == 0)
        for (; j + P <= n; j += P) simd::stream_store(dst + j, ei::ploadu<Packet>(src + j));
    std::copy(src + j, src + n, dst + j);
}

GATTN_EIGEN_PACKETS_END

/// Prepares a query block: ranges, scale·Qᵀ (padding lanes zero), Oᵀ = 0, m = −∞, l = 0.
template <class T>
void flash_begin(const FlashBlock<T>& blk, Index dk, Index dv, T scale, T* qt, T* ot, FlashState<T>& st) {
    st.reset(blk);
    pack_queries(blk, dk, scale, qt);
    std::fill(ot, ot + dv * FlashGeometry<T>::kQueries, T(0));
}

/// A key block's boolean mask and additive bias, per lane of the Sᵀ tile st (nk rows of
/// kQueries lanes, keys k0 …), then each query register's block maximum bmax again: the float
/// and the 16-bit kernels' step. A key the range (causal, window, key length) or the boolean
/// mask hides ignores its bias, whatever it holds (NaN or +∞ there must not reach the row).
template <class T, class Block>
inline void mask_elementwise(const Block& blk, T* st, Index k0, Index nk, simd::Batch<T>* bmax) noexcept {
    using B = simd::Batch<T>;
    using G = FlashGeometry<T>;
    constexpr int C = G::kCols, L = G::kLanes, W = G::kQueries;
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    GATTN_UNROLL
    for (int c = 0; c < C; ++c) bmax[c] = B(kNegInf);
    for (Index kk = 0; kk < nk; ++kk) {
        T* row = st + kk * W;
        const Index j = k0 + kk;
        for (int t = 0; t < blk.count; ++t) {
            if (row[t] == kNegInf) continue;
            if (blk.bool_row[t] && !blk.bool_row[t][j])
                row[t] = kNegInf;
            else if (blk.bias_row[t])
                row[t] = blk.bias_row[t][j] == kNegInf ? kNegInf : row[t] + blk.bias_row[t][j];
        }
        GATTN_UNROLL
        for (int c = 0; c < C; ++c) bmax[c] = xsimd::max(bmax[c], B::load_aligned(row + c * L));
    }
}

/// One key block [k0, k0 + Bc) ∩ [0, union_end) of a query block: scores, mask, online softmax
/// and Oᵀ update. key_block/value_block point at key k0 of the head.
template <class T>
void flash_step(const FlashBlock<T>& blk, FlashState<T>& state, Index k0, const T* key_block, Index key_stride,
                const T* value_block, Index value_stride, Index dk, Index dv, const T* qt, T* st, T* ot) {
    using B = simd::Batch<T>;
    using G = FlashGeometry<T>;
    constexpr int C = G::kCols, L = G::kLanes, W = G::kQueries;
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    const Index nk = std::min<Index>(G::kKeys, state.union_end - k0);
    const bool full = !state.elementwise && state.common_begin <= k0 && k0 + nk <= state.common_end;
    B bmax[C];
    GATTN_UNROLL
    for (int c = 0; c < C; ++c) bmax[c] = B(kNegInf);
    // Partial blocks: per key kk, the leading query registers that see it in no lane (dead); keys
    // that the registers see alike form runs (KeyRun).
    int dead[G::kKeys] = {};
    KeyRun runs[G::kKeys];
    int run_count = 0;
    // The last tile prefetches the block's first rows again: the group's next query block
    // starts there.
    const LogitTransform<T>* tf = state.transform.active() ? &state.transform : nullptr;
    if (tf) state.transform.at_keys(k0);
    // Registers that hold queries (the others are padding): the unmasked tiles skip the rest.
    const int live = std::max(1, (blk.count + L - 1) / L);
    if (full) {
        with_constant<C>(live - 1, [&](auto last) {
            constexpr int CE = decltype(last)::value + 1;
            scores_rows<T, G::template kLiveRows<CE>, false, CE>(key_block, key_stride, qt, dk, st, 0, nk, nullptr,
                                                                 nullptr, bmax, key_block, nullptr, tf);
        });
    } else {
        // Each lane's visible range relative to k0, clamped to [−1, Bc + 1]: small integers, exact
        // in T however large N_k is, so one vector compare per register masks a key. Padding
        // lanes see nothing.
        alignas(64) T lane_begin[W], lane_end[W];
        // Per query register: the union and the intersection of its lanes' ranges.
        Index col_begin[C], col_end[C], col_all_begin[C], col_all_end[C];
        GATTN_UNROLL
        for (int c = 0; c < C; ++c) {
            col_begin[c] = col_all_end[c] = std::numeric_limits<Index>::max();
            col_end[c] = col_all_begin[c] = std::numeric_limits<Index>::min();
        }
        for (int t = 0; t < W; ++t) {
            const Index b = t < blk.count ? blk.begin[t] - k0 : 0, e = t < blk.count ? blk.end[t] - k0 : 0;
            lane_begin[t] = static_cast<T>(std::clamp<Index>(b, -1, G::kKeys + 1));
            lane_end[t] = static_cast<T>(std::clamp<Index>(e, -1, G::kKeys + 1));
            col_all_begin[t / L] = std::max(col_all_begin[t / L], b);
            col_all_end[t / L] = std::min(col_all_end[t / L], e);
            if (b < e) {
                col_begin[t / L] = std::min(col_begin[t / L], b);
                col_end[t / L] = std::max(col_end[t / L], e);
            }
        }
        // Leading query registers that see no key kk (causal: the diagonal block's upper part),
        // and the first of the trailing registers whose every lane sees it (rounded up to C
        // unless it is one of the first two live registers, to bound the variants of the PV
        // tile; the boolean mask and bias may hide any key in any lane).
        for (Index kk = 0; kk < nk; ++kk) {
            int c = 0;
            while (c < C && !(col_begin[c] <= kk && kk < col_end[c])) ++c;
            dead[kk] = c;
            int p = C;
            while (!state.elementwise && p > c && col_all_begin[p - 1] <= kk && kk < col_all_end[p - 1]) --p;
            const int plain = p <= c + 1 ? p : C;
            if (run_count > 0 && runs[run_count - 1].first_live == c && runs[run_count - 1].first_plain == plain)
                runs[run_count - 1].end = static_cast<int>(kk) + 1;
            else
                runs[run_count++] = KeyRun{static_cast<int>(kk), static_cast<int>(kk) + 1, c, plain};
        }
        scores_rows<T, G::kRows, true>(key_block, key_stride, qt, dk, st, 0, nk, lane_begin, lane_end, bmax, key_block,
                                       dead, tf);
    }
    if (state.elementwise && !full) mask_elementwise(blk, st, k0, nk, bmax);
    if (k0 == 0)
        for (int t = 0; t < live * L; ++t) state.first_score[t] = st[t];

    B alpha[C], shift[C], lsum[C];
    GATTN_UNROLL
    for (int c = 0; c < C; ++c) {
        alpha[c] = state.rescale(c, bmax[c], shift[c]);
        lsum[c] = B(T(0));
    }
    if (full) {
        for (Index kk = 0; kk < nk; ++kk) {
            T* row = st + kk * W;
            for (int c = 0; c < live; ++c) {
                const B p = softmax_exp<T>(B::load_aligned(row + c * L) - shift[c]);
                p.store_aligned(row + c * L);
                lsum[c] += p;
            }
        }
    } else {
        // In the registers that mask key kk, a score of −∞ is stored as P = −1, which values_tile
        // skips; a visible key whose weight underflows keeps P = 0 and is multiplied like any
        // other (0·NaN = NaN), as in the registers that see the key in every lane. The runs
        // cover every key of the block. Registers below a run's first_live see none of its keys
        // and values_tile never reads them: their weights are not computed (a third of a causal
        // diagonal block's exponentials).
        for (int i = 0; i < run_count; ++i)
            with_constant<C>(runs[i].first_live, [&](auto first_live) {
                for (Index kk = runs[i].begin; kk < runs[i].end; ++kk) {
                    T* row = st + kk * W;
                    for (int c = decltype(first_live)::value; c < C; ++c) {
                        const B sc = B::load_aligned(row + c * L);
                        const B p = softmax_exp<T>(sc - shift[c]);
                        lsum[c] += p;
                        (c < runs[i].first_plain ? xsimd::select(sc == B(kNegInf), B(T(-1)), p) : p)
                            .store_aligned(row + c * L);
                    }
                }
            });
    }
    GATTN_UNROLL
    for (int c = 0; c < C; ++c) state.l[c] = simd::fma(state.l[c], alpha[c], lsum[c]);
    if (full) {
        with_constant<C>(live - 1, [&](auto last) {
            constexpr int CE = decltype(last)::value + 1;
            values_rows<T, G::template kLiveRows<CE>, false, CE>(value_block, value_stride, st, nk, alpha, ot, dv,
                                                                 nullptr, 0);
        });
    } else if constexpr (G::kMaskedRows == G::kRows) {
        values_rows<T, G::kRows, true>(value_block, value_stride, st, nk, alpha, ot, dv, runs, run_count);
    } else {
        // Masked tiles have fewer rows here (FlashGeometry::kMaskedRows): the leading keys that
        // every lane sees (a causal block's keys left of the diagonal) go through the plain
        // tiles with α, the rest through the masked tiles, which add to the rescaled Oᵀ (α = 1).
        int plain = 0;
        while (plain < run_count && runs[plain].first_live == 0 && runs[plain].first_plain == 0) ++plain;
        const Index plain_keys = plain > 0 ? runs[plain - 1].end : 0;
        if (plain_keys > 0)
            values_rows<T, G::kRows, false>(value_block, value_stride, st, plain_keys, alpha, ot, dv, nullptr, 0);
        if (plain < run_count) {
            B one[C];
            GATTN_UNROLL
            for (int c = 0; c < C; ++c) one[c] = B(T(1));
            values_rows<T, G::kMaskedRows, true>(value_block, value_stride, st, nk, plain_keys > 0 ? one : alpha, ot,
                                                 dv, runs + plain, run_count - plain);
        }
    }
}

/// Whether a query block runs as a few-query block (flash_row_step): at most one register of
/// queries, every lane seeing the same keys, no boolean mask, bias or ALiBi, d_v a whole
/// number of registers, on a tier whose FlashTiles::kRowTiles says so (and, where the masked
/// value tiles differ, FlashGeometry::kMaskedRows, keys that start at a key block). A cascade's
/// prefix rows of one KV head (16 on 8 KV heads at batch 16) and a prompt's last rows are such
/// blocks.
template <class T>
bool runs_row_tiles(const FlashBlock<T>& blk, const FlashState<T>& st, Index dv) noexcept {
    using G = FlashGeometry<T>;
    return simd::FlashTiles::kRowTiles && blk.count <= G::kLanes && st.any_key() && !st.elementwise &&
           !st.transform.alibi && st.union_begin == st.common_begin && st.union_end == st.common_end &&
           dv % G::kLanes == 0 && (G::kMaskedRows == G::kRows || st.union_begin % G::kKeys == 0);
}

/// Sᵀ (st: [nk][kQueries]) of a few-query block's n query rows (qt: scale·Qᵀ) against the nk
/// keys of a key block, softcapped, each sum in flash_step's order; hook() once per k-step of
/// the product. The tier's FlashTiles::kRowKeyRows chooses how:
/// - > 0: Sᵀ = K·Qᵀ in tile_product's blocks of kRowKeyRows keys × one register of queries, each
///   K element broadcast from the K rows (key, key_stride apart: copied side by side where they
///   lie a page apart, see flash_attention_blocks; a stride of 64, 128 or 256 is a constant of
///   the product). No transpose.
/// - 0: S = Q·Kᵀ from the key block's Kᵀ (kt: [d_k][Bc], zeros past nk) in blocks of kRows
///   query rows × kCols registers of keys, each Q element broadcast, into sr ([kLanes][Bc]),
///   then transposed into Sᵀ: fewer broadcasts per multiply-add, for tiers whose multiply-adds
///   cannot take a broadcast operand (AVX2).
template <class T, class Hook>
void row_block_scores(int n, const T* key, Index key_stride, const T* kt, Index nk, Index dk, const T* qt, T* st, T* sr,
                      const LogitTransform<T>& tf, const Hook& hook) {
    using B = simd::Batch<T>;
    using G = FlashGeometry<T>;
    constexpr int L = G::kLanes, W = G::kQueries;
    if constexpr (simd::FlashTiles::kRowKeyRows > 0) {
        (void)n, (void)kt, (void)sr;
        const auto run = [&](auto stride) {
            tile_product<T, false, simd::FlashTiles::kRowKeyRows, 1, decltype(stride)::value>(static_cast<int>(nk), L,
                                                                                              dk, key, key_stride, 1,
                                                                                              qt, W, st, W, hook);
        };
        switch (key_stride) {
            case 64: run(std::integral_constant<Index, 64>{}); break;
            case 128: run(std::integral_constant<Index, 128>{}); break;
            case 256: run(std::integral_constant<Index, 256>{}); break;
            default: run(std::integral_constant<Index, 0>{});
        }
        if (tf.capped)
            for (Index kk = 0; kk < nk; ++kk)
                simd::softcap<T>(B::load_aligned(st + kk * W), tf.cap, tf.inv_cap).store_aligned(st + kk * W);
    } else {
        (void)key, (void)key_stride;
        constexpr Index Bc = G::kKeys;
        const Index cols = (nk + L - 1) / L * L;
        tile_product<T, false>(n, static_cast<int>(cols), dk, qt, 1, W, kt, Bc, sr, Bc, hook);
        if (tf.capped)
            for (int t = 0; t < n; ++t)
                for (Index kk = 0; kk < cols; kk += L) {
                    T* row = sr + t * Bc + kk;
                    simd::softcap<T>(B::load_aligned(row), tf.cap, tf.inv_cap).store_aligned(row);
                }
        transpose_rows([&](Index t) { return sr + t * Bc; }, n, L, cols, st, W);
    }
}

/// The k-steps of a few-query block's products over nk keys that carry a share of the next key
/// block's prefetches (flash_row_step): Sᵀ's, and where FlashTiles::kRowKeyRows > 0 (whose Sᵀ
/// runs too fast to hide the fetch alone) P·V's too.
template <class T>
Index row_block_steps(int n, Index nk, Index dk, Index dv) noexcept {
    using G = FlashGeometry<T>;
    using Tiles = simd::FlashTiles;
    constexpr int L = G::kLanes;
    const auto blocks = [](Index count, Index per) { return (count + per - 1) / per; };
    if constexpr (Tiles::kRowKeyRows > 0)
        return blocks(nk, Tiles::kRowKeyRows) * dk +
               blocks(n, Tiles::kRowValueRows) * blocks(dv / L, Tiles::kRowValueCols) * nk;
    else
        return blocks(n, Tiles::kRows) * blocks((nk + L - 1) / L, Tiles::kCols) * dk;
}

/// One key block [k0, k0 + Bc) ∩ [0, union_end) of a few-query block (runs_row_tiles): one
/// register of queries. Sᵀ (st) by row_block_scores from the block's K rows (key_block,
/// key_stride apart) or its Kᵀ (kt), flash_step's softmax, then P·V on kernel::tile_product with
/// the value features in the lanes, a V register serving kRowValueRows queries (in flash_step's
/// tiles every multiply-add of one register of queries takes its own broadcast of a V element),
/// from Pᵀ into sr ([count][d_v]), added to O (o: [count][d_v], row-major, not Oᵀ) as flash_step
/// adds to Oᵀ. Every sum runs in flash_step's order, so the bits are those of a block that runs
/// flash_step (a query's result does not depend on how many share its block). The keys before
/// the lanes' range score −∞ whatever K holds there, and their V rows are not read. prefetch (or
/// null): its per_step lines at each of row_block_steps' k-steps (flash_attention_blocks).
template <class T>
void flash_row_step(const FlashBlock<T>& blk, FlashState<T>& state, Index k0, const T* key_block, Index key_stride,
                    const T* kt, const T* value_block, Index value_stride, Index dk, Index dv, const T* qt, T* st,
                    T* sr, T* o, SpreadPrefetch<T>* prefetch = nullptr) {
    using B = simd::Batch<T>;
    using G = FlashGeometry<T>;
    constexpr int L = G::kLanes, W = G::kQueries;
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    const int n = blk.count;
    const Index nk = std::min<Index>(G::kKeys, state.union_end - k0);
    const Index kb = std::max<Index>(0, state.union_begin - k0);
    // prefetch: a share of the next key block's lines at each k-step.
    auto ahead = [prefetch] {
        if (prefetch) prefetch->step(prefetch->per_step);
    };
    row_block_scores(n, key_block, key_stride, kt, nk, dk, qt, st, sr, state.transform, ahead);
    B bmax(kNegInf);
    for (Index kk = 0; kk < nk; ++kk) {
        if (kk < kb) B(kNegInf).store_aligned(st + kk * W);
        bmax = xsimd::max(bmax, B::load_aligned(st + kk * W));
    }
    if (k0 == 0)
        for (int t = 0; t < L; ++t) state.first_score[t] = st[t];
    // flash_step's softmax on the first register of queries.
    B shift;
    const B alpha = state.rescale(0, bmax, shift);
    B lsum(T(0));
    for (Index kk = 0; kk < nk; ++kk) {
        const B p = softmax_exp<T>(B::load_aligned(st + kk * W) - shift);
        p.store_aligned(st + kk * W);
        lsum += p;
    }
    state.l[0] = simd::fma(state.l[0], alpha, lsum);
    const auto value_steps = [&] {
        if constexpr (simd::FlashTiles::kRowKeyRows > 0) ahead();
    };
    tile_product<T, false, simd::FlashTiles::kRowValueRows, simd::FlashTiles::kRowValueCols, 0>(
        n, static_cast<int>(dv), nk - kb, st + kb * W, 1, W, value_block + kb * value_stride, value_stride, sr, dv,
        value_steps);
    alignas(64) T alpha_lane[L];
    alpha.store_aligned(alpha_lane);
    for (int t = 0; t < n; ++t) {
        const B a(alpha_lane[t]);
        for (Index j = 0; j < dv; j += L) {
            T* ot = o + t * dv + j;
            simd::fma(B::load_unaligned(ot), a, B::load_aligned(sr + t * dv + j)).store_unaligned(ot);
        }
    }
}

/// Writes a query block's outputs: O = Oᵀᵀ / l (0 for a lane that sees no key) into rows (the
/// block's out rows or staging rows), log-sum-exp and first-key probability. The block's rows
/// may be of any storage (only its count and optional outputs are used). row_major: ot holds O
/// as [count][d_v] (flash_row_step), not Oᵀ.
template <class T, class S, class O>
void flash_finish(const FlashBlock<T, S, O>& blk, const FlashState<T>& state, const T* ot, Index dv, T* const* rows,
                  bool stream, bool row_major = false) {
    using G = FlashGeometry<T>;
    constexpr int C = G::kCols, L = G::kLanes, W = G::kQueries;
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    alignas(64) T m_lane[W], l_lane[W];
    GATTN_UNROLL
    for (int c = 0; c < C; ++c) {
        state.m[c].store_aligned(m_lane + c * L);
        state.l[c].store_aligned(l_lane + c * L);
    }
    alignas(64) T inv[W];
    for (int t = 0; t < W; ++t) {
        T lt = l_lane[t], w = 1;
        const T sink = t < blk.count ? blk.sink[t] : kNegInf;
        if (sink != kNegInf && !std::isnan(lt)) {
            // The sink joins the denominator: rescale to m' = max(m, s), l' = l·e^(m − m') + e^(s − m').
            const T mt = std::max(m_lane[t], sink);
            w = m_lane[t] == kNegInf ? T(0) : simd::exp_scalar<T>(m_lane[t] - mt);
            lt = lt * w + simd::exp_scalar<T>(sink - mt);
            m_lane[t] = mt;
            l_lane[t] = lt;
        }
        // 0 for a lane that sees no key (its Oᵀ column is exactly 0), NaN stays NaN.
        inv[t] = !(lt > 0) && !std::isnan(lt) ? T(0) : w / lt;
    }
    if (row_major) {
        using B = simd::Batch<T>;
        for (int t = 0; t < blk.count; ++t) {
            const B it(inv[t]);
            for (Index j = 0; j < dv; j += L) (B::load_unaligned(ot + t * dv + j) * it).store_unaligned(rows[t] + j);
        }
    } else {
        unpack_outputs(blk.count, rows, ot, dv, inv, stream);
    }
    for (int t = 0; t < blk.count; ++t) {
        const T lt = l_lane[t];
        const bool empty = !(lt > 0) && !std::isnan(lt);
        if (blk.lse[t]) *blk.lse[t] = empty ? kNegInf : m_lane[t] + std::log(lt);
        if (blk.first_key[t])
            *blk.first_key[t] = empty || state.first_score[t] == kNegInf
                                    ? T(0)
                                    : simd::exp_scalar<T>(state.first_score[t] - m_lane[t]) * (T(1) / lt);
    }
}

/// Where flash_attention_blocks writes each query block's outputs.
enum class OutputWrites {
    Direct,     ///< into the block's out rows, ordinary stores
    Streaming,  ///< into the block's out rows, streaming stores where a row is aligned
    Staged,     ///< into the thread's staging rows (FlashScratch::stage); after on_block, streamed
                ///< to the block's out rows
};

/// Runs up to kGroupBlocks query blocks of one KV head against its keys [0, N_k), key block by
/// key block, each query block exactly as if it ran alone (the result does not depend on the
/// grouping). key/value point at key 0 of the head (row strides key_stride/value_stride); the
/// blocks' queries are unscaled. Writes the outputs of their lanes (see OutputWrites), their
/// log-sum-exp and first-key probability, and calls on_block(i, rows) for block i, where
/// rows[t] holds lane t's output (staged: before the rows are copied to the block's out rows).
/// KV = std::int8_t (T = float): K and V are int8 codes with the scales of `scales` (row r of the
/// head at scales.key[r·scales.stride], ops/int8_rows.hpp), dequantized key block by key block
/// into the scratch (FlashScratch::reserve with int8), never as a whole.
/// pages: key j is row pages.row(j) of key/value (and the scales); a key block over several pages
/// has its rows copied side by side into the scratch (FlashScratch::reserve with int8 reserves
/// them), with the same arithmetic.
template <class T, class OnBlock, class KV = T>
void flash_attention_blocks(const FlashBlock<T>* blocks, int count, const KV* key, Index key_stride, const KV* value,
                            Index value_stride, Index dk, Index dv, T scale, FlashScratch<T>& s, OutputWrites writes,
                            const OnBlock& on_block, [[maybe_unused]] const Int8Scales& scales = {},
                            const PageMap& pages = {}) {
    static_assert(std::is_same_v<KV, T> || (std::is_same_v<KV, std::int8_t> && std::is_same_v<T, float>),
                  "keys and values of the query type, or int8 codes with float queries");
    using G = FlashGeometry<T>;
    GATTN_DEBUG_ASSERT(count >= 1 && count <= G::kGroupBlocks);
    FlashState<T> state[G::kGroupBlocks];
    Index k_begin = std::numeric_limits<Index>::max(), k_end = 0;
    // A block with fewer queries than kCols registers runs QK tiles of more rows (kLiveRows, up to
    // 12; a few-query block, runs_row_tiles, FlashTiles::kRowKeyRows): with their next tile's
    // prefetched rows, more lines than an L1 set holds when the rows lie 4 KiB apart, so K rows
    // that are not contiguous are copied together for it.
    bool tall_tiles = false, any_row_tiles = false, all_row_tiles = true;
    bool row_tiles[G::kGroupBlocks] = {};
    for (int i = 0; i < count; ++i) {
        flash_begin(blocks[i], dk, dv, scale, s.qt[i].data(), s.ot[i].data(), state[i]);
        row_tiles[i] = runs_row_tiles(blocks[i], state[i], dv);
        any_row_tiles = any_row_tiles || row_tiles[i];
        all_row_tiles = all_row_tiles && row_tiles[i];
        tall_tiles = tall_tiles ||
                     (row_tiles[i] ? simd::FlashTiles::kRowKeyRows > 0 : blocks[i].count <= (G::kCols - 1) * G::kLanes);
        if (state[i].union_begin >= state[i].union_end) continue;
        k_begin = std::min(k_begin, state[i].first_block());
        k_end = std::max(k_end, state[i].union_end);
    }
    // The next key block's K and V rows, asked for ahead of their use (few-query blocks; not
    // for int8 codes, which are dequantized block by block).
    SpreadPrefetch<T> spread{};
    if constexpr (std::is_same_v<KV, T>)
        spread = SpreadPrefetch<T>::over(key, key_stride, value, value_stride, dk, dv, pages);
    for (Index k0 = k_begin; k0 < k_end; k0 += G::kKeys) {
        const Index nk = std::min<Index>(G::kKeys, k_end - k0);
        const T* key_block;
        const T* value_block;
        Index ks = key_stride, vs = value_stride;
        if constexpr (std::is_same_v<KV, std::int8_t>) {
            for (Index r = 0; r < nk; ++r) {
                const Index j = pages.row(k0 + r);
                dequantize_int8_row(key + j * key_stride, scales.key[j * scales.stride], s.key_rows.data() + r * dk,
                                    dk);
                dequantize_int8_row(value + j * value_stride, scales.value[j * scales.stride],
                                    s.value_rows.data() + r * dv, dv);
            }
            key_block = s.key_rows.data();
            value_block = s.value_rows.data();
            ks = dk;
            vs = dv;
        } else if (!pages.consecutive(k0, nk)) {  // rows of several pages, side by side
            for (Index r = 0; r < nk; ++r) {
                const Index j = pages.row(k0 + r);
                std::memcpy(s.key_rows.data() + r * dk, key + j * key_stride, sizeof(T) * dk);
                std::memcpy(s.value_rows.data() + r * dv, value + j * value_stride, sizeof(T) * dv);
            }
            key_block = s.key_rows.data();
            value_block = s.value_rows.data();
            ks = dk;
            vs = dv;
        } else {
            key_block = key + pages.row(k0) * key_stride;
            value_block = value + pages.row(k0) * value_stride;
            // V rows that are not contiguous ([N, H·d]: H·d apart, 4 KiB at H·d = 1024 floats)
            // are copied together for the group: the 64 rows a PV tile reads for each of its
            // columns would all fall into one L1 set. K rows too where a QK tile's rows would
            // overflow their L1 set (FlashGeometry::copies_keys). Measured, d = 128, N = 2048,
            // 8 heads, 1 thread: copying K and V against reading both in place, AVX-512 (two
            // 512-bit FMA pipes) +7 % (d = 256 +7 %, causal +7 %, d = 64 +1 %), AVX2
            // 88 → 94 GFLOP/s; copying V alone against both: −0.8 to +2.6 %, median +1 % (14 runs
            // over d = 64–256, causal, N = 512, 2 threads, AVX2), on Zen 5's 12-way L1. Exact.
            // A group of few-query blocks alone reads each V row in a few pieces of
            // kRowValueCols registers, in place (and, where kRowKeyRows is 0, each K row once,
            // into Kᵀ). Measured, 16 query rows on 8 KV heads, d = 128, 1 thread, AMD Zen 4,
            // five alternated rounds, medians: 2048 keys 60 → 67 GFLOP/s, 8192 keys (from
            // memory) 51 → 56 (AVX2: 46 → 50, 35 → 36).
            if (FlashScratch<T>::copies_values(value_stride, dv) && !all_row_tiles) {
                for (Index r = 0; r < nk; ++r)
                    std::memcpy(s.value_rows.data() + r * dv, value_block + r * value_stride, sizeof(T) * dv);
                value_block = s.value_rows.data();
                vs = dv;
            }
            if ((G::copies_keys(key_stride, dk) && !all_row_tiles) || (tall_tiles && key_stride != dk)) {
                for (Index r = 0; r < nk; ++r)
                    std::memcpy(s.key_rows.data() + r * dk, key_block + r * key_stride, sizeof(T) * dk);
                key_block = s.key_rows.data();
                ks = dk;
            }
        }
        // Few-query blocks do too little work on a key block to hide the fetch of the next: its K
        // and V rows (a page apart in a [N, H·d] layout, which the hardware prefetchers do not
        // follow) are asked for into L2 (into L1 the burst of 16 lines a row waited on L1's miss
        // buffers: 16 query rows over 8k keys, 8 heads, d = 128, AMD Zen 5, 65–71 GFLOP/s into
        // L1, 78–83 into L2; 1 or 3 blocks ahead no better than 1), a share at each k-step of
        // the products (row_block_steps), not as one burst. The same case from memory on AMD
        // Zen 4, five alternated rounds, medians: 8k keys 44 → 62 GFLOP/s, 32k 38 → 59 (2k keys,
        // in L3: 65 → 63), spread over S from Kᵀ; over both products 58 and 54, over the first
        // half or two thirds of S, or two blocks ahead, within 3 % of this. S from K rows
        // (kRowKeyRows > 0) takes a third of the time that S from Kᵀ took, too little to carry
        // the prefetches alone: over both products, medians of 11 alternated rounds, 2k keys
        // 66.5 → 71.7 GFLOP/s, 8k 66.6 → 74.9. A group with other blocks asks at once.
        const bool ahead = any_row_tiles && std::is_same_v<KV, T> && k0 + G::kKeys < k_end;
        if (ahead) {
            Index steps = 0;
            for (int i = 0; i < count; ++i)
                if (row_tiles[i]) steps += row_block_steps<T>(blocks[i].count, nk, dk, dv);
            spread.start(k0 + G::kKeys, std::min<Index>(k0 + 2 * G::kKeys, k_end), steps);
            if (!all_row_tiles) spread.step(-1);
        }
        bool packed = false;  // Kᵀ (kRowKeyRows = 0)
        for (int i = 0; i < count; ++i) {
            if (!(state[i].any_key() && state[i].first_block() <= k0 && k0 < state[i].union_end)) continue;
            if (row_tiles[i]) {
                if constexpr (simd::FlashTiles::kRowKeyRows == 0)
                    if (!packed)
                        transpose_rows([&](Index r) { return key_block + r * ks; }, nk,
                                       (nk + G::kLanes - 1) / G::kLanes * G::kLanes, dk, s.key_t.data(), G::kKeys);
                packed = true;
                flash_row_step(blocks[i], state[i], k0, key_block, ks, s.key_t.data(), value_block, vs, dk, dv,
                               s.qt[i].data(), s.st.data(), s.row_tile.data(), s.ot[i].data(),
                               ahead ? &spread : nullptr);
            } else {
                flash_step(blocks[i], state[i], k0, key_block, ks, value_block, vs, dk, dv, s.qt[i].data(), s.st.data(),
                           s.ot[i].data());
            }
        }
        if (ahead) spread.step(-1);  // what the products left
    }
    T* staged[G::kQueries] = {};
    if (writes == OutputWrites::Staged)
        for (int t = 0; t < G::kQueries; ++t) staged[t] = s.stage.data() + t * dv;
    for (int i = 0; i < count; ++i) {
        T* const* rows = writes == OutputWrites::Staged ? staged : blocks[i].out;
        flash_finish(blocks[i], state[i], s.ot[i].data(), dv, rows, writes == OutputWrites::Streaming, row_tiles[i]);
        on_block(i, rows);
        if (writes == OutputWrites::Staged) {
            for (int t = 0; t < blocks[i].count; ++t) stream_row(blocks[i].out[t], rows[t], dv);
            simd::stream_fence();
        }
    }
}

}  // namespace kernel
GATTN_END_ISA_NAMESPACE
