// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Vectorised exp, sigmoid and SiLU (register level and over arrays), plus the small array
/// kernels attention needs: dot, axpy, scale, max.
///
/// Array kernels process full registers and then the tail through a zero-padded register, so an
/// element's result does not depend on where it sits in the array.

#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <type_traits>

#include "gattn/simd/compat.hpp"

GATTN_BEGIN_ISA_NAMESPACE
namespace simd {

namespace detail {

/// 2^n for integer lanes n in T's normal exponent range, built from the exponent bits.
template <class T, class I>
inline Batch<T> pow2(const I& n) noexcept {
    constexpr int kMantissaBits = std::numeric_limits<T>::digits - 1;  // 23, 52
    constexpr int kBias = std::numeric_limits<T>::max_exponent - 1;    // 127, 1023
    return simd::bits_as<T>(simd::shift_left<kMantissaBits>(n + I(kBias)));
}

/// p·2^n. NonPositive: n in [min exponent, 0], one normal factor; otherwise two factors, so
/// that n up to the largest exponent + 1 never leaves the normal range.
template <class T, bool NonPositive, class I>
inline Batch<T> times_pow2(const Batch<T>& p, const I& n) noexcept {
    if constexpr (NonPositive) {
        return p * pow2<T>(n);
    } else {
        const I n1 = simd::shift_right<1>(n);
        return p * pow2<T>(n1) * pow2<T>(n - n1);
    }
}

inline constexpr float kLog2eF = 1.44269504088896341f;  // log₂e in float
inline constexpr float kLnFltMin = -87.3365447505531f;  // ln(FLT_MIN): e^x is subnormal below

/// e^(x − n·ln2) for float, n = round(x·log₂e): the Cephes expf reduction (Cody-Waite,
/// ln2 = hi + lo) and polynomial (degree 6), ≈1 ulp; the caller multiplies by 2^n.
inline Batch<float> expf_remainder(const Batch<float>& x, const Batch<float>& n) noexcept {
    using B = Batch<float>;
    B r = simd::fma(n, B(-0.693359375f), x);  // x − n·hi (the negated constant: one vfmadd)
    r = simd::fma(n, B(2.12194440e-4f), r);   // − n·lo
    B p(1.9875691500e-4f);
    p = simd::fma(p, r, B(1.3981999507e-3f));
    p = simd::fma(p, r, B(8.3334519073e-3f));
    p = simd::fma(p, r, B(4.1665795894e-2f));
    p = simd::fma(p, r, B(1.6666665459e-1f));
    p = simd::fma(p, r, B(5.0000001201e-1f));
    return simd::fma(p, r * r, r + B(1.0f));
}

// NonPositive: the caller guarantees x ≤ 0 (or −∞, NaN), as for softmax's e^(s − max); the
// upper clamp goes and 2^n, n in [−126, 0], is one normal factor instead of two.
template <class T, bool NonPositive>
inline Batch<T> exp_impl(const Batch<T>& x) noexcept {
    if constexpr (std::is_same_v<T, float>) {
        using B = Batch<float>;
        using I = xsimd::batch<std::int32_t, Arch>;
        const B lo(kLnFltMin);
        const B hi(88.8f);  // just above ln(FLT_MAX): p·2^128 overflows to +∞
        // Operand order matters: vmaxps/vminps return their second operand when either is
        // NaN, so NaN flows through; +∞ clamps to hi, where the result overflows to +∞.
        B xc = xsimd::max(lo, x);
        if constexpr (!NonPositive) xc = xsimd::min(hi, xc);
        const B n = xsimd::nearbyint(xc * B(kLog2eF));
        const B p = expf_remainder(xc, n);
        const I ni = xsimd::to_int(n);
        return xsimd::select(x < lo, B(0.0f), times_pow2<float, NonPositive>(p, ni));
    } else {
        // Cephes exp (double): Padé form 1 + 2x·P(x²) / (Q(x²) − x·P(x²)) after Cody-Waite
        // reduction, ≈1 ulp. Clamping first keeps ±∞ and NaN out of the integer conversion.
        using B = Batch<double>;
        using I = xsimd::batch<std::int64_t, Arch>;
        const B lo(-708.3964185322641);  // ln(DBL_MIN)
        const B hi(710.0);               // just above ln(DBL_MAX): e·2^1024 overflows to +∞
        B xc = xsimd::max(lo, x);        // NaN flows through (second operand)
        if constexpr (!NonPositive) xc = xsimd::min(hi, xc);
        const B n = xsimd::nearbyint(xc * B(1.4426950408889634));
        B r = simd::fnma(n, B(6.93145751953125e-1), xc);
        r = simd::fnma(n, B(1.42860682030941723212e-6), r);
        const B rr = r * r;
        B p = simd::fma(rr, B(1.26177193074810590878e-4), B(3.02994407707441961300e-2));
        p = simd::fma(p, rr, B(9.99999999999999999910e-1)) * r;
        B q = simd::fma(rr, B(3.00198505138664455042e-6), B(2.52448340349684104192e-3));
        q = simd::fma(q, rr, B(2.27265548208155028766e-1));
        q = simd::fma(q, rr, B(2.00000000000000000009e0));
        const B e = simd::fma(B(2.0), p / (q - p), B(1.0));
        const I ni = xsimd::to_int(xsimd::select(xsimd::isnan(n), B(0.0), n));
        return xsimd::select(x < lo, B(0.0), times_pow2<double, NonPositive>(e, ni));
    }
}

// σ(x) for float in about two thirds of the instructions of 1 / (1 + exp(−x)), which with
// 512-bit registers (two vector ports) is bound by instruction count: e^−x by exp's reduction
// and polynomial (expf_remainder), vscalefps applying 2^n (no integer exponent arithmetic),
// and 1/d from vrcp14ps refined by one Newton step (2^−28 before rounding), not a division
// (simd/x86_avx512.hpp). Where σ(x) < FLT_MIN (x < ln FLT_MIN) the lane is zeroed: there e^−x
// may overflow and the Newton step give NaN. NaN compares unordered and is kept.
inline Batch<float> sigmoid_avx512(const Batch<float>& x) noexcept {
    using B = Batch<float>;
    const B lo(kLnFltMin);
    const B t = xsimd::max(lo, -x);  // σ(x) = 1 for −x < lo either way; NaN flows through
    // n = round(t·log₂e): adding 1.5·2^23 rounds to an integer (|t·log₂e| < 2^22 where kept).
    const B shifter(12582912.0f);
    const B n = simd::fma(t, B(kLog2eF), shifter) - shifter;
    const B d = avx512::scalef(expf_remainder(t, n), n) + B(1.0f);  // 1 + e^−x
    return avx512::reciprocal_unless_below(x, lo, d);
}

}  // namespace detail

/// e^x, register level. float: Cephes expf polynomial (degree 6 after Cody-Waite reduction,
/// ≈1 ulp); double: Cephes exp (Padé form, ≈1 ulp). Results below the smallest normal number
/// are exactly 0 (so e^−∞ = 0 and no denormals), above the largest finite number +∞; NaN
/// propagates.
template <class T>
inline Batch<T> exp(const Batch<T>& x) noexcept {
    return detail::exp_impl<T, false>(x);
}

/// e^x for x ≤ 0 (softmax's e^(s − max)), register level: the Cephes polynomial of exp, ≈1 ulp,
/// with fewer operations (no upper clamp; 2^n for n in [−126, 0] (float) / [−1022, 0] (double)
/// is one normal factor). Results below the smallest normal number are 0, −∞ gives 0, NaN
/// propagates; x > 0 is outside its contract. Never throws.
template <class T>
inline Batch<T> exp_nonpositive(const Batch<T>& x) noexcept {
    return detail::exp_impl<T, true>(x);
}

/// 2^x for x ≤ 0, float, register level: x = n + r with n an integer (exact), 2^r = 1 + r·q(r)
/// with q a degree-5 polynomial fitted for relative error on r's interval (weighted least
/// squares on Chebyshev nodes, Lawson-iterated towards minimax; near the Taylor coefficients
/// (ln 2)^k / k!); times 2^n. With AVX-512DQ n = ⌊x⌋ and r ∈ [0, 1) come from one vreduceps
/// and vscalefps applies 2^⌊x⌋ itself (three instructions fewer); elsewhere n = round(x),
/// r ∈ [−½, ½]. Relative error against double over every float in [−126, 0]: 8.9e-8
/// (AVX-512DQ), 8.0e-8 (AVX2 + FMA), 1.03e-7 (SSE2, no FMA); ≈2 ulp.
/// Results below the smallest normal number are 0, −∞ gives 0, NaN propagates; x > 0 is
/// outside its contract. Softmax in base 2 needs no multiply by log₂e and no Cody-Waite
/// split. Never throws.
inline Batch<float> exp2_nonpositive(const Batch<float>& x) noexcept {
    using B = Batch<float>;
    const B lo(-126.0f);  // 2^−126 = FLT_MIN; below it the result is 0
    // 1 + r·(c₀ + r·(c₁ + … + r·c₅)), Horner's rule with fused multiply-adds.
    auto poly = [](const B& r, const float(&c)[6]) {
        B q(c[5]);
        for (int k = 4; k >= 0; --k) q = simd::fma(q, r, B(c[k]));
        return simd::fma(q, r, B(1.0f));
    };
    if constexpr (avx512::kDq) {
        // r = x − ⌊x⌋ (vreduceps): ±∞ gives 0, NaN stays NaN, and vscalefps multiplies by
        // 2^⌊x⌋ (0 for x = −∞), so no clamp is needed; x < −126 is flushed to 0 (NaN compares
        // unordered and is kept).
        static constexpr float c[6] = {6.9314706325531006e-1f, 2.4022929370403290e-1f, 5.5485296994447708e-2f,
                                       9.6754413098096848e-3f, 1.2467787601053715e-3f, 2.1613512944895774e-4f};
        return avx512::scalef_unless_below(x, lo, poly(avx512::floor_fraction(x), c), x);
    } else {
        static constexpr float c[6] = {6.9314718246459961e-1f, 2.4022647738456726e-1f, 5.5503323674201965e-2f,
                                       9.6184369176626205e-3f, 1.3398875016719103e-3f, 1.5353361959569156e-4f};
        const B xc = xsimd::max(lo, x);  // NaN flows through (second operand)
        const B n = xsimd::nearbyint(xc);
        const B p = poly(xc - n, c);
        B y;
        if constexpr (avx512::kEnabled)
            y = avx512::scalef(p, n);  // p·2^n in one instruction
        else
            y = detail::times_pow2<float, true>(p, xsimd::to_int(n));
        return xsimd::select(x < lo, B(0.0f), y);
    }
}

/// σ(x) = 1 / (1 + e^−x), as accurate as e^−x: in float at most 3.2 ulp, measured over every
/// float in [−87.3, 40] (where σ is a normal number). Below that σ(x) is 0 or subnormal, and
/// exactly 0 below about −88.7 (float) or −709.8 (double); exactly 1 for large x;
/// σ(NaN) = NaN. With AVX-512F, float multiplies by a refined reciprocal instead of dividing
/// (detail::sigmoid_avx512, the same worst error; 0 below ln FLT_MIN ≈ −87.34).
template <class T>
inline Batch<T> sigmoid(const Batch<T>& x) noexcept {
    if constexpr (avx512::kEnabled && std::is_same_v<T, float>)
        return detail::sigmoid_avx512(x);
    else
        return simd::div<T>(Batch<T>(T(1)), Batch<T>(T(1)) + simd::exp<T>(-x));
}

/// SiLU(x) = x · σ(x).
template <class T>
inline Batch<T> silu(const Batch<T>& x) noexcept {
    return x * simd::sigmoid<T>(x);
}

/// Logit soft-capping c·tanh(x/c) (Gemma 2), register level, given cap = c > 0 and
/// inv_cap = 1/c. For y = |x|/c < 1/8, tanh's Taylor series to y¹⁵ (its remainder is below
/// 10⁻¹⁷ relative there), so a cap far above the logits leaves them as they are; above, tanh(y)
/// = (1 − e^(−2y)) / (1 + e^(−2y)) with e^(−2y) from exp2_nonpositive (float) or
/// exp_nonpositive (double); then the sign of x. Error, measured against std::tanh in double
/// over |x| ≤ 8c and |x| down to 10⁻⁶c for c from 1 to 10³⁰ (SSE2, AVX2, AVX-512): float at
/// most 6.1 ulp of the result and 1.7e-7·c absolute, double 8 ulp and 4.3e-16·c; never above
/// c in magnitude. ±∞ gives ±c, NaN propagates.
template <class T>
inline Batch<T> softcap(const Batch<T>& x, T cap, T inv_cap) noexcept {
    using B = Batch<T>;
    const B y = xsimd::abs(x) * B(inv_cap);
    B e;
    if constexpr (std::is_same_v<T, float>)  // 2^(−2·log₂e·y): the cheaper base-2 kernel
        e = exp2_nonpositive(y * B(-2.0f * detail::kLog2eF));
    else
        e = exp_nonpositive<T>(y * B(T(-2)));
    const B large = simd::div<T>(B(T(1)) - e, B(T(1)) + e);
    // tanh y = y − y³/3 + 2y⁵/15 − 17y⁷/315 + 62y⁹/2835 − 1382y¹¹/155925 + 21844y¹³/6081075
    //          − 929569y¹⁵/638512875, in y² by Horner.
    const B y2 = y * y;
    B p(T(-929569.0 / 638512875.0));
    p = simd::fma(p, y2, B(T(21844.0 / 6081075.0)));
    p = simd::fma(p, y2, B(T(-1382.0 / 155925.0)));
    p = simd::fma(p, y2, B(T(62.0 / 2835.0)));
    p = simd::fma(p, y2, B(T(-17.0 / 315.0)));
    p = simd::fma(p, y2, B(T(2.0 / 15.0)));
    p = simd::fma(p, y2, B(T(-1.0 / 3.0)));
    const B small = simd::fma(p * y2, y, y);
    const B t = xsimd::select(y < B(T(0.125)), small, large);
    return xsimd::copysign(t * B(cap), x);
}

/// Applies f (register → register) to n elements of in, writing out (may equal in).
template <class T, class F>
inline void transform(const T* in, T* out, std::size_t n, F f) noexcept {
    constexpr std::size_t L = kLanes<T>;
    std::size_t i = 0;
    for (; i + L <= n; i += L) f(Batch<T>::load_unaligned(in + i)).store_unaligned(out + i);
    if (i < n) {
        alignas(64) T buf[L] = {};
        std::memcpy(buf, in + i, (n - i) * sizeof(T));
        f(Batch<T>::load_aligned(buf)).store_aligned(buf);
        std::memcpy(out + i, buf, (n - i) * sizeof(T));
    }
}

/// out[i] = e^(in[i] − shift); returns the sum of the outputs. out may equal in.
template <class T>
inline T exp_shifted_sum(const T* in, T shift, T* out, std::size_t n) noexcept {
    constexpr std::size_t L = kLanes<T>;
    const Batch<T> s(shift);
    Batch<T> acc(T(0));
    std::size_t i = 0;
    for (; i + L <= n; i += L) {
        const Batch<T> e = simd::exp<T>(Batch<T>::load_unaligned(in + i) - s);
        e.store_unaligned(out + i);
        acc += e;
    }
    T sum = reduce_sum(acc);
    if (i < n) {
        alignas(64) T buf[L];
        for (std::size_t k = 0; k < L; ++k) buf[k] = -std::numeric_limits<T>::infinity();
        std::memcpy(buf, in + i, (n - i) * sizeof(T));
        const Batch<T> e = simd::exp<T>(Batch<T>::load_aligned(buf) - s);
        e.store_aligned(buf);
        for (std::size_t k = 0; k < n - i; ++k) {
            out[i + k] = buf[k];
            sum += buf[k];
        }
    }
    return sum;
}

/// Largest of n ≥ 1 values (NaN ignored unless all are NaN).
template <class T>
inline T max_value(const T* x, std::size_t n) noexcept {
    constexpr std::size_t L = kLanes<T>;
    std::size_t i = 0;
    T m = -std::numeric_limits<T>::infinity();
    if (n >= L) {
        Batch<T> acc = Batch<T>::load_unaligned(x);
        for (i = L; i + L <= n; i += L) acc = xsimd::max(acc, Batch<T>::load_unaligned(x + i));
        m = reduce_max(acc);
    }
    for (; i < n; ++i) m = std::max(m, x[i]);
    return m;
}

/// Σ a[i]·b[i], four independent accumulators.
template <class T>
inline T dot(const T* a, const T* b, std::size_t n) noexcept {
    constexpr std::size_t L = kLanes<T>;
    Batch<T> acc0(T(0)), acc1(T(0)), acc2(T(0)), acc3(T(0));
    std::size_t i = 0;
    for (; i + 4 * L <= n; i += 4 * L) {
        acc0 = simd::fma(Batch<T>::load_unaligned(a + i), Batch<T>::load_unaligned(b + i), acc0);
        acc1 = simd::fma(Batch<T>::load_unaligned(a + i + L), Batch<T>::load_unaligned(b + i + L), acc1);
        acc2 = simd::fma(Batch<T>::load_unaligned(a + i + 2 * L), Batch<T>::load_unaligned(b + i + 2 * L), acc2);
        acc3 = simd::fma(Batch<T>::load_unaligned(a + i + 3 * L), Batch<T>::load_unaligned(b + i + 3 * L), acc3);
    }
    for (; i + L <= n; i += L) acc0 = simd::fma(Batch<T>::load_unaligned(a + i), Batch<T>::load_unaligned(b + i), acc0);
    T sum = reduce_sum((acc0 + acc1) + (acc2 + acc3));
    for (; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

/// y[i] += alpha · x[i].
template <class T>
inline void axpy(T alpha, const T* x, T* y, std::size_t n) noexcept {
    constexpr std::size_t L = kLanes<T>;
    const Batch<T> a(alpha);
    std::size_t i = 0;
    for (; i + L <= n; i += L)
        simd::fma(a, Batch<T>::load_unaligned(x + i), Batch<T>::load_unaligned(y + i)).store_unaligned(y + i);
    for (; i < n; ++i) y[i] += alpha * x[i];
}

/// y[i] *= alpha.
template <class T>
inline void scale(T alpha, T* y, std::size_t n) noexcept {
    constexpr std::size_t L = kLanes<T>;
    const Batch<T> a(alpha);
    std::size_t i = 0;
    for (; i + L <= n; i += L) (a * Batch<T>::load_unaligned(y + i)).store_unaligned(y + i);
    for (; i < n; ++i) y[i] *= alpha;
}

/// Scalar e^x through the same register kernel (for single values that must match the arrays).
template <class T>
inline T exp_scalar(T x) noexcept {
    alignas(64) T buf[kLanes<T>] = {};
    buf[0] = x;
    simd::exp<T>(Batch<T>::load_aligned(buf)).store_aligned(buf);
    return buf[0];
}

/// Scalar softcap through the same register kernel (the analysis outputs recompute logits
/// exactly as the attention kernels do).
template <class T>
inline T softcap_scalar(T x, T cap, T inv_cap) noexcept {
    alignas(64) T buf[kLanes<T>] = {};
    buf[0] = x;
    simd::softcap<T>(Batch<T>::load_aligned(buf), cap, inv_cap).store_aligned(buf);
    return buf[0];
}

}  // namespace simd
GATTN_END_ISA_NAMESPACE
