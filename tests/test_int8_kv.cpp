// int8 keys and values (ops/int8_rows.hpp): quantization worked by hand, and SDPA reading int8
// rows against the float64 reference run on the values the codes stand for (the same bytes,
// dequantized in double), so the kernels' arithmetic is checked up to float rounding (where the
// decoding kernel rounds the query to 16-bit integers for VPDPWSSD, the reference takes the
// same rounded query; its value sum's weights, rounded to 16 bits per block, stay within the
// tolerance): decoding and prefill shapes, GQA, ragged key lengths, causal and window masks,
// sinks, softcap and ALiBi, garbage past the key lengths, and thread-count invariance. The
// SDPA tests run once per decoding kernel family (AVX512-VNNI, widened float) that this build
// offers.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "gattn/gattn.hpp"
#include "support/kernel_limit.hpp"
#include "support/reference.hpp"

namespace {

using gattn::Index;
using gattn::RowMatrix;
using gattn_test::Mat;

/// An int8 matrix and its scales, as an int8 KV cache holds them.
struct Int8Matrix {
    RowMatrix<std::int8_t> codes;
    RowMatrix<float> scales;  // [rows, heads]
    Index head_dim = 0;

    Int8Matrix(const RowMatrix<float>& x, Index heads)
        : codes(x.rows(), x.cols()), scales(x.rows(), heads), head_dim(x.cols() / heads) {
        for (Index r = 0; r < x.rows(); ++r)
            EXPECT_TRUE(
                gattn::quantize_int8_row(x.row(r).data(), heads, head_dim, codes.row(r).data(), scales.row(r).data()));
    }
    gattn::Int8Rows view() const {
        return {codes.data(), codes.rows(), codes.cols(), codes.cols(), scales.data(), scales.cols()};
    }
    /// The values the codes stand for, in double: scale · code.
    Mat dequantized() const {
        Mat m(codes.rows(), codes.cols());
        for (Index r = 0; r < m.rows(); ++r)
            for (Index c = 0; c < m.cols(); ++c) m(r, c) = double(scales(r, c / head_dim)) * double(codes(r, c));
        return m;
    }
};

TEST(Int8Quantization, HandWorkedRows) {
    // Head 0: max |x| = 1.27, scale 0.01, codes x / 0.01. Head 1: zeros, scale 0. Head 2: ±max
    // give ±127, and 1/3 of the max rounds to 42 (42.33).
    const float x[12] = {0.5f, -1.27f, 0.0f, 1.0f, 0, 0, 0, 0, 3.0f, -3.0f, 1.0f, 0.0f};
    std::int8_t codes[12];
    float scales[3];
    ASSERT_TRUE(gattn::quantize_int8_row(x, 3, 4, codes, scales));
    EXPECT_FLOAT_EQ(scales[0], 0.01f);
    EXPECT_EQ(scales[1], 0.0f);
    EXPECT_FLOAT_EQ(scales[2], 3.0f / 127.0f);
    const int want[12] = {50, -127, 0, 100, 0, 0, 0, 0, 127, -127, 42, 0};
    for (int e = 0; e < 12; ++e) EXPECT_EQ(int(codes[e]), want[e]) << "element " << e;
    // Each value within half a step of its code.
    for (int e = 0; e < 12; ++e)
        EXPECT_LE(std::abs(gattn::dequantize_int8(codes[e], scales[e / 4]) - x[e]), scales[e / 4] / 2 * 1.0001f);
    // Extremes: the largest float and the smallest subnormal keep their sign and size.
    const float big[2] = {std::numeric_limits<float>::max(), -std::numeric_limits<float>::denorm_min()};
    ASSERT_TRUE(gattn::quantize_int8_row(big, 1, 2, codes, scales));
    EXPECT_EQ(int(codes[0]), 127);
    EXPECT_EQ(int(codes[1]), 0);
    EXPECT_FLOAT_EQ(gattn::dequantize_int8(codes[0], scales[0]), std::numeric_limits<float>::max());
    // The smallest subnormal: amax / 127 rounds to 0, so the scale is raised to 2⁻¹⁴⁹ itself
    // and the value is exactly code 1.
    const float tiny[2] = {std::numeric_limits<float>::denorm_min(), 0.0f};
    ASSERT_TRUE(gattn::quantize_int8_row(tiny, 1, 2, codes, scales));
    EXPECT_EQ(scales[0], std::numeric_limits<float>::denorm_min());
    EXPECT_EQ(int(codes[0]), 1);
    EXPECT_EQ(int(codes[1]), 0);
}

/// Checks the documented bound of one quantized head row in double (no rounding): every
/// |x − scale·code| ≤ scale / 2 (slack: the fast path multiplies by a rounded 127 / max|x|),
/// codes in [−127, 127] with x's sign, 0 for 0, and scale within a step of max|x| / 127.
void expect_within_half_a_step(const float* x, Index n, const std::int8_t* codes, float scale, double slack,
                               const std::string& what) {
    double amax = 0;
    for (Index e = 0; e < n; ++e) amax = std::max(amax, std::abs(double(x[e])));
    const double step = std::max(amax / 127 * 1e-6, double(std::numeric_limits<float>::denorm_min()));
    EXPECT_GE(double(scale) * 127.5, amax) << what;
    EXPECT_LE(double(scale), amax / 127 + step) << what;
    for (Index e = 0; e < n; ++e) {
        const int c = codes[e];
        EXPECT_LE(std::abs(c), 127) << what << " element " << e;
        EXPECT_LE(std::abs(double(x[e]) - double(scale) * c), double(scale) / 2 * (1 + slack))
            << what << " element " << e << ": x " << x[e] << ", code " << c << ", scale " << scale;
        if (x[e] == 0) {
            EXPECT_EQ(c, 0) << what << " element " << e;
        } else if (c != 0) {
            EXPECT_EQ(c > 0, x[e] > 0) << what << " element " << e;
        }
    }
}

/// A row whose largest magnitude is below about 1.5e-36 has a subnormal scale, and 127 / max|x|
/// overflows float: {1e-38, 0, −5e-39, 1e-40} once became codes {127, 127, −127, 127} (0 turned
/// NaN and was clamped). Each value must stay within half a step of its code, zeros 0:
/// 1e-38 is the maximum (127), 1e-40 is 1.27 steps (1), −5e-39 is −63.5 steps.
TEST(Int8Quantization, TinyRowsKeepTheErrorBound) {
    const float x[4] = {1e-38f, 0.0f, -5e-39f, 1e-40f};
    std::int8_t codes[4];
    float scale;
    ASSERT_TRUE(gattn::quantize_int8_row(x, 1, 4, codes, &scale));
    EXPECT_EQ(int(codes[0]), 127);
    EXPECT_EQ(int(codes[1]), 0);
    EXPECT_TRUE(int(codes[2]) == -63 || int(codes[2]) == -64) << int(codes[2]);
    EXPECT_EQ(int(codes[3]), 1);
    expect_within_half_a_step(x, 4, codes, scale, 0, "reproducer");

    // Rows of every size from the smallest subnormal to well past the fast path's threshold
    // (kInt8NormalScaleMax ≈ 1.5e-36): random values, zeros and the row's ±max, 32 per row.
    std::mt19937 rng(43);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int e2 = -149; e2 <= -100; ++e2)
        for (float mantissa : {1.0f, 1.37f, 1.9999f}) {
            const float amax = std::ldexp(mantissa, e2);
            float row[32];
            for (float& v : row) v = u(rng) * amax;
            row[3] = 0.0f;
            row[7] = (e2 % 2 ? -1.0f : 1.0f) * amax;
            row[11] = std::nextafter(amax, 0.0f) / 2;  // half the max: a tie for the rounding
            std::int8_t c[32];
            float s;
            ASSERT_TRUE(gattn::quantize_int8_row(row, 1, 32, c, &s));
            const bool tiny = amax < gattn::kInt8NormalScaleMax;
            expect_within_half_a_step(row, 32, c, s, tiny ? 1e-12 : 1e-6,
                                      "max |x| = " + std::to_string(mantissa) + " * 2^" + std::to_string(e2));
            // The maximum is code ±127 once the scale has a dozen bits (2^−130 / 127 is 2^12 times
            // the smallest subnormal); below, the scale is coarser, but the maximum never becomes 0.
            if (e2 >= -130)
                EXPECT_EQ(std::abs(int(c[7])), 127) << "2^" << e2;
            else
                EXPECT_GE(std::abs(int(c[7])), 1) << "2^" << e2;
        }
    // The int8 cache quantizes the rows it appends the same way: tiny keys and values keep the
    // bound in the cache's codes and scales.
    gattn::KVCache<std::int8_t> cache(1, 2, 1, 4);
    RowMatrix<float> k(1, 4);
    k << x[0], x[1], x[2], x[3];
    cache.append(k, -k, {1});
    expect_within_half_a_step(x, 4, cache.keys().data(), cache.key_scales()(0, 0), 0, "cache keys");
    const float minus_x[4] = {-x[0], -x[1], -x[2], -x[3]};
    expect_within_half_a_step(minus_x, 4, cache.values().data(), cache.value_scales()(0, 0), 0, "cache values");
}

