// What a gate costs: the same GatedMultiHeadAttention layer with and without each gate variant,
// side by side in one run, at realistic sizes (D = 2048, 16 query heads, 2 KV heads,
// head_dim 128, causal). Counters: tokens/s, and the gate's share of the layer's parameters.
// Variants "Sinks" and "G1ElementwiseSinks": learned attention sinks (gpt-oss) instead of and
// beside the gate, measured like for like.
// The gate's two parts alone: its projection GEMM and the fused activation-and-multiply pass;
// BM_GateCostPaired runs the ungated layer, the gated layer and the projection in turn.
// BM_DecodeStep: one decoding step of each variant against a KV cache of 1k or 4k tokens.
// BM_ProjectionBf16: the layer's fused input projection (Q, K, V and gate: 2048 -> 4608) and
// its output projection (2048 -> 2048) as Eigen's float GEMM, gattn's header-only bf16
// PackedLinear (its fastest kernel here and, where that is AMX, also the AVX512-BF16 one) and,
// when oneDNN is installed (found by CMake), oneDNN's bf16 matmul, in turn within every
// iteration. BM_LayerBf16VsFloat: the layer in float and bf16 (and bf16 with oneDNN's
// projections in GATTN_WITH_ONEDNN builds).
// BM_LayerBackward: the training step of one layer (D = 2048, 16 heads, 2 KV heads, head_dim
// 128, causal, plain or G1 elementwise): forward, forward_train and backward in turn within every iteration; counter
// bwd_vs_fwd = backward time / forward time, and the bytes forward_train keeps.
// Threads: OMP_NUM_THREADS (one core: OMP_NUM_THREADS=1).
//
// Run: build/bench/bench/bench_gated_layer --benchmark_counters_tabular=true
// (configure with -DGATTN_ARCH_FLAGS=-march=native for the machine's widest SIMD).

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <chrono>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <gattn/gattn.hpp>
#include <gattn/ops/packed_linear.hpp>

#if defined(GATTN_BENCH_ONEDNN)
#include <dnnl.hpp>
#endif

