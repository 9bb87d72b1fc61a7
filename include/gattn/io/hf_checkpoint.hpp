// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Loading a Qwen3-Next / Qwen3.5 attention layer from a Hugging Face checkpoint directory:
/// config.json for the shapes, and model.safetensors or the shards listed in
/// model.safetensors.index.json for the weights. Needs nlohmann_json.

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "gattn/io/safetensors.hpp"
#include "gattn/models/qwen3_next_attention.hpp"

GATTN_BEGIN_ISA_NAMESPACE

namespace detail {

/// Reads a JSON file (config.json, model.safetensors.index.json) with parse_json's limits; a
/// key named twice keeps its last value, as Python's json module does. A path that is not a
/// regular file (or a link to one) is refused before it is opened: a FIFO would block.
inline nlohmann::json read_json(const std::string& path, const char* fn) {
    std::error_code ec;
    const std::filesystem::file_status status = std::filesystem::status(path, ec);
    if (!ec && std::filesystem::exists(status) && !std::filesystem::is_regular_file(status))
        throw io_error(std::string(fn) + ": cannot open " + path + ": not a regular file");
    std::ifstream in(path);
    if (!in) throw io_error(std::string(fn) + ": cannot open " + path);
    return parse_json(in, /*unique_keys=*/false,
                      [&](const std::string& what) { throw io_error(std::string(fn) + ": " + path + ": " + what); });
}

/// Whether a weight_map file name stays inside the checkpoint directory: relative, without a
/// ".." component or a NUL character, and naming something ("" or "." do not).
inline bool is_shard_name(const std::string& name) {
    if (name.empty() || name.find('\0') != std::string::npos) return false;
    const std::filesystem::path p(name);
    if (p.is_absolute() || p.has_root_path()) return false;
    bool names_file = false;
    for (const auto& part : p) {
        if (part == "..") return false;
        if (!part.empty() && part != ".") names_file = true;
    }
    return names_file;
}

}  // namespace detail

