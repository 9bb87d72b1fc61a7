// SPDX-License-Identifier: Apache-2.0
// Trains one of the demo's tiny byte-level language models (baseline, gated or sinks; see
// trainer.hpp and examples/tiny_lm) with gattn's attention forward and backward, or checks the
// trainer against scripts/train_tiny_lm.py.
//
//   train_tiny_lm --check DIR
//       DIR as written by `scripts/train_tiny_lm.py --trainer-fixture DIR [--small]`: for each
//       model in it, the first steps in double and in float from the script's initial weights
//       on the script's windows; prints the worst relative difference of the losses to the
//       script's float64 (and float32) losses; exits 1 unless double agrees within 1e-9 and
//       float within 1e-3.
//   train_tiny_lm --config CONFIG --weights INIT --out DIR [--steps N] [--until S] ...
//       trains from INIT (e.g. a fixture's initial.safetensors: the script's initialisation) on
//       windows of the fortunes' training text drawn by a std::mt19937_64 from --seed (its own
//       batch order, not the script's), with the script's AdamW, schedule and clipping. Writes
//       DIR/model.safetensors and DIR/config.json (what examples/tiny_lm loads),
//       DIR/checkpoint.safetensors + DIR/checkpoint.json (weights, AdamW moments, step and the
//       generator's state; --resume continues from them) and DIR/training_log.json (per step:
//       loss and wall time; every --eval-every steps the held-out loss over every full
//       256-byte window of the held-out text, as the script computes it).

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "trainer.hpp"

