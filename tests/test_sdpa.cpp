// SPDX-License-Identifier: Apache-2.0
// Scaled dot-product attention against the float64 reference (tests/support/reference.hpp):
// shapes with odd sizes, GQA/MQA, d_v ≠ d_k, every mask alone and combined, the optional
// outputs, strided views, fully masked rows, NaN in masked K/V rows, argument validation, and
// extreme values: logits of ±1e30, denormal inputs, NaN and ±∞ in visible and masked keys.

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gattn/ops/sdpa.hpp"
#include "support/compare.hpp"
#include "support/reference.hpp"
#include "support/sdpa_cases.hpp"

namespace {

using gattn::Index;
using gattn_test::expect_close;
using gattn_test::Mat;
using gattn_test::random_matrix;
using gattn_test::RefMasks;
using gattn_test::rounded;

/// Per-element and whole-tensor tolerances of a scalar type against the float64 reference.
/// float: the documented atol 1e-5, rtol 1e-5 per element (observed worst |err| ≈ 6e-7) and an NMSE
/// bound about 100× above the worst observed (≈ 7e-14). double: observed worst |err| ≈ 2e-15,
/// NMSE ≈ 4e-30.
template <class S>
struct Tol;
template <>
struct Tol<float> {
    static constexpr double atol = 1e-5, rtol = 1e-5, nmse = 1e-11;
};
template <>
struct Tol<double> {
    static constexpr double atol = 1e-12, rtol = 1e-11, nmse = 1e-24;
};

using gattn_test::ScalarNames;
using gattn_test::type_label;

using namespace gattn_test::sweep;  // shapes, mask kinds, mask builders

// ---------------------------------------------------------------------------------------------
// The sweep: every shape × every mask kind, float and double.

template <class S>
void run_sweep_case(const Shape& s, MaskKind kind) {
    const std::uint64_t seed = 1000u + static_cast<std::uint64_t>(kind) * 37u +
                               static_cast<std::uint64_t>(s.Nq * 131 + s.Nk * 7 + s.dk);
    const std::string label = std::string("Sdpa") + type_label<S>() + "/" + s.name + "/" + mask_name(kind);

    Mat q = gattn_test::rounded<S>(random_matrix(s.B * s.Nq, s.H * s.dk, seed));
    Mat k = gattn_test::rounded<S>(random_matrix(s.B * s.Nk, s.Hkv * s.dk, seed + 1));
    Mat v = gattn_test::rounded<S>(random_matrix(s.B * s.Nk, s.Hkv * s.dv, seed + 2));
    const MaskBuild masks = make_masks(kind, s, seed + 3);
    const RefMasks ref_masks = reference_masks<S>(masks, s.B, s.H, s.Nq, s.Nk);
    const Index poisoned = poison_invisible_keys(ref_masks, s.B, s.H, s.Nq, s.Nk, k, v);
    if (kind == MaskKind::KeyLengthsWithEmpty) {
        EXPECT_GE(poisoned, s.Nk) << label;
    }

    const gattn_test::SdpaRefResult ref = gattn_test::sdpa_reference(q, k, v, s.B, s.H, s.Hkv, masks.scale, ref_masks);

    const gattn::RowMatrix<S> qs = q.cast<S>(), ks = k.cast<S>(), vs = v.cast<S>();
    std::vector<S> bias_store;
    const gattn::SdpaOptions<S> opt = library_options<S>(masks, bias_store);
    gattn::RowMatrix<S> out = gattn::RowMatrix<S>::Constant(s.B * s.Nq, s.H * s.dv, S(-777));
    gattn::RowMatrix<S> lse, probs, first;
    gattn::SdpaOutputs<S> extra;
    extra.log_sum_exp = &lse;
    extra.probabilities = &probs;
    extra.first_key_probability = &first;
    gattn::scaled_dot_product_attention<S>(qs, ks, vs, gattn::HeadLayout{s.B, s.H, s.Hkv}, out, opt, extra);

    using T = Tol<S>;
    expect_close(out, ref.out, T::atol, T::rtol, label + "/out", T::nmse);
    expect_close(lse, ref.log_sum_exp, T::atol, T::rtol, label + "/lse");
    expect_close(probs, ref.probabilities, T::atol, T::rtol, label + "/probabilities");
    expect_close(first, ref.first_key, T::atol, T::rtol, label + "/first_key");
    expect_masked_rows_zero<S>(out, ref.log_sum_exp, s.dv, label);

    // The convenience form gives bitwise the same output.
    const gattn::RowMatrix<S> out2 =
        gattn::scaled_dot_product_attention<S>(qs, ks, vs, gattn::HeadLayout{s.B, s.H, s.Hkv}, opt);
    EXPECT_TRUE(out2 == out) << label << ": convenience form differs from the core form";
}

class SdpaSweep : public ::testing::TestWithParam<std::tuple<Shape, MaskKind>> {};

TEST_P(SdpaSweep, FloatMatchesReference) { run_sweep_case<float>(std::get<0>(GetParam()), std::get<1>(GetParam())); }
TEST_P(SdpaSweep, DoubleMatchesReference) { run_sweep_case<double>(std::get<0>(GetParam()), std::get<1>(GetParam())); }

INSTANTIATE_TEST_SUITE_P(ShapesAndMasks, SdpaSweep,
                         ::testing::Combine(::testing::ValuesIn(kShapes), ::testing::ValuesIn(kMaskKinds)),
                         [](const ::testing::TestParamInfo<SdpaSweep::ParamType>& info) {
                             return std::string(std::get<0>(info.param).name) + mask_name(std::get<1>(info.param));
                         });

// ---------------------------------------------------------------------------------------------
// Focused tests, each for float and double.

template <class S>
class SdpaTyped : public ::testing::Test {};

using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(SdpaTyped, Scalars, ScalarNames);

/// query, key and value are column blocks of wider matrices, out a column block of a wider
/// buffer: results match, and the columns around out are untouched.
TYPED_TEST(SdpaTyped, StridedViews) {
    using S = TypeParam;
    const Index B = 2, Nq = 17, Nk = 33, H = 8, Hkv = 2, dk = 40, dv = 24;
    const Mat qw = gattn_test::rounded<S>(random_matrix(B * Nq, H * dk + 11, 51));
    const Mat kw = gattn_test::rounded<S>(random_matrix(B * Nk, Hkv * dk + 5, 52));
    const Mat vw = gattn_test::rounded<S>(random_matrix(B * Nk, Hkv * dv + 9, 53));
    const gattn::RowMatrix<S> qs = qw.cast<S>(), ks = kw.cast<S>(), vs = vw.cast<S>();
    gattn::RowMatrix<S> big = gattn::RowMatrix<S>::Constant(B * Nq, H * dv + 7, S(42));
    gattn::SdpaOptions<S> opt;
    opt.mask.causal = true;
    opt.mask.key_lengths = {Nk, 20};
    gattn::scaled_dot_product_attention<S>(qs.middleCols(3, H * dk), ks.middleCols(5, Hkv * dk),
                                           vs.middleCols(1, Hkv * dv), gattn::HeadLayout{B, H, Hkv},
                                           big.middleCols(4, H * dv), opt);
    RefMasks rm;
    rm.causal = true;
    rm.key_lengths = {Nk, 20};
    const auto ref = gattn_test::sdpa_reference(qw.middleCols(3, H * dk), kw.middleCols(5, Hkv * dk),
                                                vw.middleCols(1, Hkv * dv), B, H, Hkv, {}, rm);
    using T = Tol<S>;
    expect_close(big.middleCols(4, H * dv), ref.out, T::atol, T::rtol, "SdpaStrided/out", T::nmse);
    EXPECT_TRUE((big.leftCols(4).array() == S(42)).all()) << "columns left of out were written";
    EXPECT_TRUE((big.rightCols(3).array() == S(42)).all()) << "columns right of out were written";
}

/// Outputs of at least kStreamOutputBytes are written with streaming stores, and with an
/// epilogue through staging rows: with out a column block of a wider buffer (rows aligned and
/// not aligned to a register, d_v not a multiple of the register), plain SDPA and SDPA with an
/// epilogue match the reference, the epilogue sees each row's final values, and the columns
/// around out are untouched.
TYPED_TEST(SdpaTyped, LargeOutputsAreStreamedOutIntact) {
    using S = TypeParam;
    const Index B = 1, Nq = 6600, Nk = 19, H = 8, Hkv = 2, dk = 8, dv = 40;
    ASSERT_GE(B * Nq * H * dv * Index(sizeof(S)), gattn::detail::kStreamOutputBytes);
    const Mat q = gattn_test::rounded<S>(random_matrix(B * Nq, H * dk, 81));
    const Mat k = gattn_test::rounded<S>(random_matrix(B * Nk, Hkv * dk, 82));
    const Mat v = gattn_test::rounded<S>(random_matrix(B * Nk, Hkv * dv, 83));
    const gattn::RowMatrix<S> qs = q.cast<S>(), ks = k.cast<S>(), vs = v.cast<S>();
    gattn::SdpaOptions<S> opt;
    opt.mask.key_lengths = {15};
    RefMasks rm;
    rm.key_lengths = {15};
    const auto ref = gattn_test::sdpa_reference(q, k, v, B, H, Hkv, {}, rm);
    using T = Tol<S>;
    auto factor = [](Index row, Index h) { return S(1 + row % 3) + S(0.5) * S(h); };
    for (const bool with_epilogue : {false, true}) {
        SCOPED_TRACE(with_epilogue ? "with an epilogue" : "plain");
        gattn::RowMatrix<S> big = gattn::RowMatrix<S>::Constant(B * Nq, H * dv + 7, S(42));
        Mat expected = ref.out;
        if (with_epilogue) {
            gattn::detail::sdpa_with_epilogue<S>(qs, ks, vs, gattn::HeadLayout{B, H, Hkv}, big.middleCols(4, H * dv),
                                                 opt, {}, [&](Index row, Index h, S* y) {
                                                     for (Index j = 0; j < dv; ++j) y[j] *= factor(row, h);
                                                 });
            for (Index r = 0; r < B * Nq; ++r)
                for (Index h = 0; h < H; ++h) expected.block(r, h * dv, 1, dv) *= double(factor(r, h));
        } else {
            gattn::scaled_dot_product_attention<S>(qs, ks, vs, gattn::HeadLayout{B, H, Hkv}, big.middleCols(4, H * dv),
                                                   opt);
        }
        expect_close(big.middleCols(4, H * dv), expected, T::atol, T::rtol, "SdpaStreamed/out", T::nmse);
        EXPECT_TRUE((big.leftCols(4).array() == S(42)).all()) << "columns left of out were written";
        EXPECT_TRUE((big.rightCols(3).array() == S(42)).all()) << "columns right of out were written";
    }
}

/// Each thread keeps its kernel scratch between calls and only grows it: calls whose head dims
/// grow and shrink, with value rows copied (strided) or read in place, each match the
/// reference, and repeating the first call after the scratch has grown gives the same bits.
TYPED_TEST(SdpaTyped, ScratchKeptBetweenCallsServesAnyShape) {
    using S = TypeParam;
    struct Case {
        Index dk, dv, value_pad;
    };
    const Case cases[] = {{24, 24, 5}, {136, 72, 0}, {8, 40, 3}, {264, 264, 0}, {24, 24, 5}};
    const Index B = 1, Nq = 70, Nk = 90, H = 4, Hkv = 2;
    gattn::RowMatrix<S> first;
    int seed = 0;
    for (const Case& c : cases) {
        seed = c.dk == 24 ? 0 : seed + 1;  // the first case again: the same inputs
        const Mat q = gattn_test::rounded<S>(random_matrix(B * Nq, H * c.dk, 71 + 3 * seed));
        const Mat k = gattn_test::rounded<S>(random_matrix(B * Nk, Hkv * c.dk, 72 + 3 * seed));
        const Mat vw = gattn_test::rounded<S>(random_matrix(B * Nk, Hkv * c.dv + c.value_pad, 73 + 3 * seed));
        const gattn::RowMatrix<S> qs = q.cast<S>(), ks = k.cast<S>(), vs = vw.cast<S>();
        gattn::SdpaOptions<S> opt;
        opt.mask.causal = true;
        const auto got =
            gattn::scaled_dot_product_attention<S>(qs, ks, vs.leftCols(Hkv * c.dv), gattn::HeadLayout{B, H, Hkv}, opt);
        RefMasks rm;
        rm.causal = true;
        const auto ref = gattn_test::sdpa_reference(q, k, vw.leftCols(Hkv * c.dv), B, H, Hkv, {}, rm);
        using T = Tol<S>;
        expect_close(got, ref.out, T::atol, T::rtol, "SdpaScratch/d_k=" + std::to_string(c.dk), T::nmse);
        if (first.size() == 0) {
            first = got;
        } else if (c.dk == 24) {
            EXPECT_TRUE(got == first) << "the same call gave other bits after the scratch grew";
        }
    }
}

/// The default scale is 1/√d_k (never 1/√d_v), checked with d_v ≠ d_k.
TYPED_TEST(SdpaTyped, DefaultScaleUsesKeyHeadDim) {
    using S = TypeParam;
    const Index B = 1, N = 9, H = 2, dk = 16, dv = 4;
    const Mat q = gattn_test::rounded<S>(random_matrix(B * N, H * dk, 61, 2.0));
    const Mat k = gattn_test::rounded<S>(random_matrix(B * N, H * dk, 62, 2.0));
    const Mat v = gattn_test::rounded<S>(random_matrix(B * N, H * dv, 63));
    const gattn::RowMatrix<S> qs = q.cast<S>(), ks = k.cast<S>(), vs = v.cast<S>();
    const auto got = gattn::scaled_dot_product_attention<S>(qs, ks, vs, gattn::HeadLayout{B, H, H});
    gattn::SdpaOptions<S> explicit_opt;
    explicit_opt.scale = 0.25;  // 1/√16
    const auto got_explicit =
        gattn::scaled_dot_product_attention<S>(qs, ks, vs, gattn::HeadLayout{B, H, H}, explicit_opt);
    const auto ref = gattn_test::sdpa_reference(q, k, v, B, H, H, 0.25);
    using T = Tol<S>;
    expect_close(got, ref.out, T::atol, T::rtol, "SdpaScale/default");
    expect_close(got_explicit, ref.out, T::atol, T::rtol, "SdpaScale/explicit");
    const auto wrong = gattn_test::sdpa_reference(q, k, v, B, H, H, 0.5);  // 1/√d_v
    EXPECT_GT((got.template cast<double>() - wrong.out).cwiseAbs().maxCoeff(), 1e-3);
}

/// Logits in the thousands (exactly representable inputs): the softmax stays finite and exact.
TYPED_TEST(SdpaTyped, LargeLogitsStayFinite) {
    using S = TypeParam;
    const Index B = 1, N = 33, H = 2, dk = 4, dv = 8;
    // q multiples of 8 up to ±512, k multiples of 1/8 in [−1, 1]: products and sums are exact.
    Mat q = random_matrix(B * N, H * dk, 71, 64.0);
    Mat k = random_matrix(B * N, H * dk, 72, 8.0);
    q = (q.array().round() * 8.0).matrix();
    k = (k.array().round() / 8.0).matrix();
    const Mat v = gattn_test::rounded<S>(random_matrix(B * N, H * dv, 73));
    const gattn::RowMatrix<S> qs = q.cast<S>(), ks = k.cast<S>(), vs = v.cast<S>();
    gattn::SdpaOptions<S> opt;
    opt.mask.causal = true;
    gattn::RowMatrix<S> lse;
    gattn::SdpaOutputs<S> extra;
    extra.log_sum_exp = &lse;
    const auto got = gattn::scaled_dot_product_attention<S>(qs, ks, vs, gattn::HeadLayout{B, H, H}, opt, extra);
    RefMasks rm;
    rm.causal = true;
    const auto ref = gattn_test::sdpa_reference(q, k, v, B, H, H, {}, rm);
    EXPECT_GT(ref.log_sum_exp.cwiseAbs().maxCoeff(), 500.0) << "the case should have huge logits";
    EXPECT_TRUE(got.allFinite());
    using T = Tol<S>;
    expect_close(got, ref.out, T::atol, T::rtol, "SdpaLargeLogits/out");
    // lse is ~1000 in magnitude: relative tolerance dominates.
    expect_close(lse, ref.log_sum_exp, T::atol, T::rtol, "SdpaLargeLogits/lse");
}

/// A query's output does not depend on how many queries share its block: N_q rows that fill
/// part of a block (tiles of fewer query registers, FlashGeometry::kLiveRows) give bitwise the
/// outputs and log-sum-exp of the same rows leading a whole block (non-causal: the extra rows
/// change nothing for the first ones).
TYPED_TEST(SdpaTyped, FewQueriesGiveTheRowsOfAFullBlock) {
    using S = TypeParam;
    using G = gattn::kernel::FlashGeometry<S>;
    const Index H = 4, Hkv = 4, dk = 64, dv = 48, Nk = 150, full = G::kQueries;
    const gattn::RowMatrix<S> q = random_matrix(full, H * dk, 91).cast<S>();
    const gattn::RowMatrix<S> k = random_matrix(Nk, Hkv * dk, 92).cast<S>();
    const gattn::RowMatrix<S> v = random_matrix(Nk, Hkv * dv, 93).cast<S>();
    gattn::RowMatrix<S> out_full(full, H * dv), lse_full;
    gattn::scaled_dot_product_attention<S>(q, k, v, gattn::HeadLayout{1, H, Hkv}, out_full, {}, {&lse_full});
    for (Index nq : {Index(G::kDecodePairs) + 1, Index(G::kLanes) + 1, full - Index(G::kLanes) + 1, full - 1}) {
        if (nq <= G::kDecodePairs || nq >= full) continue;  // the decoding kernel, or a whole block
        gattn::RowMatrix<S> out(nq, H * dv), lse;
        gattn::scaled_dot_product_attention<S>(q.topRows(nq), k, v, gattn::HeadLayout{1, H, Hkv}, out, {}, {&lse});
        EXPECT_TRUE(out == out_full.topRows(nq)) << "N_q = " << nq;
        EXPECT_TRUE(lse == lse_full.topRows(nq)) << "N_q = " << nq;
    }
}

/// The last rows of a prompt that leave at most a register of queries in their block (the
/// few-query tiles, kernel::runs_row_tiles, where the tier has them) give bitwise the outputs,
/// log-sum-exp and first-key probability of the same rows inside a whole block, and match the
/// float64 reference: causal (top-left, so that a row's position does not depend on N_q) with
/// a sliding window of 20 that starts inside a key block, softcap, d_k = 40 (a partial
/// register of features), 2 heads.
TYPED_TEST(SdpaTyped, LastFewRowsGiveTheRowsOfAFullBlock) {
    using S = TypeParam;
    using G = gattn::kernel::FlashGeometry<S>;
    const Index H = 2, dk = 40, dv = 2 * G::kLanes, W = G::kQueries, Nk = 2 * W + 8;
    const gattn::RowMatrix<S> q = random_matrix(2 * W, H * dk, 94).cast<S>();
    const gattn::RowMatrix<S> k = random_matrix(Nk, H * dk, 95).cast<S>();
    const gattn::RowMatrix<S> v = random_matrix(Nk, H * dv, 96).cast<S>();
    gattn::SdpaOptions<S> opt;
    opt.logit_softcap = 1.5;
    opt.mask.causal = true;
    opt.mask.alignment = gattn::CausalAlignment::TopLeft;
    opt.mask.sliding_window = 20;
    auto run = [&](Index nq, gattn::RowMatrix<S>& out, gattn::RowMatrix<S>& lse, gattn::RowMatrix<S>& first) {
        out.resize(nq, H * dv);
        gattn::SdpaOutputs<S> extra;
        extra.log_sum_exp = &lse;
        extra.first_key_probability = &first;
        gattn::scaled_dot_product_attention<S>(q.topRows(nq), k, v, gattn::HeadLayout{1, H, H}, out, opt, extra);
    };
    gattn::RowMatrix<S> out_full, lse_full, first_full;
    run(2 * W, out_full, lse_full, first_full);
    RefMasks masks;
    masks.causal = true;
    masks.top_left = true;
    masks.sliding_window = 20;
    masks.softcap = 1.5;
    for (Index extra_rows : {Index(1), Index(3), Index(G::kLanes)}) {
        const Index nq = W + extra_rows;
        gattn::RowMatrix<S> out, lse, first;
        run(nq, out, lse, first);
        const std::string label = "N_q = " + std::to_string(nq);
        EXPECT_TRUE(out == out_full.topRows(nq)) << label;
        EXPECT_TRUE(lse == lse_full.topRows(nq)) << label;
        EXPECT_TRUE(first == first_full.topRows(nq)) << label;
        const auto ref = gattn_test::sdpa_reference(q.topRows(nq).template cast<double>(), k.template cast<double>(),
                                                    v.template cast<double>(), 1, H, H, {}, masks);
        using T = Tol<S>;
        expect_close(out, ref.out, T::atol, T::rtol, "LastFewRows/" + label);
        expect_close(lse, ref.log_sum_exp, T::atol, T::rtol, "LastFewRows/lse/" + label);
    }
}

// Rows that all see the same keys (a cascade's prefix rows) past a full query block form a
// few-query block (kernel::flash_row_step) whose K rows run at a constant stride when d_k is
// 64, 128 or 256: the same bits as in a full block, and the reference's values.
TYPED_TEST(SdpaTyped, FewQueryRowsGiveTheRowsOfAFullBlockAtEveryHeadDim) {
    using S = TypeParam;
    using G = gattn::kernel::FlashGeometry<S>;
    const Index H = 2, dv = 2 * G::kLanes, W = G::kQueries, Nk = 2 * G::kKeys + 24;
    for (const Index dk : {Index(64), Index(128), Index(256)}) {
        const gattn::RowMatrix<S> q = random_matrix(2 * W, H * dk, 97 + dk).cast<S>();
        const gattn::RowMatrix<S> k = random_matrix(Nk, H * dk, 98 + dk).cast<S>();
        const gattn::RowMatrix<S> v = random_matrix(Nk, H * dv, 99 + dk).cast<S>();
        gattn::SdpaOptions<S> opt;
        RefMasks masks;
        if (dk == 128) {
            opt.logit_softcap = S(2);
            masks.softcap = 2.0;
        }
        auto run = [&](Index nq, gattn::RowMatrix<S>& out, gattn::RowMatrix<S>& lse) {
            out.resize(nq, H * dv);
            gattn::SdpaOutputs<S> extra;
            extra.log_sum_exp = &lse;
            gattn::scaled_dot_product_attention<S>(q.topRows(nq), k, v, gattn::HeadLayout{1, H, H}, out, opt, extra);
        };
        gattn::RowMatrix<S> out_full, lse_full;
        run(2 * W, out_full, lse_full);
        for (Index extra_rows : {Index(1), Index(G::kLanes / 2 + 1), Index(G::kLanes)}) {
            const Index nq = W + extra_rows;
            gattn::RowMatrix<S> out, lse;
            run(nq, out, lse);
            const std::string label = "d_k = " + std::to_string(dk) + ", N_q = " + std::to_string(nq);
            EXPECT_TRUE(out == out_full.topRows(nq)) << label;
            EXPECT_TRUE(lse == lse_full.topRows(nq)) << label;
            const auto ref = gattn_test::sdpa_reference(q.topRows(nq).template cast<double>(),
                                                        k.template cast<double>(), v.template cast<double>(), 1, H, H,
                                                        {}, masks);
            using T = Tol<S>;
            expect_close(out, ref.out, T::atol, T::rtol, "FewQueryRows/" + label);
            expect_close(lse, ref.log_sum_exp, T::atol, T::rtol, "FewQueryRows/lse/" + label);
        }
    }
}

/// Rows with no visible key (every mechanism that can cause one) are exactly 0, lse −∞,
/// probabilities and first-key probability 0, and never NaN.
TYPED_TEST(SdpaTyped, FullyMaskedRowsAreZero) {
    using S = TypeParam;
    const Index B = 3, Nq = 6, Nk = 4, H = 2, Hkv = 1, dk = 8, dv = 8;
    const gattn::RowMatrix<S> q = random_matrix(B * Nq, H * dk, 81).cast<S>();
    const gattn::RowMatrix<S> k = random_matrix(B * Nk, Hkv * dk, 82).cast<S>();
    const gattn::RowMatrix<S> v = random_matrix(B * Nk, Hkv * dv, 83).cast<S>();
    // Sequence 0: key length 0. Sequence 1: causal with Nq > L_b hides the first queries.
    // Sequence 2: the boolean mask hides every key from query 2 of head 1; a −∞ bias row hides
    // every key from query 4 of head 0.
    gattn::SdpaOptions<S> opt;
    opt.mask.causal = true;
    opt.mask.key_lengths = {0, 3, 4};
    std::unique_ptr<bool[]> bm(new bool[B * H * Nq * Nk]);
    std::vector<S> bias(static_cast<std::size_t>(B * H * Nq * Nk), S(0));
    for (Index t = 0; t < B * H * Nq * Nk; ++t) bm[t] = true;
    for (Index j = 0; j < Nk; ++j) {
        bm[((2 * H + 1) * Nq + 2) * Nk + j] = false;
        bias[static_cast<std::size_t>(((2 * H + 0) * Nq + 4) * Nk + j)] = -std::numeric_limits<S>::infinity();
    }
    opt.mask.bool_mask = {bm.get(), B, H, Nq, Nk};
    opt.mask.bias = {bias.data(), B, H, Nq, Nk};
    gattn::RowMatrix<S> out = gattn::RowMatrix<S>::Constant(B * Nq, H * dv, S(5));
    gattn::RowMatrix<S> lse, probs, first;
    gattn::SdpaOutputs<S> extra{&lse, &probs, &first};
    gattn::scaled_dot_product_attention<S>(q, k, v, gattn::HeadLayout{B, H, Hkv}, out, opt, extra);

    auto expect_empty = [&](Index b, Index h, Index i) {
        SCOPED_TRACE("sequence " + std::to_string(b) + " head " + std::to_string(h) + " query " + std::to_string(i));
        const Index row = b * Nq + i;
        for (Index d = 0; d < dv; ++d) EXPECT_EQ(out(row, h * dv + d), S(0));
        EXPECT_EQ(lse(row, h), -std::numeric_limits<S>::infinity());
        EXPECT_EQ(first(row, h), S(0));
        for (Index j = 0; j < Nk; ++j) EXPECT_EQ(probs((b * H + h) * Nq + i, j), S(0));
    };
    for (Index h = 0; h < H; ++h)
        for (Index i = 0; i < Nq; ++i) expect_empty(0, h, i);
    // Sequence 1: L = 3, query i sees j ≤ i − 3, so queries 0..2 see nothing.
    for (Index h = 0; h < H; ++h)
        for (Index i = 0; i < 3; ++i) expect_empty(1, h, i);
    expect_empty(2, 1, 2);
    expect_empty(2, 0, 4);
    EXPECT_FALSE(out.array().isNaN().any());
    EXPECT_FALSE(lse.array().isNaN().any());
    EXPECT_FALSE(probs.array().isNaN().any());
    EXPECT_FALSE(first.array().isNaN().any());
    // And everything agrees with the reference.
    RefMasks rm;
    rm.causal = true;
    rm.key_lengths = {0, 3, 4};
    const Index dims[3] = {B, H, Nq};
    expand(bm.get(), dims, B, H, Nq, Nk, rm.bool_mask);
    std::vector<double> bias_d(bias.begin(), bias.end());
    expand(bias_d.data(), dims, B, H, Nq, Nk, rm.bias);
    const auto ref = gattn_test::sdpa_reference(q.template cast<double>(), k.template cast<double>(),
                                                v.template cast<double>(), B, H, Hkv, {}, rm);
    using T = Tol<S>;
    expect_close(out, ref.out, T::atol, T::rtol, "SdpaFullyMasked/out");
    expect_close(lse, ref.log_sum_exp, T::atol, T::rtol, "SdpaFullyMasked/lse");
}

/// NaN in the K/V rows of causal-future keys reaches only the queries that may see them, and
/// all of those. N = 100 puts the poisoned key in diagonal key blocks where it is hidden from
/// part of a SIMD register of queries and seen by the whole of the next ones.
TYPED_TEST(SdpaTyped, NaNInCausalFutureKeysDoesNotLeak) {
    using S = TypeParam;
    using T = Tol<S>;
    const Index B = 2, H = 4, Hkv = 2, dk = 8, dv = 8;
    for (const auto& [N, poisoned] : {std::pair<Index, Index>{16, 11}, {100, 11}, {100, 37}, {100, 70}}) {
        SCOPED_TRACE("N = " + std::to_string(N) + ", poisoned key " + std::to_string(poisoned));
        Mat q = random_matrix(B * N, H * dk, 91), k = random_matrix(B * N, Hkv * dk, 92),
            v = random_matrix(B * N, Hkv * dv, 93);
        for (Index b = 0; b < B; ++b) {
            k.row(b * N + poisoned).setConstant(kNaN);
            v.row(b * N + poisoned).setConstant(kNaN);
        }
        const gattn::RowMatrix<S> qs = q.cast<S>(), ks = k.cast<S>(), vs = v.cast<S>();
        gattn::SdpaOptions<S> opt;
        opt.mask.causal = true;
        const auto got = gattn::scaled_dot_product_attention<S>(qs, ks, vs, gattn::HeadLayout{B, H, Hkv}, opt);
        RefMasks rm;
        rm.causal = true;
        const auto ref = gattn_test::sdpa_reference(rounded<S>(q), rounded<S>(k), rounded<S>(v), B, H, Hkv, {}, rm);
        for (Index b = 0; b < B; ++b) {
            const auto got_b = got.middleRows(b * N, poisoned);
            EXPECT_TRUE(got_b.allFinite()) << "NaN of a future key leaked into earlier queries";
            expect_close(got_b, ref.out.middleRows(b * N, poisoned), T::atol, T::rtol, "SdpaNaNFuture/out");
            EXPECT_TRUE(got.middleRows(b * N + poisoned, N - poisoned).array().isNaN().all())
                << "a query that sees the NaN key must be NaN";
        }
    }
}

/// NaN in K/V rows hidden by an −∞ additive bias (for every query and head) does not leak.
TYPED_TEST(SdpaTyped, NaNInBiasMaskedKeysDoesNotLeak) {
    using S = TypeParam;
    const Index B = 2, Nq = 5, Nk = 9, H = 2, Hkv = 1, dk = 8, dv = 4;
    Mat q = random_matrix(B * Nq, H * dk, 101), k = random_matrix(B * Nk, Hkv * dk, 102),
        v = random_matrix(B * Nk, Hkv * dv, 103);
    std::vector<S> bias(static_cast<std::size_t>(B * Nk), S(0));
    for (Index b = 0; b < B; ++b)
        for (Index j : {Index(0), Index(4), Nk - 1}) {
            bias[static_cast<std::size_t>(b * Nk + j)] = -std::numeric_limits<S>::infinity();
            k.row(b * Nk + j).setConstant(kNaN);
            v.row(b * Nk + j).setConstant(kNaN);
        }
    const gattn::RowMatrix<S> qs = q.cast<S>(), ks = k.cast<S>(), vs = v.cast<S>();
    gattn::SdpaOptions<S> opt;
    opt.mask.bias = {bias.data(), B, 1, 1, Nk};
    gattn::RowMatrix<S> lse;
    gattn::SdpaOutputs<S> extra;
    extra.log_sum_exp = &lse;
    const auto got = gattn::scaled_dot_product_attention<S>(qs, ks, vs, gattn::HeadLayout{B, H, Hkv}, opt, extra);
    RefMasks rm;
    const Index dims[3] = {B, 1, 1};
    std::vector<double> bias_d(bias.begin(), bias.end());
    expand(bias_d.data(), dims, B, H, Nq, Nk, rm.bias);
    const auto ref = gattn_test::sdpa_reference(rounded<S>(q), rounded<S>(k), rounded<S>(v), B, H, Hkv, {}, rm);
    using T = Tol<S>;
    expect_close(got, ref.out, T::atol, T::rtol, "SdpaNaNBias/out");
    expect_close(lse, ref.log_sum_exp, T::atol, T::rtol, "SdpaNaNBias/lse");
}

/// A key that the causal mask or the boolean mask hides ignores its bias: NaN or +∞ there does
/// not reach the row (prefill over full and partial key blocks, and decoding).
TYPED_TEST(SdpaTyped, BiasOfMaskedKeysIsIgnored) {
    using S = TypeParam;
    const Index N = 70, H = 4, Hkv = 2, dk = 16, dv = 8;  // 70 keys: a full and a partial block
    const Mat q = random_matrix(N, H * dk, 121), k = random_matrix(N, Hkv * dk, 122),
              v = random_matrix(N, Hkv * dv, 123);
    std::unique_ptr<bool[]> bm(new bool[N]);
    for (Index j = 0; j < N; ++j) bm[j] = j % 7 != 3;
    const S poison[2] = {std::numeric_limits<S>::quiet_NaN(), std::numeric_limits<S>::infinity()};
    std::vector<S> bias(static_cast<std::size_t>(N * N));
    for (Index i = 0; i < N; ++i)
        for (Index j = 0; j < N; ++j)
            bias[static_cast<std::size_t>(i * N + j)] = j > i || !bm[j] ? poison[(i + j) % 2]
                                                                        : S(0.25) * S((i + 2 * j) % 5);
    const gattn::RowMatrix<S> qs = q.cast<S>(), ks = k.cast<S>(), vs = v.cast<S>();
    using T = Tol<S>;
    // Prefill: all N queries, causal + boolean mask + bias.
    {
        gattn::SdpaOptions<S> opt;
        opt.mask.causal = true;
        opt.mask.bool_mask = {bm.get(), 1, 1, 1, N};
        opt.mask.bias = {bias.data(), 1, 1, N, N};
        gattn::RowMatrix<S> lse;
        gattn::SdpaOutputs<S> extra;
        extra.log_sum_exp = &lse;
        const auto got = gattn::scaled_dot_product_attention<S>(qs, ks, vs, gattn::HeadLayout{1, H, Hkv}, opt, extra);
        RefMasks rm;
        rm.causal = true;
        const Index bool_dims[3] = {1, 1, 1}, bias_dims[3] = {1, 1, N};
        expand(bm.get(), bool_dims, 1, H, N, N, rm.bool_mask);
        std::vector<double> bias_d(bias.begin(), bias.end());
        expand(bias_d.data(), bias_dims, 1, H, N, N, rm.bias);
        const auto ref = gattn_test::sdpa_reference(rounded<S>(q), rounded<S>(k), rounded<S>(v), 1, H, Hkv, {}, rm);
        EXPECT_TRUE(got.allFinite()) << "the bias of a masked key reached the output";
        expect_close(got, ref.out, T::atol, T::rtol, "SdpaMaskedBias/out");
        expect_close(lse, ref.log_sum_exp, T::atol, T::rtol, "SdpaMaskedBias/lse");
    }
    // Decoding: the last query alone (it sees every key the boolean mask leaves).
    {
        gattn::SdpaOptions<S> opt;
        opt.mask.bool_mask = {bm.get(), 1, 1, 1, N};
        opt.mask.bias = {bias.data() + (N - 1) * N, 1, 1, 1, N};
        const auto got =
            gattn::scaled_dot_product_attention<S>(qs.bottomRows(1), ks, vs, gattn::HeadLayout{1, H, Hkv}, opt);
        RefMasks rm;
        const Index dims[3] = {1, 1, 1};
        expand(bm.get(), dims, 1, H, 1, N, rm.bool_mask);
        std::vector<double> bias_d(bias.end() - N, bias.end());
        expand(bias_d.data(), dims, 1, H, 1, N, rm.bias);
        const auto ref = gattn_test::sdpa_reference(rounded<S>(Mat(q.bottomRows(1))), rounded<S>(k), rounded<S>(v), 1,
                                                    H, Hkv, {}, rm);
        EXPECT_TRUE(got.allFinite()) << "the bias of a masked key reached the output";
        expect_close(got, ref.out, T::atol, T::rtol, "SdpaMaskedBiasDecode/out");
    }
}

/// Two calls over disjoint key halves merge through their log-sum-exp into the full result.
TYPED_TEST(SdpaTyped, LogSumExpMergesKeyShards) {
    using S = TypeParam;
    const Index B = 2, Nq = 7, Nk = 20, H = 3, Hkv = 1, dk = 16, dv = 8, split = 9;
    const gattn::RowMatrix<S> q = random_matrix(B * Nq, H * dk, 111, 2.0).cast<S>();
    const gattn::RowMatrix<S> k = random_matrix(B * Nk, Hkv * dk, 112, 2.0).cast<S>();
    const gattn::RowMatrix<S> v = random_matrix(B * Nk, Hkv * dv, 113).cast<S>();
    std::unique_ptr<bool[]> first_half(new bool[Nk]), second_half(new bool[Nk]);
    for (Index j = 0; j < Nk; ++j) {
        first_half[j] = j < split;
        second_half[j] = j >= split;
    }
    const gattn::HeadLayout layout{B, H, Hkv};
    gattn::RowMatrix<S> lse1, lse2, lse_full;
    gattn::SdpaOptions<S> o1, o2;
    o1.mask.bool_mask = {first_half.get(), 1, 1, 1, Nk};
    o2.mask.bool_mask = {second_half.get(), 1, 1, 1, Nk};
    const auto out1 = gattn::scaled_dot_product_attention<S>(q, k, v, layout, o1, {&lse1, nullptr, nullptr});
    const auto out2 = gattn::scaled_dot_product_attention<S>(q, k, v, layout, o2, {&lse2, nullptr, nullptr});
    const auto full = gattn::scaled_dot_product_attention<S>(q, k, v, layout, {}, {&lse_full, nullptr, nullptr});
    Mat merged(B * Nq, H * dv), merged_lse(B * Nq, H);
    for (Index r = 0; r < B * Nq; ++r)
        for (Index h = 0; h < H; ++h) {
            const double l1 = lse1(r, h), l2 = lse2(r, h);
            const double m = std::max(l1, l2);
            const double w1 = std::exp(l1 - m), w2 = std::exp(l2 - m);
            merged_lse(r, h) = m + std::log(w1 + w2);
            for (Index d = 0; d < dv; ++d)
                merged(r, h * dv + d) = (w1 * out1(r, h * dv + d) + w2 * out2(r, h * dv + d)) / (w1 + w2);
        }
    using T = Tol<S>;
    expect_close(merged, full.template cast<double>(), 2 * T::atol, 2 * T::rtol, "SdpaLseMerge/out");
    expect_close(merged_lse, lse_full.template cast<double>(), 2 * T::atol, 2 * T::rtol, "SdpaLseMerge/lse");
}

/// A batch of 0 sequences is valid and writes nothing.
TYPED_TEST(SdpaTyped, EmptyBatch) {
    using S = TypeParam;
    const gattn::RowMatrix<S> q(0, 16), k(0, 8), v(0, 12);
    gattn::RowMatrix<S> out(0, 24);
    EXPECT_NO_THROW(gattn::scaled_dot_product_attention<S>(q, k, v, gattn::HeadLayout{0, 2, 1}, out));
}

// ---------------------------------------------------------------------------------------------
// Validation: the right exception, a message naming the argument, and an untouched output.

struct ValidationFixture {
    static constexpr Index B = 2, Nq = 3, Nk = 5, H = 4, Hkv = 2, dk = 6, dv = 3;
    gattn::RowMatrix<float> q = random_matrix(B * Nq, H* dk, 7).cast<float>();
    gattn::RowMatrix<float> k = random_matrix(B * Nk, Hkv* dk, 8).cast<float>();
    gattn::RowMatrix<float> v = random_matrix(B * Nk, Hkv* dv, 9).cast<float>();
    gattn::RowMatrix<float> out = gattn::RowMatrix<float>::Constant(B * Nq, H* dv, 42.0f);
    gattn::HeadLayout layout{B, H, Hkv};
    gattn::SdpaOptions<float> opt;
};

/// Runs call, expects exception E (and, when plain_invalid, not a shape_error) whose message
/// names the function and contains `needle`; the output keeps its sentinel values.
template <class E, class F>
void expect_rejected(F&& call, const std::string& needle, const gattn::RowMatrix<float>& out,
                     bool plain_invalid = false) {
    try {
        call();
        ADD_FAILURE() << "no exception; expected one mentioning '" << needle << "'";
    } catch (const E& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find(needle), std::string::npos) << "message: " << what;
        EXPECT_NE(what.find("scaled_dot_product_attention"), std::string::npos) << "message: " << what;
        if (plain_invalid) {
            EXPECT_EQ(dynamic_cast<const gattn::shape_error*>(&e), nullptr)
                << "expected std::invalid_argument, got shape_error: " << what;
        }
    } catch (const std::exception& e) {
        ADD_FAILURE() << "wrong exception type: " << e.what();
    }
    EXPECT_TRUE((out.array() == 42.0f).all()) << "the output was written before validation";
}