TEST(Int8Quantization, NonFiniteValuesAreRefusedAndNothingIsWritten) {
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity()}) {
        const float x[4] = {1.0f, 2.0f, 3.0f, bad};
        std::int8_t codes[4] = {7, 7, 7, 7};
        float scales[2] = {5.0f, 5.0f};
        EXPECT_FALSE(gattn::quantize_int8_row(x, 2, 2, codes, scales));
        for (std::int8_t c : codes) EXPECT_EQ(int(c), 7);
        EXPECT_EQ(scales[0], 5.0f);
        EXPECT_EQ(scales[1], 5.0f);
    }
}

struct Case {
    std::string name;
    Index B, H, Hkv, Nq, Nk, dk, dv;
    bool causal = false;
    std::optional<Index> window = std::nullopt;
    bool ragged = false, sinks = false, alibi = false;
    std::optional<double> softcap = std::nullopt;
};

RowMatrix<float> random_rows(Index rows, Index cols, std::mt19937& rng, float spread) {
    std::normal_distribution<float> dist(0.0f, spread);
    RowMatrix<float> m(rows, cols);
    for (Index i = 0; i < m.size(); ++i) m.data()[i] = dist(rng);
    return m;
}

/// The query as the reference takes it: where the decoding kernel's integer products run, each
/// head's row rounded to 16-bit codes, and residual codes for a row with an outlier (that
/// kernel's quantize_query: AVX512-VNNI or AVX-VNNI, or SDOT's two bytes a code on ARM64), else
/// the float query.
Mat query_reference(const RowMatrix<float>& q, Index H, Index Hkv, Index Nq, Index dk) {
    Mat q_ref = q.cast<double>();
    const bool decode = gattn::detail::runs_decoding<float>(Nq, H / Hkv);
    const gattn::Int8Kernel family = gattn::int8_kernel().kernel;
#if defined(GATTN_HAS_SDOT_KERNEL)
    if (decode && family == gattn::Int8Kernel::Sdot && gattn::kernel::decode_sdot::takes(dk)) {
        for (Index r = 0; r < q.rows(); ++r)
            for (Index h = 0; h < H; ++h) {
                // Two bytes per code: high bytes, then low bytes.
                std::vector<std::int8_t> codes(2 * static_cast<std::size_t>(dk)), residual(codes.size());
                const auto s = gattn::kernel::decode_sdot::quantize_query(q.row(r).data() + h * dk, dk, codes.data(),
                                                                          residual.data());
                for (Index e = 0; e < dk; ++e) {
                    const double c = 256.0 * codes[e] + codes[dk + e], rc = 256.0 * residual[e] + residual[dk + e];
                    EXPECT_LE(std::abs(c), 32639.0);
                    q_ref(r, h * dk + e) = double(s.scale) * c + double(s.residual_scale) * rc;
                }
            }
        return q_ref;
    }
#endif
    if (decode && family != gattn::Int8Kernel::WidenedFloat && family != gattn::Int8Kernel::Sdot &&
        gattn::kernel::decode_int8::takes(dk))
        for (Index r = 0; r < q.rows(); ++r)
            for (Index h = 0; h < H; ++h) {
                std::vector<std::int16_t> codes(static_cast<std::size_t>(dk)), residual(codes.size());
                const auto s = gattn::kernel::quantize_query_for(family, q.row(r).data() + h * dk, dk, codes.data(),
                                                                 residual.data());
                // The codes stand for the query to half a code, max|q| / 65534, and a little for
                // float rounding (a wrong rounding would otherwise only show in the output's tolerance).
                double top = 0, err = 0;
                for (Index e = 0; e < dk; ++e) {
                    const double x = q(r, h * dk + e);
                    q_ref(r, h * dk + e) = double(s.scale) * double(codes[e]) +
                                           double(s.residual_scale) * double(residual[e]);
                    top = std::max(top, std::abs(x));
                    err = std::max(err, std::abs(q_ref(r, h * dk + e) - x));
                }
                EXPECT_LE(err, top / 32767 * 0.501) << "row " << r << ", head " << h;
            }
    return q_ref;
}

