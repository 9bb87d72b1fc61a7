// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Matrix aliases. Activations are row-major with the feature axis contiguous: a [B, N, H, d]
/// tensor is a RowMatrix of B·N rows and H·d columns (docs/conventions.md, "Tensors").

#include <Eigen/Core>
#include <type_traits>

#include "gattn/errors.hpp"

namespace gattn {

/// Dynamic row-major matrix.
template <class Scalar>
using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Dynamic column vector (biases).
template <class Scalar>
using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;

/// Read-only view of a row-major matrix with any row stride (a column block of a wider matrix,
/// e.g. the gate columns of a fused projection output, binds without a copy).
template <class Scalar>
using ConstMatrixRef = Eigen::Ref<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;

/// Writable view of a row-major matrix with any row stride.
template <class Scalar>
using MatrixRef = Eigen::Ref<RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;

/// Scalar types gattn is instantiated for.
template <class Scalar>
inline constexpr bool is_supported_scalar_v =
    std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>;

}  // namespace gattn
