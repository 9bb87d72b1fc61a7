// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Zero-centred RMSNorm per head, as Qwen3-Next's q_norm and k_norm (Hugging Face
/// transformers, Qwen3NextRMSNorm): y = x / √(mean(x²) + ε) · (1 + w), computed in at least float,
/// with the weight w initialised to zeros (so the norm starts as the identity scale).

#include <cmath>
#include <type_traits>

#include "gattn/types.hpp"

GATTN_BEGIN_ISA_NAMESPACE

/// Normalises every head of every row in place.
/// \param x      [rows, heads·d] row-major, any row stride; each head's d values are normalised.
/// \param rows   rows of x.
/// \param stride elements between the starts of consecutive rows of x.
/// \param heads  heads per row.
/// \param d      features per head.
/// \param weight [d] the norm weight w (used as 1 + w, or as w when not zero_centred).
/// \param eps    ε added to the mean square.
/// \param zero_centred y·(1 + w) (Qwen3-Next) or y·w (Llama's and Qwen3's RMSNorm).
/// Inner function: shapes are the caller's responsibility (no validation).
template <class Scalar>
void rms_norm_heads(Scalar* x, Index rows, Index stride, Index heads, Index d, const Scalar* weight,
                    double eps, bool zero_centred = true) noexcept {
    using Acc = std::conditional_t<std::is_same_v<Scalar, double>, double, float>;
    for (Index r = 0; r < rows; ++r)
        for (Index h = 0; h < heads; ++h) {
            Scalar* v = x + r * stride + h * d;
            Acc sum = 0;
            for (Index e = 0; e < d; ++e) sum += Acc(v[e]) * Acc(v[e]);
            const Acc inv = Acc(1) / std::sqrt(sum / Acc(d) + Acc(eps));
            const Acc offset = zero_centred ? Acc(1) : Acc(0);
            for (Index e = 0; e < d; ++e) v[e] = static_cast<Scalar>(Acc(v[e]) * inv * (offset + Acc(weight[e])));
        }
}

GATTN_END_ISA_NAMESPACE
