// SPDX-License-Identifier: Apache-2.0
//
// Serving the demo's gated tiny LM (assets/tiny_lm) to many requests over paged KV pools with
// continuous batching. Every request is one shared system prompt followed by its own question,
// and generates --tokens bytes greedily. The system prompt is prefilled once; each request forks
// it (sharing its pages) when it arrives, at a random step. Each step runs every active request
// in one mixed batch: prompt chunks of new requests and one token of each decoding one
// (TinyLM::forward over a PagedKVPoolSet, gattn's paged_attention underneath). A request leaves,
// freeing its own pages, when done.
//
// The prompt ends inside a page, so every request's first chunk copies that shared page before
// writing into it (copy on write); the full pages before it stay shared by all.
//
// It prints the tokens/s of the serving loop, the pools' peak memory against one contiguous
// KV cache per active request (each sized, when the request arrives, for its whole sequence),
// and checks every request's tokens against decoding it alone (TinyLM::generate, KVCache path).
//
//   build/demo/examples/serve_tiny_lm --requests 32 --tokens 48

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "../tiny_lm/tiny_lm.hpp"

namespace {

struct Request {
    std::vector<int> question;   // the prompt after the shared system prompt
    std::vector<int> generated;  // greedy tokens so far
    std::size_t fed = 0;         // question tokens prefilled so far
    gattn::Index arrival = 0;    // the step it arrives at
    gattn::SequenceId seq = -1;  // its sequence while active
    bool done = false;
};

int argmax(const tiny_lm::Matrix<float>& logits, gattn::Index row) {
    gattn::Index best = 0;
    for (gattn::Index v = 1; v < logits.cols(); ++v)
        if (logits(row, v) > logits(row, best)) best = v;  // the lower id on a tie
    return static_cast<int>(best);
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"Continuous batching of the tiny LM over paged KV pools with a shared prompt"};
    std::string model_dir = GATTN_ASSETS_DIR "/tiny_lm/gated";
    int requests = 32, tokens = 48, page = 16, chunk = 32;
    unsigned seed = 1;
    app.add_option("--model", model_dir, "model directory (config.json, model.safetensors)");
    app.add_option("--requests", requests, "requests served")->check(CLI::Range(1, 4096));
    app.add_option("--tokens", tokens, "bytes each request generates")->check(CLI::Range(1, 128));
    app.add_option("--page", page, "tokens per page (a multiple of 16 in [16, 256])");
    app.add_option("--chunk", chunk, "most prompt tokens a request prefills per step")->check(CLI::Range(1, 256));
    app.add_option("--seed", seed, "arrival steps and questions");
    CLI11_PARSE(app, argc, argv);
    try {
        const tiny_lm::TinyLM<float> model(model_dir);
        const std::vector<int> system =
            tiny_lm::encode("You are a fortune cookie. Answer every question with a short fortune from the file.\n%\n");
        const std::vector<std::string> questions = {"Q: What is the meaning of life?\nA: ",
                                                    "Q: Why did the chicken cross the road?\nA: ",
                                                    "Love is ",
                                                    "A computer is ",
                                                    "Never trust ",
                                                    "The best way to ",
                                                    "Life is ",
                                                    "Q: How many programmers does it take?\nA: "};
        std::mt19937 rng(seed);
        std::uniform_int_distribution<gattn::Index> arrive(0, 2 * requests);
        std::vector<Request> reqs(static_cast<std::size_t>(requests));
        std::size_t longest = 0;
        for (std::size_t i = 0; i < reqs.size(); ++i) {
            reqs[i].question = tiny_lm::encode(questions[i % questions.size()]);
            reqs[i].arrival = arrive(rng);
            longest = std::max(longest, reqs[i].question.size());
        }
        const gattn::Index per_request = (static_cast<gattn::Index>(longest) + tokens) / page + 2;
        const gattn::Index num_pages = static_cast<gattn::Index>(system.size()) / page + 1 + requests * per_request;
        auto pools = model.make_pools(num_pages, page);

        const auto t0 = std::chrono::steady_clock::now();
        const gattn::SequenceId root = pools.allocate();  // the system prompt, prefilled once
        model.forward(system, {0, static_cast<gattn::Index>(system.size())}, pools, {root});
        gattn::Index steps = 0, peak_pages = 0, generated = 0, largest_batch = 0;
        gattn::Index peak_contiguous = 0;  // tokens the active requests' contiguous caches would reserve
        for (std::size_t finished = 0; finished < reqs.size(); ++steps) {
            std::vector<int> batch;
            std::vector<gattn::Index> indptr{0};
            std::vector<gattn::SequenceId> seqs;
            std::vector<std::size_t> members;
            for (std::size_t i = 0; i < reqs.size(); ++i) {
                Request& r = reqs[i];
                if (r.done || r.arrival > steps) continue;
                if (r.seq < 0) r.seq = pools.fork(root);  // shares the system prompt's pages
                if (r.fed < r.question.size()) {          // a chunk of its question
                    const std::size_t n =
                        std::min<std::size_t>(static_cast<std::size_t>(chunk), r.question.size() - r.fed);
                    batch.insert(batch.end(), r.question.begin() + static_cast<long>(r.fed),
                                 r.question.begin() + static_cast<long>(r.fed + n));
                    r.fed += n;
                } else {  // its last token
                    batch.push_back(r.generated.back());
                }
                indptr.push_back(static_cast<gattn::Index>(batch.size()));
                seqs.push_back(r.seq);
                members.push_back(i);
            }
            if (seqs.empty()) continue;
            gattn::Index reserved = 0;
            for (std::size_t i : members)
                reserved += static_cast<gattn::Index>(system.size() + reqs[i].question.size()) + tokens;
            peak_contiguous = std::max(peak_contiguous, reserved);
            largest_batch = std::max<gattn::Index>(largest_batch, static_cast<gattn::Index>(batch.size()));
            const tiny_lm::Matrix<float> logits = model.forward(batch, indptr, pools, seqs);
            peak_pages = std::max(peak_pages, num_pages - pools.free_pages());
            for (std::size_t m = 0; m < members.size(); ++m) {
                Request& r = reqs[members[m]];
                if (r.fed < r.question.size()) continue;  // still prefilling: no token yet
                r.generated.push_back(argmax(logits, indptr[m + 1] - 1));
                ++generated;
                if (static_cast<int>(r.generated.size()) == tokens) {
                    pools.free(r.seq);
                    r.done = true;
                    ++finished;
                }
            }
        }
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

        // Each request alone, through KVCaches: the same greedy tokens.
        int equal = 0;
        for (const Request& r : reqs) {
            std::vector<int> prompt = system;
            prompt.insert(prompt.end(), r.question.begin(), r.question.end());
            equal += model.generate(prompt, tokens) == r.generated ? 1 : 0;
        }
        const double page_bytes = double(pools.storage_bytes()) / double(num_pages);
        const double contiguous = page_bytes / page * double(peak_contiguous);
        std::printf("%d requests, a %zu-byte shared prompt, %d tokens each, pages of %d tokens, chunks of %d\n",
                    requests, system.size(), tokens, page, chunk);
        std::printf("the prompt: %zu full pages shared by every request, a last page of %zu tokens copied by each\n",
                    system.size() / static_cast<std::size_t>(page), system.size() % static_cast<std::size_t>(page));
        std::printf("%lld steps, up to %lld tokens a step: %.0f generated tokens/s (%s)\n",
                    static_cast<long long>(steps), static_cast<long long>(largest_batch), double(generated) / seconds,
                    gattn::describe(gattn::instruction_sets()).c_str());
        std::printf(
            "KV memory at the peak: paged pools %.1f KiB, one contiguous cache per active request %.1f KiB "
            "(%.2fx)\n",
            double(peak_pages) * page_bytes / 1024, contiguous / 1024, contiguous / (double(peak_pages) * page_bytes));
        std::printf("requests whose tokens equal decoding them alone: %d of %d\n", equal, requests);
        // The request whose continuation has the most distinct bytes (greedy decoding of a
        // model this small often repeats one byte).
        const Request& shown = *std::max_element(reqs.begin(), reqs.end(), [](const Request& a, const Request& b) {
            auto distinct = [](std::vector<int> t) {
                std::sort(t.begin(), t.end());
                return std::unique(t.begin(), t.end()) - t.begin();
            };
            return distinct(a.generated) < distinct(b.generated);
        });
        std::printf("for example: \"%s\" -> \"%s\"\n", tiny_lm::decode(shown.question).c_str(),
                    tiny_lm::decode(shown.generated).c_str());
        return equal == requests ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "serve_tiny_lm: %s\n", e.what());
        return 2;
    }
}
