// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// x86 AVX-512 (F, BW, DQ) tier: 32 registers of 512 bits. The float flash kernel's tile shape
/// for them (FlashTiles), the decoding kernel's rows per K and V load (DecodeTiles), the
/// narrow KV-cache values widened to float as they load: int8 codes (VPMOVSXBD, VCVTDQ2PS),
/// bf16 (a 16-bit shift) and fp16 (VCVTPH2PS), and the register operations that xsimd 8.1
/// lacks or does slowly on 512-bit registers, which simd/compat.hpp and simd/math.hpp call:
/// fused and masked multiply-adds, the row-sum butterfly, streaming stores, and vscalefps,
/// vreduceps and vrcp14ps for exp and sigmoid. The rest of the float arithmetic is xsimd's
/// AVX-512 code. Compiled in where the translation unit is built with -mavx512f (kEnabled;
/// vreduceps needs -mavx512dq, kDq); elsewhere the functions are only declared, for callers
/// that name them in `if constexpr` branches they never instantiate.

#include <cstdint>
#include <type_traits>

#include "gattn/config.hpp"
#include "gattn/types.hpp"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

GATTN_BEGIN_ISA_NAMESPACE
namespace simd {
namespace avx512 {

#if defined(__AVX512F__)
inline constexpr bool kEnabled = true;  ///< built with AVX-512F
#else
inline constexpr bool kEnabled = false;
#endif

/// Tile geometry of the float flash kernel (kernel::FlashGeometry) on 32 registers.
struct FlashTiles {
    static constexpr int kCols = 4;            // registers of queries per tile row
    static constexpr int kRows = 6;            // 6 × 4 = 24 accumulators of 32 registers
    static constexpr int kMaskedRows = kRows;  // masked FMAs take a mask register (k0–k7)
    // Pairs of a KV head up to which several query rows decode (keys in lanes) rather than run
    // tiles of one query register: 16 pairs (a cascade's prefix rows, 16 on 8 KV heads, d = 128,
    // 1 thread, Zen 5) ran 1.4× faster at 512 keys and 1.7× at 2048 as a tile, 12 pairs 1.1×;
    // 8 pairs ran 1.3× faster decoding.
    static constexpr int kDecodePairs = 8;
    // Few-query blocks (kernel::runs_row_tiles) with the rows of queries broadcast and the keys
    // or the value features in the lanes: 16 queries a KV head, d = 128, 2048 keys, 1 thread,
    // Zen 5: 1.15–1.25× the query-lane tiles on 8 KV heads, 1.4–1.5× on one (the same bits).
    static constexpr bool kRowTiles = true;
    // Their P·V tiles (kernel::flash_row_step): 8 rows × 2 registers. At 16 rows, d = 128, Bc =
    // 64, Zen 4, both products from L1/L2: 6 × 4 tiles 92 GFLOP/s, 8 × 2 for P·V 100 (each V
    // row is read by two row blocks instead of three), 16 × 1 96; 8 × 2 for S as well 98.
    static constexpr int kRowValueRows = 8, kRowValueCols = 2;
    // Their Sᵀ tiles (kernel::row_block_scores): 24 keys × one register of queries from the K
    // rows, each multiply-add taking its K element as an embedded broadcast (a Bc of 64 keys runs
    // 24 + 24 + 16), instead of S from a transposed K block and its transpose into Sᵀ. 16 rows on
    // 8 KV heads, d = 128, pages of 64, 1 thread, Zen 4, upper quartiles of 11 alternated rounds
    // (neighbours' load spread the rest): 2k keys 65 → 72 GFLOP/s, 8k 63 → 75, 32k 62 → 77;
    // 16 keys a tile 73, 72, 71. The same bits.
    static constexpr int kRowKeyRows = 24;
};

/// Decoding (kernel::decode_chunk): query rows that share each K and V register load, and the
/// value sum's accumulator registers.
struct DecodeTiles {
    static constexpr int kRows = 4, kValueRegisters = 16;
    // Multi-head decoding's value sums (kernel::values_in_address_order) with a constant count of
    // registers per head (d_v = 64, 128, 256), unrolled: 8 heads on 8, one thread, AMD Zen 4,
    // from memory, seven alternated rounds, medians: d = 128 1.11× at 8k keys, 1.18× at 32k;
    // d = 256 1.05×, d = 64 1.00×.
    static constexpr bool kConstantValueWidth = true;
    // Multi-head decoding from memory leads the whole row ahead, a line in every four
    // (kernel::lead_slice), not its first four lines: 8 heads on 8, d = 128, AMD Zen 4,
    // bench_revisions, six series of pairs in 4 KiB pages, either revision first, new / old
    // time 0.94–0.97 at 8k keys and 0.92–0.95 at 32k; 0.94 and 0.90 on two threads.
    static constexpr bool kLeadWholeRow = true;
};

#if defined(__AVX512DQ__)
inline constexpr bool kDq = true;  ///< built with AVX-512DQ (vreduceps)
#else
inline constexpr bool kDq = false;
#endif

#if defined(__AVX512F__)
/// a·b + c rounded once (vfmadd), for registers B of 16 floats or 8 doubles: xsimd 8.1 has no
/// AVX-512 FMA (its a·b + c is contracted by g++ but not by clang 14).
template <class B>
inline B fma(const B& a, const B& b, const B& c) noexcept {
    if constexpr (std::is_same_v<typename B::value_type, float>)
        return B(_mm512_fmadd_ps(a, b, c));
    else
        return B(_mm512_fmadd_pd(a, b, c));
}

/// c where skip is set, else a·b + c rounded once: one masked FMA (vfmadd…{k}).
template <class B, class Mask>
inline B fma_unless(const Mask& skip, const B& a, const B& b, const B& c) noexcept {
    if constexpr (std::is_same_v<typename B::value_type, float>)
        return B(_mm512_mask3_fmadd_ps(a, b, c, static_cast<__mmask16>(~static_cast<__mmask16>(skip))));
    else
        return B(_mm512_mask3_fmadd_pd(a, b, c, static_cast<__mmask8>(~static_cast<__mmask8>(skip))));
}

/// Register of 16 floats whose lane i is the sum of rows[i] (16 registers): a butterfly in
/// registers (45 shuffles and adds, against a 16 × 16 transpose and 15 adds); each stage adds
/// two halves of pairs of registers, first within 128-bit lanes, then across them, halving the
/// registers until lane i holds the sum of rows[i].
template <class B>
inline B reduce_sum_rows(const B* rows) noexcept {
    __m512 a[8], b[4], c[2];
    GATTN_UNROLL
    for (int j = 0; j < 8; ++j) {
        const __m512 x = rows[2 * j], y = rows[2 * j + 1];
        a[j] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    GATTN_UNROLL
    for (int k = 0; k < 4; ++k)
        b[k] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    GATTN_UNROLL
    for (int k = 0; k < 2; ++k)
        c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return B(_mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1))));
}