/// Reads the attention fields of a Qwen3-Next / Qwen3.5 config.json: hidden_size,
/// num_attention_heads, num_key_value_heads, head_dim (default 256), rms_norm_eps, rope_theta
/// and partial_rotary_factor (top level or under "rope_parameters"), attention_bias,
/// attn_output_gate (default true), attention_sinks (gattn's extension, default false). A
/// multimodal config's "text_config" is used when present.
/// Defaults are those of transformers' Qwen3NextConfig. With layer ≥ 0, checks that
/// layer_types (or else full_attention_interval, default 4: every 4th layer) makes that layer a
/// full-attention layer.
/// The file is read with the limits of gattn's JSON readers: nested at most 128 levels deep; a
/// key named twice keeps its last value, as in Python's json module.
/// \throws io_error for a missing or malformed file or field (a path that is not a regular
///         file, JSON nested deeper than 128 levels, a size that is not a JSON integer, a field
///         of the wrong JSON type: text_config and rope_parameters must be objects or null);
///         std::invalid_argument when the layer is a
///         linear-attention layer or out of range, for an invalid config (validate_qwen3_next_config)
///         and for RoPE scaling other than "default" or "mrope" ("rope_scaling" or
///         rope_parameters' "rope_type": linear, dynamic, yarn, … would change the rotary
///         frequencies, which gattn does not apply).
inline Qwen3NextConfig load_qwen3_next_config(const std::string& config_json, Index layer = -1) {
    constexpr const char* fn = "gattn::load_qwen3_next_config";
    nlohmann::json j = detail::read_json(config_json, fn);
    auto bad = [&](const std::string& key, const std::string& what) {
        throw io_error(std::string(fn) + ": " + config_json + ": \"" + key + "\" " + what);
    };
    if (!j.is_object()) throw io_error(std::string(fn) + ": " + config_json + ": must hold a JSON object");
    auto object_or_null = [&](const char* key) {  // an optional object; null = absent
        if (j.contains(key) && !j[key].is_object() && !j[key].is_null())
            bad(key, "must be an object or null, got " + j[key].dump());
    };
    object_or_null("text_config");
    if (j.contains("text_config") && j["text_config"].is_object()) j = j["text_config"];
    object_or_null("rope_parameters");
    auto number = [&](const char* key, const nlohmann::json* where = nullptr) -> double {
        const nlohmann::json& o = where ? *where : j;
        if (!o.contains(key) || !o[key].is_number()) bad(key, "is missing or not a number");
        return o[key].get<double>();
    };
    // Sizes must be JSON integers (8.5 or 1e30 are not silently truncated); the range is
    // validate_qwen3_next_config's.
    auto integer = [&](const char* key) -> Index {
        if (!j.contains(key)) bad(key, "is missing");
        const nlohmann::json& v = j[key];
        if (!v.is_number_integer()) bad(key, "must be an integer, got " + v.dump());
        if (v.is_number_unsigned() && v.get<std::uint64_t>() > std::uint64_t(std::numeric_limits<Index>::max()))
            bad(key, "is out of range, got " + v.dump());
        return v.get<Index>();
    };
    auto boolean = [&](const char* key) {
        if (!j[key].is_boolean()) bad(key, "must be true or false, got " + j[key].dump());
        return j[key].get<bool>();
    };
    Qwen3NextConfig c;
    c.hidden_size = integer("hidden_size");
    c.num_attention_heads = integer("num_attention_heads");
    c.num_key_value_heads = integer("num_key_value_heads");
    c.head_dim = j.contains("head_dim") && !j["head_dim"].is_null() ? integer("head_dim") : 256;
    if (j.contains("rms_norm_eps")) c.rms_norm_eps = number("rms_norm_eps");
    const nlohmann::json* rope =
        j.contains("rope_parameters") && j["rope_parameters"].is_object() ? &j["rope_parameters"] : nullptr;
    if (j.contains("rope_theta"))
        c.rope_theta = number("rope_theta");
    else if (rope && rope->contains("rope_theta"))
        c.rope_theta = number("rope_theta", rope);
    if (j.contains("partial_rotary_factor"))
        c.partial_rotary_factor = number("partial_rotary_factor");
    else if (rope && rope->contains("partial_rotary_factor"))
        c.partial_rotary_factor = number("partial_rotary_factor", rope);
    const nlohmann::json* scaling = j.contains("rope_scaling") ? &j["rope_scaling"] : nullptr;
    for (const nlohmann::json* r : {scaling, rope}) {
        if (!r || r->is_null()) continue;
        const char* key = r == rope ? "rope_parameters" : "rope_scaling";
        if (!r->is_object()) bad(key, "must be an object or null, got " + r->dump());
        const std::string type_key = r->contains("rope_type") ? "rope_type" : "type";
        if (!r->contains(type_key)) continue;
        if (!(*r)[type_key].is_string())
            bad(std::string(key) + "." + type_key, "must be a string, got " + (*r)[type_key].dump());
        // "mrope" (multimodal sections) is plain RoPE for text positions, as transformers treats it.
        const std::string type = (*r)[type_key].get<std::string>();
        if (type != "default" && type != "mrope")
            detail::throw_invalid(fn, std::string(key) + "." + type_key,
                                  "must be \"default\": gattn applies unscaled RoPE, got \"" + type + "\"");
    }
    if (j.contains("attention_bias")) c.attention_bias = boolean("attention_bias");
    if (j.contains("attn_output_gate")) c.attn_output_gate = boolean("attn_output_gate");
    if (j.contains("attention_sinks")) c.attention_sinks = boolean("attention_sinks");
    validate_qwen3_next_config(c, fn);
    const Index interval = j.contains("full_attention_interval") ? integer("full_attention_interval") : 4;
    if (interval < 1) bad("full_attention_interval", "must be at least 1, got " + std::to_string(interval));
    if (layer >= 0) {
        if (j.contains("num_hidden_layers")) {
            const Index layers = integer("num_hidden_layers");
            if (layer >= layers)
                detail::throw_invalid(fn, "layer",
                                      "must be < num_hidden_layers = " + std::to_string(layers) + ", got " +
                                          std::to_string(layer));
        }
        std::string type;
        if (j.contains("layer_types") && !j["layer_types"].is_null()) {
            const nlohmann::json& types = j["layer_types"];
            if (!types.is_array()) bad("layer_types", "must be an array, got " + types.dump());
            if (layer >= Index(types.size()))
                detail::throw_invalid(fn, "layer",
                                      "must be < the " + std::to_string(types.size()) +
                                          " entries of layer_types, got " + std::to_string(layer));
            const nlohmann::json& t = types[static_cast<std::size_t>(layer)];
            if (!t.is_string())
                bad("layer_types", "entry " + std::to_string(layer) + " must be a string, got " + t.dump());
            type = t.get<std::string>();
        } else {
            // Layers interval − 1, 2·interval − 1, …: (layer + 1) % interval == 0, without the
            // overflow of layer + 1 for the largest Index.
            type = layer % interval == interval - 1 ? "full_attention" : "linear_attention";
        }
        if (type != "full_attention")
            detail::throw_invalid(fn, "layer",
                                  std::to_string(layer) + " is a " + type +
                                      " layer; gated attention lives in the full_attention layers");
    }
    return c;
}

