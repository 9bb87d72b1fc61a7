// SDPA throughput, side by side in one run: gattn's tiled kernel, two attention programs written
// by hand with Eigen (the full N×N score matrix), and Eigen's own GEMM at a matching size as the
// practical roof. float32, 8 heads. Counter FLOP/s counts 4·N_q·N_k·d·H (QKᵀ and PV) for
// full attention and half of that for causal attention (only the unmasked half is useful work).
//
// BM_GattnVsCareful runs gattn and the careful Eigen attention in turn in every iteration and
// reports their speedup. BM_Bf16VsFloat does the same for gattn's float SDPA and its bf16 SDPA
// (the same inputs rounded to bf16; bf16 output) and reports speedup = float time / bf16 time;
// the bf16 kernel that ran (and why no faster one) is printed in the context.
//
// BM_VariantCost runs plain SDPA and one attention variant of current models (learned sinks,
// logit softcap, ALiBi, top-left causal alignment) in turn in every iteration and reports
// cost = variant time / plain time − 1, for prefill (N_q = N_k) and decoding (N_q = 1); bf16
// variants run the bf16 kernels on the same inputs rounded.
//
// BM_DecodeFromCache runs one decoding step over a KVCache (its storage in transparent huge
// pages where the system uses them) and over plain matrices holding the same rows, in turn:
// cache_vs_plain = plain time / cache time.
//
// BM_SdpaBackward runs the forward (with its log-sum-exp) and the backward pass in turn in every
// iteration: GFLOP/s of the backward counts its five products, 10·N²·d per head (half for
// causal), and bwd_vs_fwd = backward time / forward time. BM_SdpaBackwardBf16: the bfloat16
// backward against the float backward of the same values (bf16_vs_float = time ratio).
//
// Run: build/bench/bench/bench_sdpa --benchmark_counters_tabular=true
// Threads: the benchmarks with /threads:2 set omp_set_num_threads(2) (needs an OpenMP build).

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gattn/gattn.hpp>
#include <gattn/simd/cpu.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using Matrix = gattn::RowMatrix<float>;
constexpr gattn::Index kHeads = 8;

