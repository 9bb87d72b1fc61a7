// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The few xsimd calls whose names changed between xsimd 8.1 (Debian bookworm) and later
/// releases (this is the only file that tests XSIMD_VERSION_MAJOR), the fused multiply-adds
/// xsimd 8.1 lacks on AVX-512 (plain and masked), a correctly rounded float division on ARM64
/// (div), the bit cast and constant shifts that xsimd 8.1 does not inline on ARM64 (bits_as,
/// shift_left, shift_right), the compiler's prefetch hint, and a barrier against FMA contraction (opaque).

#include <Eigen/Core>
#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "gattn/config.hpp"

GATTN_BEGIN_ISA_NAMESPACE
namespace simd {

/// Instruction set the SIMD kernels of this translation unit use.
using Arch = xsimd::default_arch;

/// SIMD register of T for Arch.
template <class T>
using Batch = xsimd::batch<T, Arch>;

/// Lanes in one register of T.
template <class T>
inline constexpr std::size_t kLanes = Batch<T>::size;

/// Sum of the lanes (xsimd ≥ 9 calls it reduce_add, 8.1 hadd).
template <class T>
inline T reduce_sum(const Batch<T>& x) noexcept {
#if XSIMD_VERSION_MAJOR >= 9
    return xsimd::reduce_add(x);
#else
    return xsimd::hadd(x);
#endif
}

/// Largest lane (xsimd 8.1 has no reduce_max). NaN lanes are ignored, as std::max would.
template <class T>
inline T reduce_max(const Batch<T>& x) noexcept {
#if XSIMD_VERSION_MAJOR >= 9
    return xsimd::reduce_max(x);
#else
    alignas(64) T lanes[kLanes<T>];
    x.store_aligned(lanes);
    T m = lanes[0];
    for (std::size_t i = 1; i < kLanes<T>; ++i) m = std::max(m, lanes[i]);
    return m;
#endif
}

GATTN_EIGEN_PACKETS_BEGIN

/// Register whose lane i is the sum of rows[i] (rows has kLanes<T> registers): the rows
/// transposed in registers (Eigen's packet transpose, when Eigen's packet is this register)
/// and added pairwise; otherwise lane by lane. Not xsimd::haddp, whose AVX-512 float version
/// in xsimd 8.1 permutes the lanes.
template <class T>
inline Batch<T> reduce_sum_rows(const Batch<T>* rows) noexcept {
    constexpr std::size_t L = kLanes<T>;
    using Packet = typename Eigen::internal::packet_traits<T>::type;
    using Register = typename Batch<T>::register_type;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<Register, __m512>) {
        // Butterfly in registers (45 shuffles and adds, against a 16 × 16 transpose and 15
        // adds): each stage adds two halves of pairs of registers, first within 128-bit lanes,
        // then across them, halving the registers until lane i holds the sum of rows[i].
        __m512 a[8], b[4], c[2];
        for (int j = 0; j < 8; ++j) {
            const __m512 x = rows[2 * j], y = rows[2 * j + 1];
            a[j] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
        }
        for (int k = 0; k < 4; ++k)
            b[k] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
        for (int k = 0; k < 2; ++k)
            c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
        return Batch<T>(_mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1))));
    }
#endif
    if constexpr (std::is_same_v<Packet, Register> && Eigen::internal::unpacket_traits<Packet>::size == L) {
        Eigen::internal::PacketBlock<Packet, static_cast<int>(L)> tile;
        for (std::size_t i = 0; i < L; ++i) tile.packet[i] = static_cast<Register>(rows[i]);
        Eigen::internal::ptranspose(tile);
        Batch<T> sums[L];
        for (std::size_t i = 0; i < L; ++i) sums[i] = Batch<T>(tile.packet[i]);
        for (std::size_t step = 1; step < L; step *= 2)
            for (std::size_t i = 0; i + step < L; i += 2 * step) sums[i] += sums[i + step];
        return sums[0];
    } else {
        alignas(64) T sums[L];
        for (std::size_t i = 0; i < L; ++i) sums[i] = reduce_sum(rows[i]);
        return Batch<T>::load_aligned(sums);
    }
}

