// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Linear layer out = x·wᵀ + b (PyTorch's nn.Linear: w is [out_features, in_features]), the
/// projections around attention, computed with Eigen.

#include <algorithm>
#include <cstddef>
#include <type_traits>
#include <utility>

#include "gattn/types.hpp"

GATTN_BEGIN_ISA_NAMESPACE
namespace detail {

/// Row counts up to which linear() runs matrix-vector products instead of Eigen's GEMM (where
/// the two cost about the same in a layer: 16 rows on one thread, 24 on two).
inline constexpr Index kLinearGemvRows = 16;

/// out = x·wᵀ + b, b empty for no bias. x [R, in], w [out, in] row-major, out [R, out]; shapes
/// are the caller's to check, out must not overlap x. Throws nothing beyond std::bad_alloc.
///
/// Eigen's GEMM packs all of w into blocks in every call, which for a few rows costs several
/// times the product itself (in = 2048, out = 2560, one thread: 2 rows 2.9 ms, against 0.8 ms
/// for one row), and its matrix-vector product runs on one thread. Up to kLinearGemvRows rows,
/// w is taken in blocks of 64 rows (512 KiB at in = 2048, so a block stays in L2 while every
/// row of x multiplies it: w streams from memory once, uncopied) and each row of x is one
/// Eigen matrix-vector product per block; the blocks are split over the OpenMP threads. The
/// blocks are fixed, so this result does not depend on the thread count.
template <class Scalar>
void linear(ConstMatrixRef<Scalar> x, const RowMatrix<Scalar>& w, const Vector<Scalar>& b, MatrixRef<Scalar> out) {
    const Index rows = x.rows(), outputs = w.rows();
    if (rows == 0 || rows > kLinearGemvRows) {
        out.noalias() = x * w.transpose();
        if (b.size()) out.rowwise() += b.transpose();
        return;
    }
    constexpr Index kBlock = 64;
    const Index blocks = (outputs + kBlock - 1) / kBlock;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (blocks > 1 && rows * outputs * x.cols() >= (Index(1) << 20))
#endif
    for (Index k = 0; k < blocks; ++k) {
        const Index o = k * kBlock, n = std::min(kBlock, outputs - o);
        const auto wk = w.middleRows(o, n);
        for (Index r = 0; r < rows; ++r) {
            auto y = out.row(r).segment(o, n);
            y.noalias() = x.row(r) * wk.transpose();
            if (b.size()) y += b.segment(o, n).transpose();
        }
    }
}

}  // namespace detail

/// A float or double linear layer as the layers keep it, y = x·wᵀ + b through detail::linear:
/// the counterpart of PackedLinear (ops/packed_linear.hpp) for 16-bit weights, with the same
/// interface. Shapes are the caller's to check.
template <class Scalar>
class DenseLinear {
public:
    DenseLinear() = default;
    /// weight [out_features, in_features], bias [out_features] or empty.
    DenseLinear(RowMatrix<Scalar> weight, Vector<Scalar> bias) : m_w(std::move(weight)), m_b(std::move(bias)) {}
    /// Inputs per row of x (the weight's columns).
    Index in_features() const noexcept { return m_w.cols(); }
    /// Outputs per row (the weight's rows).
    Index out_features() const noexcept { return m_w.rows(); }
    /// Bytes of weights and bias held.
    std::size_t bytes() const noexcept { return sizeof(Scalar) * static_cast<std::size_t>(m_w.size() + m_b.size()); }
    /// The weight [out_features, in_features] as given.
    const RowMatrix<Scalar>& weight() const noexcept { return m_w; }
    /// out [R, out_features] = x [R, in_features]·wᵀ + b; out must not overlap x.
    template <class X, class Y>
    void forward(ConstMatrixRef<X> x, MatrixRef<Y> out) const {
        static_assert(std::is_same_v<X, Scalar> && std::is_same_v<Y, Scalar>, "float or double throughout");
        detail::linear<Scalar>(x, m_w, m_b, out);
    }

private:
    RowMatrix<Scalar> m_w;
    Vector<Scalar> m_b;
};

GATTN_END_ISA_NAMESPACE
