// Loads a gated attention layer that PyTorch produced (weights, input and PyTorch's output in
// one safetensors file, Hugging Face parameter names), runs it with gattn, and prints:
//  - the largest difference from PyTorch's output, for the whole sequences at once and (causal
//    layers) decoded token by token with a KV cache,
//  - the gate statistics of the paper (mean gate score, first-token attention, largest output),
//  - the time of the gated layer and of the same layer without its gate.
//
// Usage: layer_from_pytorch [file.safetensors]   (default: tests/data/demo_layer.safetensors; --help)

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <gattn/gattn.hpp>
#include <gattn/io/safetensors.hpp>

namespace {

/// Reads the layer's configuration from the file's metadata (written by scripts/make_fixtures.py).
gattn::AttentionConfig config_from_metadata(const gattn::SafetensorsFile& file) {
    const auto& meta = file.metadata();
    auto number = [&](const char* key) { return static_cast<gattn::Index>(std::stol(meta.at(key))); };
    gattn::AttentionConfig config;
    config.d_model = number("d_model");
    config.num_heads = number("num_heads");
    config.num_kv_heads = number("num_kv_heads");
    config.head_dim = number("head_dim");
    config.causal = meta.at("causal") == "true";
    config.qkv_bias = config.o_bias = meta.at("bias") == "true";
    const auto layout = meta.at("gate_layout") == "per_head_interleaved" ? gattn::GateLayout::PerHeadInterleaved
                                                                          : gattn::GateLayout::Separate;
    if (meta.at("gate") == "g1_elementwise") config.gate = gattn::GateSpec::g1_elementwise(layout);
    if (meta.at("gate") == "g1_headwise") config.gate = gattn::GateSpec::g1_headwise(layout);
    config.gate.bias = meta.at("gate_bias") == "true";
    return config;
}

/// Median wall time of `reps` calls, in milliseconds.
template <class F>
double median_ms(F&& f, int reps) {
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
        const auto start = std::chrono::steady_clock::now();
        f();
        t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"Runs a gated attention layer exported from PyTorch (weights, input and PyTorch's output in one\n"
                 "safetensors file) with gattn, checks it against PyTorch and times it against the ungated layer."};
    std::string path = "tests/data/demo_layer.safetensors";
    app.add_option("file", path, "safetensors file written by scripts/make_fixtures.py")
        ->check(CLI::ExistingFile)
        ->capture_default_str();
    CLI11_PARSE(app, argc, argv);
    std::printf("gattn %s: %s\n", gattn::version(), gattn::describe(gattn::instruction_sets()).c_str());
    try {
        const gattn::SafetensorsFile file(path);
        const gattn::AttentionConfig config = config_from_metadata(file);
        const auto weights = gattn::load_attention_weights<float>(file, config);
        const gattn::GatedMultiHeadAttention<float> layer(config, weights);

        const gattn::RowMatrix<float> x = file.matrix<float>("input");
        const gattn::Index batch = std::stol(file.metadata().at("batch"));
        gattn::ForwardTrace<float> trace;
        const gattn::RowMatrix<float> y = layer.forward(x, batch, {}, &trace);
        const gattn::RowMatrix<double> reference = file.matrix<double>("output");
        const double max_diff = (y.cast<double>() - reference).cwiseAbs().maxCoeff();
        const double max_ref = reference.cwiseAbs().maxCoeff();

        std::printf("layer     %s\n", path.c_str());
        std::printf("shape     B=%ld N=%ld D=%ld, %ld query heads, %ld KV heads, head_dim %ld, %s\n",
                    static_cast<long>(batch), static_cast<long>(x.rows() / std::max<gattn::Index>(batch, 1)),
                    static_cast<long>(config.d_model), static_cast<long>(config.num_heads),
                    static_cast<long>(config.num_kv_heads), static_cast<long>(config.head_dim),
                    config.causal ? "causal" : "non-causal");
        std::printf("gate      %s\n", gattn::describe(config.gate).c_str());
        std::printf("SIMD      %s\n", gattn::simd::arch_name());
        std::printf("\nagreement with PyTorch (float64 reference)\n");
        std::printf("  max |gattn - torch| = %.3g   (max |torch| = %.3g)\n", max_diff, max_ref);
        double decode_diff = 0;
        if (config.causal) {
            // The same sequences token by token, as a generating model runs them: each step
            // appends one token per sequence to the cache and attends to everything before it.
            const gattn::Index n = x.rows() / batch;
            auto cache = layer.make_cache(batch, n);
            gattn::RowMatrix<float> step_in(batch, x.cols()), step_out(batch, x.cols());
            for (gattn::Index t = 0; t < n; ++t) {
                for (gattn::Index b = 0; b < batch; ++b) step_in.row(b) = x.row(b * n + t);
                layer.forward(step_in, cache, step_out);
                for (gattn::Index b = 0; b < batch; ++b)
                    decode_diff = std::max(
                        decode_diff, (step_out.row(b).cast<double>() - reference.row(b * n + t)).cwiseAbs().maxCoeff());
            }
            std::printf("  decoded token by token with a KV cache: max |gattn - torch| = %.3g\n", decode_diff);
        }
        const bool agrees = std::max(max_diff, decode_diff) <= 1e-4 * std::max(1.0, max_ref);
        std::printf("\ngate statistics (arXiv:2505.06708, Table 4)\n");
        std::printf("  mean gate score              %.4f\n", trace.mean_gate_score());
        std::printf("  first-token attention share  %.4f\n", trace.first_token_attention_share());
        std::printf("  largest |output| (M-Act)     %.4f\n", static_cast<double>(trace.max_abs_output));

        // The same layer without its gate: same projections and SDPA, no gate_proj.
        gattn::AttentionConfig plain_config = config;
        plain_config.gate = {};
        gattn::AttentionWeights<float> plain_weights = weights;
        plain_weights.gate_proj_weight.resize(0, 0);
        plain_weights.gate_proj_bias.resize(0);
        if (config.gate.layout != gattn::GateLayout::Separate) {
            std::printf("\n(timing skipped: the gate is fused into q_proj)\n");
            return agrees ? 0 : 1;
        }
        const gattn::GatedMultiHeadAttention<float> plain(plain_config, plain_weights);
        gattn::RowMatrix<float> out(x.rows(), x.cols());
        const int reps = 21;
        layer.forward(x, batch, out);  // warm up
        const double gated_ms = median_ms([&] { layer.forward(x, batch, out); }, reps);
        const double plain_ms = median_ms([&] { plain.forward(x, batch, out); }, reps);
        std::printf("\nforward time (median of %d)\n", reps);
        std::printf("  gated    %.3f ms\n  ungated  %.3f ms\n  ratio    %.3f\n", gated_ms, plain_ms,
                    gated_ms / plain_ms);
        return agrees ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "layer_from_pytorch: %s\n", e.what());
        return 2;
    }
}