void check_case(const Case& c) {
    SCOPED_TRACE(c.name);
    std::mt19937 rng(17);
    const RowMatrix<float> q = random_rows(c.B * c.Nq, c.H * c.dk, rng, 1.0f);
    Int8Matrix k(random_rows(c.B * c.Nk, c.Hkv * c.dk, rng, 1.0f), c.Hkv);
    Int8Matrix v(random_rows(c.B * c.Nk, c.Hkv * c.dv, rng, 1.0f), c.Hkv);

    gattn::SdpaOptions<float> opt;
    gattn_test::RefMasks ref;
    opt.mask.causal = ref.causal = c.causal;
    opt.mask.sliding_window = ref.sliding_window = c.window;
    if (c.ragged)
        for (Index b = 0; b < c.B; ++b) ref.key_lengths.push_back(c.Nk - (b * 37) % (c.Nk / 2 + 1));
    opt.mask.key_lengths = ref.key_lengths;
    for (Index h = 0; h < c.H && c.sinks; ++h) {
        ref.sinks.push_back(0.5 * double(h % 3) - 0.25);
        opt.sinks.push_back(static_cast<float>(ref.sinks.back()));
    }
    if (c.alibi) {
        ref.alibi_slopes = gattn::alibi_slopes(c.H);
        opt.alibi_slopes.assign(ref.alibi_slopes.begin(), ref.alibi_slopes.end());
    }
    opt.logit_softcap = ref.softcap = c.softcap;
    const Mat kd = k.dequantized(), vd = v.dequantized();
    // Rows past each sequence's key length hold garbage: codes and NaN scales.
    for (Index b = 0; b < c.B && c.ragged; ++b)
        for (Index j = ref.key_lengths[b]; j < c.Nk; ++j) {
            k.codes.row(b * c.Nk + j).setConstant(-128);
            k.scales.row(b * c.Nk + j).setConstant(std::numeric_limits<float>::quiet_NaN());
            v.scales.row(b * c.Nk + j).setConstant(std::numeric_limits<float>::quiet_NaN());
        }

    const Mat q_ref = query_reference(q, c.H, c.Hkv, c.Nq, c.dk);
    const auto want = gattn_test::sdpa_reference(q_ref, kd, vd, c.B, c.H, c.Hkv, std::nullopt, ref);
    RowMatrix<float> out(c.B * c.Nq, c.H * c.dv), lse;
    gattn::SdpaOutputs<float> extra;
    extra.log_sum_exp = &lse;
    gattn::scaled_dot_product_attention(q, k.view(), v.view(), {c.B, c.H, c.Hkv}, out, opt, extra);
    const double out_err = (out.cast<double>() - want.out).cwiseAbs().maxCoeff();
    EXPECT_LE(out_err, 2e-5 * (1 + want.out.cwiseAbs().maxCoeff())) << "out";
    double lse_err = 0;
    for (Index i = 0; i < lse.size(); ++i) {
        const double w = want.log_sum_exp.data()[i], g = lse.data()[i];
        if (std::isinf(w)) {
            EXPECT_EQ(g, w);
        } else {
            lse_err = std::max(lse_err, std::abs(g - w) / (1 + std::abs(w)));
        }
    }
    EXPECT_LE(lse_err, 2e-6) << "log-sum-exp";

    // Probabilities, recomputed row by row, read the same codes and take the query as the
    // kernel took it (rounded where the integer logits run), so they agree with the output.
    if (c.B * c.H * c.Nq * c.Nk <= 200000) {
        const double tol = 2e-6;
        RowMatrix<float> probabilities;
        gattn::SdpaOutputs<float> with_p;
        with_p.probabilities = &probabilities;
        gattn::scaled_dot_product_attention(q, k.view(), v.view(), {c.B, c.H, c.Hkv}, out, opt, with_p);
        EXPECT_LE((probabilities.cast<double>() - want.probabilities).cwiseAbs().maxCoeff(), tol) << "probabilities";
    }
}

