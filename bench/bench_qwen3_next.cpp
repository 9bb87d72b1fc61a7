// Decoding with Qwen3-Next's gated full-attention layer at the real model's shapes
// (hidden 2048, 16 query heads, 2 KV heads, head_dim 256, partial RoPE 0.25; random weights):
// one token per step against KV caches of 1k–32k tokens, for one sequence and for a batch of 4
// decoded together (one row each). Counters steps/s and tokens/s. BM_Qwen3NextDecodeStep/...
// runs the float layer; BM_Qwen3NextDecodeStepBf16 the same layer with bf16 weights and cache
// (float activations), and the label names the bf16 kernel. BM_DecodeRoof/<storage>/... sets one
// step's time against the time its bytes take to stream from memory (counter roof_fraction),
// for one sequence over 1k–32k cached tokens; int8 is the float layer with an int8 KV cache.
// BM_DecodeAttention/<cache>/... times SDPA alone over the cache (one query token, 16 heads,
// 2 KV heads, d = 256) for float, bf16 and int8 caches side by side (int8 with its integer
// products and with the codes widened to float).
//
// Run: build/bench/bench/bench_qwen3_next --benchmark_counters_tabular=true

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <gattn/gattn.hpp>
#include <gattn/simd/cpu.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using Matrix = gattn::RowMatrix<float>;

gattn::Qwen3NextConfig real_config() {
    gattn::Qwen3NextConfig c;
    c.hidden_size = 2048;
    c.num_attention_heads = 16;
    c.num_key_value_heads = 2;
    c.head_dim = 256;
    c.partial_rotary_factor = 0.25;
    c.rope_theta = 10000000.0;
    return c;
}

gattn::Qwen3NextAttentionWeights<float> random_weights(const gattn::Qwen3NextConfig& c) {
    gattn::Qwen3NextAttentionWeights<float> w;
    const float s = 1.0f / std::sqrt(float(c.hidden_size));
    w.q_proj_weight = Matrix::Random(2 * c.num_attention_heads * c.head_dim, c.hidden_size) * s;
    w.k_proj_weight = Matrix::Random(c.num_key_value_heads * c.head_dim, c.hidden_size) * s;
    w.v_proj_weight = Matrix::Random(c.num_key_value_heads * c.head_dim, c.hidden_size) * s;
    w.o_proj_weight = Matrix::Random(c.hidden_size, c.num_attention_heads * c.head_dim) * s;
    w.q_norm_weight = gattn::Vector<float>::Zero(c.head_dim);
    w.k_norm_weight = gattn::Vector<float>::Zero(c.head_dim);
    return w;
}

/// Bytes of one token's keys and values in a cache of Cache (an int8 cache's codes and scales).
template <class Cache>
double kv_row_bytes(gattn::Index num_kv_heads, gattn::Index head_dim) {
    const double scales = std::is_same_v<Cache, std::int8_t> ? 2.0 * num_kv_heads * sizeof(float) : 0.0;
    return 2.0 * double(num_kv_heads * head_dim) * sizeof(Cache) + scales;
}

/// One decoding step's inputs: the layer (random weights) and a cache of `batch` sequences
/// filled with `kv_len` random keys and values each (prefilling 32k tokens would dominate the
/// run), one new token per sequence. Sets the OpenMP threads; restores 1 when destroyed.
/// Storage: the weights' type;
/// Cache: the KV cache's (Storage, or std::int8_t).
template <class Storage, class Cache = Storage>
struct DecodeStep {
    gattn::Qwen3NextConfig config = real_config();
    gattn::Qwen3NextAttention<Storage> layer{config, random_weights(config).template cast<Storage>()};
    gattn::Index kv_len, batch, width = config.num_key_value_heads * config.head_dim;
    std::vector<gattn::Index> lengths;
    gattn::KVCache<Cache> cache;
    Matrix x, out;

