// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Linear layer out = x·wᵀ + b (PyTorch's nn.Linear: w is [out_features, in_features]) with the
/// weights stored in 16 bits (bf16 or fp16) and packed once, at construction, for the kernel
/// that will multiply them; accumulation in float.
///
/// Kernels (the same families as SDPA's, gattn::bf16_kernel()):
///  - AMX, bf16 weights: panels of 64 outputs as below, their pair rows padded with zero pairs
///    to a multiple of 16 (in_features to a multiple of 32) and laid out as TDPBF16PS B tiles
///    (VNNI layout: 16 pair rows × 16 outputs, 1 KiB, rows of 64 bytes): each group of 16
///    outputs holds its tiles of every k step (16 pairs) one after the other, so that a tile
///    load reads 16 consecutive lines and a panel streams from memory as 4 sequential streams
///    (the hardware prefetchers serve several streams faster than one). x is rounded to bf16 as
///    below into a per-thread copy padded with zeros to whole A tiles (16 rows × 16 pairs); a
///    call of fewer than 16 rows configures its A and C tiles with only those rows.
///    Each output is the float accumulator of TDPBF16PS products over the k steps of 16 pairs,
///    in input order, plus the bias in float. Per thread, one tile configuration per call (C in
///    tiles 0–3, x and weights in 4–7), released at the end; rows in chunks of 256 (their x
///    stays in L2), then per panel blocks of 32 rows × 32 outputs (2 × 2 C tiles) and a last
///    block of up to 16 rows × 64 outputs (1 × 4), the next tiles' lines prefetched into L1 two
///    k steps ahead. Rows past the last and outputs past out_features are computed on zero
///    padding and not stored. Every row count runs on AMX: a row's products and their order
///    do not depend on the block it falls in, so a row's result never depends on the other
///    rows. At 1–2 rows (decoding; the weights stream from L3 or memory) AMX ran at 0.7–1.1×
///    the AVX512-BF16 kernel's speed, at 8 rows 1.2–1.4×, at 16 rows 1.9–2.4×, from 64 rows
///    2–5× (2048 → 256, 2048 and 4608, one thread); sending 1–2 rows to AVX512-BF16 would make
///    a row decoded alone differ from the same row decoded in a batch. (Measured before the
///    tile layout above; see bench_gated_layer's BM_ProjectionBf16 for the present ratios.)
///  - AVX512-BF16, bf16 weights: the weights are packed as pairs of inputs in panels of 64
///    outputs, [⌈in/2⌉][64] pairs per panel (the same bytes as the bf16 weights); x is rounded
///    to bf16 (nearest even) when it is float, and each output is Σ over input pairs of
///    VDPBF16PS products, in float, in input order, plus the bias in float. Tiles of 6 rows of x
///    × 64 outputs (24 accumulators); the panels are split over the OpenMP threads.
///  - BFDOT (ARM64 with BF16), bf16 weights: the AVX512-BF16 kernel's packing and rounding;
///    each panel in slices of 16 outputs (8 above 4 rows), the pairs four at a time by BFDOT by
///    element (simd/arm_neon_bf16.hpp), tiles of up to 6 rows of x.
///  - Widened float (fp16 weights; bf16 without a dot-product kernel): the weights stay as given; each
///    panel of 64 output rows is widened exactly to float in a per-thread scratch and multiplied
///    by float x with Eigen (one thread per panel): a matrix-vector product per row up to
///    kLinearGemvRows rows, a GEMM above.
/// Each kernel computes each output on one thread in a fixed order: the result does not depend
/// on the thread count, and, up to kLinearGemvRows rows (decoding a batch; AMX: at any row
/// count; BFDOT: at any row count), a row's result does not depend on the other rows. AMX and AVX512-BF16 sum the same
/// products in different orders and roundings, so their results differ in the last bits.
///
/// Optional backend: with GATTN_WITH_ONEDNN defined and libdnnl linked (CMake
/// -DGATTN_WITH_ONEDNN=ON), bf16 weights go to oneDNN's matmul by default (AMX where oneDNN
/// finds it; ops/onednn_linear.hpp), with x rounded to bf16 as above.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "gattn/errors.hpp"
#include "gattn/ops/bf16_flash_kernel.hpp"
#include "gattn/ops/linear.hpp"
#include "gattn/ops/sdpa.hpp"  // detail::overlaps_any, span_of
#include "gattn/simd/cpu.hpp"
#include "gattn/types.hpp"
#if defined(GATTN_WITH_ONEDNN)
#include "gattn/ops/onednn_linear.hpp"
#endif

