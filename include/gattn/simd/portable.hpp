// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The portable tier: what runs where no wider tier is compiled in (SSE2 and the other x86
/// builds without AVX2 + FMA, ARM64's NEON, other CPUs), through xsimd's code for the
/// translation unit's instruction set: the tile shapes for 16 registers of 128 bits, which the
/// tiers that do not set their own take, and what every x86-64 CPU has (SSE2: streaming
/// stores of 128-bit registers and their fence; the "x" register constraint of opaque).

#include <type_traits>

#include "gattn/config.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

GATTN_BEGIN_ISA_NAMESPACE
namespace simd {
namespace portable {

/// Tile geometry of the float flash kernel (kernel::FlashGeometry) on 16 registers.
struct FlashTiles {
    static constexpr int kCols = 2;
    static constexpr int kRows = 6;  // 6 × 2 = 12 accumulators of 16 registers
    static constexpr int kMaskedRows = kRows;
    static constexpr int kDecodePairs = 2;  // a quarter of a block's 8 float queries (SSE2, NEON)
    // Few-query blocks keep the query lanes (kernel::runs_row_tiles): with 4 queries a KV head
    // the two ran equally fast (SSE2, Zen 5).
    static constexpr bool kRowTiles = false;
    static constexpr int kRowValueRows = kRows, kRowValueCols = kCols;  // unused: no row tiles
    static constexpr int kRowKeyRows = 0;                               // unused: no row tiles
};

/// Decoding (kernel::decode_chunk): query rows that share each K and V register load, and the
/// value sum's accumulator registers.
struct DecodeTiles {
    static constexpr int kRows = 2, kValueRegisters = 8;
    // Multi-head decoding's value sums with a constant count of registers per head (see the
    // AVX-512 tier): 0.90–0.93 of the loop's speed in an AVX2 build on AMD Zen 4.
    static constexpr bool kConstantValueWidth = false;
    // Multi-head decoding leading whole rows (see the AVX-512 tier): 1.01–1.08× the time of
    // the first-lines lead in an AVX2 build on AMD Zen 4, with the lines asked for at once or
    // spread over the heads, one in every 2, 4 or 8 (docs/benchmarks.md).
    static constexpr bool kLeadWholeRow = false;
};

#if defined(__SSE2__)
inline constexpr bool kSse2 = true;  ///< built for x86 with SSE2 (every x86-64 CPU)

/// Stores register v (4 floats or 2 doubles, as T) at p, aligned to 16 bytes, with a
/// non-temporal hint.
template <class T, class Packet>
inline void stream_store(T* p, const Packet& v) noexcept {
    if constexpr (std::is_same_v<T, float>)
        _mm_stream_ps(p, v);
    else
        _mm_stream_pd(p, v);
}

/// Orders the calling thread's streaming stores before its later stores (sfence).
inline void stream_fence() noexcept { _mm_sfence(); }

/// An empty asm statement that hides how register r was computed (simd::opaque): "x" takes
/// an xmm/ymm register.
template <class R>
inline void hide(R& r) noexcept {
    asm("" : "+x"(r));
}
#else
inline constexpr bool kSse2 = false;
template <class T, class Packet>
void stream_store(T* p, const Packet& v) noexcept;
inline void stream_fence() noexcept {}
template <class R>
void hide(R& r) noexcept;
#endif

}  // namespace portable
}  // namespace simd
GATTN_END_ISA_NAMESPACE
