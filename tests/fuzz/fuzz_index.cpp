// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness for sharded Hugging Face checkpoints: the index model.safetensors.index.json
// and its weight_map, read by gattn::load_qwen3_next_attention_weights (clang
// -fsanitize=fuzzer,address,undefined; scripts/fuzz.sh builds and runs it; seeds:
// tests/fuzz/corpus_index, written by scripts/make_fuzz_seeds.py).
//
// A temporary directory of this process holds, written once:
//   config.json                          a config (hidden 8, 2 heads of 4, 1 KV head, gated)
//   model-00001-of-00002.safetensors     layer 0's q_proj (F32), k_proj (BF16), q_norm (F32)
//   model-00002-of-00002.safetensors     layer 0's v_proj (F16), o_proj (F64), k_norm (F32),
//                                        and layer 1's q_proj
//   qwen35.safetensors                   layer 0 under model.language_model. (Qwen3.5), F32
//   sub/all.safetensors                  layer 0, all six tensors, F32
//   mismatched.safetensors               layer 0's q_proj with a headwise gate's 10 rows,
//                                        k_proj as I32, v_proj 1-D, q_norm as U8
//   broken.safetensors                   a truncated file
// Every weight element i holds ((7i mod 17) − 8) / 8, exact in every dtype. The input is the
// index; layer 0 is loaded as float and as bfloat16. The loader may only throw gattn::io_error
// or gattn::shape_error; the weights it returns must have the config's shapes and those values.
// Any other exception, a wrong value, a crash, a sanitizer report or a leak is a finding.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz/fuzz_io.hpp"
#include "gattn/io/hf_checkpoint.hpp"
#include "support/safetensors_writer.hpp"

namespace {

using gattn::Index;
using gattn_test::RawTensor;

float pattern(Index i) { return static_cast<float>((7 * i) % 17 - 8) / 8.0f; }

RawTensor tensor(const std::string& name, const std::string& dtype, std::vector<Index> shape) {
    Index n = 1;
    for (Index d : shape) n *= d;
    std::vector<unsigned char> bytes;
    for (Index i = 0; i < n; ++i) {
        const float x = pattern(i);
        unsigned char b[8];
        std::size_t w = 0;
        if (dtype == "F32") {
            std::memcpy(b, &x, w = 4);
        } else if (dtype == "F64") {
            const double d = x;
            std::memcpy(b, &d, w = 8);
        } else if (dtype == "BF16") {
            const gattn::bfloat16 h(x);
            std::memcpy(b, &h, w = 2);
        } else if (dtype == "F16") {
            const gattn::half h(x);
            std::memcpy(b, &h, w = 2);
        } else if (dtype == "I32") {
            const std::int32_t v = static_cast<std::int32_t>(i);
            std::memcpy(b, &v, w = 4);
        } else {  // U8
            b[0] = static_cast<unsigned char>(i);
            w = 1;
        }
        bytes.insert(bytes.end(), b, b + w);
    }
    return {name, dtype, std::move(shape), std::move(bytes)};
}

const char* const kConfig =
    R"({"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "partial_rotary_factor": 0.5, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "num_hidden_layers": 2, "layer_types": ["full_attention", "full_attention"]})";

/// Writes the directory's files once; returns its path.
const std::string& checkpoint_dir() {
    static const std::string dir = [] {
        const auto d = fuzz_io::temp_dir() / "checkpoint";
        std::filesystem::create_directories(d / "sub");
        fuzz_io::write_file(d / "config.json", kConfig, std::strlen(kConfig));
        auto layer = [](const std::string& p, const std::string& name, const std::string& dtype) {
            const std::vector<Index> shape = name == "q_proj.weight"                  ? std::vector<Index>{16, 8}
                                             : name == "o_proj.weight"                ? std::vector<Index>{8, 8}
                                             : name.find("norm") != std::string::npos ? std::vector<Index>{4}
                                                                                      : std::vector<Index>{4, 8};
            return tensor(p + name, dtype, shape);
        };
        const std::string l0 = "model.layers.0.self_attn.", l1 = "model.layers.1.self_attn.";
        const std::string l35 = "model.language_model.layers.0.self_attn.";
        const std::vector<std::string> names{"q_proj.weight", "k_proj.weight", "v_proj.weight",
                                             "o_proj.weight", "q_norm.weight", "k_norm.weight"};
        gattn_test::write_safetensors((d / "model-00001-of-00002.safetensors").string(),
                                      {layer(l0, "q_proj.weight", "F32"), layer(l0, "k_proj.weight", "BF16"),
                                       layer(l0, "q_norm.weight", "F32")});
        gattn_test::write_safetensors((d / "model-00002-of-00002.safetensors").string(),
                                      {layer(l0, "v_proj.weight", "F16"), layer(l0, "o_proj.weight", "F64"),
                                       layer(l0, "k_norm.weight", "F32"), layer(l1, "q_proj.weight", "F32")});
        std::vector<RawTensor> qwen35, all;
        for (const auto& n : names) {
            qwen35.push_back(layer(l35, n, "F32"));
            all.push_back(layer(l0, n, "F32"));
        }
        gattn_test::write_safetensors((d / "qwen35.safetensors").string(), qwen35);
        gattn_test::write_safetensors((d / "sub" / "all.safetensors").string(), all);
        gattn_test::write_safetensors(
            (d / "mismatched.safetensors").string(),
            {tensor(l0 + "q_proj.weight", "F32", {10, 8}), tensor(l0 + "k_proj.weight", "I32", {4, 8}),
             tensor(l0 + "v_proj.weight", "F32", {32}), tensor(l0 + "q_norm.weight", "U8", {4})});
        gattn_test::write_safetensors((d / "broken.safetensors").string(), {layer(l0, "o_proj.weight", "F32")}, "",
                                      100);
        return d.string();
    }();
    return dir;
}

gattn::Qwen3NextConfig config() {
    gattn::Qwen3NextConfig c;
    c.hidden_size = 8;
    c.num_attention_heads = 2;
    c.num_key_value_heads = 1;
    c.head_dim = 4;
    c.partial_rotary_factor = 0.5;
    return c;
}

template <class M>
void check_weight(const char* name, const M& m, Index rows, Index cols) {
    FUZZ_CHECK(m.rows() == rows && m.cols() == cols, std::string(name) + " has the wrong shape");
    for (Index i = 0; i < m.size(); ++i)
        FUZZ_CHECK(static_cast<float>(m.data()[i]) == pattern(i),
                   std::string(name) + ": wrong value at " + std::to_string(i));
}

template <class Scalar>
void load(const std::string& dir) {
    gattn::Qwen3NextAttentionWeights<Scalar> w;
    if (!fuzz_io::only_throws<gattn::io_error, gattn::shape_error>("load_qwen3_next_attention_weights", [&] {
            w = gattn::load_qwen3_next_attention_weights<Scalar>(dir, 0, config());
        }))
        return;
    check_weight("q_proj.weight", w.q_proj_weight, 16, 8);
    check_weight("k_proj.weight", w.k_proj_weight, 4, 8);
    check_weight("v_proj.weight", w.v_proj_weight, 4, 8);
    check_weight("o_proj.weight", w.o_proj_weight, 8, 8);
    check_weight("q_norm.weight", w.q_norm_weight, 4, 1);
    check_weight("k_norm.weight", w.k_norm_weight, 4, 1);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const std::string& dir = checkpoint_dir();
    fuzz_io::write_file(std::filesystem::path(dir) / "model.safetensors.index.json", data, size);
    load<float>(dir);
    load<gattn::bfloat16>(dir);
    return 0;
}