/// Head-major keys must have B·H_kv·N_k rows of d_k = query.cols() / H, values key's rows;
/// the message names the layout, and nothing is written.
TEST(SdpaValidation, HeadMajorShapes) {
    ValidationFixture f;  // B = 2, H_kv = 2, d_k = 6, N_k = 5
    const gattn::RowMatrix<float> k = gattn::RowMatrix<float>::Zero(f.B * f.Hkv * f.Nk, f.dk),
                                  v = gattn::RowMatrix<float>::Zero(f.B * f.Hkv * f.Nk, f.dv);
    const gattn::RowMatrix<float> k_rows = gattn::RowMatrix<float>::Zero(f.B * f.Hkv * f.Nk - 2, f.dk),
                                  k_cols = gattn::RowMatrix<float>::Zero(f.B * f.Hkv * f.Nk, f.dk + 1),
                                  v_rows = gattn::RowMatrix<float>::Zero(f.B * f.Hkv * f.Nk - 4, f.dv);
    using gattn::HeadMajorRows;
    auto call = [&](const gattn::RowMatrix<float>& key, const gattn::RowMatrix<float>& value) {
        return [&] {
            gattn::scaled_dot_product_attention<float>(f.q, HeadMajorRows<float>(key), HeadMajorRows<float>(value),
                                                       f.layout, f.out, f.opt);
        };
    };
    expect_rejected<gattn::shape_error>(
        call(k_rows, v),
        "key must have shape head-major [B*num_kv_heads*N_k, head_dim] = [multiple of 4, 6], got [18, 6]", f.out);
    expect_rejected<gattn::shape_error>(call(k_cols, v), "got [20, 7]", f.out);
    expect_rejected<gattn::shape_error>(call(k, v_rows),
                                        "value must have shape head-major [20, value_head_dim >= 1], got [16, 3]",
                                        f.out);
    // A token-major key passed as head-major has H_kv times too few rows.
    expect_rejected<gattn::shape_error>(call(f.k, v), "head-major", f.out);
    // Valid shapes run, and a bad head count is still named first.
    EXPECT_NO_THROW(call(k, v)());
    gattn::RowMatrix<float> out2 = gattn::RowMatrix<float>::Constant(f.out.rows(), f.out.cols(), 42.0f);
    expect_rejected<std::invalid_argument>(
        [&] {
            gattn::scaled_dot_product_attention<float>(f.q, HeadMajorRows<float>(k_rows), HeadMajorRows<float>(v),
                                                       {f.B, f.H, 3}, out2, f.opt);
        },
        "num_kv_heads", out2, true);
}

