// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness for gattn::load_qwen3_next_config (clang -fsanitize=fuzzer,address,undefined;
// scripts/fuzz.sh builds and runs it; seeds: tests/fuzz/corpus_config, written by
// scripts/make_fuzz_seeds.py).
//
// The input is a config.json, written to a temporary file of this process and loaded without a
// layer (-1) and for layers 0, 3, 47 and the largest Index. The loader may only throw
// gattn::io_error or std::invalid_argument (gattn::shape_error is one). A config it returns
// must be one validate_qwen3_next_config accepts, checked here from its documented ranges:
// sizes in [1, 2^24], num_key_value_heads dividing num_attention_heads, partial_rotary_factor
// in (0, 1] giving an even rotary_dim of at least 2, rope_theta > 0, rms_norm_eps ≥ 0; the
// weight shapes of the config then have the sizes that follow from it. Any other exception, a
// crash, a sanitizer report or a leak is a finding.

#include <cstdint>
#include <limits>
#include <string>

#include "fuzz/fuzz_io.hpp"
#include "gattn/io/hf_checkpoint.hpp"

namespace {

using gattn::Index;

void check_config(const gattn::Qwen3NextConfig& c) {
    const Index max = Index(1) << 24;
    for (Index v : {c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim})
        FUZZ_CHECK(v >= 1 && v <= max, "size " + std::to_string(v) + " out of [1, 2^24]");
    FUZZ_CHECK(c.num_attention_heads % c.num_key_value_heads == 0, "num_key_value_heads does not divide the heads");
    FUZZ_CHECK(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1, "partial_rotary_factor out of (0, 1]");
    const double rotary = static_cast<double>(c.head_dim) * c.partial_rotary_factor;
    FUZZ_CHECK(rotary >= 2 && static_cast<Index>(rotary) % 2 == 0 && c.rotary_dim() == static_cast<Index>(rotary),
               "rotary_dim " + std::to_string(c.rotary_dim()));
    FUZZ_CHECK(c.rope_theta > 0 && c.rms_norm_eps >= 0, "rope_theta or rms_norm_eps out of range");
    const auto shapes = gattn::qwen3_next_weight_shapes(c);
    const Index Hd = c.num_attention_heads * c.head_dim;
    FUZZ_CHECK(shapes.at(0).shape.at(0) == (c.attn_output_gate ? 2 * Hd : Hd), "q_proj.weight rows");
    FUZZ_CHECK(shapes.at(3).shape.at(1) == Hd, "o_proj.weight columns");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    static const std::string path = (fuzz_io::temp_dir() / "config.json").string();
    fuzz_io::write_file(path, data, size);
    for (Index layer : {Index(-1), Index(0), Index(3), Index(47), std::numeric_limits<Index>::max()}) {
        gattn::Qwen3NextConfig c;
        if (fuzz_io::only_throws<gattn::io_error, std::invalid_argument>("load_qwen3_next_config", [&] {
                c = gattn::load_qwen3_next_config(path, layer);
            }))
            check_config(c);
    }
    return 0;
}
