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

/// Scalar types gattn computes in.
template <class Scalar>
inline constexpr bool is_supported_scalar_v =
    std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>;

/// bfloat16 (1 sign, 8 exponent, 7 mantissa bits): the storage type of current checkpoints.
using bfloat16 = Eigen::bfloat16;
/// IEEE binary16 (5 exponent, 10 mantissa bits).
using half = Eigen::half;

/// 16-bit storage types: tensors of them are read by kernels that compute in float.
template <class Storage>
inline constexpr bool is_narrow_storage_v = std::is_same_v<Storage, bfloat16> || std::is_same_v<Storage, half>;

/// Types a tensor may be stored in: the compute types and the 16-bit storage types.
template <class Storage>
inline constexpr bool is_supported_storage_v = is_supported_scalar_v<Storage> || is_narrow_storage_v<Storage>;

/// The type a kernel computes in for tensors stored as Storage: float for bf16 and fp16,
/// Storage itself otherwise (softmax statistics, accumulators, masks' bias, scale).
template <class Storage>
using compute_t = std::conditional_t<is_narrow_storage_v<Storage>, float, Storage>;

}  // namespace gattn
