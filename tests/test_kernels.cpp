// SIMD kernels (exp, sigmoid, SiLU, fused gate, dot, axpy, max) against double-precision math,
// at every length from 0 to several registers and at unaligned starts.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gattn/gattn.hpp"

namespace {

namespace simd = gattn::simd;

template <class T>
class Kernels : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Kernels, Scalars);

template <class T>
double rel_tol() {
    return std::is_same_v<T, float> ? 3e-7 : 1e-14;
}

double sigmoid_ref(double x) { return x >= 0 ? 1.0 / (1.0 + std::exp(-x)) : std::exp(x) / (1.0 + std::exp(x)); }

TYPED_TEST(Kernels, ExpMatchesDoubleAcrossTheRange) {
    using T = TypeParam;
    const T inf = std::numeric_limits<T>::infinity();
    std::vector<T> x;
    for (double v = -87.0; v <= 88.0; v += 0.01737) x.push_back(static_cast<T>(v));
    std::vector<T> y(x.size());
    simd::transform(x.data(), y.data(), x.size(), [](const auto& b) { return simd::exp<T>(b); });
    for (std::size_t i = 0; i < x.size(); ++i) {
        const double want = std::exp(static_cast<double>(x[i]));
        ASSERT_LE(std::abs(y[i] - want), rel_tol<T>() * want) << "exp(" << x[i] << ")";
    }
    const std::vector<T> special{-inf, inf, T(-1000), T(1000), T(0), std::numeric_limits<T>::quiet_NaN()};
    std::vector<T> s(special.size());
    simd::transform(special.data(), s.data(), special.size(), [](const auto& b) { return simd::exp<T>(b); });
    EXPECT_EQ(s[0], T(0));
    EXPECT_EQ(s[1], inf);
    EXPECT_EQ(s[2], T(0));
    EXPECT_EQ(s[3], inf);
    EXPECT_EQ(s[4], T(1));
    EXPECT_TRUE(std::isnan(s[5]));
}

// The softmax exp (x ≤ 0 only): same accuracy down to the smallest normal result (a result
// just below it may be 0), exact 0 further down and for −∞, NaN kept.
TYPED_TEST(Kernels, ExpNonPositiveMatchesDoubleDownToZero) {
    using T = TypeParam;
    const double lowest = std::log(static_cast<double>(std::numeric_limits<T>::min()));
    std::vector<T> x;
    for (double v = lowest; v <= 0.0; v += -lowest / 9973.0) x.push_back(static_cast<T>(v));
    x.push_back(T(0));
    x.push_back(-std::numeric_limits<T>::denorm_min());
    std::vector<T> y(x.size());
    simd::transform(x.data(), y.data(), x.size(), [](const auto& b) { return simd::exp_nonpositive<T>(b); });
    for (std::size_t i = 0; i < x.size(); ++i) {
        const double want = std::exp(static_cast<double>(x[i]));
        if (want < static_cast<double>(std::numeric_limits<T>::min()) && y[i] == T(0)) continue;
        ASSERT_LE(std::abs(y[i] - want), rel_tol<T>() * want) << "exp(" << x[i] << ")";
    }
    const T inf = std::numeric_limits<T>::infinity();
    const std::vector<T> special{-inf, static_cast<T>(lowest - 1), T(-1e30), std::numeric_limits<T>::quiet_NaN()};
    std::vector<T> s(special.size());
    simd::transform(special.data(), s.data(), special.size(),
                    [](const auto& b) { return simd::exp_nonpositive<T>(b); });
    EXPECT_EQ(s[0], T(0));
    EXPECT_EQ(s[1], T(0));
    EXPECT_EQ(s[2], T(0));
    EXPECT_TRUE(std::isnan(s[3]));
}

