// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The few xsimd calls whose names changed between xsimd 8.1 (Debian bookworm) and later
/// releases (this is the only file that tests XSIMD_VERSION_MAJOR), the fused multiply-adds
/// xsimd 8.1 lacks on AVX-512 (plain and masked), a correctly rounded float division on ARM64
/// (div), the bit cast and constant shifts that xsimd 8.1 does not inline on ARM64 (bits_as,
/// shift_left, shift_right), the compiler's prefetch hint, and a barrier against FMA contraction (opaque).
/// Where a tier has an instruction for one of them, the tier's header holds it
/// (simd/x86_avx512.hpp, simd/x86_avx2.hpp, simd/portable.hpp, simd/arm_neon.hpp) and this file
/// calls it in an `if constexpr` branch: no instruction-set `#if` here.

#include <Eigen/Core>
#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "gattn/config.hpp"
#include "gattn/simd/arm_neon.hpp"
#include "gattn/simd/portable.hpp"
#include "gattn/simd/x86_avx2.hpp"
#include "gattn/simd/x86_avx512.hpp"

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

/// Whether xsimd is 8.x, whose ARM64 division, bit casts and constant shifts the NEON tier
/// replaces (div, bits_as, shift_left, shift_right).
inline constexpr bool kXsimd8 = XSIMD_VERSION_MAJOR < 9;

/// Whether T is float or double.
template <class T>
inline constexpr bool kFloating = std::is_same_v<T, float> || std::is_same_v<T, double>;

/// Whether integer register IntBatch has 32- or 64-bit signed lanes.
template <class IntBatch>
inline constexpr bool kIntLanes = std::is_same_v<typename IntBatch::value_type, std::int32_t> ||
                                  std::is_same_v<typename IntBatch::value_type, std::int64_t>;

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
    if constexpr (avx512::kEnabled && std::is_same_v<T, float> && L == 16) return avx512::reduce_sum_rows(rows);
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
    // Registers of floats or doubles (Eigen's packet of T): by their width.
    if constexpr (kFloating<T> && avx512::kEnabled && sizeof(Packet) == 64)
        avx512::stream_store(p, v);
    else if constexpr (kFloating<T> && avx2::kAvx && sizeof(Packet) == 32)
        avx2::stream_store(p, v);
    else if constexpr (kFloating<T> && portable::kSse2 && sizeof(Packet) == 16)
        portable::stream_store(p, v);
    else
        Eigen::internal::pstore(p, v);
}

GATTN_EIGEN_PACKETS_END

/// Makes the calling thread's streaming stores (stream_store) visible before its later stores.
inline void stream_fence() noexcept { portable::stream_fence(); }

/// a·b + c rounded once. xsimd 8.1 has no AVX-512 FMA: its 512-bit registers fall back to
/// a·b + c, which g++ contracts into an FMA and clang 14 does not (two roundings and twice the
/// instructions: prefill ran at 0.6× under clang). Here AVX-512 calls the instruction itself.
template <class T>
inline Batch<T> fma(const Batch<T>& a, const Batch<T>& b, const Batch<T>& c) noexcept {
    if constexpr (avx512::kEnabled && kFloating<T>)  // registers are 512-bit: Batch<float> holds a __m512
        return avx512::fma(a, b, c);
    else
        return xsimd::fma(a, b, c);
}

/// a / b correctly rounded. xsimd 8.1 divides float registers on ARM64 by NEON's reciprocal
/// estimate refined by two Newton steps (up to 2 ulp off); there this is one FDIV, as on x86.
template <class T>
inline Batch<T> div(const Batch<T>& a, const Batch<T>& b) noexcept {
    if constexpr (neon::kEnabled && kXsimd8 && std::is_same_v<T, float>)
        return neon::div(a, b);
    else
        return a / b;
}

