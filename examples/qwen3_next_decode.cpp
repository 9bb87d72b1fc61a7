// Qwen3-Next / Qwen3.5 gated attention with a KV cache: loads one full-attention layer from a
// Hugging Face checkpoint directory, prefills a prompt of hidden states, then decodes further
// tokens one at a time, printing each step's time and the mean gate score σ(gate).
//
// Usage: qwen3_next_decode [checkpoint_dir [layer [prompt_tokens [new_tokens]]]]  (--help)
//   default: tests/data/qwen3_next (a tiny checkpoint), its first full-attention layer,
//   a 64-token prompt, 8 new tokens. A real Qwen3-Next or Qwen3.5 directory works as well
//   (config.json plus model.safetensors or model.safetensors.index.json and its shards).
// The hidden states are random here; in a model they come from the previous layer's RMSNorm.

#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <gattn/gattn.hpp>
#include <gattn/io/hf_checkpoint.hpp>
#include <nlohmann/json.hpp>

namespace {

/// First layer index whose layer_types entry is "full_attention" (3 in Qwen3-Next).
/// \throws gattn::io_error for a missing or malformed config.json (gattn's own checks first).
gattn::Index first_full_attention_layer(const std::string& dir) {
    const std::string path = dir + "/config.json";
    (void)gattn::load_qwen3_next_config(path, -1);  // io_error naming the file or field
    std::ifstream in(path);
    nlohmann::json j = nlohmann::json::parse(in);
    if (j.contains("text_config")) j = j["text_config"];
    if (j.contains("layer_types"))
        for (std::size_t i = 0; i < j["layer_types"].size(); ++i)
            if (j["layer_types"][i] == "full_attention") return static_cast<gattn::Index>(i);
    return j.value("full_attention_interval", 4) - 1;  // transformers' default: every 4th layer
}

double ms_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"Loads one full-attention layer of a Qwen3-Next or Qwen3.5 checkpoint, prefills a prompt of\n"
                 "random hidden states and decodes further tokens one at a time with a KV cache."};
    std::string dir = "tests/data/qwen3_next";
    long layer_arg = -1, prompt_arg = 64, steps_arg = 8;
    app.add_option("checkpoint_dir", dir, "Hugging Face checkpoint directory (config.json, model.safetensors)")
        ->check(CLI::ExistingDirectory)
        ->capture_default_str();
    app.add_option("layer", layer_arg, "full-attention layer index (default: the first one)")
        ->check(CLI::Range(0L, 100000L));
    app.add_option("prompt_tokens", prompt_arg, "tokens to prefill")->check(CLI::Range(1L, 1L << 24))->capture_default_str();
    app.add_option("new_tokens", steps_arg, "tokens to decode after the prompt")
        ->check(CLI::Range(0L, 1L << 24))
        ->capture_default_str();
    CLI11_PARSE(app, argc, argv);
    std::printf("gattn %s: %s\n", gattn::version(), gattn::describe(gattn::instruction_sets()).c_str());
    try {
        const gattn::Index layer_index = layer_arg >= 0 ? layer_arg : first_full_attention_layer(dir);
        const gattn::Index prompt = prompt_arg, steps = steps_arg;
        const auto layer = gattn::load_qwen3_next_attention<float>(dir, layer_index);
        const gattn::Qwen3NextConfig& c = layer.config();
        std::printf("layer %ld of %s: hidden %ld, %ld query heads, %ld KV heads, head_dim %ld, rotary_dim %ld\n",
                    static_cast<long>(layer_index), dir.c_str(), static_cast<long>(c.hidden_size),
                    static_cast<long>(c.num_attention_heads), static_cast<long>(c.num_key_value_heads),
                    static_cast<long>(c.head_dim), static_cast<long>(c.rotary_dim()));

        std::mt19937 rng(0);
        std::normal_distribution<float> normal;
        auto random_rows = [&](gattn::Index n) {
            gattn::RowMatrix<float> x(n, c.hidden_size);
            for (gattn::Index i = 0; i < x.size(); ++i) x.data()[i] = normal(rng);
            return x;
        };
        auto cache = layer.make_cache(/*batch=*/1, /*capacity=*/prompt + steps);

        std::vector<gattn::Index> positions(static_cast<std::size_t>(prompt));
        for (gattn::Index t = 0; t < prompt; ++t) positions[t] = t;
        gattn::RowMatrix<float> out(prompt, c.hidden_size), gates;
        auto start = std::chrono::steady_clock::now();
        layer.forward(random_rows(prompt), positions, cache, out, {}, &gates);
        std::printf("prefill  %4ld tokens  %8.3f ms  mean gate %.4f\n", static_cast<long>(prompt), ms_since(start),
                    gates.mean());

        for (gattn::Index s = 0; s < steps; ++s) {
            const gattn::Index position = cache.lengths()[0];
            gattn::RowMatrix<float> y(1, c.hidden_size);
            start = std::chrono::steady_clock::now();
            layer.forward(random_rows(1), {position}, cache, y, {}, &gates);
            std::printf("decode   position %4ld  %8.3f ms  mean gate %.4f  |y|max %.4f\n", static_cast<long>(position),
                        ms_since(start), gates.mean(), y.cwiseAbs().maxCoeff());
        }
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "qwen3_next_decode: %s\n", e.what());
        return 1;
    }
}