namespace detail {

/// load_qwen3_next_attention_weights, or with `blocks` only each tensor's block.
template <class Scalar>
Qwen3NextAttentionWeights<Scalar> load_qwen3_next_blocks(const std::string& dir, Index layer,
                                                         const Qwen3NextConfig& config,
                                                         const std::map<std::string, WeightBlock>* blocks,
                                                         const char* fn) {
    namespace fs = std::filesystem;
    std::map<std::string, std::string> file_of;  // tensor name -> file (sharded checkpoints)
    const fs::path index = fs::path(dir) / "model.safetensors.index.json";
    std::string single = (fs::path(dir) / "model.safetensors").string();
    // The error_code overload: a path the system cannot examine (too long, no permission) is an
    // io_error like a missing file, not a std::filesystem::filesystem_error.
    auto exists = [&](const fs::path& p) {
        std::error_code ec;
        const bool found = fs::exists(p, ec);
        if (ec) throw io_error(std::string(fn) + ": " + p.string() + ": " + ec.message());
        return found;
    };
    const bool sharded = exists(index);  // then the index alone says where tensors are
    if (sharded) {
        const nlohmann::json j = detail::read_json(index.string(), fn);
        if (!j.contains("weight_map") || !j["weight_map"].is_object())
            throw io_error(std::string(fn) + ": " + index.string() + " has no weight_map");
        for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
            if (!it.value().is_string())
                throw io_error(std::string(fn) + ": " + index.string() + ": weight_map entry '" + it.key() +
                               "' must be a file name, got " + it.value().dump());
            const std::string& file = it.value().get_ref<const std::string&>();
            if (!detail::is_shard_name(file))
                throw io_error(std::string(fn) + ": " + index.string() + ": weight_map entry '" + it.key() +
                               "' must name a file inside the checkpoint directory (a relative path without "
                               "'..'), got " +
                               it.value().dump());
            file_of[it.key()] = (fs::path(dir) / file).string();
        }
    } else if (!exists(single)) {
        throw io_error(std::string(fn) + ": " + dir +
                       " has neither model.safetensors nor model.safetensors.index.json");
    }
    std::map<std::string, std::unique_ptr<SafetensorsFile>> open_files;
    auto file_for = [&](const std::string& name) -> const SafetensorsFile* {
        std::string path = single;
        if (sharded) {
            auto it = file_of.find(name);
            if (it == file_of.end()) return nullptr;
            path = it->second;
        }
        auto& f = open_files[path];
        if (!f) f = std::make_unique<SafetensorsFile>(path);
        return f->contains(name) ? f.get() : nullptr;
    };
    const std::string n = std::to_string(layer);
    std::string prefix;
    for (const std::string& candidate :
         {"model.layers." + n + ".self_attn.", "model.language_model.layers." + n + ".self_attn."})
        if (file_for(candidate + "q_proj.weight")) {
            prefix = candidate;
            break;
        }
    if (prefix.empty())
        throw io_error(std::string(fn) + ": " + dir + ": missing tensor 'model.layers." + n +
                       ".self_attn.q_proj.weight'");
    Qwen3NextAttentionWeights<Scalar> w;
    const auto shapes = qwen3_next_weight_shapes(config);
    w.for_each([&](const char* name, auto* t) {
        for (const auto& s : shapes) {
            if (s.name != name) continue;
            const std::string full = prefix + name;
            const SafetensorsFile* f = file_for(full);
            if (!f) throw io_error(std::string(fn) + ": " + dir + ": missing tensor '" + full + "'");
            const TensorInfo& info = f->info(full);
            detail::check_weight_dtype(info, full, "", fn);
            if (info.shape != s.shape) {
                std::string why;
                if (s.name == "q_proj.weight" && !info.shape.empty())
                    why = qwen3_next_q_proj_hint(config, info.shape[0]);
                throw shape_error(std::string(fn) + ": " + full + " must have shape " +
                                  SafetensorsFile::shape_text(s.shape) + ", got " +
                                  SafetensorsFile::shape_text(info.shape) + why);
            }
            using T = std::decay_t<decltype(*t)>;
            constexpr bool kVector = T::ColsAtCompileTime == 1;
            if (blocks) {
                const WeightBlock& k = blocks->at(s.name);
                if (k.zero)
                    *t = T::Zero(k.rows, kVector ? 1 : k.cols);
                else if constexpr (kVector)  // a 1-D tensor reads as one row
                    *t = f->block<Scalar>(full, 0, 1, k.first_row, k.rows).transpose();
                else
                    *t = f->block<Scalar>(full, k.first_row, k.rows, k.first_col, k.cols);
            } else if constexpr (kVector) {
                *t = f->vector<Scalar>(full);
            } else {
                *t = f->matrix<Scalar>(full);
            }
        }
    });
    return w;
}

}  // namespace detail