GATTN_BEGIN_ISA_NAMESPACE

/// Who multiplies a PackedLinear's weights.
enum class LinearBackend {
    Default,     ///< oneDNN for bf16 weights when built with it and it runs here; else HeaderOnly
    HeaderOnly,  ///< gattn's own kernels (AMX, AVX512-BF16 or widened float)
    OneDnn,      ///< oneDNN's matmul (bf16 weights, GATTN_WITH_ONEDNN builds only)
};

namespace detail {
inline LinearBackend& default_linear_backend() noexcept {
    static LinearBackend backend = LinearBackend::Default;
    return backend;
}
}  // namespace detail

/// What LinearBackend::Default stands for in the PackedLinear objects (and so the layers)
/// constructed from now on: Default (oneDNN where it runs), HeaderOnly or OneDnn. For
/// comparisons and tests; set it before constructing, from one thread (it is not synchronised).
inline void set_default_linear_backend(LinearBackend backend) noexcept { detail::default_linear_backend() = backend; }

/// Whether this build contains the oneDNN backend (GATTN_WITH_ONEDNN).
inline constexpr bool compiled_with_onednn() noexcept {
#if defined(GATTN_WITH_ONEDNN)
    return true;
#else
    return false;
#endif
}

namespace detail {

/// Per-thread scratch of PackedLinear (grows only).
struct PackedLinearScratch {
    std::vector<std::uint32_t> x_pairs;  // x rounded to bf16, [rows][⌈in/2⌉] pairs
    RowMatrix<float> x_wide;             // x widened, [rows, in]
    RowMatrix<float> panel;              // one panel's weights widened, [64, in]
    static PackedLinearScratch& for_this_thread() {
        thread_local PackedLinearScratch s;
        return s;
    }
};

}  // namespace detail

/// A linear layer y = x·wᵀ + b with 16-bit weights packed once for this CPU's kernel.
/// Storage: gattn::bfloat16 or gattn::half. Resident memory: the weights' own 16-bit bytes (plus
/// up to 63 rows of zero padding per layer and, for AMX, up to 31 zero inputs per row), the
/// bias in float.
template <class Storage>
class PackedLinear {
    static_assert(is_narrow_storage_v<Storage>, "GATTN_PACKED_LINEAR_STORAGE_MUST_BE_BFLOAT16_OR_HALF");

public:
    PackedLinear() = default;

