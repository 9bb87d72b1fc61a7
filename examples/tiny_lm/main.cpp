// SPDX-License-Identifier: Apache-2.0
// Runs the three tiny byte-level language models of assets/tiny_lm (a baseline, its G1
// elementwise sigmoid-gated twin and its twin with gpt-oss's learned attention sinks, trained on
// Debian's fortunes by scripts/train_tiny_lm.py) through gattn: from each, a continuation
// sampled with temperature, top-k and top-p from a fixed seed and the greedy one, with the
// longest substring each repeats; held-out perplexity; tokens per second (median and range of
// several runs); and the paper's attention-sink and gate-sparsity measures per layer
// (first-token attention F-Attn, mean gate score, largest hidden activation M-Act). Writes
// F-Attn per layer and head as CSV for scripts/plot_sink.py.
//
// Usage: tiny_lm [assets_dir] [csv_out] [prompt] [--temperature T] [--top-k K] [--top-p P]
//                [--seed S] [--length N] [--runs R]   (--help)
//   defaults: assets/tiny_lm, tiny_lm_sink.csv, the prompt of the models' reference outputs
//   (chosen by the training script as the one whose 200-byte greedy samples loop least),
//   temperature 0.8, top-k 40, top-p 0.95 (llama.cpp's defaults), seed 1, 200 bytes, 5 runs.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "tiny_lm.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using Scalar = float;

struct Settings {
    std::string prompt;
    tiny_lm::Sampling sampling;
    std::uint64_t seed = 1;
    gattn::Index length = 200, runs = 5;
};

struct Report {
    std::string name, greedy, sampled;
    long long parameters = 0;
    double nll = 0;
    std::vector<double> prefill_tokens_per_s, decode_tokens_per_s;  // one per run
    gattn::Index windows = 0, window = 0;
    std::vector<std::vector<double>> first_token_attention;  // [layer][head], mean over queries ≥ 1
    std::vector<double> gate_mean, max_abs_hidden;           // per layer
};

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// "median (min-max)" of the runs' figures.
std::string spread(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const std::size_t n = v.size();
    const double median = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.0f (%.0f-%.0f)", median, v.front(), v.back());
    return buf;
}

// Non-printable bytes as '?'; newlines as "\n" (quoted) or as a new indented line (text).
std::string printable(const std::string& s, bool quoted) {
    std::string out;
    for (unsigned char c : s) {
        if (c == '\n')
            out += quoted ? "\\n" : "\n    ";
        else if (c == '\t' || (c >= 32 && c < 127))
            out += static_cast<char>(c);
        else
            out += '?';
    }
    return out;
}

