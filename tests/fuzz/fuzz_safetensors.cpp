// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness for gattn::SafetensorsFile (clang -fsanitize=fuzzer,address,undefined;
// scripts/fuzz.sh builds and runs it; seeds: tests/fuzz/corpus_safetensors, written by
// scripts/make_fuzz_seeds.py).
//
// The input is the file, written to a temporary file of this process and opened:
//  - as it is (an 8-byte little-endian header length, the JSON header, the data section);
//  - or, when it starts with '{', as "header JSON, a NUL byte, data": the harness writes the
//    length in front, so that mutations of the header keep a consistent length. (A JSON text
//    holds no raw NUL byte. A real file whose header length is 123 modulo 256 starts with '{'
//    too; the seed script pads such headers with a space, as the format allows.)
// The constructor may only throw gattn::io_error. An accepted file must obey the format: the
// header fits the input, names no key twice in one object (a SAX pass over the header checks
// this independently) and the tensors tile the data section exactly. Every tensor is then
// read as float, double, gattn::bfloat16 and gattn::half, and as a matrix and a vector:
//  - F16, BF16, F32, F64, I32 and I64 tensors read; any other dtype is an io_error;
//  - the values are those of the input's bytes (F32 as float and F64 as double bit for bit,
//    BF16 as bfloat16 and F16 as half bit for bit, BF16 as float its bits shifted by 16,
//    F32 as double exactly, I32 and I64 as double exactly);
//  - vector() throws gattn::shape_error exactly when the tensor is not 1-D.
// gattn::load_attention_weights with a small fixed config then runs on the file (io_error or
// shape_error only). Any other exception, a wrong value, a crash, a sanitizer report, a leak
// or one allocation beyond libFuzzer's -malloc_limit_mb is a finding.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "fuzz/fuzz_io.hpp"
#include "gattn/io/safetensors.hpp"

