// Every error the layers and caches document (docs/conventions.md, "Errors": the rows of
// GatedMultiHeadAttention, Qwen3NextAttention, KVCache and KVCacheSet), triggered one at a time
// by a table of cases named after the documented error: each call must throw the documented
// type with a message that names the function and the argument, and leave every byte of every
// cache it could reach (keys, values, int8 scales, lengths, first positions, capacity, window)
// and of every output (out, the trace, the optional outputs) as it was before the call. The
// caches hold tokens already: float, int8, and a window cache that has dropped some. Errors of
// constructors, which have nothing to leave changed, are checked for their type and message,
// and for refusing at construction what a call would refuse later. Last, every function that
// writes into a caller's view (the ops' too) is given one whose rows overlap.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gattn/gattn.hpp"

namespace error_paths {

using gattn::Index;
using gattn::RowMatrix;
using Map = Eigen::Map<RowMatrix<float>>;
using ConstMap = Eigen::Map<const RowMatrix<float>>;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

/// A matrix's shape and bytes (bytes, not values: unused cache slots may hold NaN).
template <class M>
std::string bytes_of(const M& m) {
    std::string s = std::to_string(m.rows()) + "x" + std::to_string(m.cols()) + ":";
    s.append(reinterpret_cast<const char*>(m.data()), static_cast<std::size_t>(m.size()) * sizeof(typename M::Scalar));
    return s;
}
std::string bytes_of(const std::vector<Index>& v) {
    std::string s;
    for (Index x : v) s += std::to_string(x) + ",";
    return s;
}

/// Named parts of the state a call could change.
using Parts = std::vector<std::pair<std::string, std::string>>;

template <class S>
void add_cache(Parts& p, const std::string& name, const gattn::KVCache<S>& c) {
    p.push_back({name + ".keys", bytes_of(c.keys())});
    p.push_back({name + ".values", bytes_of(c.values())});
    p.push_back({name + ".key_scales", bytes_of(c.key_scales())});
    p.push_back({name + ".value_scales", bytes_of(c.value_scales())});
    p.push_back({name + ".lengths", bytes_of(c.lengths())});
    p.push_back({name + ".first_positions", bytes_of(c.first_positions())});
    p.push_back({name + ".capacity and window", std::to_string(c.capacity()) + "/" + std::to_string(c.window())});
}

void add_matrix(Parts& p, const std::string& name, const RowMatrix<float>& m) { p.push_back({name, bytes_of(m)}); }

void add_trace(Parts& p, const std::string& name, const gattn::ForwardTrace<float>& t) {
    add_matrix(p, name + ".gate_scores", t.gate_scores);
    add_matrix(p, name + ".first_key_attention", t.first_key_attention);
    add_matrix(p, name + ".probabilities", t.probabilities);
    p.push_back({name + ".max_abs_output", std::to_string(t.max_abs_output)});
}

enum class Throws { ShapeError, InvalidArgument, OutOfRange };

/// One documented error: what the table calls it, the exception, the function the message
/// starts with (empty: std::out_of_range from the standard library, whose wording is its own),
/// a part of the message (argument, expected and actual values), and the call.
struct Case {
    std::string error;
    Throws type;
    std::string function;
    std::string message;
    std::function<void()> call;
};

/// Checks that e is the case's type and says what the case says.
void check_exception(const Case& c, const std::exception& e) {
    const std::string what = e.what();
    const Throws got = dynamic_cast<const std::out_of_range*>(&e)       ? Throws::OutOfRange
                       : dynamic_cast<const gattn::shape_error*>(&e)    ? Throws::ShapeError
                       : dynamic_cast<const std::invalid_argument*>(&e) ? Throws::InvalidArgument
                                                                        : Throws::OutOfRange;
    EXPECT_EQ(int(got), int(c.type)) << "wrong exception type: " << what;
    if (!dynamic_cast<const std::out_of_range*>(&e) && !dynamic_cast<const std::invalid_argument*>(&e))
        ADD_FAILURE() << "undocumented exception: " << what;
    if (!c.function.empty()) {
        EXPECT_EQ(what.rfind(c.function + ": ", 0), 0u) << what;
    }
    EXPECT_NE(what.find(c.message), std::string::npos) << "'" << c.message << "' in: " << what;
}

/// Runs each case and compares the watched parts before and after, byte for byte.
void run_cases(const std::vector<Case>& cases, const std::function<Parts()>& watched) {
    for (const Case& c : cases) {
        SCOPED_TRACE("case: " + c.error);
        const Parts before = watched();
        try {
            c.call();
            ADD_FAILURE() << "no exception";
        } catch (const std::exception& e) {
            check_exception(c, e);
        }
        const Parts after = watched();
        ASSERT_EQ(after.size(), before.size());
        for (std::size_t i = 0; i < after.size(); ++i)
            EXPECT_TRUE(after[i].second == before[i].second) << after[i].first << " changed by a call that threw";
    }
}

/// Constructor errors: type and message only (no object exists yet to be left changed).
void run_constructor_cases(const std::vector<Case>& cases) {
    for (const Case& c : cases) {
        SCOPED_TRACE("case: " + c.error);
        try {
            c.call();
            ADD_FAILURE() << "no exception";
        } catch (const std::exception& e) {
            check_exception(c, e);
        }
    }
}

/// D = 16, H = 4, H_kv = 2, d = 4, causal, G1 elementwise gate, sinks, the given window.
gattn::AttentionConfig layer_config(std::optional<Index> window = std::nullopt) {
    gattn::AttentionConfig c;
    c.d_model = 16;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 4;
    c.causal = true;
    c.gate = gattn::GateSpec::g1_elementwise();
    c.sinks = true;
    c.sliding_window = window;
    return c;
}

/// Qwen3-Next attention with D = 16, H = 4, H_kv = 2, d = 8, sinks.
gattn::Qwen3NextConfig qwen_config() {
    gattn::Qwen3NextConfig c;
    c.hidden_size = 16;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 8;
    c.attention_sinks = true;
    return c;
}

/// Weights of the config's shapes, U(−0.3, 0.3), norm gains (1 + w) near 1.
gattn::Qwen3NextAttentionWeights<float> qwen_weights(const gattn::Qwen3NextConfig& c, unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-0.3f, 0.3f);
    gattn::Qwen3NextAttentionWeights<float> w;
    const auto shapes = gattn::qwen3_next_weight_shapes(c);
    w.for_each([&](const char* name, auto* p) {
        for (const auto& s : shapes)
            if (s.name == name) {
                p->resize(s.shape[0], s.shape.size() > 1 ? s.shape[1] : 1);
                for (Index k = 0; k < p->size(); ++k) p->data()[k] = u(rng);
            }
    });
    return w;
}