/// Loads layer `layer`'s attention weights from a checkpoint directory (model.safetensors, or
/// the shards named by model.safetensors.index.json), trying the prefixes
/// "model.layers.N.self_attn." and "model.language_model.layers.N.self_attn." (Qwen3.5).
/// The index is read with load_qwen3_next_config's JSON limits, and its weight_map may only
/// name files inside `dir` (relative paths without ".."; subdirectories are fine); each file is
/// opened as a SafetensorsFile, with its limits, once, when a tensor it holds is needed.
/// \throws io_error for a missing, truncated or malformed file (or a path the system cannot
///         examine), a weight_map file name that is not a string or leaves `dir`, a missing
///         tensor or a non-floating-point dtype; shape_error for a wrong shape (for q_proj,
///         naming the layout its rows fit, see qwen3_next_q_proj_hint).
template <class Scalar>
Qwen3NextAttentionWeights<Scalar> load_qwen3_next_attention_weights(const std::string& dir, Index layer,
                                                                    const Qwen3NextConfig& config) {
    return detail::load_qwen3_next_blocks<Scalar>(dir, layer, config, nullptr,
                                                  "gattn::load_qwen3_next_attention_weights");
}

/// One shard's config and weights of layer `layer` (qwen3_next_shard: the shard's query heads,
/// the KV heads they read, their rows of q_proj, k_proj and v_proj and columns of o_proj), read
/// from the checkpoint as load_qwen3_next_attention_weights reads it, but only the shard's
/// rows and columns of each tensor (SafetensorsFile::block): each rank of a head-parallel layer
/// reads its part, never the whole layer. Equal to shard_qwen3_next of the whole weights.
/// \throws as load_qwen3_next_attention_weights; std::invalid_argument for a shard that
///         head_shard could not give.
template <class Scalar>
std::pair<Qwen3NextConfig, Qwen3NextAttentionWeights<Scalar>> load_qwen3_next_attention_shard(
    const std::string& dir, Index layer, const Qwen3NextConfig& config, const HeadShard& shard) {
    const auto [shard_config, blocks] = qwen3_next_shard(config, shard);
    return {shard_config, detail::load_qwen3_next_blocks<Scalar>(dir, layer, config, &blocks,
                                                                 "gattn::load_qwen3_next_attention_shard")};
}

/// Loads layer `layer` of a Qwen3-Next / Qwen3.5 checkpoint directory in one call
/// (config.json, then the layer's weights; math in models/qwen3_next_attention.hpp).
/// \throws io_error (missing/malformed files or tensors), shape_error (wrong weight shape),
///         std::invalid_argument (a linear-attention or out-of-range layer, an invalid config).
template <class Scalar>
Qwen3NextAttention<Scalar> load_qwen3_next_attention(const std::string& dir, Index layer) {
    const Qwen3NextConfig config = load_qwen3_next_config((std::filesystem::path(dir) / "config.json").string(), layer);
    return Qwen3NextAttention<Scalar>(config, load_qwen3_next_attention_weights<Scalar>(dir, layer, config));
}

GATTN_END_ISA_NAMESPACE
