// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The ranges of SDPA's logit options that the kernels compute with in a compute type (float or
/// double): SdpaOptions::logit_softcap and alibi_slopes (docs/conventions.md, "Numerics"). A
/// softcapped logit and an ALiBi term each stay within half the compute type's largest value, in
/// the natural units of the float and double kernels and in the base 2 (times log₂e) of the
/// 16-bit kernels, so their sum is finite.

#include <cmath>
#include <limits>
#include <type_traits>

#include "gattn/config.hpp"

GATTN_BEGIN_ISA_NAMESPACE
namespace detail {

/// log₂e, the factor that takes natural logits to the base-2 units of the 16-bit kernels.
inline constexpr double kLog2e = 1.4426950408889634;

/// Name of a compute type in messages.
template <class T>
inline const char* compute_type_name() noexcept {
    return std::is_same_v<T, float> ? "float" : "double";
}

/// The smallest logit softcap c the kernels take in compute type T: T's smallest normal number
/// (below it, 1/c overflows or c itself has lost its precision; FLT_MIN ≈ 1.18e-38 in float).
template <class T>
inline double softcap_min() noexcept {
    return double(std::numeric_limits<T>::min());
}

/// The largest logit softcap c the kernels take in compute type T: c·log₂e stays within half of
/// T's largest value (c ≤ 1.1793e38 in float, 6.2303e307 in double), so that a capped logit
/// plus an ALiBi term (alibi_slope_max) is finite in the natural and in the base-2 kernels.
template <class T>
inline double softcap_max() noexcept {
    return double(std::numeric_limits<T>::max()) / (2 * kLog2e);
}

/// The largest |ALiBi slope| the kernels take in compute type T: 2^(e − 66) for T's largest
/// values below 2^e (2^62 ≈ 4.6e18 in float, 2^958 in double). Any distance |i' − j| an Index
/// holds (< 2^63), times log₂e (< 2^0.53), times the slope then stays below 2^(e − 2.47), within
/// half of T's largest value, whatever the call's shapes.
template <class T>
inline double alibi_slope_max() noexcept {
    return std::ldexp(1.0, std::numeric_limits<T>::max_exponent - 66);
}

}  // namespace detail
GATTN_END_ISA_NAMESPACE