TEST(KernelsFloat, Exp2NonPositiveMatchesDoubleDownToZero) {
    // Every 2^x over [−126, 0] on a fine grid, all half-integers (the ends of the polynomial's
    // range), and the special values.
    std::vector<float> x;
    for (double v = -126.0; v <= 0.0; v += 126.0 / 19997.0) x.push_back(static_cast<float>(v));
    for (int i = -252; i <= 0; ++i) x.push_back(0.5f * static_cast<float>(i));
    x.push_back(-std::numeric_limits<float>::denorm_min());
    std::vector<float> y(x.size());
    simd::transform(x.data(), y.data(), x.size(), [](const auto& b) { return simd::exp2_nonpositive(b); });
    for (std::size_t i = 0; i < x.size(); ++i) {
        const double want = std::exp2(static_cast<double>(x[i]));
        ASSERT_LE(std::abs(y[i] - want), 2e-7 * want) << "exp2(" << x[i] << ")";
    }
    const float inf = std::numeric_limits<float>::infinity();
    const std::vector<float> special{-inf, -126.0001f, -127.0f, -1e30f, std::numeric_limits<float>::quiet_NaN()};
    std::vector<float> s(special.size());
    simd::transform(special.data(), s.data(), special.size(), [](const auto& b) { return simd::exp2_nonpositive(b); });
    EXPECT_EQ(s[0], 0.0f);
    EXPECT_EQ(s[1], 0.0f);
    EXPECT_EQ(s[2], 0.0f);
    EXPECT_EQ(s[3], 0.0f);
    EXPECT_TRUE(std::isnan(s[4]));
}

TYPED_TEST(Kernels, ActivationsMatchDoubleAndSaturateExactly) {
    using T = TypeParam;
    std::vector<T> z;
    for (double v = -30.0; v <= 30.0; v += 0.0731) z.push_back(static_cast<T>(v));
    z.insert(z.end(), {T(-1000), T(1000), T(-89), T(89), -std::numeric_limits<T>::infinity(),
                       std::numeric_limits<T>::infinity()});
    std::vector<T> out(z.size());
    using Act = gattn::GateActivation;
    for (Act a : {Act::Sigmoid, Act::SiLU, Act::NonSparseSigmoid}) {
        gattn::activate(a, z.data(), out.data(), z.size());
        for (std::size_t i = 0; i + 6 < z.size(); ++i) {
            const double s = sigmoid_ref(z[i]);
            const double want = a == Act::Sigmoid ? s : a == Act::SiLU ? z[i] * s : 0.5 + 0.5 * s;
            ASSERT_NEAR(out[i], want, 4 * rel_tol<T>() * std::max(1.0, std::abs(want)))
                << gattn::to_string(a) << "(" << z[i] << ")";
        }
    }
    gattn::activate(Act::Sigmoid, z.data(), out.data(), z.size());
    const std::size_t n = z.size();
    EXPECT_EQ(out[n - 6], T(0));  // σ(−1000)
    EXPECT_EQ(out[n - 5], T(1));  // σ(1000)
    EXPECT_EQ(out[n - 2], T(0));  // σ(−∞)
    EXPECT_EQ(out[n - 1], T(1));  // σ(+∞)
    const T nan = std::numeric_limits<T>::quiet_NaN();
    gattn::activate(Act::Sigmoid, &nan, out.data(), 1);
    EXPECT_TRUE(std::isnan(out[0]));
}

