// SPDX-License-Identifier: Apache-2.0
// Two builds of gattn in one process: the shared objects A and B (bench/ab_step.cpp, each built
// against one revision's headers by scripts/ab_revisions.sh) run the same float SDPA call in
// turn, in alternating order, within every iteration. On a shared machine whose speed drifts
// from minute to minute, the ratio of each pair of calls is far steadier than the ratio of two
// processes' times. Counters: a_ms and b_ms (medians), b_vs_a (median of the pairs' ratios of
// B's time to A's: below 1, B is faster), b_vs_a_q1 and b_vs_a_q3 (quartiles of those ratios;
// each the nearest of the sorted ratios), same_bits (1: the two outputs are bitwise equal). No
// kernel of gattn is compiled in here: of its headers only cache/huge_pages.hpp (--huge_pages).
//
//   bench_revisions [Google Benchmark flags] A.so B.so    (paths with a '/', as dlopen wants)
//
// Cases: one decoding step (1 query token over N_k keys, bottom-right causal, d = 128): over
// 8k and 32k keys, 8 query heads on 2 or 8 KV heads, with the CPU caches flushed before each
// call (flush:1) so that K and V come from memory; over 256 keys of 32 heads and 1024 keys of 8
// heads (8 MiB of K and V, within gattn's in-cache limit, kDecodeFromMemoryBytes) with no
// flush, so that they come from cache; a prefill of N = 2048 (8 heads, d = 128, non-causal
// and causal); and the decoding steps of 8 on 8 KV heads over head-major keys and values
// (head_major:1, HeadMajorRows: the same buffers read as [H_kv·N_k, d] rows).
//
// --huge_pages (anywhere among the flags): K and V sit in memory advised into transparent huge
// pages by gattn/cache/huge_pages.hpp, as gattn's KVCache and PagedKVPool advise theirs (counter
// huge_page_MiB: what was advised, as KVCache::huge_page_bytes(); 0 where transparent huge pages
// are off). Without it, 4 KiB pages as a plain vector's.
#include <dlfcn.h>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <random>
#include <vector>

#include <gattn/cache/huge_pages.hpp>  // the caches' own advice; no kernel code

namespace {

using Sdpa = int (*)(const float*, const float*, const float*, float*, long, long, long, long, long, int, int);
Sdpa g_sdpa[2] = {nullptr, nullptr};  // A, B

/// Loads the gattn_ab_sdpa of shared object path; nullptr, with the reason printed, when it fails.
Sdpa load(const char* path) {
    void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        std::fprintf(stderr, "bench_revisions: %s\n", dlerror());
        return nullptr;
    }
    auto* f = reinterpret_cast<Sdpa>(dlsym(handle, "gattn_ab_sdpa"));
    if (!f) std::fprintf(stderr, "bench_revisions: %s has no gattn_ab_sdpa\n", path);
    return f;
}

bool g_huge_pages = false;  // --huge_pages

/// A copy of x in its own 2 MiB-aligned memory, advised into huge pages when --huge_pages
/// (before it is written, as the caches do); adds the bytes advised to `advised`.
std::unique_ptr<float, decltype(&std::free)> place(const std::vector<float>& x, std::size_t& advised) {
    constexpr std::size_t kHuge = std::size_t(2) << 20;
    const std::size_t bytes = (x.size() * sizeof(float) + kHuge - 1) / kHuge * kHuge;
    std::unique_ptr<float, decltype(&std::free)> p(static_cast<float*>(std::aligned_alloc(kHuge, bytes)), &std::free);
    if (!p) throw std::bad_alloc();
    if (g_huge_pages) advised += gattn::advise_huge_pages(p.get(), bytes);
    std::memcpy(p.get(), x.data(), x.size() * sizeof(float));
    return p;
}

double quantile(std::vector<double> x, double q) {
    std::sort(x.begin(), x.end());
    return x[static_cast<std::size_t>(q * static_cast<double>(x.size() - 1) + 0.5)];
}

