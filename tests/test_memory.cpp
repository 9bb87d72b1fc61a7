// SDPA's extra memory is a few tiles per thread, never N_q × N_k: N = 65,536 runs within a
// small budget, forward and backward. Its own executable, so that the process's peak resident size measures this test
// alone.

#include <gtest/gtest.h>

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "gattn/gattn.hpp"

namespace {

using gattn::Index;
using Matrix = gattn::RowMatrix<float>;

/// Peak resident set size of this process so far, in bytes.
double peak_rss_bytes() {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    return double(usage.ru_maxrss) * 1024.0;  // Linux reports KiB
}

TEST(SdpaMemory, SixtyFourThousandTokensUseTilesNotScores) {
    const Index n = 65536, d = 128;
    // Inputs and output: 4 × 32 MiB, touched (filled) before the baseline is taken.
    Matrix q = Matrix::Random(n, d), k = Matrix::Random(n, d), v = Matrix::Random(n, d);
    Matrix out = Matrix::Constant(n, d, 1.0f);  // nonzero: zero-filled pages may stay unmapped
    // The same three paths on 1,024 tokens first, so that what the threads set up once (their
    // stacks; under AddressSanitizer, its fake stacks: 14 MiB at AVX2) is in the baseline.
    {
        const Index m = 1024;
        Matrix small(m, d);
        gattn::SdpaOptions<float> w;
        w.mask.causal = true;
        w.mask.sliding_window = 256;
        gattn::scaled_dot_product_attention<float>(q.topRows(m), k.topRows(m), v.topRows(m), {1, 1, 1}, small, w);
        gattn::scaled_dot_product_attention<float>(q.topRows(256), k.topRows(m), v.topRows(m), {1, 1, 1},
                                                   small.topRows(256));
        gattn::scaled_dot_product_attention<float>(q.topRows(1), k.topRows(m), v.topRows(m), {1, 1, 1},
                                                   small.topRows(1));
    }
    const double before = peak_rss_bytes();

    // All 65,536 queries, causal with a 256-key window: linear work, and a materialised score
    // matrix would need 16 GiB.
    gattn::SdpaOptions<float> windowed;
    windowed.mask.causal = true;
    windowed.mask.sliding_window = 256;
    gattn::scaled_dot_product_attention<float>(q, k, v, {1, 1, 1}, out, windowed);
    // 256 queries against all 65,536 keys without a window (64 MiB of scores if materialised).
    Matrix out_few = Matrix::Constant(256, d, 1.0f);
    gattn::scaled_dot_product_attention<float>(q.bottomRows(256), k, v, {1, 1, 1}, out_few);
    // One query (the decoding path) against all keys.
    Matrix out_one = Matrix::Constant(1, d, 1.0f);
    gattn::scaled_dot_product_attention<float>(q.bottomRows(1), k, v, {1, 1, 1}, out_one);

    const double growth = peak_rss_bytes() - before;
    RecordProperty("peak_growth_bytes", std::to_string(growth));
    EXPECT_LT(growth, 16.0 * 1024 * 1024) << "peak resident size grew by " << growth / 1048576 << " MiB";
    // The last query's full-attention output is the same whichever path computed it.
    EXPECT_LT((out_few.bottomRows(1) - out_one).cwiseAbs().maxCoeff(), 1e-5f);
    EXPECT_TRUE(out.allFinite());
}

// The backward pass at N = 65,536 (one head, causal with a 256-key window: linear work; without
// the window the test would take minutes in the sanitizer builds): its extra memory is a few
// tiles per thread plus D and the tiles' key ranges (256 KiB and 16 KiB here), where the
// probabilities of the textbook backward would take 16 GiB.
TEST(SdpaMemory, BackwardAtSixtyFourThousandTokensUsesTiles) {
    const Index n = 65536, d = 64;
    const Matrix q = Matrix::Random(n, d), k = Matrix::Random(n, d), v = Matrix::Random(n, d);
    const Matrix d_out = Matrix::Random(n, d);
    Matrix out = Matrix::Constant(n, d, 1.0f), lse = Matrix::Constant(n, 1, 1.0f);
    Matrix dq = Matrix::Constant(n, d, 1.0f), dk = Matrix::Constant(n, d, 1.0f), dv = Matrix::Constant(n, d, 1.0f);
    gattn::SdpaOptions<float> windowed;
    windowed.mask.causal = true;
    windowed.mask.sliding_window = 256;
    gattn::SdpaOutputs<float> extra;
    extra.log_sum_exp = &lse;
    {  // 1,024 tokens first: what the threads set up once is in the baseline
        const Index m = 1024;
        Matrix o(m, d), l(m, 1), gq(m, d), gk(m, d), gv(m, d);
        gattn::SdpaOutputs<float> e;
        e.log_sum_exp = &l;
        gattn::scaled_dot_product_attention<float>(q.topRows(m), k.topRows(m), v.topRows(m), {1, 1, 1}, o, windowed, e);
        gattn::scaled_dot_product_attention_backward<float>(q.topRows(m), k.topRows(m), v.topRows(m), {1, 1, 1}, o, l,
                                                            d_out.topRows(m), gq, gk, gv, windowed);
    }
    const double before = peak_rss_bytes();
    gattn::scaled_dot_product_attention<float>(q, k, v, {1, 1, 1}, out, windowed, extra);
    gattn::scaled_dot_product_attention_backward<float>(q, k, v, {1, 1, 1}, out, lse, d_out, dq, dk, dv, windowed);
    const double growth = peak_rss_bytes() - before;
    RecordProperty("peak_growth_bytes", std::to_string(growth));
    EXPECT_LT(growth, 16.0 * 1024 * 1024) << "peak resident size grew by " << growth / 1048576 << " MiB";
    EXPECT_TRUE(dq.allFinite() && dk.allFinite() && dv.allFinite());
    // A key's gradient comes only from the 256 queries that see it: the first key's dV is the sum
    // of its weights times dO over queries 0..255, which this checks against a direct sum.
    Eigen::RowVectorXd expected = Eigen::RowVectorXd::Zero(d);
    for (Index i = 0; i < 256; ++i) {
        double m = -1e300;
        std::vector<double> logits;
        for (Index j = std::max<Index>(0, i - 255); j <= i; ++j) {
            logits.push_back(double(q.row(i).dot(k.row(j))) / 8.0);  // scale 1/√64
            m = std::max(m, logits.back());
        }
        double z = 0;
        for (double x : logits) z += std::exp(x - m);
        const double p0 = std::exp(logits.front() - m) / z;  // key 0 is the first visible key
        expected += p0 * d_out.row(i).cast<double>();
    }
    EXPECT_LT((dv.row(0).cast<double>() - expected).cwiseAbs().maxCoeff(),
              1e-4 * expected.cwiseAbs().maxCoeff() + 1e-5);
}

}  // namespace
