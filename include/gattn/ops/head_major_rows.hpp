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

#include "gattn/config.hpp"
#include "gattn/types.hpp"

GATTN_BEGIN_ISA_NAMESPACE

/// Read-only view of head-major keys or values (see the file comment): rows() = B·H_kv·N_k rows
/// of d elements, any row stride.
template <class Scalar>
struct HeadMajorRows {
    ConstMatrixRef<Scalar> matrix;  ///< [B·H_kv·N_k, d]; row (b·H_kv + g)·N_k + j: key j, KV head g

    /// Views m ([B·H_kv·N_k, d], row-major, any row stride) as head-major rows.
    explicit HeadMajorRows(ConstMatrixRef<Scalar> m) : matrix(m) {}
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
