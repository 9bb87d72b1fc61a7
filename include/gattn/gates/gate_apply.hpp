// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The fused gate kernel: activation and combine in one SIMD pass over a row,
/// y ← y ⊙ act(z), y + act(z) or act(z) ⊙ y + (1 − act(z)) ⊙ x (paper arXiv:2505.06708 §2.2).

#include <cstddef>
#include <cstring>

#include "gattn/gates/gate_spec.hpp"
#include "gattn/simd/math.hpp"

GATTN_BEGIN_ISA_NAMESPACE
namespace kernel {

template <class T>
struct SigmoidAct {
    simd::Batch<T> operator()(const simd::Batch<T>& z) const noexcept { return simd::sigmoid<T>(z); }
};
template <class T>
struct SiluAct {
    simd::Batch<T> operator()(const simd::Batch<T>& z) const noexcept { return simd::silu<T>(z); }
};
template <class T>
struct NonSparseSigmoidAct {
    simd::Batch<T> operator()(const simd::Batch<T>& z) const noexcept {
        return simd::fma(simd::Batch<T>(T(0.5)), simd::sigmoid<T>(z), simd::Batch<T>(T(0.5)));
    }
};
/// Gate values already activated (input-independent gates are activated once per call).
template <class T>
struct IdentityAct {
    simd::Batch<T> operator()(const simd::Batch<T>& z) const noexcept { return z; }
};

template <class T, class Act, GateCombine Combine>
inline void fused_gate_impl(T* y, const T* z, const T* x, T* gate_out, std::size_t n) noexcept {
    using B = simd::Batch<T>;
    constexpr std::size_t L = simd::kLanes<T>;
    const Act act;
    auto step = [&](const B& yv, const B& zv, const B& xv, B& g) {
        // Opaque: an additive gate would otherwise let the compiler fuse SiLU's z·σ(z) with
        // the add, in some inlined copies of this loop and not in others (a gate applied to
        // a head at a time in SDPA's epilogue must equal the same gate over the whole row).
        g = simd::opaque(act(zv));
        if constexpr (Combine == GateCombine::Multiplicative) return yv * g;
        else if constexpr (Combine == GateCombine::Additive) return yv + g;
        else return simd::fma(g, yv - xv, xv);  // g·y + (1 − g)·x
    };
    std::size_t i = 0;
    for (; i + L <= n; i += L) {
        B g;
        const B xv = Combine == GateCombine::ResidualMix ? B::load_unaligned(x + i) : B(T(0));
        step(B::load_unaligned(y + i), B::load_unaligned(z + i), xv, g).store_unaligned(y + i);
        if (gate_out) g.store_unaligned(gate_out + i);
    }
    if (i < n) {
        const std::size_t r = n - i;
        alignas(64) T yb[L] = {}, zb[L] = {}, xb[L] = {}, gb[L];
        std::memcpy(yb, y + i, r * sizeof(T));
        std::memcpy(zb, z + i, r * sizeof(T));
        if (Combine == GateCombine::ResidualMix) std::memcpy(xb, x + i, r * sizeof(T));
        B g;
        step(B::load_aligned(yb), B::load_aligned(zb), B::load_aligned(xb), g).store_aligned(yb);
        g.store_aligned(gb);
        std::memcpy(y + i, yb, r * sizeof(T));
        if (gate_out) std::memcpy(gate_out + i, gb, r * sizeof(T));
    }
}

template <class T, class Act>
inline void fused_gate_combine(GateCombine combine, T* y, const T* z, const T* x, T* gate_out,
                               std::size_t n) noexcept {
    switch (combine) {
        case GateCombine::Multiplicative:
            fused_gate_impl<T, Act, GateCombine::Multiplicative>(y, z, x, gate_out, n);
            break;
        case GateCombine::Additive:
            fused_gate_impl<T, Act, GateCombine::Additive>(y, z, x, gate_out, n);
            break;
        case GateCombine::ResidualMix:
            fused_gate_impl<T, Act, GateCombine::ResidualMix>(y, z, x, gate_out, n);
            break;
    }
}

}  // namespace kernel

/// Fused elementwise gate over n elements: y[e] ← combine(y[e], act(z[e])).
/// \param activation act: the gate's non-linearity (sigmoid: arXiv:2505.06708 eq. (5)).
/// \param combine  multiplicative y·g, additive y + g, or residual mix g·y + (1 − g)·x.
/// \param y        target, updated in place.
/// \param z        gate logits (or, with `activated`, gate values).
/// \param x        residual input for GateCombine::ResidualMix (else unused, may be null).
/// \param gate_out optional, receives act(z) (for gate statistics).
/// \param n        elements of y, z (and x, gate_out).
/// \param activated z already holds activated gate values.
template <class T>
inline void apply_gate(GateActivation activation, GateCombine combine, T* y, const T* z,
                       const T* x, T* gate_out, std::size_t n, bool activated = false) noexcept {
    if (activated) {
        kernel::fused_gate_combine<T, kernel::IdentityAct<T>>(combine, y, z, x, gate_out, n);
        return;
    }
    switch (activation) {
        case GateActivation::Sigmoid:
            kernel::fused_gate_combine<T, kernel::SigmoidAct<T>>(combine, y, z, x, gate_out, n);
            break;
        case GateActivation::SiLU:
            kernel::fused_gate_combine<T, kernel::SiluAct<T>>(combine, y, z, x, gate_out, n);
            break;
        case GateActivation::NonSparseSigmoid:
            kernel::fused_gate_combine<T, kernel::NonSparseSigmoidAct<T>>(combine, y, z, x,
                                                                          gate_out, n);
            break;
    }
}

/// Activation applied to n values: out[e] = act(z[e]) (out may equal z).
template <class T>
inline void activate(GateActivation activation, const T* z, T* out, std::size_t n) noexcept {
    switch (activation) {
        case GateActivation::Sigmoid:
            simd::transform(z, out, n, kernel::SigmoidAct<T>{});
            break;
        case GateActivation::SiLU:
            simd::transform(z, out, n, kernel::SiluAct<T>{});
            break;
        case GateActivation::NonSparseSigmoid:
            simd::transform(z, out, n, kernel::NonSparseSigmoidAct<T>{});
            break;
    }
}

GATTN_END_ISA_NAMESPACE