/// The int8 SDPA tests, once per decoding kernel family; a family this build or CPU lacks is
/// skipped (int8_kernel() says why).
class Int8Sdpa : public ::testing::TestWithParam<gattn::Int8Kernel> {
protected:
    void SetUp() override {
        if (gattn::int8_kernel().kernel != GetParam())
            GTEST_SKIP() << gattn::kernel_name(GetParam())
                         << " does not run here: " << gattn::describe(gattn::int8_kernel());
    }
    gattn_test::Int8KernelLimit limit{GetParam()};
};

// Vnni runs in builds with AVX512-VNNI; AvxVnni where the unit has AVX-VNNI and the CPU too
// (in an AVX-512 build through the limit, on 16-key blocks); Sdot on ARM64 CPUs with the dot
// product; each skips with the reason elsewhere.
INSTANTIATE_TEST_SUITE_P(Kernels, Int8Sdpa,
                         ::testing::Values(gattn::Int8Kernel::Vnni, gattn::Int8Kernel::AvxVnni, gattn::Int8Kernel::Sdot,
                                           gattn::Int8Kernel::WidenedFloat),
                         [](const auto& info) {
                             switch (info.param) {
                                 case gattn::Int8Kernel::Vnni: return std::string("Vnni");
                                 case gattn::Int8Kernel::AvxVnni: return std::string("AvxVnni");
                                 case gattn::Int8Kernel::Sdot: return std::string("Sdot");
                                 default: return std::string("WidenedFloat");
                             }
                         });

TEST_P(Int8Sdpa, MatchesTheReferenceOnTheDequantizedValues) {
    static_assert(gattn::kernel::kDecodeFromMemoryBytes < Index(2) * 7000 * 2 * (256 + 256), "from memory");
    const std::vector<Case> cases = {
        // Decoding (one query per sequence): the split-KV kernel reads the codes in place.
        {"decode GQA ragged", 3, 8, 2, 1, 1300, 64, 64, true, std::nullopt, true},
        {"decode MHA d=128", 1, 4, 4, 1, 1100, 128, 128, true},
        {"decode Qwen3-Next heads d=256 sinks", 2, 16, 2, 1, 600, 256, 256, true, std::nullopt, true, true},
        {"decode d=20 (a tail past the lanes), window", 2, 2, 1, 1, 90, 20, 12, true, 33},
        {"decode softcap ALiBi", 2, 4, 2, 1, 700, 64, 32, true, std::nullopt, true, false, true, 5.0},
        // d_k = 576 (as MLA's keys): past 512, the integer lane sums turn into floats before they add.
        {"decode MQA d=576", 1, 4, 1, 1, 300, 576, 512, true},
        // 14 MB of codes: past kDecodeFromMemoryBytes, where the kernel prefetches ahead.
        {"decode from memory GQA ragged", 2, 8, 2, 1, 7000, 256, 256, true, std::nullopt, true},
        // Prefill: key blocks dequantized into the tile kernel's scratch.
        {"prefill GQA causal ragged", 2, 4, 2, 37, 53, 32, 32, true, std::nullopt, true},
        {"prefill d=128 causal sinks", 1, 8, 2, 130, 260, 128, 128, true, std::nullopt, false, true},
        {"prefill window softcap ALiBi", 2, 4, 1, 70, 90, 64, 48, true, 17, true, true, true, 20.0},
        {"prefill not causal", 1, 2, 2, 40, 300, 16, 16},
    };
    for (const Case& c : cases) check_case(c);
}

