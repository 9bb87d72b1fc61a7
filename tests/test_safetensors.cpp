// The safetensors reader and the weight loader: dtype conversion and every error it reports.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/stat.h>
#endif

#include "gattn/io/safetensors.hpp"
#include "support/safetensors_writer.hpp"

// The largest single allocation by operator new since the last reset: this executable replaces
// the global operator new (and its deletes) to check that a header cannot make the reader
// allocate what the file does not hold.
namespace {
std::atomic<std::size_t> g_largest_allocation{0};
}  // namespace

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"  // new and delete here are malloc and free
#endif
void* operator new(std::size_t n) {
    std::size_t seen = g_largest_allocation.load(std::memory_order_relaxed);
    while (n > seen && !g_largest_allocation.compare_exchange_weak(seen, n, std::memory_order_relaxed)) {
    }
    if (void* p = std::malloc(n ? n : 1)) return p;
    throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

namespace {

using gattn::Index;

using gattn_test::bytes_of;
using gattn_test::RawTensor;

std::string temp_path(const std::string& name) {
    return (std::filesystem::temp_directory_path() / ("gattn_test_" + name + ".safetensors")).string();
}

std::string write_file(const std::string& name, const std::vector<RawTensor>& tensors,
                       const std::string& header_override = "", std::size_t truncate_data = 0) {
    const std::string path = temp_path(name);
    gattn_test::write_safetensors(path, tensors, header_override, truncate_data);
    return path;
}

std::vector<unsigned char> u16_bytes(const std::vector<std::uint16_t>& v) { return bytes_of(v); }

TEST(Safetensors, ConvertsF16BF16F32F64) {
    // Hand-worked encodings: F16 0x3C00 = 1, 0xC000 = -2, 0x3555 ≈ 0.333251953125,
    // 0x0001 = 2^-24 (subnormal), 0x7C00 = +inf. BF16 0x3F80 = 1, 0xC0A0 = -5, 0x3EAB = 0.333984375.
    const std::string path =
        write_file("dtypes", {{"h", "F16", {5}, u16_bytes({0x3C00, 0xC000, 0x3555, 0x0001, 0x7C00})},
                              {"b", "BF16", {3}, u16_bytes({0x3F80, 0xC0A0, 0x3EAB})},
                              {"f", "F32", {2, 2}, bytes_of(std::vector<float>{1.5f, -2.25f, 3.0f, 0.125f})},
                              {"d", "F64", {1, 2}, bytes_of(std::vector<double>{0.1, -7.0})}});
    const gattn::SafetensorsFile f(path);
    const auto h = f.values<double>("h");
    EXPECT_EQ(h[0], 1.0);
    EXPECT_EQ(h[1], -2.0);
    EXPECT_EQ(h[2], 0.333251953125);
    EXPECT_EQ(h[3], std::ldexp(1.0, -24));
    EXPECT_TRUE(std::isinf(h[4]) && h[4] > 0);
    EXPECT_EQ(f.values<float>("b"), (std::vector<float>{1.0f, -5.0f, 0.333984375f}));
    const auto m = f.matrix<float>("f");
    EXPECT_EQ(m.rows(), 2);
    EXPECT_EQ(m(1, 0), 3.0f);
    EXPECT_EQ(f.matrix<double>("d")(0, 0), 0.1);
    EXPECT_EQ(f.vector<float>("h").size(), 5);
    EXPECT_EQ(f.metadata().at("format"), "pt");
    EXPECT_THROW(f.vector<float>("f"), gattn::shape_error);
}

/// 16-bit tensors read as their own type keep their bits (NaN payload included); F32 read as
/// bf16 rounds to nearest, ties to even (hand-worked: 1 + 2⁻⁸ is a tie between 1 and 1 + 2⁻⁷
/// and goes to 1 (0x3F80); 1 + 3·2⁻⁸ goes to 1 + 2⁻⁶ (0x3F82)); a bf16 layer loads from them.
TEST(Safetensors, ReadsSixteenBitTensorsAsSixteenBitTypes) {
    const std::string path =
        write_file("sixteen", {{"b", "BF16", {3}, u16_bytes({0x3F80, 0xC0A0, 0x7FC1})},
                               {"h", "F16", {2}, u16_bytes({0x3555, 0x7E01})},
                               {"f", "F32", {2}, bytes_of(std::vector<float>{1.00390625f, 1.01171875f})}});
    const gattn::SafetensorsFile f(path);
    auto bits = [](const auto& v) {
        std::vector<std::uint16_t> out;
        for (const auto& x : v) {
            std::uint16_t b;
            std::memcpy(&b, &x, 2);
            out.push_back(b);
        }
        return out;
    };
    EXPECT_EQ(bits(f.values<gattn::bfloat16>("b")), (std::vector<std::uint16_t>{0x3F80, 0xC0A0, 0x7FC1}));
    EXPECT_EQ(bits(f.values<gattn::half>("h")), (std::vector<std::uint16_t>{0x3555, 0x7E01}));
    EXPECT_EQ(bits(f.values<gattn::bfloat16>("f")), (std::vector<std::uint16_t>{0x3F80, 0x3F82}));
}

/// block() reads a rectangle of a tensor: element (r, c) of a [4, 5] F32 tensor holding
/// 10·r + c, and of a BF16 one holding small integers (exact in bf16), whole rows and a column
/// range; a 1-D tensor reads as one row; a block outside the tensor is refused with its shape.
TEST(Safetensors, ReadsABlockOfRowsAndColumns) {
    std::vector<float> f(20);
    std::vector<std::uint16_t> b(20);
    for (int r = 0; r < 4; ++r)
        for (int c = 0; c < 5; ++c) {
            f[r * 5 + c] = float(10 * r + c);
            const float v = float(10 * r + c);
            std::uint32_t u;
            std::memcpy(&u, &v, 4);
            b[r * 5 + c] = static_cast<std::uint16_t>(u >> 16);  // exact: the integers fit in 8 bits
        }
    const std::string path = write_file("block", {{"f", "F32", {4, 5}, bytes_of(f)},
                                                  {"b", "BF16", {4, 5}, u16_bytes(b)},
                                                  {"v", "F64", {3}, bytes_of(std::vector<double>{7, 8, 9})},
                                                  {"e", "F32", {3, 0}, bytes_of(std::vector<float>{})}});
    const gattn::SafetensorsFile file(path);
    const gattn::RowMatrix<double> cols = file.block<double>("f", 1, 2, 3, 2);
    ASSERT_EQ(cols.rows(), 2);
    ASSERT_EQ(cols.cols(), 2);
    EXPECT_EQ(cols(0, 0), 13);
    EXPECT_EQ(cols(0, 1), 14);
    EXPECT_EQ(cols(1, 0), 23);
    EXPECT_EQ(cols(1, 1), 24);
    const gattn::RowMatrix<float> rows = file.block<float>("b", 2, 2, 0, 5);
    for (int r = 0; r < 2; ++r)
        for (int c = 0; c < 5; ++c) EXPECT_EQ(rows(r, c), float(10 * (r + 2) + c));
    const gattn::RowMatrix<double> v = file.block<double>("v", 0, 1, 1, 2);
    EXPECT_EQ(v(0, 0), 8);
    EXPECT_EQ(v(0, 1), 9);
    EXPECT_EQ(file.block<double>("f", 4, 0, 0, 5).size(), 0);
    try {
        (void)file.block<double>("f", 3, 2, 0, 5);
        ADD_FAILURE() << "a block past the last row was read";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("[4, 5]"), std::string::npos) << e.what();
    }
    EXPECT_THROW((void)file.block<double>("f", 0, 1, 4, 2), std::invalid_argument);
    EXPECT_THROW((void)file.block<double>("missing", 0, 1, 0, 1), gattn::io_error);
    try {  // an empty tensor's message gives its own shape
        (void)file.block<double>("e", 0, 1, 0, 1);
        ADD_FAILURE() << "a block of an empty tensor was read";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("of shape [3, 0]"), std::string::npos) << e.what();
    }
}