void set_threads(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

double attention_flops(double nq, double nk, double d, bool causal) {
    const double full = 4.0 * nq * nk * d * kHeads;
    return causal ? full / 2 : full;
}

struct Inputs {
    Matrix q, k, v, out;
    Inputs(gattn::Index nq, gattn::Index nk, gattn::Index d)
        : q(Matrix::Random(nq, kHeads * d)),
          k(Matrix::Random(nk, kHeads * d)),
          v(Matrix::Random(nk, kHeads * d)),
          out(nq, kHeads * d) {}
};

/// gattn SDPA. Args: N_q, N_k, d, causal, threads.
void BM_GattnSdpa(benchmark::State& state) {
    const gattn::Index nq = state.range(0), nk = state.range(1), d = state.range(2);
    const bool causal = state.range(3) != 0;
    set_threads(static_cast<int>(state.range(4)));
    Inputs in(nq, nk, d);
    gattn::SdpaOptions<float> opt;
    opt.mask.causal = causal;
    for (auto _ : state) {
        gattn::scaled_dot_product_attention<float>(in.q, in.k, in.v, {1, kHeads, kHeads}, in.out, opt);
        benchmark::DoNotOptimize(in.out.data());
        benchmark::ClobberMemory();
    }
    state.counters["FLOP/s"] =
        benchmark::Counter(attention_flops(nq, nk, d, causal), benchmark::Counter::kIsIterationInvariantRate);
    state.SetLabel(gattn::simd::arch_name());
    set_threads(1);
}

/// Careful hand-written Eigen attention: per head, S = scale·Q·Kᵀ into a preallocated N×N
/// matrix, a row-wise softmax with Eigen's vectorised exp, O = P·V. Causal masking sets the
/// upper triangle to −∞ (it still computes the masked half, as such code does).
void careful_eigen_attention(Inputs& in, Matrix& s, gattn::Index d, bool causal) {
    const gattn::Index n = s.rows();
    const float scale = 1.0f / std::sqrt(float(d));
    for (gattn::Index h = 0; h < kHeads; ++h) {
        const auto qh = in.q.middleCols(h * d, d);
        const auto kh = in.k.middleCols(h * d, d);
        const auto vh = in.v.middleCols(h * d, d);
        s.noalias() = scale * qh * kh.transpose();
        for (gattn::Index i = 0; i < n; ++i) {
            auto row = s.row(i);
            const gattn::Index visible = causal ? i + 1 : n;
            if (causal) row.tail(n - visible).setConstant(-INFINITY);
            const float m = row.head(visible).maxCoeff();
            row = (row.array() - m).exp();
            row /= row.sum();
        }
        in.out.middleCols(h * d, d).noalias() = s * vh;
    }
}

void BM_EigenCarefulSdpa(benchmark::State& state) {
    const gattn::Index n = state.range(0), d = state.range(1);
    const bool causal = state.range(2) != 0;
    Inputs in(n, n, d);
    Matrix s(n, n);
    for (auto _ : state) {
        careful_eigen_attention(in, s, d, causal);
        benchmark::DoNotOptimize(in.out.data());
        benchmark::ClobberMemory();
    }
    state.counters["FLOP/s"] =
        benchmark::Counter(attention_flops(n, n, d, causal), benchmark::Counter::kIsIterationInvariantRate);
}

/// gattn and the careful Eigen attention in turn within every iteration, one thread, so that
/// both see the same state of a shared machine (other tenants, clock) and their ratio is
/// steadier than that of two benchmarks run minutes apart. Counters: each one's GFLOP/s and
/// speedup = careful time / gattn time.
void BM_GattnVsCareful(benchmark::State& state) {
    const gattn::Index n = state.range(0), d = state.range(1);
    const bool causal = state.range(2) != 0;
    set_threads(1);
    Inputs in(n, n, d);
    Matrix s(n, n), out(n, kHeads * d);
    gattn::SdpaOptions<float> opt;
    opt.mask.causal = causal;
    const auto [t_gattn, t_careful] = gattn_bench::time_in_turn(
        state,
        [&] {
            gattn::scaled_dot_product_attention<float>(in.q, in.k, in.v, {1, kHeads, kHeads}, out, opt);
            benchmark::DoNotOptimize(out.data());
        },
        [&] {
            careful_eigen_attention(in, s, d, causal);
            benchmark::DoNotOptimize(in.out.data());
        });
    const double flops = attention_flops(n, n, d, causal) * static_cast<double>(state.iterations());
    state.counters["gattn_GFLOP/s"] = flops / t_gattn / 1e9;
    state.counters["careful_GFLOP/s"] = flops / t_careful / 1e9;
    state.counters["speedup"] = t_careful / t_gattn;
    state.SetLabel(gattn::simd::arch_name());
}

/// The forward (with its log-sum-exp) and the backward pass of SDPA in turn within every
/// iteration, float, kBackwardHeads heads. Args: N (= N_q = N_k), d, causal, threads. Counters:
/// GFLOP/s of the backward (10·N²·d per head: QKᵀ, dO·Vᵀ, dS·K, dSᵀ·Q, Pᵀ·dO; half for
/// causal), bwd_vs_fwd = backward time / forward time, and each one's milliseconds.
constexpr gattn::Index kBackwardHeads = 2;
void BM_SdpaBackward(benchmark::State& state) {
    const gattn::Index n = state.range(0), d = state.range(1), h = kBackwardHeads;
    const bool causal = state.range(2) != 0;
    set_threads(static_cast<int>(state.range(3)));
    const Matrix q = Matrix::Random(n, h * d), k = Matrix::Random(n, h * d), v = Matrix::Random(n, h * d);
    const Matrix d_out = Matrix::Random(n, h * d);
    Matrix out(n, h * d), lse, dq(n, h * d), dk(n, h * d), dv(n, h * d);
    gattn::SdpaOptions<float> opt;
    opt.mask.causal = causal;
    gattn::SdpaOutputs<float> extra;
    extra.log_sum_exp = &lse;
    const gattn::HeadLayout heads{1, h, h};
    const auto [t_fwd, t_bwd] = gattn_bench::time_in_turn(
        state,
        [&] {
            gattn::scaled_dot_product_attention<float>(q, k, v, heads, out, opt, extra);
            benchmark::DoNotOptimize(out.data());
        },
        [&] {
            gattn::scaled_dot_product_attention_backward<float>(q, k, v, heads, out, lse, d_out, dq, dk, dv, opt);
            benchmark::DoNotOptimize(dq.data());
        });
    const double iterations = static_cast<double>(state.iterations());
    const double flops = 10.0 * double(n) * double(n) * double(d) * double(h) * (causal ? 0.5 : 1.0);
    state.counters["GFLOP/s"] = flops * iterations / t_bwd / 1e9;
    state.counters["bwd_vs_fwd"] = t_bwd / t_fwd;
    state.counters["fwd_ms"] = 1e3 * t_fwd / iterations;
    state.counters["bwd_ms"] = 1e3 * t_bwd / iterations;
    state.SetLabel(gattn::simd::arch_name());
    set_threads(1);
}

/// The bfloat16 backward (inputs, output and gradients in bf16, accumulation in float) against
/// the float backward of the same values, in turn within every iteration (Args: N, d, causal,
/// threads); counter bf16_vs_float = bf16 time / float time.
void BM_SdpaBackwardBf16(benchmark::State& state) {
    using Bf16 = gattn::RowMatrix<gattn::bfloat16>;
    const gattn::Index n = state.range(0), d = state.range(1), h = kBackwardHeads;
    const bool causal = state.range(2) != 0;
    set_threads(static_cast<int>(state.range(3)));
    const Bf16 q = Matrix::Random(n, h * d).cast<gattn::bfloat16>(),
               k = Matrix::Random(n, h * d).cast<gattn::bfloat16>(),
               v = Matrix::Random(n, h * d).cast<gattn::bfloat16>(),
               d_out = Matrix::Random(n, h * d).cast<gattn::bfloat16>();
    const Matrix qf = q.cast<float>(), kf = k.cast<float>(), vf = v.cast<float>(), d_outf = d_out.cast<float>();
    gattn::SdpaOptions<float> opt;
    opt.mask.causal = causal;
    const gattn::HeadLayout heads{1, h, h};
    Bf16 out(n, h * d), dq(n, h * d), dk(n, h * d), dv(n, h * d);
    Matrix outf(n, h * d), dqf(n, h * d), dkf(n, h * d), dvf(n, h * d), lse, lsef;
    gattn::SdpaOutputs<float> extra, extraf;
    extra.log_sum_exp = &lse;
    extraf.log_sum_exp = &lsef;
    gattn::scaled_dot_product_attention<gattn::bfloat16>(q, k, v, heads, out, opt, extra);
    gattn::scaled_dot_product_attention<float>(qf, kf, vf, heads, outf, opt, extraf);
    const auto [t_float, t_bf16] = gattn_bench::time_in_turn(
        state,
        [&] {
            gattn::scaled_dot_product_attention_backward<float>(qf, kf, vf, heads, outf, lsef, d_outf, dqf, dkf, dvf,
                                                                opt);
            benchmark::DoNotOptimize(dqf.data());
        },
        [&] {
            gattn::scaled_dot_product_attention_backward<gattn::bfloat16>(q, k, v, heads, out, lse, d_out, dq, dk, dv,
                                                                          opt);
            benchmark::DoNotOptimize(dq.data());
        });
    const double iterations = static_cast<double>(state.iterations());
    const double flops = 10.0 * double(n) * double(n) * double(d) * double(h) * (causal ? 0.5 : 1.0);
    state.counters["GFLOP/s"] = flops * iterations / t_bf16 / 1e9;
    state.counters["bf16_vs_float"] = t_bf16 / t_float;
    state.SetLabel(gattn::simd::arch_name());
}

/// The bf16 kernel limit a benchmark's argument names: 0 none (the fastest this CPU and build
/// run), 1 AVX512-BF16 (what a CPU without AMX runs), 2 widened float (a CPU without bf16
/// instructions).
gattn::Bf16Kernel kernel_limit(std::int64_t arg) {
    return arg == 1   ? gattn::Bf16Kernel::Avx512Bf16
           : arg == 2 ? gattn::Bf16Kernel::WidenedFloat
                      : gattn::Bf16Kernel::Amx;
}

/// gattn's float SDPA and its SDPA over 16-bit inputs S (bf16: BM_Bf16VsFloat, fp16:
/// BM_Fp16VsFloat), in turn within every iteration. Args: N, causal, threads, kernel
/// (kernel_limit; bf16 only); d = 128, 8 heads. Counters: each one's GFLOP/s (float_GFLOP/s,
/// bf16_GFLOP/s or fp16_GFLOP/s) and speedup = float / 16-bit time. The label names the kernel
/// that ran (fp16: always the widened float kernel).
template <class S>
void BM_NarrowVsFloat(benchmark::State& state) {
    constexpr bool kBf16 = std::is_same_v<S, gattn::bfloat16>;
    const gattn::Index n = state.range(0), d = 128;
    const bool causal = state.range(1) != 0;
    set_threads(static_cast<int>(state.range(2)));
    if constexpr (kBf16) gattn::set_bf16_kernel_limit(kernel_limit(state.range(3)));
    Inputs in(n, n, d);
    const gattn::RowMatrix<S> q = in.q.cast<S>(), k = in.k.cast<S>(), v = in.v.cast<S>();
    gattn::RowMatrix<S> out(n, kHeads * d);
    gattn::SdpaOptions<float> opt;
    opt.mask.causal = causal;
    const auto [t_float, t_narrow] = gattn_bench::time_in_turn(
        state,
        [&] {
            gattn::scaled_dot_product_attention<float>(in.q, in.k, in.v, {1, kHeads, kHeads}, in.out, opt);
            benchmark::DoNotOptimize(in.out.data());
        },
        [&] {
            gattn::scaled_dot_product_attention<S>(q, k, v, {1, kHeads, kHeads}, out, opt);
            benchmark::DoNotOptimize(out.data());
        });
    const double flops = attention_flops(n, n, d, causal) * static_cast<double>(state.iterations());
    state.counters["float_GFLOP/s"] = flops / t_float / 1e9;
    state.counters[kBf16 ? "bf16_GFLOP/s" : "fp16_GFLOP/s"] = flops / t_narrow / 1e9;
    state.counters["speedup"] = t_float / t_narrow;
    state.SetLabel(kBf16 ? gattn::kernel_name(gattn::bf16_kernel().kernel) : "widened float");
    if constexpr (kBf16) gattn::set_bf16_kernel_limit(gattn::Bf16Kernel::Amx);
    set_threads(1);
}

/// One decoding step (one query token, 8 heads, d = 128) over a float cache and over a 16-bit
/// cache S (bf16: BM_Bf16DecodeVsFloat, fp16: BM_Fp16DecodeVsFloat), in turn within every
/// iteration. Args: cached tokens, KV heads, threads. Counters: each one's time per call in µs
/// (float_us, bf16_us or fp16_us) and speedup = float / 16-bit time (the step reads the cache
/// from memory, so half the bytes is the 16-bit cache's gain; a speedup below 1 means widening
/// costs more than the bytes saved).
template <class S>
void BM_NarrowDecodeVsFloat(benchmark::State& state) {
    const gattn::Index nk = state.range(0), hkv = state.range(1), d = 128;
    set_threads(static_cast<int>(state.range(2)));
    const Matrix q = Matrix::Random(1, kHeads * d), k = Matrix::Random(nk, hkv * d), v = Matrix::Random(nk, hkv * d);
    const gattn::RowMatrix<S> qb = q.cast<S>(), kb = k.cast<S>(), vb = v.cast<S>();
    Matrix out(1, kHeads * d);
    gattn::RowMatrix<S> out_b(1, kHeads * d);
    const auto [t_float, t_narrow] = gattn_bench::time_in_turn(
        state,
        [&] {
            gattn::scaled_dot_product_attention<float>(q, k, v, {1, kHeads, hkv}, out);
            benchmark::DoNotOptimize(out.data());
        },
        [&] {
            gattn::scaled_dot_product_attention<S>(qb, kb, vb, {1, kHeads, hkv}, out_b);
            benchmark::DoNotOptimize(out_b.data());
        });
    const double n = static_cast<double>(state.iterations());
    state.counters["float_us"] = t_float / n * 1e6;
    state.counters[std::is_same_v<S, gattn::bfloat16> ? "bf16_us" : "fp16_us"] = t_narrow / n * 1e6;
    state.counters["speedup"] = t_float / t_narrow;
    set_threads(1);
}

/// One decoding step (one query token, 8 query heads, d = 128) over a float cache, over an
/// int8 cache with the fastest int8 kernel this build and CPU run (kernel 0) or AVX-VNNI
/// (kernel 1: set_int8_kernel_limit keeps AVX512-VNNI out), and over the same int8 cache with
/// the codes widened to float FMAs, the three in turn within every iteration. Args: cached
/// tokens, KV heads, threads, kernel. Counters: µs of each (float_us, int8_us, widened_us),
/// vs_float = float / int8 time, vs_widened = widened / int8 time. The label names the
/// kernel that ran.
void BM_Int8DecodeVsFloat(benchmark::State& state) {
    const gattn::Index nk = state.range(0), hkv = state.range(1), d = 128;
    set_threads(static_cast<int>(state.range(2)));
    const gattn::Int8Kernel best = state.range(3) == 1 ? gattn::Int8Kernel::AvxVnni : gattn::Int8Kernel::Vnni;
    const Matrix q = Matrix::Random(1, kHeads * d), k = Matrix::Random(nk, hkv * d), v = Matrix::Random(nk, hkv * d);
    struct Codes {
        gattn::RowMatrix<std::int8_t> codes;
        gattn::RowMatrix<float> scales;
    } kc{gattn::RowMatrix<std::int8_t>(nk, hkv * d), gattn::RowMatrix<float>(nk, hkv)}, vc = kc;
    for (gattn::Index r = 0; r < nk; ++r) {
        gattn::quantize_int8_row(k.row(r).data(), hkv, d, kc.codes.row(r).data(), kc.scales.row(r).data());
        gattn::quantize_int8_row(v.row(r).data(), hkv, d, vc.codes.row(r).data(), vc.scales.row(r).data());
    }
    auto view = [&](const Codes& c) {
        return gattn::Int8Rows{c.codes.data(), nk, hkv * d, hkv * d, c.scales.data(), hkv};
    };
    Matrix out(1, kHeads * d), out_int8(1, kHeads * d), out_widened(1, kHeads * d);
    auto int8_call = [&](gattn::Int8Kernel limit, Matrix& o) {
        gattn::set_int8_kernel_limit(limit);
        gattn::scaled_dot_product_attention(q, view(kc), view(vc), {1, kHeads, hkv}, o);
        benchmark::DoNotOptimize(o.data());
    };
    const auto [t_float, t_int8, t_widened] = gattn_bench::time_in_turn(
        state,
        [&] {
            gattn::scaled_dot_product_attention<float>(q, k, v, {1, kHeads, hkv}, out);
            benchmark::DoNotOptimize(out.data());
        },
        [&] { int8_call(best, out_int8); }, [&] { int8_call(gattn::Int8Kernel::WidenedFloat, out_widened); });
    const double n = static_cast<double>(state.iterations());
    state.counters["float_us"] = t_float / n * 1e6;
    state.counters["int8_us"] = t_int8 / n * 1e6;
    state.counters["widened_us"] = t_widened / n * 1e6;
    state.counters["vs_float"] = t_float / t_int8;
    state.counters["vs_widened"] = t_widened / t_int8;
    gattn::set_int8_kernel_limit(best);
    state.SetLabel(gattn::kernel_name(gattn::int8_kernel().kernel));
    gattn::set_int8_kernel_limit(gattn::Int8Kernel::Vnni);
    set_threads(1);
}

/// One decoding step (one query token, 8 query heads, d = 128, float cache) with gattn over
/// token-major [N_k, H_kv·d] keys and values, with hand-written Eigen over them (per query head:
/// logits = K_h·q, softmax, out = V_hᵀ·p, the heads split over the OpenMP threads), and with
/// gattn over head-major copies ([H_kv·N_k, d], HeadMajorRows; ONNX Runtime's cache layout), in
/// turn within every iteration. Args: cached tokens, KV heads, threads. Counters: µs of each,
/// gattn_vs_eigen = Eigen time / gattn time, head_major_speedup = token-major time / head-major
/// time, and each one's roof fraction: (cache bytes / stream bandwidth measured just before) /
/// time.
void BM_DecodeVsEigen(benchmark::State& state) {
    const gattn::Index nk = state.range(0), hkv = state.range(1), d = 128, group = kHeads / hkv;
    set_threads(static_cast<int>(state.range(2)));
    const Matrix q = Matrix::Random(1, kHeads * d), k = Matrix::Random(nk, hkv * d), v = Matrix::Random(nk, hkv * d);
    Matrix out(1, kHeads * d), out_eigen(1, kHeads * d), out_head_major(1, kHeads * d);
    Matrix k_head_major(hkv * nk, d), v_head_major(hkv * nk, d);
    for (gattn::Index g = 0; g < hkv; ++g) {
        k_head_major.middleRows(g * nk, nk) = k.middleCols(g * d, d);
        v_head_major.middleRows(g * nk, nk) = v.middleCols(g * d, d);
    }
    const float scale = 1.0f / std::sqrt(float(d));
    const double bytes = double(2 * nk * hkv * d) * sizeof(float);
    const double bandwidth = gattn_bench::stream_bandwidth(static_cast<std::size_t>(bytes));
    using Strided = Eigen::Map<const Matrix, 0, Eigen::OuterStride<>>;
    const auto [t_gattn, t_eigen, t_head_major] = gattn_bench::time_in_turn(
        state,
        [&] {
            gattn::scaled_dot_product_attention<float>(q, k, v, {1, kHeads, hkv}, out);
            benchmark::DoNotOptimize(out.data());
        },
        [&] {
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
            for (gattn::Index h = 0; h < kHeads; ++h) {
                const gattn::Index g = h / group;
                const Strided kh(k.data() + g * d, nk, d, Eigen::OuterStride<>(hkv * d));
                const Strided vh(v.data() + g * d, nk, d, Eigen::OuterStride<>(hkv * d));
                Eigen::VectorXf logits = kh * (q.row(0).segment(h * d, d).transpose() * scale);
                const float m = logits.maxCoeff();
                logits = (logits.array() - m).exp();
                out_eigen.row(0).segment(h * d, d) = (vh.transpose() * logits).transpose() / logits.sum();
            }
            benchmark::DoNotOptimize(out_eigen.data());
        },
        [&] {
            gattn::scaled_dot_product_attention<float>(q, gattn::HeadMajorRows<float>(k_head_major),
                                                       gattn::HeadMajorRows<float>(v_head_major), {1, kHeads, hkv},
                                                       out_head_major);
            benchmark::DoNotOptimize(out_head_major.data());
        });
    if (out_head_major != out) state.SkipWithError("head-major keys and values gave other bits");
    const double n = static_cast<double>(state.iterations());
    state.counters["gattn_us"] = t_gattn / n * 1e6;
    state.counters["eigen_us"] = t_eigen / n * 1e6;
    state.counters["head_major_us"] = t_head_major / n * 1e6;
    state.counters["gattn_vs_eigen"] = t_eigen / t_gattn;
    state.counters["head_major_speedup"] = t_gattn / t_head_major;
    state.counters["gattn_roof"] = bytes / bandwidth / (t_gattn / n);
    state.counters["eigen_roof"] = bytes / bandwidth / (t_eigen / n);
    state.counters["head_major_roof"] = bytes / bandwidth / (t_head_major / n);
    set_threads(1);
}

/// One decoding step (one query token, 8 query heads, d = 128, float) over the same keys and
/// values held by a KVCache, whose storage is advised into transparent huge pages
/// (cache/huge_pages.hpp), and by plain matrices, in turn within every iteration. Args: cached
/// tokens, KV heads. Counters: µs of each, cache_vs_plain = plain time / cache time, and the
/// cache's huge_page_MiB (0: the system does not use huge pages; then both read small pages).
/// Where the system backs every large allocation with huge pages ("always" in
/// /sys/kernel/mm/transparent_hugepage/enabled) both do, and the ratio is about 1.
void BM_DecodeFromCache(benchmark::State& state) {
    const gattn::Index nk = state.range(0), hkv = state.range(1), d = 128;
    set_threads(1);
    const Matrix q = Matrix::Random(1, kHeads * d), k = Matrix::Random(nk, hkv * d), v = Matrix::Random(nk, hkv * d);
    gattn::KVCache<float> cache(1, nk, hkv, d);
    cache.append(k, v, {nk});
    Matrix out(1, kHeads * d), out_plain(1, kHeads * d);
    const gattn::HeadLayout heads{1, kHeads, hkv};
    const auto [t_cache, t_plain] = gattn_bench::time_in_turn(
        state,
        [&] {
            gattn::scaled_dot_product_attention<float>(q, cache.keys(), cache.values(), heads, out);
            benchmark::DoNotOptimize(out.data());
        },
        [&] {
            gattn::scaled_dot_product_attention<float>(q, k, v, heads, out_plain);
            benchmark::DoNotOptimize(out_plain.data());
        });
    if (!(out.array() == out_plain.array()).all()) state.SkipWithError("the cache and the matrices disagree");
    const double n = static_cast<double>(state.iterations());
    state.counters["cache_us"] = t_cache / n * 1e6;
    state.counters["plain_us"] = t_plain / n * 1e6;
    state.counters["cache_vs_plain"] = t_plain / t_cache;
    state.counters["huge_page_MiB"] = static_cast<double>(cache.huge_page_bytes()) / (1 << 20);
}

/// Accuracy of bf16 SDPA against float64 SDPA on the same bf16 inputs, N(0, 1) entries, one head
/// of d = 128, non-causal (the float64 reference is a plain three-pass softmax per row). Args: N,
/// output (0: bf16, 1: float), kernel (kernel_limit). Counters: NMSE = Σ(out − ref)² / Σ ref²,
/// max |out − ref|, and the same for the float SDPA on the widened inputs (float_*). Run once;
/// not a timing.
void BM_Bf16Accuracy(benchmark::State& state) {
    const gattn::Index n = state.range(0), d = 128;
    const bool float_out = state.range(1) != 0;
    gattn::set_bf16_kernel_limit(kernel_limit(state.range(2)));
    std::mt19937 rng(42);
    std::normal_distribution<float> normal;
    gattn::RowMatrix<gattn::bfloat16> q(n, d), k(n, d), v(n, d);
    for (auto* m : {&q, &k, &v})
        for (gattn::Index i = 0; i < m->size(); ++i) m->data()[i] = gattn::bfloat16(normal(rng));
    const Matrix qf = q.cast<float>(), kf = k.cast<float>(), vf = v.cast<float>();
    Matrix got(n, d), got_float(n, d);
    for (auto _ : state) {
        if (float_out) {
            gattn::scaled_dot_product_attention<gattn::bfloat16, float>(q, k, v, {1, 1, 1}, got);
        } else {
            const gattn::RowMatrix<gattn::bfloat16> out =
                gattn::scaled_dot_product_attention<gattn::bfloat16>(q, k, v, {1, 1, 1});
            got = out.cast<float>();
        }
        gattn::scaled_dot_product_attention<float>(qf, kf, vf, {1, 1, 1}, got_float);
    }
    // float64 reference, row by row.
    const Eigen::MatrixXd kd = kf.cast<double>(), vd = vf.cast<double>();
    const double scale = 1.0 / std::sqrt(double(d));
    double err2 = 0, ref2 = 0, max_err = 0, ferr2 = 0, fmax = 0;
    Eigen::VectorXd logits(n);
    for (gattn::Index i = 0; i < n; ++i) {
        logits.noalias() = kd * (qf.row(i).cast<double>().transpose() * scale);
        const double m = logits.maxCoeff();
        const Eigen::VectorXd p = (logits.array() - m).exp().matrix();
        const Eigen::RowVectorXd ref = (p.transpose() * vd) / p.sum();
        for (gattn::Index c = 0; c < d; ++c) {
            const double e = got(i, c) - ref(c), f = got_float(i, c) - ref(c);
            err2 += e * e;
            ferr2 += f * f;
            ref2 += ref(c) * ref(c);
            max_err = std::max(max_err, std::abs(e));
            fmax = std::max(fmax, std::abs(f));
        }
    }
    state.counters["NMSE"] = err2 / ref2;
    state.counters["max_err"] = max_err;
    state.counters["float_NMSE"] = ferr2 / ref2;
    state.counters["float_max_err"] = fmax;
    state.SetLabel(gattn::kernel_name(gattn::bf16_kernel().kernel));
    gattn::set_bf16_kernel_limit(gattn::Bf16Kernel::Amx);
}

/// Typical hand-written Eigen attention: (Q·Kᵀ)·scale materialised, softmax through
/// broadcasting expressions.
void BM_EigenTypicalSdpa(benchmark::State& state) {
    const gattn::Index n = state.range(0), d = state.range(1);
    Inputs in(n, n, d);
    const float scale = 1.0f / std::sqrt(float(d));
    for (auto _ : state) {
        for (gattn::Index h = 0; h < kHeads; ++h) {
            Matrix s = (in.q.middleCols(h * d, d) * in.k.middleCols(h * d, d).transpose()) * scale;
            Eigen::VectorXf m = s.rowwise().maxCoeff();
            Matrix e = (s.colwise() - m).array().exp().matrix();
            Eigen::VectorXf sum = e.rowwise().sum();
            Matrix p = e.array().colwise() / sum.array();
            in.out.middleCols(h * d, d) = p * in.v.middleCols(h * d, d);
        }
        benchmark::DoNotOptimize(in.out.data());
        benchmark::ClobberMemory();
    }
    state.counters["FLOP/s"] =
        benchmark::Counter(attention_flops(n, n, d, false), benchmark::Counter::kIsIterationInvariantRate);
}

/// Eigen GEMM with the same FLOP count as one head of full attention (N×d times d×N, then
/// N×N times N×d), repeated for every head: the practical roof of a GEMM-based kernel.
void BM_EigenGemmRoof(benchmark::State& state) {
    const gattn::Index n = state.range(0), d = state.range(1);
    const Matrix a = Matrix::Random(n, d), b = Matrix::Random(d, n);
    const Matrix p = Matrix::Random(n, n), v = Matrix::Random(n, d);
    Matrix s(n, n), o(n, d);
    for (auto _ : state) {
        for (gattn::Index h = 0; h < kHeads; ++h) {
            s.noalias() = a * b;
            o.noalias() = p * v;
        }
        benchmark::DoNotOptimize(s.data());
        benchmark::DoNotOptimize(o.data());
        benchmark::ClobberMemory();
    }
    state.counters["FLOP/s"] =
        benchmark::Counter(attention_flops(n, n, d, false), benchmark::Counter::kIsIterationInvariantRate);
}

/// A field of /proc/self/status in MiB (Linux), or −1.
double status_mib(const char* field) {
    std::FILE* f = std::fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    double kib = -1;
    const std::size_t len = std::strlen(field);
    while (std::fgets(line, sizeof line, f))
        if (std::strncmp(line, field, len) == 0 && line[len] == ':') kib = std::atof(line + len + 1);
    std::fclose(f);
    return kib < 0 ? -1 : kib / 1024.0;
}

/// One causal head of N = 65,536 tokens, d = 128. Reports the resident size with the inputs and
/// output allocated and touched (4 × 32 MiB) and the peak during the run: the difference is
/// gattn's extra memory (N² scores would be 16 GiB). The peak is reset first through
/// /proc/self/clear_refs so that earlier benchmarks do not count.
void BM_GattnLongContext(benchmark::State& state) {
    const gattn::Index n = 65536, d = 128;
    set_threads(static_cast<int>(state.range(0)));
    const Matrix q = Matrix::Random(n, d), k = Matrix::Random(n, d), v = Matrix::Random(n, d);
    Matrix out = Matrix::Zero(n, d);
    gattn::SdpaOptions<float> opt;
    opt.mask.causal = true;
    if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
        std::fputs("5", f);  // resets the peak resident size (VmHWM)
        std::fclose(f);
    }
    const double before = status_mib("VmRSS");
    for (auto _ : state) {
        gattn::scaled_dot_product_attention<float>(q, k, v, {1, 1, 1}, out, opt);
        benchmark::DoNotOptimize(out.data());
    }
    state.counters["RSS_before_MiB"] = before;
    state.counters["peak_RSS_MiB"] = status_mib("VmHWM");
    state.counters["FLOP/s"] = benchmark::Counter(4.0 * n * n * d / 2, benchmark::Counter::kIsIterationInvariantRate);
    set_threads(1);
}