TEST_P(Int8Sdpa, QueriesWithAnOutlierFeatureKeepTheirPrecision) {
    // One feature of each query head 300 times the others' spread (massive activations): with
    // one scale per row, the others would keep about 7 bits; the residual codes keep the logits to
    // float precision, so the outputs match the reference on the float query itself.
    const Index B = 2, H = 4, Hkv = 2, dk = 128, dv = 64, Nk = 700;
    std::mt19937 rng(9);
    RowMatrix<float> q = random_rows(B, H * dk, rng, 1.0f);
    for (Index h = 0; h < H; ++h) q.col(h * dk + 3 * h).array() += 300.0f;
    Int8Matrix k(random_rows(B * Nk, Hkv * dk, rng, 2.0f), Hkv), v(random_rows(B * Nk, Hkv * dv, rng, 1.0f), Hkv);
    gattn_test::RefMasks ref;
    ref.causal = true;
    gattn::SdpaOptions<float> opt;
    opt.mask.causal = true;
    const auto want =
        gattn_test::sdpa_reference(q.cast<double>(), k.dequantized(), v.dequantized(), B, H, Hkv, std::nullopt, ref);
    RowMatrix<float> out(B, H * dv), lse, probabilities;
    gattn::SdpaOutputs<float> extra;
    extra.log_sum_exp = &lse;
    extra.probabilities = &probabilities;
    gattn::scaled_dot_product_attention(q, k.view(), v.view(), {B, H, Hkv}, out, opt, extra);
    EXPECT_LE((out.cast<double>() - want.out).cwiseAbs().maxCoeff(), 2e-5 * (1 + want.out.cwiseAbs().maxCoeff()));
    // The log-sum-exp relative to its size (about 100).
    EXPECT_LE(((lse.cast<double>() - want.log_sum_exp).array() / (1 + want.log_sum_exp.array().abs())).abs().maxCoeff(),
              2e-6);
    // Logits near 100: float rounding alone moves the probabilities by a few 1e-6.
    EXPECT_LE((probabilities.cast<double>() - want.probabilities).cwiseAbs().maxCoeff(), 2e-5);
}

TEST_P(Int8Sdpa, LongKeyHeadsSumPastInt32) {
    // d_k = 1024, every query value equal (codes 32767; SDOT: 32639) and every key code ±127: each
    // dot product of the codes, 1024·32767·127 ≈ 4.3e9, is past int32 and must still come out right.
    const Index dk = 1024, dv = 64, Nk = 40;
    std::mt19937 rng(5);
    const RowMatrix<float> q = RowMatrix<float>::Constant(1, 2 * dk, 0.03f);  // 2 heads on 1 KV head
    RowMatrix<float> key(Nk, dk);
    for (Index j = 0; j < Nk; ++j) key.row(j).setConstant(j % 3 == 0 ? 0.05f : -0.05f);
    Int8Matrix k(key, 1), v(random_rows(Nk, dv, rng, 1.0f), 1);
    const auto want = gattn_test::sdpa_reference(query_reference(q, 2, 1, 1, dk), k.dequantized(), v.dequantized(), 1,
                                                 2, 1, std::nullopt, {});
    RowMatrix<float> out(1, 2 * dv);
    gattn::scaled_dot_product_attention(q, k.view(), v.view(), {1, 2, 1}, out);
    EXPECT_LE((out.cast<double>() - want.out).cwiseAbs().maxCoeff(), 2e-5 * (1 + want.out.cwiseAbs().maxCoeff()));
    // The two kinds of keys get different weights: the logits ±1024·0.03·0.05 / 32.
    EXPECT_GT((want.out.leftCols(dv) - v.dequantized().colwise().mean()).cwiseAbs().maxCoeff(), 1e-3);
}

#ifdef _OPENMP
TEST_P(Int8Sdpa, ADecodingThreadTakesMoreHeadsAfterLongerHeads) {
    // One thread decodes 2 KV heads of d = 256, then 4 of d = 128: the same number of query
    // codes, twice the query scales. Its kept scratch must grow for the scales too (it once grew
    // only with the codes, and the second call wrote past the scales).
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    check_case({"decode d=256, 2 KV heads", 1, 16, 2, 1, 300, 256, 256, true});
    check_case({"decode d=128, 4 KV heads", 1, 32, 4, 1, 300, 128, 128, true});
    omp_set_num_threads(saved);
}
#endif