/// A shard read block by block from a file equals the shard cut from the whole layer's weights
/// in memory (shard_attention), for fused layouts re-laid for a shard that holds part of a KV
/// group, head-shared gates (averaged over every head) and a G5 gate (whole).
TEST(Safetensors, LoadsAHeadParallelShardAsShardAttentionCutsIt) {
    auto config = [](gattn::GateSpec g, Index Hkv) {
        gattn::AttentionConfig c;
        c.d_model = 24;
        c.num_heads = 4;
        c.num_kv_heads = Hkv;
        c.head_dim = 8;
        c.qkv_bias = c.o_bias = true;
        c.sinks = true;
        c.qk_norm = gattn::QkNorm::RmsNorm;
        c.gate = g;
        return c;
    };
    gattn::GateSpec shared = gattn::GateSpec::g1_elementwise();
    shared.sharing = gattn::GateSharing::HeadShared;
    shared.bias = true;
    gattn::GateSpec g5;
    g5.position = gattn::GatePosition::G5;
    g5.bias = true;
    gattn::GateSpec query = gattn::GateSpec::g1_headwise();
    query.source = gattn::GateSource::Query;
    for (const auto& c : {config(gattn::GateSpec::g1_headwise(gattn::GateLayout::GroupedByKV), 1),
                          config(gattn::GateSpec::g1_elementwise(gattn::GateLayout::PerHeadInterleaved), 2),
                          config(shared, 2), config(g5, 2), config(query, 1)}) {
        const auto whole = gattn::make_random_weights<float>(c, 17);
        const std::string path = write_file("shard", gattn_test::f32_tensors(whole, "layer."));
        const gattn::SafetensorsFile file(path);
        const gattn::HeadShard shard{2, 2, c.num_kv_heads == 1 ? 0 : 1, 1};  // query heads 2, 3
        const auto [read_config, read] = gattn::load_attention_shard<float>(file, c, shard, "layer.");
        const auto [cut_config, cut] = gattn::shard_attention(c, whole, shard);
        EXPECT_EQ(read_config.num_heads, 2);
        EXPECT_EQ(read_config.gate, cut_config.gate);
        std::vector<std::string> compared;
        read.for_each([&, &cut = cut](const char* name, const auto& t) {
            cut.for_each([&](const char* other, const auto& u) {
                if constexpr (std::is_same_v<decltype(t), decltype(u)>) {
                    if (std::string(name) == other) {
                        EXPECT_TRUE(t == u) << name << " (gate " << gattn::describe(c.gate) << ")";
                        if (t.size()) compared.push_back(name);
                    }
                }
            });
        });
        EXPECT_GE(compared.size(), 10u);
    }
    // A missing tensor is named before anything is read.
    const auto c = config(gattn::GateSpec{}, 2);
    const std::string path = write_file(
        "shard_missing", {gattn_test::f32_tensor("layer.q_proj.weight", gattn::RowMatrix<float>::Zero(32, 24))});
    try {
        (void)gattn::load_attention_shard<float>(gattn::SafetensorsFile(path), c, gattn::HeadShard{0, 2, 0, 1},
                                                 "layer.");
        ADD_FAILURE() << "no exception";
    } catch (const gattn::io_error& e) {
        EXPECT_NE(std::string(e.what()).find("layer.k_proj.weight"), std::string::npos) << e.what();
    }
}