namespace {

using gattn::GateSpec;

struct Variant {
    const char* name;
    GateSpec gate;
    bool sinks = false;  ///< learned attention sinks (gpt-oss), the other answer to the sink
};

std::vector<Variant> variants() {
    using P = gattn::GatePosition;
    auto at = [](P p, gattn::GateGranularity g = gattn::GateGranularity::Elementwise) {
        GateSpec s;
        s.position = p;
        s.granularity = g;
        return s;
    };
    GateSpec fused = GateSpec::g1_elementwise(gattn::GateLayout::PerHeadInterleaved);
    GateSpec silu = GateSpec::g1_elementwise();
    silu.activation = gattn::GateActivation::SiLU;
    return {{"Ungated", GateSpec{}},
            {"G1Elementwise", GateSpec::g1_elementwise()},
            {"G1ElementwiseFusedQProj", fused},
            {"G1Headwise", GateSpec::g1_headwise()},
            {"G1ElementwiseSiLU", silu},
            {"G2Elementwise", at(P::G2)},
            {"G3Elementwise", at(P::G3)},
            {"G4Elementwise", at(P::G4)},
            {"G5Elementwise", at(P::G5)},
            {"Sinks", GateSpec{}, true},
            {"G1ElementwiseSinks", GateSpec::g1_elementwise(), true}};
}

gattn::AttentionConfig realistic_config(const GateSpec& gate, bool sinks = false) {
    gattn::AttentionConfig c;
    c.sinks = sinks;
    c.d_model = 2048;
    c.num_heads = 16;
    c.num_kv_heads = 2;
    c.head_dim = 128;
    c.causal = true;
    c.gate = gate;
    return c;
}

void BM_Layer(benchmark::State& state, Variant v) {
    const gattn::Index seq_len = state.range(0);
    const auto config = realistic_config(v.gate, v.sinks);
    const gattn::GatedMultiHeadAttention<float> layer(config, gattn::make_random_weights<float>(config, 1));
    const gattn::RowMatrix<float> x = gattn::RowMatrix<float>::Random(seq_len, config.d_model);
    gattn::RowMatrix<float> out(seq_len, config.d_model);
    for (auto _ : state) {
        layer.forward(x, 1, out);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
    }
    state.counters["tokens/s"] = benchmark::Counter(double(seq_len), benchmark::Counter::kIsIterationInvariantRate);
    state.counters["gate_params"] = double(gattn::gate_parameter_count(config));
    state.SetLabel(gattn::simd::arch_name());
}

/// The fused gate pass alone (activation and multiply over [N, H·d]) as the layer runs it, row
/// by row over the OpenMP threads, to compare with the layer. The pass works in place, so U is
/// restored (untimed) before each iteration: gating the same U again and again would shrink it
/// into subnormal numbers, which multiply at a fraction of the normal speed on many CPUs.
void BM_FusedGatePass(benchmark::State& state) {
    const gattn::Index seq_len = state.range(0), width = 16 * 128;
    const gattn::RowMatrix<float> u0 = gattn::RowMatrix<float>::Random(seq_len, width);
    const gattn::RowMatrix<float> z = gattn::RowMatrix<float>::Random(seq_len, width);
    gattn::RowMatrix<float> u(seq_len, width);
    for (auto _ : state) {
        state.PauseTiming();
        u = u0;
        state.ResumeTiming();
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
        for (gattn::Index r = 0; r < seq_len; ++r)
            gattn::apply_gate(gattn::GateActivation::Sigmoid, gattn::GateCombine::Multiplicative, u.data() + r * width,
                              z.data() + r * width, static_cast<const float*>(nullptr), static_cast<float*>(nullptr),
                              static_cast<std::size_t>(width));
        benchmark::DoNotOptimize(u.data());
        benchmark::ClobberMemory();
    }
    state.counters["elements/s"] = benchmark::Counter(double(u.size()), benchmark::Counter::kIsIterationInvariantRate);
}

/// The gate projection alone, X [N, D] times W_gᵀ [D, H·d_v] with Eigen, the GEMM the layer runs
/// for the gate logits: a gated layer should cost the ungated one plus this and the gate pass.
void BM_GateProjection(benchmark::State& state) {
    const gattn::Index seq_len = state.range(0), d_model = 2048, width = 16 * 128;
    const gattn::RowMatrix<float> x = gattn::RowMatrix<float>::Random(seq_len, d_model);
    const gattn::RowMatrix<float> w = gattn::RowMatrix<float>::Random(width, d_model);
    gattn::RowMatrix<float> z(seq_len, width);
    for (auto _ : state) {
        z.noalias() = x * w.transpose();
        benchmark::DoNotOptimize(z.data());
        benchmark::ClobberMemory();
    }
    state.counters["FLOP/s"] = benchmark::Counter(2.0 * double(seq_len) * double(d_model) * double(width),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}

#if defined(GATTN_BENCH_ONEDNN)
/// oneDNN's matmul y = x·wᵀ, bf16 x and w, float y, weights reordered once into the layout
/// oneDNN picks for this CPU.
struct OneDnnMatmul {
    dnnl::engine engine{dnnl::engine::kind::cpu, 0};
    dnnl::stream stream{engine};
    dnnl::matmul prim;
    dnnl::memory src, weights, dst;
    OneDnnMatmul(const gattn::RowMatrix<gattn::bfloat16>& x, const gattn::RowMatrix<gattn::bfloat16>& w,
                 gattn::RowMatrix<float>& y) {
        using dt = dnnl::memory::data_type;
        using tag = dnnl::memory::format_tag;
        const dnnl::memory::dim n = x.rows(), k = x.cols(), o = w.rows();
        const dnnl::memory::desc src_md({n, k}, dt::bf16, tag::ab), dst_md({n, o}, dt::f32, tag::ab);
        const dnnl::memory::desc w_user({k, o}, dt::bf16, tag::ba), w_any({k, o}, dt::bf16, tag::any);
        const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, w_any, dst_md), engine);
        prim = dnnl::matmul(pd);
        src = dnnl::memory(src_md, engine, const_cast<gattn::bfloat16*>(x.data()));
        dst = dnnl::memory(dst_md, engine, y.data());
        dnnl::memory user(w_user, engine, const_cast<gattn::bfloat16*>(w.data()));
        weights = dnnl::memory(pd.weights_desc(), engine);
        dnnl::reorder(user, weights).execute(stream, user, weights);
        stream.wait();
        implementation = pd.impl_info_str();
    }
    void run() {
        prim.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, dst}});
        stream.wait();
    }
    std::string implementation;
};
#endif