/// The documented errors of GatedMultiHeadAttention::forward with a cache of CS (float, or
/// int8), and with a window (a window cache that has dropped tokens, float).
template <class CS>
void check_layer_cache_errors(std::optional<Index> window) {
    const auto c = layer_config(window);
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 1));
    const gattn::GatedMultiHeadAttention<float> twin(c, gattn::make_random_weights<float>(c, 2));
    const std::string fn = "gattn::GatedMultiHeadAttention::forward";
    constexpr bool kInt8 = std::is_same_v<CS, std::int8_t>;
    auto cache = layer.template make_cache<CS>(2, 16);      // window w: a window cache of 2w rows
    auto twin_cache = twin.template make_cache<CS>(2, 16);  // another layer's
    gattn::KVCache<CS> other_heads(2, 8, 1, 8);             // 1 KV head of 8: the same widths
    gattn::KVCache<CS> window3(2, 8, 2, 4, 0, 0, 3);        // another window
    ASSERT_EQ(cache.window(), window.value_or(0));
    gattn::ForwardTrace<float> trace;
    trace.record_probabilities = true;
    RowMatrix<float> out = RowMatrix<float>::Constant(6, 16, 7.0f);
    // Tokens already there: 9 per sequence (a window cache has dropped the first ones).
    for (int step = 0; step < 3; ++step)
        layer.forward(RowMatrix<float>::Random(6, 16), cache, out, {3, 3}, step == 2 ? &trace : nullptr);
    twin.forward(RowMatrix<float>::Random(2, 16), twin_cache, out.topRows(2));
    other_heads.append(RowMatrix<float>::Random(2, 8).cast<typename gattn::KVCache<CS>::Input>(),
                       RowMatrix<float>::Random(2, 8).cast<typename gattn::KVCache<CS>::Input>(), {1, 1});
    if (window) {
        ASSERT_GT(cache.first_positions()[0], 0) << "the window cache should have dropped tokens";
    }
    out.setConstant(7.0f);

    const RowMatrix<float> x = RowMatrix<float>::Random(6, 16);  // B = 2 sequences of N = 3 slots
    RowMatrix<float> narrow = RowMatrix<float>::Constant(6, 8, 7.0f), big = RowMatrix<float>::Constant(16, 16, 7.0f);
    RowMatrix<float> shared = x, x_nan = x;
    x_nan(4, 3) = kNaN;  // sequence 1, token 1: a valid token
    gattn::ForwardTrace<float> holds_x, holds_out;
    holds_x.gate_scores = x;
    holds_out.probabilities = RowMatrix<float>::Constant(6, 16, 7.0f);
    // x and out inside the cache's own storage (any storage type: compared by bytes).
    auto keys_as_x = [&] { return ConstMap(reinterpret_cast<const float*>(cache.keys().data()), 2, 16); };
    auto values_as_out = [&] {
        return Map(const_cast<float*>(reinterpret_cast<const float*>(cache.values().data())), 2, 16);
    };
    ASSERT_GE(cache.keys().size() * Index(sizeof(CS)), Index(32 * sizeof(float)));

    std::vector<Case> cases = {
        {"x of the wrong shape", Throws::ShapeError, fn, "x must have shape [B*N, d_model] = [multiple of 2, 16]",
         [&] { layer.forward(RowMatrix<float>::Random(6, 15), cache, out, {}, &trace); }},
        {"x whose rows are no multiple of the cache's batch", Throws::ShapeError, fn,
         "(B = the cache's batch, 2), got [5, 16]",
         [&] { layer.forward(RowMatrix<float>::Random(5, 16), cache, out, {}, &trace); }},
        {"out of the wrong shape", Throws::ShapeError, fn, "out must have shape [6, 16], got [6, 8]",
         [&] { layer.forward(x, cache, narrow, {}, &trace); }},
        {"counts of the wrong shape", Throws::ShapeError, fn, "counts must have shape [2], got [1]",
         [&] { layer.forward(x, cache, out, {3}, &trace); }},
        {"a cache whose heads are not this layer's", Throws::ShapeError, fn,
         "cache must hold this layer's heads (num_kv_heads 2, head_dim 4, value_head_dim 4), got num_kv_heads 1",
         [&] { layer.forward(x, other_heads, out, {}, &trace); }},
        {"a cache made by another layer's make_cache", Throws::InvalidArgument, fn, "cache belongs to another layer",
         [&] { layer.forward(x, twin_cache, out, {}, &trace); }},
        {"a cache keeping another window", Throws::InvalidArgument, fn, "cache keeps only a window of 3 tokens",
         [&] { layer.forward(x, window3, out, {}, &trace); }},
        {"a count outside [0, N]", Throws::InvalidArgument, fn, "counts[0] must be in [0, 3], got 4",
         [&] {
             layer.forward(x, cache, out, {4, 0}, &trace);
         }},
        {"a negative count", Throws::InvalidArgument, fn, "counts[1] must be in [0, 3], got -1",
         [&] {
             layer.forward(x, cache, out, {0, -1}, &trace);
         }},
        {"out sharing an element with x", Throws::InvalidArgument, fn, "out must not overlap x",
         [&] { layer.forward(shared, cache, shared, {}, &trace); }},
        {"x sharing an element with the cache's keys or values", Throws::InvalidArgument, fn,
         "x must not share an element with the cache's keys or values",
         [&] { layer.forward(keys_as_x(), cache, out.topRows(2), {}, &trace); }},
        {"out sharing an element with the cache's keys or values", Throws::InvalidArgument, fn,
         "out must not share an element with the cache's keys or values",
         [&] { layer.forward(x.topRows(2), cache, values_as_out(), {}, &trace); }},
        {"a trace matrix holding x", Throws::InvalidArgument, fn, "trace->gate_scores must not hold x or out",
         [&] { layer.forward(holds_x.gate_scores, cache, out, {}, &holds_x); }},
        {"a trace matrix holding out", Throws::InvalidArgument, fn, "trace->probabilities must not hold x or out",
         [&] { layer.forward(x, cache, holds_out.probabilities, {}, &holds_out); }},
    };
    if (!window)
        cases.push_back({"a sequence that would exceed the capacity of a cache without a window",
                         Throws::InvalidArgument, fn,
                         "cache sequence 0 would exceed the capacity 16 (holds 9, adding 8)",
                         [&] { layer.forward(RowMatrix<float>::Random(16, 16), cache, big, {}, &trace); }});
    if (kInt8)
        cases.push_back({"a key or value that is NaN or infinite (int8 cache, as KVCache::append)",
                         Throws::InvalidArgument, "gattn::KVCache::append", "an int8 cache stores finite values only",
                         [&] { layer.forward(x_nan, cache, out, {}, &trace); }});
    run_cases(cases, [&] {
        Parts p;
        add_cache(p, "cache", cache);
        add_cache(p, "twin_cache", twin_cache);
        add_cache(p, "other_heads", other_heads);
        add_cache(p, "window3", window3);
        add_matrix(p, "out", out);
        add_matrix(p, "narrow", narrow);
        add_matrix(p, "big", big);
        add_matrix(p, "shared", shared);
        add_trace(p, "trace", trace);
        add_trace(p, "holds_x", holds_x);
        add_trace(p, "holds_out", holds_out);
        return p;
    });
    // The cache still works: the rows a NaN token would have taken are free.
    layer.forward(x, cache, out, {1, 1});
    EXPECT_TRUE(out.topRows(1).allFinite());
}