    /// ragged: the sequences' caches hold evenly spread lengths from 1024 to `cached` tokens
    /// (serving); else `cached` each.
    DecodeStep(gattn::Index cached, gattn::Index sequences, int threads, bool ragged = false)
        : kv_len(cached),
          batch(sequences),
          lengths(static_cast<std::size_t>(sequences), cached),
          cache(layer.template make_cache<Cache>(sequences, cached + 1)),
          x(Matrix::Random(sequences, config.hidden_size)),
          out(sequences, config.hidden_size) {
        if (ragged && sequences > 1)
            for (gattn::Index b = 0; b < sequences; ++b) lengths[b] = 1024 + b * (cached - 1024) / (sequences - 1);
#ifdef _OPENMP
        omp_set_num_threads(threads);
#else
        (void)threads;
#endif
        using Input = typename gattn::KVCache<Cache>::Input;
        cache.append(Matrix::Random(batch * kv_len, width).cast<Input>(),
                     Matrix::Random(batch * kv_len, width).cast<Input>(), lengths);
    }
    ~DecodeStep() {
#ifdef _OPENMP
        omp_set_num_threads(1);
#endif
    }
    /// One step, then the cache rolled back to its lengths.
    void run() {
        layer.forward(x, lengths, cache, out);
        benchmark::DoNotOptimize(out.data());
        cache.truncate(lengths);
    }
    /// Bytes a step must read: the weights in their storage and every cached key and value (an
    /// int8 cache's codes and scales).
    double bytes() const {
        gattn::Index cached = 0;
        for (gattn::Index l : lengths) cached += l;
        return double(layer.weight_bytes()) +
               double(cached) * kv_row_bytes<Cache>(config.num_key_value_heads, config.head_dim);
    }
    static std::string label() {
        return std::is_same_v<Storage, float> ? gattn::simd::arch_name()
                                              : gattn::kernel_name(gattn::bf16_kernel().kernel);
    }
};

