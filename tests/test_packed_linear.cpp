// SPDX-License-Identifier: Apache-2.0
// PackedLinear (16-bit weights packed for this CPU's kernel) against y = x·wᵀ + b computed in
// double from the same rounded weights: x rounded to bf16 where the AMX and AVX512-BF16 kernels
// round it, exact float x on the widened path. Odd sizes (rows, inputs and outputs off the
// tiles' multiples), bias or none, strided x, 16-bit outputs, fp16 weights, thread-count
// invariance, a row's result independent of the rows beside it, argument checks, resident
// bytes; every header-only kernel this CPU runs and, in builds with GATTN_WITH_ONEDNN, the
// oneDNN backend.

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "gattn/ops/packed_linear.hpp"
#include "support/compare.hpp"
#include "support/kernel_limit.hpp"

namespace {

using gattn::Bf16Kernel;
using gattn::bfloat16;
using gattn::half;
using gattn::Index;
using gattn_test::random_matrix;

using gattn_test::KernelLimit;

/// A backend and kernel limit to construct PackedLinear under.
struct Choice {
    gattn::LinearBackend backend;
    Bf16Kernel limit;
};

/// Every backend and header-only kernel that runs here.
std::vector<Choice> runnable() {
    std::vector<Choice> cs;
    const Bf16Kernel best = gattn::bf16_kernel().kernel;
    if (best == Bf16Kernel::Amx) cs.push_back({gattn::LinearBackend::HeaderOnly, Bf16Kernel::Amx});
    if (best == Bf16Kernel::Amx || best == Bf16Kernel::Avx512Bf16)
        cs.push_back({gattn::LinearBackend::HeaderOnly, Bf16Kernel::Avx512Bf16});
    if (best == Bf16Kernel::Bfdot) cs.push_back({gattn::LinearBackend::HeaderOnly, Bf16Kernel::Bfdot});  // ARM64
    cs.push_back({gattn::LinearBackend::HeaderOnly, Bf16Kernel::WidenedFloat});
    if (gattn::compiled_with_onednn() &&
        gattn::PackedLinear<bfloat16>(gattn::RowMatrix<bfloat16>::Zero(1, 1)).backend() == gattn::LinearBackend::OneDnn)
        cs.push_back({gattn::LinearBackend::OneDnn, Bf16Kernel::Amx});
    return cs;
}

/// Whether lin rounds float x to bf16 (the AMX, AVX512-BF16 and BFDOT kernels, oneDNN) or widens its
/// weights.
template <class S>
bool rounds_x(const gattn::PackedLinear<S>& lin) {
    return lin.backend() == gattn::LinearBackend::OneDnn || lin.kernel() != Bf16Kernel::WidenedFloat;
}

#ifdef _OPENMP
/// lin's outputs for x on 1, 2 and 3 OpenMP threads (the caller restores the thread count).
std::vector<gattn::RowMatrix<float>> outputs_on_1_2_3_threads(const gattn::PackedLinear<bfloat16>& lin,
                                                              const gattn::RowMatrix<float>& x) {
    std::vector<gattn::RowMatrix<float>> ys;
    for (int threads : {1, 2, 3}) {
        omp_set_num_threads(threads);
        gattn::RowMatrix<float> y(x.rows(), lin.out_features());
        lin.forward<float, float>(x, y);
        ys.push_back(y);
    }
    return ys;
}
#endif

/// y = x·wᵀ + b in double; x rounded to bf16 first when round_x.
gattn::RowMatrix<double> reference(const gattn::RowMatrix<float>& x, const gattn::RowMatrix<double>& w,
                                   const gattn::Vector<float>& b, bool round_x) {
    gattn::RowMatrix<double> y(x.rows(), w.rows());
    for (Index r = 0; r < x.rows(); ++r)
        for (Index o = 0; o < w.rows(); ++o) {
            double acc = b.size() ? double(b[o]) : 0.0;
            for (Index i = 0; i < x.cols(); ++i)
                acc += (round_x ? double(float(bfloat16(x(r, i)))) : double(x(r, i))) * w(o, i);
            y(r, o) = acc;
        }
    return y;
}

/// Float accumulation over `in` products of size ≤ 1: a bound of in·2⁻²³ plus slack.
double tolerance(Index in) { return 4e-7 * double(in) + 1e-6; }

template <class S>
void check_shapes(Choice c) {
    KernelLimit limit(c.limit);
    // Rows: AVX512-BF16 tiles of 6, AMX tiles of 16 (blocks of 32); inputs: AMX k steps of 32.
    for (Index rows : {1, 5, 6, 13, 17, 33})
        for (Index in : {1, 7, 40, 64, 100, 301})
            for (Index out : {1, 63, 64, 130})
                for (bool with_bias : {false, true}) {
                    const std::string label = "rows " + std::to_string(rows) + " in " + std::to_string(in) + " out " +
                                              std::to_string(out) + (with_bias ? " bias" : "");
                    const std::uint64_t seed = std::uint64_t(rows * 1000 + in * 10 + out);
                    const gattn::RowMatrix<S> w = random_matrix(out, in, seed).cast<S>();
                    const gattn::RowMatrix<float> x = random_matrix(rows, in, seed + 1).cast<float>();
                    const gattn::Vector<float> b =
                        with_bias ? gattn::Vector<float>(random_matrix(out, 1, seed + 2).cast<float>())
                                  : gattn::Vector<float>();
                    const gattn::PackedLinear<S> lin(w, b, c.backend);
                    const auto ref = reference(x, w.template cast<float>().template cast<double>(), b, rounds_x(lin));
                    gattn::RowMatrix<float> y(rows, out);
                    lin.template forward<float, float>(x, y);
                    gattn_test::expect_close(y, ref, tolerance(in), 0.0,
                                             "PackedLinear/" + lin.describe() + " " + label);
                    gattn::RowMatrix<S> y16(rows, out);
                    lin.template forward<float, S>(x, y16);
                    const double rtol = std::is_same_v<S, bfloat16> ? 0x1p-8 : 0x1p-11;
                    gattn_test::expect_close(y16.template cast<float>(), ref, tolerance(in), rtol,
                                             "PackedLinear16/" + lin.describe() + " " + label);
                }
}

TEST(PackedLinear, Bf16MatchesReference) {
    for (Choice c : runnable()) check_shapes<bfloat16>(c);
}

TEST(PackedLinear, HalfMatchesReference) { check_shapes<half>({gattn::LinearBackend::Default, Bf16Kernel::Amx}); }

/// bf16 x gives the same result as the float x it was rounded from (the kernel rounds float x
/// the same way), and a strided x (a column block) the same as a contiguous copy.
TEST(PackedLinear, Bf16InputAndStridedViews) {
    const Index rows = 9, in = 99, out = 70;
    const gattn::RowMatrix<bfloat16> w = random_matrix(out, in, 3).cast<bfloat16>();
    const gattn::RowMatrix<float> wide = random_matrix(rows, in + 10, 4).cast<float>();
    const auto x = wide.middleCols(5, in);
    for (Choice c : runnable()) {
        KernelLimit limit(c.limit);
        const gattn::PackedLinear<bfloat16> lin(w, gattn::Vector<float>(), c.backend);
        gattn::RowMatrix<float> y_view(rows, out), y_copy(rows, out), y_16(rows, out);
        lin.forward<float, float>(x, y_view);
        const gattn::RowMatrix<float> x_copy = x;
        lin.forward<float, float>(x_copy, y_copy);
        EXPECT_TRUE(y_view == y_copy) << lin.describe();
        if (rounds_x(lin)) {
            const gattn::RowMatrix<bfloat16> x16 = x_copy.cast<bfloat16>();
            lin.forward<bfloat16, float>(x16, y_16);
            EXPECT_TRUE(y_16 == y_copy);
        }
    }
}

/// The result is bitwise the same on 1, 2 and 3 threads, for decoding-sized and prefill-sized x.
TEST(PackedLinear, ThreadCountDoesNotChangeResults) {
#ifdef _OPENMP
    const Index in = 512, out = 700;
    const gattn::RowMatrix<bfloat16> w = random_matrix(out, in, 5).cast<bfloat16>();
    const int saved = omp_get_max_threads();
    for (Index rows : {2, 300}) {
        const gattn::RowMatrix<float> x = random_matrix(rows, in, 6).cast<float>();
        for (Choice c : runnable()) {
            KernelLimit limit(c.limit);
            const gattn::PackedLinear<bfloat16> lin(w, gattn::Vector<float>(), c.backend);
            const std::vector<gattn::RowMatrix<float>> ys = outputs_on_1_2_3_threads(lin, x);
            EXPECT_TRUE(ys[0] == ys[1] && ys[0] == ys[2]) << lin.describe() << " rows " << rows;
        }
    }
    omp_set_num_threads(saved);
#else
    GTEST_SKIP() << "built without OpenMP";
#endif
}

/// Up to kLinearGemvRows rows (decoding a batch), a row's result does not depend on the rows
/// beside it: each row alone gives the same bits as in the batch. The AMX kernel keeps this at
/// every row count (rows past 256 cross its row chunks).
TEST(PackedLinear, RowResultDoesNotDependOnOtherRows) {
    const Index in = 100, out = 150;
    const gattn::RowMatrix<bfloat16> w = random_matrix(out, in, 9).cast<bfloat16>();
    const gattn::Vector<float> b = random_matrix(out, 1, 10).cast<float>();
    for (Choice c : runnable()) {
        if (c.backend == gattn::LinearBackend::OneDnn) continue;  // oneDNN blocks by row count
        KernelLimit limit(c.limit);
        const gattn::PackedLinear<bfloat16> lin(w, b, c.backend);
        const bool amx = lin.kernel() == Bf16Kernel::Amx;
        for (Index rows : {Index(2), Index(7), gattn::detail::kLinearGemvRows, Index(40), Index(300)}) {
            if (rows > gattn::detail::kLinearGemvRows && !amx) continue;
            const gattn::RowMatrix<float> x = random_matrix(rows, in, 11 + std::uint64_t(rows)).cast<float>();
            gattn::RowMatrix<float> y(rows, out), y1(1, out);
            lin.forward<float, float>(x, y);
            for (Index r = 0; r < rows; ++r) {
                lin.forward<float, float>(x.row(r), y1);
                ASSERT_TRUE(y1.row(0) == y.row(r)) << lin.describe() << " rows " << rows << " row " << r;
            }
        }
    }
}

/// Where bf16_kernel() is AMX, PackedLinear runs and reports the AMX kernel, and its result is
/// bitwise the same on 1, 2 and 3 threads for few and many rows, with input and output counts
/// off the tiles' multiples.
TEST(PackedLinear, AmxKernelIsReportedAndThreadCountInvariant) {
    if (gattn::bf16_kernel().kernel != Bf16Kernel::Amx) GTEST_SKIP() << gattn::describe(gattn::bf16_kernel());
    const Index in = 1000, out = 650;
    const gattn::RowMatrix<bfloat16> w = random_matrix(out, in, 12).cast<bfloat16>();
    const gattn::Vector<float> b = random_matrix(out, 1, 13).cast<float>();
    const gattn::PackedLinear<bfloat16> lin(w, b, gattn::LinearBackend::HeaderOnly);
    EXPECT_EQ(lin.kernel(), Bf16Kernel::Amx);
    EXPECT_EQ(lin.describe(), "AMX");
#ifdef _OPENMP
    const int saved = omp_get_max_threads();
    for (Index rows : {1, 17, 300}) {
        const gattn::RowMatrix<float> x = random_matrix(rows, in, 14).cast<float>();
        const auto ref = reference(x, w.cast<float>().cast<double>(), b, true);
        const std::vector<gattn::RowMatrix<float>> ys = outputs_on_1_2_3_threads(lin, x);
        gattn_test::expect_close(ys[0], ref, tolerance(in), 0.0, "AMX rows " + std::to_string(rows));
        EXPECT_TRUE(ys[0] == ys[1] && ys[0] == ys[2]) << "rows " << rows;
    }
    omp_set_num_threads(saved);
#endif
}

TEST(PackedLinear, BadArgumentsThrowAndLeaveOutputUntouched) {
    const gattn::RowMatrix<bfloat16> w = random_matrix(8, 6, 7).cast<bfloat16>();
    EXPECT_THROW(gattn::PackedLinear<bfloat16>(w, gattn::Vector<float>::Zero(7)), gattn::shape_error);
    EXPECT_THROW(gattn::PackedLinear<bfloat16>(gattn::RowMatrix<bfloat16>(0, 6)), std::invalid_argument);
    const gattn::PackedLinear<bfloat16> lin(w);
    gattn::RowMatrix<float> y = gattn::RowMatrix<float>::Constant(3, 8, 2.0f);
    try {
        lin.forward<float, float>(gattn::RowMatrix<float>::Zero(3, 5), y);
        ADD_FAILURE() << "no exception";
    } catch (const gattn::shape_error& e) {
        EXPECT_NE(std::string(e.what()).find("x must have shape [R, 6]"), std::string::npos) << e.what();
    }
    auto forward = [&](gattn::ConstMatrixRef<float> x, gattn::MatrixRef<float> out) {
        lin.forward<float, float>(x, out);
    };
    gattn::RowMatrix<float> short_out(2, 8);
    EXPECT_THROW(forward(gattn::RowMatrix<float>::Zero(3, 6), short_out), gattn::shape_error);
    gattn::RowMatrix<float> buffer = gattn::RowMatrix<float>::Zero(3, 14);
    EXPECT_THROW(forward(buffer.leftCols(6), buffer.rightCols(8)), std::invalid_argument);
    EXPECT_TRUE((y.array() == 2.0f).all());
}

/// A loaded layer holds its weights' 16-bit bytes, not a widened copy.
TEST(PackedLinear, HoldsSixteenBitBytes) {
    const Index in = 2048, out = 256;
    const gattn::RowMatrix<bfloat16> w = gattn::RowMatrix<bfloat16>::Zero(out, in);
    for (Choice c : runnable()) {
        KernelLimit limit(c.limit);
        const gattn::PackedLinear<bfloat16> lin(w, gattn::Vector<float>(), c.backend);
        EXPECT_EQ(lin.bytes(), std::size_t(in * out * 2)) << lin.describe();
    }
}

/// The backend is reported: describe() names oneDNN's implementation or says why oneDNN is not
/// used; asking for oneDNN where it cannot run is an error that says why.
TEST(PackedLinear, BackendIsReported) {
    const gattn::RowMatrix<bfloat16> w = random_matrix(8, 6, 8).cast<bfloat16>();
    const gattn::PackedLinear<bfloat16> lin(w);
    const gattn::PackedLinear<half> lin16(w.cast<float>().cast<half>());
    // The header-only kernel is SDPA's bf16 family (BFDOT on ARM64 with BF16).
    EXPECT_EQ(gattn::PackedLinear<bfloat16>(w, gattn::Vector<float>(), gattn::LinearBackend::HeaderOnly).kernel(),
              gattn::bf16_kernel().kernel);
    EXPECT_EQ(lin16.backend(), gattn::LinearBackend::HeaderOnly);
    EXPECT_NE(lin16.describe().find("oneDNN: used for bf16 weights only"), std::string::npos) << lin16.describe();
    EXPECT_THROW(gattn::PackedLinear<half>(w.cast<float>().cast<half>(), gattn::Vector<float>(),
                                           gattn::LinearBackend::OneDnn),
                 std::invalid_argument);
    if (!gattn::compiled_with_onednn()) {
        EXPECT_EQ(lin.backend(), gattn::LinearBackend::HeaderOnly);
        EXPECT_NE(lin.describe().find("oneDNN: not built in"), std::string::npos) << lin.describe();
        try {
            gattn::PackedLinear<bfloat16>(w, gattn::Vector<float>(), gattn::LinearBackend::OneDnn);
            ADD_FAILURE() << "no exception";
        } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find("OneDnn cannot run: oneDNN: not built in"), std::string::npos)
                << e.what();
        }
    } else if (lin.backend() == gattn::LinearBackend::OneDnn) {
        EXPECT_EQ(lin.describe().rfind("oneDNN ", 0), 0u) << lin.describe();
    }
    const gattn::PackedLinear<bfloat16> own(w, gattn::Vector<float>(), gattn::LinearBackend::HeaderOnly);
    EXPECT_EQ(own.backend(), gattn::LinearBackend::HeaderOnly);
}

}  // namespace