    /// \param weight  [out_features, in_features] (nn.Linear layout, any row stride; copied).
    /// \param bias    [out_features] in float, or empty for none.
    /// \param backend Default (unless set_default_linear_backend says otherwise): oneDNN when
    ///                this build has it, the weights are bf16 and oneDNN runs here, else the
    ///                header-only kernels (describe() says why).
    /// The backend and kernel are chosen here (gattn::bf16_kernel(), limits included) and kept.
    /// \throws shape_error when bias is neither empty nor out_features long;
    ///         std::invalid_argument when a dimension is 0, or when backend is OneDnn and oneDNN
    ///         cannot run (not built in, fp16 weights, no bf16 matmul for this CPU).
    explicit PackedLinear(ConstMatrixRef<Storage> weight, const Vector<float>& bias = Vector<float>(),
                          LinearBackend backend = LinearBackend::Default) {
        constexpr const char* fn = "gattn::PackedLinear";
        if (weight.rows() == 0 || weight.cols() == 0)
            detail::throw_invalid(fn, "weight",
                                  "must have out_features, in_features >= 1, got " +
                                      detail::shape_string({weight.rows(), weight.cols()}));
        if (bias.size() != 0 && bias.size() != weight.rows())
            detail::throw_shape(fn, "bias", "[0] or " + detail::shape_string({weight.rows()}),
                                detail::shape_string({bias.size()}));
        m_in = weight.cols();
        m_out = weight.rows();
        if (backend == LinearBackend::Default) backend = detail::default_linear_backend();
        if (backend != LinearBackend::HeaderOnly && try_onednn(weight, bias, backend == LinearBackend::OneDnn)) return;
        m_bias = bias;
        m_kernel = std::is_same_v<Storage, bfloat16> ? detail::bf16_kernel_family() : Bf16Kernel::WidenedFloat;
        if (m_kernel == Bf16Kernel::WidenedFloat) {
            m_rows = weight;
            return;
        }
        // Panels of 64 outputs, [⌈in/2⌉][64] pairs each (AMX: ⌈in/32⌉·16 pairs each, as B tiles,
        // detail::amx_panel_offset); outputs and pairs past the weights' are zero.
        const Index pairs = (m_in + 1) / 2, panels = (m_out + detail::kLinearPanel - 1) / detail::kLinearPanel;
        const bool amx = m_kernel == Bf16Kernel::Amx;
        m_pair_rows = amx ? (pairs + detail::kAmxPairs - 1) / detail::kAmxPairs * detail::kAmxPairs : pairs;
        m_packed.setZero(panels * m_pair_rows, detail::kLinearPanel);
        const Index kblocks = m_pair_rows / detail::kAmxPairs;
        for (Index o = 0; o < m_out; ++o) {
            std::uint32_t* panel = m_packed.data() + (o / detail::kLinearPanel) * m_pair_rows * detail::kLinearPanel;
            const Index j = o % detail::kLinearPanel;
            const Storage* w = weight.data() + o * weight.outerStride();
            for (Index p = 0; p < pairs; ++p)
                panel[amx ? detail::amx_panel_offset(p, j, kblocks) : p * detail::kLinearPanel + j] =
                    std::uint32_t(kernel::bits16(w[2 * p])) |
                    (2 * p + 1 < m_in ? std::uint32_t(kernel::bits16(w[2 * p + 1])) << 16 : 0u);
        }
    }

    /// Inputs per row of x (the weight's columns).
    Index in_features() const noexcept { return m_in; }
    /// Outputs per row (the weight's rows).
    Index out_features() const noexcept { return m_out; }
    /// The backend chosen at construction: HeaderOnly or OneDnn.
    LinearBackend backend() const noexcept { return m_backend; }
    /// The header-only kernel chosen at construction (meaningful when backend() is HeaderOnly).
    Bf16Kernel kernel() const noexcept { return m_kernel; }
    /// One line for logs: "oneDNN <implementation>" or "<kernel> (<why not oneDNN>)".
    std::string describe() const {
        if (m_backend == LinearBackend::OneDnn) return "oneDNN " + m_onednn_name;
        return std::string(kernel_name(m_kernel)) + (m_why_not_onednn.empty() ? "" : " (" + m_why_not_onednn + ")");
    }
    /// Bytes of weights and bias held.
    std::size_t bytes() const noexcept {
        return onednn_bytes() + sizeof(std::uint32_t) * static_cast<std::size_t>(m_packed.size()) +
               sizeof(Storage) * static_cast<std::size_t>(m_rows.size()) +
               sizeof(float) * static_cast<std::size_t>(m_bias.size());
    }

