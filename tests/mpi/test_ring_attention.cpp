// SPDX-License-Identifier: Apache-2.0
// Ring attention under MPI (run with mpirun -np 2 and -np 3): every rank builds the same whole
// sequences, keeps its part, and checks its part of ring_attention's output and log-sum-exp
// against scaled_dot_product_attention over the whole sequences in one process. Bad arguments
// on one rank make every rank throw the same error instead of waiting.

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <limits>
#include <string>

#include "gattn/dist/ring_attention.hpp"
#include "support/compare.hpp"
#include "support/mpi_test.hpp"
#include "support/reference.hpp"

namespace {

using gattn::Index;
using gattn::RowMatrix;

using gattn_test::rank_of;
using gattn_test::size_of;

/// Rows of this rank's part of a [B·P·n, w] matrix: sequence b's tokens [r·n, (r + 1)·n), or
/// (zigzag) its chunks r and 2P − 1 − r of n/2 tokens.
template <class S>
RowMatrix<S> part_of(const RowMatrix<S>& whole, Index B, Index n, bool zigzag = false) {
    const Index P = size_of(), r = rank_of(), c = n / 2;
    RowMatrix<S> p(B * n, whole.cols());
    for (Index b = 0; b < B; ++b) {
        if (zigzag) {
            p.middleRows(b * n, c) = whole.middleRows(b * P * n + r * c, c);
            p.middleRows(b * n + c, c) = whole.middleRows(b * P * n + (2 * P - 1 - r) * c, c);
        } else {
            p.middleRows(b * n, n) = whole.middleRows(b * P * n + r * n, n);
        }
    }
    return p;
}

struct Case {
    const char* name;
    bool causal;
    bool sinks_and_softcap;
    Index n_q;    // query tokens per rank
    Index n;      // key tokens per rank
    bool zigzag;  // RingLayout::Zigzag
};

template <class S>
void check(const Case& c) {
    SCOPED_TRACE(std::string(c.name) + " on " + std::to_string(size_of()) + " ranks, rank " +
                 std::to_string(rank_of()));
    const Index P = size_of(), B = 2, H = 4, Hkv = 2, d = 16, n = c.n;
    const RowMatrix<S> q = gattn_test::random_matrix(B * P * c.n_q, H * d, 11).template cast<S>();
    const RowMatrix<S> k = gattn_test::random_matrix(B * P * n, Hkv * d, 12).template cast<S>();
    const RowMatrix<S> v = gattn_test::random_matrix(B * P * n, Hkv * d, 13).template cast<S>();
    gattn::SdpaOptions<S> o;
    o.mask.causal = c.causal;
    if (c.sinks_and_softcap) {
        o.sinks = {S(0.5), S(-1), S(2), -std::numeric_limits<S>::infinity()};
        o.logit_softcap = 1.5;
    }
    // The whole sequences in one process.
    RowMatrix<S> whole(B * P * c.n_q, H * d), whole_lse;
    gattn::SdpaOutputs<S> extra;
    extra.log_sum_exp = &whole_lse;
    gattn::scaled_dot_product_attention<S>(q, k, v, {B, H, Hkv}, whole, o, extra);
    // This rank's part through the ring.
    RowMatrix<S> out(B * c.n_q, H * d), lse;
    const auto layout = c.zigzag ? gattn::RingLayout::Zigzag : gattn::RingLayout::Contiguous;
    gattn::ring_attention<S>(part_of(q, B, c.n_q, c.zigzag), part_of(k, B, n, c.zigzag), part_of(v, B, n, c.zigzag),
                             {B, H, Hkv}, out, o, MPI_COMM_WORLD, &lse, layout);
    const double tol = std::is_same_v<S, float> ? 2e-6 : 1e-13;
    gattn_test::expect_close(out, part_of(whole, B, c.n_q, c.zigzag).template cast<double>(), tol, tol, "out");
    gattn_test::expect_close(lse, part_of(whole_lse, B, c.n_q, c.zigzag).template cast<double>(), tol, tol,
                             "log_sum_exp");
}

const Case kCases[] = {{"causal", true, false, 37, 37, false},
                       {"full", false, false, 37, 37, false},
                       {"full, fewer queries", false, false, 5, 37, false},
                       {"causal with sinks and softcap", true, true, 37, 37, false},
                       {"zigzag causal", true, false, 38, 38, true},
                       {"zigzag full with sinks and softcap", false, true, 38, 38, true},
                       {"zigzag causal with sinks and softcap", true, true, 38, 38, true}};

TEST(RingAttention, FloatEqualsOneProcess) {
    for (const Case& c : kCases) check<float>(c);
}
TEST(RingAttention, DoubleEqualsOneProcess) {
    for (const Case& c : kCases) check<double>(c);
}

/// One rank's key of the wrong width: every rank throws, naming that rank and the argument.
TEST(RingAttention, BadInputOnOneRankFailsEveryRank) {
    const Index B = 1, H = 2, Hkv = 1, d = 8, n = 4;
    const int bad = size_of() - 1;
    const RowMatrix<float> q = RowMatrix<float>::Random(B * n, H * d), v = RowMatrix<float>::Random(B * n, Hkv * d);
    const RowMatrix<float> k = RowMatrix<float>::Random(B * n, Hkv * d + (rank_of() == bad ? 1 : 0));
    RowMatrix<float> out = RowMatrix<float>::Constant(B * n, H * d, 7.0f);
    try {
        gattn::ring_attention<float>(q, k, v, {B, H, Hkv}, out, {}, MPI_COMM_WORLD);
        ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("gattn::ring_attention: rank " + std::to_string(bad) + " of " + std::to_string(size_of()) +
                            ": key must have shape"),
                  std::string::npos)
            << what;
    }
    EXPECT_TRUE((out.array() == 7.0f).all()) << "out was written";
    // A mask the ring cannot place is refused on every rank.
    gattn::SdpaOptions<float> o;
    o.mask.sliding_window = 3;
    const RowMatrix<float> k_ok = RowMatrix<float>::Random(B * n, Hkv * d);
    EXPECT_THROW(gattn::ring_attention<float>(q, k_ok, v, {B, H, Hkv}, out, o, MPI_COMM_WORLD), std::invalid_argument);
    // Zigzag needs two chunks of equal length.
    const RowMatrix<float> q3 = RowMatrix<float>::Random(3, H * d), k3 = RowMatrix<float>::Random(3, Hkv * d);
    RowMatrix<float> out3(3, H * d);
    EXPECT_THROW(gattn::ring_attention<float>(q3, k3, k3, {1, H, Hkv}, out3, {}, MPI_COMM_WORLD, nullptr,
                                              gattn::RingLayout::Zigzag),
                 std::invalid_argument);
}

}  // namespace

int main(int argc, char** argv) { return gattn_test::run_mpi_tests(argc, argv); }