TEST_P(Int8Sdpa, ANaNQueryReachesOnlyItsOwnHead) {
    // Decoding, d = 64 (the integer value sum where VNNI is compiled in): a NaN in head 1's query
    // makes its logits NaN; its output must be NaN and every other head's output unchanged.
    std::mt19937 rng(11);
    const Index H = 4, Hkv = 2, d = 64, Nk = 700;
    const RowMatrix<float> q = random_rows(1, H * d, rng, 1.0f);
    const Int8Matrix k(random_rows(Nk, Hkv * d, rng, 1.0f), Hkv), v(random_rows(Nk, Hkv * d, rng, 1.0f), Hkv);
    RowMatrix<float> clean(1, H * d), with_nan(1, H * d);
    gattn::scaled_dot_product_attention(q, k.view(), v.view(), {1, H, Hkv}, clean);
    RowMatrix<float> q_nan = q;
    q_nan(0, 1 * d + 5) = std::numeric_limits<float>::quiet_NaN();
    gattn::scaled_dot_product_attention(q_nan, k.view(), v.view(), {1, H, Hkv}, with_nan);
    for (Index h = 0; h < H; ++h)
        for (Index e = 0; e < d; ++e) {
            if (h == 1)
                EXPECT_TRUE(std::isnan(with_nan(0, h * d + e))) << "head 1, feature " << e;
            else
                EXPECT_EQ(with_nan(0, h * d + e), clean(0, h * d + e)) << "head " << h << ", feature " << e;
        }
}

TEST_P(Int8Sdpa, NegativeAndMixedValueScalesAreHonoured) {
    // A view's scales are the caller's: value rows with negative scales (all, or some of a
    // block) must weigh as scale · code. One head, d = 64, 37 keys (a partial last block),
    // against the float64 reference on the same codes and scales.
    std::mt19937 rng(23);
    const Index d = 64, Nk = 37;
    const RowMatrix<float> q = random_rows(1, d, rng, 1.0f);
    Int8Matrix k(random_rows(Nk, d, rng, 1.0f), 1), v(random_rows(Nk, d, rng, 1.0f), 1);
    for (int all_negative = 0; all_negative < 2; ++all_negative) {
        for (Index j = 0; j < Nk; ++j)
            v.scales(j, 0) = std::abs(v.scales(j, 0)) * (all_negative || j % 3 == 1 ? -1.0f : 1.0f) * float(1 + j % 4);
        const auto want = gattn_test::sdpa_reference(q.cast<double>(), k.dequantized(), v.dequantized(), 1, 1, 1);
        RowMatrix<float> out(1, d);
        gattn::scaled_dot_product_attention(q, k.view(), v.view(), {1, 1, 1}, out);
        const double worst = (out.cast<double>() - want.out).cwiseAbs().maxCoeff();
        const double largest = want.out.cwiseAbs().maxCoeff();
        // The decoding kernel rounds the query to 16 bits: 1e-4 covers that, a wrong sign does not.
        EXPECT_LE(worst, 1e-4 * (1 + largest)) << (all_negative ? "all negative" : "mixed signs");
    }
}

TEST_P(Int8Sdpa, ScalesAreRequired) {
    Int8Matrix k(RowMatrix<float>::Ones(4, 8), 2), v(RowMatrix<float>::Ones(4, 8), 2);
    RowMatrix<float> q = RowMatrix<float>::Ones(2, 8), out(2, 8);
    auto no_scales = k.view();
    no_scales.scales = nullptr;
    EXPECT_THROW(gattn::scaled_dot_product_attention(q, no_scales, v.view(), {2, 2, 2}, out), std::invalid_argument);
    auto short_stride = v.view();
    short_stride.scale_stride = 1;
    try {
        gattn::scaled_dot_product_attention(q, k.view(), short_stride, {2, 2, 2}, out);
        ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("value.scale_stride"), std::string::npos) << e.what();
    }
}

