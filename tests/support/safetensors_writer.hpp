// A minimal safetensors writer for tests: 8-byte little-endian header length, JSON header, data.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "gattn/types.hpp"

namespace gattn_test {

struct RawTensor {
    std::string name, dtype;
    std::vector<gattn::Index> shape;
    std::vector<unsigned char> bytes;
};

template <class T>
std::vector<unsigned char> bytes_of(const std::vector<T>& v) {
    std::vector<unsigned char> b(v.size() * sizeof(T));
    if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
    return b;
}

/// An F32 tensor holding a row-major matrix.
inline RawTensor f32_tensor(const std::string& name, const gattn::RowMatrix<float>& m, bool as_vector = false) {
    std::vector<gattn::Index> shape = as_vector ? std::vector<gattn::Index>{m.size()}
                                                : std::vector<gattn::Index>{m.rows(), m.cols()};
    return {name, "F32", shape, bytes_of(std::vector<float>(m.data(), m.data() + m.size()))};
}

/// Writes `tensors` to `path`; header_override replaces the JSON header, truncate_data drops
/// that many bytes from the end of the data section.
/// Every non-empty tensor of a weights struct (AttentionWeights, Qwen3NextAttentionWeights) as
/// F32, named prefix + its HF name; vectors 1-D.
template <class Weights>
std::vector<RawTensor> f32_tensors(const Weights& w, const std::string& prefix = "") {
    std::vector<RawTensor> tensors;
    w.for_each([&](const char* name, const auto& m) {
        if (m.size() == 0) return;
        constexpr bool is_vector = std::decay_t<decltype(m)>::ColsAtCompileTime == 1;
        tensors.push_back(f32_tensor(prefix + name, gattn::RowMatrix<float>(m.template cast<float>()), is_vector));
    });
    return tensors;
}

inline void write_safetensors(const std::string& path, const std::vector<RawTensor>& tensors,
                              const std::string& header_override = "", std::size_t truncate_data = 0) {
    nlohmann::json h;
    h["__metadata__"] = {{"format", "pt"}};
    std::vector<unsigned char> data;
    for (const auto& t : tensors) {
        h[t.name] = {{"dtype", t.dtype},
                     {"shape", t.shape},
                     {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
        data.insert(data.end(), t.bytes.begin(), t.bytes.end());
    }
    const std::string header = header_override.empty() ? h.dump() : header_override;
    std::ofstream f(path, std::ios::binary);
    const std::uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) f.put(static_cast<char>((n >> (8 * i)) & 0xff));
    f << header;
    f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size() - truncate_data));
}

}  // namespace gattn_test
