// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// ARM64 NEON tier: the conversions the kernels' xsimd code has no instruction for, reading
/// narrow storage (bf16, fp16, int8 codes) into float registers exactly, and the register
/// operations that xsimd 8.1 leaves as calls or slow sequences on ARM64, which simd/compat.hpp
/// calls: division (FDIV), bit casts, constant shifts. Compiled in on ARM64 (kEnabled);
/// elsewhere the functions are only declared, for callers that name them in `if constexpr`
/// branches they never instantiate. The tile shapes are the portable tier's.
///
/// The float arithmetic itself is xsimd's NEON (neon64: 128-bit registers, FMLA); this header
/// adds only the widening loads, each a few instructions: bf16 is the top half of a float
/// (USHLL #16), fp16 widens with FCVTL (ARMv8.0, no FP16 arithmetic needed), int8 codes
/// with SXTL, SXTL and SCVTF. Loads are unaligned.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gattn/config.hpp"
#include "gattn/types.hpp"

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define GATTN_HAS_NEON 1
#endif

GATTN_BEGIN_ISA_NAMESPACE
namespace simd {
namespace neon {

#if defined(GATTN_HAS_NEON)
inline constexpr bool kEnabled = true;  ///< built for ARM64 with NEON
#else
inline constexpr bool kEnabled = false;
#endif

#if defined(GATTN_HAS_NEON)

/// Four float lanes from four int8 codes at p, exactly.
inline float32x4_t widen4(const std::int8_t* p) noexcept {
    std::uint32_t bytes;
    std::memcpy(&bytes, p, 4);
    const int16x8_t h = vmovl_s8(vcreate_s8(bytes));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
}

/// Four float lanes from four bf16 values at p, exactly.
inline float32x4_t widen4(const bfloat16* p) noexcept {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const std::uint16_t*>(p)), 16));
}

/// Four float lanes from four fp16 values at p, exactly.
inline float32x4_t widen4(const half* p) noexcept {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const std::uint16_t*>(p))));
}

/// dst[i] = float(src[i]) for i < n, exactly: eight lanes at a time, then four, then one.
inline void widen_row(const half* src, float* dst, std::ptrdiff_t n) noexcept {
    std::ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const uint16x8_t h = vld1q_u16(reinterpret_cast<const std::uint16_t*>(src + i));
        vst1q_f32(dst + i, vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h))));
        vst1q_f32(dst + i + 4, vcvt_high_f32_f16(vreinterpretq_f16_u16(h)));
    }
    for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, widen4(src + i));
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

/// Four float lanes (B: a 4-float register) from four int8 codes, bf16 or fp16 values at p,
/// exactly (widen4).
template <class B, class KV>
inline B widen(const KV* p) noexcept {
    return B(widen4(p));
}

/// a / b for registers B of 4 floats, correctly rounded: one FDIV.
template <class B>
inline B div(const B& a, const B& b) noexcept {
    return B(vdivq_f32(a, b));
}

/// The bits of integer register x (4 int32 or 2 int64 lanes) as a register B of floats or
/// doubles: a reinterpretation, no instruction.
template <class B, class IntBatch>
inline B bits_as(const IntBatch& x) noexcept {
    if constexpr (std::is_same_v<typename IntBatch::value_type, std::int32_t>)
        return B(vreinterpretq_f32_s32(x));
    else
        return B(vreinterpretq_f64_s64(x));
}

/// Each lane of integer register x (int32 or int64) shifted left by the constant N: one SHL.
template <int N, class IntBatch>
inline IntBatch shift_left(const IntBatch& x) noexcept {
    if constexpr (std::is_same_v<typename IntBatch::value_type, std::int32_t>)
        return IntBatch(vshlq_n_s32(x, N));
    else
        return IntBatch(vshlq_n_s64(x, N));
}

/// Each lane of integer register x (int32 or int64) shifted right (arithmetic) by the constant
/// N: one SSHR.
template <int N, class IntBatch>
inline IntBatch shift_right(const IntBatch& x) noexcept {
    if constexpr (std::is_same_v<typename IntBatch::value_type, std::int32_t>)
        return IntBatch(vshrq_n_s32(x, N));
    else
        return IntBatch(vshrq_n_s64(x, N));
}

/// An empty asm statement that hides how register r was computed (simd::opaque): "w" takes
/// any FP/SIMD register.
template <class R>
inline void hide(R& r) noexcept {
    asm("" : "+w"(r));
}
#else
void widen_row(const half* src, float* dst, std::ptrdiff_t n) noexcept;
template <class B, class KV>
B widen(const KV* p) noexcept;
template <class B>
B div(const B& a, const B& b) noexcept;
template <class B, class IntBatch>
B bits_as(const IntBatch& x) noexcept;
template <int N, class IntBatch>
IntBatch shift_left(const IntBatch& x) noexcept;
template <int N, class IntBatch>
IntBatch shift_right(const IntBatch& x) noexcept;
template <class R>
void hide(R& r) noexcept;
#endif  // GATTN_HAS_NEON

}  // namespace neon
}  // namespace simd
GATTN_END_ISA_NAMESPACE