TEST(ErrorPaths, GatedLayerWithACacheLeavesCacheAndOutputsAsTheyWere) {
    {
        SCOPED_TRACE("float cache");
        check_layer_cache_errors<float>(std::nullopt);
    }
    {
        SCOPED_TRACE("int8 cache");
        check_layer_cache_errors<std::int8_t>(std::nullopt);
    }
    {
        SCOPED_TRACE("window cache (float), tokens dropped");
        check_layer_cache_errors<float>(2);
    }
    {
        SCOPED_TRACE("window cache (int8), tokens dropped");
        check_layer_cache_errors<std::int8_t>(4);  // 2w = 8 rows: room for x's 2 × 16 floats
    }
}

/// GatedMultiHeadAttention::forward without a cache: as SDPA, plus x, out, positions, batch,
/// overlaps and trace matrices.
TEST(ErrorPaths, GatedLayerWithoutACacheLeavesOutputsAsTheyWere) {
    auto c = layer_config();
    c.rotary_dim = 4;  // RoPE: options.positions are read
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 3));
    const std::string fn = "gattn::GatedMultiHeadAttention::forward";
    const RowMatrix<float> x = RowMatrix<float>::Random(6, 16);  // B = 2 of N = 3
    RowMatrix<float> out = RowMatrix<float>::Constant(6, 16, 7.0f), narrow = RowMatrix<float>::Constant(6, 8, 7.0f);
    RowMatrix<float> shared = x;
    gattn::ForwardTrace<float> trace, holds_x, holds_out, holds_bias;
    trace.record_probabilities = true;
    layer.forward(x, 2, out, {}, &trace);  // a trace with something in it
    out.setConstant(7.0f);
    holds_x.gate_scores = x;
    holds_out.first_key_attention = RowMatrix<float>::Constant(6, 16, 7.0f);
    holds_bias.probabilities = RowMatrix<float>::Zero(1, 9);
    std::unique_ptr<bool[]> allow(new bool[64]);
    std::fill(allow.get(), allow.get() + 64, true);
    std::vector<float> bias(64, 0.0f);
    auto with = [](auto f) {
        gattn::ForwardOptions<float> o;
        f(o);
        return o;
    };
    const auto lengths_count = with([](auto& o) { o.key_lengths = {3}; });
    const auto lengths_range = with([](auto& o) { o.key_lengths = {3, 4}; });
    const auto bool_shape = with([&](auto& o) { o.bool_mask = {allow.get(), 1, 3, 1, 3}; });
    const auto bias_shape = with([&](auto& o) { o.bias = {bias.data(), 1, 1, 2, 3}; });
    const auto positions = with([](auto& o) { o.positions = {0, 1, 2}; });
    const auto bias_in_trace = with([&](auto& o) { o.bias = {holds_bias.probabilities.data(), 1, 1, 3, 3}; });
    const std::vector<Case> cases = {
        {"x of the wrong shape", Throws::ShapeError, fn, "x must have shape [B*N, d_model] = [multiple of 2, 16]",
         [&] { layer.forward(RowMatrix<float>::Random(6, 15), 2, out, {}, &trace); }},
        {"x whose rows are no multiple of the batch", Throws::ShapeError, fn, "[multiple of 4, 16]",
         [&] { layer.forward(x, 4, out, {}, &trace); }},
        {"a negative batch", Throws::InvalidArgument, fn, "batch must be >= 0, got -1",
         [&] { layer.forward(x, -1, out, {}, &trace); }},
        {"rows with batch 0", Throws::ShapeError, fn, "x must have shape [0, 16] (batch 0 has no rows)",
         [&] { layer.forward(x, 0, out, {}, &trace); }},
        {"out of the wrong shape", Throws::ShapeError, fn, "out must have shape [6, 16], got [6, 8]",
         [&] { layer.forward(x, 2, narrow, {}, &trace); }},
        {"options.positions of the wrong shape", Throws::ShapeError, fn,
         "options.positions must have shape [6], got [3]", [&] { layer.forward(x, 2, out, positions, &trace); }},
        {"key lengths of the wrong shape (as SDPA)", Throws::ShapeError, fn,
         "options.key_lengths must have shape [2], got [1]", [&] { layer.forward(x, 2, out, lengths_count, &trace); }},
        {"a key length outside [0, N] (as SDPA)", Throws::InvalidArgument, fn,
         "options.key_lengths[1] must be in [0, N_k = 3], got 4",
         [&] { layer.forward(x, 2, out, lengths_range, &trace); }},
        {"a boolean mask of the wrong shape (as SDPA)", Throws::ShapeError, fn,
         "options.bool_mask must have shape [1|2, 1|4, 1|3, 3], got [1, 3, 1, 3]",
         [&] { layer.forward(x, 2, out, bool_shape, &trace); }},
        {"a bias of the wrong shape (as SDPA)", Throws::ShapeError, fn,
         "options.bias must have shape [1|2, 1|4, 1|3, 3], got [1, 1, 2, 3]",
         [&] { layer.forward(x, 2, out, bias_shape, &trace); }},
        {"out sharing an element with x", Throws::InvalidArgument, fn, "out must not overlap x",
         [&] { layer.forward(shared, 2, shared, {}, &trace); }},
        {"a trace matrix holding x", Throws::InvalidArgument, fn,
         "trace->gate_scores must not hold x, out or options.bias",
         [&] { layer.forward(holds_x.gate_scores, 2, out, {}, &holds_x); }},
        {"a trace matrix holding out", Throws::InvalidArgument, fn,
         "trace->first_key_attention must not hold x, out or options.bias",
         [&] { layer.forward(x, 2, holds_out.first_key_attention, {}, &holds_out); }},
        {"a trace matrix holding options.bias", Throws::InvalidArgument, fn,
         "trace->probabilities must not hold x, out or options.bias",
         [&] { layer.forward(x, 2, out, bias_in_trace, &holds_bias); }},
    };
    run_cases(cases, [&] {
        Parts p;
        add_matrix(p, "out", out);
        add_matrix(p, "narrow", narrow);
        add_matrix(p, "shared", shared);
        add_trace(p, "trace", trace);
        add_trace(p, "holds_x", holds_x);
        add_trace(p, "holds_out", holds_out);
        add_trace(p, "holds_bias", holds_bias);
        return p;
    });
}

