// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Keys or values laid out head-major: the view SDPA reads PyTorch's and ONNX's 4-D
/// [B, H_kv, N_k, d] tensors through (a Hugging Face KV cache, ONNX Runtime's present_key),
/// without a transposed copy.
///
/// gattn's activations and caches are token-major, [B·N_k, H_kv·d] (docs/conventions.md,
/// "Tensors"): one row holds a token's every KV head. Head-major, each KV head's keys of a
/// sequence are rows of their own, back to back: the [B·H_kv·N_k, d] matrix whose row
/// (b·H_kv + g)·N_k + j is key j of sequence b, KV head g. Decoding one token reads each head's
/// rows as one stream; over a cache larger than the last-level cache that is faster than
/// reading each 512-byte head slice of the token-major rows (docs/benchmarks.md, "The layout
/// is what is left").

#include <type_traits>

#include "gattn/config.hpp"
#include "gattn/types.hpp"

GATTN_BEGIN_ISA_NAMESPACE

/// Read-only view of head-major keys or values (see the file comment): rows() = B·H_kv·N_k rows
/// of d elements, any row stride. It keeps a pointer to the rows, never a copy: it is built from
/// row-major storage only (a RowMatrix, a Map or Ref of one, a block of those), and the storage
/// must outlive the view. A column-major matrix or an expression does not compile (an
/// Eigen::Ref would hold a converted copy that dies with the constructor's argument).
template <class Scalar>
struct HeadMajorRows {
    /// [B·H_kv·N_k, d]; row (b·H_kv + g)·N_k + j: key j, KV head g.
    Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>> matrix;

    /// Views m ([B·H_kv·N_k, d], row-major with contiguous rows, any row stride) as head-major
    /// rows, in place.
    template <class Derived,
              class = std::enable_if_t<Derived::IsRowMajor && Derived::InnerStrideAtCompileTime == 1 &&
                                       (Eigen::internal::traits<Derived>::Flags & Eigen::DirectAccessBit) != 0 &&
                                       std::is_same_v<typename Derived::Scalar, Scalar>>>
    explicit HeadMajorRows(const Eigen::DenseBase<Derived>& m)
        : matrix(m.derived().data(), m.rows(), m.cols(), Eigen::OuterStride<>(m.derived().outerStride())) {}
    /// Rows (B·H_kv·N_k), as Eigen's rows().
    Index rows() const noexcept { return matrix.rows(); }
    /// Columns (d), as Eigen's cols().
    Index cols() const noexcept { return matrix.cols(); }
    /// Elements between consecutive rows, as Eigen's outerStride().
    Index outerStride() const noexcept { return matrix.outerStride(); }
    /// The first element, as Eigen's data().
    const Scalar* data() const noexcept { return matrix.data(); }
};

GATTN_END_ISA_NAMESPACE