Report run(const std::string& dir, const std::string& name, const std::string& heldout, const Settings& settings) {
    Report rep;
    rep.name = name;
    const tiny_lm::TinyLM<Scalar> model(dir);
    const gattn::SafetensorsFile file(dir + "/model.safetensors");
    for (const std::string& t : file.names()) rep.parameters += file.info(t).numel();

    const gattn::Index L = model.num_layers(), H = model.attention_config().num_attention_heads;
    const gattn::Index window = model.context(), batch = 8;
    rep.window = window;
    rep.first_token_attention.assign(L, std::vector<double>(H, 0.0));
    rep.gate_mean.assign(L, 0.0);
    rep.max_abs_hidden.assign(L, 0.0);
    double queries = 0, gate_values = 0;
    rep.nll = tiny_lm::heldout_nll(model, heldout, window, 1 << 30, batch,
                                   [&](const tiny_lm::LayerStats<Scalar>& s, gattn::Index windows) {
                                       for (gattn::Index l = 0; l < L; ++l) {
                                           const auto& first = s.first_token_attention[l];
                                           for (gattn::Index r = 0; r < first.rows(); ++r) {
                                               if (r % window == 0) continue;  // query 0 can only attend to itself
                                               for (gattn::Index h = 0; h < H; ++h)
                                                   rep.first_token_attention[l][h] += first(r, h);
                                           }
                                           rep.gate_mean[l] += s.gate_scores[l].template cast<double>().sum();
                                           rep.max_abs_hidden[l] = std::max(rep.max_abs_hidden[l], s.max_abs_hidden[l]);
                                       }
                                       queries += double(windows * (window - 1));
                                       gate_values += double(s.gate_scores[0].size());
                                       rep.windows += windows;
                                   });
    for (gattn::Index l = 0; l < L; ++l) {
        for (double& v : rep.first_token_attention[l]) v /= queries;
        rep.gate_mean[l] = gate_values > 0 ? rep.gate_mean[l] / gate_values : 1.0;  // ungated: gate ≡ 1
    }

    // Speed, each run: prefill of `batch` held-out windows in one forward call, and greedy
    // decoding steps after the prompt (one token per forward call, KV cache; the prompt's
    // prefill and the cache allocation are not timed).
    const std::vector<int> first_windows = tiny_lm::encode(heldout.substr(0, static_cast<std::size_t>(batch * window)));
    const std::vector<int> prompt_tokens = tiny_lm::encode(settings.prompt);
    const gattn::Index count = settings.length;
    for (gattn::Index run_i = 0; run_i < settings.runs; ++run_i) {
        auto caches = model.make_caches(batch, window);
        auto t0 = Clock::now();
        model.forward(first_windows, caches);
        rep.prefill_tokens_per_s.push_back(double(batch * window) / seconds_since(t0));

        caches = model.make_caches(1, static_cast<gattn::Index>(prompt_tokens.size()) + count);
        tiny_lm::Matrix<Scalar> logits = model.forward(prompt_tokens, caches);
        std::vector<int> generated;
        t0 = Clock::now();
        for (gattn::Index t = 0; t < count; ++t) {
            gattn::Index next = 0;
            logits.row(logits.rows() - 1).maxCoeff(&next);
            generated.push_back(static_cast<int>(next));
            if (t + 1 < count) logits = model.forward({static_cast<int>(next)}, caches);
        }
        if (count > 1) rep.decode_tokens_per_s.push_back(double(count - 1) / seconds_since(t0));
        rep.greedy = tiny_lm::decode(generated);
    }
    // The sampled continuation: every model draws from its own generator seeded alike.
    tiny_lm::Sampler sampler(settings.sampling, settings.seed);
    rep.sampled = tiny_lm::decode(model.generate(prompt_tokens, count, sampler));
    return rep;
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{
        "Runs the three tiny byte-level language models of assets/tiny_lm (a baseline, its G1-gated\n"
        "twin and its twin with learned sinks) through gattn: sampled and greedy continuations,\n"
        "held-out perplexity, speed, attention-sink statistics."};
    std::string dir = "assets/tiny_lm", csv = "tiny_lm_sink.csv";
    Settings settings;
    std::string& prompt = settings.prompt;
    app.add_option("assets_dir", dir, "directory with baseline/, gated/, sinks/ and heldout.txt")
        ->check(CLI::ExistingDirectory)
        ->capture_default_str();
    app.add_option("csv_out", csv, "where to write first-token attention per layer and head")->capture_default_str();
    app.add_option("prompt", prompt,
                   "prompt of the continuations (default: the one in baseline/reference.safetensors)");
    // Ranges are checked below, with the sampler's own messages.
    app.add_option("--temperature", settings.sampling.temperature, "sampling: logits divided by it, >= 0 (0: greedy)")
        ->capture_default_str();
    app.add_option("--top-k", settings.sampling.top_k, "sampling: the k most probable bytes stay, >= 0 (0: all)")
        ->capture_default_str();
    app.add_option("--top-p", settings.sampling.top_p,
                   "sampling: then the fewest most probable bytes whose probability sums to at least p, in (0, 1] "
                   "(1: all)")
        ->capture_default_str();
    app.add_option("--seed", settings.seed, "seed of the sampling's std::mt19937_64")->capture_default_str();
    app.add_option("--length", settings.length, "bytes generated per continuation, >= 1")->capture_default_str();
    app.add_option("--runs", settings.runs, "timed runs per model, >= 1 (speed: their median, min and max)")
        ->capture_default_str();
    CLI11_PARSE(app, argc, argv);
    std::printf("gattn %s: %s\n", gattn::version(), gattn::describe(gattn::instruction_sets()).c_str());
    try {
        tiny_lm::validate(settings.sampling);
        if (settings.length < 1)
            throw std::invalid_argument("--length: expected >= 1, got " + std::to_string(settings.length));
        if (settings.runs < 1)
            throw std::invalid_argument("--runs: expected >= 1, got " + std::to_string(settings.runs));
        std::ifstream in(dir + "/heldout.txt", std::ios::binary);
        if (!in) throw gattn::io_error("cannot open " + dir + "/heldout.txt");
        std::stringstream text;
        text << in.rdbuf();
        const std::string heldout = text.str();
        if (prompt.empty()) {
            const gattn::SafetensorsFile reference(dir + "/baseline/reference.safetensors");
            const auto found = reference.metadata().find("prompt");
            if (found == reference.metadata().end())
                throw gattn::io_error(dir + "/baseline/reference.safetensors: no \"prompt\" in its metadata");
            prompt = found->second;
        }

        std::vector<Report> reports;
        for (const char* name : {"baseline", "gated", "sinks"})
            reports.push_back(run(dir + "/" + name, name, heldout, settings));

        std::printf(
            "Three byte-level models trained on Debian's fortunes, identical but for the attention's\n"
            "way out of a sink: none, the G1 gate, or a learned sink logit per head (gpt-oss).\n\n");
        const tiny_lm::Sampling& s = settings.sampling;
        std::printf(
            "Continuations of \"%s\", %lld bytes each: sampled with temperature %g, top-k %lld,\n"
            "top-p %g from seed %llu (--temperature, --top-k, --top-p, --seed), and greedy (the most\n"
            "probable byte at each step); \"repeat\": the longest substring that occurs twice.\n",
            printable(prompt, true).c_str(), static_cast<long long>(settings.length), s.temperature, s.top_k, s.top_p,
            static_cast<unsigned long long>(settings.seed));
        for (const Report& r : reports) {
            std::printf("[%s] sampled, repeat %zu bytes\n    %s\n", r.name.c_str(), tiny_lm::longest_repeat(r.sampled),
                        printable(r.sampled, false).c_str());
            std::printf("[%s] greedy, repeat %zu bytes\n    %s\n", r.name.c_str(), tiny_lm::longest_repeat(r.greedy),
                        printable(r.greedy, false).c_str());
        }

        const long long window = reports[0].window;
        std::printf(
            "\nHeld-out text: %lld windows of %lld bytes (float, gattn). tokens/s: median (min-max) of\n"
            "%lld runs; prefill of 8 windows in one call, decoding one token per call after the prompt\n",
            static_cast<long long>(reports[0].windows), window, static_cast<long long>(settings.runs));
        std::printf("%-9s %8s %11s %10s %22s %20s\n", "model", "params", "perplexity", "bits/byte", "prefill tok/s",
                    "decode tok/s");
        for (const Report& r : reports)
            std::printf("%-9s %8lld %11.3f %10.3f %22s %20s\n", r.name.c_str(), r.parameters, std::exp(r.nll),
                        r.nll / std::log(2.0), spread(r.prefill_tokens_per_s).c_str(),
                        r.decode_tokens_per_s.empty() ? "-" : spread(r.decode_tokens_per_s).c_str());

        std::printf(
            "\nAttention sink and sparsity per layer (held-out text; F-Attn: mean attention on the first\n"
            "token over heads and queries 1..%lld, a sink's share not counted; M-Act: largest |hidden|\n"
            "after the layer)\n",
            window - 1);
        std::printf("%-6s %12s %12s %12s %10s %12s %12s %12s\n", "", "F-Attn", "F-Attn", "F-Attn", "gate", "M-Act",
                    "M-Act", "M-Act");
        std::printf("%-6s %12s %12s %12s %10s %12s %12s %12s\n", "layer", "baseline", "gated", "sinks", "mean",
                    "baseline", "gated", "sinks");
        const std::size_t L = reports[0].gate_mean.size();
        auto mean = [](const std::vector<double>& v) {
            double s = 0;
            for (double x : v) s += x;
            return v.empty() ? 0.0 : s / double(v.size());
        };
        std::vector<std::vector<double>> fa(reports.size());  // [model][layer] mean over heads
        for (std::size_t m = 0; m < reports.size(); ++m)
            for (std::size_t l = 0; l < L; ++l) fa[m].push_back(mean(reports[m].first_token_attention[l]));
        for (std::size_t l = 0; l < L; ++l)
            std::printf("%-6zu %12.4f %12.4f %12.4f %10.4f %12.2f %12.2f %12.2f\n", l, fa[0][l], fa[1][l], fa[2][l],
                        reports[1].gate_mean[l], reports[0].max_abs_hidden[l], reports[1].max_abs_hidden[l],
                        reports[2].max_abs_hidden[l]);
        std::printf("%-6s %12.4f %12.4f %12.4f %10.4f\n", "all", mean(fa[0]), mean(fa[1]), mean(fa[2]),
                    mean(reports[1].gate_mean));

        std::ofstream out(csv);
        out << "model,layer,head,first_token_attention\n";
        for (const Report& r : reports)
            for (std::size_t l = 0; l < L; ++l)
                for (std::size_t h = 0; h < r.first_token_attention[l].size(); ++h)
                    out << r.name << ',' << l << ',' << h << ',' << r.first_token_attention[l][h] << '\n';
        if (!out) throw gattn::io_error("cannot write " + csv);
        std::printf("\nF-Attn per layer and head: %s\n", csv.c_str());
    } catch (const std::exception& e) {
        std::fprintf(stderr, "tiny_lm: %s\n", e.what());
        return 1;
    }
    return 0;
}