// HeadMajorRows keeps a pointer to row-major storage, never a converted copy that would die
// with the constructor's argument: column-major matrices and expressions do not convert.
static_assert(std::is_constructible_v<gattn::HeadMajorRows<float>, const gattn::RowMatrix<float>&>);
static_assert(std::is_constructible_v<gattn::HeadMajorRows<float>, const gattn::ConstMatrixRef<float>&>);
static_assert(std::is_constructible_v<gattn::HeadMajorRows<float>,
                                      decltype(std::declval<const gattn::RowMatrix<float>&>().middleCols(1, 2))>);
static_assert(!std::is_constructible_v<gattn::HeadMajorRows<float>, const Eigen::MatrixXf&>);
static_assert(!std::is_constructible_v<gattn::HeadMajorRows<float>, const gattn::RowMatrix<double>&>);
static_assert(!std::is_constructible_v<gattn::HeadMajorRows<float>,
                                       decltype(std::declval<const gattn::RowMatrix<double>&>().cast<float>())>);

/// B·H_kv past Index's range with no rows at all: nothing to compute, no overflow (B = H = H_kv
/// = 2³², d_k = 1; the token-major call returns for the same shapes).
TEST(SdpaValidation, HeadMajorHugeHeadCountsWithoutRows) {
    const Index n = Index(1) << 32;
    const float dummy = 0;
    float out_dummy = 0;
    const Eigen::Map<const gattn::RowMatrix<float>> q(&dummy, 0, n), k(&dummy, 0, 1);
    Eigen::Map<gattn::RowMatrix<float>> out(&out_dummy, 0, n);
    EXPECT_NO_THROW(gattn::scaled_dot_product_attention<float>(q, gattn::HeadMajorRows<float>(k),
                                                               gattn::HeadMajorRows<float>(k), {n, n, n}, out));
    const Eigen::Map<const gattn::RowMatrix<float>> k1(&dummy, 1, 1);
    try {
        gattn::scaled_dot_product_attention<float>(q, gattn::HeadMajorRows<float>(k1), gattn::HeadMajorRows<float>(k1),
                                                   {n, n, n}, out);
        ADD_FAILURE() << "one key row for 2^64 (sequence, KV head) pairs was accepted";
    } catch (const gattn::shape_error& e) {
        EXPECT_NE(std::string(e.what()).find("multiple of 4294967296*4294967296"), std::string::npos) << e.what();
    }
}

TEST(SdpaValidation, QueryWidthNotMultipleOfHeads) {
    ValidationFixture f;
    const gattn::RowMatrix<float> q = f.q.leftCols(f.H * f.dk - 1);
    expect_rejected<gattn::shape_error>(
        [&] { gattn::scaled_dot_product_attention<float>(q, f.k, f.v, f.layout, f.out, f.opt); }, "query", f.out);
}

TEST(SdpaValidation, QueryRowsNotMultipleOfBatch) {
    ValidationFixture f;
    const gattn::RowMatrix<float> q = gattn::RowMatrix<float>::Zero(7, f.H * f.dk);
    const std::string want = "query must have shape [B*N_q, num_heads*head_dim] = [multiple of 2, " +
                             std::to_string(f.H * f.dk) + "], got [7, " + std::to_string(f.H * f.dk) + "]";
    expect_rejected<gattn::shape_error>(
        [&] {
            gattn::scaled_dot_product_attention<float>(q, f.k, f.v, {2, f.H, f.Hkv}, f.out, f.opt);
        },
        want, f.out);
}

TEST(SdpaValidation, KeyWidthMismatch) {
    ValidationFixture f;
    const gattn::RowMatrix<float> k = f.k.leftCols(f.Hkv * f.dk - 2);
    expect_rejected<gattn::shape_error>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, k, f.v, f.layout, f.out, f.opt); }, "key", f.out);
}

TEST(SdpaValidation, ValueRowsMismatch) {
    ValidationFixture f;
    const gattn::RowMatrix<float> v = f.v.topRows(f.v.rows() - 2);
    expect_rejected<gattn::shape_error>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, v, f.layout, f.out, f.opt); }, "value", f.out);
}

TEST(SdpaValidation, OutputWrongShape) {
    ValidationFixture f;
    gattn::RowMatrix<float> out = gattn::RowMatrix<float>::Constant(f.B * f.Nq, f.H * f.dk, 42.0f);
    expect_rejected<gattn::shape_error>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, out, f.opt); }, "out", out);
}

TEST(SdpaValidation, KvHeadsMustDivideHeads) {
    ValidationFixture f;
    const gattn::HeadLayout bad{f.B, f.H, 3};
    expect_rejected<std::invalid_argument>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, bad, f.out, f.opt); }, "num_kv_heads", f.out,
        true);
}

TEST(SdpaValidation, KeyLengthOutOfRange) {
    ValidationFixture f;
    f.opt.mask.key_lengths = {f.Nk, f.Nk + 1};
    expect_rejected<std::invalid_argument>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); }, "key_lengths",
        f.out, true);
    f.opt.mask.key_lengths = {-1, 0};
    expect_rejected<std::invalid_argument>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); }, "key_lengths",
        f.out, true);
}

TEST(SdpaValidation, KeyLengthsWrongCount) {
    ValidationFixture f;
    f.opt.mask.key_lengths = {f.Nk};
    expect_rejected<gattn::shape_error>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); }, "key_lengths",
        f.out);
}

TEST(SdpaValidation, QueryLengthsWrongCount) {
    ValidationFixture f;
    f.opt.mask.query_lengths = {f.Nq};
    expect_rejected<gattn::shape_error>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); },
        "mask.query_lengths must have shape [2], got [1]", f.out);
}