    /// out = x·wᵀ + b. X, Y: float or Storage (the output is rounded once, to nearest even).
    /// \param x   [R, in_features], any row stride.
    /// \param out [R, out_features], written; must share no memory with x.
    /// \throws shape_error when a shape disagrees; std::invalid_argument when out overlaps x
    ///         or its rows overlap (row stride < out_features).
    /// Nothing is written before the checks pass.
    template <class X, class Y>
    void forward(ConstMatrixRef<X> x, MatrixRef<Y> out) const {
        static_assert(std::is_same_v<X, float> || std::is_same_v<X, Storage>, "x: float or the storage type");
        static_assert(std::is_same_v<Y, float> || std::is_same_v<Y, Storage>, "out: float or the storage type");
        constexpr const char* fn = "gattn::PackedLinear::forward";
        if (x.cols() != m_in)
            detail::throw_shape(fn, "x", "[R, " + std::to_string(m_in) + "]",
                                detail::shape_string({x.rows(), x.cols()}));
        detail::check_output(fn, "out", out, x.rows(), m_out);
        if (detail::overlaps_any(x.data(), detail::span_of(x), out.data(), detail::span_of(out)))
            detail::throw_invalid(fn, "out", "must not share memory with x");
        const Index rows = x.rows();
        if (rows == 0) return;
        // Float results go straight to out when it is float; else to a staging matrix.
        RowMatrix<float> staged;
        float* y;
        Index ldy;
        if constexpr (std::is_same_v<Y, float>) {
            y = out.data();
            ldy = out.outerStride();
        } else {
            staged.resize(rows, m_out);
            y = staged.data();
            ldy = m_out;
        }
        if (m_backend == LinearBackend::OneDnn)
            forward_onednn(x, y, ldy);
        else if (m_kernel == Bf16Kernel::WidenedFloat)
            forward_widened(x, y, ldy);
        else if (m_kernel == Bf16Kernel::Amx && compiled_with_amx())
            forward_amx(x, y, ldy);
        else
            forward_pairs(x, y, ldy);
        if constexpr (!std::is_same_v<Y, float>)
            for (Index r = 0; r < rows; ++r) kernel::narrow_row(staged.data() + r * m_out, &out(r, 0), m_out);
    }

private:
    /// Sets up the oneDNN backend; false (with the reason kept) when it cannot run and
    /// `required` is false. Throws std::invalid_argument when it cannot run and is required.
    bool try_onednn([[maybe_unused]] ConstMatrixRef<Storage> weight, [[maybe_unused]] const Vector<float>& bias,
                    bool required) {
        std::string why;
        if constexpr (!std::is_same_v<Storage, bfloat16>) {
            why = "oneDNN: used for bf16 weights only";
        } else if constexpr (!compiled_with_onednn()) {
            why = "oneDNN: not built in (define GATTN_WITH_ONEDNN and link libdnnl)";
        } else {
#if defined(GATTN_WITH_ONEDNN)
            try {
                m_onednn = detail::OneDnnLinear(weight, bias);
                m_onednn_name = m_onednn.implementation();
                m_backend = LinearBackend::OneDnn;
                return true;
            } catch (const dnnl::error& e) {
                why = std::string("oneDNN: no bf16 matmul on this CPU (") + e.what() + ")";
            }
#endif
        }
        if (required) detail::throw_invalid("gattn::PackedLinear", "backend", "OneDnn cannot run: " + why);
        m_why_not_onednn = why;
        return false;
    }

    std::size_t onednn_bytes() const noexcept {
#if defined(GATTN_WITH_ONEDNN)
        return m_onednn.bytes();
#else
        return 0;
#endif
    }

    template <class X>
    void forward_onednn([[maybe_unused]] ConstMatrixRef<X> x, [[maybe_unused]] float* y,
                        [[maybe_unused]] Index ldy) const {
#if defined(GATTN_WITH_ONEDNN)
        // oneDNN reads contiguous bf16 rows: contiguous bf16 x as it is; otherwise a copy, float
        // x rounded once (nearest even), as for the header-only kernel.
        const Index rows = x.rows();
        if constexpr (std::is_same_v<X, bfloat16>)
            if (x.outerStride() == m_in || rows == 1) return m_onednn.forward(x.data(), rows, y, ldy);
        thread_local std::vector<bfloat16> x16;
        if (static_cast<Index>(x16.size()) < rows * m_in) x16.resize(static_cast<std::size_t>(rows * m_in));
        for (Index r = 0; r < rows; ++r) {
            const X* xr = x.data() + r * x.outerStride();
            if constexpr (std::is_same_v<X, bfloat16>)
                std::copy(xr, xr + m_in, x16.data() + r * m_in);
            else
                kernel::narrow_row(xr, x16.data() + r * m_in, m_in);
        }
        m_onednn.forward(x16.data(), rows, y, ldy);
#endif
    }