/// The shards of a layer, each read from a file and run as a GatedMultiHeadAttention of its
/// own, sum to the whole layer's output (the sum head parallelism computes over MPI): whole KV
/// groups per shard (8 heads, 4 KV heads, 2 groups a shard) and parts of one group (4 heads,
/// 1 KV head), for the gate layouts whose rows a shard re-lays or averages.
TEST(Safetensors, TheShardsOfALayerSumToTheWholeLayer) {
    using gattn::GatePosition;
    gattn::GateSpec shared = gattn::GateSpec::g1_elementwise();
    shared.sharing = gattn::GateSharing::HeadShared;
    shared.bias = true;
    gattn::GateSpec query = gattn::GateSpec::g1_headwise();
    query.source = gattn::GateSource::Query;
    gattn::GateSpec theta = gattn::GateSpec::g1_elementwise();
    theta.source = gattn::GateSource::InputIndependent;
    auto at = [](GatePosition p, gattn::GateGranularity g = gattn::GateGranularity::Elementwise) {
        gattn::GateSpec s;
        s.position = p;
        s.granularity = g;
        return s;
    };
    const std::vector<gattn::GateSpec> gates{gattn::GateSpec::g1_headwise(gattn::GateLayout::GroupedByKV),
                                             gattn::GateSpec::g1_elementwise(gattn::GateLayout::GroupedByKV),
                                             gattn::GateSpec::g1_elementwise(gattn::GateLayout::PerHeadInterleaved),
                                             shared,
                                             query,
                                             theta,
                                             at(GatePosition::G2),
                                             at(GatePosition::G3, gattn::GateGranularity::Headwise),
                                             at(GatePosition::G4)};
    for (const auto& [H, Hkv] : {std::pair<Index, Index>{8, 4}, {4, 1}})
        for (const auto& g : gates) {
            gattn::AttentionConfig c;
            c.d_model = 20;
            c.num_heads = H;
            c.num_kv_heads = Hkv;
            c.head_dim = 8;
            c.qkv_bias = c.o_bias = true;
            c.causal = true;
            c.gate = g;
            const std::string path =
                write_file("shards", gattn_test::f32_tensors(gattn::make_random_weights<double>(c, 29)));
            const gattn::SafetensorsFile file(path);
            const gattn::GatedMultiHeadAttention<double> whole(c, gattn::load_attention_weights<double>(file, c));
            std::mt19937 rng(6);
            std::normal_distribution<double> normal;
            gattn::RowMatrix<double> x(10, c.d_model);
            for (Index i = 0; i < x.size(); ++i) x.data()[i] = normal(rng);
            gattn::RowMatrix<double> sum = gattn::RowMatrix<double>::Zero(10, c.d_model);
            for (int rank = 0; rank < 2; ++rank) {
                const gattn::HeadShard shard = gattn::head_shard(H, Hkv, rank, 2);
                const auto [config, weights] = gattn::load_attention_shard<double>(file, c, shard);
                sum += gattn::GatedMultiHeadAttention<double>(config, weights).forward(x, 2);
            }
            EXPECT_LE((sum - whole.forward(x, 2)).cwiseAbs().maxCoeff(), 1e-12)
                << H << " heads, " << Hkv << " KV heads, gate " << gattn::describe(g);
        }
    // A shard whose query heads would read another KV head than in the whole layer.
    gattn::AttentionConfig c;
    c.d_model = 20;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 8;
    const auto w = gattn::make_random_weights<double>(c, 1);
    EXPECT_THROW((void)gattn::shard_attention(c, w, gattn::HeadShard{0, 2, 0, 2}), std::invalid_argument);
    EXPECT_THROW((void)gattn::shard_attention(c, w, gattn::HeadShard{0, 2, 1, 1}), std::invalid_argument);
}

