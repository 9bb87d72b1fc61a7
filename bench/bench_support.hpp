// SPDX-License-Identifier: Apache-2.0
// Helpers shared by gattn's benchmarks.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <gattn/gattn.hpp>

namespace gattn_bench {

/// Runs a and b in turn within every iteration of state (so that both see the same state of a
/// shared machine) and returns the seconds each took in all.
template <class A, class B>
inline std::pair<double, double> time_in_turn(benchmark::State& state, const A& a, const B& b) {
    using Clock = std::chrono::steady_clock;
    double ta = 0, tb = 0;
    for (auto _ : state) {
        const auto t0 = Clock::now();
        a();
        benchmark::ClobberMemory();
        const auto t1 = Clock::now();
        b();
        benchmark::ClobberMemory();
        const auto t2 = Clock::now();
        ta += std::chrono::duration<double>(t1 - t0).count();
        tb += std::chrono::duration<double>(t2 - t1).count();
    }
    return {ta, tb};
}

/// time_in_turn for three calls: a, b and c in turn within every iteration; their total seconds.
template <class A, class B, class C>
inline std::array<double, 3> time_in_turn(benchmark::State& state, const A& a, const B& b, const C& c) {
    using Clock = std::chrono::steady_clock;
    std::array<double, 3> t{};
    for (auto _ : state) {
        const auto t0 = Clock::now();
        a();
        benchmark::ClobberMemory();
        const auto t1 = Clock::now();
        b();
        benchmark::ClobberMemory();
        const auto t2 = Clock::now();
        c();
        benchmark::ClobberMemory();
        const auto t3 = Clock::now();
        t[0] += std::chrono::duration<double>(t1 - t0).count();
        t[1] += std::chrono::duration<double>(t2 - t1).count();
        t[2] += std::chrono::duration<double>(t3 - t2).count();
    }
    return t;
}

/// Adds gattn's version, the instruction sets (compiled for, and the CPU's), the bf16 and int8
/// decoding kernels and the thread count to the benchmark context that Google Benchmark prints first.
inline void add_gattn_context() {
    benchmark::AddCustomContext("gattn_version", gattn::version());
    benchmark::AddCustomContext("gattn_isa", gattn::describe(gattn::instruction_sets()));
    benchmark::AddCustomContext("gattn_bf16_kernel", gattn::describe(gattn::bf16_kernel()));
    benchmark::AddCustomContext("gattn_int8_kernel", gattn::describe(gattn::int8_kernel()));
    benchmark::AddCustomContext("gattn_threads", std::to_string(gattn::num_threads()));
}

/// Streaming read bandwidth in bytes/s: the best of five sums over a buffer of `bytes` (at least
/// 8 MiB), split over the OpenMP threads as the measured call is. Measure it just before the
/// call it is the roof of, so that both see the same state of a shared machine.
inline double stream_bandwidth(std::size_t bytes) {
    const std::size_t n = std::max<std::size_t>(bytes / sizeof(std::uint64_t), 1 << 20);
    std::vector<std::uint64_t> buffer(n, 1);
    double best = 0;
    for (int pass = 0; pass < 5; ++pass) {
        std::uint64_t total = 0;
        const auto t0 = std::chrono::steady_clock::now();
#ifdef _OPENMP
#pragma omp parallel for schedule(static) reduction(+ : total)
#endif
        for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(n); ++i) total += buffer[std::size_t(i)];
        const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        benchmark::DoNotOptimize(total);
        best = std::max(best, double(n * sizeof(std::uint64_t)) / t);
    }
    return best;
}

/// Independent FMA chains of the peak kernel: with two FMA pipes of 4-cycle latency, 8 keep
/// both busy; 12 leave a margin and, with the two constant operands, fit in AVX2's 16 registers.
inline constexpr int kChains = 12;
/// Steps of the peak kernel per iteration: 2^23 · 12 chains · 2 FLOPs · lanes, about 1.6 GFLOP
/// (AVX2) or 3.2 GFLOP (AVX-512), some 16 ms at the peak.
inline constexpr long kPeakSteps = 1L << 23;

/// kChains chains acc = acc·a + b of `steps` fused multiply-adds each, in registers of the
/// build's width; returns a value that depends on all of them (kept alive by the caller).
[[gnu::noinline]] inline float fma_chains(long steps) {
    namespace simd = gattn::simd;
    using B = simd::Batch<float>;
    B acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = B(1.0f + 0.001f * float(i));
    const B a = simd::opaque(B(0.9999999f)), b = simd::opaque(B(1e-7f));
    for (long s = 0; s < steps; ++s)
        for (int i = 0; i < kChains; ++i) acc[i] = simd::fma(acc[i], a, b);
    B total = acc[0];
    for (int i = 1; i < kChains; ++i) total += acc[i];
    return simd::reduce_sum(total);
}

/// FLOPs of one fma_chains call.
inline double peak_flops(long steps) { return double(steps) * kChains * 2.0 * double(gattn::simd::kLanes<float>); }

/// The benchmarks' main: gattn's context, then Google Benchmark as BENCHMARK_MAIN runs it.
inline int run(int argc, char** argv) {
    add_gattn_context();
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
}

}  // namespace gattn_bench