    template <class X>
    void forward_widened(ConstMatrixRef<X> x, float* y, Index ldy) const {
        const Index rows = x.rows(), panels = (m_out + detail::kLinearPanel - 1) / detail::kLinearPanel;
        const float* xf;
        Index ldx;
        auto& caller = detail::PackedLinearScratch::for_this_thread();
        if constexpr (std::is_same_v<X, float>) {
            xf = x.data();
            ldx = x.outerStride();
        } else {
            if (caller.x_wide.size() < rows * m_in) caller.x_wide.resize(rows, m_in);
            for (Index r = 0; r < rows; ++r)
                kernel::widen_row(x.data() + r * x.outerStride(), caller.x_wide.data() + r * m_in, m_in);
            xf = caller.x_wide.data();
            ldx = m_in;
        }
        using ConstMap = Eigen::Map<const RowMatrix<float>, 0, Eigen::OuterStride<>>;
        using Map = Eigen::Map<RowMatrix<float>, 0, Eigen::OuterStride<>>;
        const ConstMap xm(xf, rows, m_in, Eigen::OuterStride<>(ldx));
        // Always a parallel region: inside one, Eigen's GEMM runs on one thread, so a panel's
        // blocking (and its rounding) does not depend on the thread count.
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
        for (Index k = 0; k < panels; ++k) {
            const Index o = k * detail::kLinearPanel, n = std::min(detail::kLinearPanel, m_out - o);
            auto& s = detail::PackedLinearScratch::for_this_thread();
            if (s.panel.size() < detail::kLinearPanel * m_in) s.panel.resize(detail::kLinearPanel, m_in);
            for (Index j = 0; j < n; ++j)
                kernel::widen_row(m_rows.data() + (o + j) * m_in, s.panel.data() + j * m_in, m_in);
            const ConstMap wk(s.panel.data(), n, m_in, Eigen::OuterStride<>(m_in));
            Map yk(y + o, rows, n, Eigen::OuterStride<>(ldy));
            // A few rows (decoding): one matrix-vector product per row, so that a row's result
            // does not depend on how many rows come with it (Eigen's GEMM blocks by row count).
            if (rows <= detail::kLinearGemvRows)
                for (Index r = 0; r < rows; ++r) yk.row(r).noalias() = xm.row(r) * wk.transpose();
            else
                yk.noalias() = xm * wk.transpose();
            if (m_bias.size()) yk.rowwise() += m_bias.segment(o, n).transpose();
        }
    }

    template <class X>
    void forward_pairs(ConstMatrixRef<X> x, float* y, Index ldy) const {
        if constexpr (!simd::avx512bf16::kEnabled && !simd::neon_bf16::kEnabled) {
            (void)x, (void)y, (void)ldy;
        } else {
            const Index rows = x.rows(), pairs = (m_in + 1) / 2;
            const Index panels = (m_out + detail::kLinearPanel - 1) / detail::kLinearPanel;
            // x as bf16 pairs, rounded once when it is float.
            auto& caller = detail::PackedLinearScratch::for_this_thread();
            if (static_cast<Index>(caller.x_pairs.size()) < rows * pairs)
                caller.x_pairs.resize(static_cast<std::size_t>(rows * pairs));
            std::uint32_t* xp = caller.x_pairs.data();
            for (Index r = 0; r < rows; ++r)
                detail::linear_pack_x(x.data() + r * x.outerStride(), m_in, xp + r * pairs);
            const float* bias = m_bias.size() ? m_bias.data() : nullptr;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (panels > 1 && rows * m_out * m_in >= (Index(1) << 20))
#endif
            for (Index k = 0; k < panels; ++k) {
                const Index o = k * detail::kLinearPanel, n = std::min(detail::kLinearPanel, m_out - o);
                const std::uint32_t* panel = m_packed.data() + k * m_pair_rows * detail::kLinearPanel;
                for (Index r0 = 0; r0 < rows; r0 += 6) {
                    const int tile = static_cast<int>(std::min<Index>(6, rows - r0));
                    kernel::with_constant<7>(tile, [&](auto count) {
                        constexpr int R = decltype(count)::value;
                        if constexpr (R > 0)
                            detail::linear_tile<R>(xp + r0 * pairs, pairs, panel, bias ? bias + o : nullptr,
                                                   y + r0 * ldy + o, ldy, n);
                    });
                }
            }
        }
    }