/// Args: N_q, N_k, query heads, KV heads, head_dim, causal, flush (64 MiB read before each call),
/// head_major (keys and values as head-major rows).
void BM_Revisions(benchmark::State& state) {
    const long nq = state.range(0), nk = state.range(1), h = state.range(2), hkv = state.range(3), d = state.range(4);
    const int causal = static_cast<int>(state.range(5));
    const bool flushes = state.range(6) != 0;
    const int head_major = static_cast<int>(state.range(7));
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> uniform(-1, 1);
    auto random = [&](std::size_t n) {
        std::vector<float> x(n);
        for (float& e : x) e = uniform(rng);
        return x;
    };
    std::size_t advised = 0;
    const std::vector<float> q = random(static_cast<std::size_t>(nq * h * d));
    const auto k = place(random(static_cast<std::size_t>(nk * hkv * d)), advised);
    const auto v = place(random(static_cast<std::size_t>(nk * hkv * d)), advised);
    std::vector<float> out[2] = {std::vector<float>(q.size()), std::vector<float>(q.size())};
    std::vector<char> flush(flushes ? std::size_t(64) << 20 : 0, 1);  // past a 32 MiB L3
    long touched = 0;
    std::vector<double> ms[2], ratios;
    bool failed = false;
    for (auto _ : state) {
        double seconds[2] = {0, 0};
        for (int turn = 0; turn < 2 && !failed; ++turn) {
            const int which = (ms[0].size() % 2 == 0) ? turn : 1 - turn;  // A first, then B first
            for (std::size_t i = 0; i < flush.size(); i += 64) touched += flush[i];
            const auto t0 = std::chrono::steady_clock::now();
            failed = g_sdpa[which](q.data(), k.get(), v.get(), out[which].data(), nq, nk, h, hkv, d, causal,
                                   head_major) != 0;
            seconds[which] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        }
        if (failed) {
            state.SkipWithError("a call threw (see above)");
            break;
        }
        state.SetIterationTime(seconds[0] + seconds[1]);
        ms[0].push_back(seconds[0] * 1e3);
        ms[1].push_back(seconds[1] * 1e3);
        ratios.push_back(seconds[1] / seconds[0]);
    }
    benchmark::DoNotOptimize(touched);
    if (failed) return;
    state.counters["a_ms"] = quantile(ms[0], 0.5);
    state.counters["b_ms"] = quantile(ms[1], 0.5);
    state.counters["b_vs_a"] = quantile(ratios, 0.5);
    state.counters["b_vs_a_q1"] = quantile(ratios, 0.25);
    state.counters["b_vs_a_q3"] = quantile(ratios, 0.75);
    state.counters["huge_page_MiB"] = static_cast<double>(advised) / (1 << 20);
    state.counters["same_bits"] = std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float)) == 0;
}

BENCHMARK(BM_Revisions)
    ->ArgNames({"N_q", "N_k", "heads", "kv_heads", "d", "causal", "flush", "head_major"})
    ->Args({1, 8192, 8, 2, 128, 1, 1, 0})
    ->Args({1, 8192, 8, 8, 128, 1, 1, 0})
    ->Args({1, 32768, 8, 2, 128, 1, 1, 0})
    ->Args({1, 32768, 8, 8, 128, 1, 1, 0})
    ->Args({1, 32768, 1, 1, 128, 1, 1, 0})
    ->Args({1, 131072, 1, 1, 128, 1, 1, 0})
    ->Args({1, 8192, 8, 8, 128, 1, 1, 1})
    ->Args({1, 32768, 8, 8, 128, 1, 1, 1})
    ->Args({1, 256, 32, 32, 128, 1, 0, 0})
    ->Args({1, 1024, 8, 8, 128, 1, 0, 0})
    ->Args({2048, 2048, 8, 8, 128, 0, 0, 0})
    ->Args({2048, 2048, 8, 8, 128, 1, 0, 0})
    ->UseManualTime()
    ->MinTime(2.0)
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
    benchmark::Initialize(&argc, argv);
    int kept = 1;  // argv without --huge_pages
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--huge_pages") == 0)
            g_huge_pages = true;
        else
            argv[kept++] = argv[i];
    }
    argc = kept;
    if (argc != 3) {
        std::fprintf(stderr,
                     "usage: bench_revisions [Google Benchmark flags] [--huge_pages] A.so B.so (paths with a '/')\n");
        return 2;
    }
    for (int i = 0; i < 2; ++i)
        if (!(g_sdpa[i] = load(argv[1 + i]))) return 1;
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
}