/// A projection of the layer (D = 2048 -> `width`: 4608 for the fused input projection, Q 2048
/// + gate 2048 + K 256 + V 256; 2048 for the output projection) for `rows` rows: Eigen's float
/// GEMM (gattn's float layers), gattn's bf16 PackedLinear with its fastest kernel here (float x
/// rounded to bf16 inside the call), the same with its AVX512-BF16 kernel when the fastest is
/// AMX, and, when built with oneDNN, oneDNN's bf16 matmul (x given in bf16), in turn within
/// every iteration. Counters: GFLOP/s of each; bf16_vs_float = float time / PackedLinear time,
/// bf16_vs_onednn = oneDNN time / PackedLinear time, bf16_vs_avx512bf16 = AVX512-BF16 kernel
/// time / PackedLinear time. The label names the kernels in that order.
void BM_ProjectionBf16(benchmark::State& state) {
    using Clock = std::chrono::steady_clock;
    const gattn::Index rows = state.range(0), d_model = 2048, width = state.range(1);
    const gattn::RowMatrix<float> x = gattn::RowMatrix<float>::Random(rows, d_model);
    const gattn::RowMatrix<float> w = gattn::RowMatrix<float>::Random(width, d_model) * 0.02f;
    const gattn::RowMatrix<gattn::bfloat16> w16 = w.cast<gattn::bfloat16>(), x16 = x.cast<gattn::bfloat16>();
    const gattn::Vector<float> no_bias;
    const gattn::PackedLinear<gattn::bfloat16> packed(w16, no_bias, gattn::LinearBackend::HeaderOnly);
    std::optional<gattn::PackedLinear<gattn::bfloat16>> packed_avx;
    if (packed.kernel() == gattn::Bf16Kernel::Amx) {
        gattn::set_bf16_kernel_limit(gattn::Bf16Kernel::Avx512Bf16);
        packed_avx.emplace(w16, no_bias, gattn::LinearBackend::HeaderOnly);
        gattn::set_bf16_kernel_limit(gattn::Bf16Kernel::Amx);
    }
    gattn::RowMatrix<float> y_float(rows, width), y_bf16(rows, width), y_avx(rows, width), y_onednn(rows, width);
    std::string label = packed.describe();
    if (packed_avx) label = gattn::kernel_name(packed.kernel()) + std::string(" | ") + packed_avx->describe();
#if defined(GATTN_BENCH_ONEDNN)
    OneDnnMatmul onednn(x16, w16, y_onednn);
    label += " | oneDNN " + onednn.implementation;
#endif
    state.SetLabel(label);
    double t_float = 0, t_bf16 = 0, t_avx = 0, t_onednn = 0;
    for (auto _ : state) {
        const auto t0 = Clock::now();
        gattn::detail::linear<float>(x, w, no_bias, y_float);
        benchmark::ClobberMemory();
        const auto t1 = Clock::now();
        packed.forward<float, float>(x, y_bf16);
        benchmark::ClobberMemory();
        const auto t2 = Clock::now();
        if (packed_avx) packed_avx->forward<float, float>(x, y_avx);
        benchmark::ClobberMemory();
        const auto t3 = Clock::now();
#if defined(GATTN_BENCH_ONEDNN)
        onednn.run();
        benchmark::ClobberMemory();
#endif
        const auto t4 = Clock::now();
        t_float += std::chrono::duration<double>(t1 - t0).count();
        t_bf16 += std::chrono::duration<double>(t2 - t1).count();
        t_avx += std::chrono::duration<double>(t3 - t2).count();
        t_onednn += std::chrono::duration<double>(t4 - t3).count();
    }
    const double flops = 2.0 * double(rows) * double(d_model) * double(width) * double(state.iterations());
    state.counters["float_GFLOP/s"] = flops / t_float / 1e9;
    state.counters["bf16_GFLOP/s"] = flops / t_bf16 / 1e9;
    state.counters["bf16_vs_float"] = t_float / t_bf16;
    if (packed_avx) {
        state.counters["avx512bf16_GFLOP/s"] = flops / t_avx / 1e9;
        state.counters["bf16_vs_avx512bf16"] = t_avx / t_bf16;
    }
#if defined(GATTN_BENCH_ONEDNN)
    state.counters["onednn_GFLOP/s"] = flops / t_onednn / 1e9;
    state.counters["bf16_vs_onednn"] = t_onednn / t_bf16;
#endif
}

