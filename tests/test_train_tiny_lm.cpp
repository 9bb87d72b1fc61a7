// SPDX-License-Identifier: Apache-2.0
// The C++ trainer of examples/train_tiny_lm against scripts/train_tiny_lm.py: from the same
// initial weights, on the same windows, its first 20 training steps give the losses the
// script's own training step gave in PyTorch (tests/data/train_tiny_lm, written by
// `scripts/train_tiny_lm.py --trainer-fixture tests/data/train_tiny_lm --small`). Every loss
// after the first depends on every gradient of the steps before it (through clipping and
// AdamW), so agreement to 1e-9 in double checks the whole backward pass, attention included.

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "train_tiny_lm/trainer.hpp"

namespace {

const std::string kFixture = GATTN_TEST_DATA_DIR "/train_tiny_lm/";

double worst_relative(const std::vector<double>& got, const std::vector<double>& want) {
    EXPECT_EQ(got.size(), want.size());
    double worst = 0;
    for (std::size_t i = 0; i < std::min(got.size(), want.size()); ++i)
        worst = std::max(worst, std::abs(got[i] - want[i]) / std::abs(want[i]));
    return worst;
}

// One thread: at these sizes, threads cost more than they give.
class TrainTinyLm : public ::testing::TestWithParam<std::string> {
protected:
    void SetUp() override { gattn::set_num_threads(1); }
    void TearDown() override { gattn::set_num_threads(m_threads); }

private:
    int m_threads = gattn::num_threads();
};

TEST_P(TrainTinyLm, DoubleMatchesTheScriptsFloat64Losses) {
    const auto f = train_tiny_lm::Fixture::load(kFixture + GetParam());
    ASSERT_EQ(f.losses_float64.size(), 20u);
    const std::vector<double> losses = f.run<double>();
    EXPECT_LE(worst_relative(losses, f.losses_float64), 1e-9);
    // The loss moves over the 20 steps by far more than the tolerance: the check sees training.
    EXPECT_GT(std::abs(f.losses_float64.front() - f.losses_float64.back()), 1e-3);
}

TEST_P(TrainTinyLm, FloatMatchesTheScriptsFloat32Losses) {
    const auto f = train_tiny_lm::Fixture::load(kFixture + GetParam());
    const std::vector<double> losses = f.run<float>();
    EXPECT_LE(worst_relative(losses, f.losses_float64), 1e-3);
    EXPECT_LE(worst_relative(losses, f.losses_float32), 1e-3);
}

TEST_P(TrainTinyLm, ScheduleIsTheScripts) {
    const auto f = train_tiny_lm::Fixture::load(kFixture + GetParam());
    for (std::size_t i = 0; i < f.learning_rates.size(); ++i)
        EXPECT_NEAR(f.hyper.learning_rate(static_cast<gattn::Index>(i + 1)), f.learning_rates[i],
                    1e-15 * f.learning_rates[i])
            << "step " << i + 1;
}

INSTANTIATE_TEST_SUITE_P(Models, TrainTinyLm, ::testing::Values("baseline", "gated", "sinks"),
                         [](const auto& info) { return info.param; });

TEST(TrainTinyLmErrors, BadWindowsAreRefusedAndChangeNothing) {
    const auto f = train_tiny_lm::Fixture::load(kFixture + "gated");
    train_tiny_lm::Model<double> model(f.config, f.initial_weights);
    const auto before = model.parameters().front().value;
    std::vector<std::int64_t> windows = f.windows.front();
    windows.pop_back();  // not batch x (N + 1)
    EXPECT_THROW(model.train_step(windows, f.hyper.batch, f.hyper), std::invalid_argument);
    windows = f.windows.front();
    windows[5] = 256;  // outside the vocabulary
    try {
        model.train_step(windows, f.hyper.batch, f.hyper);
        ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("windows: expected tokens in [0, 256), got 256 at 5"), std::string::npos)
            << e.what();
    }
    EXPECT_THROW(model.train_step(f.windows.front(), 0, f.hyper), std::invalid_argument);
    EXPECT_EQ(model.step(), 0);
    EXPECT_EQ(model.parameters().front().value, before);
}

// A config.json without one of the model's fields, or with it of another JSON type: an
// io_error naming the file and the field, as ModelConfig::load documents.
TEST(TrainTinyLmErrors, MalformedConfigIsAnIoError) {
    std::ifstream in(kFixture + "gated/config.json");
    const nlohmann::json good = nlohmann::json::parse(in);
    const std::string path = (std::filesystem::temp_directory_path() / "gattn_train_tiny_lm_config.json").string();
    for (const auto& [what, edit] : std::vector<std::pair<std::string, std::function<void(nlohmann::json&)>>>{
             {"vocab_size", [](nlohmann::json& j) { j.erase("vocab_size"); }},
             {"intermediate_size", [](nlohmann::json& j) { j["intermediate_size"] = "64"; }}}) {
        nlohmann::json j = good;
        edit(j);
        std::ofstream(path) << j.dump();
        try {
            (void)train_tiny_lm::ModelConfig::load(path);
            ADD_FAILURE() << "no exception for " << what;
        } catch (const gattn::io_error& e) {
            EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
        }
    }
    std::filesystem::remove(path);
}

// The schedule past the warmup, by hand: steps = 1100, warmup 100, peak 3e-3, floor 3e-4.
TEST(TrainTinyLmSchedule, CosineDecayByHand) {
    train_tiny_lm::Hyper h;
    h.steps = 1100;
    EXPECT_DOUBLE_EQ(h.learning_rate(50), 1.5e-3);
    EXPECT_DOUBLE_EQ(h.learning_rate(100), 3e-3);
    EXPECT_DOUBLE_EQ(h.learning_rate(600), 3e-4 + 2.7e-3 * 0.5);  // half-way: cos(π/2) = 0
    EXPECT_DOUBLE_EQ(h.learning_rate(1100), 3e-4);
}

}  // namespace
