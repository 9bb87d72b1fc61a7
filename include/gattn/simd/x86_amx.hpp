// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// x86 AMX tier (AMX-TILE and AMX-BF16, on top of AVX512-BF16): TDPBF16PS, a 16 × 16 float
/// tile += a 16-row bf16 tile times 16 rows of bf16 pairs. Holds the tile code of the bf16
/// prefill kernel (kernel::bf16::amx, driven by ops/bf16_flash_kernel.hpp) and of PackedLinear's
/// bf16 product (detail::linear_amx_*, driven by ops/packed_linear.hpp). Compiled in where
/// the translation unit is built with -mamx-tile -mamx-bf16 and AVX512-BF16 (kEnabled);
/// elsewhere its functions are only declared, for drivers that name them in `if constexpr`
/// branches they never instantiate. The operating system must allow the tile state first
/// (simd/cpu.hpp asks for it).

#include <cstdint>

#include "gattn/config.hpp"
#include "gattn/simd/x86_avx512bf16.hpp"
#include "gattn/types.hpp"

#if defined(GATTN_HAS_AVX512BF16_KERNEL) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#define GATTN_HAS_AMX_KERNEL 1
#endif

GATTN_BEGIN_ISA_NAMESPACE
namespace simd {
namespace amx {
#if defined(GATTN_HAS_AMX_KERNEL)
inline constexpr bool kEnabled = true;  ///< built with AMX-TILE, AMX-BF16 and AVX512-BF16
#else
inline constexpr bool kEnabled = false;
#endif
}  // namespace amx
}  // namespace simd

namespace kernel {
namespace bf16 {

/// The AMX parts of the kernel: both products on the tile unit (TDPBF16PS: a 16 × 16 float tile
/// += a 16-row bf16 tile times 16 rows of bf16 pairs), everything else as the AVX512-BF16
/// kernel's (simd/x86_avx512bf16.hpp). Every tile is
/// 16 rows × 64 bytes (palette 1); the operands are the AVX512-BF16 kernel's own buffers and
/// the key rows where they lie.
namespace amx {

constexpr int kTileRows = 16;

#if defined(GATTN_HAS_AMX_KERNEL)
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
    GATTN_UNROLL
    for (int q = 0; q < C; ++q) rescale = rescale || xsimd::any(alpha[q] != B(1.0f));
    if (rescale)
        for (Index j = 0; j < dv; ++j) {
            GATTN_UNROLL
            for (int q = 0; q < C; ++q)
                (B::load_aligned(ot + j * W + q * L) * alpha[q]).store_aligned(ot + j * W + q * L);
        }
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
#else
/// Configures this thread's tiles for its lifetime (declared only: no AMX in this build).
struct Tiles {
    Tiles() noexcept;
    ~Tiles();
    Tiles(const Tiles&) = delete;
    Tiles& operator=(const Tiles&) = delete;
};
void scores(const bfloat16* key, Index key_stride, const std::uint32_t* qp, Index dk, float* st, Index nk) noexcept;
void values(const std::uint32_t* vt, const std::uint32_t* pt, const B* alpha, float* ot, Index dv) noexcept;
#endif  // GATTN_HAS_AMX_KERNEL

}  // namespace amx
}  // namespace bf16
}  // namespace kernel