TEST(SdpaValidation, QueryLengthOutOfRange) {
    ValidationFixture f;
    f.opt.mask.query_lengths = {f.Nq, f.Nq + 1};
    expect_rejected<std::invalid_argument>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); },
        "mask.query_lengths[1] must be in [0, N_q = 3], got 4", f.out, true);
    f.opt.mask.query_lengths = {-2, 0};
    expect_rejected<std::invalid_argument>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); },
        "mask.query_lengths[0] must be in [0, N_q = 3], got -2", f.out, true);
}

TEST(SdpaValidation, QueryOffsetsCountAndRange) {
    ValidationFixture f;
    f.opt.mask.query_offsets = {0};
    expect_rejected<gattn::shape_error>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); },
        "mask.query_offsets must have shape [2], got [1]", f.out);
    f.opt.mask.query_offsets = {0, f.Nk + 1};
    expect_rejected<std::invalid_argument>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); },
        "mask.query_offsets[1] must be in [-N_q, N_k] = [-3, " + std::to_string(f.Nk) + "], got " +
            std::to_string(f.Nk + 1),
        f.out, true);
    f.opt.mask.query_offsets = {-f.Nq - 1, 0};
    expect_rejected<std::invalid_argument>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); },
        "mask.query_offsets[0] must be in [-N_q, N_k]", f.out, true);
}

/// Hand-worked alignment: 2 queries, 3 keys, causal. Bottom-right: query 0 sees keys 0..1,
/// query 1 sees 0..2. Top-left: query 0 sees key 0 only (its output is V row 0), query 1 sees
/// keys 0..1. Offset −1: query 0 sees nothing (output 0), query 1 sees key 0.
TEST(SdpaAlignment, TopLeftAndOffsetsByHand) {
    gattn::RowMatrix<double> q(2, 1), k(3, 1), v(3, 1);
    q << 0, 0;  // equal logits: outputs are plain means of the visible V rows
    k << 1, 2, 3;
    v << 10, 20, 60;
    auto run = [&](gattn::CausalAlignment a, std::vector<Index> offsets) {
        gattn::SdpaOptions<double> o;
        o.mask.causal = true;
        o.mask.alignment = a;
        o.mask.query_offsets = std::move(offsets);
        return gattn::scaled_dot_product_attention<double>(q, k, v, {1, 1, 1}, o);
    };
    const auto bottom_right = run(gattn::CausalAlignment::BottomRight, {});
    EXPECT_DOUBLE_EQ(bottom_right(0, 0), 15.0);
    EXPECT_DOUBLE_EQ(bottom_right(1, 0), 30.0);
    const auto top_left = run(gattn::CausalAlignment::TopLeft, {});
    EXPECT_DOUBLE_EQ(top_left(0, 0), 10.0);
    EXPECT_DOUBLE_EQ(top_left(1, 0), 15.0);
    const auto offset = run(gattn::CausalAlignment::BottomRight, {-1});  // offsets override alignment
    EXPECT_DOUBLE_EQ(offset(0, 0), 0.0);
    EXPECT_DOUBLE_EQ(offset(1, 0), 10.0);
}

TEST(SdpaValidation, SinksCountAndValues) {
    ValidationFixture f;
    f.opt.sinks = {0.0f, 1.0f};
    expect_rejected<gattn::shape_error>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); },
        "sinks must have shape [4], got [2]", f.out);
    f.opt.sinks = {0.0f, 1.0f, std::numeric_limits<float>::quiet_NaN(), 0.0f};
    expect_rejected<std::invalid_argument>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); },
        "sinks[2] must be finite or -inf (no sink), got nan", f.out, true);
    f.opt.sinks = {0.0f, std::numeric_limits<float>::infinity(), 0.0f, 0.0f};
    expect_rejected<std::invalid_argument>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); },
        "sinks[1] must be finite or -inf", f.out, true);
}

/// Hand-worked sink: one query, two keys with equal logits, V = 1 and 3, sink log 2: the
/// denominator is 1 + 1 + 2 = 4, so out = (1 + 3) / 4 = 1 and log-sum-exp = log 4. With no
/// visible key the row gives 0 and log-sum-exp log 2.
TEST(SdpaSinks, HandWorked) {
    gattn::RowMatrix<double> q(1, 1), k(2, 1), v(2, 1), lse;
    q << 0;
    k << 1, -1;
    v << 1, 3;
    gattn::SdpaOptions<double> o;
    o.sinks = {std::log(2.0)};
    gattn::SdpaOutputs<double> extra;
    extra.log_sum_exp = &lse;
    gattn::RowMatrix<double> out(1, 1);
    gattn::scaled_dot_product_attention<double>(q, k, v, {1, 1, 1}, out, o, extra);
    EXPECT_NEAR(out(0, 0), 1.0, 1e-15);
    EXPECT_NEAR(lse(0, 0), std::log(4.0), 1e-15);
    o.mask.key_lengths = {0};
    gattn::scaled_dot_product_attention<double>(q, k, v, {1, 1, 1}, out, o, extra);
    EXPECT_EQ(out(0, 0), 0.0);
    EXPECT_NEAR(lse(0, 0), std::log(2.0), 1e-15);
}

/// Keys split in two calls, the sinks given to one of them: merge_attention gives the
/// one-call result (causal GQA, the float64 reference's tolerance).
TEST(SdpaSinks, MergeStaysExactWithSinksOnOneSide) {
    const Index B = 2, Nq = 3, Nk = 40, H = 4, Hkv = 2, d = 16, cut = 25;
    const Mat q = random_matrix(B * Nq, H * d, 71), k = random_matrix(B * Nk, Hkv * d, 72),
              v = random_matrix(B * Nk, Hkv * d, 73);
    gattn::SdpaOptions<double> whole;
    whole.sinks = {0.5, -std::numeric_limits<double>::infinity(), 1.5, -0.5};
    gattn::RowMatrix<double> lse_all, lse_a, lse_b;
    gattn::SdpaOutputs<double> e_all, e_a, e_b;
    e_all.log_sum_exp = &lse_all;
    e_a.log_sum_exp = &lse_a;
    e_b.log_sum_exp = &lse_b;
    gattn::RowMatrix<double> out_all(B * Nq, H * d), out_a(B * Nq, H * d), out_b(B * Nq, H * d);
    gattn::scaled_dot_product_attention<double>(q, k, v, {B, H, Hkv}, out_all, whole, e_all);
    // Keys [0, cut) of each sequence with the sinks, keys [cut, Nk) without.
    Mat ka(B * cut, Hkv * d), va(B * cut, Hkv * d), kb(B * (Nk - cut), Hkv * d), vb(B * (Nk - cut), Hkv * d);
    for (Index b = 0; b < B; ++b) {
        ka.middleRows(b * cut, cut) = k.middleRows(b * Nk, cut);
        va.middleRows(b * cut, cut) = v.middleRows(b * Nk, cut);
        kb.middleRows(b * (Nk - cut), Nk - cut) = k.middleRows(b * Nk + cut, Nk - cut);
        vb.middleRows(b * (Nk - cut), Nk - cut) = v.middleRows(b * Nk + cut, Nk - cut);
    }
    gattn::SdpaOptions<double> without;
    gattn::scaled_dot_product_attention<double>(q, ka, va, {B, H, Hkv}, out_a, whole, e_a);
    gattn::scaled_dot_product_attention<double>(q, kb, vb, {B, H, Hkv}, out_b, without, e_b);
    gattn::RowMatrix<double> merged(B * Nq, H * d), lse_merged(B * Nq, H);
    gattn::merge_attention<double>(out_a, lse_a, out_b, lse_b, merged, lse_merged);
    gattn_test::expect_close(merged, out_all, 1e-13, 1e-13, "SinkMerge/out");
    gattn_test::expect_close(lse_merged, lse_all, 1e-13, 1e-13, "SinkMerge/lse");
}

/// Decodes one token of each of 2 sequences against a cache of Nk keys per sequence (H query
/// heads on Hkv KV heads, head_dim d) and checks the output and log-sum-exp against the float64
/// reference, with ALiBi and a key length that leaves 5 NaN keys of sequence 0 unread.
/// The head-major copy [B·H_kv·N, d] of token-major rows [B·N, H_kv·d] (row (b·H_kv + g)·N + j
/// holds row b·N + j's columns [g·d, (g + 1)·d)).
template <class M>
M head_major_copy(const M& rows, Index B, Index Hkv) {
    const Index N = rows.rows() / B, d = rows.cols() / Hkv;
    M hm(B * Hkv * N, d);
    for (Index b = 0; b < B; ++b)
        for (Index g = 0; g < Hkv; ++g) hm.middleRows((b * Hkv + g) * N, N) = rows.block(b * N, g * d, N, d);
    return hm;
}

template <class S>
void check_decode_against_reference(Index Nk, Index H, Index Hkv, Index d, unsigned seed, const std::string& label) {
    const Mat q = rounded<S>(random_matrix(2, H * d, seed));
    Mat k = rounded<S>(random_matrix(2 * Nk, Hkv * d, seed + 1)),
        v = rounded<S>(random_matrix(2 * Nk, Hkv * d, seed + 2));
    k.middleRows(Nk - 5, 5).setConstant(std::numeric_limits<double>::quiet_NaN());  // sequence 0 past its length
    v.middleRows(Nk - 5, 5).setConstant(std::numeric_limits<double>::quiet_NaN());
    RefMasks masks;
    masks.key_lengths = {Nk - 5, Nk};
    const double slopes[] = {0.0, 1e-3, 1e-2, 0.5};  // ALiBi: head h has slopes[h % 4]
    for (Index h = 0; h < H; ++h) masks.alibi_slopes.push_back(static_cast<double>(static_cast<S>(slopes[h % 4])));
    const auto ref = gattn_test::sdpa_reference(q, k, v, 2, H, Hkv, {}, masks);
    gattn::SdpaOptions<S> o;
    o.mask.key_lengths = masks.key_lengths;
    for (double m : masks.alibi_slopes) o.alibi_slopes.push_back(static_cast<S>(m));
    gattn::RowMatrix<S> out(2, H * d), lse;
    gattn::SdpaOutputs<S> extra;
    extra.log_sum_exp = &lse;
    gattn::scaled_dot_product_attention<S>(q.cast<S>(), k.cast<S>(), v.cast<S>(), {2, H, Hkv}, out, o, extra);
    expect_close(out, ref.out, Tol<S>::atol, Tol<S>::rtol, label + "/out", Tol<S>::nmse);
    expect_close(lse, ref.log_sum_exp, Tol<S>::atol, Tol<S>::rtol, label + "/lse");
    // The same keys and values head-major (one decoding call per KV head): the same bits.
    const gattn::RowMatrix<S> k_hm = head_major_copy<gattn::RowMatrix<S>>(k.cast<S>(), 2, Hkv),
                              v_hm = head_major_copy<gattn::RowMatrix<S>>(v.cast<S>(), 2, Hkv);
    gattn::RowMatrix<S> out_hm(2, H * d), lse_hm;
    extra.log_sum_exp = &lse_hm;
    gattn::scaled_dot_product_attention<S>(q.cast<S>(), gattn::HeadMajorRows<S>(k_hm), gattn::HeadMajorRows<S>(v_hm),
                                           {2, H, Hkv}, out_hm, o, extra);
    EXPECT_TRUE(out_hm == out) << label << ": head-major keys and values gave other bits";
    EXPECT_TRUE(lse_hm == lse) << label << ": head-major keys and values gave another log-sum-exp";
}

/// Head-major keys and values ([B·H_kv·N_k, d], PyTorch's [B, H_kv, N_k, d]) give the bits of
/// the token-major call over the same values, and the float64 reference's values, in the
/// prefill tiles (causal or not, GQA, d_v ≠ d_k, a softcap) and in decoding from cache (one or
/// two query rows per KV head); B = 2, sequence 0 sees N_k − 3 keys and the rest hold NaN.
/// Probabilities, recomputed from the keys, agree too.
TYPED_TEST(SdpaTyped, HeadMajorKeysAndValues) {
    using S = TypeParam;
    struct Shape {
        Index Nq, Nk, H, Hkv, dk, dv;
        bool causal;
    };
    const Index B = 2;
    unsigned seed = 310;
    for (const Shape& c :
         {Shape{37, 75, 4, 2, 24, 16, true}, Shape{40, 40, 3, 1, 8, 8, false}, Shape{1, 203, 8, 4, 32, 40, false},
          Shape{1, 203, 4, 4, 64, 64, true}, Shape{2, 130, 4, 2, 16, 16, true}}) {
        const std::string label = "N_q " + std::to_string(c.Nq) + ", N_k " + std::to_string(c.Nk) + ", " +
                                  std::to_string(c.H) + " on " + std::to_string(c.Hkv);
        SCOPED_TRACE(label);
        const Mat q = rounded<S>(random_matrix(B * c.Nq, c.H * c.dk, seed++));
        Mat k = rounded<S>(random_matrix(B * c.Nk, c.Hkv * c.dk, seed++)),
            v = rounded<S>(random_matrix(B * c.Nk, c.Hkv * c.dv, seed++));
        k.middleRows(c.Nk - 3, 3).setConstant(std::numeric_limits<double>::quiet_NaN());
        v.middleRows(c.Nk - 3, 3).setConstant(std::numeric_limits<double>::quiet_NaN());
        RefMasks rm;
        rm.key_lengths = {c.Nk - 3, c.Nk};
        rm.causal = c.causal;
        rm.softcap = 20.0;
        const auto ref = gattn_test::sdpa_reference(q, k, v, B, c.H, c.Hkv, {}, rm);
        gattn::SdpaOptions<S> o;
        o.mask.key_lengths = rm.key_lengths;
        o.mask.causal = c.causal;
        o.logit_softcap = 20.0;
        const gattn::RowMatrix<S> qs = q.cast<S>(), ks = k.cast<S>(), vs = v.cast<S>();
        const gattn::RowMatrix<S> k_hm = head_major_copy(ks, B, c.Hkv), v_hm = head_major_copy(vs, B, c.Hkv);
        gattn::RowMatrix<S> out(B * c.Nq, c.H * c.dv), out_hm(B * c.Nq, c.H * c.dv), lse, lse_hm, p_hm;
        gattn::SdpaOutputs<S> extra, extra_hm;
        extra.log_sum_exp = &lse;
        extra_hm.log_sum_exp = &lse_hm;
        extra_hm.probabilities = &p_hm;
        gattn::scaled_dot_product_attention<S>(qs, ks, vs, {B, c.H, c.Hkv}, out, o, extra);
        gattn::scaled_dot_product_attention<S>(qs, gattn::HeadMajorRows<S>(k_hm), gattn::HeadMajorRows<S>(v_hm),
                                               {B, c.H, c.Hkv}, out_hm, o, extra_hm);
        expect_close(out_hm, ref.out, Tol<S>::atol, Tol<S>::rtol, label + "/out", Tol<S>::nmse);
        expect_close(lse_hm, ref.log_sum_exp, Tol<S>::atol, Tol<S>::rtol, label + "/lse");
        expect_close(p_hm, ref.probabilities, Tol<S>::atol, Tol<S>::rtol, label + "/probabilities");
        EXPECT_TRUE(out_hm == out) << "head-major keys and values gave other bits";
        EXPECT_TRUE(lse_hm == lse) << "head-major keys and values gave another log-sum-exp";
    }
}

/// Decoding a cache too large for the CPU caches (30000 keys, 15 MB of float K and V: past
/// kDecodeFromMemoryBytes, where the kernel prefetches two blocks ahead).
TYPED_TEST(SdpaTyped, DecodeFromMemoryMatchesReference) {
    static_assert(gattn::kernel::kDecodeFromMemoryBytes < Index(30000) * 2 * 64 * 4, "the test must read from memory");
    check_decode_against_reference<TypeParam>(30000, 4, 1, 64, 91, "DecodeFromMemory");
}

/// The same with a KV head per query head (multi-head attention: one query row per KV head, read
/// in address order): 7003 keys of 4 KV heads, 14 MB of float K and V. Sequence 0 sees 6998
/// keys, so its last block holds 6 keys (eight and four keys at a time, then single keys).
TYPED_TEST(SdpaTyped, DecodeFromMemoryOneRowPerKvHead) {
    static_assert(gattn::kernel::kDecodeFromMemoryBytes < Index(7003) * 4 * 2 * 64 * 4,
                  "the test must read from memory");
    check_decode_against_reference<TypeParam>(7003, 4, 4, 64, 94, "DecodeFromMemoryMha");
}

