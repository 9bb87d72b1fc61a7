// SPDX-License-Identifier: Apache-2.0
// One executable, two translation units with the same gattn code built for different
// instruction sets (odr_tu.cpp with the baseline flags and with -mavx2 -mfma), exchanging raw
// buffers only. gattn puts every function it defines in an inline namespace named after the
// instruction set (gattn/config.hpp), so each unit keeps its own code instead of the linker
// picking one copy for both (the ODR violation of numpy#25274); tests/odr/check_symbols.sh checks
// that with `nm` and `objdump`. Eigen's own functions are shared by the units, so both must use
// one heap alignment: both get EIGEN_MAX_ALIGN_BYTES=64 (tests/CMakeLists.txt), as a program
// that mixes -m flags must give every unit.
// This test checks that the units did use different instruction sets and one Eigen heap
// alignment, that one unit catches the other's gattn::shape_error, and that both compute the
// same attention, layer and Qwen3-Next outputs.
// Results are compared to 1e-5, not bitwise: the AVX2 unit has 8 lanes and FMA, so it sums and
// rounds in another order.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "odr/odr_api.h"

namespace {

bool cpu_has_avx2_fma() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return false;
#endif
}

#define REQUIRE_AVX2()                                                              \
    do {                                                                            \
        if (!cpu_has_avx2_fma()) GTEST_SKIP() << "this CPU has no AVX2 and FMA";    \
    } while (0)

std::vector<float> random_values(std::size_t n, unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    std::vector<float> v(n);
    for (auto& x : v) x = u(rng);
    return v;
}

// |a − b| ≤ 1e-5 · (1 + |b|) for every element; at most 5 failures are printed.
void expect_agree(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    int bad = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
        const double x = a[i], y = b[i];
        if (!(std::abs(x - y) <= 1e-5 * (1.0 + std::abs(y))) && ++bad <= 5)
            ADD_FAILURE() << what << ": element " << i << " baseline " << x << " vs avx2 " << y;
    }
    EXPECT_EQ(bad, 0) << what;
}

TEST(Odr, UnitsUseDifferentInstructionSets) {
    REQUIRE_AVX2();
    const std::string base_arch = gattn_odr_arch_baseline(), avx2_arch = gattn_odr_arch_avx2();
    const std::string base_ns = gattn_odr_namespace_baseline(), avx2_ns = gattn_odr_namespace_avx2();
    std::printf("baseline unit: %s (gattn::%s)\navx2 unit:     %s (gattn::%s)\n", base_arch.c_str(),
                base_ns.c_str(), avx2_arch.c_str(), avx2_ns.c_str());
    EXPECT_NE(base_arch, avx2_arch);
    EXPECT_NE(base_ns, avx2_ns);
    EXPECT_EQ(avx2_ns, "isa_avx2_fma");
    EXPECT_NE(avx2_arch.find("avx2"), std::string::npos) << avx2_arch;
}

// Eigen's allocation functions (e.g. PlainObjectBase::resize) exist once in the program: with
// different heap alignments one unit would free the other's memory with the wrong allocator.
TEST(Odr, UnitsShareEigenHeapAlignment) {
    const int base = gattn_odr_eigen_alignment_baseline(), avx2 = gattn_odr_eigen_alignment_avx2();
    std::printf("Eigen heap alignment: baseline unit %d bytes, avx2 unit %d bytes\n", base, avx2);
    EXPECT_EQ(base, avx2);
}

// Exception types stay outside the instruction-set namespaces: one unit catches what the other
// throws as gattn::shape_error.
TEST(Odr, ShapeErrorIsCaughtAcrossUnits) {
    REQUIRE_AVX2();
    EXPECT_EQ(gattn_odr_catch_shape_error_baseline(&gattn_odr_throw_shape_error_avx2), 1);
    EXPECT_EQ(gattn_odr_catch_shape_error_avx2(&gattn_odr_throw_shape_error_baseline), 1);
}

