// SPDX-License-Identifier: Apache-2.0
// gattn's float SDPA against the FMA peak of the build's vector width and against OpenBLAS's
// sgemm of the same FLOPs, timed in turn within every iteration of one process, so that the
// three see the same state of a shared machine (other tenants, clock) and the ratios cancel it.
//
// BM_FlashVsPeak (args N, d, causal, N_q; 8 heads, N_k = N keys, N_q query rows, one thread),
// per iteration:
//  - gattn: scaled_dot_product_attention<float> on [N_q, 8·d] query and [N, 8·d] key rows;
//  - peak: 12 independent chains of fused multiply-adds in registers of the build's width
//    (AVX2: 256-bit, AVX-512: 512-bit), enough to fill two FMA pipes of 4-cycle latency;
//  - gemm (when built with OpenBLAS): per head S = Q_h·K_hᵀ, then O_h = S·V_h with cblas_sgemm,
//    on N_q/2 query rows for causal attention, so that it does the same FLOPs as gattn.
// FLOPs count 4·N_q·N·d per head (QKᵀ and PV), half of it for causal attention (N_q = N).
// The three are timed by the thread's CPU time (POSIX CLOCK_THREAD_CPUTIME_ID; all three run
// on the calling thread), so that time slices given to other programs on a busy machine count
// for none of them; the benchmark's own time column is wall time. N_q = 16 is the shape of a
// cascade's shared prefix at batch 16 with one query head per KV head (cascade_attention): 16
// rows against the keys of each head.
// Counters: gattn_GFLOP/s, peak_GFLOP/s, of_peak = gattn / peak, and with OpenBLAS gemm_GFLOP/s,
// vs_gemm = gattn / gemm and gemm_of_peak. Run with repetitions and read the medians:
//
//   OPENBLAS_CORETYPE=Haswell OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
//     build/avx2/bench/bench_flash_peak --benchmark_repetitions=5
//     --benchmark_report_aggregates_only=true --benchmark_counters_tabular=true
// (one command line).
//
// OPENBLAS_CORETYPE=Haswell makes OpenBLAS run its AVX2 kernel on any x86-64 CPU (the
// contender of an AVX2 build); without it OpenBLAS picks the kernel for the CPU it finds. The
// kernel it ran is printed in the context (openblas_core).

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <string>

#include <gattn/gattn.hpp>
#include <gattn/simd/compat.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef GATTN_BENCH_OPENBLAS
#include <cblas.h>
#endif

namespace {

using Matrix = gattn::RowMatrix<float>;
constexpr gattn::Index kHeads = 8;

using gattn_bench::fma_chains;
using gattn_bench::kChains;
using gattn_bench::kPeakSteps;
using gattn_bench::peak_flops;

/// Seconds of CPU time of the calling thread (wall time where POSIX's thread clock is missing).
double thread_seconds() {
#if defined(CLOCK_THREAD_CPUTIME_ID)
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
#else
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
#endif
}

double attention_flops(double nq, double n, double d, bool causal) {
    const double full = 4.0 * nq * n * d * kHeads;
    return causal ? full / 2 : full;
}

void single_thread() {
#ifdef _OPENMP
    omp_set_num_threads(1);
#endif
#ifdef GATTN_BENCH_OPENBLAS
    openblas_set_num_threads(1);
#endif
}

/// gattn's SDPA, the FMA peak and OpenBLAS's sgemm in turn within every iteration.
void BM_FlashVsPeak(benchmark::State& state) {
    const gattn::Index n = state.range(0), d = state.range(1), nq = state.range(3);
    const bool causal = state.range(2) != 0;
    single_thread();
    const Matrix q = Matrix::Random(nq, kHeads * d), k = Matrix::Random(n, kHeads * d),
                 v = Matrix::Random(n, kHeads * d);
    Matrix out(nq, kHeads * d);
    gattn::SdpaOptions<float> opt;
    opt.mask.causal = causal;
#ifdef GATTN_BENCH_OPENBLAS
    const gattn::Index gemm_rows = causal ? nq / 2 : nq;  // the same FLOPs as the causal kernel
    Matrix s(gemm_rows, n), gemm_out(gemm_rows, kHeads * d);
    const int ld = static_cast<int>(kHeads * d), ni = static_cast<int>(n), di = static_cast<int>(d);
    const int mi = static_cast<int>(gemm_rows);
#endif
    double t_gattn = 0, t_peak = 0, t_gemm = 0;
    float sink = 0;
    for (auto _ : state) {
        const double t0 = thread_seconds();
        gattn::scaled_dot_product_attention<float>(q, k, v, {1, kHeads, kHeads}, out, opt);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
        const double t1 = thread_seconds();
        sink += fma_chains(kPeakSteps);
        benchmark::DoNotOptimize(sink);
        const double t2 = thread_seconds();
#ifdef GATTN_BENCH_OPENBLAS
        for (gattn::Index h = 0; h < kHeads; ++h) {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, mi, ni, di, 1.0f, q.data() + h * d, ld,
                        k.data() + h * d, ld, 0.0f, s.data(), ni);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, mi, di, ni, 1.0f, s.data(), ni, v.data() + h * d, ld,
                        0.0f, gemm_out.data() + h * d, ld);
        }
        benchmark::DoNotOptimize(gemm_out.data());
        benchmark::ClobberMemory();
#endif
        const double t3 = thread_seconds();
        t_gattn += t1 - t0;
        t_peak += t2 - t1;
        t_gemm += t3 - t2;
    }
    const double iters = static_cast<double>(state.iterations());
    const double flops = attention_flops(double(nq), double(n), double(d), causal) * iters;
    const double gattn_rate = flops / t_gattn, peak_rate = peak_flops(kPeakSteps) * iters / t_peak;
    state.counters["gattn_GFLOP/s"] = gattn_rate / 1e9;
    state.counters["peak_GFLOP/s"] = peak_rate / 1e9;
    state.counters["of_peak"] = gattn_rate / peak_rate;
#ifdef GATTN_BENCH_OPENBLAS
    const double gemm_rate = flops / t_gemm;
    state.counters["gemm_GFLOP/s"] = gemm_rate / 1e9;
    state.counters["vs_gemm"] = gattn_rate / gemm_rate;
    state.counters["gemm_of_peak"] = gemm_rate / peak_rate;
#else
    (void)t_gemm;
#endif
    state.SetLabel(gattn::simd::arch_name());
}

BENCHMARK(BM_FlashVsPeak)
    ->Args({2048, 128, 0, 2048})
    ->Args({2048, 128, 1, 2048})
    ->Args({2048, 64, 0, 2048})
    ->Args({2048, 64, 1, 2048})
    ->Args({2048, 256, 0, 2048})
    ->Args({2048, 256, 1, 2048})
    ->Args({2048, 128, 0, 16})
    ->Args({8192, 128, 0, 16})
    ->ArgNames({"N", "d", "causal", "N_q"})
    ->MinTime(2.0)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
#ifdef GATTN_BENCH_OPENBLAS
    benchmark::AddCustomContext("openblas_core", openblas_get_corename());
#endif
    return gattn_bench::run(argc, argv);
}