/// The same with one query head on one KV head, whose rows lie back to back: 14003 keys of
/// d = 64, 14 MB of float K and V for the two sequences.
TYPED_TEST(SdpaTyped, DecodeFromMemoryOneKvHead) {
    static_assert(gattn::kernel::kDecodeFromMemoryBytes < Index(14003) * 2 * 2 * 64 * 4,
                  "the test must read from memory");
    check_decode_against_reference<TypeParam>(14003, 1, 1, 64, 97, "DecodeFromMemoryOneHead");
}

/// A decoding step of B = 2 sequences over N_k keys (203: a partial last block), H query heads
/// on H_kv: sequence 0 sees N_k − 6 keys, and those past its length hold NaN; key 101 of
/// sequence 1 is hidden by a bias of −∞ ([B, H, 1, N_k]) over a NaN value row. Random q, K, V
/// from seeds seed, seed + 1, seed + 2.
struct HiddenKeysCase {
    static constexpr Index B = 2;
    Index Nk;
    Mat q, k, v;
    std::vector<Index> lengths{Nk - 6, Nk};
    std::vector<double> bias;
    HiddenKeysCase(Index H, Index Hkv, Index dk, Index dv, unsigned seed, Index num_keys = 203)
        : Nk(num_keys),
          q(random_matrix(B, H * dk, seed)),
          k(random_matrix(B * Nk, Hkv * dk, seed + 1)),
          v(random_matrix(B * Nk, Hkv * dv, seed + 2)),
          bias(static_cast<std::size_t>(B * H * Nk), 0.0) {
        for (Index j = lengths[0]; j < Nk; ++j) {
            k.row(j).setConstant(kNaN);
            v.row(j).setConstant(kNaN);
        }
        for (Index h = 0; h < H; ++h)
            bias[static_cast<std::size_t>((H + h) * Nk + 101)] = -std::numeric_limits<double>::infinity();
        v.row(Nk + 101).setConstant(kNaN);
    }
};

/// Where float decoding runs the SVE kernel (ARM64, SVE vectors over 128 bits), it runs there,
/// not NEON's: its logits sum the features in another order, so its output differs from NEON's
/// in some bits, and both stay within float tolerance of the float64 reference. MHA and GQA (at
/// most 2 (head, query) pairs per KV head: the decoding kernel on every tier), head sizes that
/// leave a partial vector (d_k = 72, d_v = 40), a partial last key block, keys past a length
/// holding NaN, and a −∞ bias over a NaN value row mid-block.
TEST(SdpaDecoding, RunsTheSveKernelWhereItsVectorsAreWider) {
    if (!gattn::detail::sve_float_decoding())
        GTEST_SKIP() << "float decoding runs SVE on ARM64 CPUs with SVE vectors over 128 bits; here "
                     << gattn::describe(gattn::instruction_sets());
    const Index dk = 72, dv = 40;
    for (auto [H, Hkv] : {std::pair<Index, Index>{8, 8}, {4, 2}}) {
        SCOPED_TRACE(std::to_string(H) + " heads on " + std::to_string(Hkv));
        const HiddenKeysCase c(H, Hkv, dk, dv, 51);
        const Index B = c.B, Nk = c.Nk;
        const Mat &q = c.q, &k = c.k, &v = c.v;
        const std::vector<Index>& lengths = c.lengths;
        const std::vector<double>& bias = c.bias;
        RefMasks rm;
        rm.key_lengths = lengths;
        rm.bias = bias;
        const auto ref = gattn_test::sdpa_reference(q, k, v, B, H, Hkv, {}, rm);
        const std::vector<float> bias_f(bias.begin(), bias.end());
        gattn::SdpaOptions<float> opt;
        opt.mask.key_lengths = lengths;
        opt.mask.bias = {bias_f.data(), B, H, 1, Nk};
        const gattn::RowMatrix<float> qf = q.cast<float>(), kf = k.cast<float>(), vf = v.cast<float>();
        gattn::RowMatrix<float> out_sve(B, H * dv), out_neon(B, H * dv);
        gattn::scaled_dot_product_attention<float>(qf, kf, vf, {B, H, Hkv}, out_sve, opt);
        gattn::set_sve_kernels(false);
        gattn::scaled_dot_product_attention<float>(qf, kf, vf, {B, H, Hkv}, out_neon, opt);
        gattn::set_sve_kernels(true);
        expect_close(out_sve, ref.out, Tol<float>::atol, Tol<float>::rtol, "SveDecode/out", Tol<float>::nmse);
        expect_close(out_neon, ref.out, Tol<float>::atol, Tol<float>::rtol, "NeonDecode/out", Tol<float>::nmse);
        EXPECT_FALSE(out_sve == out_neon) << "the SVE kernel gave NEON's output bit for bit: did it run?";
    }
}

/// Multi-head decoding (a KV head per query head) over a cache read from memory reads each key
/// block's rows of all heads in address order: 5 and 9 heads (a group of eight and a rest),
/// d_k = 40 (a partial register on AVX-512), and d = 64 and 128 (whole registers, the loops'
/// constant trip counts on every tier), 4603 keys (a partial last block; 13–85 MB of float K
/// and V), sinks and softcap, keys past a length holding NaN, and a key hidden by a −∞ bias
/// and another by the boolean mask, both over NaN value rows mid-block: each must be skipped,
/// never multiplied by 0. Against the float64 reference, with the log-sum-exp.
TEST(SdpaDecoding, MultiHeadSkipsHiddenKeysOverNaNValues) {
    const Index Nk = 4603;
    static_assert(gattn::kernel::kDecodeFromMemoryBytes < 2 * Nk * 5 * (40 + 32) * 4, "the test must read from memory");
    for (const auto& [dk, dv] : {std::pair<Index, Index>{40, 32}, {64, 64}, {128, 128}})
        for (Index H : {5, 9}) {
            SCOPED_TRACE(std::to_string(H) + " heads, d_k " + std::to_string(dk) + ", d_v " + std::to_string(dv));
            HiddenKeysCase c(H, H, dk, dv, 61, Nk);
            const Index B = c.B;
            const Mat &q = c.q, &k = c.k;
            Mat& v = c.v;
            const std::vector<Index>& lengths = c.lengths;
            const std::vector<double>& bias = c.bias;
            std::vector<bool> attend(static_cast<std::size_t>(B * H * Nk), true);
            for (Index h = 0; h < H; ++h) attend[static_cast<std::size_t>(h * Nk + 37)] = false;
            v.row(37).setConstant(kNaN);
            RefMasks rm;
            rm.key_lengths = lengths;
            rm.bias = bias;
            rm.bool_mask = attend;
            rm.softcap = 3.0;
            for (Index h = 0; h < H; ++h) rm.sinks.push_back(0.25 * double(h % 3));
            const auto ref = gattn_test::sdpa_reference(q, k, v, B, H, H, {}, rm);
            const std::vector<float> bias_f(bias.begin(), bias.end());
            std::unique_ptr<bool[]> attend_b(new bool[attend.size()]);
            std::copy(attend.begin(), attend.end(), attend_b.get());
            gattn::SdpaOptions<float> opt;
            opt.mask.key_lengths = lengths;
            opt.mask.bias = {bias_f.data(), B, H, 1, Nk};
            opt.mask.bool_mask = {attend_b.get(), B, H, 1, Nk};
            opt.logit_softcap = 3.0;
            opt.sinks.assign(rm.sinks.begin(), rm.sinks.end());
            gattn::RowMatrix<float> out(B, H * dv), lse;
            gattn::SdpaOutputs<float> extra;
            extra.log_sum_exp = &lse;
            gattn::scaled_dot_product_attention<float>(q.cast<float>(), k.cast<float>(), v.cast<float>(), {B, H, H},
                                                       out, opt, extra);
            expect_close(out, ref.out, Tol<float>::atol, Tol<float>::rtol, "MhaDecode/out", Tol<float>::nmse);
            expect_close(lse, ref.log_sum_exp, Tol<float>::atol, Tol<float>::rtol, "MhaDecode/lse");
        }
}

TEST(SdpaValidation, SoftcapAndAlibiSlopes) {
    ValidationFixture f;
    // A float softcap lies in [FLT_MIN, FLT_MAX / (2·log₂e)]: 1e-40 is subnormal (1/c overflows),
    // 1.2e38 times log₂e is past half the largest float, 1e-50 is 0 in float.
    for (const auto& [cap, shown] : {std::pair<double, const char*>{0.0, "0"},
                                     {-1.0, "-1"},
                                     {std::numeric_limits<double>::infinity(), "inf"},
                                     {std::numeric_limits<double>::quiet_NaN(), "nan"},
                                     {1e300, "1e+300"},
                                     {3e38, "3e+38"},
                                     {1.2e38, "1.2e+38"},
                                     {1e-40, "1e-40"},
                                     {1e-50, "1e-50"}}) {
        f.opt.logit_softcap = cap;
        expect_rejected<std::invalid_argument>(
            [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); },
            std::string("logit_softcap must be in [1.175494e-38, 1.179329e+38] (a normal float whose product with "
                        "log2(e) stays within half the largest float), got ") +
                shown,
            f.out, true);
    }
    // The ends that docs/conventions.md gives are taken: float [1.1755e-38, 1.1793e38], double
    // [2.2251e-308, 6.2303e307]; the next values out (1.1754e-38, 1.1794e38; 2.2250e-308,
    // 6.2304e307) are not.
    for (double cap : {1.1755e-38, 1.1793e38}) {
        f.opt.logit_softcap = cap;
        EXPECT_NO_THROW(gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt)) << cap;
        EXPECT_TRUE(f.out.allFinite()) << cap;
    }
    for (double cap : {1.1754e-38, 1.1794e38}) {
        f.opt.logit_softcap = cap;
        EXPECT_THROW(gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt),
                     std::invalid_argument)
            << cap;
    }
    {
        const gattn::RowMatrix<double> q = f.q.cast<double>(), k = f.k.cast<double>(), v = f.v.cast<double>();
        gattn::RowMatrix<double> out(q.rows(), f.out.cols());
        gattn::SdpaOptions<double> opt;
        for (double cap : {2.2251e-308, 6.2303e307}) {
            opt.logit_softcap = cap;
            EXPECT_NO_THROW(gattn::scaled_dot_product_attention<double>(q, k, v, f.layout, out, opt)) << cap;
            EXPECT_TRUE(out.allFinite()) << cap;
        }
        for (double cap : {2.2250e-308, 6.2304e307}) {
            opt.logit_softcap = cap;
            EXPECT_THROW(gattn::scaled_dot_product_attention<double>(q, k, v, f.layout, out, opt),
                         std::invalid_argument)
                << cap;
        }
    }
    f.out.setConstant(42.0f);
    f.opt.logit_softcap.reset();
    f.opt.alibi_slopes = {0.5f, 0.25f};
    expect_rejected<gattn::shape_error>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); },
        "alibi_slopes must have shape [4], got [2]", f.out);
    // |slope| ≤ 2^62 in float: NaN, ±∞, ±2e38 and just past 2^62 are refused.
    const std::string slope_range =
        "must be in [-4.611686e+18, 4.611686e+18] (the ALiBi term of any distance stays "
        "within half the largest float), got ";
    for (const auto& [slope, shown] : {std::pair<float, const char*>{std::numeric_limits<float>::infinity(), "inf"},
                                       {std::numeric_limits<float>::quiet_NaN(), "nan"},
                                       {-3e38f, "-3e+38"},
                                       {-2e38f, "-2e+38"},
                                       {2e38f, "2e+38"},
                                       {std::nextafter(std::ldexp(1.0f, 62), 1e30f), "4.611687e+18"}}) {
        f.opt.alibi_slopes = {0.5f, 0.25f, slope, 0.0f};
        expect_rejected<std::invalid_argument>(
            [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); },
            "alibi_slopes[2] " + slope_range + shown, f.out, true);
    }
    f.opt.alibi_slopes.clear();
    gattn::RowMatrix<float> logits;
    gattn::SdpaOutputs<float> extra;
    extra.logits = &logits;
    extra.logits_stage = static_cast<gattn::LogitStage>(7);
    expect_rejected<std::invalid_argument>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt, extra); },
        "extra.logits_stage must be Scaled, Softcapped or Final", f.out, true);
}

/// The standard slopes, worked by hand from Press et al. §3: 8 heads 2^−1 … 2^−8; 12 heads the
/// 8-head slopes, then 2^−0.5, 2^−1.5, 2^−2.5, 2^−3.5 (odd powers of the 16-head base 2^−0.5).
TEST(SdpaAlibi, StandardSlopesByHand) {
    const std::vector<double> eight = gattn::alibi_slopes(8);
    ASSERT_EQ(eight.size(), 8u);
    for (int h = 0; h < 8; ++h) EXPECT_DOUBLE_EQ(eight[h], std::ldexp(1.0, -(h + 1)));
    const std::vector<double> twelve = gattn::alibi_slopes(12);
    ASSERT_EQ(twelve.size(), 12u);
    for (int h = 0; h < 8; ++h) EXPECT_DOUBLE_EQ(twelve[h], std::ldexp(1.0, -(h + 1)));
    for (int k = 0; k < 4; ++k) EXPECT_DOUBLE_EQ(twelve[8 + k], std::pow(2.0, -0.5 - k));
    const std::vector<double> one = gattn::alibi_slopes(1);
    ASSERT_EQ(one.size(), 1u);
    EXPECT_DOUBLE_EQ(one[0], 1.0 / 256);
    EXPECT_THROW(gattn::alibi_slopes(0), std::invalid_argument);
}

/// Hand-worked ALiBi: two keys with equal logits, causal bottom-right, so the query sits at
/// key 1: key 0 gets −m, key 1 gets 0. With m = ln 3 the weights are 1/4 and 3/4: V = 4 and 8
/// give 7, and log-sum-exp = log(1/3 + 1) = log(4/3). Top-left puts the query at key 0:
/// causal, it sees key 0 alone (4); without the causal mask key 1 gets −m (weights 3/4, 1/4: 5).
TEST(SdpaAlibi, HandWorked) {
    gattn::RowMatrix<double> q(1, 1), k(2, 1), v(2, 1), lse, out(1, 1);
    q << 0;
    k << 1, -1;
    v << 4, 8;
    gattn::SdpaOptions<double> o;
    o.alibi_slopes = {std::log(3.0)};
    o.mask.causal = true;
    gattn::SdpaOutputs<double> extra;
    extra.log_sum_exp = &lse;
    gattn::scaled_dot_product_attention<double>(q, k, v, {1, 1, 1}, out, o, extra);
    EXPECT_NEAR(out(0, 0), 7.0, 1e-14);
    EXPECT_NEAR(lse(0, 0), std::log(4.0 / 3.0), 1e-15);
    o.mask.alignment = gattn::CausalAlignment::TopLeft;
    gattn::scaled_dot_product_attention<double>(q, k, v, {1, 1, 1}, out, o, extra);
    EXPECT_NEAR(out(0, 0), 4.0, 1e-15);
    o.mask.causal = false;
    gattn::scaled_dot_product_attention<double>(q, k, v, {1, 1, 1}, out, o, extra);
    EXPECT_NEAR(out(0, 0), 5.0, 1e-14);
}

/// Hand-worked softcap: logits 3 and −3 (q = 3, k = ±1, scale 1) capped at c = 3 become
/// ±3·tanh(1); the weights are σ(±6·tanh(1)), so with V = 0 and 1 the output is σ(−6·tanh 1).
/// An infinite logit is capped to c (a finite weight), not passed through.
TEST(SdpaSoftcap, HandWorked) {
    gattn::RowMatrix<double> q(1, 1), k(2, 1), v(2, 1), out(1, 1);
    q << 3;
    k << 1, -1;
    v << 0, 1;
    gattn::SdpaOptions<double> o;
    o.scale = 1.0;
    o.logit_softcap = 3.0;
    gattn::scaled_dot_product_attention<double>(q, k, v, {1, 1, 1}, out, o);
    EXPECT_NEAR(out(0, 0), 1.0 / (1.0 + std::exp(6.0 * std::tanh(1.0))), 1e-15);
    k << std::numeric_limits<double>::infinity(), -1;  // logits +∞ and −3: capped 3 and −3·tanh 1
    gattn::scaled_dot_product_attention<double>(q, k, v, {1, 1, 1}, out, o);
    EXPECT_NEAR(out(0, 0), 1.0 / (1.0 + std::exp(3.0 + 3.0 * std::tanh(1.0))), 1e-15);
}