/// The documented errors of Qwen3NextAttention::forward with a cache of CS (float or int8).
template <class CS>
void check_qwen_errors() {
    const auto c = qwen_config();
    const gattn::Qwen3NextAttention<float> layer(c, qwen_weights(c, 4));
    const gattn::Qwen3NextAttention<float> twin(c, qwen_weights(c, 5));
    const std::string fn = "gattn::Qwen3NextAttention::forward";
    constexpr bool kInt8 = std::is_same_v<CS, std::int8_t>;
    auto cache = layer.template make_cache<CS>(2, 8);
    auto twin_cache = twin.template make_cache<CS>(2, 8);
    gattn::KVCache<CS> other_heads(2, 8, 4, 4);  // the same widths, other heads
    gattn::KVCache<CS> window3(2, 8, 2, 8, 0, 0, 3);
    RowMatrix<float> out = RowMatrix<float>::Constant(6, 16, 7.0f), gates, first;
    layer.forward(RowMatrix<float>::Random(6, 16), {0, 1, 2, 0, 1, 2}, cache, out, {3, 2}, &gates, &first);
    twin.forward(RowMatrix<float>::Random(2, 16), {0, 0}, twin_cache, out.topRows(2));
    out.setConstant(7.0f);
    const RowMatrix<float> x = RowMatrix<float>::Random(6, 16);
    const std::vector<Index> pos{3, 4, 5, 2, 3, 4};
    RowMatrix<float> narrow = RowMatrix<float>::Constant(6, 8, 7.0f), big = RowMatrix<float>::Constant(12, 16, 7.0f);
    RowMatrix<float> shared = x, x_nan = x, holds_x = x, holds_out = RowMatrix<float>::Constant(6, 16, 7.0f);
    x_nan(1, 0) = kInf;  // sequence 0, token 1: a valid token
    auto keys_as_x = [&] { return ConstMap(reinterpret_cast<const float*>(cache.keys().data()), 2, 16); };
    auto values_as_out = [&] {
        return Map(const_cast<float*>(reinterpret_cast<const float*>(cache.values().data())), 2, 16);
    };
    std::vector<Case> cases = {
        {"x of the wrong shape", Throws::ShapeError, fn, "x must have shape [B*N, hidden_size] = [multiple of 2, 16]",
         [&] { layer.forward(RowMatrix<float>::Random(6, 15), pos, cache, out, {}, &gates, &first); }},
        {"x whose rows are no multiple of the cache's batch", Throws::ShapeError, fn, "got [5, 16]",
         [&] {
             layer.forward(RowMatrix<float>::Random(5, 16), {1, 2, 3, 4, 5}, cache, out, {}, &gates, &first);
         }},
        {"out of the wrong shape", Throws::ShapeError, fn, "out must have shape [6, 16], got [6, 8]",
         [&] { layer.forward(x, pos, cache, narrow, {}, &gates, &first); }},
        {"positions of the wrong shape", Throws::ShapeError, fn, "positions must have shape [6], got [5]",
         [&] {
             layer.forward(x, {3, 4, 5, 2, 3}, cache, out, {}, &gates, &first);
         }},
        {"counts of the wrong shape", Throws::ShapeError, fn, "counts must have shape [2], got [3]",
         [&] {
             layer.forward(x, pos, cache, out, {1, 1, 1}, &gates, &first);
         }},
        {"a cache of other heads", Throws::ShapeError, fn, "cache must hold this layer's heads",
         [&] { layer.forward(x, pos, other_heads, out, {}, &gates, &first); }},
        {"a cache made by another layer's make_cache", Throws::InvalidArgument, fn, "cache belongs to another layer",
         [&] { layer.forward(x, pos, twin_cache, out, {}, &gates, &first); }},
        {"a window cache (the layer sees every token)", Throws::InvalidArgument, fn,
         "cache keeps only a window of 3 tokens; this layer's window is none",
         [&] { layer.forward(x, pos, window3, out, {}, &gates, &first); }},
        {"a count outside [0, N]", Throws::InvalidArgument, fn, "counts[1] must be in [0, 3], got 4",
         [&] {
             layer.forward(x, pos, cache, out, {3, 4}, &gates, &first);
         }},
        {"a negative count", Throws::InvalidArgument, fn, "counts[0] must be in [0, 3], got -1",
         [&] {
             layer.forward(x, pos, cache, out, {-1, 0}, &gates, &first);
         }},
        {"a sequence that would exceed the cache's capacity", Throws::InvalidArgument, fn,
         "cache sequence 0 would exceed the capacity 8 (holds 3, adding 6)",
         [&] { layer.forward(RowMatrix<float>::Random(12, 16), std::vector<Index>(12, 3), cache, big, {}); }},
        {"out sharing an element with x", Throws::InvalidArgument, fn, "out must not overlap x",
         [&] { layer.forward(shared, pos, cache, shared, {}, &gates, &first); }},
        {"x sharing an element with the cache's keys or values", Throws::InvalidArgument, fn,
         "x must not share an element with the cache's keys or values",
         [&] {
             layer.forward(keys_as_x(), {3, 2}, cache, out.topRows(2), {}, &gates, &first);
         }},
        {"out sharing an element with the cache's keys or values", Throws::InvalidArgument, fn,
         "out must not share an element with the cache's keys or values",
         [&] {
             layer.forward(x.topRows(2), {3, 2}, cache, values_as_out(), {}, &gates, &first);
         }},
        {"gate_scores holding x", Throws::InvalidArgument, fn, "gate_scores must not hold x or out",
         [&] { layer.forward(holds_x, pos, cache, out, {}, &holds_x, &first); }},
        {"first_key_probability holding out", Throws::InvalidArgument, fn,
         "first_key_probability must not hold x or out",
         [&] { layer.forward(x, pos, cache, holds_out, {}, &gates, &holds_out); }},
        {"gate_scores and first_key_probability the same matrix", Throws::InvalidArgument, fn,
         "gate_scores must not be first_key_probability",
         [&] { layer.forward(x, pos, cache, out, {}, &gates, &gates); }},
    };
    if (kInt8)
        cases.push_back({"a key or value that is NaN or infinite (int8 cache, as KVCache::append)",
                         Throws::InvalidArgument, "gattn::KVCache::append", "an int8 cache stores finite values only",
                         [&] { layer.forward(x_nan, pos, cache, out, {}, &gates, &first); }});
    run_cases(cases, [&] {
        Parts p;
        add_cache(p, "cache", cache);
        add_cache(p, "twin_cache", twin_cache);
        add_cache(p, "other_heads", other_heads);
        add_cache(p, "window3", window3);
        add_matrix(p, "out", out);
        add_matrix(p, "gate_scores", gates);
        add_matrix(p, "first_key_probability", first);
        add_matrix(p, "narrow", narrow);
        add_matrix(p, "big", big);
        add_matrix(p, "shared", shared);
        add_matrix(p, "holds_x", holds_x);
        add_matrix(p, "holds_out", holds_out);
        return p;
    });
}

TEST(ErrorPaths, Qwen3NextLeavesCacheAndOutputsAsTheyWere) {
    {
        SCOPED_TRACE("float cache");
        check_qwen_errors<float>();
    }
    {
        SCOPED_TRACE("int8 cache");
        check_qwen_errors<std::int8_t>();
    }
}

