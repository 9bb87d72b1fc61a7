// Attention over a paged KV pool against the same tokens in a contiguous KVCache, side by side
// in one process.
//
// BM_PagedVsContiguous runs gattn::paged_attention (K and V read in place through the page
// table) and scaled_dot_product_attention over a KVCache holding the same tokens in turn in
// every iteration, and reports paged_vs_contiguous = contiguous time / paged time (1 = as fast;
// above 1 = the paged call is faster). Both give bitwise the same result (tests/test_paged_kv).
// Layer: 8 query heads on 2 KV heads, d = 128. Decoding: 4 sequences of `cached` tokens, one
// new query each. Prefill: one sequence, a chunk of 512 queries (causal) against `cached`
// tokens before it plus the chunk itself. The pool's pages are dealt to the sequences in
// rounds of 100 tokens, so that a sequence's pages are scattered over the pool as they are in
// a server; the contiguous cache holds each sequence in one run of rows.
// Args: storage (0 float, 1 bf16, 2 int8), page size, cached tokens, prefill (0 decoding, 1 a
// 512-token chunk), threads.
//
// BM_MixedBatch: continuous batching's step. One sequence brings a 512-token prompt chunk
// (causal, after `cached` tokens) and 15 decode one token each over `cached` tokens, float,
// pages of 64: one paged_attention call over the ragged batch (qo_indptr) against the same work
// as two calls (the chunk, then the 15 decoding steps), in turn in every iteration;
// speedup = two calls' time / one call's time. Args: cached tokens, threads.
//
// Run: build/bench/bench/bench_paged --benchmark_counters_tabular=true

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

#include <gattn/gattn.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using gattn::Index;
constexpr Index kHeads = 8, kKvHeads = 2, kDim = 128, kChunk = 512;