/// Args: KV length, batch (sequences decoded together, one token each), threads. Storage: the
/// weights' and the cache's type (float or gattn::bfloat16).
template <class Storage>
void BM_Qwen3NextDecodeStep(benchmark::State& state) {
    DecodeStep<Storage> step(state.range(0), state.range(1), static_cast<int>(state.range(2)));
    for (auto _ : state) step.run();
    state.counters["steps/s"] = benchmark::Counter(1.0, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["tokens/s"] = benchmark::Counter(double(step.batch), benchmark::Counter::kIsIterationInvariantRate);
    state.SetLabel(DecodeStep<Storage>::label());
}

BENCHMARK_TEMPLATE(BM_Qwen3NextDecodeStep, float)
    ->Name("BM_Qwen3NextDecodeStep")
    ->ArgsProduct({{1024, 4096, 8192, 32768}, {1}, {1, 2}})
    ->ArgsProduct({{4096}, {4}, {1, 2}})
    ->ArgNames({"kv_len", "batch", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_Qwen3NextDecodeStep, gattn::bfloat16)
    ->Name("BM_Qwen3NextDecodeStepBf16")
    ->ArgsProduct({{1024, 4096, 8192, 32768}, {1}, {1, 2}})
    ->ArgsProduct({{4096}, {4}, {1, 2}})
    ->ArgNames({"kv_len", "batch", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

/// One decoding step of the Qwen3-Next layer against the memory roof. Args: cached tokens,
/// batch (sequences, one new token each), threads, and ragged (1: the batch's caches hold
/// lengths spread evenly from 1024 to the cached tokens, as in serving; tokens/s counts the
/// batch's tokens). Storage: the weights' and the cache's type.
/// Counters: step_ms; MiB, the bytes the step must read (weights in their storage, and every
/// sequence's cached keys and values); stream_GB/s, the read bandwidth of a buffer of that size
/// measured just before in this process; roof_fraction = (bytes / bandwidth) / step time.
template <class Storage, class Cache = Storage>
void BM_DecodeRoof(benchmark::State& state) {
    DecodeStep<Storage, Cache> step(state.range(0), state.range(1), static_cast<int>(state.range(2)),
                                    state.range(3) != 0);
    const double bytes = step.bytes();
    const double bandwidth = gattn_bench::stream_bandwidth(static_cast<std::size_t>(bytes));
    double seconds = 0;
    for (auto _ : state) {
        const auto t0 = std::chrono::steady_clock::now();
        step.run();
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    const double step_seconds = seconds / double(state.iterations());
    state.counters["step_ms"] = step_seconds * 1e3;
    state.counters["MiB"] = bytes / double(1 << 20);
    state.counters["stream_GB/s"] = bandwidth / 1e9;
    state.counters["roof_fraction"] = bytes / bandwidth / step_seconds;
    state.counters["tokens/s"] = double(step.batch) / step_seconds;
    state.SetLabel(DecodeStep<Storage, Cache>::label());
}

/// One sequence at 1k–32k cached tokens, 8 at 4k and 32k, and 8 ragged (1k–32k); 1 and 2 threads.
void decode_roof_args(benchmark::internal::Benchmark* b) {
    b->ArgsProduct({{1024, 4096, 8192, 16384, 32768}, {1}, {1, 2}, {0}})
        ->ArgsProduct({{4096, 32768}, {8}, {1, 2}, {0}})
        ->ArgsProduct({{32768}, {8}, {1, 2}, {1}})
        ->ArgNames({"cached", "batch", "threads", "ragged"})
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
}

BENCHMARK_TEMPLATE(BM_DecodeRoof, float)->Name("BM_DecodeRoof/float")->Apply(decode_roof_args);
BENCHMARK_TEMPLATE(BM_DecodeRoof, gattn::bfloat16)->Name("BM_DecodeRoof/bf16")->Apply(decode_roof_args);
BENCHMARK_TEMPLATE(BM_DecodeRoof, float, std::int8_t)->Name("BM_DecodeRoof/int8")->Apply(decode_roof_args);
BENCHMARK_TEMPLATE(BM_DecodeRoof, gattn::bfloat16, std::int8_t)
    ->Name("BM_DecodeRoof/bf16_weights_int8_cache")
    ->ArgsProduct({{32768}, {1}, {1, 2}, {0}})
    ->ArgNames({"cached", "batch", "threads", "ragged"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

/// SDPA alone for one decoding step (one query token per sequence, Qwen3-Next's 16 heads, 2 KV
/// heads, d = 256) over a cache of Cache (float, bf16 or int8) filled with random keys and
/// values. Args: cached tokens, threads. Counters: step_ms; cache_MiB, the cache's bytes read;
/// GB/s, those bytes over the step time. Compare the caches within one run. int8: Limit is the
/// decoding kernel family allowed (BM_DecodeAttention/int8_widened: the codes widened to float
/// FMAs); the label names the one that ran.
template <class Cache, gattn::Int8Kernel Limit = gattn::Int8Kernel::Vnni>
void BM_DecodeAttention(benchmark::State& state) {
    const gattn::Index n = state.range(0), H = 16, Hkv = 2, d = 256;
    gattn::set_int8_kernel_limit(Limit);
    if constexpr (std::is_same_v<Cache, std::int8_t>) state.SetLabel(gattn::kernel_name(gattn::int8_kernel().kernel));
#ifdef _OPENMP
    omp_set_num_threads(static_cast<int>(state.range(1)));
#endif
    gattn::KVCache<Cache> cache(1, n, Hkv, d);
    using Input = typename gattn::KVCache<Cache>::Input;
    cache.append(Matrix::Random(n, Hkv * d).cast<Input>(), Matrix::Random(n, Hkv * d).cast<Input>(), {n});
    using Q = std::conditional_t<std::is_same_v<Cache, std::int8_t>, float, Cache>;
    const gattn::RowMatrix<Q> q = Matrix::Random(1, H * d).cast<Q>();
    Matrix out(1, H * d);
    auto step = [&] {
        if constexpr (std::is_same_v<Cache, std::int8_t>)
            gattn::scaled_dot_product_attention(q, cache.key_operand(), cache.value_operand(), {1, H, Hkv}, out);
        else
            gattn::scaled_dot_product_attention<Cache, float>(q, cache.keys(), cache.values(), {1, H, Hkv}, out);
        benchmark::DoNotOptimize(out.data());
    };
    for (auto _ : state) step();
    const double row_bytes = kv_row_bytes<Cache>(Hkv, d);
    state.counters["cache_MiB"] = double(n) * row_bytes / double(1 << 20);
    state.counters["GB/s"] = benchmark::Counter(double(n) * row_bytes, benchmark::Counter::kIsIterationInvariantRate);
    gattn::set_int8_kernel_limit(gattn::Int8Kernel::Vnni);
#ifdef _OPENMP
    omp_set_num_threads(1);
#endif
}

void decode_attention_args(benchmark::internal::Benchmark* b) {
    b->ArgsProduct({{4096, 32768}, {1, 2}})
        ->ArgNames({"cached", "threads"})
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
}

BENCHMARK_TEMPLATE(BM_DecodeAttention, float)->Name("BM_DecodeAttention/float")->Apply(decode_attention_args);
BENCHMARK_TEMPLATE(BM_DecodeAttention, gattn::bfloat16)->Name("BM_DecodeAttention/bf16")->Apply(decode_attention_args);
BENCHMARK_TEMPLATE(BM_DecodeAttention, std::int8_t)->Name("BM_DecodeAttention/int8")->Apply(decode_attention_args);
BENCHMARK_TEMPLATE(BM_DecodeAttention, std::int8_t, gattn::Int8Kernel::WidenedFloat)
    ->Name("BM_DecodeAttention/int8_widened")
    ->Apply(decode_attention_args);

}  // namespace

int main(int argc, char** argv) { return gattn_bench::run(argc, argv); }