void prefill_args(benchmark::internal::Benchmark* b) {
    for (int d : {64, 128, 256})
        for (int n : {128, 512, 2048, 8192})
            for (int causal : {0, 1})
                for (int threads : {1, 2}) b->Args({n, n, d, causal, threads});
}

void decode_args(benchmark::internal::Benchmark* b) {
    for (int nk : {1024, 8192, 32768})
        for (int threads : {1, 2}) b->Args({1, nk, 128, 0, threads});
}

void baseline_args(benchmark::internal::Benchmark* b) {
    for (int d : {64, 128, 256})
        for (int n : {128, 512, 2048}) b->Args({n, d, 0})->Args({n, d, 1});
    b->Args({8192, 128, 0})->Args({8192, 128, 1});  // 256 MiB of scores per head
}

/// The variants BM_VariantCost compares with plain SDPA.
enum class Variant { Sinks, Softcap, Alibi, TopLeft, SoftcapAlibiSinks };
const char* variant_name(Variant v) {
    switch (v) {
        case Variant::Sinks: return "sinks";
        case Variant::Softcap: return "softcap";
        case Variant::Alibi: return "alibi";
        case Variant::TopLeft: return "top_left";
        case Variant::SoftcapAlibiSinks: return "softcap+alibi+sinks";
    }
    return "?";
}