/// The G1-gated layer (D = 2048, 16 heads, 2 KV heads, causal) in float and with bf16 weights
/// (float activations), in turn within every iteration: bf16 with the header-only projections
/// and, in builds with GATTN_WITH_ONEDNN, bf16 with oneDNN's. Args: N, head_dim (128, or
/// Qwen3-Next's 256). Counters: ms of each, speedup = float time / header-only bf16 time and
/// speedup_onednn = float time / oneDNN bf16 time; the label names the kernels.
void BM_LayerBf16VsFloat(benchmark::State& state) {
    using Layer16 = gattn::GatedMultiHeadAttention<gattn::bfloat16>;
    const gattn::Index seq_len = state.range(0);
    gattn::AttentionConfig config = realistic_config(GateSpec::g1_elementwise());
    config.head_dim = state.range(1);
    const auto weights = gattn::make_random_weights<float>(config, 1);
    const auto weights16 = weights.cast<gattn::bfloat16>();
    const gattn::GatedMultiHeadAttention<float> layer(config, weights);
    gattn::set_default_linear_backend(gattn::LinearBackend::HeaderOnly);
    const Layer16 layer16(config, weights16);
    std::optional<Layer16> layer_onednn;
    if (gattn::compiled_with_onednn()) {
        gattn::set_default_linear_backend(gattn::LinearBackend::OneDnn);
        layer_onednn.emplace(config, weights16);
    }
    gattn::set_default_linear_backend(gattn::LinearBackend::Default);
    const gattn::RowMatrix<float> x = gattn::RowMatrix<float>::Random(seq_len, config.d_model);
    gattn::RowMatrix<float> y(seq_len, config.d_model), y16(seq_len, config.d_model);
    using Clock = std::chrono::steady_clock;
    double t_float = 0, t_bf16 = 0, t_onednn = 0;
    for (auto _ : state) {
        const auto t0 = Clock::now();
        layer.forward(x, 1, y);
        benchmark::ClobberMemory();
        const auto t1 = Clock::now();
        layer16.forward(x, 1, y16);
        benchmark::ClobberMemory();
        const auto t2 = Clock::now();
        if (layer_onednn) layer_onednn->forward(x, 1, y16);
        benchmark::ClobberMemory();
        const auto t3 = Clock::now();
        t_float += std::chrono::duration<double>(t1 - t0).count();
        t_bf16 += std::chrono::duration<double>(t2 - t1).count();
        t_onednn += std::chrono::duration<double>(t3 - t2).count();
    }
    const double n = static_cast<double>(state.iterations());
    state.counters["float_ms"] = t_float / n * 1e3;
    state.counters["bf16_ms"] = t_bf16 / n * 1e3;
    state.counters["speedup"] = t_float / t_bf16;
    std::string label = gattn::kernel_name(gattn::bf16_kernel().kernel);
    if (layer_onednn) {
        state.counters["onednn_ms"] = t_onednn / n * 1e3;
        state.counters["speedup_onednn"] = t_float / t_onednn;
        label += " | projections: oneDNN";
    }
    state.SetLabel(label);
}