// σ in its tail, where the test above only bounds the absolute error: relative accuracy down
// to the smallest normal result, and nothing above it below that.
/// softcap against c·tanh(x/c) in double over |x| ≤ 8c and down to |x| = 10⁻⁶c, for caps from
/// 0.5 to 10³⁰ (far above the logits it must leave them as they are): within the documented
/// bounds (float 6.1 ulp and 1.7e-7·c, double 8 ulp and 4.3e-16·c, with 10 % margin), never
/// above c in magnitude; ±∞ gives ±c and NaN stays NaN.
TYPED_TEST(Kernels, SoftcapIsTanhWithinTheStatedBound) {
    using T = TypeParam;
    const double abs_bound = (std::is_same_v<T, float> ? 1.7e-7 : 4.3e-16) * 1.1;
    const double ulp_bound = (std::is_same_v<T, float> ? 6.1 : 8.0) * 1.1;
    for (double cap : {0.5, 1.0, 2.5, 30.0, 50.0, 1e10, 1e30}) {
        const T c = static_cast<T>(cap), inv = T(1) / c;
        double worst_abs = 0, worst_ulp = 0;
        const int n = 50000;
        for (double span : {8.0, 0.125, 1e-6})
            for (int i = 0; i <= n; ++i) {
                const T x = static_cast<T>(span * cap * (-1.0 + 2.0 * i / n));
                const T y = simd::softcap_scalar<T>(x, c, inv);
                const double ref = double(c) * std::tanh(double(x) / double(c));
                worst_abs = std::max(worst_abs, std::abs(double(y) - ref) / double(c));
                const T r = static_cast<T>(ref);
                const double ulp = double(std::nextafter(r, std::numeric_limits<T>::infinity()) - r);
                if (ref != 0) worst_ulp = std::max(worst_ulp, std::abs(double(y) - ref) / ulp);
                ASSERT_LE(std::abs(y), c) << "x " << x;
            }
        EXPECT_LE(worst_abs, abs_bound) << "cap " << cap;
        EXPECT_LE(worst_ulp, ulp_bound) << "cap " << cap;
    }
    const T inf = std::numeric_limits<T>::infinity();
    EXPECT_EQ(simd::softcap_scalar<T>(inf, T(50), T(1) / T(50)), T(50));
    EXPECT_EQ(simd::softcap_scalar<T>(-inf, T(50), T(1) / T(50)), T(-50));
    EXPECT_TRUE(std::isnan(simd::softcap_scalar<T>(std::numeric_limits<T>::quiet_NaN(), T(50), T(1) / T(50))));
}

TYPED_TEST(Kernels, SigmoidKeepsRelativeAccuracyInItsTail) {
    using T = TypeParam;
    const double lowest = std::log(static_cast<double>(std::numeric_limits<T>::min()));
    std::vector<T> z;
    for (double v = lowest; v <= 0.0; v += -lowest / 7919.0) z.push_back(static_cast<T>(v));
    for (double v = lowest - 2.0; v < lowest; v += 0.0173) z.push_back(static_cast<T>(v));
    std::vector<T> out(z.size());
    gattn::activate(gattn::GateActivation::Sigmoid, z.data(), out.data(), z.size());
    for (std::size_t i = 0; i < z.size(); ++i) {
        const double want = sigmoid_ref(z[i]);
        if (want >= static_cast<double>(std::numeric_limits<T>::min()))
            ASSERT_LE(std::abs(out[i] - want), 4 * rel_tol<T>() * want) << "sigmoid(" << z[i] << ")";
        else
            ASSERT_TRUE(out[i] >= T(0) && out[i] < std::numeric_limits<T>::min()) << "sigmoid(" << z[i] << ")";
    }
}

TYPED_TEST(Kernels, FusedGateMatchesDoubleAtEveryLengthAndOffset) {
    using T = TypeParam;
    std::mt19937_64 rng(1);
    std::uniform_real_distribution<double> u(-6, 6);
    const std::size_t L = simd::kLanes<T>;
    using C = gattn::GateCombine;
    using Act = gattn::GateActivation;
    for (std::size_t n = 0; n <= 3 * L + 1; ++n)
        for (std::size_t off = 0; off < 3; ++off)
            for (C comb : {C::Multiplicative, C::Additive, C::ResidualMix})
                for (Act act : {Act::Sigmoid, Act::SiLU, Act::NonSparseSigmoid}) {
                    std::vector<T> y(n + off), z(n + off), x(n + off), g(n + off, T(-7));
                    for (auto* v : {&y, &z, &x})
                        for (auto& e : *v) e = static_cast<T>(u(rng));
                    const std::vector<T> y0 = y;
                    gattn::apply_gate(act, comb, y.data() + off, z.data() + off, x.data() + off, g.data() + off, n);
                    for (std::size_t i = off; i < n + off; ++i) {
                        const double s = sigmoid_ref(z[i]);
                        const double gv = act == Act::Sigmoid ? s : act == Act::SiLU ? z[i] * s : 0.5 + 0.5 * s;
                        const double want = comb == C::Multiplicative ? y0[i] * gv
                                            : comb == C::Additive     ? y0[i] + gv
                                                                      : gv * y0[i] + (1 - gv) * x[i];
                        ASSERT_NEAR(y[i], want, 8 * rel_tol<T>() * std::max(1.0, std::abs(want)))
                            << "n=" << n << " off=" << off;
                        ASSERT_NEAR(g[i], gv, 4 * rel_tol<T>() * std::max(1.0, std::abs(gv)));
                    }
                    for (std::size_t i = 0; i < off; ++i) ASSERT_EQ(y[i], y0[i]) << "wrote before the row";
                }
}