/// Stores Eigen packet v at p, which must be aligned to the packet's size, with a non-temporal
/// hint where x86 has one (streaming stores: the line goes to memory without first being read
/// for ownership, and is not kept in cache); elsewhere an ordinary aligned store. stream_fence()
/// orders such stores before later ones (before another thread reads the memory).
template <class T, class Packet>
inline void stream_store(T* p, const Packet& v) noexcept {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<Packet, __m512>) return _mm512_stream_ps(p, v);
    if constexpr (std::is_same_v<Packet, __m512d>) return _mm512_stream_pd(p, v);
#endif
#if defined(__AVX__)
    if constexpr (std::is_same_v<Packet, __m256>) return _mm256_stream_ps(p, v);
    if constexpr (std::is_same_v<Packet, __m256d>) return _mm256_stream_pd(p, v);
#endif
#if defined(__SSE2__)
    if constexpr (std::is_same_v<Packet, __m128>) return _mm_stream_ps(p, v);
    if constexpr (std::is_same_v<Packet, __m128d>) return _mm_stream_pd(p, v);
#endif
    Eigen::internal::pstore(p, v);
}

GATTN_EIGEN_PACKETS_END

/// Makes the calling thread's streaming stores (stream_store) visible before its later stores.
inline void stream_fence() noexcept {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/// a·b + c rounded once. xsimd 8.1 has no AVX-512 FMA: its 512-bit registers fall back to
/// a·b + c, which g++ contracts into an FMA and clang 14 does not (two roundings and twice the
/// instructions: prefill ran at 0.6× under clang). Here AVX-512 calls the instruction itself.
template <class T>
inline Batch<T> fma(const Batch<T>& a, const Batch<T>& b, const Batch<T>& c) noexcept {
#if defined(__AVX512F__)  // registers are 512-bit: Batch<float> holds a __m512
    if constexpr (std::is_same_v<T, float>) return Batch<T>(_mm512_fmadd_ps(a, b, c));
    if constexpr (std::is_same_v<T, double>) return Batch<T>(_mm512_fmadd_pd(a, b, c));
#endif
    return xsimd::fma(a, b, c);
}

/// a / b correctly rounded. xsimd 8.1 divides float registers on ARM64 by NEON's reciprocal
/// estimate refined by two Newton steps (up to 2 ulp off); there this is one FDIV, as on x86.
template <class T>
inline Batch<T> div(const Batch<T>& a, const Batch<T>& b) noexcept {
#if defined(__aarch64__) && XSIMD_VERSION_MAJOR < 9
    if constexpr (std::is_same_v<T, float>) return Batch<T>(vdivq_f32(a, b));
#endif
    return a / b;
}

/// The bits of integer register x as a register of T (xsimd::bitwise_cast). xsimd 8.1 on NEON
/// casts through a table of function pointers, which g++ left as calls in the kernels' exp;
/// on ARM64 this is the reinterpretation itself (no instruction).
template <class T, class IntBatch>
inline Batch<T> bits_as(const IntBatch& x) noexcept {
#if defined(__aarch64__) && XSIMD_VERSION_MAJOR < 9
    if constexpr (std::is_same_v<T, float> && std::is_same_v<typename IntBatch::value_type, std::int32_t>)
        return Batch<T>(vreinterpretq_f32_s32(x));
    if constexpr (std::is_same_v<T, double> && std::is_same_v<typename IntBatch::value_type, std::int64_t>)
        return Batch<T>(vreinterpretq_f64_s64(x));
#endif
    return xsimd::bitwise_cast<Batch<T>>(x);
}

/// Each lane of integer register x shifted left by the constant N. xsimd 8.1 on NEON shifts by
/// a run-time count, found by comparing it with every possible count; on ARM64 this is one SHL.
template <int N, class IntBatch>
inline IntBatch shift_left(const IntBatch& x) noexcept {
#if defined(__aarch64__) && XSIMD_VERSION_MAJOR < 9
    if constexpr (std::is_same_v<typename IntBatch::value_type, std::int32_t>) return IntBatch(vshlq_n_s32(x, N));
    if constexpr (std::is_same_v<typename IntBatch::value_type, std::int64_t>) return IntBatch(vshlq_n_s64(x, N));
#endif
    return x << N;
}

/// Each lane of integer register x shifted right (arithmetic) by the constant N: one SSHR on
/// ARM64, as shift_left.
template <int N, class IntBatch>
inline IntBatch shift_right(const IntBatch& x) noexcept {
#if defined(__aarch64__) && XSIMD_VERSION_MAJOR < 9
    if constexpr (std::is_same_v<typename IntBatch::value_type, std::int32_t>) return IntBatch(vshrq_n_s32(x, N));
    if constexpr (std::is_same_v<typename IntBatch::value_type, std::int64_t>) return IntBatch(vshrq_n_s64(x, N));
#endif
    return x >> N;
}

/// c − a·b rounded once: fma(−a, b, c) (negation is exact; compilers emit one vfnmadd).
template <class T>
inline Batch<T> fnma(const Batch<T>& a, const Batch<T>& b, const Batch<T>& c) noexcept {
    return simd::fma(-a, b, c);
}

/// select(skip, c, a·b + c) with a·b + c fused (one rounding). AVX-512: one masked FMA
/// (vfmadd…{k}); g++ compiles the select as an FMA, a blend and a move. Elsewhere: FMA and blend.
/// Same values on every path.
template <class T>
inline Batch<T> fma_unless(const xsimd::batch_bool<T, Arch>& skip, const Batch<T>& a, const Batch<T>& b,
                           const Batch<T>& c) noexcept {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>)
        return Batch<T>(_mm512_mask3_fmadd_ps(a, b, c, static_cast<__mmask16>(~static_cast<__mmask16>(skip))));
    if constexpr (std::is_same_v<T, double>)
        return Batch<T>(_mm512_mask3_fmadd_pd(a, b, c, static_cast<__mmask8>(~static_cast<__mmask8>(skip))));
#endif
    return xsimd::select(skip, c, simd::fma(a, b, c));
}

