// SPDX-License-Identifier: Apache-2.0
// fuzz_sdpa's checks of the gated layer: its forward, and decoding through a KV cache (fuzz_sdpa.cpp
// describes the harness).

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "fuzz_sdpa.hpp"
#include "support/reference.hpp"

namespace fuzz_sdpa {
namespace {

/// A matrix's shape and bytes, and a cache's parts (bytes: unused cache slots may hold NaN).
template <class M>
std::string bytes_of(const M& m) {
    std::string s = std::to_string(m.rows()) + "x" + std::to_string(m.cols()) + ":";
    s.append(reinterpret_cast<const char*>(m.data()), std::size_t(m.size()) * sizeof(typename M::Scalar));
    return s;
}
template <class S>
std::string cache_bytes(const gattn::KVCache<S>& c) {
    std::string s = bytes_of(c.keys()) + bytes_of(c.values()) + bytes_of(c.key_scales()) + bytes_of(c.value_scales());
    for (Index l : c.lengths()) s += std::to_string(l) + ",";
    for (Index f : c.first_positions()) s += std::to_string(f) + ",";
    return s + std::to_string(c.capacity()) + "/" + std::to_string(c.window());
}

/// Decoding with a cache of CS (see the file comment); in: the steps, then the values.
template <class CS>
void run_decode_with(Reader& in, const gattn::AttentionConfig& config, Index B, Index capacity) {
    constexpr bool kInt8 = std::is_same_v<CS, std::int8_t>;
    const auto weights = gattn::make_random_weights<float>(config, in.byte());
    const auto wd = gattn_test::weights_to_double(weights);
    const gattn::GatedMultiHeadAttention<float> layer(config, weights);
    const gattn::GatedMultiHeadAttention<float> twin(config, weights);  // the same weights, another layer
    auto cache = layer.template make_cache<CS>(B, capacity);
    auto twin_cache = twin.template make_cache<CS>(B, capacity);
    const Index D = config.d_model;
    struct Step {
        std::uint8_t op, a, b, c;
    };
    std::vector<Step> steps(std::size_t(in.range(1, 8)));
    for (Step& st : steps) st = {in.byte(), in.byte(), in.byte(), in.byte()};
    Values values(in);
    auto describe_decode = [&] {
        std::fprintf(stderr,
                     "decode: gate %s, D=%ld H=%ld Hkv=%ld d=%ld/%ld window=%ld sinks=%d softcap=%g alibi=%d "
                     "qk_norm=%d rotary=%ld, %s cache of B=%ld, capacity %ld (window %ld)\n",
                     gattn::describe(config.gate).c_str(), long(D), long(config.num_heads), long(config.num_kv_heads),
                     long(config.d_k()), long(config.d_v()), long(config.sliding_window ? *config.sliding_window : 0),
                     int(config.sinks), config.logit_softcap, int(config.alibi), int(config.qk_norm),
                     long(config.rotary_dim), kInt8 ? "int8" : "float", long(B), long(cache.capacity()),
                     long(cache.window()));
    };
    // Each sequence's tokens so far (rows of D values): the reference's input.
    std::vector<std::vector<std::vector<float>>> history(static_cast<std::size_t>(B));
    auto make_x = [&](Index rows, Index cols) {
        Matrix x(rows, cols);
        for (Index r = 0; r < rows; ++r)
            for (Index e = 0; e < cols; ++e) x(r, e) = values.next() / 4;  // [−1, 1)
        return x;
    };
    auto room = [&](Index b) { return cache.window() > 0 ? Index(1) << 20 : cache.capacity() - cache.lengths()[b]; };
    for (std::size_t step = 0; step < steps.size(); ++step) {
        const Step st = steps[step];
        const int op = st.op % 8;
        if (op <= 3) {  // a valid forward
            const Index N = 1 + st.a % 4;
            std::vector<Index> counts(static_cast<std::size_t>(B));
            for (Index b = 0; b < B; ++b) counts[b] = std::min<Index>(((st.b >> (2 * b)) & 3) % (N + 1), room(b));
            const Matrix x = make_x(B * N, D);
            Matrix out = Matrix::Constant(B * N, D, -12345.0f);
            const std::vector<Index> seen = cache.tokens_seen();
            try {
                layer.forward(x, cache, out, counts);
            } catch (const std::exception& e) {
                describe_decode();
                std::fprintf(stderr, "step %zu: a valid forward threw: %s\n", step, e.what());
                __builtin_trap();
            }
            for (Index b = 0; b < B; ++b)
                for (Index t = 0; t < counts[b]; ++t)
                    history[b].emplace_back(x.row(b * N + t).data(), x.row(b * N + t).data() + D);
            for (Index n = 0; n < out.size(); ++n)
                if (!std::isfinite(out.data()[n])) {
                    describe_decode();
                    std::fprintf(stderr, "step %zu: output %ld = %g on finite input\n", step, long(n),
                                 double(out.data()[n]));
                    __builtin_trap();
                }
            if (kInt8) continue;
            // The float64 layer on each sequence's whole history; the new tokens' rows.
            Index longest = 0;
            std::vector<Index> lengths(static_cast<std::size_t>(B));
            for (Index b = 0; b < B; ++b) longest = std::max(longest, lengths[b] = Index(history[b].size()));
            if (longest == 0) continue;
            gattn_test::Mat xs = gattn_test::Mat::Zero(B * longest, D);
            for (Index b = 0; b < B; ++b)
                for (Index t = 0; t < lengths[b]; ++t)
                    for (Index e = 0; e < D; ++e) xs(b * longest + t, e) = history[b][t][e];
            const gattn_test::Mat ref = gattn_test::layer_reference(config, wd, xs, B, lengths).y;
            for (Index b = 0; b < B; ++b)
                for (Index t = 0; t < counts[b]; ++t) {
                    const Index r = b * longest + seen[b] + t;
                    const double size = ref.row(r).cwiseAbs().maxCoeff();
                    for (Index e = 0; e < D; ++e) {
                        const double g = out(b * N + t, e), w = ref(r, e);
                        if (!(std::abs(g - w) <= 2e-3 + 2e-3 * size)) {
                            describe_decode();
                            std::fprintf(stderr,
                                         "MISMATCH at step %zu, sequence %ld, token %ld (position %ld), feature %ld: "
                                         "gattn %.9g, reference %.9g\n",
                                         step, long(b), long(t), long(seen[b] + t), long(e), g, w);
                            __builtin_trap();
                        }
                    }
                }
        } else if (op == 4) {  // a valid rollback
            std::vector<Index> lengths = cache.lengths();
            for (Index b = 0; b < B; ++b) {
                const Index lo = cache.min_length(std::size_t(b)), hi = lengths[b];
                lengths[b] = lo + ((st.a + 7 * b) % (hi - lo + 1));
            }
            cache.truncate(lengths);
            for (Index b = 0; b < B; ++b) history[b].resize(std::size_t(cache.tokens_seen()[b]));
        } else if (op == 7) {
            cache.clear();
            for (auto& h : history) h.clear();
        } else {  // an invalid call: it must throw and change nothing
            const Index N = 1 + st.b % 4;
            Matrix x = make_x(B * N, D), out = Matrix::Constant(B * N, D, -12345.0f);
            std::vector<Index> counts(std::size_t(B), 0);
            int kind = op == 6 ? 100 + st.a % 3 : st.a % 11;
            if (kind == 4 && B == 1) kind = 3;              // every row count is a multiple of 1
            if (kind == 6 && cache.window() > 0) kind = 0;  // a window cache never overflows
            if (kind == 7 && !kInt8) kind = 8;              // a float cache takes NaN
            const Index keys_floats = cache.keys().size() * Index(sizeof(CS)) / Index(sizeof(float));
            if (kind == 10 && keys_floats < B * D) kind = 9;
            Matrix wide, big, big_out;
            if (kind == 7) {  // a NaN in the input of a token that is appended
                for (Index b = 0; b < B; ++b) counts[b] = std::min<Index>(N, room(b));
                const Index b = st.c % B;
                if (counts[b] == 0) counts[b] = 1;  // then this sequence overflows: an error too
                x(b * N + counts[b] - 1, st.c % D) = std::numeric_limits<float>::quiet_NaN();
            }
            const std::string before = cache_bytes(cache) + cache_bytes(twin_cache),
                              out_before = bytes_of(out) + bytes_of(x);
            const char* what = "";
            try {
                switch (kind) {
                    case 0:
                        what = "counts of B + 1 entries";
                        counts.push_back(0);
                        layer.forward(x, cache, out, counts);
                        break;
                    case 1:
                        what = "a count N + 1";
                        counts[st.c % B] = N + 1;
                        layer.forward(x, cache, out, counts);
                        break;
                    case 2:
                        what = "a count -1";
                        counts[st.c % B] = -1;
                        layer.forward(x, cache, out, counts);
                        break;
                    case 3:
                        what = "x of D + 1 columns";
                        wide = make_x(B * N, D + 1);
                        layer.forward(wide, cache, out);
                        break;
                    case 4:
                        what = "x rows no multiple of B";
                        wide = make_x(B * N + 1, D);
                        layer.forward(wide, cache, out);
                        break;
                    case 5:
                        what = "out of other rows";
                        big_out = Matrix::Constant(B * N + 1, D, -1.0f);
                        layer.forward(x, cache, big_out);
                        break;
                    case 6: {
                        what = "a capacity exceeded";
                        const Index n = cache.capacity() + 1;
                        big = make_x(B * n, D);
                        big_out = Matrix::Constant(B * n, D, -1.0f);
                        layer.forward(big, cache, big_out);
                        break;
                    }
                    case 7:
                        what = "a NaN key for an int8 cache";
                        layer.forward(x, cache, out, counts);
                        break;
                    case 8:
                        what = "another layer's cache";
                        layer.forward(x, twin_cache, out);
                        break;
                    case 9:
                        what = "out overlapping x";
                        layer.forward(x, cache, x);
                        break;
                    case 10: {
                        what = "x inside the cache";
                        using Map = Eigen::Map<const Matrix>;
                        layer.forward(Map(reinterpret_cast<const float*>(cache.keys().data()), B, D), cache,
                                      out.topRows(B));
                        break;
                    }
                    case 100:
                        what = "truncate: B + 1 lengths";
                        cache.truncate(std::vector<Index>(std::size_t(B) + 1, 0));
                        break;
                    case 101: {
                        what = "truncate: a length past the current one";
                        std::vector<Index> l = cache.lengths();
                        l[st.c % B] += 1 + st.b % 3;
                        cache.truncate(l);
                        break;
                    }
                    default: {
                        what = "truncate: a length below the minimum";
                        std::vector<Index> l = cache.lengths();
                        l[st.c % B] = cache.min_length(std::size_t(st.c % B)) - 1;
                        cache.truncate(l);
                        break;
                    }
                }
                describe_decode();
                std::fprintf(stderr, "step %zu: %s was accepted\n", step, what);
                __builtin_trap();
            } catch (const std::invalid_argument&) {
            } catch (const std::exception& e) {
                describe_decode();
                std::fprintf(stderr, "step %zu: %s threw an undocumented exception: %s\n", step, what, e.what());
                __builtin_trap();
            }
            if (cache_bytes(cache) + cache_bytes(twin_cache) != before || bytes_of(out) + bytes_of(x) != out_before) {
                describe_decode();
                std::fprintf(stderr, "step %zu: %s threw but changed %s\n", step, what,
                             bytes_of(out) + bytes_of(x) != out_before ? "out or x" : "a cache");
                __builtin_trap();
            }
        }
    }
}

}  // namespace

void run_layer(Reader& in) {
    static const std::vector<gattn::GateSpec> specs = gattn::all_valid_gate_specs();
    gattn::AttentionConfig config;
    config.gate = specs[in.byte() % specs.size()];
    config.d_model = in.range(1, 24);
    config.num_heads = in.range(1, 6);
    config.num_kv_heads = kv_heads_of(in, int(config.num_heads));
    config.head_dim = in.range(1, 12);
    config.value_head_dim = in.flag() ? 0 : in.range(1, 12);
    const std::uint8_t bits = in.byte();
    config.qkv_bias = bits & 1;
    config.o_bias = bits & 2;
    config.causal = bits & 4;
    if (bits & 8) config.sliding_window = in.range(1, 20);
    const int batch = in.range(0, 3), tokens = in.range(1, 20);
    gattn::ForwardOptions<float> options;
    if (bits & 16)
        for (int b = 0; b < batch; ++b) options.key_lengths.push_back(in.range(0, tokens));
    const bool with_trace = bits & 32;
    try {
        gattn::validate_config(config, "fuzz_sdpa");
    } catch (const std::invalid_argument&) {
        return;  // e.g. an elementwise gate fused into q_proj with d_v != d_k
    }
    const std::uint64_t seed = in.byte();
    Values values(in);
    Matrix x(Index(batch) * tokens, config.d_model);
    fill(x, config.d_model, values);
    Matrix y;
    gattn::ForwardTrace<float> trace;
    trace.record_probabilities = bits & 64;
    try {
        const gattn::GatedMultiHeadAttention<float> layer(config, gattn::make_random_weights<float>(config, seed));
        y = layer.forward(x, batch, options, with_trace ? &trace : nullptr);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "layer (gate %s, D=%ld H=%ld Hkv=%ld d=%ld/%ld, B=%d N=%d) threw: %s\n",
                     gattn::describe(config.gate).c_str(), long(config.d_model), long(config.num_heads),
                     long(config.num_kv_heads), long(config.d_k()), long(config.d_v()), batch, tokens, e.what());
        __builtin_trap();
    }
    if (y.rows() != x.rows() || y.cols() != config.d_model) __builtin_trap();
    for (Index n = 0; n < y.size(); ++n)
        if (!std::isfinite(y.data()[n])) {
            std::fprintf(stderr, "layer (gate %s, D=%ld H=%ld Hkv=%ld d=%ld/%ld, B=%d N=%d): output %ld = %g\n",
                         gattn::describe(config.gate).c_str(), long(config.d_model), long(config.num_heads),
                         long(config.num_kv_heads), long(config.d_k()), long(config.d_v()), batch, tokens, long(n),
                         double(y.data()[n]));
            __builtin_trap();
        }
}