/// KVCache::append, truncate, check_truncate, lengths_after and capacity_after on a cache of S
/// holding tokens (window: a window cache that has dropped some).
template <class S>
void check_cache_errors(Index window) {
    using In = typename gattn::KVCache<S>::Input;
    constexpr bool kInt8 = std::is_same_v<S, std::int8_t>;
    gattn::KVCache<S> cache(2, 4, 2, 3, 0, 0, window);  // keys [8, 6]
    cache.append(RowMatrix<float>::Random(6, 6).cast<In>(), RowMatrix<float>::Random(6, 6).cast<In>(), {3, 2});
    // Then 1 more each without a window (4 of 4 rows), 2 and 1 with one (sequence 0 drops one).
    const std::vector<Index> more = window ? std::vector<Index>{2, 1} : std::vector<Index>{1, 1};
    cache.append(RowMatrix<float>::Random(4, 6).cast<In>(), RowMatrix<float>::Random(4, 6).cast<In>(), more);
    if (window) {
        ASSERT_GT(cache.first_positions()[0], 0);
    }
    const RowMatrix<In> k = RowMatrix<float>::Random(2, 6).cast<In>(), v = RowMatrix<float>::Random(2, 6).cast<In>();
    RowMatrix<In> k_nan = k, v_inf = v;
    k_nan(1, 4) = In(kNaN);
    v_inf(1, 0) = In(-kInf);
    const std::string append = "gattn::KVCache::append", truncate = "gattn::KVCache::truncate";
    // k and v inside the cache's storage: a view of its keys as Input (for int8, its scales).
    auto inside = [&] {
        if constexpr (kInt8)
            return Eigen::Map<const RowMatrix<In>>(cache.key_scales().data(), 2, 6);  // [8, 2] scales
        else
            return Eigen::Map<const RowMatrix<In>>(cache.keys().data(), 2, 6);
    };
    const std::vector<Index> seen = cache.lengths();
    std::vector<Case> cases = {
        {"append: k of the wrong shape", Throws::ShapeError, append,
         "k must have shape [B*n, 6] (B = the cache's batch, 2), got [2, 5]",
         [&] {
             cache.append(RowMatrix<In>::Zero(2, 5), v, {1, 1});
         }},
        {"append: v of the wrong shape", Throws::ShapeError, append, "v must have shape [2, 6], got [4, 6]",
         [&] {
             cache.append(k, RowMatrix<In>::Zero(4, 6), {1, 1});
         }},
        {"append: counts of the wrong shape", Throws::ShapeError, append, "counts must have shape [2], got [1]",
         [&] { cache.append(k, v, {1}); }},
        {"append: a count outside [0, n]", Throws::InvalidArgument, append, "counts[1] must be in [0, 1], got 2",
         [&] {
             cache.append(k, v, {0, 2});
         }},
        {"append: k inside the cache's storage", Throws::InvalidArgument, append,
         "k must not share an element with the cache's keys or values",
         [&] {
             cache.append(inside(), v, {0, 1});
         }},
        {"append: v inside the cache's storage", Throws::InvalidArgument, append,
         "v must not share an element with the cache's keys or values",
         [&] {
             cache.append(k, inside(), {0, 1});
         }},
        {"truncate: lengths of the wrong shape", Throws::ShapeError, truncate, "lengths must have shape [2], got [1]",
         [&] { cache.truncate({1}); }},
        {"truncate: a length longer than the current one", Throws::InvalidArgument, truncate, "lengths[0] must be in [",
         [&] {
             cache.truncate({seen[0] + 1, seen[1]});
         }},
        {"truncate: a negative length", Throws::InvalidArgument, truncate, "lengths[1] must be in [",
         [&] {
             cache.truncate({seen[0], -1});
         }},
        {"check_truncate: lengths of the wrong shape", Throws::ShapeError, truncate,
         "lengths must have shape [2], got [3]",
         [&] {
             cache.check_truncate({0, 0, 0});
         }},
        {"check_truncate: a length longer than the current one", Throws::InvalidArgument, truncate,
         "lengths[1] must be in [",
         [&] {
             cache.check_truncate({seen[0], seen[1] + 1});
         }},
        {"lengths_after: counts of the wrong shape", Throws::ShapeError, "gattn::KVCache::lengths_after",
         "counts must have shape [2], got [3]",
         [&] {
             (void)cache.lengths_after({1, 1, 1});
         }},
        {"capacity_after: counts of the wrong shape", Throws::ShapeError, "gattn::KVCache::capacity_after",
         "counts must have shape [2], got [1]", [&] { (void)cache.capacity_after({1}); }},
    };
    if (window == 0)
        cases.push_back({"append: the capacity exceeded without a window", Throws::InvalidArgument, append,
                         "counts[0] would exceed the capacity 4 (sequence holds 4)", [&] {
                             cache.append(k, v, {1, 0});
                         }});
    else
        cases.push_back({"truncate: below window - 1 once a window cache dropped tokens", Throws::InvalidArgument,
                         truncate, "(after dropping tokens a window cache keeps at least window − 1)", [&] {
                             cache.truncate({0, seen[1]});
                         }});
    if (kInt8) {
        cases.push_back({"append: a NaN appended to an int8 cache", Throws::InvalidArgument, append,
                         "k row 1 (sequence 1, new token 0), column 4 (KV head 1, feature 1) is nan", [&] {
                             cache.append(k_nan, v, {0, 1});
                         }});
        cases.push_back({"append: an infinity appended to an int8 cache", Throws::InvalidArgument, append,
                         "v row 1 (sequence 1, new token 0), column 0 (KV head 0, feature 0) is -inf", [&] {
                             cache.append(k, v_inf, {0, 1});
                         }});
    }
    run_cases(cases, [&] {
        Parts p;
        add_cache(p, "cache", cache);
        return p;
    });
}

TEST(ErrorPaths, KVCacheLeavesItsBytesAsTheyWere) {
    for (Index window : {0, 3}) {
        SCOPED_TRACE("window " + std::to_string(window));
        check_cache_errors<float>(window);
        check_cache_errors<std::int8_t>(window);
        check_cache_errors<gattn::bfloat16>(window);
    }
}

// A window cache whose rows must grow and cannot be allocated (its values would take 2^48
// bytes, beyond any address space) throws std::bad_alloc and keeps every part as it was: the
// grown keys (256 MiB, allocated first) are not swapped in alone.
TEST(ErrorPaths, WindowCacheThatCannotGrowStaysAsItWas) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    GTEST_SKIP() << "a sanitizer's allocator stops the program on a 2^48-byte request instead of failing it";
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
    GTEST_SKIP() << "a sanitizer's allocator stops the program on a 2^48-byte request instead of failing it";
#endif
#endif
    const Index dv = Index(1) << 20, window = Index(1) << 24;
    gattn::KVCache<float> cache(/*batch=*/2, /*capacity=*/1, /*num_kv_heads=*/1, /*head_dim=*/1, dv, 0, window);
    RowMatrix<float> k(2, 1), v = RowMatrix<float>::Zero(2, dv);
    k << 10, 20;
    cache.append(k, v, {1, 1});
    Parts before;
    add_cache(before, "cache", cache);
    // Two tokens each do not fit one row: the cache grows to 2·window rows per sequence.
    EXPECT_THROW(cache.append(RowMatrix<float>::Ones(4, 1), RowMatrix<float>::Ones(4, dv), {2, 2}), std::bad_alloc);
    Parts after;
    add_cache(after, "cache", cache);
    ASSERT_EQ(before.size(), after.size());
    for (std::size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(before[i] == after[i]) << before[i].first << " changed";
    EXPECT_EQ(cache.keys()(1, 0), 20.0f);  // sequence 1's token, at row 1·capacity
}