/// The gate's cost read off one benchmark: the ungated layer, the G1 elementwise gated layer and
/// the gate projection GEMM alone run in turn within every iteration (same state of a shared
/// machine for all three). Counters in ms per forward, and gated / (ungated + projection): at
/// most 1 when a gate costs no more than its projection (the gate itself is applied inside
/// SDPA). S: the weights' storage (float, or bf16 with float activations, the projection then
/// a PackedLinear as the layer's own). Threads: OMP_NUM_THREADS.
template <class S>
void BM_GateCostPaired(benchmark::State& state) {
    const gattn::Index seq_len = state.range(0);
    const auto plain_config = realistic_config(GateSpec{});
    const auto gated_config = realistic_config(GateSpec::g1_elementwise());
    const auto gated_weights = gattn::make_random_weights<float>(gated_config, 1);
    const gattn::GatedMultiHeadAttention<S> plain(plain_config,
                                                  gattn::make_random_weights<float>(plain_config, 1).cast<S>());
    const gattn::GatedMultiHeadAttention<S> gated(gated_config, gated_weights.cast<S>());
    constexpr bool kFloat = std::is_same_v<S, float>;
    // The gate projection alone: Eigen's GEMM for float weights, else packed as the layer packs it.
    const auto gate_proj = [&] {
        if constexpr (kFloat)
            return gated_weights.gate_proj_weight.transpose();
        else
            return gattn::PackedLinear<S>(gated_weights.gate_proj_weight.template cast<S>());
    }();
    const gattn::RowMatrix<float> x = gattn::RowMatrix<float>::Random(seq_len, plain_config.d_model);
    gattn::RowMatrix<float> out(seq_len, plain_config.d_model), z(seq_len, gated_weights.gate_proj_weight.rows());
    using Clock = std::chrono::steady_clock;
    double t_plain = 0, t_gated = 0, t_projection = 0;
    for (auto _ : state) {
        const auto t0 = Clock::now();
        plain.forward(x, 1, out);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
        const auto t1 = Clock::now();
        gated.forward(x, 1, out);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
        const auto t2 = Clock::now();
        if constexpr (kFloat)
            z.noalias() = x * gate_proj;
        else
            gate_proj.template forward<float, float>(x, z);
        benchmark::DoNotOptimize(z.data());
        benchmark::ClobberMemory();
        const auto t3 = Clock::now();
        t_plain += std::chrono::duration<double>(t1 - t0).count();
        t_gated += std::chrono::duration<double>(t2 - t1).count();
        t_projection += std::chrono::duration<double>(t3 - t2).count();
    }
    const double n = static_cast<double>(state.iterations());
    state.counters["ungated_ms"] = 1e3 * t_plain / n;
    state.counters["gated_ms"] = 1e3 * t_gated / n;
    state.counters["projection_ms"] = 1e3 * t_projection / n;
    state.counters["gated/(ungated+proj)"] = t_gated / (t_plain + t_projection);
    std::string label = gattn::simd::arch_name();
    if constexpr (!kFloat)
        label += std::string(" | SDPA ") + gattn::kernel_name(gattn::bf16_kernel().kernel) + " | " +
                 gate_proj.describe();
    state.SetLabel(label);
}

/// One decoding step (one new token per sequence) of the layer with a KV cache already holding
/// `cached` tokens per sequence (random keys and values), rolled back after each step.
/// Args: cached tokens, sequences.
void BM_DecodeStep(benchmark::State& state, Variant v) {
    const gattn::Index cached = state.range(0), batch = state.range(1);
    const auto config = realistic_config(v.gate, v.sinks);
    const gattn::GatedMultiHeadAttention<float> layer(config, gattn::make_random_weights<float>(config, 1));
    auto cache = layer.make_cache(batch, cached + 1);
    const gattn::Index kv = config.num_kv_heads * config.head_dim;
    cache.append(gattn::RowMatrix<float>::Random(batch * cached, kv),
                 gattn::RowMatrix<float>::Random(batch * cached, kv),
                 std::vector<gattn::Index>(static_cast<std::size_t>(batch), cached));
    const std::vector<gattn::Index> lengths = cache.lengths();
    const gattn::RowMatrix<float> x = gattn::RowMatrix<float>::Random(batch, config.d_model);
    gattn::RowMatrix<float> out(batch, config.d_model);
    for (auto _ : state) {
        layer.forward(x, cache, out);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
        cache.truncate(lengths);
    }
    state.counters["tokens/s"] = benchmark::Counter(double(batch), benchmark::Counter::kIsIterationInvariantRate);
    state.SetLabel(gattn::simd::arch_name());
}