TYPED_TEST(Kernels, DotAxpyMaxAndExpSumAtEveryLength) {
    using T = TypeParam;
    std::mt19937_64 rng(2);
    std::uniform_real_distribution<double> u(-1, 1);
    const std::size_t L = simd::kLanes<T>;
    for (std::size_t n = 1; n <= 5 * L + 3; ++n) {
        std::vector<T> a(n + 1), b(n + 1), y(n + 1);
        for (auto* v : {&a, &b, &y})
            for (auto& e : *v) e = static_cast<T>(u(rng));
        const T* pa = a.data() + 1;  // unaligned starts
        const T* pb = b.data() + 1;
        double dot = 0, mx = -1e300, es = 0;
        for (std::size_t i = 0; i < n; ++i) {
            dot += double(pa[i]) * pb[i];
            mx = std::max(mx, double(pa[i]));
        }
        for (std::size_t i = 0; i < n; ++i) es += std::exp(double(pa[i]) - mx);
        EXPECT_NEAR(simd::dot(pa, pb, n), dot, 1e2 * std::numeric_limits<T>::epsilon() * n) << n;
        EXPECT_EQ(simd::max_value(pa, n), static_cast<T>(mx)) << n;
        std::vector<T> e(n);
        EXPECT_NEAR(simd::exp_shifted_sum(pa, static_cast<T>(mx), e.data(), n), es, 4 * rel_tol<T>() * es) << n;
        const std::vector<T> y0 = y;
        simd::axpy(T(0.5), pa, y.data() + 1, n);
        for (std::size_t i = 0; i < n; ++i) ASSERT_NEAR(y[i + 1], y0[i + 1] + 0.5 * pa[i], 4 * rel_tol<T>());
        EXPECT_EQ(y[0], y0[0]);
    }
}

TYPED_TEST(Kernels, ReduceSumRowsPutsRowSumsInOrder) {
    // xsimd 8.1's haddp permutes lanes on AVX-512; gattn's shim must not.
    using T = TypeParam;
    constexpr std::size_t L = simd::kLanes<T>;
    simd::Batch<T> rows[L];
    alignas(64) T buf[L];
    for (std::size_t i = 0; i < L; ++i) {
        for (std::size_t j = 0; j < L; ++j) buf[j] = static_cast<T>(100 * i + j);
        rows[i] = simd::Batch<T>::load_aligned(buf);
    }
    simd::reduce_sum_rows<T>(rows).store_aligned(buf);
    for (std::size_t i = 0; i < L; ++i) EXPECT_EQ(buf[i], static_cast<T>(100 * i * L + L * (L - 1) / 2)) << i;
}