/// KVCacheSet: a layer's index out of range, the lengths of an empty set, and truncate, which
/// checks every cache before it changes any (here {2, 2} fits the first cache, not the window
/// cache of the second layer, which has dropped tokens).
TEST(ErrorPaths, KVCacheSetLeavesEveryCacheAsItWas) {
    const auto c = layer_config();
    const auto cw = layer_config(2);
    const gattn::GatedMultiHeadAttention<float> first(c, gattn::make_random_weights<float>(c, 6));
    const gattn::GatedMultiHeadAttention<float> second(cw, gattn::make_random_weights<float>(cw, 7));
    gattn::KVCacheSet<float> caches(std::vector<const gattn::GatedMultiHeadAttention<float>*>{&first, &second}, 2, 16);
    const gattn::KVCacheSet<float> empty;
    RowMatrix<float> out(10, 16);
    for (int step = 0; step < 2; ++step) {
        const RowMatrix<float> x = RowMatrix<float>::Random(10, 16);  // 5 tokens each, twice
        first.forward(x, caches[0], out);
        second.forward(x, caches[1], out);
    }
    ASSERT_GT(caches[1].first_positions()[0], 0);
    const gattn::KVCacheSet<float>& read_only = caches;
    const std::string fn = "gattn::KVCacheSet::truncate";
    const std::vector<Case> cases = {
        {"operator[] out of range", Throws::OutOfRange, "", "", [&] { (void)caches[2]; }},
        {"operator[] const out of range", Throws::OutOfRange, "", "", [&] { (void)read_only[5]; }},
        {"lengths of an empty set", Throws::OutOfRange, "", "", [&] { (void)empty.lengths(); }},
        {"truncate: lengths of the wrong shape", Throws::ShapeError, fn, "lengths must have shape [2], got [1]",
         [&] { caches.truncate({2}); }},
        {"truncate: a length outside what a cache can roll back to", Throws::InvalidArgument, fn,
         "lengths[0] must be in [",
         [&] {
             caches.truncate({2, 2});
         }},
        {"truncate: a length longer than the tokens seen", Throws::InvalidArgument, fn, "lengths[1] must be in [",
         [&] {
             caches.truncate({10, 11});
         }},
    };
    run_cases(cases, [&] {
        Parts p;
        add_cache(p, "caches[0]", caches[0]);
        add_cache(p, "caches[1]", caches[1]);
        return p;
    });
}

/// The snapshot sees what a call changes: a valid append changes the lengths and keys, and a
/// change to an int8 cache's scales alone (the rows quantize to the same codes) is seen too.
TEST(ErrorPaths, TheSnapshotSeesEveryPartChange) {
    gattn::KVCache<std::int8_t> cache(1, 4, 1, 2);
    auto parts = [&] {
        Parts p;
        add_cache(p, "cache", cache);
        return p;
    };
    RowMatrix<float> k(1, 2), v(1, 2);
    k << 1.0f, 0.5f;
    v << 2.0f, -1.0f;
    cache.append(k, v, {1});
    const Parts before = parts();
    cache.truncate({0});
    cache.append(k * 2.0f, v, {1});  // codes 127, 64 as before; the key scale doubles
    const Parts after = parts();
    ASSERT_EQ(before.size(), after.size());
    std::vector<std::string> changed;
    for (std::size_t i = 0; i < before.size(); ++i)
        if (before[i].second != after[i].second) changed.push_back(before[i].first);
    EXPECT_EQ(changed, std::vector<std::string>{"cache.key_scales"});
    cache.append(k, v, {1});
    EXPECT_NE(parts()[4].second, after[4].second) << "lengths";
}

/// Constructors refuse what a call would refuse later (the weights' values, the SDPA options
/// the config implies), and the other documented errors, naming the argument.
TEST(ErrorPaths, ConstructorsNameWhatTheyRefuse) {
    const auto c = layer_config();
    const auto w = gattn::make_random_weights<float>(c, 8);
    const auto qc = qwen_config();
    const auto qw = qwen_weights(qc, 9);
    const std::string gated = "gattn::GatedMultiHeadAttention", qwen = "gattn::Qwen3NextAttention";
    auto edited = [](auto weights, auto edit) {
        edit(weights);
        return weights;
    };
    std::vector<Case> cases = {
        {"GatedMultiHeadAttention: an invalid config", Throws::InvalidArgument, gated,
         "config.num_kv_heads must divide num_heads = 4, got 3",
         [&] {
             auto bad = c;
             bad.num_kv_heads = 3;
             gattn::GatedMultiHeadAttention<float> l(bad, w);
         }},
        {"GatedMultiHeadAttention: an invalid gate spec", Throws::InvalidArgument, gated, "gate",
         [&] {
             auto bad = c;
             bad.gate.sharing = gattn::GateSharing::HeadShared;
             bad.gate.granularity = gattn::GateGranularity::Headwise;
             gattn::GatedMultiHeadAttention<float> l(bad, w);
         }},
        {"GatedMultiHeadAttention: a weight missing", Throws::ShapeError, gated,
         "k_proj.weight must have shape [8, 16], got [0, 0] (missing: this config uses it)",
         [&] { gattn::GatedMultiHeadAttention<float> l(c, edited(w, [](auto& x) { x.k_proj_weight.resize(0, 0); })); }},
        {"GatedMultiHeadAttention: a weight misshapen", Throws::ShapeError, gated,
         "o_proj.weight must have shape [16, 16], got [16, 15]",
         [&] {
             gattn::GatedMultiHeadAttention<float> l(c, edited(w, [](auto& x) { x.o_proj_weight.resize(16, 15); }));
         }},
        {"GatedMultiHeadAttention: a weight given but unused", Throws::ShapeError, gated, "gate_theta must be empty",
         [&] { gattn::GatedMultiHeadAttention<float> l(c, edited(w, [](auto& x) { x.gate_theta.resize(4, 4); })); }},
        {"GatedMultiHeadAttention: a NaN weight", Throws::InvalidArgument, gated,
         "v_proj.weight[3, 7] must be finite, got nan",
         [&] { gattn::GatedMultiHeadAttention<float> l(c, edited(w, [](auto& x) { x.v_proj_weight(3, 7) = kNaN; })); }},
        {"GatedMultiHeadAttention: an infinite norm weight", Throws::InvalidArgument, gated,
         "q_norm.weight[1] must be finite, got -inf",
         [&] {
             auto qk = c;
             qk.qk_norm = gattn::QkNorm::RmsNorm;
             auto wq = gattn::make_random_weights<float>(qk, 8);
             wq.q_norm_weight[1] = -kInf;
             gattn::GatedMultiHeadAttention<float> l(qk, wq);
         }},
        {"GatedMultiHeadAttention: a NaN sink", Throws::InvalidArgument, gated,
         "sinks[2] must be finite or -inf (no sink), got nan",
         [&] { gattn::GatedMultiHeadAttention<float> l(c, edited(w, [](auto& x) { x.sinks[2] = kNaN; })); }},
        {"GatedMultiHeadAttention: a +inf sink", Throws::InvalidArgument, gated,
         "sinks[0] must be finite or -inf (no sink), got inf",
         [&] { gattn::GatedMultiHeadAttention<float> l(c, edited(w, [](auto& x) { x.sinks[0] = kInf; })); }},
        {"GatedMultiHeadAttention: a scale not finite in the compute type", Throws::InvalidArgument, gated,
         "scale must be finite in float, got 1e+300",
         [&] {
             auto bad = c;
             bad.scale = 1e300;
             gattn::GatedMultiHeadAttention<float> l(bad, w);
         }},
        {"GatedMultiHeadAttention: a tiny negative rms_norm_eps, shown as given", Throws::InvalidArgument, gated,
         "config.rms_norm_eps must be finite and >= 0, got -1e-50",
         [&] {
             auto bad = c;
             bad.qk_norm = gattn::QkNorm::RmsNorm;
             bad.rms_norm_eps = -1e-50;
             gattn::GatedMultiHeadAttention<float> l(bad, w);
         }},
        {"make_cache: a size < 1 (as the KVCache constructor)", Throws::InvalidArgument, "gattn::KVCache",
         "capacity must be >= 1, got 0", [&] { (void)gattn::GatedMultiHeadAttention<float>(c, w).make_cache(2, 0); }},
        {"Qwen3NextAttention: an invalid config", Throws::InvalidArgument, qwen,
         "config.rms_norm_eps must be finite and >= 0, got -1",
         [&] {
             auto bad = qc;
             bad.rms_norm_eps = -1;
             gattn::Qwen3NextAttention<float> l(bad, qw);
         }},
        {"Qwen3NextAttention: a weight misshapen", Throws::ShapeError, qwen,
         "k_norm.weight must have shape [8], got [7]",
         [&] { gattn::Qwen3NextAttention<float> l(qc, edited(qw, [](auto& x) { x.k_norm_weight.resize(7); })); }},
        {"Qwen3NextAttention: a bias while attention_bias is false", Throws::ShapeError, qwen,
         "o_proj.bias must be empty: attention_bias is false",
         [&] { gattn::Qwen3NextAttention<float> l(qc, edited(qw, [](auto& x) { x.o_proj_bias.setZero(16); })); }},
        {"Qwen3NextAttention: q_proj of a headwise gate's rows", Throws::ShapeError, qwen,
         "(a headwise gate checkpoint: H·d + H rows",
         [&] { gattn::Qwen3NextAttention<float> l(qc, edited(qw, [](auto& x) { x.q_proj_weight.resize(36, 16); })); }},
        {"Qwen3NextAttention: an infinite weight", Throws::InvalidArgument, qwen,
         "k_proj.weight[0, 1] must be finite, got inf",
         [&] { gattn::Qwen3NextAttention<float> l(qc, edited(qw, [](auto& x) { x.k_proj_weight(0, 1) = kInf; })); }},
        {"Qwen3NextAttention: a NaN sink", Throws::InvalidArgument, qwen,
         "sinks[2] must be finite or -inf (no sink), got nan",
         [&] { gattn::Qwen3NextAttention<float> l(qc, edited(qw, [](auto& x) { x.sinks[2] = kNaN; })); }},
        {"KVCache: a size < 1", Throws::InvalidArgument, "gattn::KVCache", "batch must be >= 1, got 0",
         [] { gattn::KVCache<float> k(0, 4, 1, 1); }},
        {"KVCache: value_head_dim < 0", Throws::InvalidArgument, "gattn::KVCache",
         "value_head_dim must be >= 0 (0 = head_dim), got -1", [] { gattn::KVCache<float> k(1, 4, 1, 1, -1); }},
        {"KVCache: a window outside [0, 2^40]", Throws::InvalidArgument, "gattn::KVCache",
         "window must be in [0, 2^40] (0 = keep every token), got -1",
         [] { gattn::KVCache<float> k(1, 4, 1, 1, 0, 0, -1); }},
        {"KVCache: sizes whose product overflows", Throws::InvalidArgument, "gattn::KVCache", "overflows",
         [] { gattn::KVCache<float> k(4, Index(1) << 62, 1, 1); }},
        {"KVCacheSet: as the layers' make_cache", Throws::InvalidArgument, "gattn::KVCache",
         "batch must be >= 1, got 0",
         [&] {
             const gattn::GatedMultiHeadAttention<float> l(c, w);
             gattn::KVCacheSet<float> s(std::vector<const gattn::GatedMultiHeadAttention<float>*>{&l}, 0, 4);
         }},
    };
    run_constructor_cases(cases);
}