/// Returns x through an empty asm statement: the compiler no longer sees how x was computed,
/// so it cannot fuse a multiply that produced x with an add that uses it (FMA contraction,
/// which g++ does by default). An expression's result then does not depend on where it is
/// inlined or whether it runs in a loop or its tail. Emits no instruction. x86 and ARM64 with
/// g++ or clang; elsewhere it returns x unchanged.
template <class T>
inline Batch<T> opaque(const Batch<T>& x) noexcept {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
    typename Batch<T>::register_type r = x;
#if defined(__AVX512F__)
    asm("" : "+v"(r));
#else
    asm("" : "+x"(r));
#endif
    return Batch<T>(r);
#elif (defined(__GNUC__) || defined(__clang__)) && defined(__aarch64__)
    typename Batch<T>::register_type r = x;
    asm("" : "+w"(r));  // any FP/SIMD register
    return Batch<T>(r);
#else
    return x;
#endif
}

/// Elements of T in one 64-byte cache line.
template <class T>
inline constexpr std::size_t kLineElems = 64 / sizeof(T);

/// Asks for the cache line holding p to be brought into L1 (a hint: never faults, any address).
inline void prefetch(const void* p) noexcept {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p, 0, 3);
#else
    (void)p;
#endif
}

/// Name of the instruction set, for benchmark labels and diagnostics.
inline const char* arch_name() noexcept { return Arch::name(); }

}  // namespace simd
GATTN_END_ISA_NAMESPACE