/// Stores register v (16 floats or 8 doubles, as T) at p, aligned to 64 bytes, with a
/// non-temporal hint.
template <class T, class Packet>
inline void stream_store(T* p, const Packet& v) noexcept {
    if constexpr (std::is_same_v<T, float>)
        _mm512_stream_ps(p, v);
    else
        _mm512_stream_pd(p, v);
}

/// p·2^⌊n⌋ in one instruction (vscalefps; 0 for n = −∞), 16 floats.
template <class B>
inline B scalef(const B& p, const B& n) noexcept {
    return B(_mm512_scalef_ps(p, n));
}

/// x − ⌊x⌋ in [0, 1) (vreduceps, round down, exceptions suppressed; AVX-512DQ): ±∞ gives 0,
/// NaN stays NaN. 16 floats.
template <class B>
inline B floor_fraction(const B& x) noexcept {
    return B(_mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
}

/// p·2^⌊n⌋ where x ≥ lo, 0 where x < lo (NaN in x compares unordered: kept), in one
/// instruction (vscalefps with a zeroing mask). 16 floats.
template <class B>
inline B scalef_unless_below(const B& x, const B& lo, const B& p, const B& n) noexcept {
    return B(_mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ), p, n));
}

/// 1/d where x ≥ lo, 0 where x < lo (NaN in x: kept): vrcp14ps refined by one Newton step
/// (2^−28 before rounding), not a division, the step's FMA with a zeroing mask. 16 floats.
template <class B>
inline B reciprocal_unless_below(const B& x, const B& lo, const B& d) noexcept {
    const __m512 r0 = _mm512_rcp14_ps(d);
    const __m512 residual = _mm512_fnmadd_ps(d, r0, _mm512_set1_ps(1.0f));  // 1 − d·r0
    return B(_mm512_maskz_fmadd_ps(_mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ), r0, residual, r0));
}

/// An empty asm statement that hides how register r was computed (simd::opaque): "v" takes
/// any of the 32 vector registers.
template <class R>
inline void hide(R& r) noexcept {
    asm("" : "+v"(r));
}

/// Sixteen float lanes (B: a 16-float register) from sixteen int8 codes, bf16 or fp16 values
/// at p, exactly.
template <class B, class KV>
inline B widen(const KV* p) noexcept {
    if constexpr (std::is_same_v<KV, std::int8_t>) {
        return B(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
    } else {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        if constexpr (std::is_same_v<KV, bfloat16>)
            return B(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        else
            return B(_mm512_cvtph_ps(h));
    }
}
#else
template <class B>
B fma(const B& a, const B& b, const B& c) noexcept;
template <class B, class Mask>
B fma_unless(const Mask& skip, const B& a, const B& b, const B& c) noexcept;
template <class B>
B reduce_sum_rows(const B* rows) noexcept;
template <class T, class Packet>
void stream_store(T* p, const Packet& v) noexcept;
template <class B>
B scalef(const B& p, const B& n) noexcept;
template <class B>
B floor_fraction(const B& x) noexcept;
template <class B>
B scalef_unless_below(const B& x, const B& lo, const B& p, const B& n) noexcept;
template <class B>
B reciprocal_unless_below(const B& x, const B& lo, const B& d) noexcept;
template <class R>
void hide(R& r) noexcept;
template <class B, class KV>
B widen(const KV* p) noexcept;
#endif

}  // namespace avx512
}  // namespace simd
GATTN_END_ISA_NAMESPACE