void run_decode(Reader& in) {
    static const std::vector<gattn::GateSpec> specs = gattn::all_valid_gate_specs();
    gattn::AttentionConfig config;
    config.gate = specs[in.byte() % specs.size()];
    config.d_model = in.range(1, 16);
    config.num_heads = in.range(1, 4);
    config.num_kv_heads = kv_heads_of(in, int(config.num_heads));
    config.head_dim = in.range(1, 8);
    config.value_head_dim = in.flag() ? 0 : in.range(1, 8);
    config.causal = true;  // new tokens then see what the whole sequence's forward shows them
    const std::uint8_t bits = in.byte();
    config.qkv_bias = bits & 1;
    config.o_bias = bits & 2;
    config.sinks = bits & 4;
    if (bits & 8) config.sliding_window = in.range(1, 6);
    if (bits & 16) config.logit_softcap = in.flag() ? 0.5 : 30.0;
    if (bits & 32) config.qk_norm = in.flag() ? gattn::QkNorm::ZeroCentredRmsNorm : gattn::QkNorm::RmsNorm;
    if ((bits & 64) && config.head_dim >= 2) config.rotary_dim = 2 * in.range(1, int(config.head_dim / 2));
    config.alibi = bits & 128;
    const bool int8 = in.flag();
    const Index B = in.range(1, 3), capacity = in.range(1, 24);
    try {
        gattn::validate_config(config, "fuzz_sdpa");
    } catch (const std::invalid_argument&) {
        return;  // e.g. an elementwise gate fused into q_proj with d_v != d_k
    }
    if (int8)
        run_decode_with<std::int8_t>(in, config, B, capacity);
    else
        run_decode_with<float>(in, config, B, capacity);
}

}  // namespace fuzz_sdpa