/// The bits of integer register x as a register of T (xsimd::bitwise_cast). xsimd 8.1 on NEON
/// casts through a table of function pointers, which g++ left as calls in the kernels' exp;
/// on ARM64 this is the reinterpretation itself (no instruction).
template <class T, class IntBatch>
inline Batch<T> bits_as(const IntBatch& x) noexcept {
    if constexpr (neon::kEnabled && kXsimd8 && kIntLanes<IntBatch> &&
                  sizeof(T) == sizeof(typename IntBatch::value_type))
        return neon::bits_as<Batch<T>>(x);
    else
        return xsimd::bitwise_cast<Batch<T>>(x);
}

/// Each lane of integer register x shifted left by the constant N. xsimd 8.1 on NEON shifts by
/// a run-time count, found by comparing it with every possible count; on ARM64 this is one SHL.
template <int N, class IntBatch>
inline IntBatch shift_left(const IntBatch& x) noexcept {
    if constexpr (neon::kEnabled && kXsimd8 && kIntLanes<IntBatch>)
        return neon::shift_left<N>(x);
    else
        return x << N;
}

/// Each lane of integer register x shifted right (arithmetic) by the constant N: one SSHR on
/// ARM64, as shift_left.
template <int N, class IntBatch>
inline IntBatch shift_right(const IntBatch& x) noexcept {
    if constexpr (neon::kEnabled && kXsimd8 && kIntLanes<IntBatch>)
        return neon::shift_right<N>(x);
    else
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
    if constexpr (avx512::kEnabled && kFloating<T>)
        return avx512::fma_unless(skip, a, b, c);
    else
        return xsimd::select(skip, c, simd::fma(a, b, c));
}

/// Returns x through an empty asm statement: the compiler no longer sees how x was computed,
/// so it cannot fuse a multiply that produced x with an add that uses it (FMA contraction,
/// which g++ does by default). An expression's result then does not depend on where it is
/// inlined or whether it runs in a loop or its tail. Emits no instruction. x86 and ARM64 with
/// g++ or clang; elsewhere it returns x unchanged.
template <class T>
inline Batch<T> opaque(const Batch<T>& x) noexcept {
    typename Batch<T>::register_type r = x;
    if constexpr (avx512::kEnabled)
        avx512::hide(r);
    else if constexpr (portable::kSse2)
        portable::hide(r);
    else if constexpr (neon::kEnabled)
        neon::hide(r);
    return Batch<T>(r);
}

/// Elements of T in one 64-byte cache line.
template <class T>
inline constexpr std::size_t kLineElems = 64 / sizeof(T);

/// Asks for the cache line holding p to be brought toward the core with the given temporal
/// locality (3: into L1, 1: the outer caches; a hint: never faults, any address).
/// Always inlined, as are its two callers below: GCC finds a function whose only statement is
/// __builtin_prefetch free of side effects, and deletes each call to it that its early inliner
/// left in place (GCC 12: every prefetch of a few-query block's next keys vanished so).
template <int Locality>
inline GATTN_ALWAYS_INLINE void prefetch_hint(const void* p) noexcept {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p, 0, Locality);
#else
    (void)p;
#endif
}

/// Asks for the cache line holding p to be brought into L1 (a hint: never faults, any address).
inline GATTN_ALWAYS_INLINE void prefetch(const void* p) noexcept { prefetch_hint<3>(p); }

/// Asks for the cache line holding p to be brought into the outer caches but not L1
/// (prefetcht2 on x86: L2 on AMD Zen, L2 or L3 on Intel; a hint: never faults, any address).
/// A burst of them does not wait for L1's few miss buffers, as a burst of prefetch() can.
inline GATTN_ALWAYS_INLINE void prefetch_outer(const void* p) noexcept { prefetch_hint<1>(p); }

/// Name of the instruction set, for benchmark labels and diagnostics.
inline const char* arch_name() noexcept { return Arch::name(); }

}  // namespace simd
GATTN_END_ISA_NAMESPACE