/// Runs SDPA in storage S (compute type compute_t<S>) on double inputs rounded to S; returns the
/// output and log-sum-exp in double.
template <class S>
std::pair<Mat, Mat> run_stored(const Mat& q, const Mat& k, const Mat& v, const gattn::HeadLayout& heads,
                               const gattn::SdpaOptions<gattn::compute_t<S>>& o) {
    using T = gattn::compute_t<S>;
    gattn::RowMatrix<S> out(q.rows(), heads.num_heads * (v.cols() / heads.num_kv_heads));
    gattn::RowMatrix<T> lse;
    gattn::SdpaOutputs<T> extra;
    extra.log_sum_exp = &lse;
    gattn::scaled_dot_product_attention<S>(q.cast<S>(), k.cast<S>(), v.cast<S>(), heads, out, o, extra);
    return {out.template cast<T>().template cast<double>(), lse.template cast<double>()};
}

/// A softcap at the ends of its range, in the decoding and the prefill kernels and in float,
/// bf16 (base-2 kernels) and double: q = 0 and k = v = 1 over three keys give logits 0, weights
/// 1/3, output 1 and log-sum-exp log 3, worked by hand. In float, c = 1e-40 once gave NaN (1/c
/// overflows, and simd::softcap met 0·∞): it is refused, and FLT_MIN, the smallest c taken,
/// gives the answer; double takes 1e-40. Logits ±√32 and 2√32, far above a tiny c, are capped
/// to ±c ≈ 0: the weights stay 1/3, and V rows 1, 2, 3 average to 2.
template <class S>
void check_softcap_range(Index nq) {
    using T = gattn::compute_t<S>;
    SCOPED_TRACE(std::string(gattn_test::type_label<S>()) + ", " + std::to_string(nq) + " queries");
    const Index d = 32;  // the VDPBF16PS kernels' multiple of 32
    const Mat q = Mat::Zero(nq, d), k = Mat::Ones(3, d), v = Mat::Ones(3, d);
    const double low = std::is_same_v<T, double> ? 1e-40 : double(std::numeric_limits<float>::min());
    for (double cap : {low, 2.5e-38, 1.0, gattn::detail::softcap_max<T>()}) {
        gattn::SdpaOptions<T> o;
        o.logit_softcap = cap;
        const auto [out, lse] = run_stored<S>(q, k, v, {1, 1, 1}, o);
        for (Index r = 0; r < nq; ++r) {
            EXPECT_NEAR(lse(r, 0), std::log(3.0), 1e-6) << "c = " << cap << ", row " << r;
            for (Index e = 0; e < d; ++e) ASSERT_NEAR(out(r, e), 1.0, 1e-6) << "c = " << cap << ", row " << r;
        }
    }
    Mat k2(3, d), v2(3, d);
    k2.row(0).setConstant(1);
    k2.row(1).setConstant(-1);
    k2.row(2).setConstant(2);
    v2.row(0).setConstant(1);
    v2.row(1).setConstant(2);
    v2.row(2).setConstant(3);
    gattn::SdpaOptions<T> o;
    o.logit_softcap = low;
    const auto [out, lse] = run_stored<S>(Mat::Ones(nq, d), k2, v2, {1, 1, 1}, o);
    for (Index r = 0; r < nq; ++r) {
        EXPECT_NEAR(lse(r, 0), std::log(3.0), 1e-6) << "row " << r;
        for (Index e = 0; e < d; ++e) ASSERT_NEAR(out(r, e), 2.0, 1e-2) << "row " << r;  // bf16 rounds 2 to 2
    }
    if constexpr (!std::is_same_v<T, double>) {
        o.logit_softcap = 1e-40;
        gattn::RowMatrix<S> y = gattn::RowMatrix<S>::Constant(nq, d, S(42.0f));
        EXPECT_THROW(gattn::scaled_dot_product_attention<S>(q.cast<S>(), k.cast<S>(), v.cast<S>(), {1, 1, 1}, y, o),
                     std::invalid_argument);
        EXPECT_TRUE((y.template cast<float>().array() == 42.0f).all()) << "written before validation";
    }
}

TEST(SdpaSoftcap, TinyAndHugeCapsInEveryKernel) {
    for (Index nq : {1, 64}) {  // decoding (keys in lanes), prefill (queries in lanes)
        check_softcap_range<float>(nq);
        check_softcap_range<double>(nq);
        check_softcap_range<gattn::bfloat16>(nq);
    }
}

/// Plain float64 ALiBi attention, no mask: for query i of the single sequence at aligned
/// position offset + i, logit_j = scale·q_i·k_j − m_h·|offset + i − j|, softmax over all keys.
std::pair<Mat, Mat> alibi_reference(const Mat& q, const Mat& k, const Mat& v, Index H,
                                    const std::vector<double>& slopes, Index offset) {
    const Index nq = q.rows(), nk = k.rows(), d = q.cols() / H, dv = v.cols();
    Mat out = Mat::Zero(nq, H * dv), lse(nq, H);
    for (Index h = 0; h < H; ++h)
        for (Index i = 0; i < nq; ++i) {
            std::vector<double> x(static_cast<std::size_t>(nk));
            double m = -std::numeric_limits<double>::infinity();
            for (Index j = 0; j < nk; ++j) {
                const double dot = q.row(i).segment(h * d, d).dot(k.row(j));
                x[j] = dot / std::sqrt(double(d)) - slopes[h] * std::abs(double(offset + i - j));
                m = std::max(m, x[j]);
            }
            double sum = 0;
            for (Index j = 0; j < nk; ++j) sum += std::exp(x[j] - m);
            for (Index j = 0; j < nk; ++j) out.row(i).segment(h * dv, dv) += std::exp(x[j] - m) / sum * v.row(j);
            lse(i, h) = m + std::log(sum);
        }
    return {out, lse};
}

/// ALiBi at the ends of its range against the float64 reference above: slopes ±2^62 (the
/// largest a float call takes; ±2e38 once gave NaN, or rows of −∞ with output 0 and
/// log-sum-exp −∞, and are now refused), 2 and 64 queries (decoding and prefill kernels), the
/// queries at the keys' end (bottom-right) or before the first key (offset −2: every distance
/// ≥ 2), in float, bf16 (base-2 kernels) and double (which takes ±1e200). Distances to the
/// nearest key (+m) and to the farthest (−m) are unique, so the exact weights are one-hot.
template <class S>
void check_alibi_range(Index nq) {
    using T = gattn::compute_t<S>;
    const Index nk = 70, H = 2, d = 32;
    const Mat q = rounded<S>(random_matrix(nq, H * d, 61)), k = rounded<S>(random_matrix(nk, d, 62)),
              v = rounded<S>(random_matrix(nk, d, 63));
    const double m = std::is_same_v<T, double> ? 1e200 : std::ldexp(1.0, 62);
    for (Index offset : {nk - nq, Index(-2)}) {
        SCOPED_TRACE(std::string(gattn_test::type_label<S>()) + ", " + std::to_string(nq) + " queries, offset " +
                     std::to_string(offset));
        gattn::SdpaOptions<T> o;
        o.alibi_slopes = {T(m), T(-m)};
        if (offset < 0) o.mask.query_offsets = {offset};
        const auto [out, lse] = run_stored<S>(q, k, v, {1, H, 1}, o);
        const auto [want_out, want_lse] = alibi_reference(q, k, v, H, {m, -m}, offset);
        EXPECT_TRUE(lse.allFinite());
        expect_close(out, want_out, 1e-5, 1e-5, "ALiBi at the range's end: out");
        expect_close(lse, want_lse, 1e-5, 1e-5, "ALiBi at the range's end: lse");
    }
    if constexpr (!std::is_same_v<T, double>) {
        gattn::SdpaOptions<T> o;
        o.alibi_slopes = {T(2e38), T(-2e38)};
        gattn::RowMatrix<S> y = gattn::RowMatrix<S>::Constant(nq, H * d, S(42.0f));
        EXPECT_THROW(gattn::scaled_dot_product_attention<S>(q.cast<S>(), k.cast<S>(), v.cast<S>(), {1, H, 1}, y, o),
                     std::invalid_argument);
        EXPECT_TRUE((y.template cast<float>().array() == 42.0f).all()) << "written before validation";
    }
}

TEST(SdpaAlibi, LargestSlopesMatchFloat64Reference) {
    for (Index nq : {2, 64}) {
        check_alibi_range<float>(nq);
        check_alibi_range<double>(nq);
        check_alibi_range<gattn::bfloat16>(nq);
    }
}

/// The logits output at each stage against logits computed here in double: scaled, then
/// c·tanh(x/c), then −m_h·|i' − j| and the bias, −∞ where the causal mask or the bias hides a
/// key. GQA, two sequences, bottom-right causal with N_q < N_k.
TYPED_TEST(SdpaTyped, LogitsOutputAtEachStage) {
    using S = TypeParam;
    const Index B = 2, Nq = 3, Nk = 7, H = 4, Hkv = 2, d = 8;
    const Mat q = rounded<S>(random_matrix(B * Nq, H * d, 81)), k = rounded<S>(random_matrix(B * Nk, Hkv * d, 82)),
              v = rounded<S>(random_matrix(B * Nk, Hkv * d, 83));
    std::vector<S> bias(static_cast<std::size_t>(Nq * Nk));
    for (std::size_t e = 0; e < bias.size(); ++e)
        bias[e] = e % 5 == 1 ? -std::numeric_limits<S>::infinity() : static_cast<S>(0.1 * double(e % 4));
    gattn::SdpaOptions<S> o;
    o.scale = 0.5;
    o.logit_softcap = 0.8;
    o.alibi_slopes = {S(0.5), S(0.25), S(0), S(-0.125)};
    o.mask.causal = true;
    o.mask.bias = {bias.data(), 1, 1, Nq, Nk};
    const gattn::RowMatrix<S> qs = q.cast<S>(), ks = k.cast<S>(), vs = v.cast<S>();
    gattn::RowMatrix<S> out(B * Nq, H * d);
    const double cap = static_cast<double>(static_cast<S>(0.8));
    for (auto stage : {gattn::LogitStage::Scaled, gattn::LogitStage::Softcapped, gattn::LogitStage::Final}) {
        gattn::RowMatrix<S> logits;
        gattn::SdpaOutputs<S> extra;
        extra.logits = &logits;
        extra.logits_stage = stage;
        gattn::scaled_dot_product_attention<S>(qs, ks, vs, {B, H, Hkv}, out, o, extra);
        ASSERT_EQ(logits.rows(), B * H * Nq);
        ASSERT_EQ(logits.cols(), Nk);
        Mat expected(B * H * Nq, Nk);
        for (Index b = 0; b < B; ++b)
            for (Index h = 0; h < H; ++h)
                for (Index i = 0; i < Nq; ++i)
                    for (Index j = 0; j < Nk; ++j) {
                        double x = 0.5 *
                                   q.row(b * Nq + i).segment(h * d, d).dot(k.row(b * Nk + j).segment(h / 2 * d, d));
                        if (stage != gattn::LogitStage::Scaled) x = cap * std::tanh(x / cap);
                        if (stage == gattn::LogitStage::Final) {
                            const Index pos = i + Nk - Nq;
                            const double b_ij = static_cast<double>(bias[static_cast<std::size_t>(i * Nk + j)]);
                            if (j > pos || b_ij == -gattn_test::kInf)
                                x = -gattn_test::kInf;
                            else
                                x += -static_cast<double>(o.alibi_slopes[h]) * double(pos - j) + b_ij;
                        }
                        expected((b * H + h) * Nq + i, j) = x;
                    }
        expect_close(logits, expected, Tol<S>::atol, Tol<S>::rtol, "Logits");
    }
}

TEST(SdpaValidation, WindowMustBePositive) {
    ValidationFixture f;
    f.opt.mask.sliding_window = 0;
    expect_rejected<std::invalid_argument>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); }, "sliding_window",
        f.out, true);
}

TEST(SdpaValidation, BoolMaskWrongDims) {
    ValidationFixture f;
    std::unique_ptr<bool[]> m(new bool[64]());
    f.opt.mask.bool_mask = {m.get(), 1, 3, 1, f.Nk};  // 3 heads: neither 1 nor H
    expect_rejected<gattn::shape_error>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); }, "bool_mask", f.out);
}

TEST(SdpaValidation, BiasWrongKeyLength) {
    ValidationFixture f;
    std::vector<float> bias(64, 0.0f);
    f.opt.mask.bias = {bias.data(), 1, 1, 1, f.Nk + 1};
    expect_rejected<gattn::shape_error>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); }, "bias", f.out);
}

TEST(SdpaValidation, NonFiniteScale) {
    ValidationFixture f;
    f.opt.scale = std::numeric_limits<double>::quiet_NaN();
    expect_rejected<std::invalid_argument>(
        [&] { gattn::scaled_dot_product_attention<float>(f.q, f.k, f.v, f.layout, f.out, f.opt); }, "scale", f.out,
        true);
}