void expect_io_error(const std::string& path, const std::string& needle) {
    try {
        gattn::SafetensorsFile f(path);
        ADD_FAILURE() << "no exception for " << needle;
    } catch (const gattn::io_error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
}

TEST(Safetensors, ReportsMalformedFiles) {
    const RawTensor t{"w", "F32", {2}, bytes_of(std::vector<float>{1, 2})};
    expect_io_error(temp_path("does_not_exist"), "cannot open");
    expect_io_error(write_file("truncated_data", {t}, "", 4), "truncated");
    expect_io_error(write_file("bad_json", {t}, "{\"w\": [1, 2"), "malformed JSON");
    expect_io_error(write_file("bad_entry", {t}, "{\"w\": {\"dtype\": \"F32\"}}"), "malformed header entry");
    expect_io_error(write_file("size_mismatch", {{"w", "F32", {3}, bytes_of(std::vector<float>{1, 2})}}),
                    "do not hold shape [3]");
    expect_io_error(write_file("bad_dtype", {{"w", "Q4", {2}, bytes_of(std::vector<float>{1, 2})}}), "unknown dtype");
    // Tensors must tile the data section (8 bytes here): no overlap, no gap, nothing left over.
    const std::string a = "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":";
    const std::string b = "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":";
    expect_io_error(
        write_file("overlap", {t}, "{" + a + "[0,4]}," + b + "[0,4]}}"),
        "tensor 'b' starts at byte 0, expected 4 (tensors must follow one another without gaps or overlaps)");
    expect_io_error(write_file("gap", {t}, "{" + a + "[4,8]}}"), "tensor 'a' starts at byte 4, expected 0");
    expect_io_error(write_file("left_over", {t}, "{" + a + "[0,4]}}"),
                    "4 bytes after the last tensor (byte 4 of a 8-byte data section)");
    {
        const gattn::SafetensorsFile tiled(write_file("tiled", {t}, "{" + b + "[4,8]}," + a + "[0,4]}}"));
        EXPECT_EQ(tiled.values<float>("a"), std::vector<float>{1});
        EXPECT_EQ(tiled.values<float>("b"), std::vector<float>{2});
    }
    {
        const std::string path = temp_path("short");
        std::ofstream(path, std::ios::binary) << "abc";
        expect_io_error(path, "truncated");
    }
    {
        const std::string path = temp_path("huge_header");
        std::ofstream f(path, std::ios::binary);
        for (int i = 0; i < 8; ++i) f.put(static_cast<char>(0x7f));
        f << "{}";
        f.close();
        expect_io_error(path, "header length");
        expect_io_error(path, "not a safetensors file?");
    }
    const gattn::SafetensorsFile ok(write_file("ints", {{"i", "I32", {2}, bytes_of(std::vector<std::int32_t>{3, -4})},
                                                        {"l", "I64", {1}, bytes_of(std::vector<std::int64_t>{1})},
                                                        {"u", "U8", {1}, std::vector<unsigned char>{7}}}));
    EXPECT_EQ(ok.values<double>("i"), (std::vector<double>{3.0, -4.0}));  // positions, lengths
    EXPECT_EQ(ok.values<float>("l"), (std::vector<float>{1.0f}));
    EXPECT_THROW(ok.values<float>("u"), gattn::io_error);
    EXPECT_THROW(ok.values<float>("absent"), gattn::io_error);
    // Dtypes gattn does not convert (FP8 scales, complex, FP4/FP6 packs) do not hide the file's
    // other tensors; a zero-length 1-D tensor is a [1, 0] matrix.
    const gattn::SafetensorsFile mixed(
        write_file("mixed", {{"scale", "F8_E8M0", {2}, std::vector<unsigned char>{127, 128}},
                             {"packed", "F4", {4}, std::vector<unsigned char>{0x21, 0x43}},
                             {"w", "F32", {2}, bytes_of(std::vector<float>{5, 6})},
                             {"c", "C64", {1}, bytes_of(std::vector<float>{1, 2})},
                             {"none", "F32", {0}, {}}}));
    EXPECT_EQ(mixed.values<float>("w"), (std::vector<float>{5, 6}));
    EXPECT_THROW(mixed.values<float>("scale"), gattn::io_error);
    EXPECT_THROW(mixed.values<float>("packed"), gattn::io_error);
    const auto none = mixed.matrix<float>("none");
    EXPECT_EQ(none.rows(), 1);
    EXPECT_EQ(none.cols(), 0);
    const RawTensor one{"w", "F32", {1}, bytes_of(std::vector<float>{4})};
    const gattn::SafetensorsFile null_metadata(
        write_file("null_metadata", {one},
                   "{\"__metadata__\":null,\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}"));
    EXPECT_EQ(null_metadata.values<float>("w"), std::vector<float>{4});
    expect_io_error(write_file("f4_odd", {{"p", "F4", {3}, std::vector<unsigned char>{0x21, 0x43}}}),
                    "2 bytes do not hold shape [3] of F4");
}

TEST(Safetensors, LoaderNamesMissingAndMisshapenTensors) {
    gattn::AttentionConfig c;
    c.d_model = 8;
    c.num_heads = 2;
    c.num_kv_heads = 1;
    c.head_dim = 4;
    c.gate = gattn::GateSpec::g1_elementwise(gattn::GateLayout::PerHeadInterleaved);
    const auto w = gattn::make_random_weights<float>(c, 1);
    auto raw = [](const std::string& n, const gattn::RowMatrix<float>& m) {
        return RawTensor{n, "F32", {m.rows(), m.cols()}, bytes_of(std::vector<float>(m.data(), m.data() + m.size()))};
    };
    const std::string prefix = "model.layers.3.self_attn.";
    const std::vector<RawTensor> all{raw(prefix + "q_proj.weight", w.q_proj_weight),
                                     raw(prefix + "k_proj.weight", w.k_proj_weight),
                                     raw(prefix + "v_proj.weight", w.v_proj_weight),
                                     raw(prefix + "o_proj.weight", w.o_proj_weight)};
    const gattn::SafetensorsFile good(write_file("layer", all));
    const auto loaded = gattn::load_attention_weights<float>(good, c, prefix);
    EXPECT_EQ(loaded.q_proj_weight, w.q_proj_weight);
    EXPECT_EQ(loaded.o_proj_weight, w.o_proj_weight);

    try {  // a headwise config reading an elementwise checkpoint: q_proj has H·2d rows, not H·d + H
        auto headwise = c;
        headwise.gate.granularity = gattn::GateGranularity::Headwise;
        gattn::load_attention_weights<float>(good, headwise, prefix);
        ADD_FAILURE() << "no exception";
    } catch (const gattn::shape_error& e) {
        EXPECT_NE(std::string(e.what()).find("q_proj.weight must have shape [10, 8], got [16, 8]"), std::string::npos)
            << e.what();
    }
    const gattn::SafetensorsFile missing(write_file("missing", {all[0], all[1], all[3]}));
    try {
        gattn::load_attention_weights<float>(missing, c, prefix);
        ADD_FAILURE() << "no exception";
    } catch (const gattn::io_error& e) {
        EXPECT_NE(std::string(e.what()).find("missing tensor 'model.layers.3.self_attn.v_proj.weight'"),
                  std::string::npos)
            << e.what();
        EXPECT_NE(std::string(e.what()).find("no tensor of the file ends in 'v_proj.weight'"), std::string::npos)
            << e.what();
    }
    {  // an integer tensor (I64 converts for positions, never for weights) is named with its dtype
        auto ints = all;
        std::vector<std::int64_t> big(static_cast<std::size_t>(w.k_proj_weight.size()), std::int64_t(1) << 62);
        ints[1] =
            RawTensor{prefix + "k_proj.weight", "I64", {w.k_proj_weight.rows(), w.k_proj_weight.cols()}, bytes_of(big)};
        const gattn::SafetensorsFile file(write_file("int_weight", ints));
        try {
            gattn::load_attention_weights<float>(file, c, prefix);
            ADD_FAILURE() << "no exception";
        } catch (const gattn::io_error& e) {
            EXPECT_NE(std::string(e.what()).find("model.layers.3.self_attn.k_proj.weight has dtype I64"),
                      std::string::npos)
                << e.what();
            EXPECT_NE(std::string(e.what()).find("weights must be F32, F16, BF16 or F64"), std::string::npos)
                << e.what();
        }
    }
    try {  // the prefix left out: the message names the tensor the file holds under it
        gattn::load_attention_weights<float>(good, c);
        ADD_FAILURE() << "no exception";
    } catch (const gattn::io_error& e) {
        EXPECT_NE(std::string(e.what()).find("missing tensor 'q_proj.weight' (prefix ''); the file has "
                                             "'model.layers.3.self_attn.q_proj.weight'"),
                  std::string::npos)
            << e.what();
    }
}

TEST(Safetensors, RejectsOverflowingShapesAndNumbers) {
    const RawTensor t{"w", "F32", {1}, bytes_of(std::vector<float>{1})};
    expect_io_error(write_file("dims_overflow", {t},
                               "{\"a\":{\"dtype\":\"F32\",\"shape\":[18446744073709551615,18446744073709551615],"
                               "\"data_offsets\":[0,4]}}"),
                    "elements");
    expect_io_error(write_file("count_overflow", {t},
                               "{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904],\"data_offsets\":[0,0]}}"),
                    "elements");
    expect_io_error(write_file("number_overflow", {t}, "{\"__metadata__\":{\"x\":1e400}}"), "malformed JSON");
}

/// A file written byte by byte: the 8-byte little-endian length of `header`, `header`, `data`.
std::string write_bytes(const std::string& name, const std::string& header, const std::string& data) {
    const std::string path = temp_path(name);
    std::string bytes;
    for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>((std::uint64_t(header.size()) >> (8 * i)) & 0xff));
    std::ofstream(path, std::ios::binary) << bytes << header << data;
    return path;
}