/// forward, forward_train and backward of one layer in turn within every iteration (Args: N,
/// gated). Counters in ms, bwd_vs_fwd = backward / forward, (forward_train + backward) /
/// forward, and the bytes forward_train saved.
void BM_LayerBackward(benchmark::State& state) {
    const gattn::Index seq_len = state.range(0);
    const gattn::AttentionConfig config = realistic_config(state.range(1) ? GateSpec::g1_elementwise() : GateSpec{});
    const gattn::GatedMultiHeadAttention<float> layer(config, gattn::make_random_weights<float>(config, 1));
    const gattn::RowMatrix<float> x = gattn::RowMatrix<float>::Random(seq_len, config.d_model);
    const gattn::RowMatrix<float> d_y = gattn::RowMatrix<float>::Random(seq_len, config.d_model);
    gattn::RowMatrix<float> out(seq_len, config.d_model), d_x(seq_len, config.d_model);
    gattn::ForwardActivations<float> saved;
    gattn::AttentionWeights<float> grads;
    using Clock = std::chrono::steady_clock;
    double t_forward = 0, t_train = 0, t_backward = 0;
    for (auto _ : state) {
        const auto t0 = Clock::now();
        layer.forward(x, 1, out);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
        const auto t1 = Clock::now();
        layer.forward_train(x, 1, out, saved);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
        const auto t2 = Clock::now();
        layer.backward(x, saved, d_y, grads, d_x);
        benchmark::DoNotOptimize(d_x.data());
        benchmark::ClobberMemory();
        const auto t3 = Clock::now();
        t_forward += std::chrono::duration<double>(t1 - t0).count();
        t_train += std::chrono::duration<double>(t2 - t1).count();
        t_backward += std::chrono::duration<double>(t3 - t2).count();
    }
    const double n = static_cast<double>(state.iterations());
    state.counters["forward_ms"] = 1e3 * t_forward / n;
    state.counters["forward_train_ms"] = 1e3 * t_train / n;
    state.counters["backward_ms"] = 1e3 * t_backward / n;
    state.counters["bwd_vs_fwd"] = t_backward / t_forward;
    state.counters["step_vs_fwd"] = (t_train + t_backward) / t_forward;
    state.counters["saved_MiB"] = double(saved.bytes()) / (1 << 20);
    state.SetLabel(gattn::simd::arch_name());
}

const bool registered = [] {
    for (const auto& v : variants())
        benchmark::RegisterBenchmark((std::string("BM_DecodeStep/") + v.name).c_str(), BM_DecodeStep, v)
            ->Args({1024, 1})
            ->Args({4096, 1})
            ->Args({4096, 4})
            ->ArgNames({"cached", "batch"})
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
    for (const auto& v : variants())
        benchmark::RegisterBenchmark((std::string("BM_Layer/") + v.name).c_str(), BM_Layer, v)
            ->Arg(512)
            ->Arg(1024)
            ->Arg(2048)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
    benchmark::RegisterBenchmark("BM_FusedGatePass", BM_FusedGatePass)
        ->Arg(512)
        ->Arg(2048)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("BM_GateCostPaired", BM_GateCostPaired<float>)
        ->Arg(512)
        ->Arg(2048)
        ->MinTime(3.0)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("BM_GateCostPairedBf16", BM_GateCostPaired<gattn::bfloat16>)
        ->Arg(512)
        ->Arg(2048)
        ->MinTime(3.0)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("BM_LayerBf16VsFloat", BM_LayerBf16VsFloat)
        ->Args({2048, 128})
        ->Args({2048, 256})
        ->Args({512, 128})
        ->ArgNames({"N", "head_dim"})
        ->MinTime(2.0)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("BM_ProjectionBf16", BM_ProjectionBf16)
        ->ArgsProduct({{1, 16, 512, 2048}, {4608, 2048}})
        ->ArgNames({"rows", "width"})
        ->MinTime(1.0)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("BM_GateProjection", BM_GateProjection)
        ->Arg(512)
        ->Arg(1024)
        ->Arg(2048)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("BM_LayerBackward", BM_LayerBackward)
        ->ArgsProduct({{512, 2048}, {0, 1}})
        ->ArgNames({"N", "gated"})
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    return true;
}();

}  // namespace

int main(int argc, char** argv) { return gattn_bench::run(argc, argv); }