/// Plain SDPA and one variant in turn, one thread. Args: variant, N_q, N_k, d, causal, bf16.
/// Counter cost = variant / plain − 1 (0.05: the variant takes 5 % longer).
void BM_VariantCost(benchmark::State& state) {
    const auto variant = static_cast<Variant>(state.range(0));
    const gattn::Index nq = state.range(1), nk = state.range(2), d = state.range(3);
    const bool causal = state.range(4) != 0, narrow = state.range(5) != 0;
    set_threads(1);
    Inputs in(nq, nk, d);
    gattn::SdpaOptions<float> plain, with;
    plain.mask.causal = with.mask.causal = causal;
    switch (variant) {
        case Variant::Sinks: with.sinks.assign(kHeads, 0.5f); break;
        case Variant::Softcap: with.logit_softcap = 50.0; break;  // Gemma 2's cap
        case Variant::Alibi: with.alibi_slopes = gattn::alibi_slopes<float>(kHeads); break;
        case Variant::TopLeft: with.mask.alignment = gattn::CausalAlignment::TopLeft; break;
        case Variant::SoftcapAlibiSinks:
            with.sinks.assign(kHeads, 0.5f);
            with.logit_softcap = 50.0;
            with.alibi_slopes = gattn::alibi_slopes<float>(kHeads);
            break;
    }
    const gattn::HeadLayout heads{1, kHeads, kHeads};
    using Bf = gattn::RowMatrix<gattn::bfloat16>;
    const Bf q16 = in.q.cast<gattn::bfloat16>(), k16 = in.k.cast<gattn::bfloat16>(), v16 = in.v.cast<gattn::bfloat16>();
    Bf out16(in.out.rows(), in.out.cols());
    auto run = [&](const gattn::SdpaOptions<float>& o) {
        return [&, o] {
            if (narrow)
                gattn::scaled_dot_product_attention<gattn::bfloat16>(q16, k16, v16, heads, out16, o);
            else
                gattn::scaled_dot_product_attention<float>(in.q, in.k, in.v, heads, in.out, o);
        };
    };
    const auto [t_plain, t_variant] = gattn_bench::time_in_turn(state, run(plain), run(with));
    state.counters["cost"] = t_variant / t_plain - 1.0;
    state.counters["plain_ms"] = 1e3 * t_plain / double(state.iterations());
    state.counters["variant_ms"] = 1e3 * t_variant / double(state.iterations());
    state.SetLabel(variant_name(variant));
}