/// A tensor named twice is refused, naming it, as the format's reference reader does; so is
/// any key named twice in one object of the header. (A parsed JSON document keeps only the
/// last of equal keys, which the reader would then take as the whole header.)
TEST(Safetensors, RefusesNamesGivenTwice) {
    const std::string w = "\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}";
    const std::string data(8, '\0');
    {  // the bytes: header length 0x6b = 107, the header, 8 bytes of data
        const std::string header = "{" + w + "," + w + "}";
        ASSERT_EQ(header.size(), 107u);
        const std::string path = write_bytes("duplicate_tensor", header, data);
        std::ifstream in(path, std::ios::binary);
        std::string got(8, '\0');
        in.read(got.data(), 8);
        EXPECT_EQ(got, std::string("\x6b\0\0\0\0\0\0\0", 8));
        expect_io_error(path, "malformed header: key 'w' appears twice in the top-level object");
    }
    // Twice with different dtypes or spans: the file is refused either way.
    expect_io_error(write_bytes("duplicate_tensor_dtype",
                                "{" + w + ",\"w\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[0,8]}}", data),
                    "key 'w' appears twice");
    expect_io_error(write_bytes("duplicate_field",
                                "{\"w\":{\"dtype\":\"F64\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
                                data),
                    "key 'dtype' appears twice in the object of 'w'");
    expect_io_error(write_bytes("duplicate_metadata", "{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}," + w + "}", data),
                    "key 'k' appears twice in the object of '__metadata__'");
    // Equal keys in different objects are fine.
    const gattn::SafetensorsFile ok(
        write_bytes("same_key_elsewhere", "{\"__metadata__\":{\"w\":\"x\"}," + w + "}", data));
    EXPECT_EQ(ok.names(), std::vector<std::string>{"w"});
    EXPECT_EQ(ok.metadata().at("w"), "x");
}

