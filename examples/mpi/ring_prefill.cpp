// Ring attention across MPI ranks (gattn/dist/ring_attention.hpp): a causal prefill of one long
// sequence with Qwen3-Next's attention shapes (16 query heads, 2 KV heads, head_dim 256),
// split across the ranks in the zigzag layout (rank r holds chunks r and 2P − 1 − r of 2P), so
// that every rank does the same work. Each rank makes up its own queries, keys and values
// (random; in a model they come from the layer's projections of its tokens) and prints its time.
// Then each rank keeps its keys and values as its slice of the KV cache, and the sequence
// decodes --decode more tokens against the sharded cache (gattn/dist/sharded_cache.hpp): every
// rank attends the new token to its slice, the last rank stores the new token's key and value.
//
// Run: mpirun -np 2 build/examples/ring_prefill [--tokens 65536] [--decode 8]   (--help)
//   as root add --allow-run-as-root; OMP_NUM_THREADS sets each rank's threads. 64k tokens take
//   about 2.5 GB of memory over two ranks and a few minutes on two cores.

#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <string>

#include <CLI/CLI.hpp>
#include <gattn/dist/ring_attention.hpp>
#include <gattn/dist/sharded_cache.hpp>
#include <gattn/simd/cpu.hpp>
#include <gattn/version.hpp>

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    CLI::App app{"Causal ring-attention prefill of one long sequence across the MPI ranks (zigzag layout)."};
    long tokens = 65536, heads = 16, kv_heads = 2, head_dim = 256, decode = 8;
    app.add_option("--tokens", tokens, "sequence length; a multiple of 2 × ranks")->capture_default_str();
    app.add_option("--decode", decode, "tokens decoded after the prefill")
        ->capture_default_str()
        ->check(CLI::Range(0L, 1L << 20));
    app.add_option("--heads", heads, "query heads")->capture_default_str();
    app.add_option("--kv-heads", kv_heads, "key/value heads (divides --heads)")->capture_default_str();
    app.add_option("--head-dim", head_dim, "features per head")->capture_default_str();
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        const int code = rank == 0 ? app.exit(e) : 0;
        MPI_Finalize();
        return code;
    }
    int status = 0;
    try {
        if (tokens < 2 * size || tokens % (2 * size) != 0)
            throw std::invalid_argument("--tokens must be a positive multiple of 2 × ranks = " +
                                        std::to_string(2 * size) + ", got " + std::to_string(tokens));
        if (rank == 0)
            std::printf("gattn %s: %s\n%d ranks, %ld tokens (%ld per rank), %ld heads, %ld KV heads, head_dim %ld\n",
                        gattn::version(), gattn::describe(gattn::instruction_sets()).c_str(), size, tokens,
                        tokens / size, heads, kv_heads, head_dim);
        const gattn::Index n = tokens / size;
        using Matrix = gattn::RowMatrix<float>;
        std::srand(1 + unsigned(rank));  // each rank's own tokens
        const Matrix q = Matrix::Random(n, heads * head_dim), k = Matrix::Random(n, kv_heads * head_dim),
                     v = Matrix::Random(n, kv_heads * head_dim);
        Matrix out(n, heads * head_dim);
        gattn::SdpaOptions<float> options;
        options.mask.causal = true;
        MPI_Barrier(MPI_COMM_WORLD);
        const auto t0 = std::chrono::steady_clock::now();
        gattn::ring_attention<float>(q, k, v, {1, heads, kv_heads}, out, options, MPI_COMM_WORLD, nullptr,
                                     gattn::RingLayout::Zigzag);
        double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("rank %d: positions of chunks %d and %d, %.2f s\n", rank, rank, 2 * size - 1 - rank, seconds);
        MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (rank == 0)
            std::printf("prefill: %.2f s (slowest rank), %.0f tokens/s; each rank sent %.1f MiB of keys and values\n",
                        seconds, double(tokens) / seconds,
                        double(size - 1) * double(k.size() + v.size()) * sizeof(float) / (1 << 20));

        // Decoding: this rank's keys and values become its slice of the cache (the last rank's
        // slice grows by each new token). The new token comes after every cached one, so it sees
        // them all, wherever they sit: no causal mask is needed, nor the slices' positions.
        gattn::KVCache<float> cache(1, n + decode, kv_heads, head_dim);
        cache.append(k, v, {n});
        gattn::SdpaOptions<float> all_keys;
        Matrix token_out(1, heads * head_dim);
        MPI_Barrier(MPI_COMM_WORLD);
        const auto t1 = std::chrono::steady_clock::now();
        for (long step = 0; step < decode; ++step) {
            std::srand(1000 + unsigned(step));  // the same new token on every rank
            const Matrix qt = Matrix::Random(1, heads * head_dim), kt = Matrix::Random(1, kv_heads * head_dim),
                         vt = Matrix::Random(1, kv_heads * head_dim);
            if (rank == size - 1) cache.append(kt, vt, {1});
            gattn::sharded_cache_attention<float>(qt, cache, {0}, {tokens + step}, heads, token_out, all_keys,
                                                  MPI_COMM_WORLD);
        }
        double decode_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
        MPI_Allreduce(MPI_IN_PLACE, &decode_seconds, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (rank == 0 && decode > 0)
            std::printf("decoding: %ld tokens against the sharded cache, %.2f ms per token (slowest rank)\n", decode,
                        1e3 * decode_seconds / double(decode));
    } catch (const std::exception& e) {
        std::fprintf(stderr, "ring_prefill: rank %d: %s\n", rank, e.what());
        status = 1;
    }
    MPI_Finalize();
    return status;
}