namespace {

namespace fs = std::filesystem;
using train_tiny_lm::Index;
using Clock = std::chrono::steady_clock;

double worst_relative(const std::vector<double>& got, const std::vector<double>& want) {
    double worst = 0;
    for (std::size_t i = 0; i < got.size(); ++i)
        worst = std::max(worst, std::abs(got[i] - want[i]) / std::abs(want[i]));
    return worst;
}

int check(const std::string& dir) {
    bool ok = true, any = false;
    for (const char* name : {"baseline", "gated", "sinks"}) {
        const fs::path model_dir = fs::path(dir) / name;
        if (!fs::is_directory(model_dir)) continue;
        any = true;
        const auto f = train_tiny_lm::Fixture::load(model_dir.string());
        auto t0 = Clock::now();
        const std::vector<double> d = f.run<double>();
        const double seconds_double = std::chrono::duration<double>(Clock::now() - t0).count();
        t0 = Clock::now();
        const std::vector<double> s = f.run<float>();
        const double seconds_float = std::chrono::duration<double>(Clock::now() - t0).count();
        const double wd = worst_relative(d, f.losses_float64), wf = worst_relative(s, f.losses_float64),
                     wf32 = worst_relative(s, f.losses_float32);
        const bool good = wd <= 1e-9 && wf <= 1e-3;
        ok = ok && good;
        std::printf(
            "%-8s %zu steps of %lld windows of %lld bytes: double vs float64 %.3g, float vs float64 %.3g "
            "(vs float32 %.3g); %.1f ms/step double, %.1f ms/step float  %s\n",
            name, d.size(), static_cast<long long>(f.hyper.batch), static_cast<long long>(f.hyper.window), wd, wf, wf32,
            1e3 * seconds_double / static_cast<double>(d.size()), 1e3 * seconds_float / static_cast<double>(s.size()),
            good ? "ok" : "MISMATCH");
    }
    if (!any) {
        std::fprintf(stderr, "train_tiny_lm: --check: no baseline, gated or sinks directory in %s\n", dir.c_str());
        return 1;
    }
    return ok ? 0 : 1;
}

struct Options {
    std::string config, weights, out, fortunes = "/usr/share/games/fortunes";
    Index steps = 1500, until = 0, batch = 16, eval_every = 100, checkpoint_every = 100;
    std::uint64_t seed = 1;
    int threads = 1;
    bool resume = false;
    bool steps_given = false, batch_given = false;  // on the command line (else a resumed run's own)
};

void write_text(const fs::path& path, const std::string& text) {
    const fs::path tmp = path.string() + ".tmp";
    {
        std::ofstream out(tmp);
        out << text;
        if (!out) throw gattn::io_error("train_tiny_lm: cannot write " + tmp.string());
    }
    fs::rename(tmp, path);
}

template <class S>
void save(train_tiny_lm::Model<S>& model, const Options& o, const std::mt19937_64& rng, const nlohmann::json& log) {
    const fs::path dir(o.out);
    train_tiny_lm::write_safetensors((dir / "model.safetensors.tmp").string(), train_tiny_lm::weight_tensors(model),
                                     {{"format", "pt"}});
    fs::rename(dir / "model.safetensors.tmp", dir / "model.safetensors");
    nlohmann::json config = model.config().json;
    config["torch_dtype"] = "float32";
    write_text(dir / "config.json", config.dump(2) + "\n");
    train_tiny_lm::write_safetensors((dir / "checkpoint.safetensors.tmp").string(),
                                     train_tiny_lm::checkpoint_tensors(model));
    fs::rename(dir / "checkpoint.safetensors.tmp", dir / "checkpoint.safetensors");
    std::ostringstream state;
    state << rng;
    write_text(
        dir / "checkpoint.json",
        nlohmann::json{{"step", model.step()}, {"rng", state.str()}, {"steps", o.steps}, {"batch", o.batch}}.dump(2) +
            "\n");
    write_text(dir / "training_log.json", log.dump(1) + "\n");
}

/// --resume: the checkpoint's schedule length and batch, which the resumed run keeps (a
/// different --steps would change the learning rate of every later step, a different --batch
/// the windows drawn); given on the command line, they must agree.
nlohmann::json read_checkpoint(Options& o) {
    const fs::path path = fs::path(o.out) / "checkpoint.json";
    std::ifstream in(path);
    if (!in) throw gattn::io_error("train_tiny_lm: --resume: cannot open " + path.string());
    const nlohmann::json ck = nlohmann::json::parse(in);
    auto keep = [&](const char* name, Index& value, bool given) {
        const Index saved = ck.at(name).get<Index>();
        if (given && value != saved)
            throw std::invalid_argument(std::string("--") + name + " " + std::to_string(value) + " differs from " +
                                        path.string() + "'s " + std::to_string(saved) +
                                        "; a resumed run keeps its schedule (leave --" + name + " out)");
        value = saved;
    };
    keep("steps", o.steps, o.steps_given);
    keep("batch", o.batch, o.batch_given);
    return ck;
}

int train(Options o) {
    const nlohmann::json checkpoint = o.resume ? read_checkpoint(o) : nlohmann::json();
    using S = float;
    gattn::set_num_threads(o.threads);
    const fs::path dir(o.out);
    fs::create_directories(dir);
    const auto config = train_tiny_lm::ModelConfig::load(o.config);
    train_tiny_lm::Hyper hp;
    hp.steps = o.steps;
    hp.batch = o.batch;
    hp.window = config.context + 1;
    hp.warmup_steps = std::min<Index>(100, std::max<Index>(1, o.steps / 10));  // as the script
    const Index until = o.until > 0 ? std::min(o.until, o.steps) : o.steps;

    const train_tiny_lm::Corpus corpus = train_tiny_lm::Corpus::load(o.fortunes);
    std::printf("%zu training fortunes (%zu bytes), %zu held out (%zu bytes)\n", corpus.train_fortunes,
                corpus.train.size(), corpus.heldout_fortunes, corpus.heldout.size());

    std::mt19937_64 rng(o.seed);
    nlohmann::json log = {{"config", o.config},   {"init", o.weights},
                          {"steps", o.steps},     {"batch", o.batch},
                          {"window", hp.window},  {"seed", o.seed},
                          {"threads", o.threads}, {"records", nlohmann::json::array()}};
    std::unique_ptr<train_tiny_lm::Model<S>> model;
    if (o.resume) {
        model = std::make_unique<train_tiny_lm::Model<S>>(config, (dir / "checkpoint.safetensors").string());
        model->load_moments((dir / "checkpoint.safetensors").string(), checkpoint.at("step").get<Index>());
        std::istringstream state(checkpoint.at("rng").get<std::string>());
        state >> rng;
        std::ifstream log_in(dir / "training_log.json");
        if (log_in) log = nlohmann::json::parse(log_in);
        auto& records = log["records"];  // drop what was logged after the checkpoint
        while (!records.empty() && records.back().at("step").get<Index>() > model->step())
            records.erase(records.size() - 1);
        std::printf("resuming at step %lld\n", static_cast<long long>(model->step()));
    } else {
        model = std::make_unique<train_tiny_lm::Model<S>>(config, o.weights);
    }

    const Index span = hp.window, text = static_cast<Index>(corpus.train.size());
    std::uniform_int_distribution<Index> offset(0, text - span);
    std::vector<std::int64_t> windows(static_cast<std::size_t>(hp.batch * span));
    const auto t0 = Clock::now();
    const double offset_seconds = log["records"].empty() ? 0.0 : log["records"].back().value("seconds", 0.0);
    while (model->step() < until) {
        for (Index b = 0; b < hp.batch; ++b) {
            const Index start = offset(rng);
            for (Index t = 0; t < span; ++t)
                windows[b * span + t] = static_cast<unsigned char>(corpus.train[static_cast<std::size_t>(start + t)]);
        }
        const auto t_step = Clock::now();
        const double loss = model->train_step(windows, hp.batch, hp);
        const double step_seconds = std::chrono::duration<double>(Clock::now() - t_step).count();
        const Index step = model->step();
        nlohmann::json record = {{"step", step},
                                 {"loss", loss},
                                 {"lr", hp.learning_rate(step)},
                                 {"step_seconds", step_seconds},
                                 {"seconds",
                                  offset_seconds + std::chrono::duration<double>(Clock::now() - t0).count()}};
        if (step % o.eval_every == 0 || step == until) {
            const auto [heldout, count] = train_tiny_lm::mean_nll(*model, corpus.heldout, config.context);
            record["heldout_loss"] = heldout;
            record["heldout_predictions"] = count;
            std::printf("step %6lld  loss %.4f  held-out %.4f  lr %.2e  %.0f ms/step  %.0f s\n",
                        static_cast<long long>(step), loss, heldout, hp.learning_rate(step), 1e3 * step_seconds,
                        record["seconds"].get<double>());
            std::fflush(stdout);
        }
        log["records"].push_back(record);
        if (step % o.checkpoint_every == 0 || step == until) save(*model, o, rng, log);
    }
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
#if defined(__GLIBC__)
    // A step allocates and frees the same large activations each time; by default glibc hands
    // such blocks back to the kernel, and the page faults of taking them again cost twice the
    // step's arithmetic. Keep them in the heap.
    mallopt(M_MMAP_THRESHOLD, 1 << 30);
    mallopt(M_TRIM_THRESHOLD, -1);
#endif
    CLI::App app{"Trains a tiny byte-level LM with gattn's attention backward, or checks the trainer"};
    std::string check_dir;
    Options o;
    app.add_option("--check", check_dir, "a --trainer-fixture directory of scripts/train_tiny_lm.py");
    app.add_option("--config", o.config, "config.json of the model to train");
    app.add_option("--weights", o.weights, "initial weights (safetensors, HF names)");
    app.add_option("--out", o.out, "output directory");
    auto* steps =
        app.add_option("--steps", o.steps, "length of the learning-rate schedule (--resume: the checkpoint's)")
            ->check(CLI::PositiveNumber);
    app.add_option("--until", o.until, "stop after this step (default: --steps); --resume continues");
    auto* batch =
        app.add_option("--batch", o.batch, "windows per step (--resume: the checkpoint's)")->check(CLI::PositiveNumber);
    app.add_option("--eval-every", o.eval_every, "held-out loss every this many steps")->check(CLI::PositiveNumber);
    app.add_option("--checkpoint-every", o.checkpoint_every, "checkpoint every this many steps")
        ->check(CLI::PositiveNumber);
    app.add_option("--seed", o.seed, "seed of the window generator (std::mt19937_64)");
    app.add_option("--threads", o.threads, "gattn threads")->check(CLI::PositiveNumber);
    app.add_option("--fortunes", o.fortunes, "the fortune files (Debian package fortunes)");
    app.add_flag("--resume", o.resume, "continue from --out's checkpoint");
    CLI11_PARSE(app, argc, argv);
    o.steps_given = steps->count() > 0;
    o.batch_given = batch->count() > 0;
    try {
        if (!check_dir.empty()) return check(check_dir);
        if (o.config.empty() || o.out.empty() || (o.weights.empty() && !o.resume)) {
            std::fprintf(stderr, "train_tiny_lm: give --check DIR, or --config, --weights (or --resume) and --out\n");
            return 2;
        }
        return train(o);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "train_tiny_lm: %s\n", e.what());
        return 1;
    }
}