TEST(Odr, SdpaAgreesAcrossUnits) {
    REQUIRE_AVX2();
    const int lengths_a[] = {70, 33};
    const int lengths_b[] = {3000, 1999};
    // batch, nq, nk, heads, kv_heads, dk, dv, causal, window, key_lengths
    const GattnOdrSdpaCase cases[] = {
        {2, 40, 70, 4, 2, 16, 8, 1, 0, lengths_a},   // prefill tiles, GQA, causal, key lengths
        {1, 64, 64, 2, 2, 32, 32, 0, 9, nullptr},    // sliding window, not causal
        {2, 1, 3000, 2, 2, 24, 24, 1, 0, lengths_b}, // decoding: split-KV chunks
        {1, 17, 50, 6, 1, 12, 20, 1, 5, nullptr},    // MQA, d_v != d_k, causal window
        {3, 2, 9, 8, 4, 8, 8, 0, 0, nullptr},        // few queries per KV head
    };
    unsigned seed = 1;
    for (const auto& c : cases) {
        const std::string what = "case B=" + std::to_string(c.batch) + " Nq=" + std::to_string(c.nq) +
                                 " Nk=" + std::to_string(c.nk) + " H=" + std::to_string(c.heads);
        const auto q = random_values(std::size_t(c.batch) * c.nq * c.heads * c.dk, seed++);
        const auto k = random_values(std::size_t(c.batch) * c.nk * c.kv_heads * c.dk, seed++);
        const auto v = random_values(std::size_t(c.batch) * c.nk * c.kv_heads * c.dv, seed++);
        std::vector<float> base(std::size_t(c.batch) * c.nq * c.heads * c.dv, -7.0f), avx2 = base;
        ASSERT_EQ(gattn_odr_sdpa_baseline(&c, q.data(), k.data(), v.data(), base.data()), 0) << what;
        ASSERT_EQ(gattn_odr_sdpa_avx2(&c, q.data(), k.data(), v.data(), avx2.data()), 0) << what;
        expect_agree(base, avx2, what);
        EXPECT_TRUE(std::all_of(base.begin(), base.end(), [](float x) { return std::isfinite(x); })) << what;
    }
}

TEST(Odr, LayerAgreesAcrossUnitsForEveryGate) {
    REQUIRE_AVX2();
    const int gates = gattn_odr_gate_count_baseline();
    ASSERT_EQ(gates, gattn_odr_gate_count_avx2());
    ASSERT_GT(gates, 1);
    const int batch = 2, tokens = 9;
    const auto x = random_values(std::size_t(batch) * tokens * GATTN_ODR_D_MODEL, 99);
    for (int g = 0; g < gates; ++g) {
        std::vector<float> base(x.size(), -7.0f), avx2 = base;
        ASSERT_EQ(gattn_odr_layer_baseline(g, 5u + unsigned(g), x.data(), batch, tokens, base.data()), 0) << g;
        ASSERT_EQ(gattn_odr_layer_avx2(g, 5u + unsigned(g), x.data(), batch, tokens, avx2.data()), 0) << g;
        expect_agree(base, avx2, "gate spec " + std::to_string(g));
    }
}

TEST(Odr, Qwen3NextAgreesAcrossUnits) {
    REQUIRE_AVX2();
    const int batch = 2, tokens = 7;
    const auto x = random_values(std::size_t(batch) * (tokens + 1) * GATTN_ODR_D_MODEL, 17);
    std::vector<float> base(x.size(), -7.0f), avx2 = base;
    ASSERT_EQ(gattn_odr_qwen3_next_baseline(3u, x.data(), batch, tokens, base.data()), 0);
    ASSERT_EQ(gattn_odr_qwen3_next_avx2(3u, x.data(), batch, tokens, avx2.data()), 0);
    expect_agree(base, avx2, "Qwen3-Next prefill and decoding step");
}

}  // namespace
