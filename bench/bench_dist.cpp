// SPDX-License-Identifier: Apache-2.0
// Ring attention over MPI (gattn/dist), run under mpirun: a causal prefill of one sequence with
// Qwen3-Next's attention shapes (16 query heads, 2 KV heads, head_dim 256, float), split across
// the ranks, against rank 0 alone over the whole sequence in the same run (the other ranks wait).
//
// BM_RingPrefill/tokens/causal/zigzag reports, per prefill: ring_ms (the slowest rank), one_rank_ms,
// speedup = one_rank_ms / ring_ms, MiB_sent (K and V bytes each rank sends), and work_balance:
// the most key-chunk work any rank does over the mean (1 = balanced; from the layout, not timed).
//
// BM_HeadParallelDecode/cached: one decoding step of Qwen3-Next's layer (hidden 2048, random
// weights, float) against `cached` tokens per rank's shard of the cache, its heads split across
// the ranks (gattn/dist/head_parallel.hpp), against rank 0 alone with the whole layer and cache:
// parallel_ms (the slowest rank), one_rank_ms, speedup, and MiB_read_per_rank (its weights and
// cache shard).
//
// BM_ShardedCacheDecode/cached: SDPA of one query token (16 heads, 2 KV heads, head_dim 256)
// against `cached` tokens whose cache is split by position across the ranks
// (gattn/dist/sharded_cache.hpp), against rank 0 alone over the whole cache: sharded_ms,
// one_rank_ms, speedup, and MiB_read_per_rank.
//
// Run: mpirun -np 2 --oversubscribe build/bench/bench/bench_dist --benchmark_counters_tabular=true
// (as root add --allow-run-as-root; OMP_NUM_THREADS=1 gives each rank one thread).

#include <benchmark/benchmark.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include <gattn/dist/head_parallel.hpp>
#include <gattn/dist/ring_attention.hpp>
#include <gattn/dist/sharded_cache.hpp>

#include "bench_support.hpp"

namespace {

using gattn::Index;
using Matrix = gattn::RowMatrix<float>;
constexpr Index kHeads = 16, kKvHeads = 2, kHeadDim = 256;

int rank_of() {
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
}
int size_of() {
    int s = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &s);
    return s;
}

/// Key-chunk work of rank r over the mean, causal: contiguous rank r attends r whole blocks and
/// half of its own; zigzag ranks all attend the same.
double work_balance(int P, bool causal, bool zigzag) {
    if (!causal || zigzag) return 1.0;
    return (P - 0.5) / (P / 2.0);
}

/// Runs `all_ranks` on every rank, then `rank0_alone` on rank 0 while the others wait, each
/// timed from a barrier, for every iteration of the benchmark (whose time is the parallel
/// call's). Sets the counters ranks, <name>_ms (the slowest rank), one_rank_ms and speedup.
template <class AllRanks, class Rank0Alone>
void time_against_rank0(benchmark::State& state, const char* name, AllRanks&& all_ranks, Rank0Alone&& rank0_alone) {
    double parallel = 0, alone = 0;
    for (auto _ : state) {
        MPI_Barrier(MPI_COMM_WORLD);
        auto t0 = std::chrono::steady_clock::now();
        all_ranks();
        double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);  // the slowest rank
        parallel += t;
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = std::chrono::steady_clock::now();
        if (rank_of() == 0) rank0_alone();
        double t_alone = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        MPI_Bcast(&t_alone, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
        alone += t_alone;
        state.SetIterationTime(t);
    }
    const double iters = double(state.iterations());
    state.counters["ranks"] = size_of();
    state.counters[std::string(name) + "_ms"] = 1e3 * parallel / iters;
    state.counters["one_rank_ms"] = 1e3 * alone / iters;
    state.counters["speedup"] = alone / parallel;
}

/// Args: tokens, causal, zigzag.
void BM_RingPrefill(benchmark::State& state) {
    const int P = size_of(), r = rank_of();
    const Index N = state.range(0);
    const bool causal = state.range(1) != 0, zigzag = state.range(2) != 0;
    const Index n = N / P, c = n / 2;
    const Matrix q = Matrix::Random(N, kHeads * kHeadDim), k = Matrix::Random(N, kKvHeads * kHeadDim),
                 v = Matrix::Random(N, kKvHeads * kHeadDim);
    // This rank's rows: [r·n, (r + 1)·n), or chunks r and 2P − 1 − r of n/2.
    auto part = [&](const Matrix& m) {
        Matrix p(n, m.cols());
        if (zigzag) {
            p.topRows(c) = m.middleRows(r * c, c);
            p.bottomRows(c) = m.middleRows((2 * P - 1 - r) * c, c);
        } else {
            p = m.middleRows(r * n, n);
        }
        return p;
    };
    const Matrix qp = part(q), kp = part(k), vp = part(v);
    Matrix out(n, kHeads * kHeadDim), whole(N, kHeads * kHeadDim);
    gattn::SdpaOptions<float> o;
    o.mask.causal = causal;
    const auto layout = zigzag ? gattn::RingLayout::Zigzag : gattn::RingLayout::Contiguous;
    time_against_rank0(
        state, "ring",
        [&] {
            gattn::ring_attention<float>(qp, kp, vp, {1, kHeads, kKvHeads}, out, o, MPI_COMM_WORLD, nullptr, layout);
        },
        [&] {
            gattn::scaled_dot_product_attention<float>(q, k, v, {1, kHeads, kKvHeads}, whole, o);
        });
    state.counters["MiB_sent"] = double(P - 1) * double(kp.size() + vp.size()) * sizeof(float) / (1 << 20);
    state.counters["work_balance"] = work_balance(P, causal, zigzag);
}

