// SPDX-License-Identifier: Apache-2.0
#pragma once

// Drawing the next token from a language model's logits with temperature, top-k and top-p
// (nucleus) sampling, in the order Hugging Face transformers applies them:
//
//   z_i = logit_i / temperature                       (temperature 0: the arg-max token)
//   keep the top_k largest z_i                         (top_k 0: all)
//   p_i = e^(z_i − max z) / Σ_kept e^(z_j − max z)
//   keep the fewest most probable tokens whose p sums to at least top_p   (top_p 1: all)
//   draw from the kept tokens, their p renormalised to sum to 1
//
// Tokens are ranked by probability, ties by the lower token id. A draw takes one uniform number
// u in [0, 1) from std::mt19937_64 by hand, (x >> 11) · 2⁻⁵³ (the standard fixes the engine's
// output, not std::uniform_real_distribution's), and picks the first ranked token whose
// cumulative probability exceeds u. So a seed gives the same tokens on every machine, unless
// two builds' float logits differ by enough to move a boundary across u.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace tiny_lm {

/// Temperature, top-k and top-p of a sampled continuation (the defaults are llama.cpp's).
struct Sampling {
    double temperature = 0.8;  ///< logits divided by it; 0: greedy (the arg-max token)
    long long top_k = 40;      ///< the k most probable tokens stay; 0: all
    double top_p = 0.95;       ///< then the fewest most probable whose probability sums to ≥ p; 1: all
};

/// A token and the probability of drawing it.
struct Candidate {
    int token = 0;
    double probability = 0;
};

/// Throws std::invalid_argument naming the field unless temperature is finite and ≥ 0, top_k
/// ≥ 0 and top_p in (0, 1].
inline void validate(const Sampling& s) {
    auto fail = [](const char* field, const char* expected, double got) {
        std::ostringstream m;
        m << "tiny_lm::Sampling: " << field << ": expected " << expected << ", got " << got;
        throw std::invalid_argument(m.str());
    };
    if (!(s.temperature >= 0) || !std::isfinite(s.temperature))
        fail("temperature", "a finite number >= 0", s.temperature);
    if (s.top_k < 0) fail("top_k", "a count >= 0 (0: all tokens)", static_cast<double>(s.top_k));
    if (!(s.top_p > 0 && s.top_p <= 1)) fail("top_p", "a number in (0, 1]", s.top_p);
}

/// The tokens a draw can pick and their probabilities (summing to 1), most probable first,
/// ties by the lower token id. Tokens of probability 0 (a logit of −∞, or one that underflows)
/// are left out. Throws std::invalid_argument for invalid `s` (validate), no logits, a NaN or
/// +∞ logit, or logits that are all −∞.
inline std::vector<Candidate> sampling_distribution(const std::vector<double>& logits, const Sampling& s) {
    validate(s);
    if (logits.empty()) throw std::invalid_argument("tiny_lm::sampling_distribution: logits: expected at least one");
    for (std::size_t i = 0; i < logits.size(); ++i)
        if (std::isnan(logits[i]) || logits[i] == INFINITY)
            throw std::invalid_argument("tiny_lm::sampling_distribution: logits[" + std::to_string(i) +
                                        "]: expected a finite number or -inf, got " + std::to_string(logits[i]));
    std::vector<int> order(logits.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
    const double top = logits[order[0]];
    if (top == -INFINITY)
        throw std::invalid_argument("tiny_lm::sampling_distribution: logits: expected one above -inf, got all -inf");
    if (s.temperature == 0) return {{order[0], 1.0}};

    std::size_t kept = order.size();
    if (s.top_k > 0 && static_cast<std::size_t>(s.top_k) < kept) kept = static_cast<std::size_t>(s.top_k);
    std::vector<Candidate> c;
    double total = 0;
    for (std::size_t r = 0; r < kept; ++r) {
        const double w = std::exp((logits[order[r]] - top) / s.temperature);
        if (w == 0) break;  // ranked: every later weight is 0 too
        c.push_back({order[r], w});
        total += w;
    }
    if (s.top_p < 1) {
        double before = 0;  // probability of the tokens ranked before candidate r
        std::size_t r = 0;
        while (r < c.size() && before < s.top_p) before += c[r++].probability / total;
        c.resize(r);
    }
    double sum = 0;
    for (const Candidate& x : c) sum += x.probability;
    for (Candidate& x : c) x.probability /= sum;
    return c;
}

/// A uniform number in [0, 1) from the engine's next output x: (x >> 11) · 2⁻⁵³, the same on
/// every machine.
inline double uniform(std::mt19937_64& engine) { return static_cast<double>(engine() >> 11) * 0x1.0p-53; }

/// The first candidate whose cumulative probability exceeds u · (their sum), u in [0, 1); the
/// last one when rounding leaves u past them all. Throws std::invalid_argument for no
/// candidates or u outside [0, 1).
inline int draw(const std::vector<Candidate>& candidates, double u) {
    if (candidates.empty()) throw std::invalid_argument("tiny_lm::draw: candidates: expected at least one");
    if (!(u >= 0 && u < 1))
        throw std::invalid_argument("tiny_lm::draw: u: expected a number in [0, 1), got " + std::to_string(u));
    double sum = 0;
    for (const Candidate& x : candidates) sum += x.probability;
    const double target = u * sum;
    double cumulative = 0;
    for (const Candidate& x : candidates) {
        cumulative += x.probability;
        if (cumulative > target) return x.token;
    }
    return candidates.back().token;
}

/// Draws tokens one at a time from a seeded std::mt19937_64 (one uniform number per token,
/// greedy ones included, so the draws stay aligned whatever the settings).
class Sampler {
public:
    /// Throws std::invalid_argument for invalid `s` (validate).
    Sampler(const Sampling& s, std::uint64_t seed) : sampling_(s), engine_(seed) { validate(s); }

    /// The next token for these logits.
    int next(const std::vector<double>& logits) {
        const double u = uniform(engine_);
        return draw(sampling_distribution(logits, sampling_), u);
    }

    const Sampling& sampling() const { return sampling_; }

private:
    Sampling sampling_;
    std::mt19937_64 engine_;
};

/// Length of the longest substring that occurs at least twice in `s` (overlaps allowed): a
/// sample that loops repeats most of itself.
inline std::size_t longest_repeat(const std::string& s) {
    std::size_t best = 0;
    for (std::size_t shift = 1; shift < s.size(); ++shift) {  // s against itself shifted
        std::size_t run = 0;
        for (std::size_t i = 0; i + shift < s.size(); ++i) {
            run = s[i] == s[i + shift] ? run + 1 : 0;
            best = std::max(best, run);
        }
    }
    return best;
}

}  // namespace tiny_lm