void set_threads(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

template <class S>
gattn::RowMatrix<S> random_rows(Index rows, Index cols, std::mt19937& rng) {
    std::normal_distribution<float> dist(0.0f, 1.0f);
    gattn::RowMatrix<S> m(rows, cols);
    for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<S>(dist(rng));
    return m;
}

template <class S>
void run(benchmark::State& state, Index page_size, Index cached, bool prefill) {
    using Q = std::conditional_t<std::is_same_v<S, std::int8_t>, float, S>;
    using In = typename gattn::PagedKVPool<S>::Input;
    const Index B = prefill ? 1 : 4, Nq = prefill ? kChunk : 1, L = cached + (prefill ? kChunk : 0);
    std::mt19937 rng(7);
    gattn::PagedKVPool<S> pool(B * ((L + page_size - 1) / page_size), page_size, kKvHeads, kDim);
    gattn::KVCache<S> cache(B, L, kKvHeads, kDim);
    std::vector<gattn::SequenceId> ids;
    for (Index b = 0; b < B; ++b) ids.push_back(pool.allocate());
    // Rounds of up to 100 tokens per sequence: the pages of the sequences interleave.
    for (Index done = 0; done < L;) {
        const Index n = std::min<Index>(100, L - done);
        const gattn::RowMatrix<In> k = random_rows<In>(B * n, kKvHeads * kDim, rng),
                                   v = random_rows<In>(B * n, kKvHeads * kDim, rng);
        pool.append(ids, k, v, std::vector<Index>(static_cast<std::size_t>(B), n));
        cache.append(k, v, std::vector<Index>(static_cast<std::size_t>(B), n));
        done += n;
    }
    const gattn::PageTable table = pool.page_table(ids);
    const gattn::RowMatrix<Q> q = random_rows<Q>(B * Nq, kHeads * kDim, rng);
    gattn::RowMatrix<Q> out_paged(B * Nq, kHeads * kDim), out_contiguous(B * Nq, kHeads * kDim);
    gattn::SdpaOptions<gattn::compute_t<Q>> opt, copt;
    opt.mask.causal = copt.mask.causal = prefill;
    copt.mask.key_lengths = cache.lengths();
    const gattn::HeadLayout heads{B, kHeads, kKvHeads};
    const auto [t_contiguous, t_paged] = gattn_bench::time_in_turn(
        state,
        [&] {
            if constexpr (std::is_same_v<S, std::int8_t>)
                gattn::scaled_dot_product_attention(q, cache.key_operand(), cache.value_operand(), heads,
                                                    out_contiguous, copt);
            else
                gattn::scaled_dot_product_attention<S>(q, cache.keys(), cache.values(), heads, out_contiguous, copt);
            benchmark::DoNotOptimize(out_contiguous.data());
        },
        [&] {
            gattn::paged_attention<S, Q>(q, pool, table, kHeads, out_paged, opt);
            benchmark::DoNotOptimize(out_paged.data());
        });
    const double n = static_cast<double>(state.iterations());
    state.counters["contiguous_us"] = t_contiguous / n * 1e6;
    state.counters["paged_us"] = t_paged / n * 1e6;
    state.counters["paged_vs_contiguous"] = t_contiguous / t_paged;
    state.counters["bitwise_equal"] = out_paged == out_contiguous ? 1 : 0;
}

/// Args: storage (0 float, 1 bf16, 2 int8), page size, cached tokens, prefill, threads.
void BM_PagedVsContiguous(benchmark::State& state) {
    set_threads(static_cast<int>(state.range(4)));
    const Index page_size = state.range(1), cached = state.range(2);
    const bool prefill = state.range(3) != 0;
    switch (state.range(0)) {
        case 0: run<float>(state, page_size, cached, prefill); break;
        case 1: run<gattn::bfloat16>(state, page_size, cached, prefill); break;
        default: run<std::int8_t>(state, page_size, cached, prefill); break;
    }
    set_threads(1);
}

void paged_args(benchmark::internal::Benchmark* b) {
    for (int prefill : {0, 1})
        for (int cached : {4096, 32768})
            for (int storage : {0, 1, 2})
                for (int page : {16, 64, 256})
                    for (int threads : {1, 2}) b->Args({storage, page, cached, prefill, threads});
}

BENCHMARK(BM_PagedVsContiguous)
    ->Apply(paged_args)
    ->ArgNames({"storage", "page", "cached", "prefill", "threads"})
    ->MinTime(0.5)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_MixedBatch(benchmark::State& state) {
    const Index cached = state.range(0), decoders = 15, B = decoders + 1, page = 64;
    set_threads(static_cast<int>(state.range(1)));
    std::mt19937 rng(11);
    gattn::PagedKVPool<float> pool(B * ((cached + kChunk + page - 1) / page), page, kKvHeads, kDim);
    std::vector<gattn::SequenceId> ids;
    for (Index b = 0; b < B; ++b) ids.push_back(pool.allocate());
    for (Index done = 0; done < cached;) {  // interleaved pages, as in a server
        const Index n = std::min<Index>(100, cached - done);
        const gattn::RowMatrix<float> k = random_rows<float>(B * n, kKvHeads * kDim, rng),
                                      v = random_rows<float>(B * n, kKvHeads * kDim, rng);
        pool.append(ids, k, v, std::vector<Index>(static_cast<std::size_t>(B), n));
        done += n;
    }
    // Sequence 0's prompt chunk and every decoder's new token are in the pool before the call.
    std::vector<Index> counts(static_cast<std::size_t>(B), 1);
    counts[0] = kChunk;
    pool.append(ids, random_rows<float>(B * kChunk, kKvHeads * kDim, rng),  // row b·512 + i: sequence b's i-th
                random_rows<float>(B * kChunk, kKvHeads * kDim, rng), counts);
    std::vector<Index> indptr{0};
    for (Index n : counts) indptr.push_back(indptr.back() + n);
    const gattn::RowMatrix<float> q = random_rows<float>(indptr.back(), kHeads * kDim, rng);
    gattn::RowMatrix<float> out_mixed(q.rows(), kHeads * kDim), out_split(q.rows(), kHeads * kDim);
    const gattn::PageTable all = pool.page_table(ids), chunk = pool.page_table({ids[0]}),
                           decoding = pool.page_table(std::vector<gattn::SequenceId>(ids.begin() + 1, ids.end()));
    gattn::SdpaOptions<float> opt;
    opt.mask.causal = true;
    const auto [t_split, t_mixed] = gattn_bench::time_in_turn(
        state,
        [&] {
            gattn::paged_attention<float, float>(q.topRows(kChunk), pool, chunk, kHeads, out_split.topRows(kChunk),
                                                 opt);
            gattn::paged_attention<float, float>(q.bottomRows(decoders), pool, decoding, kHeads,
                                                 out_split.bottomRows(decoders), opt);
            benchmark::DoNotOptimize(out_split.data());
        },
        [&] {
            gattn::paged_attention<float, float>(q, indptr, pool, all, kHeads, out_mixed, opt);
            benchmark::DoNotOptimize(out_mixed.data());
        });
    const double n = static_cast<double>(state.iterations());
    state.counters["split_us"] = t_split / n * 1e6;
    state.counters["mixed_us"] = t_mixed / n * 1e6;
    state.counters["speedup"] = t_split / t_mixed;
    state.counters["bitwise_equal"] = out_mixed == out_split ? 1 : 0;
    set_threads(1);
}

BENCHMARK(BM_MixedBatch)
    ->ArgsProduct({{4096, 8192}, {1, 2}})
    ->ArgNames({"cached", "threads"})
    ->MinTime(0.5)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

/// Shared-prefix decoding: B sequences forked from one prompt of `prefix` tokens, each with
/// `suffix` tokens of its own, decode one token each through gattn::cascade_attention (the
/// prefix read once for all B sequences), timed in turn with paged_attention over the same
/// sequences' full tables (the prefix read once per sequence). Page size 64, float, 1 thread.
/// Counters: speedup = unshared time / cascade time; bytes_read (cascade: prefix once plus the
/// suffixes; unshared_bytes_read: every sequence's prefix and suffix); pool_bytes (the pool,
/// which holds the prefix once); prefix_of_peak: the prefix call's FLOP rate (4·B·H·prefix·d
/// FLOPs: q·k and p·v) over the FMA peak (gattn_bench::fma_chains) timed in turn with it;
/// prefix_GB/s: the prefix's K and V bytes over the prefix call's time, and stream_GB/s: the same
/// bytes summed by Eigen in turn with it (how fast this core reads them from where they are:
/// memory once they exceed the caches). Where prefix_GB/s is near stream_GB/s the prefix part
/// is bound by memory: its FLOPs per byte (B·H / H_kv / 2 per key and feature: 16 for batch 16,
/// 8 on 8 heads) times stream_GB/s is its ceiling.
/// Args: batch, prefix tokens, suffix tokens, query heads, KV heads, head dim.
void BM_SharedPrefixDecode(benchmark::State& state) {
    set_threads(1);
    const Index B = state.range(0), prefix = state.range(1), suffix = state.range(2), H = state.range(3),
                Hkv = state.range(4), d = state.range(5), P = 64;
    std::mt19937 rng(11);
    const Index pages = prefix / P + B * ((suffix + P - 1) / P);
    gattn::PagedKVPool<float> pool(pages, P, Hkv, d);
    const gattn::SequenceId root = pool.allocate();
    for (Index done = 0; done < prefix;) {
        const Index n = std::min<Index>(1024, prefix - done);
        const gattn::RowMatrix<float> k = random_rows<float>(n, Hkv * d, rng), v = random_rows<float>(n, Hkv * d, rng);
        pool.append({root}, k, v, {n});
        done += n;
    }
    std::vector<gattn::SequenceId> ids;
    for (Index b = 0; b < B; ++b) ids.push_back(pool.fork(root));
    if (suffix > 0) {
        const gattn::RowMatrix<float> k = random_rows<float>(B * suffix, Hkv * d, rng),
                                      v = random_rows<float>(B * suffix, Hkv * d, rng);
        pool.append(ids, k, v, std::vector<Index>(static_cast<std::size_t>(B), suffix));
    }
    const gattn::PageTable full = pool.page_table(ids);
    const auto split = gattn::split_shared_prefix(full, P);
    const gattn::RowMatrix<float> q = random_rows<float>(B, H * d, rng);
    gattn::RowMatrix<float> out_cascade(B, H * d), out_plain(B, H * d);
    const auto [t_cascade, t_plain] = gattn_bench::time_in_turn(
        state,
        [&] {
            gattn::cascade_attention<float, float>(q, pool, split.first, split.second, H, out_cascade);
            benchmark::DoNotOptimize(out_cascade.data());
        },
        [&] {
            gattn::paged_attention<float, float>(q, pool, full, H, out_plain);
            benchmark::DoNotOptimize(out_plain.data());
        });
    // The prefix part alone (the stacked rows over the prefix's pages) against the FMA peak.
    gattn::RowMatrix<float> out_prefix(B, H * d), lse;
    double t_prefix = 0, t_peak = 0, t_stream = 0;
    const long steps = gattn_bench::kPeakSteps / 8;
    const Index prefix_rows = prefix / P * P;  // the prefix's pages are the pool's first
    for (int rep = 0; rep < 5; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        gattn::paged_attention<float, float>(q, pool, split.first, H, out_prefix, {}, {&lse});
        benchmark::DoNotOptimize(out_prefix.data());
        const auto t1 = std::chrono::steady_clock::now();
        benchmark::DoNotOptimize(gattn_bench::fma_chains(steps));
        const auto t2 = std::chrono::steady_clock::now();
        float sum = pool.keys().topRows(prefix_rows).sum() + pool.values().topRows(prefix_rows).sum();
        benchmark::DoNotOptimize(sum);
        const auto t3 = std::chrono::steady_clock::now();
        t_prefix += std::chrono::duration<double>(t1 - t0).count();
        t_peak += std::chrono::duration<double>(t2 - t1).count();
        t_stream += std::chrono::duration<double>(t3 - t2).count();
    }
    const double n = static_cast<double>(state.iterations()), row_bytes = double(Hkv * 2 * d * sizeof(float));
    state.counters["cascade_us"] = t_cascade / n * 1e6;
    state.counters["unshared_us"] = t_plain / n * 1e6;
    state.counters["speedup"] = t_plain / t_cascade;
    state.counters["bytes_read"] = double(prefix + B * suffix) * row_bytes;
    state.counters["unshared_bytes_read"] = double(B * (prefix + suffix)) * row_bytes;
    state.counters["pool_bytes"] = double(pool.storage_bytes());
    const double prefix_rate = 4.0 * double(B * H * prefix * d) * 5 / t_prefix,
                 peak_rate = gattn_bench::peak_flops(steps) * 5 / t_peak;
    state.counters["prefix_GFLOP/s"] = prefix_rate / 1e9;
    state.counters["peak_GFLOP/s"] = peak_rate / 1e9;
    state.counters["prefix_of_peak"] = prefix_rate / peak_rate;
    const double prefix_bytes = double(prefix_rows) * row_bytes;
    state.counters["prefix_GB/s"] = prefix_bytes * 5 / t_prefix / 1e9;
    state.counters["stream_GB/s"] = prefix_bytes * 5 / t_stream / 1e9;
    state.counters["max_abs_diff"] = (out_cascade - out_plain).cwiseAbs().maxCoeff();
}

void shared_prefix_args(benchmark::internal::Benchmark* b) {
    for (auto [H, Hkv, d] : {std::array<int, 3>{8, 8, 128}, {16, 2, 256}})
        for (int batch : {16, 64})
            for (int prefix : {2048, 8192, 32768})
                for (int suffix : {0, 512}) b->Args({batch, prefix, suffix, H, Hkv, d});
}

BENCHMARK(BM_SharedPrefixDecode)
    ->Apply(shared_prefix_args)
    ->ArgNames({"batch", "prefix", "suffix", "heads", "kv_heads", "d"})
    ->MinTime(0.2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) { return gattn_bench::run(argc, argv); }
