// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Keys and values stored as int8: the format of an int8 KV cache, its quantization, and the
/// view SDPA reads it through.
///
/// A [rows, H_kv·d] matrix of keys (or values) is stored as int8 codes with one float scale per
/// (row, KV head): element (r, g·d + e) stands for scales[r, g] · codes[r, g·d + e]. Quantization
/// is symmetric round-to-nearest over each head's d values: scale = max|x| / 127 and
/// code = round(x / scale) in [−127, 127] (0 with scale 0 for a row of zeros). The error of an
/// element is at most scale / 2 = max|x| / 254 of its head's row, down to the smallest
/// subnormal rows (there the scale is rounded up to keep that bound). One scale per head row (not
/// per 32 values, as llama.cpp's q8_0) lets the kernels apply it once per key: to the logit
/// q·k = s_k·(q·codes) and to the weight p·s_v of the value sum, so the codes are only widened,
/// never scaled, in the decoding kernel; the cost is 4 bytes per head_dim codes (1.6 % at d = 256).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "gattn/config.hpp"
#include "gattn/errors.hpp"
#include "gattn/types.hpp"

GATTN_BEGIN_ISA_NAMESPACE

/// Read-only view of int8 keys or values: rows() × cols() codes, row r at data + r·stride, and
/// cols() / head_dim scales per row at scales + r·scale_stride (see the file comment).
struct Int8Rows {
    const std::int8_t* codes = nullptr;  ///< row-major codes
    Index num_rows = 0;                  ///< rows (tokens)
    Index num_cols = 0;                  ///< H_kv·d
    Index stride = 0;                    ///< codes between the starts of consecutive rows
    const float* scales = nullptr;       ///< per (row, KV head): scales[r·scale_stride + g]
    Index scale_stride = 0;              ///< scales between the starts of consecutive rows

    /// Rows (tokens), as Eigen's rows().
    Index rows() const noexcept { return num_rows; }
    /// Columns (H_kv·d), as Eigen's cols().
    Index cols() const noexcept { return num_cols; }
    /// Codes between consecutive rows, as Eigen's outerStride().
    Index outerStride() const noexcept { return stride; }
    /// The first code, as Eigen's data().
    const std::int8_t* data() const noexcept { return codes; }
};

/// Rows whose largest magnitude is at least this (127 times the smallest normal float, about
/// 1.5e-36) get a normal scale max|x| / 127 and finite 127 / max|x|: the fast path. Smaller
/// rows (subnormal scales) take detail::tiny_int8_scale.
inline constexpr float kInt8NormalScaleMax = 127.0f * std::numeric_limits<float>::min();

namespace detail {
/// The scale of a row whose largest magnitude amax is below kInt8NormalScaleMax: amax / 127
/// rounded to a (subnormal) float, then raised by one step of 2⁻¹⁴⁹ where the rounding left it
/// below amax / 127.5, so that every |x| ≤ amax is within 127.5 scales and its code's error is
/// at most scale / 2, as for normal rows (a subnormal scale has few significant bits: amax / 127
/// may round down by up to half a step, or to 0). 0 for amax = 0.
inline float tiny_int8_scale(float amax) noexcept {
    float s = static_cast<float>(double(amax) / 127.0);
    if (double(s) * 127.5 < double(amax)) s = std::nextafter(s, std::numeric_limits<float>::infinity());
    return s;
}
}  // namespace detail

/// Quantizes the `heads` head rows of `width` values of x (at x, x + width, …) to codes and one
/// scale each (the file's rule; a row below kInt8NormalScaleMax, whose scale is subnormal, is
/// divided by its scale in double instead, with the scale rounded up where needed: see
/// detail::tiny_int8_scale). \returns false, writing nothing, when a value is not finite.
inline bool quantize_int8_row(const float* x, Index heads, Index width, std::int8_t* codes, float* scales) noexcept {
    for (Index e = 0; e < heads * width; ++e)
        if (!std::isfinite(x[e])) return false;
    for (Index g = 0; g < heads; ++g) {
        const float* xg = x + g * width;
        std::int8_t* cg = codes + g * width;
        float amax = 0;
        for (Index e = 0; e < width; ++e) amax = std::max(amax, std::fabs(xg[e]));
        if (amax >= kInt8NormalScaleMax) {
            scales[g] = amax / 127.0f;
            // x·(127 / max|x|) rounds to an integer in [−127, 127]; the clamp guards the last ulp.
            const float inv = 127.0f / amax;
            for (Index e = 0; e < width; ++e) {
                const float q = std::nearbyint(xg[e] * inv);
                cg[e] = static_cast<std::int8_t>(std::max(-127.0f, std::min(127.0f, q)));
            }
        } else {
            scales[g] = detail::tiny_int8_scale(amax);
            // Exact in double: x and the scale are floats, x / scale ≤ 127.5 (tiny_int8_scale).
            const double s = scales[g];
            for (Index e = 0; e < width; ++e) {
                const double q = s > 0 ? std::nearbyint(double(xg[e]) / s) : 0.0;
                cg[e] = static_cast<std::int8_t>(std::max(-127.0, std::min(127.0, q)));
            }
        }
    }
    return true;
}

/// The value that code c with scale s stands for.
inline float dequantize_int8(std::int8_t c, float s) noexcept { return s * static_cast<float>(c); }

/// Widens `n` codes of one head row to floats, times its scale.
inline void dequantize_int8_row(const std::int8_t* codes, float scale, float* out, Index n) noexcept {
    for (Index e = 0; e < n; ++e) out[e] = dequantize_int8(codes[e], scale);
}

namespace kernel {
/// The scales of int8 keys and values for the kernels: key row j of KV head g has scale
/// key[j·stride + g]; null for other storage.
struct Int8Scales {
    const float* key = nullptr;    ///< the first key row's scales
    const float* value = nullptr;  ///< the first value row's scales
    Index stride = 0;              ///< scales between consecutive rows
};
}  // namespace kernel

GATTN_END_ISA_NAMESPACE