/// The reproducer of a layer that changed its cache and then threw: a Qwen3-Next layer took a
/// NaN (or +∞) sink, and forward appended the call's keys and values (lengths 0 → 2) before
/// SDPA refused it. The layer now refuses the sink when it is built; with −∞ (no sink) for that
/// head it is built, and its forward fills the cache and an output that is finite.
TEST(ErrorPaths, Qwen3NextRefusesANonFiniteSinkBeforeAnyCache) {
    auto c = qwen_config();
    auto w = qwen_weights(c, 10);
    w.q_norm_weight.setZero();  // gains 1 + w = 1
    w.k_norm_weight.setZero();
    w.sinks = gattn::Vector<float>::Zero(4);
    for (float bad : {kNaN, kInf}) {
        w.sinks[2] = bad;
        EXPECT_THROW(gattn::Qwen3NextAttention<float>(c, w), std::invalid_argument);
    }
    w.sinks[2] = -kInf;
    const gattn::Qwen3NextAttention<float> layer(c, w);
    auto cache = layer.make_cache(1, 8);
    RowMatrix<float> out(2, 16);
    layer.forward(RowMatrix<float>::Random(2, 16), {0, 1}, cache, out);
    EXPECT_EQ(cache.lengths(), std::vector<Index>{2});
    EXPECT_TRUE(out.allFinite());
}