/// The header is checked against the file before anything is allocated for it or for a tensor:
/// a header may not make the reader allocate what the file does not hold.
TEST(Safetensors, AllocatesNoMoreThanTheFileHolds) {
    constexpr std::size_t kSmall = 1 << 16;  // far below every size the headers below declare
    auto largest_while = [](const auto& f) {
        g_largest_allocation = 0;
        f();
        return g_largest_allocation.load();
    };
    // 2^40 F32 elements (4 TiB) declared, offsets beyond the 8 bytes the file holds.
    const auto start = std::chrono::steady_clock::now();
    const std::string huge =
        write_bytes("huge_shape",
                    "{\"w\":{\"dtype\":\"F32\",\"shape\":[1099511627776],\"data_offsets\":[0,4398046511104]}}",
                    std::string(8, '\0'));
    EXPECT_LT(largest_while([&] {
                  expect_io_error(huge,
                                  "truncated: tensor 'w' spans bytes [0, 4398046511104) of a 8-byte data section");
              }),
              kSmall);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
    // The same shape over the 8 bytes that are there.
    EXPECT_LT(largest_while([&] {
                  expect_io_error(
                      write_bytes("huge_shape_in_file",
                                  "{\"w\":{\"dtype\":\"F32\",\"shape\":[1099511627776],\"data_offsets\":[0,8]}}",
                                  std::string(8, '\0')),
                      "8 bytes do not hold shape [1099511627776] of F32");
              }),
              kSmall);
    // A header length of 50 MB (under the format's 100 MB limit) in a file of 16 bytes.
    {
        const std::string path = temp_path("long_header_length");
        std::string bytes(16, ' ');
        const std::uint64_t n = 50'000'000;
        for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
        std::ofstream(path, std::ios::binary) << bytes;
        EXPECT_LT(largest_while(
                      [&] { expect_io_error(path, "truncated: header length 50000000 exceeds the 8 bytes after it"); }),
                  kSmall);
    }
    // A tensor of a dtype that does not convert (F4: 2^20 elements in 512 KiB) is refused before
    // its bytes or 2^20 doubles are allocated.
    const gattn::SafetensorsFile packed(
        write_file("packed_f4", {{"p", "F4", {1 << 20}, std::vector<unsigned char>(1 << 19)}}));
    EXPECT_LT(largest_while([&] { EXPECT_THROW(packed.values<double>("p"), gattn::io_error); }), kSmall);
    // Reading a tensor allocates its bytes and the result: here 4 KiB of F16 read as double.
    const gattn::SafetensorsFile f16(write_file("f16_4k", {{"h", "F16", {2048}, std::vector<unsigned char>(4096)}}));
    const std::size_t read = largest_while([&] { EXPECT_EQ(f16.values<double>("h").size(), 2048u); });
    EXPECT_EQ(read, 2048 * sizeof(double));
}

