// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Products of small tiles, C = A·B or C += A·B, in registers: the five products of each tile
/// of the backward pass (ops/sdpa_backward.hpp) and both products of the forward kernel's
/// few-query blocks (ops/flash_kernel.hpp, flash_row_step). B's rows are read as vectors (row-major, any
/// row stride); A is read one element at a time and broadcast, through a row stride and a
/// depth stride, so A may be a row-major tile or the transpose of one and neither is packed.
/// C is computed in blocks of kRows rows × kCols registers (by default the forward's tile geometry,
/// simd::FlashTiles), each held in registers over the whole depth, so a k-step loads kCols
/// vectors of B and broadcasts kRows elements of A for kRows·kCols fused multiply-adds.
///
/// Every element of C adds its depth terms in order 0, 1, …, k − 1 by fused multiply-adds,
/// starting from 0 or from C's old value: the result depends neither on the blocking nor on
/// which thread runs it. Columns past the last whole register are summed element by element in
/// the same order.

#include <algorithm>
#include <type_traits>
#include <utility>

#include "gattn/simd/math.hpp"
#include "gattn/simd/tiers.hpp"
#include "gattn/types.hpp"

GATTN_BEGIN_ISA_NAMESPACE
namespace kernel {

/// Calls f(std::integral_constant<int, I>{}) for the I in [0, N) that equals i, nothing when
/// i is outside: a count known at run time (dead query registers, rows of a group) turned
/// into a template argument, so that register arrays stay indexed by constants.
template <int N, int I = 0, class F>
inline void with_constant(int i, F&& f) {
    if constexpr (I < N) {
        if (i == I)
            f(std::integral_constant<int, I>{});
        else
            with_constant<N, I + 1>(i, std::forward<F>(f));
    }
}

/// What tile_product calls at each k-step when given nothing: nothing.
struct NoStepHook {
    void operator()() const noexcept {}
};

/// One block of C: R rows × V registers, over `depth` k-steps. a(r, k) = a[r·a_row + k·a_depth],
/// B's row k at b + k·b_row, C's row r at c + r·c_row. hook() runs once per k-step.
/// ARow > 0: A's row stride as a constant (a_row_ is ignored), so that the broadcasts of a tall
/// block (many rows, one register) address A at constant offsets from one pointer; with a run-time
/// stride GCC keeps R offsets, spilled to the stack past the general registers' count.
template <class T, int R, int V, bool Accumulate, Index ARow = 0, class Hook = NoStepHook>
inline void product_block(const T* a, Index a_row_, Index a_depth, const T* b, Index b_row, Index depth, T* c,
                          Index c_row, const Hook& hook = {}) noexcept {
    if constexpr (R > 0 && V > 0) {
        using B = simd::Batch<T>;
        constexpr Index L = static_cast<Index>(simd::kLanes<T>);
        const Index a_row = ARow > 0 ? ARow : a_row_;
        B acc[R][V];
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            GATTN_UNROLL
            for (int v = 0; v < V; ++v) acc[r][v] = Accumulate ? B::load_unaligned(c + r * c_row + v * L) : B(T(0));
        }
        for (Index k = 0; k < depth; ++k) {
            hook();
            const T* bk = b + k * b_row;
            const T* ak = a + k * a_depth;
            B bv[V];
            GATTN_UNROLL
            for (int v = 0; v < V; ++v) bv[v] = B::load_unaligned(bk + v * L);
            GATTN_UNROLL
            for (int r = 0; r < R; ++r) {
                const B ar(ak[r * a_row]);
                GATTN_UNROLL
                for (int v = 0; v < V; ++v) acc[r][v] = simd::fma(ar, bv[v], acc[r][v]);
            }
        }
        GATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            GATTN_UNROLL
            for (int v = 0; v < V; ++v) acc[r][v].store_unaligned(c + r * c_row + v * L);
        }
    }
}

/// C[m × n] = A[m × depth]·B[depth × n] (Accumulate: C += A·B), with a(i, k) =
/// a[i·a_row + k·a_depth], B's row k at b + k·b_row (n contiguous elements) and C's row i at
/// c + i·c_row. C must not overlap A or B. hook() runs once per k-step of each register block
/// (a few-query block's prefetches, spread over its work: ops/flash_kernel.hpp). R × V: the
/// register blocks' shape (the tier's FlashTiles by default). ARow: as product_block.
template <class T, bool Accumulate, int R = simd::FlashTiles::kRows, int V = simd::FlashTiles::kCols, Index ARow = 0,
          class Hook = NoStepHook>
inline void tile_product(int m, int n, Index depth, const T* a, Index a_row, Index a_depth, const T* b, Index b_row,
                         T* c, Index c_row, const Hook& hook = {}) noexcept {
    constexpr int L = static_cast<int>(simd::kLanes<T>);
    const int vectors = n / L;
    for (int i = 0; i < m; i += R) {
        const T* ai = a + i * a_row;
        T* ci = c + i * c_row;
        with_constant<R + 1>(std::min(R, m - i), [&](auto rows) {
            constexpr int RR = decltype(rows)::value;
            for (int v = 0; v < vectors; v += V)
                with_constant<V + 1>(std::min(V, vectors - v), [&](auto cols) {
                    product_block<T, RR, decltype(cols)::value, Accumulate, ARow>(ai, a_row, a_depth, b + v * L, b_row,
                                                                                  depth, ci + v * L, c_row, hook);
                });
        });
        for (int r = i; r < std::min(m, i + R); ++r)
            for (int j = vectors * L; j < n; ++j) {
                T sum = Accumulate ? c[r * c_row + j] : T(0);
                for (Index k = 0; k < depth; ++k) sum += a[r * a_row + k * a_depth] * b[k * b_row + j];
                c[r * c_row + j] = sum;
            }
    }
}

}  // namespace kernel
GATTN_END_ISA_NAMESPACE