/// Every function that writes into a caller's matrix view refuses one whose rows overlap (row
/// stride below its columns, here cols − 1 and 1; Eigen reads a Map's row stride 0 as cols),
/// where one row's results would overwrite another's, before writing anything: the view's
/// buffer, the caches, the pools and the other outputs stay as they were.
TEST(ErrorPaths, OutputsWhoseRowsOverlapAreRefused) {
    using StridedMap = Eigen::Map<RowMatrix<float>, 0, Eigen::OuterStride<>>;
    using gattn::bfloat16;
    std::vector<float> buffer(4096, 7.0f);
    // A view of rows × cols over the buffer with row stride `stride`.
    auto view = [&](Index rows, Index cols, Index stride) {
        return StridedMap(buffer.data(), rows, cols, Eigen::OuterStride<>(stride));
    };
    std::mt19937 rng(31);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    auto random = [&](Index r, Index c) {
        return RowMatrix<float>(RowMatrix<float>::NullaryExpr(r, c, [&] { return u(rng); }));
    };

    // SDPA: B = 1, H = 2 on H_kv = 1, d = 4, N_q = 3, N_k = 5.
    const gattn::HeadLayout heads{1, 2, 1};
    const RowMatrix<float> q = random(3, 8), k = random(5, 4), v = random(5, 4), lse = random(3, 2);
    const RowMatrix<bfloat16> q16 = q.cast<bfloat16>(), k16 = k.cast<bfloat16>(), v16 = v.cast<bfloat16>();
    const RowMatrix<float> d_o = random(3, 8);
    RowMatrix<float> d_q = RowMatrix<float>::Constant(3, 8, 7.0f), d_k = RowMatrix<float>::Constant(5, 4, 7.0f),
                     d_v = d_k, lse_out = RowMatrix<float>::Constant(3, 2, 7.0f), merged = d_q;
    // Layers: the error-path configs (D = 16, 6 rows: B = 2 sequences of 3).
    const auto c = layer_config();
    const gattn::GatedMultiHeadAttention<float> layer(c, gattn::make_random_weights<float>(c, 1));
    auto cache = layer.make_cache<float>(2, 8);
    auto pool = layer.make_pool<float>(8, 16);
    const std::vector<gattn::SequenceId> seqs{pool.allocate(), pool.allocate()};
    const auto qc = qwen_config();
    const gattn::Qwen3NextAttention<float> qwen(qc, qwen_weights(qc, 2));
    auto qwen_cache = qwen.make_cache(2, 8);
    auto qwen_pool = qwen.make_pool<float>(8, 16);
    const std::vector<gattn::SequenceId> qwen_seqs{qwen_pool.allocate(), qwen_pool.allocate()};
    const RowMatrix<float> x = random(6, 16);
    gattn::ForwardActivations<float> saved;
    RowMatrix<float> y(6, 16);
    layer.forward_train(x, 2, y, saved);
    gattn::AttentionWeights<float> grads;
    // A paged pool of SDPA's shape holding the 5 keys, and a shared prefix of 16 keys.
    gattn::PagedKVPool<float> kv_pool(8, 16, 1, 4);
    const gattn::SequenceId s0 = kv_pool.allocate();
    kv_pool.append({s0}, k, v, {5});
    const gattn::SequenceId root = kv_pool.allocate();
    kv_pool.append({root}, random(16, 4), random(16, 4), {16});
    const gattn::SequenceId fork_a = kv_pool.fork(root), fork_b = kv_pool.fork(root);
    kv_pool.append({fork_a, fork_b}, random(2, 4), random(2, 4), {1, 1});
    const auto split = gattn::split_shared_prefix(kv_pool.page_table({fork_a, fork_b}), 16);
    const gattn::PackedLinear<bfloat16> linear(RowMatrix<float>::Random(8, 16).cast<bfloat16>());

    const std::string sdpa = "gattn::scaled_dot_product_attention",
                      layer_fn = "gattn::GatedMultiHeadAttention::forward",
                      qwen_fn = "gattn::Qwen3NextAttention::forward";
    std::vector<Case> cases;
    for (const bool by_one : {true, false}) {  // row stride cols − 1, then 1
        const std::string how = by_one ? " (row stride cols - 1)" : " (row stride 1)";
        auto add = [&](const std::string& what, const std::string& fn, const std::string& arg,
                       std::function<void()> call) {
            cases.push_back({what + how, Throws::InvalidArgument, fn, arg + " must have rows apart", std::move(call)});
        };
        auto out = [&view, by_one](Index rows, Index cols) { return view(rows, cols, by_one ? cols - 1 : 1); };
        add("SDPA, float", sdpa, "out",
            [&, out] { gattn::scaled_dot_product_attention<float>(q, k, v, heads, out(3, 8)); });
        add("SDPA, bf16 with a float out", sdpa, "out",
            [&, out] { gattn::scaled_dot_product_attention<bfloat16, float>(q16, k16, v16, heads, out(3, 8)); });
        add("merge_attention's out", "gattn::merge_attention", "out",
            [&, out] { gattn::merge_attention<float>(q, lse, q, lse, out(3, 8), lse_out); });
        add("merge_attention's lse", "gattn::merge_attention", "lse",
            [&, out] { gattn::merge_attention<float>(q, lse, q, lse, merged, out(3, 2)); });
        add("SDPA backward's d_query", "gattn::scaled_dot_product_attention_backward", "d_query", [&, out] {
            gattn::scaled_dot_product_attention_backward<float>(q, k, v, heads, q, lse, d_o, out(3, 8), d_k, d_v);
        });
        add("SDPA backward's d_key", "gattn::scaled_dot_product_attention_backward", "d_key", [&, out] {
            gattn::scaled_dot_product_attention_backward<float>(q, k, v, heads, q, lse, d_o, d_q, out(5, 4), d_v);
        });
        add("SDPA backward's d_value", "gattn::scaled_dot_product_attention_backward", "d_value", [&, out] {
            gattn::scaled_dot_product_attention_backward<float>(q, k, v, heads, q, lse, d_o, d_q, d_k, out(5, 4));
        });
        add("paged_attention", "gattn::paged_attention", "out",
            [&, out] { gattn::paged_attention<float, float>(q, kv_pool, kv_pool.page_table({s0}), 2, out(3, 8)); });
        add("cascade_attention", "gattn::cascade_attention", "out", [&, out] {
            gattn::cascade_attention<float, float>(q.topRows(2), kv_pool, split.first, split.second, 2, out(2, 8));
        });
        add("PackedLinear::forward", "gattn::PackedLinear::forward", "out",
            [&, out] { linear.forward<float, float>(x, out(6, 8)); });
        add("the layer without a cache", layer_fn, "out", [&, out] { layer.forward(x, 2, out(6, 16)); });
        add("the layer with a cache", layer_fn, "out", [&, out] { layer.forward(x, cache, out(6, 16)); });
        add("the layer over a pool", layer_fn, "out", [&, out] {
            layer.forward(x, {0, 3, 6}, pool, seqs, out(6, 16));
        });
        add("the layer's backward", "gattn::GatedMultiHeadAttention::backward", "d_x",
            [&, out] { layer.backward(x, saved, y, grads, out(6, 16)); });
        add("Qwen3-Next with a cache", qwen_fn, "out", [&, out] {
            qwen.forward(x, {0, 1, 2, 0, 1, 2}, qwen_cache, out(6, 16));
        });
        add("Qwen3-Next over a pool", qwen_fn, "out", [&, out] {
            qwen.forward(x, {0, 3, 6}, qwen_pool, qwen_seqs, out(6, 16));
        });
    }
    auto add_pool = [](Parts& p, const std::string& name, const auto& pl, const std::vector<gattn::SequenceId>& ids) {
        p.push_back({name + ".keys", bytes_of(pl.keys())});
        p.push_back({name + ".values", bytes_of(pl.values())});
        for (gattn::SequenceId id : ids) p.push_back({name + " length", std::to_string(pl.length(id))});
    };
    run_cases(cases, [&] {
        Parts p;
        p.push_back(
            {"the view's buffer", std::string(reinterpret_cast<const char*>(buffer.data()), buffer.size() * 4)});
        add_cache(p, "cache", cache);
        add_cache(p, "qwen_cache", qwen_cache);
        add_pool(p, "pool", pool, seqs);
        add_pool(p, "qwen_pool", qwen_pool, qwen_seqs);
        add_matrix(p, "d_q", d_q);
        add_matrix(p, "d_k", d_k);
        add_matrix(p, "d_v", d_v);
        add_matrix(p, "lse_out", lse_out);
        add_matrix(p, "merged", merged);
        add_matrix(p, "grads.o_proj_weight", grads.o_proj_weight);
        return p;
    });
    // A view whose rows are apart, however closely, is taken: row stride = cols.
    gattn::scaled_dot_product_attention<float>(q, k, v, heads, view(3, 8, 8));
    RowMatrix<float> expected(3, 8);
    gattn::scaled_dot_product_attention<float>(q, k, v, heads, expected);
    EXPECT_EQ(RowMatrix<float>(view(3, 8, 8)), expected);
}

}  // namespace error_paths