/// The value of a binary16 bit pattern, decoded from its fields in double.
double half_value(std::uint16_t bits) {
    const int exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
    const double sign = (bits >> 15) ? -1.0 : 1.0;
    if (exponent == 31)
        return mantissa ? std::numeric_limits<double>::quiet_NaN() : sign * std::numeric_limits<double>::infinity();
    if (exponent == 0) return sign * std::ldexp(mantissa, -24);
    return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

/// Narrow storage read into float registers as the decoding kernels read a cache in place, and
/// fp16 rows widened as prefill widens them: every bf16 and fp16 bit pattern and every int8
/// code, in every lane, gives its value (bf16: the bits above 16 zero bits; fp16: decoded from
/// its fields), bit for bit; NaN stays NaN.
TEST(KernelsFloat, NarrowValuesWidenExactly) {
    constexpr std::size_t L = simd::kLanes<float>;
    auto expect_value = [](float got, double want, const char* what, std::size_t i) {
        if (std::isnan(want))
            EXPECT_TRUE(std::isnan(got)) << what << " " << i;
        else
            EXPECT_EQ(got, static_cast<float>(want)) << what << " " << i;  // exact in float
    };
    std::vector<gattn::bfloat16> b(65536 + L);
    std::vector<gattn::half> h(65536 + L);
    for (std::size_t i = 0; i < b.size(); ++i) {
        b[i] = Eigen::numext::bit_cast<gattn::bfloat16>(static_cast<std::uint16_t>(i));
        h[i] = Eigen::numext::bit_cast<gattn::half>(static_cast<std::uint16_t>(i));
    }
    alignas(64) float lanes[L];
    for (std::size_t i = 0; i < 65536; ++i) {
        gattn::kernel::load_widened<float>(b.data() + i).store_aligned(lanes);
        for (std::size_t l = 0; l < L; ++l) {
            const std::uint32_t word = static_cast<std::uint32_t>((i + l) & 0xffff) << 16;
            float want;
            std::memcpy(&want, &word, 4);
            expect_value(lanes[l], want, "bf16", i + l);
        }
        gattn::kernel::load_widened<float>(h.data() + i).store_aligned(lanes);
        for (std::size_t l = 0; l < L; ++l) expect_value(lanes[l], half_value((i + l) & 0xffff), "fp16", i + l);
        if (::testing::Test::HasFailure()) return;
    }
    std::vector<std::int8_t> codes(256 + L);
    for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<std::int8_t>(i - 128);
    for (std::size_t i = 0; i < 256; ++i) {
        gattn::kernel::load_widened<float>(codes.data() + i).store_aligned(lanes);
        for (std::size_t l = 0; l < L; ++l)
            expect_value(lanes[l], static_cast<double>(static_cast<std::int8_t>(i + l - 128)), "int8", i + l);
    }
    // Rows of every length up to 19 at every start up to 8, and the whole range at once.
    std::vector<float> row(65536 + L, -1.0f);
    for (std::size_t start = 0; start < 8; ++start)
        for (std::size_t n = 0; n < 20; ++n) {
            std::fill(row.begin(), row.end(), -1.0f);
            gattn::kernel::widen_row(h.data() + 31740 + start, row.data(), static_cast<gattn::Index>(n));
            for (std::size_t i = 0; i < n; ++i) expect_value(row[i], half_value(31740 + start + i), "fp16 row", i);
            EXPECT_EQ(row[n], -1.0f) << "written past the row, n = " << n;
        }
    gattn::kernel::widen_row(h.data(), row.data(), 65536);
    for (std::size_t i = 0; i < 65536; ++i)
        expect_value(row[i], half_value(static_cast<std::uint16_t>(i)), "fp16 row", i);
}

TEST(Kernels, IsaNamespaceMatchesTheCompiledArchitecture) {
    // The library's SIMD symbols live in an inline namespace named after the instruction set.
    const std::string arch = simd::arch_name();
    EXPECT_FALSE(arch.empty());
#if defined(__AVX512F__)
    EXPECT_NE(arch.find("avx512"), std::string::npos) << arch;
#elif defined(__AVX2__) && defined(__FMA__)
    EXPECT_NE(arch.find("avx2"), std::string::npos) << arch;
#elif defined(__aarch64__)
    EXPECT_EQ(arch, "arm64+neon");
#endif
}

/// The instruction-set report names what this unit was compiled for (from the compiler's own
/// macros) and calls a build slow exactly when the CPU's vectors are twice as wide or more.
/// ARM64: NEON in every build (with SVE for float decoding where compiled in), never slow; an
/// SVE CPU is named with its vector length, and when that is wider than NEON's the report says
/// that float decoding runs SVE and the rest NEON, or why not.
TEST(Library, InstructionSetReport) {
    const gattn::InstructionSets s = gattn::instruction_sets();
#if defined(__aarch64__)
    const gattn::CpuFeatures& f = gattn::cpu_features();
    EXPECT_STREQ(s.compiled, gattn::compiled_with_sve() ? "NEON, SVE (float decoding)" : "NEON");
    EXPECT_FALSE(s.slow_build);
    if (f.sve) {
        EXPECT_EQ(f.sve_bits % 128, 0) << f.sve_bits;
        EXPECT_GE(f.sve_bits, 128);
        const std::string want = std::string(f.sve2 ? "SVE2" : "SVE") + " (" + std::to_string(f.sve_bits) + "-bit)";
        EXPECT_EQ(std::string(s.cpu), want);
    } else {
        EXPECT_STREQ(s.cpu, "NEON");
        EXPECT_EQ(f.sve_bits, 0);
    }
    EXPECT_EQ(std::string(s.unused).empty(), f.sve_bits <= 128) << s.unused;
    const std::string line = gattn::describe(s);
    EXPECT_NE(line.find(std::string("compiled for ") + s.compiled + ", CPU has " + s.cpu), std::string::npos) << line;
    const bool sve_runs = f.sve_bits > 128 && gattn::compiled_with_sve();
    EXPECT_EQ(gattn::detail::sve_float_decoding(), sve_runs);
    EXPECT_EQ(line.find("float decoding runs SVE") != std::string::npos, sve_runs) << line;
    // set_sve_kernels(false) keeps NEON and says so.
    gattn::set_sve_kernels(false);
    EXPECT_FALSE(gattn::detail::sve_float_decoding());
    const std::string off = gattn::describe(gattn::instruction_sets());
    gattn::set_sve_kernels(true);
    EXPECT_EQ(off.find("excluded by set_sve_kernels(false)") != std::string::npos, sve_runs) << off;
    EXPECT_EQ(line.find("-march=native"), std::string::npos) << line;
#else
#if defined(__AVX512F__)
    EXPECT_STREQ(s.compiled, "AVX-512");
    const int compiled = 512;
#elif defined(__AVX2__) && defined(__FMA__)
    EXPECT_STREQ(s.compiled, gattn::compiled_with_avxvnni() ? "AVX2+FMA+AVX-VNNI" : "AVX2+FMA");
    const int compiled = 256;
#else
    EXPECT_STREQ(s.compiled, "SSE2");
    const int compiled = 128;
#endif
    const gattn::CpuFeatures& f = gattn::cpu_features();
    const int cpu = f.avx512f ? 512 : f.avx2_fma ? 256 : 128;
    EXPECT_EQ(s.slow_build, cpu >= 2 * compiled);
    const std::string line = gattn::describe(s);
    EXPECT_NE(line.find(std::string("compiled for ") + s.compiled + ", CPU has " + s.cpu), std::string::npos) << line;
    EXPECT_EQ(line.find("-march=native") != std::string::npos, s.slow_build) << line;
    EXPECT_STREQ(s.unused, "");
#endif
}

/// The CPU features read from the operating system (ARM64: the HWCAP words and the SVE vector
/// length) are those of the CPU the test runs on, as its runner states them in
/// GATTN_EXPECT_CPU_FEATURES: the features present, space-separated, of asimd asimddp sve sve2
/// bf16 i8mm, and sve_bits=<n> (e.g. scripts/test.sh's aarch64 flavour, which chooses the CPU
/// model QEMU emulates). Skipped where it is not set.
TEST(Library, CpuFeaturesAreThoseOfTheCpu) {
    const char* expected = std::getenv("GATTN_EXPECT_CPU_FEATURES");
    if (!expected) GTEST_SKIP() << "GATTN_EXPECT_CPU_FEATURES is not set";
    std::set<std::string> want;
    int sve_bits = 0;
    std::istringstream words(expected);
    for (std::string w; words >> w;) {
        if (w.rfind("sve_bits=", 0) == 0)
            sve_bits = std::stoi(w.substr(9));
        else
            want.insert(w);
    }
    const gattn::CpuFeatures& f = gattn::cpu_features();
    const std::pair<const char*, bool> has[] = {{"asimd", f.asimd}, {"asimddp", f.asimddp}, {"sve", f.sve},
                                                {"sve2", f.sve2},   {"bf16", f.bf16},       {"i8mm", f.i8mm}};
    for (const auto& [name, present] : has) {
        EXPECT_EQ(present, want.count(name) == 1) << name;
        want.erase(name);
    }
    EXPECT_TRUE(want.empty()) << "unknown feature " << *want.begin();
    EXPECT_EQ(f.sve_bits, sve_bits);
}

}  // namespace