BENCHMARK(BM_RingPrefill)
    ->ArgsProduct({{4096, 8192}, {1}, {0, 1}})
    ->Args({4096, 0, 0})
    ->Args({32768, 1, 1})  // Qwen3-Next's attention at 32k tokens: minutes
    ->ArgNames({"tokens", "causal", "zigzag"})
    ->Iterations(2)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

/// Args: cached tokens.
void BM_HeadParallelDecode(benchmark::State& state) {
    const int r = rank_of();
    const Index cached = state.range(0);
    gattn::Qwen3NextConfig c;
    c.hidden_size = 2048;
    c.num_attention_heads = kHeads;
    c.num_key_value_heads = kKvHeads;
    c.head_dim = kHeadDim;
    c.partial_rotary_factor = 0.25;
    gattn::Qwen3NextAttentionWeights<float> w;  // the same on every rank
    std::srand(11);
    const float s = 1.0f / std::sqrt(float(c.hidden_size));
    w.q_proj_weight = Matrix::Random(2 * kHeads * kHeadDim, c.hidden_size) * s;
    w.k_proj_weight = Matrix::Random(kKvHeads * kHeadDim, c.hidden_size) * s;
    w.v_proj_weight = Matrix::Random(kKvHeads * kHeadDim, c.hidden_size) * s;
    w.o_proj_weight = Matrix::Random(c.hidden_size, kHeads * kHeadDim) * s;
    w.q_norm_weight = gattn::Vector<float>::Zero(kHeadDim);
    w.k_norm_weight = gattn::Vector<float>::Zero(kHeadDim);
    const gattn::HeadParallelQwen3Next<float> parallel(c, w, MPI_COMM_WORLD);
    auto shard_cache = parallel.make_cache(1, cached + 1);
    const Index shard_width = parallel.shard().num_kv_heads * kHeadDim;
    shard_cache.append(Matrix::Random(cached, shard_width), Matrix::Random(cached, shard_width), {cached});
    std::vector<gattn::Qwen3NextAttention<float>> whole;  // rank 0's whole layer and cache
    std::vector<gattn::KVCache<float>> whole_cache;
    if (r == 0) {
        whole.emplace_back(c, w);
        whole_cache.push_back(whole[0].make_cache(1, cached + 1));
        whole_cache[0].append(Matrix::Random(cached, kKvHeads * kHeadDim), Matrix::Random(cached, kKvHeads * kHeadDim),
                              {cached});
    }
    const Matrix x = Matrix::Random(1, c.hidden_size);
    Matrix out(1, c.hidden_size);
    time_against_rank0(
        state, "parallel",
        [&] {
            parallel.forward(x, {cached}, shard_cache, out);
            shard_cache.truncate({cached});
        },
        [&] {
            whole[0].forward(x, {cached}, whole_cache[0], out);
            whole_cache[0].truncate({cached});
        });
    state.counters["MiB_read_per_rank"] =
        (double(parallel.local().weight_bytes()) + double(cached * 2 * shard_width) * sizeof(float)) / (1 << 20);
}

BENCHMARK(BM_HeadParallelDecode)
    ->Arg(32768)
    ->ArgNames({"cached"})
    ->Iterations(20)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

/// Args: cached tokens (over all ranks).
void BM_ShardedCacheDecode(benchmark::State& state) {
    const int P = size_of();
    const Index cached = state.range(0), n = cached / P;
    // This rank's slice of the cache, its own random keys and values; the same query everywhere.
    gattn::KVCache<float> slice(1, n, kKvHeads, kHeadDim);
    slice.append(Matrix::Random(n, kKvHeads * kHeadDim), Matrix::Random(n, kKvHeads * kHeadDim), {n});
    std::vector<gattn::KVCache<float>> whole;  // rank 0's whole cache
    if (rank_of() == 0) {
        whole.emplace_back(1, cached, kKvHeads, kHeadDim);
        whole[0].append(Matrix::Random(cached, kKvHeads * kHeadDim), Matrix::Random(cached, kKvHeads * kHeadDim),
                        {cached});
    }
    std::srand(3);
    const Matrix q = Matrix::Random(1, kHeads * kHeadDim);
    Matrix out(1, kHeads * kHeadDim);
    const gattn::SdpaOptions<float> o;
    time_against_rank0(
        state, "sharded",
        [&] {
            gattn::sharded_cache_attention<float>(q, slice, {rank_of() * n}, {cached}, kHeads, out, o, MPI_COMM_WORLD);
        },
        [&] {
            gattn::scaled_dot_product_attention<float>(q, whole[0].key_operand(), whole[0].value_operand(),
                                                       {1, kHeads, kKvHeads}, out, o);
        });
    state.counters["MiB_read_per_rank"] = double(n * 2 * kKvHeads * kHeadDim) * sizeof(float) / (1 << 20);
}

BENCHMARK(BM_ShardedCacheDecode)
    ->Arg(32768)
    ->ArgNames({"cached"})
    ->Iterations(50)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

/// Prints nothing: ranks other than 0 run the benchmarks (every rank must) silently.
class Silent : public benchmark::BenchmarkReporter {
public:
    bool ReportContext(const Context&) override { return true; }
    void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    gattn_bench::add_gattn_context();
    benchmark::Initialize(&argc, argv);
    if (rank_of() == 0) {
        benchmark::RunSpecifiedBenchmarks();
    } else {
        Silent silent;
        benchmark::RunSpecifiedBenchmarks(&silent);
    }
    benchmark::Shutdown();
    MPI_Finalize();
    return 0;
}