/// Only regular files open: a directory is refused, and a FIFO is refused without blocking.
TEST(Safetensors, OpensOnlyRegularFiles) {
    expect_io_error(std::filesystem::temp_directory_path().string(), "not a regular file");
#if defined(__unix__) || defined(__APPLE__)
    const std::string fifo = temp_path("fifo");
    std::filesystem::remove(fifo);
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
    expect_io_error(fifo, "not a regular file");
    std::filesystem::remove(fifo);
#endif
}

/// Arrays and objects nest at most 128 levels deep, as in the reference reader: deeper headers
/// are refused as they are parsed (here 126 arrays in __metadata__ in the top-level object is 128).
TEST(Safetensors, RefusesHeadersNestedDeeperThan128) {
    const std::string w = "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}";
    auto nested = [&](int arrays) {
        return "{\"__metadata__\":{\"a\":" + std::string(arrays, '[') + std::string(arrays, ']') + "}," + w + "}";
    };
    const gattn::SafetensorsFile ok(write_bytes("depth_128", nested(126), std::string(4, '\0')));
    EXPECT_EQ(ok.names(), std::vector<std::string>{"w"});
    expect_io_error(write_bytes("depth_129", nested(127), std::string(4, '\0')), "JSON nested deeper than 128 levels");
    expect_io_error(write_bytes("depth_100000", nested(100000), std::string(4, '\0')),
                    "JSON nested deeper than 128 levels");
}

}  // namespace