namespace {

using gattn::Index;

std::uint64_t le64(const std::uint8_t* p) {
    std::uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

std::size_t element_bytes(const std::string& dtype) {
    if (dtype == "F64" || dtype == "I64") return 8;
    if (dtype == "F32" || dtype == "I32") return 4;
    if (dtype == "F16" || dtype == "BF16") return 2;
    return 0;  // not converted by gattn
}

template <class T>
T load(const std::uint8_t* p) {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
}

template <class T>
std::uint16_t bits16(T x) {
    std::uint16_t b;
    std::memcpy(&b, &x, 2);
    return b;
}

template <class T>
bool same_bits(T a, T b) {
    return std::memcmp(&a, &b, sizeof(T)) == 0;
}

/// Reads tensor `name` as Scalar and checks each value against the file's bytes `p`.
template <class Scalar>
void check_values(const gattn::SafetensorsFile& file, const std::string& name, const gattn::TensorInfo& t,
                  const std::uint8_t* p) {
    std::vector<Scalar> v;
    const bool read =
        fuzz_io::only_throws<gattn::io_error>("SafetensorsFile::values", [&] { v = file.values<Scalar>(name); });
    const std::size_t width = element_bytes(t.dtype);
    FUZZ_CHECK(read == (width != 0), "tensor '" + name + "' of dtype " + t.dtype + (read ? " read" : " did not read"));
    if (!read) return;
    FUZZ_CHECK(v.size() == static_cast<std::size_t>(t.numel()), "tensor '" + name + "': wrong number of values");
    for (std::size_t i = 0; i < v.size(); ++i) {
        const std::uint8_t* e = p + i * width;
        bool ok = true;
        if constexpr (std::is_same_v<Scalar, float>) {
            if (t.dtype == "F32") ok = same_bits(v[i], load<float>(e));
            if (t.dtype == "BF16") {
                const std::uint32_t b = std::uint32_t(e[0] | (e[1] << 8)) << 16;
                ok = same_bits(v[i], load<float>(reinterpret_cast<const std::uint8_t*>(&b)));
            }
        } else if constexpr (std::is_same_v<Scalar, double>) {
            if (t.dtype == "F64") ok = same_bits(v[i], load<double>(e));
            if (t.dtype == "F32") ok = same_bits(v[i], static_cast<double>(load<float>(e)));
            if (t.dtype == "I32") ok = v[i] == static_cast<double>(load<std::int32_t>(e));
            if (t.dtype == "I64") ok = v[i] == static_cast<double>(load<std::int64_t>(e));
        } else if constexpr (std::is_same_v<Scalar, gattn::bfloat16>) {
            if (t.dtype == "BF16") ok = bits16(v[i]) == std::uint16_t(e[0] | (e[1] << 8));
        } else {
            if (t.dtype == "F16") ok = bits16(v[i]) == std::uint16_t(e[0] | (e[1] << 8));
        }
        FUZZ_CHECK(ok, "tensor '" + name + "' (" + t.dtype + "): wrong value at element " + std::to_string(i));
    }
}

/// SAX handler that finds a key named twice in one object (the reader must refuse such a header).
struct DuplicateKeys : nlohmann::json_sax<nlohmann::json> {
    std::vector<std::vector<std::string>> open_objects;
    std::string duplicate;
    bool found = false;

    bool null() override { return true; }
    bool boolean(bool) override { return true; }
    bool number_integer(number_integer_t) override { return true; }
    bool number_unsigned(number_unsigned_t) override { return true; }
    bool number_float(number_float_t, const string_t&) override { return true; }
    bool string(string_t&) override { return true; }
    bool binary(binary_t&) override { return true; }
    bool start_object(std::size_t) override {
        open_objects.emplace_back();
        return true;
    }
    bool key(string_t& k) override {
        auto& keys = open_objects.back();
        if (std::find(keys.begin(), keys.end(), k) != keys.end() && !found) {
            found = true;
            duplicate = k;
        }
        keys.push_back(k);
        return true;
    }
    bool end_object() override {
        open_objects.pop_back();
        return true;
    }
    bool start_array(std::size_t) override { return true; }
    bool end_array() override { return true; }
    bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }
};

void check_file(const gattn::SafetensorsFile& file, const std::uint8_t* data, std::size_t size) {
    FUZZ_CHECK(size >= 8, "accepted a file of " + std::to_string(size) + " bytes");
    const std::uint64_t header_len = le64(data);
    FUZZ_CHECK(header_len <= size - 8, "accepted a header longer than the file");
    DuplicateKeys sax;
    FUZZ_CHECK(nlohmann::json::sax_parse(data + 8, data + 8 + header_len, &sax), "accepted a header that is not JSON");
    FUZZ_CHECK(!sax.found, "accepted a header that names '" + sax.duplicate + "' twice in one object");
    const std::uint8_t* section = data + 8 + header_len;
    const std::uint64_t data_size = size - 8 - header_len;
    std::uint64_t covered = 0;
    for (const std::string& name : file.names()) {
        const gattn::TensorInfo& t = file.info(name);
        FUZZ_CHECK(t.begin <= t.end && t.end <= data_size, "tensor '" + name + "' outside the data section");
        covered += t.end - t.begin;
        const std::size_t width = element_bytes(t.dtype);
        if (width != 0)
            FUZZ_CHECK(t.end - t.begin == static_cast<std::uint64_t>(t.numel()) * width,
                       "tensor '" + name + "': bytes do not match the shape");
        const std::uint8_t* p = section + t.begin;
        check_values<float>(file, name, t, p);
        check_values<double>(file, name, t, p);
        check_values<gattn::bfloat16>(file, name, t, p);
        check_values<gattn::half>(file, name, t, p);
        if (width == 0) continue;
        gattn::RowMatrix<float> m;
        fuzz_io::only_throws<gattn::io_error>("SafetensorsFile::matrix", [&] { m = file.matrix<float>(name); });
        FUZZ_CHECK(m.size() == t.numel(), "tensor '" + name + "': matrix of the wrong size");
        FUZZ_CHECK(m.cols() == (t.shape.empty() ? 1 : t.shape.back()), "tensor '" + name + "': matrix columns");
        gattn::Vector<double> vec;
        const bool one_d = fuzz_io::only_throws<gattn::io_error, gattn::shape_error>("SafetensorsFile::vector", [&] {
            vec = file.vector<double>(name);
        });
        FUZZ_CHECK(one_d == (t.shape.size() == 1),
                   "tensor '" + name + "': vector() of a " + std::to_string(t.shape.size()) + "-D tensor");
        if (one_d) FUZZ_CHECK(vec.size() == t.numel(), "tensor '" + name + "': vector of the wrong size");
    }
    FUZZ_CHECK(covered == data_size, "the tensors do not cover the data section");
    fuzz_io::only_throws<gattn::io_error>("SafetensorsFile::info", [&] { file.info("\x01 absent"); });
}

/// load_attention_weights on the file: a layer with d_model 8, 2 heads of 4, 1 KV head, an
/// elementwise gate in its own projection (tensors q_proj, k_proj, v_proj, o_proj, gate_proj).
void load_layer(const gattn::SafetensorsFile& file) {
    gattn::AttentionConfig c;
    c.d_model = 8;
    c.num_heads = 2;
    c.num_kv_heads = 1;
    c.head_dim = 4;
    c.gate = gattn::GateSpec::g1_elementwise(gattn::GateLayout::Separate);
    fuzz_io::only_throws<gattn::io_error, gattn::shape_error>("load_attention_weights", [&] {
        const auto w = gattn::load_attention_weights<float>(file, c);
        FUZZ_CHECK(w.q_proj_weight.rows() == 8 && w.q_proj_weight.cols() == 8, "q_proj.weight shape");
    });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    static const std::string path = (fuzz_io::temp_dir() / "input.safetensors").string();
    std::vector<std::uint8_t> file;
    if (size > 0 && data[0] == '{') {  // header JSON, NUL, data: the length goes in front
        const auto* nul = static_cast<const std::uint8_t*>(std::memchr(data, 0, size));
        const std::size_t header_len = nul ? static_cast<std::size_t>(nul - data) : size;
        for (int i = 0; i < 8; ++i) file.push_back(static_cast<std::uint8_t>(std::uint64_t(header_len) >> (8 * i)));
        file.insert(file.end(), data, data + header_len);
        if (nul) file.insert(file.end(), nul + 1, data + size);
    } else {
        file.assign(data, data + size);
    }
    fuzz_io::write_file(path, file.data(), file.size());
    std::optional<gattn::SafetensorsFile> st;
    if (!fuzz_io::only_throws<gattn::io_error>("SafetensorsFile(path)", [&] { st.emplace(path); })) return 0;
    check_file(*st, file.data(), file.size());
    load_layer(*st);
    return 0;
}