    template <class X>
    void forward_amx(ConstMatrixRef<X> x, float* y, Index ldy) const {
        if constexpr (!simd::amx::kEnabled) {
            (void)x, (void)y, (void)ldy;
        } else {
            using detail::kAmxPairs;
            using detail::kAmxRows;
            using detail::kLinearPanel;
            const Index rows = x.rows(), pairs = (m_in + 1) / 2, kblocks = m_pair_rows / kAmxPairs;
            const Index panels = (m_out + kLinearPanel - 1) / kLinearPanel;
            // x as bf16 pairs, rounded once when it is float, in whole tiles: rows padded with zero
            // rows to a multiple of 16, pairs with zero pairs to m_pair_rows; the row stride is 16
            // pairs (64 bytes) longer, so that a tile's rows do not all fall in one L1 set.
            const Index lda = m_pair_rows + kAmxPairs, padded_rows = (rows + kAmxRows - 1) / kAmxRows * kAmxRows;
            auto& caller = detail::PackedLinearScratch::for_this_thread();
            if (static_cast<Index>(caller.x_pairs.size()) < padded_rows * lda)
                caller.x_pairs.resize(static_cast<std::size_t>(padded_rows * lda));
            std::uint32_t* xp = caller.x_pairs.data();
            for (Index r = 0; r < rows; ++r) {
                std::uint32_t* dst = xp + r * lda;
                detail::linear_pack_x(x.data() + r * x.outerStride(), m_in, dst);
                std::fill(dst + pairs, dst + lda, 0u);
            }
            std::fill(xp + rows * lda, xp + padded_rows * lda, 0u);
            const float* bias = m_bias.size() ? m_bias.data() : nullptr;
#ifdef _OPENMP
#pragma omp parallel if (panels > 1 && rows * m_out * m_in >= (Index(1) << 20))
#endif
            {
                const detail::LinearAmxTiles tiles(rows);  // released at the end of the block
                alignas(64) float c[2 * kAmxRows * kLinearPanel];
                // Chunks of rows outside, so that a chunk's x pairs stay in L2 while the panels
                // pass; inside, blocks of 32 rows × 32 outputs, and a last block of up to 16 rows
                // × 64 outputs.
                for (Index c0 = 0; c0 < rows; c0 += kAmxChunkRows) {
                    const Index c1 = std::min(rows, c0 + kAmxChunkRows);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
                    for (Index k = 0; k < panels; ++k) {
                        const Index o = k * kLinearPanel, n = std::min(kLinearPanel, m_out - o);
                        const std::uint32_t* panel = m_packed.data() + k * m_pair_rows * kLinearPanel;
                        const float* b = bias ? bias + o : nullptr;
                        Index r0 = c0;
                        for (; c1 - r0 > kAmxRows; r0 += 2 * kAmxRows) {
                            const Index m = std::min(2 * kAmxRows, c1 - r0);
                            for (Index h = 0; h < n; h += 32) {
                                detail::linear_amx_block(xp + r0 * lda, lda,
                                                         panel + h / 16 * kblocks * detail::kAmxTile, kblocks, c);
                                detail::linear_amx_store(c, 32, m, b ? b + h : nullptr, y + r0 * ldy + o + h, ldy,
                                                         std::min<Index>(32, n - h));
                            }
                        }
                        if (r0 < c1) {
                            detail::linear_amx_row_tile(xp + r0 * lda, lda, panel, kblocks, c);
                            detail::linear_amx_store(c, kLinearPanel, c1 - r0, b, y + r0 * ldy + o, ldy, n);
                        }
                    }
                }
            }
        }
    }

    /// Rows of x per chunk of the AMX kernel (its x pairs: 1 MiB at in_features 2048).
    static constexpr Index kAmxChunkRows = 256;

    Index m_in = 0, m_out = 0;
    Index m_pair_rows = 0;  // pair rows per panel: ⌈in/2⌉, rounded up to 16 for AMX
    LinearBackend m_backend = LinearBackend::HeaderOnly;
    Bf16Kernel m_kernel = Bf16Kernel::WidenedFloat;
    std::string m_why_not_onednn, m_onednn_name;
#if defined(GATTN_WITH_ONEDNN)
    detail::OneDnnLinear m_onednn;
#endif
    Eigen::Matrix<std::uint32_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> m_packed;  // AMX, AVX512-BF16 panels
    RowMatrix<Storage> m_rows;  // widened kernel: the weights as given
    Vector<float> m_bias;
};

/// How the layers keep a projection of Scalar weights: packed 16-bit (PackedLinear) or float
/// and double as given (DenseLinear); both have the same interface.
template <class Scalar>
using Projection = std::conditional_t<is_narrow_storage_v<Scalar>, PackedLinear<Scalar>, DenseLinear<Scalar>>;

GATTN_END_ISA_NAMESPACE
