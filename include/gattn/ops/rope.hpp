// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Rotary position embedding (RoPE, Su et al. 2021), NeoX "rotate_half" form, optionally
/// partial (Qwen3-Next rotates the first rotary_dim = head_dim · partial_rotary_factor dims).
///
/// For pair i < r/2 of a head (r = rotary_dim), with θ_i = base^(−2i/r) and position p:
///     y_i       = x_i · cos(p θ_i) − x_{i+r/2} · sin(p θ_i)
///     y_{i+r/2} = x_{i+r/2} · cos(p θ_i) + x_i · sin(p θ_i)
/// (Hugging Face transformers, apply_rotary_pos_emb with rotate_half); dims ≥ r pass through.
/// Interleaved (GPT-J, Meta's Llama reference): pair i is features (2i, 2i + 1) instead.
/// Angles are computed in double, so long positions keep their accuracy.

#include <cmath>
#include <vector>

#include "gattn/types.hpp"

GATTN_BEGIN_ISA_NAMESPACE

/// Rotates the first rotary_dim dims of every head of every row in place.
/// \param x          [rows, heads·d] row-major with row stride `stride`.
/// \param rows       rows of x.
/// \param stride     elements between the starts of consecutive rows of x.
/// \param heads      heads per row.
/// \param d          features per head.
/// \param rotary_dim r: features rotated per head (even, ≤ d); the rest pass through.
/// \param positions  [rows] position of each row's token.
/// \param base       the RoPE base of θ_i = base^(−2i/r) (HF rope_theta).
/// \param interleaved pairs (2i, 2i + 1) (GPT-J) instead of (i, i + r/2) (NeoX).
/// Inner function: shapes are the caller's responsibility (rotary_dim even, ≤ d).
template <class Scalar>
void apply_rope(Scalar* x, Index rows, Index stride, Index heads, Index d, Index rotary_dim, const Index* positions,
                double base, bool interleaved = false) {
    const Index half = rotary_dim / 2;
    std::vector<double> inv_freq(static_cast<std::size_t>(half));
    for (Index i = 0; i < half; ++i) inv_freq[i] = std::pow(base, -2.0 * double(i) / double(rotary_dim));
    std::vector<Scalar> cos_v(static_cast<std::size_t>(half)), sin_v(static_cast<std::size_t>(half));
    for (Index r = 0; r < rows; ++r) {
        for (Index i = 0; i < half; ++i) {
            const double angle = double(positions[r]) * inv_freq[i];
            cos_v[i] = static_cast<Scalar>(std::cos(angle));
            sin_v[i] = static_cast<Scalar>(std::sin(angle));
        }
        for (Index h = 0; h < heads; ++h) {
            Scalar* v = x + r * stride + h * d;
            const Index first = interleaved ? 2 : 1, second = interleaved ? 1 : half;  // pair i: (first·i, first·i + second)
            for (Index i = 0; i < half; ++i) {
                Scalar& x0 = v[first * i];
                Scalar& x1 = v[first * i + second];
                const Scalar a = x0, b = x1;
                x0 = a * cos_v[i] - b * sin_v[i];
                x1 = b * cos_v[i] + a * sin_v[i];
            }
        }
    }
}

GATTN_END_ISA_NAMESPACE