TEST(SdpaValidation, OutputOverlappingInput) {
    // q has exactly out's shape when d_v = d_k; writing into it is refused.
    const Index B = 1, N = 4, H = 2, d = 3;
    gattn::RowMatrix<float> q = random_matrix(B * N, H * d, 11).cast<float>();
    const gattn::RowMatrix<float> k = random_matrix(B * N, H * d, 12).cast<float>();
    const gattn::RowMatrix<float> v = random_matrix(B * N, H * d, 13).cast<float>();
    const gattn::RowMatrix<float> q_before = q;
    try {
        gattn::scaled_dot_product_attention<float>(q, k, v, gattn::HeadLayout{B, H, H}, q);
        ADD_FAILURE() << "out aliasing query was accepted";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("out"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(q == q_before) << "query was modified";
}

TEST(SdpaValidation, OutputBesideInputsInOneWorkspace) {
    // Q, K, V and out as column blocks of one matrix (a fused workspace): no element is shared,
    // so the call is accepted and matches the reference; one more column of out would reach
    // into V and is refused, with V unchanged.
    const Index B = 2, N = 9, H = 2, d = 5, w = H * d;
    const Mat ws = gattn_test::rounded<float>(random_matrix(B * N, 4 * w + 3, 14));
    gattn::RowMatrix<float> work = ws.cast<float>();
    work.rightCols(w + 3).setConstant(7.0f);
    gattn::SdpaOptions<float> opt;
    opt.mask.causal = true;
    gattn::scaled_dot_product_attention<float>(work.leftCols(w), work.middleCols(w, w), work.middleCols(2 * w, w),
                                               gattn::HeadLayout{B, H, H}, work.middleCols(3 * w, w), opt);
    RefMasks rm;
    rm.causal = true;
    const auto ref =
        gattn_test::sdpa_reference(ws.leftCols(w), ws.middleCols(w, w), ws.middleCols(2 * w, w), B, H, H, {}, rm);
    using T = Tol<float>;
    expect_close(work.middleCols(3 * w, w), ref.out, T::atol, T::rtol, "SdpaWorkspace/out", T::nmse);
    EXPECT_TRUE(work.leftCols(3 * w) == ws.leftCols(3 * w).cast<float>()) << "an input was written";
    EXPECT_TRUE((work.rightCols(3).array() == 7.0f).all()) << "columns right of out were written";
    const gattn::RowMatrix<float> before = work;
    try {
        gattn::scaled_dot_product_attention<float>(work.leftCols(w), work.middleCols(w, w), work.middleCols(2 * w, w),
                                                   gattn::HeadLayout{B, H, H}, work.middleCols(2 * w + 1, w), opt);
        ADD_FAILURE() << "out sharing columns with value was accepted";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("out"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(work == before) << "a refused call wrote";
}

TEST(SdpaValidation, OverlapTestAgreesWithSharedElements) {
    // detail::views_overlap against the sets of elements two strided views cover, for views of
    // one buffer at every offset, including rows that run past the row stride into the next row.
    std::vector<float> buf(200);
    using View = Eigen::Map<const gattn::RowMatrix<float>, 0, Eigen::OuterStride<>>;
    auto elements = [&](const View& v) {
        std::vector<bool> used(buf.size(), false);
        for (Index i = 0; i < v.rows(); ++i)
            for (Index j = 0; j < v.cols(); ++j)
                used[static_cast<std::size_t>(v.data() + i * v.outerStride() + j - buf.data())] = true;
        return used;
    };
    int checked = 0, shared = 0;
    for (Index s : {4, 7})
        for (Index s2 : {s, s + 1})
            for (Index off_a = 0; off_a < 2 * s; ++off_a)
                for (Index off_b = 0; off_b < 3 * s; ++off_b)
                    for (Index rows_a : {1, 3})
                        for (Index rows_b : {2, 4})
                            for (Index cols_a = 1; cols_a <= s; ++cols_a)
                                for (Index cols_b = 1; cols_b <= std::min(s, s2); cols_b += 2) {
                                    const View a(buf.data() + off_a, rows_a, cols_a, Eigen::OuterStride<>(s));
                                    const View b(buf.data() + off_b, rows_b, cols_b, Eigen::OuterStride<>(s2));
                                    const auto ea = elements(a), eb = elements(b);
                                    bool common = false;
                                    for (std::size_t i = 0; i < buf.size(); ++i) common = common || (ea[i] && eb[i]);
                                    const bool got = gattn::detail::views_overlap(a, b);
                                    ++checked;
                                    shared += common;
                                    // Equal strides are exact; other strides may only over-report.
                                    if (s == s2) {
                                        ASSERT_EQ(got, common)
                                            << "stride " << s << " a at " << off_a << " [" << rows_a << "x" << cols_a
                                            << "], b at " << off_b << " [" << rows_b << "x" << cols_b << "]";
                                        ASSERT_EQ(gattn::detail::views_overlap(b, a), common);
                                    } else if (common) {
                                        ASSERT_TRUE(got);
                                    }
                                }
    EXPECT_GT(shared, checked / 8);
    EXPECT_LT(shared, checked);
}

// ---------------------------------------------------------------------------------------------
// Extreme and non-finite values against the float64 reference, on both kernels: query tiles
// (many (head, query) pairs per KV head) and the decoding path (one query per sequence; 2100
// keys make two split-KV chunks, and the chosen keys sit in both).

struct KernelShape {
    const char* name;
    Index B, Nq, Nk, H, Hkv, dk, dv;
};
const KernelShape kKernelShapes[] = {
    {"tiles", 2, 37, 70, 4, 2, 8, 12},
    {"decoding", 2, 1, 2100, 4, 2, 8, 12},
};

/// Number of (row, head) blocks of a [B·N_q, H·d_v] result that hold a NaN, and that are finite.
template <class M>
std::pair<Index, Index> nan_and_finite_blocks(const M& out, Index H) {
    const Index dv = out.cols() / H;
    Index nan = 0, finite = 0;
    for (Index r = 0; r < out.rows(); ++r)
        for (Index h = 0; h < H; ++h) {
            const auto block = out.block(r, h * dv, 1, dv);
            if (block.array().isNaN().any()) ++nan;
            if (block.allFinite()) ++finite;
        }
    return {nan, finite};
}

/// Additive biases of ±1e30 are finite, so they do not mask: keys with +1e30 take all the weight
/// and share it equally (the logit's own part is lost in rounding, in float and double alike), a
/// row whose visible keys all have −1e30 averages them, and −∞ still masks.
TYPED_TEST(SdpaTyped, HugeBiasLogitsMatchReference) {
    using S = TypeParam;
    for (const auto& sh : kKernelShapes) {
        SCOPED_TRACE(sh.name);
        const Index B = sh.B, Nq = sh.Nq, Nk = sh.Nk, H = sh.H, Hkv = sh.Hkv;
        const Mat q = rounded<S>(random_matrix(B * Nq, H * sh.dk, 201));
        const Mat k = rounded<S>(random_matrix(B * Nk, Hkv * sh.dk, 202));
        const Mat v = rounded<S>(random_matrix(B * Nk, Hkv * sh.dv, 203));
        std::vector<S> bias(static_cast<std::size_t>(B * H * Nq * Nk));
        std::mt19937_64 rng(204);
        std::uniform_real_distribution<double> u(0.0, 1.0);
        for (std::size_t row = 0; row < bias.size() / Nk; ++row) {
            S* b = bias.data() + row * Nk;
            switch (row % 4) {
                case 0:  // a mix of everything
                    for (Index j = 0; j < Nk; ++j) {
                        const double x = u(rng);
                        b[j] = x < 0.05  ? S(1e30)
                               : x < 0.4 ? S(-1e30)
                               : x < 0.5 ? -std::numeric_limits<S>::infinity()
                                         : S(4 * x - 2);
                    }
                    break;
                case 1:  // only −1e30 and −∞: the −1e30 keys share the weight
                    for (Index j = 0; j < Nk; ++j) b[j] = u(rng) < 0.2 ? -std::numeric_limits<S>::infinity() : S(-1e30);
                    break;
                case 2:  // one +1e30 key, which every query of the row sees (key 0)
                    for (Index j = 0; j < Nk; ++j) b[j] = S(0);
                    b[0] = S(1e30);
                    break;
                default:
                    for (Index j = 0; j < Nk; ++j) b[j] = S(4 * u(rng) - 2);
            }
        }
        const gattn::RowMatrix<S> qs = q.cast<S>(), ks = k.cast<S>(), vs = v.cast<S>();
        gattn::SdpaOptions<S> opt;
        opt.mask.causal = true;
        opt.mask.bias = {bias.data(), B, H, Nq, Nk};
        gattn::RowMatrix<S> lse;
        gattn::SdpaOutputs<S> extra;
        extra.log_sum_exp = &lse;
        const auto got = gattn::scaled_dot_product_attention<S>(qs, ks, vs, {B, H, Hkv}, opt, extra);
        RefMasks rm;
        rm.causal = true;
        rm.bias.assign(bias.begin(), bias.end());
        const auto ref = gattn_test::sdpa_reference(q, k, v, B, H, Hkv, {}, rm);
        EXPECT_GE(ref.log_sum_exp.maxCoeff(), 1e30) << "the case should have +1e30 logits";
        EXPECT_TRUE(got.allFinite());
        using T = Tol<S>;
        expect_close(got, ref.out, T::atol, T::rtol, "SdpaHugeBias/out", T::nmse);
        expect_close(lse, ref.log_sum_exp, T::atol, T::rtol, "SdpaHugeBias/lse");
    }
}

/// Logits near ±1e31 from Q·K itself: q and k are small integers times 2^50 and the scale is
/// 1/8, so every logit is exact in float and double and ties stay ties. The largest logit of a
/// row (shared equally by tied keys) takes all the weight; the others underflow to 0.
TYPED_TEST(SdpaTyped, HugeQueryKeyProductsMatchReference) {
    using S = TypeParam;
    for (const auto& sh : kKernelShapes) {
        SCOPED_TRACE(sh.name);
        const Index B = sh.B, Nq = sh.Nq, Nk = sh.Nk, H = sh.H, Hkv = sh.Hkv;
        const double two50 = std::ldexp(1.0, 50);
        const Mat q = (random_matrix(B * Nq, H * sh.dk, 211, 3.49).array().round() * two50).matrix();
        const Mat k = (random_matrix(B * Nk, Hkv * sh.dk, 212, 3.49).array().round() * two50).matrix();
        const Mat v = rounded<S>(random_matrix(B * Nk, Hkv * sh.dv, 213));
        const gattn::RowMatrix<S> qs = q.cast<S>(), ks = k.cast<S>(), vs = v.cast<S>();
        gattn::SdpaOptions<S> opt;
        opt.scale = 0.125;
        opt.mask.causal = true;
        opt.mask.key_lengths = {Nk, Nk - 9};
        gattn::RowMatrix<S> lse;
        gattn::SdpaOutputs<S> extra;
        extra.log_sum_exp = &lse;
        const auto got = gattn::scaled_dot_product_attention<S>(qs, ks, vs, {B, H, Hkv}, opt, extra);
        RefMasks rm;
        rm.causal = true;
        rm.key_lengths = opt.mask.key_lengths;
        const auto ref = gattn_test::sdpa_reference(q, k, v, B, H, Hkv, 0.125, rm);
        EXPECT_GE(ref.log_sum_exp.cwiseAbs().maxCoeff(), 1e30) << "the case should have logits of 1e30";
        EXPECT_TRUE(got.allFinite());
        using T = Tol<S>;
        expect_close(got, ref.out, T::atol, T::rtol, "SdpaHugeQK/out", T::nmse);
        expect_close(lse, ref.log_sum_exp, T::atol, T::rtol, "SdpaHugeQK/lse");
    }
}

/// Denormal float inputs. Q, K and V all 1e-40f: the logits underflow to 0 and each row averages
/// its visible values, 1e-40f. Then values near FLT_MIN: q·k products around FLT_MIN and V of a
/// few FLT_MIN, so results land among the denormals. Nothing is flushed to zero, nothing becomes
/// NaN; the tolerance allows one rounding of a denormal per key.
TEST(SdpaExtremeValues, DenormalFloatInputsMatchReference) {
    constexpr float kFltMin = std::numeric_limits<float>::min();
    const double denorm_min = std::numeric_limits<float>::denorm_min();
    for (const auto& sh : kKernelShapes) {
        SCOPED_TRACE(sh.name);
        const Index B = sh.B, Nq = sh.Nq, Nk = sh.Nk, H = sh.H, Hkv = sh.Hkv;
        const double atol = static_cast<double>(Nk) * denorm_min;
        gattn::SdpaOptions<float> opt;
        opt.mask.causal = true;
        opt.mask.key_lengths = {Nk, Nk - 5};
        RefMasks rm;
        rm.causal = true;
        rm.key_lengths = opt.mask.key_lengths;
        gattn::RowMatrix<float> lse;
        gattn::SdpaOutputs<float> extra;
        extra.log_sum_exp = &lse;

        const gattn::RowMatrix<float> q1 = gattn::RowMatrix<float>::Constant(B * Nq, H * sh.dk, 1e-40f);
        const gattn::RowMatrix<float> k1 = gattn::RowMatrix<float>::Constant(B * Nk, Hkv * sh.dk, 1e-40f);
        const gattn::RowMatrix<float> v1 = gattn::RowMatrix<float>::Constant(B * Nk, Hkv * sh.dv, 1e-40f);
        ASSERT_EQ(std::fpclassify(q1(0, 0)), FP_SUBNORMAL);
        const auto got1 = gattn::scaled_dot_product_attention<float>(q1, k1, v1, {B, H, Hkv}, opt, extra);
        const auto ref1 =
            gattn_test::sdpa_reference(q1.cast<double>(), k1.cast<double>(), v1.cast<double>(), B, H, Hkv, {}, rm);
        EXPECT_TRUE(got1.allFinite());
        expect_close(got1, ref1.out, atol, 1e-5, "SdpaDenormal/constant out");
        expect_close(lse, ref1.log_sum_exp, 1e-5, 1e-5, "SdpaDenormal/constant lse");

        const double qk_scale = std::ldexp(1.0, -63);  // |q·k| terms around 2^-126 = FLT_MIN
        const gattn::RowMatrix<float> q2 = (random_matrix(B * Nq, H * sh.dk, 221) * qk_scale).cast<float>();
        const gattn::RowMatrix<float> k2 = (random_matrix(B * Nk, Hkv * sh.dk, 222) * qk_scale).cast<float>();
        gattn::RowMatrix<float> v2 = (random_matrix(B * Nk, Hkv * sh.dv, 223) * (4.0 * kFltMin)).cast<float>();
        v2.row(3).setConstant(std::numeric_limits<float>::denorm_min());
        v2.row(4).setConstant(kFltMin / 3);
        const auto got2 = gattn::scaled_dot_product_attention<float>(q2, k2, v2, {B, H, Hkv}, opt, extra);
        const auto ref2 =
            gattn_test::sdpa_reference(q2.cast<double>(), k2.cast<double>(), v2.cast<double>(), B, H, Hkv, {}, rm);
        EXPECT_TRUE(got2.allFinite());
        EXPECT_GT(got2.cwiseAbs().maxCoeff(), 0.0f) << "denormal results were flushed to zero";
        expect_close(got2, ref2.out, atol, 1e-5, "SdpaDenormal/near FLT_MIN out");
        expect_close(lse, ref2.log_sum_exp, 1e-5, 1e-5, "SdpaDenormal/near FLT_MIN lse");
    }
}

/// Values up to FLT_MAX / N_k in magnitude give finite outputs (docs/conventions.md, "Numerics":
/// the kernels sum e^(ℓ − m)·v over the keys before dividing by the row sum): every value
/// positive, the worst case for that sum, on every kernel shape, against the float64 reference.
TEST(SdpaExtremeValues, ValuesUpToLargestOverKeysStayFinite) {
    for (const auto& sh : kKernelShapes) {
        SCOPED_TRACE(sh.name);
        const Index B = sh.B, Nq = sh.Nq, Nk = sh.Nk, H = sh.H, Hkv = sh.Hkv;
        const double c = 0.99 * std::numeric_limits<float>::max() / static_cast<double>(Nk);
        const gattn::RowMatrix<float> q = random_matrix(B * Nq, H * sh.dk, 231).cast<float>();
        const gattn::RowMatrix<float> k = random_matrix(B * Nk, Hkv * sh.dk, 232).cast<float>();
        const gattn::RowMatrix<float> v =
            ((random_matrix(B * Nk, Hkv * sh.dv, 233).array().abs() * 0.5 + 0.5) * c).matrix().cast<float>();
        gattn::SdpaOptions<float> opt;
        opt.mask.causal = true;
        RefMasks rm;
        rm.causal = true;
        const auto got = gattn::scaled_dot_product_attention<float>(q, k, v, {B, H, Hkv}, opt);
        const auto ref =
            gattn_test::sdpa_reference(q.cast<double>(), k.cast<double>(), v.cast<double>(), B, H, Hkv, {}, rm);
        EXPECT_TRUE(got.allFinite());
        expect_close((got.cast<double>() / c).eval(), (ref.out / c).eval(), 1e-5, 1e-4, "values near FLT_MAX / N_k");
    }
}

/// NaN in a key that some queries see (one K element of one key, one V element of another) and
/// +∞ in a third key's K: as IEEE arithmetic says, a query that sees the NaN key gets NaN in
/// every element of the heads reading it, the NaN value element makes only that element NaN, an
/// +∞ logit gives NaN (∞ − ∞) and a −∞ logit weight 0. Queries that do not see them (boolean
/// mask, causal) are unaffected. The reference decides which blocks are NaN.
TYPED_TEST(SdpaTyped, NonFiniteVisibleKeysReachOnlyTheirQueries) {
    using S = TypeParam;
    for (const auto& sh : kKernelShapes) {
        SCOPED_TRACE(sh.name);
        const Index B = sh.B, Nq = sh.Nq, Nk = sh.Nk, H = sh.H, Hkv = sh.Hkv;
        Mat q = rounded<S>(random_matrix(B * Nq, H * sh.dk, 231));
        Mat k = rounded<S>(random_matrix(B * Nk, Hkv * sh.dk, 232));
        Mat v = rounded<S>(random_matrix(B * Nk, Hkv * sh.dv, 233));
        const bool decoding = Nq == 1;
        const Index nan_key = decoding ? 2060 : 5, nan_value = decoding ? 100 : 20, inf_key = decoding ? 2090 : 12;
        k(0 * Nk + nan_key, 3) = kNaN;            // sequence 0, KV head 0
        v(1 * Nk + nan_value, sh.dv + 2) = kNaN;  // sequence 1, KV head 1, element 2
        k(1 * Nk + inf_key, 1) = kInf;            // sequence 1, KV head 0
        const std::size_t n = static_cast<std::size_t>(B * H * Nq * Nk);
        std::unique_ptr<bool[]> allow(new bool[n]);
        std::mt19937_64 rng(234);
        for (std::size_t i = 0; i < n; ++i) allow[i] = std::bernoulli_distribution(0.7)(rng);
        const gattn::RowMatrix<S> qs = q.cast<S>(), ks = k.cast<S>(), vs = v.cast<S>();
        gattn::SdpaOptions<S> opt;
        opt.mask.causal = true;
        opt.mask.bool_mask = {allow.get(), B, H, Nq, Nk};
        gattn::RowMatrix<S> lse;
        gattn::SdpaOutputs<S> extra;
        extra.log_sum_exp = &lse;
        const auto got = gattn::scaled_dot_product_attention<S>(qs, ks, vs, {B, H, Hkv}, opt, extra);
        RefMasks rm;
        rm.causal = true;
        rm.bool_mask.assign(allow.get(), allow.get() + n);
        const auto ref = gattn_test::sdpa_reference(q, k, v, B, H, Hkv, {}, rm);
        const auto [nan_blocks, finite_blocks] = nan_and_finite_blocks(ref.out, H);
        EXPECT_GT(nan_blocks, 0) << "no query sees the non-finite keys";
        EXPECT_GT(finite_blocks, 0);
        using T = Tol<S>;
        expect_close(got, ref.out, T::atol, T::rtol, "SdpaNonFiniteVisible/out");
        expect_close(lse, ref.log_sum_exp, T::atol, T::rtol, "SdpaNonFiniteVisible/lse");
    }
}

/// ±∞ and NaN in the K and V rows of keys that key lengths, the causal mask, the window and a
/// boolean key row hide from every query: the result equals the reference without them.
TYPED_TEST(SdpaTyped, NonFiniteMaskedKeysDoNotLeak) {
    using S = TypeParam;
    for (const auto& sh : kKernelShapes) {
        SCOPED_TRACE(sh.name);
        const Index B = sh.B, Nq = sh.Nq, Nk = sh.Nk, H = sh.H, Hkv = sh.Hkv;
        const Mat q = rounded<S>(random_matrix(B * Nq, H * sh.dk, 241));
        const Mat k = rounded<S>(random_matrix(B * Nk, Hkv * sh.dk, 242));
        const Mat v = rounded<S>(random_matrix(B * Nk, Hkv * sh.dv, 243));
        std::unique_ptr<bool[]> row(new bool[static_cast<std::size_t>(B * Nk)]);
        std::mt19937_64 rng(244);
        for (Index i = 0; i < B * Nk; ++i) row[i] = std::bernoulli_distribution(0.8)(rng);
        gattn::SdpaOptions<S> opt;
        opt.mask.causal = true;
        opt.mask.sliding_window = Nq == 1 ? 1000 : 20;
        opt.mask.key_lengths = {Nk, Nk * 2 / 3};
        opt.mask.bool_mask = {row.get(), B, 1, 1, Nk};
        RefMasks rm;
        rm.causal = true;
        rm.sliding_window = opt.mask.sliding_window;
        rm.key_lengths = opt.mask.key_lengths;
        const Index dims[3] = {B, 1, 1};
        expand(row.get(), dims, B, H, Nq, Nk, rm.bool_mask);
        const auto ref = gattn_test::sdpa_reference(q, k, v, B, H, Hkv, {}, rm);
        Mat kp = k, vp = v;
        const Index poisoned = poison_invisible_keys(rm, B, H, Nq, Nk, kp, vp);
        ASSERT_GT(poisoned, 0);
        // Poisoned rows hold NaN; make every third one +∞ in K and −∞ in V, every third −∞ and +∞.
        Index seen = 0;
        for (Index r = 0; r < B * Nk; ++r) {
            if (!std::isnan(kp(r, 0))) continue;
            const Index kind = seen++ % 3;
            if (kind == 1) {
                kp.row(r).setConstant(kInf);
                vp.row(r).setConstant(-kInf);
            } else if (kind == 2) {
                kp.row(r).setConstant(-kInf);
                vp.row(r).setConstant(kInf);
            }
        }
        const gattn::RowMatrix<S> qs = q.cast<S>(), ks = kp.cast<S>(), vs = vp.cast<S>();
        gattn::RowMatrix<S> lse;
        gattn::SdpaOutputs<S> extra;
        extra.log_sum_exp = &lse;
        const auto got = gattn::scaled_dot_product_attention<S>(qs, ks, vs, {B, H, Hkv}, opt, extra);
        EXPECT_TRUE(got.allFinite());
        using T = Tol<S>;
        expect_close(got, ref.out, T::atol, T::rtol, "SdpaNonFiniteMasked/out", T::nmse);
        expect_close(lse, ref.log_sum_exp, T::atol, T::rtol, "SdpaNonFiniteMasked/lse");
        expect_masked_rows_zero(got, ref.log_sum_exp, sh.dv, "SdpaNonFiniteMasked");
    }
}

// Inputs found by an adversarial search: each one once crashed, corrupted memory or gave a
// wrong answer.

TEST(SdpaHardening, ExtraOutputAliasingAnInputIsRejected) {
    using M = gattn::RowMatrix<float>;
    M q = M::Random(4, 4), k = M::Random(4, 4), v = M::Random(4, 4), out = M::Constant(4, 4, 3.0f);
    const M q_before = q;
    gattn::SdpaOutputs<float> extra;
    extra.probabilities = &q;  // would be resized (freeing q's storage) while q is read
    EXPECT_THROW(gattn::scaled_dot_product_attention<float>(q, k, v, {1, 1, 1}, out, {}, extra), std::invalid_argument);
    EXPECT_TRUE(q == q_before);
    extra.probabilities = nullptr;
    extra.log_sum_exp = &out;
    EXPECT_THROW(gattn::scaled_dot_product_attention<float>(q, k, v, {1, 1, 1}, out, {}, extra), std::invalid_argument);
    EXPECT_TRUE((out.array() == 3.0f).all());
}

TEST(SdpaHardening, HugeSlidingWindowEqualsNoWindow) {
    using M = gattn::RowMatrix<float>;
    const M q = M::Random(4, 8), k = M::Random(6, 8), v = M::Random(6, 8);
    for (bool causal : {false, true}) {
        gattn::SdpaOptions<float> plain, windowed;
        plain.mask.causal = windowed.mask.causal = causal;
        windowed.mask.sliding_window = std::numeric_limits<Index>::max();
        EXPECT_TRUE(gattn::scaled_dot_product_attention<float>(q, k, v, {1, 2, 2}, windowed) ==
                    gattn::scaled_dot_product_attention<float>(q, k, v, {1, 2, 2}, plain))
            << "causal " << causal;
    }
}

TEST(SdpaHardening, ScaleThatOverflowsFloatIsRejected) {
    using M = gattn::RowMatrix<float>;
    gattn::SdpaOptions<float> opt;
    opt.scale = 1e39;  // finite as a double, +inf as a float
    EXPECT_THROW(gattn::scaled_dot_product_attention<float>(M::Zero(2, 4), M::Zero(2, 4), M::Zero(2, 4), {1, 1, 1},
                                                            opt),
                 std::invalid_argument);
}

TEST(SdpaHardening, BiasOverlappingOutIsRejected) {
    std::vector<float> buffer(6, 0.0f);
    Eigen::Map<gattn::RowMatrix<float>> out(buffer.data(), 3, 2);
    using M = gattn::RowMatrix<float>;
    const M q = M::Random(3, 2), k = M::Random(3, 2), v = M::Random(3, 2);
    gattn::SdpaOptions<float> opt;
    opt.mask.bias = gattn::MaskView<float>{buffer.data(), 1, 1, 1, 3};
    EXPECT_THROW(gattn::scaled_dot_product_attention<float>(q, k, v, {1, 1, 1}, out, opt), std::invalid_argument);
}

TEST(SdpaHardening, NoKeysGivesZerosAndMinusInfinityLogSumExp) {
    using M = gattn::RowMatrix<float>;
    M lse;
    gattn::SdpaOutputs<float> extra;
    extra.log_sum_exp = &lse;
    const M out = gattn::scaled_dot_product_attention<float>(M::Random(3, 8), M(0, 8), M(0, 8), {1, 2, 2}, {}, extra);
    EXPECT_TRUE((out.array() == 0.0f).all());
    EXPECT_TRUE((lse.array() == -std::numeric_limits<float>::infinity()).all());
}

}  // namespace

namespace {

// Property test: thousands of random small configurations (both kernels: query tiles and the
// decoding path) with random mask combinations, float SDPA against the float64 reference.
TEST(SdpaProperty, RandomConfigurationsMatchReference) {
    std::mt19937_64 rng(20261129);
    auto pick = [&](Index lo, Index hi) { return std::uniform_int_distribution<Index>(lo, hi)(rng); };
    auto coin = [&](double p) { return std::bernoulli_distribution(p)(rng); };
    int failures = 0;
    for (int trial = 0; trial < 2000 && failures == 0; ++trial) {
        const Index B = pick(1, 3), Hkv = pick(1, 3), H = Hkv * pick(1, 4);
        const Index Nq = coin(0.4) ? 1 : pick(1, 24), Nk = pick(1, 150), dk = pick(1, 40), dv = pick(1, 40);
        const gattn::RowMatrix<float> q = random_matrix(B * Nq, H * dk, 3 * trial + 1, 2.0).cast<float>();
        const gattn::RowMatrix<float> k = random_matrix(B * Nk, Hkv * dk, 3 * trial + 2, 2.0).cast<float>();
        const gattn::RowMatrix<float> v = random_matrix(B * Nk, Hkv * dv, 3 * trial + 3).cast<float>();
        RefMasks ref;
        gattn::SdpaOptions<float> opt;
        ref.causal = opt.mask.causal = coin(0.5);
        if (coin(0.3)) ref.sliding_window = opt.mask.sliding_window = pick(1, 40);
        if (coin(0.4))
            for (Index b = 0; b < B; ++b) ref.key_lengths.push_back(pick(0, Nk));
        opt.mask.key_lengths = ref.key_lengths;
        std::unique_ptr<bool[]> bool_data;
        std::vector<float> bias_data;
        const std::size_t n = static_cast<std::size_t>(B * H * Nq * Nk);
        if (coin(0.3)) {
            bool_data.reset(new bool[n]);
            for (std::size_t i = 0; i < n; ++i) bool_data[i] = coin(0.85);
            ref.bool_mask.assign(bool_data.get(), bool_data.get() + n);
            opt.mask.bool_mask = {bool_data.get(), B, H, Nq, Nk};
        }
        if (coin(0.3)) {
            for (std::size_t i = 0; i < n; ++i)
                bias_data.push_back(coin(0.1) ? -std::numeric_limits<float>::infinity()
                                              : std::uniform_real_distribution<float>(-2, 2)(rng));
            ref.bias.assign(bias_data.begin(), bias_data.end());
            opt.mask.bias = {bias_data.data(), B, H, Nq, Nk};
        }
        const auto want =
            gattn_test::sdpa_reference(q.cast<double>(), k.cast<double>(), v.cast<double>(), B, H, Hkv, {}, ref);
        const auto got = gattn::scaled_dot_product_attention<float>(q, k, v, {B, H, Hkv}, opt);
        const auto stats = expect_close(got, want.out, 1e-5, 1e-4,
                                        "trial " + std::to_string(trial) + " B=" + std::to_string(B) +
                                            " H=" + std::to_string(H) + "/" + std::to_string(Hkv) +
                                            " Nq=" + std::to_string(Nq) + " Nk=" + std::to_string(Nk) +
                                            " dk=" + std::to_string(dk) + " dv=" + std::to_string(dv));
        failures += stats.failures > 0;
    }
    EXPECT_EQ(failures, 0);
}

TEST(SdpaHardening, ProbabilitiesStayExactWhenEveryLogitIsHuge) {
    // A finite "minus infinity" bias on every key (a padded row masked with finfo.min) leaves
    // the keys visible with equal logits: each gets 1/3, which exp(s − lse) alone would not give.
    using M = gattn::RowMatrix<float>;
    const M q = M::Random(1, 4), k = M::Random(3, 4), v = M::Random(3, 4);
    std::vector<float> bias{-1e30f, -1e30f, -1e30f};
    gattn::SdpaOptions<float> opt;
    opt.mask.bias = gattn::MaskView<float>{bias.data(), 1, 1, 1, 3};
    M probabilities;
    gattn::SdpaOutputs<float> extra;
    extra.probabilities = &probabilities;
    gattn::scaled_dot_product_attention<float>(q, k, v, {1, 1, 1}, opt, extra);
    for (Index j = 0; j < 3; ++j) EXPECT_NEAR(probabilities(0, j), 1.0f / 3, 1e-6f);
}

TEST(SdpaHardening, FloatMaskIsExactBeyondTwoToThe24Keys) {
    // Key positions above 2^24 are not all representable in float: the masks must not round
    // them. Logits are all 0, so each output is the mean of V over the query's window; V is
    // a small integer ramp near the end, 0 elsewhere. Prefill tiles (64 queries) and decoding
    // (8 queries) both.
    using M = gattn::RowMatrix<float>;
    const Index nk = (Index(1) << 24) + 64, window = 48, ramp = 200;
    M k = M::Zero(nk, 1), v = M::Zero(nk, 1);
    for (Index j = nk - ramp; j < nk; ++j) v(j, 0) = static_cast<float>(j - (nk - ramp));
    for (const Index nq : {Index(64), Index(8)}) {
        SCOPED_TRACE("N_q = " + std::to_string(nq));
        const M q = M::Zero(nq, 1);
        gattn::SdpaOptions<float> opt;
        opt.mask.causal = true;
        opt.mask.sliding_window = window;
        const M out = gattn::scaled_dot_product_attention<float>(q, k, v, {1, 1, 1}, opt);
        for (Index i = 0; i < nq; ++i) {
            const Index last = i + nk - nq;  // bottom-right aligned: keys (last − w, last]
            double sum = 0;
            for (Index j = last - window + 1; j <= last; ++j) sum += v(j, 0);
            EXPECT_NEAR(out(i, 0), sum / window, 1e-4) << "query " << i;
        }
    }
}

TYPED_TEST(SdpaTyped, NaNScoreOfTheOnlyVisibleKeyOfABlockReachesTheRow) {
    // Even rows see keys 3 and 20, odd rows key 3 alone; K row 20 is NaN. Even rows are NaN
    // (a NaN logit makes the softmax NaN), odd rows equal V row 3. One query (decoding) and
    // 24 (query tiles).
    using S = TypeParam;
    using M = gattn::RowMatrix<S>;
    const Index nk = 40, d = 4;
    M k = M::Constant(nk, d, S(0.25)), v(nk, d);
    for (Index j = 0; j < nk; ++j)
        for (Index c = 0; c < d; ++c) v(j, c) = static_cast<S>(j + 0.5 * c);
    k.row(20).setConstant(std::numeric_limits<S>::quiet_NaN());
    for (const Index nq : {Index(1), Index(24)}) {
        SCOPED_TRACE("N_q = " + std::to_string(nq));
        const M q = M::Constant(nq, d, S(0.5));
        std::array<bool, 24 * 40> allow{};
        for (Index i = 0; i < nq; ++i) {
            allow[static_cast<std::size_t>(i * nk + 3)] = true;
            allow[static_cast<std::size_t>(i * nk + 20)] = i % 2 == 0;
        }
        gattn::SdpaOptions<S> opt;
        opt.mask.bool_mask = {allow.data(), 1, 1, nq, nk};
        M lse;
        gattn::SdpaOutputs<S> extra;
        extra.log_sum_exp = &lse;
        const M out = gattn::scaled_dot_product_attention<S>(q, k, v, {1, 1, 1}, opt, extra);
        for (Index i = 0; i < nq; ++i) {
            if (i % 2 == 0) {
                EXPECT_TRUE(out.row(i).array().isNaN().all()) << "row " << i << ": " << out.row(i);
                EXPECT_TRUE(std::isnan(lse(i, 0))) << "row " << i;
            } else {
                EXPECT_EQ(out.row(i), v.row(3)) << "row " << i;
            }
        }
    }
}

TEST(SdpaHardening, NaNValueOfAVisibleKeyWhoseWeightUnderflowsReachesTheRow) {
    // Logits 0, −200, 0: key 1's weight e^−200 underflows to 0 in float, and 0·NaN = NaN, as
    // the float64 reference (weight 1.4e-87) also gives. Where key 1 is masked its NaN must
    // not leak: those rows are (V₀ + V₂)/2 = 2. Decoding (2 queries) and query tiles (24),
    // each with the mask (partial tiles) and, for the all-visible rows, without (full tiles).
    using M = gattn::RowMatrix<float>;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    M k(3, 1), v(3, 1);
    k << 0.0f, -200.0f, 0.0f;
    v << 1.0f, nan, 3.0f;
    for (const Index nq : {Index(2), Index(24)}) {
        SCOPED_TRACE("N_q = " + std::to_string(nq));
        const M q = M::Constant(nq, 1, 1.0f);
        std::array<bool, 24 * 3> allow{};
        for (Index i = 0; i < nq; ++i)
            for (Index j = 0; j < 3; ++j) allow[static_cast<std::size_t>(i * 3 + j)] = j != 1 || i % 2 == 0;
        gattn::SdpaOptions<float> opt;
        opt.scale = 1.0;
        const M all_visible = gattn::scaled_dot_product_attention<float>(q, k, v, {1, 1, 1}, opt);
        EXPECT_TRUE(all_visible.array().isNaN().all()) << all_visible.transpose();
        opt.mask.bool_mask = {allow.data(), 1, 1, nq, 3};
        const M out = gattn::scaled_dot_product_attention<float>(q, k, v, {1, 1, 1}, opt);
        for (Index i = 0; i < nq; ++i) {
            if (i % 2 == 0)
                EXPECT_TRUE(std::isnan(out(i, 0))) << "row " << i << ": " << out(i, 0);
            else
                EXPECT_EQ(out(i, 0), 2.0f) << "row " << i;
        }
    }
}

}  // namespace
