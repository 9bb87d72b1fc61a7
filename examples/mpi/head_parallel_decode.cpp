// A Qwen3-Next-shaped gated attention layer (hidden 2048, 16 query heads, 2 KV heads, head_dim
// 256; random weights) with its heads split across the MPI ranks (gattn/dist/head_parallel.hpp):
// each rank holds 16 / P query heads, their gate rows and KV heads, its columns of o_proj and its
// part of the KV cache. The ranks prefill a prompt together, then decode tokens one at a time;
// every rank gets the whole output of each step (one all-reduce). Prints what each rank holds
// and each step's time.
//
// Run: mpirun -np 2 build/examples/head_parallel_decode [--prompt 4096] [--steps 8]   (--help)
//   as root add --allow-run-as-root; OMP_NUM_THREADS sets each rank's threads.

#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <gattn/dist/head_parallel.hpp>
#include <gattn/simd/cpu.hpp>
#include <gattn/version.hpp>

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    CLI::App app{"Prefill and decoding with a Qwen3-Next-shaped layer whose heads are split across the MPI ranks."};
    long prompt = 4096, steps = 8;
    app.add_option("--prompt", prompt, "prompt tokens to prefill")
        ->check(CLI::Range(1L, 1L << 20))
        ->capture_default_str();
    app.add_option("--steps", steps, "tokens to decode after the prompt")
        ->check(CLI::Range(0L, 1L << 20))
        ->capture_default_str();
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        const int code = rank == 0 ? app.exit(e) : 0;
        MPI_Finalize();
        return code;
    }
    int status = 0;
    try {
        using Matrix = gattn::RowMatrix<float>;
        gattn::Qwen3NextConfig c;
        c.hidden_size = 2048;
        c.num_attention_heads = 16;
        c.num_key_value_heads = 2;
        c.head_dim = 256;
        c.partial_rotary_factor = 0.25;
        // The same weights on every rank (each keeps its shard); in a program they come from a
        // checkpoint (gattn/io/hf_checkpoint.hpp).
        std::srand(5);
        const float s = 1.0f / std::sqrt(float(c.hidden_size));
        gattn::Qwen3NextAttentionWeights<float> w;
        w.q_proj_weight = Matrix::Random(2 * 16 * 256, c.hidden_size) * s;
        w.k_proj_weight = Matrix::Random(2 * 256, c.hidden_size) * s;
        w.v_proj_weight = Matrix::Random(2 * 256, c.hidden_size) * s;
        w.o_proj_weight = Matrix::Random(c.hidden_size, 16 * 256) * s;
        w.q_norm_weight = gattn::Vector<float>::Zero(256);
        w.k_norm_weight = gattn::Vector<float>::Zero(256);
        const gattn::HeadParallelQwen3Next<float> layer(c, w, MPI_COMM_WORLD);
        if (rank == 0)
            std::printf("gattn %s: %s\n%d ranks\n", gattn::version(),
                        gattn::describe(gattn::instruction_sets()).c_str(), size);
        MPI_Barrier(MPI_COMM_WORLD);
        const gattn::HeadShard& sh = layer.shard();
        std::printf("rank %d: query heads %ld-%ld, KV heads %ld-%ld, %.1f MiB of weights\n", rank, long(sh.first_head),
                    long(sh.first_head + sh.num_heads - 1), long(sh.first_kv_head),
                    long(sh.first_kv_head + sh.num_kv_heads - 1), double(layer.local().weight_bytes()) / (1 << 20));
        std::fflush(stdout);
        MPI_Barrier(MPI_COMM_WORLD);

        auto cache = layer.make_cache(1, prompt + steps);
        std::srand(6);  // the same hidden states on every rank
        const Matrix x = Matrix::Random(prompt, c.hidden_size);
        std::vector<gattn::Index> positions(static_cast<std::size_t>(prompt));
        for (long t = 0; t < prompt; ++t) positions[t] = t;
        Matrix y(prompt, c.hidden_size);
        auto t0 = std::chrono::steady_clock::now();
        layer.forward(x, positions, cache, y);
        const double prefill = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (rank == 0) std::printf("prefill of %ld tokens: %.1f ms\n", prompt, 1e3 * prefill);
        Matrix xt = y.bottomRows(1), yt(1, c.hidden_size);  // stands for the next token's hidden state
        for (long step = 0; step < steps; ++step) {
            t0 = std::chrono::steady_clock::now();
            layer.forward(xt, {prompt + step}, cache, yt);
            const double ms = 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            if (rank == 0)
                std::printf("step %ld: %.2f ms, cache %ld tokens, |y| %.4f\n", step, ms, long(cache.lengths()[0]),
                            double(yt.norm()));
            xt = yt / std::max(1e-6f, yt.norm() / std::sqrt(float(c.hidden_size)));
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "head_parallel_decode: rank %d: %s\n", rank, e.what());
        status = 1;
    }
    MPI_Finalize();
    return status;
}
