// SPDX-License-Identifier: Apache-2.0
// The trained models of assets/tiny_lm run through gattn (examples/tiny_lm/tiny_lm.hpp) against
// what PyTorch computed for them in float64 (reference.safetensors, written by
// scripts/train_tiny_lm.py): logits of a prompt and its greedy continuation, the greedy tokens
// themselves (KV-cache decoding in gattn), and the held-out negative log-likelihood.

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include "tiny_lm/tiny_lm.hpp"

namespace {

const std::string kAssets = GATTN_ASSETS_DIR "/tiny_lm";

struct Reference {
    std::vector<int> prompt, generated;
    gattn::RowMatrix<double> logits;  // [P + G − 1, vocab]: row t predicts token t + 1
    double heldout_nll = 0, min_margin = 0;

    explicit Reference(const std::string& model) {
        const gattn::SafetensorsFile f(kAssets + "/" + model + "/reference.safetensors");
        for (double t : f.values<double>("prompt_tokens")) prompt.push_back(static_cast<int>(t));
        for (double t : f.values<double>("generated_tokens")) generated.push_back(static_cast<int>(t));
        logits = f.matrix<double>("logits");
        heldout_nll = f.values<double>("heldout_nll").at(0);
        min_margin = f.values<double>("min_top2_margin").at(0);
    }
};

std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
}

// Logit tolerance: measured errors are 2e-5 (float) and 3e-14 (double) on logits of magnitude ~10.
template <class Scalar>
constexpr double kLogitTol = std::is_same_v<Scalar, double> ? 1e-11 : 2e-4;

template <class Scalar>
class TinyLM : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(TinyLM, Scalars);

template <class Scalar>
void check_model(const std::string& name) {
    SCOPED_TRACE(name);
    const Reference ref(name);
    ASSERT_EQ(ref.generated.size(), 64u);
    ASSERT_EQ(ref.logits.rows(), static_cast<gattn::Index>(ref.prompt.size() + ref.generated.size() - 1));
    // The stored continuation must be decidable in float: no near-tie among the greedy choices.
    ASSERT_GT(ref.min_margin, 10 * kLogitTol<float>);
    const tiny_lm::TinyLM<Scalar> model(kAssets + "/" + name);

    // One prefill of the whole teacher-forced sequence.
    std::vector<int> sequence = ref.prompt;
    sequence.insert(sequence.end(), ref.generated.begin(), ref.generated.end() - 1);
    {
        auto caches = model.make_caches(1, static_cast<gattn::Index>(sequence.size()));
        const gattn::RowMatrix<double> logits = model.forward(sequence, caches).template cast<double>();
        EXPECT_LE((logits - ref.logits).cwiseAbs().maxCoeff(), kLogitTol<Scalar>);
    }

    // Greedy decoding through the KV cache: the same tokens as PyTorch, step logits agree.
    EXPECT_EQ(model.generate(ref.prompt, 64), ref.generated);
    auto caches = model.make_caches(1, static_cast<gattn::Index>(sequence.size()));
    gattn::RowMatrix<double> logits = model.forward(ref.prompt, caches).template cast<double>();
    const gattn::Index P = static_cast<gattn::Index>(ref.prompt.size());
    EXPECT_LE((logits - ref.logits.topRows(P)).cwiseAbs().maxCoeff(), kLogitTol<Scalar>);
    for (gattn::Index t = 0; t + 1 < 64; ++t) {
        logits = model.forward({ref.generated[t]}, caches).template cast<double>();
        EXPECT_LE((logits - ref.logits.row(P + t)).cwiseAbs().maxCoeff(), kLogitTol<Scalar>) << "step " << t;
    }

    // Held-out NLL over the first 8 windows of 256 bytes (the script's convention).
    const double nll = tiny_lm::heldout_nll(model, read_file(kAssets + "/heldout.txt"), 256, 8);
    EXPECT_NEAR(nll, ref.heldout_nll, (std::is_same_v<Scalar, double> ? 1e-10 : 1e-5));
}

TYPED_TEST(TinyLM, BaselineMatchesPyTorch) { check_model<TypeParam>("baseline"); }
TYPED_TEST(TinyLM, GatedMatchesPyTorch) { check_model<TypeParam>("gated"); }

// Statistics the demo reports: shapes, ranges, and the ungated model has no gate scores.
TEST(TinyLMStats, ShapesAndRanges) {
    for (const char* name : {"baseline", "gated"}) {
        SCOPED_TRACE(name);
        const tiny_lm::TinyLM<double> model(kAssets + "/" + name);
        const auto& c = model.attention_config();
        std::vector<int> tokens = tiny_lm::encode(read_file(kAssets + "/heldout.txt").substr(0, 2 * 40));
        auto caches = model.make_caches(2, 40);
        tiny_lm::LayerStats<double> stats;
        model.forward(tokens, caches, &stats);
        ASSERT_EQ(stats.first_token_attention.size(), static_cast<std::size_t>(model.num_layers()));
        for (gattn::Index l = 0; l < model.num_layers(); ++l) {
            const auto& first = stats.first_token_attention[l];
            ASSERT_EQ(first.rows(), 80);
            ASSERT_EQ(first.cols(), c.num_attention_heads);
            EXPECT_TRUE((first.array() >= 0).all() && (first.array() <= 1 + 1e-12).all());
            // Query 0 of each sequence sees only the first token.
            EXPECT_NEAR(first(0, 0), 1.0, 1e-12);
            EXPECT_NEAR(first(40, 0), 1.0, 1e-12);
            EXPECT_EQ(stats.gate_scores[l].cols(), c.attn_output_gate ? c.num_attention_heads * c.head_dim : 0);
            EXPECT_GT(stats.max_abs_hidden[l], 0.0);
        }
    }
}

}  // namespace