void variant_args(benchmark::internal::Benchmark* b) {
    for (int v = 0; v <= static_cast<int>(Variant::SoftcapAlibiSinks); ++v)
        for (int narrow : {0, 1}) {
            b->Args({v, 2048, 2048, 128, 1, narrow});  // prefill, causal
            b->Args({v, 1, 16384, 128, 0, narrow});    // decoding against 16k keys
        }
}

BENCHMARK(BM_GattnSdpa)
    ->Apply(prefill_args)
    ->ArgNames({"Nq", "Nk", "d", "causal", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_GattnSdpa)
    ->Name("BM_GattnDecode")
    ->Apply(decode_args)
    ->ArgNames({"Nq", "Nk", "d", "causal", "threads"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_GattnLongContext)->Arg(2)->ArgNames({"threads"})->Iterations(1)->Unit(benchmark::kSecond)->UseRealTime();
BENCHMARK(BM_GattnVsCareful)
    ->Args({512, 128, 0})
    ->Args({512, 128, 1})
    ->Args({2048, 128, 0})
    ->Args({2048, 128, 1})
    ->ArgNames({"N", "d", "causal"})
    ->MinTime(3.0)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_SdpaBackwardBf16)
    ->ArgsProduct({{2048}, {64, 128}, {0, 1}, {1, 2}})
    ->ArgNames({"N", "d", "causal", "threads"})
    ->MinTime(0.5)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_SdpaBackward)
    ->ArgsProduct({{512, 2048, 8192}, {64, 128}, {0, 1}, {1, 2}})
    ->ArgNames({"N", "d", "causal", "threads"})
    ->MinTime(0.5)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_NarrowVsFloat, gattn::bfloat16)
    ->Name("BM_Bf16VsFloat")
    ->ArgsProduct({{512, 2048, 8192}, {0, 1}, {1}, {0}})
    ->ArgsProduct({{2048}, {0, 1}, {2}, {0}})
    ->ArgsProduct({{2048}, {0, 1}, {1}, {1, 2}})
    ->ArgNames({"N", "causal", "threads", "kernel"})
    ->MinTime(2.0)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_NarrowVsFloat, gattn::half)
    ->Name("BM_Fp16VsFloat")
    ->ArgsProduct({{2048}, {0, 1}, {1}, {0}})
    ->ArgNames({"N", "causal", "threads", "kernel"})
    ->MinTime(2.0)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_NarrowDecodeVsFloat, gattn::bfloat16)
    ->Name("BM_Bf16DecodeVsFloat")
    ->ArgsProduct({{8192, 32768}, {2, 8}, {1, 2}})
    ->ArgNames({"Nk", "kv_heads", "threads"})
    ->MinTime(1.0)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_NarrowDecodeVsFloat, gattn::half)
    ->Name("BM_Fp16DecodeVsFloat")
    ->ArgsProduct({{8192, 32768}, {2, 8}, {1}})
    ->ArgNames({"Nk", "kv_heads", "threads"})
    ->MinTime(1.0)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_Int8DecodeVsFloat)
    ->ArgsProduct({{8192, 32768}, {2, 8}, {1}, {0, 1}})
    ->ArgNames({"Nk", "kv_heads", "threads", "kernel"})
    ->MinTime(1.0)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_DecodeFromCache)
    ->ArgsProduct({{8192, 32768}, {2, 8}})
    ->ArgNames({"Nk", "kv_heads"})
    ->MinTime(1.0)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_DecodeVsEigen)
    ->ArgsProduct({{8192, 32768}, {2, 8}, {1, 2}})
    ->ArgNames({"Nk", "kv_heads", "threads"})
    ->MinTime(1.0)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_Bf16Accuracy)
    ->ArgsProduct({{2048, 8192}, {0, 1}, {0, 1}})
    ->ArgNames({"N", "float_out", "kernel"})
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_VariantCost)
    ->Apply(variant_args)
    ->ArgNames({"variant", "Nq", "Nk", "d", "causal", "bf16"})
    ->MinTime(2.0)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_EigenCarefulSdpa)
    ->Apply(baseline_args)
    ->ArgNames({"N", "d", "causal"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_EigenTypicalSdpa)
    ->Args({512, 128})
    ->Args({2048, 128})
    ->ArgNames({"N", "d"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_EigenGemmRoof)
    ->Args({512, 128})
    ->Args({2048, 128})
    ->Args({2048, 64})
    ->Args({2048, 256})
    ->ArgNames({"N", "d"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) { return gattn_bench::run(argc, argv); }