/// PackedLinear's (ops/packed_linear.hpp) AMX kernel: x rounded to bf16 pairs in tiles of
/// kAmxRows rows, times weights packed as B tiles (amx_panel_offset).
namespace detail {

/// Pairs of inputs per AMX k step: a bf16 tile row is 64 bytes, 16 pairs.
inline constexpr Index kAmxPairs = 16;
/// uint32 pairs per packed B tile: 16 pair rows × 16 outputs, 1 KiB.
inline constexpr Index kAmxTile = kAmxPairs * 16;
/// Offset in an AMX panel of kblocks k steps of pair p of the panel's output j: the panel's 4
/// groups of 16 outputs one after the other, each its B tiles of k steps 0, 1, 2, ...
constexpr Index amx_panel_offset(Index p, Index j, Index kblocks) noexcept {
    return (j / 16) * kblocks * kAmxTile + (p / kAmxPairs) * kAmxTile + (p % kAmxPairs) * 16 + j % 16;
}

/// Rows of x per AMX tile.
inline constexpr Index kAmxRows = 16;

#if defined(GATTN_HAS_AMX_KERNEL)
/// k steps ahead that the AMX kernel prefetches its tiles' lines into L1: tile loads that miss
/// L1 stall (2048 → 4608, one thread: 1.5–2× as fast at 16 and 64 rows, up to 1.4× at 2048).
inline constexpr Index kAmxPrefetchSteps = 2;

/// PackedLinear's tiles, rows of 64 bytes: C in 0–3 (16 rows × 16 floats), then A (16 rows ×
/// 16 x pairs) and B (16 pair rows × 16 outputs) in 4–7 (linear_amx_block: A in 4–5, B in 6–7;
/// linear_amx_row_tile: A in 4, B in 5–7). Configured for this thread while it lives and
/// released after; with rows < 16 (a call of fewer rows), C and A hold only those rows.
class LinearAmxTiles {
public:
    explicit LinearAmxTiles(Index rows) noexcept {
        kernel::bf16::amx::TileConfig config;
        if (rows < kAmxRows) {
            GATTN_UNROLL
            for (int t = 0; t < 5; ++t) config.rows[t] = static_cast<std::uint8_t>(rows);
        }
        _tile_loadconfig(&config);
    }
    ~LinearAmxTiles() { _tile_release(); }
    LinearAmxTiles(const LinearAmxTiles&) = delete;
    LinearAmxTiles& operator=(const LinearAmxTiles&) = delete;
};

/// Prefetches `lines` cache lines, `stride` uint32 apart, from p into L1.
inline void linear_amx_prefetch(const std::uint32_t* p, Index stride, int lines) noexcept {
    for (int i = 0; i < lines; ++i) _mm_prefetch(reinterpret_cast<const char*>(p + i * stride), _MM_HINT_T0);
}

/// Two row tiles × two column tiles: c[32][32] (row stride 32 floats) = Σ over kblocks blocks
/// of 16 pairs, in order, of TDPBF16PS products of x pairs at a (32 rows, row stride lda
/// pairs) and 32 outputs of a panel: the tiles of outputs 0–15 at b and of outputs 16–31 at
/// b + kblocks · kAmxTile, one per k step. Needs the tiles configured on this thread for 16
/// rows (LinearAmxTiles).
inline void linear_amx_block(const std::uint32_t* a, Index lda, const std::uint32_t* b, Index kblocks,
                             float* c) noexcept {
    constexpr int kStrideB = 16 * sizeof(std::uint32_t), kStrideC = 32 * sizeof(float);
    const int stride_a = static_cast<int>(lda * static_cast<Index>(sizeof(std::uint32_t)));
    const std::uint32_t* a1 = a + kAmxRows * lda;
    const std::uint32_t* b1 = b + kblocks * kAmxTile;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (Index k = 0; k < kblocks; ++k) {
        if (k + kAmxPrefetchSteps < kblocks) {
            const Index ahead = (k + kAmxPrefetchSteps) * kAmxTile;
            linear_amx_prefetch(b + ahead, 16, 16);
            linear_amx_prefetch(b1 + ahead, 16, 16);
            linear_amx_prefetch(a + (k + kAmxPrefetchSteps) * kAmxPairs, lda, 2 * kAmxRows);
        }
        kernel::bf16::amx::dot_2x2(a + k * kAmxPairs, a1 + k * kAmxPairs, stride_a, b + k * kAmxTile, b1 + k * kAmxTile,
                                   kStrideB, true);
    }
    kernel::bf16::amx::store_2x2(c, 16 * 32, kStrideC, true);
}

/// One row tile × a whole panel: c[16][64] (row stride 64 floats; as many rows as the tiles
/// are configured with) = Σ over kblocks blocks of 16 pairs, in order, of TDPBF16PS products
/// of x pairs at a (row stride lda pairs) and the panel at b, read once as 4 sequential
/// streams, one per group of 16 outputs (for few rows, when the weights stream from memory).
/// Each output sees the same products in the same order as in linear_amx_block. Needs the
/// tiles configured on this thread (LinearAmxTiles).
inline void linear_amx_row_tile(const std::uint32_t* a, Index lda, const std::uint32_t* b, Index kblocks,
                                float* c) noexcept {
    constexpr int kStrideB = 16 * sizeof(std::uint32_t), kStrideC = 64 * sizeof(float);
    const int stride_a = static_cast<int>(lda * static_cast<Index>(sizeof(std::uint32_t)));
    const Index stream = kblocks * kAmxTile;  // one group of 16 outputs
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (Index k = 0; k < kblocks; ++k) {
        const std::uint32_t* bk = b + k * kAmxTile;
        if (k + kAmxPrefetchSteps < kblocks) {
            GATTN_UNROLL
            for (int t = 0; t < 4; ++t) linear_amx_prefetch(bk + t * stream + kAmxPrefetchSteps * kAmxTile, 16, 16);
        }
        _tile_loadd(4, a + k * kAmxPairs, stride_a);
        _tile_loadd(5, bk, kStrideB);
        _tile_loadd(6, bk + stream, kStrideB);
        _tile_loadd(7, bk + 2 * stream, kStrideB);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, bk + 3 * stream, kStrideB);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, c, kStrideC);
    _tile_stored(1, c + 16, kStrideC);
    _tile_stored(2, c + 32, kStrideC);
    _tile_stored(3, c + 48, kStrideC);
}

/// out[r][j] = c[r][j] + bias[j] for r < rows, j < n (c: row stride ldc floats, 64-byte aligned
/// rows; n ≤ ldc).
inline void linear_amx_store(const float* c, Index ldc, Index rows, const float* bias, float* out, Index out_stride,
                             Index n) noexcept {
    for (Index j = 0; j < n; j += 16) {
        const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1u);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + j) : _mm512_setzero_ps();
        for (Index r = 0; r < rows; ++r)
            _mm512_mask_storeu_ps(out + r * out_stride + j, m, _mm512_add_ps(_mm512_load_ps(c + r * ldc + j), b));
    }
}
#else
/// PackedLinear's tiles (declared only: no AMX in this build).
class LinearAmxTiles {
public:
    explicit LinearAmxTiles(Index rows) noexcept;
    ~LinearAmxTiles();
    LinearAmxTiles(const LinearAmxTiles&) = delete;
    LinearAmxTiles& operator=(const LinearAmxTiles&) = delete;
};
void linear_amx_block(const std::uint32_t* a, Index lda, const std::uint32_t* b, Index kblocks, float* c) noexcept;
void linear_amx_row_tile(const std::uint32_t* a, Index lda, const std::uint32_t* b, Index kblocks, float* c) noexcept;
void linear_amx_store(const float* c, Index ldc, Index rows, const float* bias, float* out, Index out_stride,
                      Index n) noexcept;
#endif  // GATTN_HAS_AMX_KERNEL

}  // namespace detail
GATTN_END_ISA_NAMESPACE