TEST(Int8Sdot, HandWorkedQueryCodesAndLogits) {
#if defined(GATTN_HAS_SDOT_KERNEL)
    if (!gattn::cpu_features().asimddp) GTEST_SKIP() << "this CPU has no dot-product instructions (SDOT)";
    namespace sdot = gattn::kernel::decode_sdot;
    // q = (1, −0.5, 0.25, 0, …): scale 1/32639, codes 32639 = 127·256 + 127,
    // −16319.5 → −16320 (ties to even) = −64·256 + 64, 8159.75 → 8160 = 32·256 − 32.
    const Index dk = 16;
    std::vector<float> q(dk, 0.0f);
    q[0] = 1.0f, q[1] = -0.5f, q[2] = 0.25f;
    std::vector<std::int8_t> codes(2 * dk), residual(2 * dk, 7);
    const auto s = sdot::quantize_query(q.data(), dk, codes.data(), residual.data());
    EXPECT_EQ(s.scale, 1.0f / 32639.0f);
    EXPECT_EQ(s.residual_scale, 0.0f);  // no outlier: Σ|q / max|q|| = 1.75 ≥ 16 / 32
    const std::vector<int> hi = {127, -64, 32}, lo = {127, 64, -32};
    for (Index d = 0; d < dk; ++d) {
        EXPECT_EQ(codes[d], d < 3 ? hi[d] : 0) << "high byte " << d;
        EXPECT_EQ(codes[dk + d], d < 3 ? lo[d] : 0) << "low byte " << d;
        EXPECT_EQ(residual[d], 0) << d;
    }
    // Three keys (lane 3 stays 0): (2, 4, −8, 0, …), all 1, and −128 at feature 0. Their dot
    // products with the codes: 65278 − 65280 − 65280 = −65282, 32639 − 16320 + 8160 = 24479,
    // and −128·32639 = −4177792.
    std::vector<std::int8_t> key(3 * dk, 0);
    key[0] = 2, key[1] = 4, key[2] = -8;
    for (Index d = 0; d < dk; ++d) key[dk + d] = 1;
    key[2 * dk] = -128;
    const std::int8_t* rows[1] = {codes.data()};
    const float scales[1] = {s.scale};
    gattn::simd::Batch<float> out[1];
    sdot::logits<1>(rows, scales, key.data(), dk, 3, dk, out,
                    static_cast<gattn::kernel::SpreadPrefetch<std::int8_t>*>(nullptr));
    alignas(64) float got[gattn::simd::kLanes<float>];
    out[0].store_aligned(got);
    const double want[4] = {-65282.0 / 32639, 24479.0 / 32639, -4177792.0 / 32639, 0};
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(got[i], want[i], 1e-6 * (1 + std::abs(want[i]))) << "key " << i;
#else
    GTEST_SKIP() << "the SDOT kernel is ARM64 code";
#endif
}

TEST(Int8Kernel, SaysWhichKernelRunsAndWhyNoFasterOne) {
    const gattn::Int8KernelChoice best = gattn::int8_kernel();
#if defined(__aarch64__)
    // Chosen at run time from HWCAP: SDOT wherever the CPU has the dot-product instructions.
    EXPECT_TRUE(gattn::compiled_with_sdot());
    if (gattn::cpu_features().asimddp) {
        EXPECT_EQ(best.kernel, gattn::Int8Kernel::Sdot);
        EXPECT_EQ(gattn::describe(best), "SDOT");
    } else {
        EXPECT_EQ(best.kernel, gattn::Int8Kernel::WidenedFloat);
        EXPECT_EQ(gattn::describe(best), "widened float (dot product (SDOT): this CPU has none)");
    }
    {
        gattn_test::Int8KernelLimit limit(gattn::Int8Kernel::WidenedFloat);
        EXPECT_EQ(gattn::describe(gattn::int8_kernel()),
                  "widened float (dot product (SDOT): excluded by set_int8_kernel_limit)");
    }
    EXPECT_EQ(gattn::int8_kernel().kernel, best.kernel) << "the limit is lifted";
#else
    const gattn::CpuFeatures& f = gattn::cpu_features();
    EXPECT_EQ(best.reason.empty(), best.kernel == gattn::Int8Kernel::Vnni) << gattn::describe(best);
    {
        gattn_test::Int8KernelLimit limit(gattn::Int8Kernel::WidenedFloat);
        const gattn::Int8KernelChoice widened = gattn::int8_kernel();
        EXPECT_EQ(widened.kernel, gattn::Int8Kernel::WidenedFloat);
        // The limit is named first, whatever the build and the CPU offer.
        EXPECT_EQ(gattn::describe(widened),
                  "widened float (AVX512-VNNI: excluded by set_int8_kernel_limit; "
                  "AVX-VNNI: excluded by set_int8_kernel_limit)");
    }
    // AVX-VNNI runs wherever the unit and the CPU have it, AVX512-VNNI only kept out by the limit.
    const bool avxvnni = gattn::compiled_with_avxvnni() && f.avxvnni;
    {
        gattn_test::Int8KernelLimit limit(gattn::Int8Kernel::AvxVnni);
        const gattn::Int8KernelChoice ymm = gattn::int8_kernel();
        EXPECT_EQ(ymm.kernel, avxvnni ? gattn::Int8Kernel::AvxVnni : gattn::Int8Kernel::WidenedFloat);
        const std::string why = !f.avxvnni                        ? "this CPU has none"
                                : !gattn::compiled_with_avxvnni() ? "not compiled with the flags (build with "
                                                                    "-march=native, or -mavx2 -mfma -mavxvnni)"
                                                                  : "";
        EXPECT_EQ(ymm.reason,
                  "AVX512-VNNI: excluded by set_int8_kernel_limit" + (why.empty() ? "" : "; AVX-VNNI: " + why));
        EXPECT_EQ(gattn::detail::int8_kernel_family(), ymm.kernel);
    }
    EXPECT_EQ(gattn::int8_kernel().kernel, best.kernel) << "the limit is lifted";
    EXPECT_EQ(gattn::detail::int8_kernel_family(), best.kernel);
    const gattn::Int8Kernel want_best = gattn::compiled_with_vnni() ? gattn::Int8Kernel::Vnni
                                        : avxvnni                   ? gattn::Int8Kernel::AvxVnni
                                                                    : gattn::Int8Kernel::WidenedFloat;
    EXPECT_EQ(best.kernel, want_best) << gattn::describe(best);
    if (!gattn::compiled_with_vnni()) {
        const std::string want = f.avx512vnni ? "AVX512-VNNI: not compiled with the flags (build with -march=native)"
                                              : "AVX512-VNNI: this CPU has none";
        EXPECT_EQ(best.reason.substr(0, want.size()), want) << best.reason;
        EXPECT_EQ(best.reason.find("AVX-VNNI:") == std::string::npos, avxvnni) << best.reason;
    }
    EXPECT_STREQ(gattn::kernel_name(gattn::Int8Kernel::AvxVnni), "AVX-VNNI");
#endif
}

TEST(Int8Cache, AppendQuantizesEachRowAndRefusesNonFiniteValues) {
    gattn::KVCache<std::int8_t> cache(2, 4, 2, 3);
    RowMatrix<float> k(4, 6), v(4, 6);
    k << 0.5f, -1.27f, 1.0f, 0, 0, 0,  //
        2, 4, -8, 1, 1, 1,             //
        9, 9, 9, 9, 9, 9,              //
        9, 9, 9, 9, 9, 9;
    v = -k;
    cache.append(k, v, {2, 1});  // sequence 0: rows 0, 1; sequence 1: row 2
    EXPECT_EQ(cache.lengths(), (std::vector<Index>{2, 1}));
    // Row 0, head 0: scale 0.01, codes 50, −127, 100; head 1: zeros.
    EXPECT_FLOAT_EQ(cache.key_scales()(0, 0), 0.01f);
    EXPECT_EQ(cache.key_scales()(0, 1), 0.0f);
    EXPECT_EQ(int(cache.keys()(0, 0)), 50);
    EXPECT_EQ(int(cache.keys()(0, 1)), -127);
    EXPECT_EQ(int(cache.keys()(0, 2)), 100);
    EXPECT_EQ(int(cache.values()(0, 1)), 127);
    // Row 1, head 0: max 8, codes 2·127/8 = 31.75 → 32, 4·127/8 = 63.5 → 64 (ties to even), −127.
    EXPECT_FLOAT_EQ(cache.key_scales()(1, 0), 8.0f / 127.0f);
    EXPECT_EQ(int(cache.keys()(1, 0)), 32);
    EXPECT_EQ(int(cache.keys()(1, 1)), 64);
    EXPECT_EQ(int(cache.keys()(1, 2)), -127);
    EXPECT_EQ(int(cache.keys()(1, 3)), 127);
    // Sequence 1 starts at row capacity = 4.
    EXPECT_FLOAT_EQ(cache.key_scales()(4, 0), 9.0f / 127.0f);
    EXPECT_EQ(int(cache.keys()(4, 5)), 127);

    // A NaN in a row that is appended is refused, naming it; nothing changes.
    const RowMatrix<std::int8_t> codes_before = cache.keys();
    RowMatrix<float> bad = RowMatrix<float>::Ones(2, 6);
    bad(1, 4) = std::numeric_limits<float>::quiet_NaN();
    try {
        cache.append(RowMatrix<float>::Ones(2, 6), bad, {1, 1});
        ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
        // Row 1 is sequence 1's first new token; column 4 is KV head 1's feature 1 (d = 3).
        EXPECT_NE(std::string(e.what()).find(
                      "v row 1 (sequence 1, new token 0), column 4 (KV head 1, feature 1) is nan"),
                  std::string::npos)
            << e.what();
    }
    EXPECT_EQ(cache.lengths(), (std::vector<Index>{2, 1}));
    EXPECT_EQ(cache.keys(), codes_before);
    // The same NaN in a padding slot (not appended) is never read.
    cache.append(RowMatrix<float>::Ones(2, 6), bad, {1, 0});
    EXPECT_EQ(cache.lengths(), (std::vector<Index>{3, 1}));
    cache.truncate({1, 1});
    EXPECT_EQ(cache.lengths(), (std::vector<Index>{1, 1}));
}

#ifdef _OPENMP
TEST_P(Int8Sdpa, ResultsDoNotDependOnTheThreadCount) {
    std::mt19937 rng(5);
    const Index B = 2, H = 8, Hkv = 2, d = 64, Nk = 3000;
    const RowMatrix<float> q = random_rows(B, H * d, rng, 1.0f);
    const Int8Matrix k(random_rows(B * Nk, Hkv * d, rng, 1.0f), Hkv), v(random_rows(B * Nk, Hkv * d, rng, 1.0f), Hkv);
    RowMatrix<float> one(B, H * d), two(B, H * d);
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    gattn::scaled_dot_product_attention(q, k.view(), v.view(), {B, H, Hkv}, one);
    omp_set_num_threads(2);
    gattn::scaled_dot_product_attention(q, k.view(), v.view(), {B, H, Hkv}, two);
    omp_set_num_threads(saved);
    EXPECT_EQ(one, two);
}
#endif

}  // namespace
