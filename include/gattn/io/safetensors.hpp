// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Reader for safetensors files (Hugging Face's checkpoint format) and a loader of attention
/// layer weights by their HF names. Needs nlohmann_json (the only gattn header that does).
///
/// Format (huggingface/safetensors, README "Format"): an 8-byte little-endian header length n,
/// n bytes of JSON {"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [b, e]}},
/// then the data section; offsets are relative to its start and the tensors fill it in order,
/// without gaps or overlaps; tensors are row-major and little-endian. F16, BF16, F32, F64, I32
/// and I64 tensors convert to the requested type on read.
/// Tensors are read on demand, so a multi-gigabyte checkpoint is not loaded whole.
///
/// Files from anywhere are safe to open: the header is checked against the file before anything
/// is read or allocated for it (limits in SafetensorsFile's documentation), and every error is a
/// gattn::io_error (shape_error from vector() of a tensor that is not 1-D).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "gattn/io/json_input.hpp"
#include "gattn/layers/attention_config.hpp"
#include "gattn/layers/attention_shard.hpp"
#include "gattn/layers/gated_multi_head_attention.hpp"
#include "gattn/types.hpp"

namespace gattn {

/// Header entry of one tensor.
struct TensorInfo {
    std::string dtype;         ///< "F32", "F16", "BF16", "F64", ... as stored
    std::vector<Index> shape;  ///< row-major dims; empty for a scalar
    std::uint64_t begin = 0;   ///< byte offset in the data section
    std::uint64_t end = 0;     ///< byte offset one past the tensor's last byte

    /// Elements: the product of shape (1 for a scalar).
    Index numel() const noexcept {
        Index n = 1;
        for (Index d : shape) n *= d;
        return n;
    }
};

}  // namespace gattn

GATTN_BEGIN_ISA_NAMESPACE

namespace detail {

/// Bits per element of the format's dtypes (0 for a name it does not define). A file may hold
/// tensors that gattn does not convert (FP8 scales, complex, FP4/FP6 packs): they are checked
/// and skipped, so the file's other tensors stay readable.
inline std::size_t dtype_bits(const std::string& dtype) noexcept {
    if (dtype == "F64" || dtype == "I64" || dtype == "U64" || dtype == "C64") return 64;
    if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 32;
    if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 16;
    if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2" ||
        dtype == "F8_E8M0")
        return 8;
    if (dtype == "F6_E2M3" || dtype == "F6_E3M2") return 6;
    if (dtype == "F4") return 4;
    return 0;
}

/// IEEE half → float (exact: every half is a float).
inline float half_to_float(std::uint16_t h) noexcept {
    const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
    std::uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);  // inf / NaN
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {  // subnormal half: normalise
        exp = 113;
        while ((mant & 0x400u) == 0) {
            mant <<= 1;
            --exp;
        }
        bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float bf16_to_float(std::uint16_t h) noexcept {
    const std::uint32_t bits = std::uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

}  // namespace detail

/// A safetensors file opened for reading.
///
/// Limits, checked when the file is opened (each an io_error naming the file and the fault):
///  - the path names a regular file (or a link to one): a directory, FIFO or device is refused
///    unopened;
///  - the header length is at most 100 MB (the format's limit) and at most the bytes after it;
///  - the header is one JSON object, nested at most 128 levels deep, naming no key twice in one
///    object (a tensor named twice is refused, as by the format's reference reader);
///  - each tensor has a known dtype, at most 2^48 elements, non-negative integer offsets within
///    the data section whose length is exactly its elements' bytes, and the tensors tile the data
///    section without gap or overlap.
///
/// Memory: opening holds the header text and its parsed JSON (bounded by the header length, so
/// by the file); values() allocates the tensor's bytes, which the file was checked to hold, and
/// the converted result (numel × sizeof(Scalar)); no size is taken from the header alone.
class SafetensorsFile {
public:
    /// Reads and validates the header (see the class's limits).
    /// \throws io_error when the path is not a regular file or cannot be opened, the file is
    ///         shorter than its header says, or the header exceeds 100 MB, is not valid JSON, is
    ///         nested deeper than 128 levels, names a key twice in one object (e.g. a tensor),
    ///         or has an entry with a bad dtype, shape or offsets (offsets past the end, or
    ///         tensors that leave a gap, overlap or stop short of the end of the data section).
    explicit SafetensorsFile(std::string path) : m_path(std::move(path)) {
        // Only a regular file (or a link to one) has a size to check the header against; a
        // directory, a FIFO or a device is refused before it is opened (a FIFO would block).
        std::error_code ec;
        const std::filesystem::file_status status = std::filesystem::status(m_path, ec);
        if (ec || !std::filesystem::exists(status))
            fail("cannot open file" + (ec ? ": " + ec.message() : std::string()));
        if (!std::filesystem::is_regular_file(status)) fail("cannot open file: not a regular file");
        std::ifstream in(m_path, std::ios::binary | std::ios::ate);
        if (!in) fail("cannot open file");
        const std::streamoff end = in.tellg();
        if (end < 0) fail("cannot determine the file size");
        const std::uint64_t file_size = static_cast<std::uint64_t>(end);
        if (file_size < 8)
            fail("truncated: " + std::to_string(file_size) + " bytes, less than the 8-byte header length");
        in.seekg(0);
        unsigned char len_bytes[8];
        if (!in.read(reinterpret_cast<char*>(len_bytes), 8)) fail("cannot read the header length");
        std::uint64_t header_len = 0;
        for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
        if (header_len > kMaxHeaderBytes)
            fail("malformed: header length " + std::to_string(header_len) +
                 " exceeds the format's 100 MB limit (not a safetensors file? PyTorch's .pt and .bin "
                 "files are zip or pickle archives)");
        if (header_len > file_size - 8)
            fail("truncated: header length " + std::to_string(header_len) + " exceeds the " +
                 std::to_string(file_size - 8) + " bytes after it");
        std::string header(static_cast<std::size_t>(header_len), '\0');
        in.read(header.data(), static_cast<std::streamsize>(header_len));
        if (!in) fail("cannot read the header");
        m_data_offset = 8 + header_len;
        const std::uint64_t data_size = file_size - m_data_offset;

        // Tensor names and entry fields must be unique, as the reference reader requires (a
        // parsed document would keep only the last of two equal keys).
        const nlohmann::json j = detail::parse_json(header, /*unique_keys=*/true, [&](const std::string& what) {
            fail("malformed header: " + what);
        });
        if (!j.is_object()) fail("malformed header: not a JSON object");
        for (auto it = j.begin(); it != j.end(); ++it) {
            const std::string& name = it.key();
            const auto& v = it.value();
            if (name == "__metadata__") {
                if (v.is_null()) continue;  // as the reference reader, which takes null for none
                if (!v.is_object()) fail("malformed header: __metadata__ is not an object");
                for (auto m = v.begin(); m != v.end(); ++m)
                    if (m.value().is_string()) m_metadata[m.key()] = m.value().get<std::string>();
                continue;
            }
            if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets") ||
                !v["dtype"].is_string() || !v["shape"].is_array() || !v["data_offsets"].is_array() ||
                v["data_offsets"].size() != 2)
                fail("malformed header entry for tensor '" + name + "'");
            TensorInfo t;
            t.dtype = v["dtype"].get<std::string>();
            std::uint64_t count = 1;  // element count, checked for overflow
            for (const auto& d : v["shape"]) {
                if (!d.is_number_unsigned()) fail("tensor '" + name + "': shape entries must be non-negative integers");
                const std::uint64_t dim = d.get<std::uint64_t>();
                if (dim > kMaxElements || (dim != 0 && count > kMaxElements / dim))
                    fail("tensor '" + name + "': shape " + v["shape"].dump() + " has more than 2^48 elements");
                count *= dim;
                t.shape.push_back(static_cast<Index>(dim));
            }
            if (!v["data_offsets"][0].is_number_unsigned() || !v["data_offsets"][1].is_number_unsigned())
                fail("tensor '" + name + "': data_offsets must be non-negative integers");
            t.begin = v["data_offsets"][0].get<std::uint64_t>();
            t.end = v["data_offsets"][1].get<std::uint64_t>();
            const std::size_t bits = detail::dtype_bits(t.dtype);
            if (bits == 0) fail("tensor '" + name + "': unknown dtype '" + t.dtype + "'");
            if (t.begin > t.end || t.end > data_size)
                fail("truncated: tensor '" + name + "' spans bytes [" + std::to_string(t.begin) + ", " +
                     std::to_string(t.end) + ") of a " + std::to_string(data_size) + "-byte data section");
            if ((t.end - t.begin) * 8 != static_cast<std::uint64_t>(t.numel()) * bits)
                fail("tensor '" + name + "': " + std::to_string(t.end - t.begin) + " bytes do not hold shape " +
                     shape_text(t.shape) + " of " + t.dtype);
            m_tensors.emplace(name, std::move(t));
        }
        // As the format requires (and its reference reader checks): the tensors tile the data
        // section in offset order, with no gap, no overlap and nothing after the last one.
        std::vector<std::tuple<std::uint64_t, std::uint64_t, std::string>> spans;  // begin, end, name
        for (const auto& [name, t] : m_tensors) spans.emplace_back(t.begin, t.end, name);
        std::sort(spans.begin(), spans.end());
        std::uint64_t expected = 0;
        for (const auto& [begin, end, name] : spans) {
            if (begin != expected)
                fail("malformed: tensor '" + name + "' starts at byte " + std::to_string(begin) + ", expected " +
                     std::to_string(expected) + " (tensors must follow one another without gaps or overlaps)");
            expected = end;
        }
        if (expected != data_size)
            fail("malformed: " + std::to_string(data_size - expected) + " bytes after the last tensor (byte " +
                 std::to_string(expected) + " of a " + std::to_string(data_size) + "-byte data section)");
    }

    /// The file's path as given.
    const std::string& path() const noexcept { return m_path; }
    /// Whether the header names tensor `name`.
    bool contains(const std::string& name) const { return m_tensors.count(name) != 0; }
    /// Header entry; \throws io_error when the tensor is missing.
    const TensorInfo& info(const std::string& name) const {
        auto it = m_tensors.find(name);
        if (it == m_tensors.end()) fail("missing tensor '" + name + "'");
        return it->second;
    }
    /// Tensor names in sorted order.
    std::vector<std::string> names() const {
        std::vector<std::string> n;
        for (const auto& kv : m_tensors) n.push_back(kv.first);
        return n;
    }
    /// The free-form string map "__metadata__" (empty when absent).
    const std::map<std::string, std::string>& metadata() const noexcept { return m_metadata; }

    /// All values of a tensor, row-major, converted to Scalar (float, double, gattn::bfloat16 or
    /// gattn::half; conversions to 16 bits round to nearest even, a tensor of that very type is
    /// copied bit for bit). Allocates the tensor's bytes and the result, nothing before the
    /// dtype is known to convert.
    /// \throws io_error (missing tensor, dtype other than F16, BF16, F32, F64, I32 and I64, read
    ///         failure, e.g. a file truncated since it was opened).
    template <class Scalar>
    std::vector<Scalar> values(const std::string& name) const {
        const TensorInfo& t = info(name);
        check_converts(name, t);
        // The header was checked against the file: the tensor's bytes are in it (end ≤ the data
        // section's size) and hold exactly numel elements, so neither buffer exceeds what the
        // file holds (times sizeof(Scalar) / the dtype's width for the result).
        std::vector<Scalar> out(static_cast<std::size_t>(t.numel()));
        std::ifstream in(m_path, std::ios::binary);
        read_converted(in, name, t, 0, out.size(), out.data());
        return out;
    }

    /// Rows [first_row, first_row + rows) and columns [first_col, first_col + cols) of a tensor
    /// viewed as matrix() does, converted as values() does, reading only those bytes from the
    /// file (one read per row, or one for whole rows): a rank of a head-parallel layer takes
    /// its heads' rows or columns of a large projection without reading the rest.
    /// \throws std::invalid_argument when the block does not lie within the tensor (the message
    ///         gives the tensor's shape); io_error as values().
    template <class Scalar>
    RowMatrix<Scalar> block(const std::string& name, Index first_row, Index rows, Index first_col, Index cols) const {
        const TensorInfo& t = info(name);
        check_converts(name, t);
        const Index total_cols = t.shape.empty() ? 1 : t.shape.back(),
                    total_rows = total_cols ? t.numel() / total_cols : 0;
        if (first_row < 0 || rows < 0 || first_col < 0 || cols < 0 || first_row > total_rows ||
            rows > total_rows - first_row || first_col > total_cols || cols > total_cols - first_col)
            detail::throw_invalid("gattn::SafetensorsFile::block", "block",
                                  "rows [" + std::to_string(first_row) + ", +" + std::to_string(rows) +
                                      ") and columns [" + std::to_string(first_col) + ", +" + std::to_string(cols) +
                                      ") must lie within tensor '" + name + "' of shape " + shape_text(t.shape) +
                                      " (as a matrix: " + std::to_string(total_rows) + " rows of " +
                                      std::to_string(total_cols) + ")");
        RowMatrix<Scalar> m(rows, cols);
        const auto at = [&](Index r) { return static_cast<std::size_t>((first_row + r) * total_cols + first_col); };
        std::ifstream in(m_path, std::ios::binary);
        if (cols == total_cols) {
            if (m.size()) read_converted(in, name, t, at(0), static_cast<std::size_t>(m.size()), m.data());
        } else {
            for (Index r = 0; r < rows && cols > 0; ++r)
                read_converted(in, name, t, at(r), static_cast<std::size_t>(cols), m.data() + r * cols);
        }
        return m;
    }

    /// A tensor as a matrix: [shape[0], shape[1]] for 2-D; N-D tensors flatten to
    /// [Π shape[:-1], shape[-1]]; 1-D tensors give [1, n].
    /// \throws io_error (missing tensor, unsupported dtype, read failure).
    template <class Scalar>
    RowMatrix<Scalar> matrix(const std::string& name) const {
        const TensorInfo& t = info(name);
        const Index cols = t.shape.empty() ? 1 : t.shape.back();
        Index rows = 1;
        for (std::size_t i = 0; i + 1 < t.shape.size(); ++i) rows *= t.shape[i];
        const std::vector<Scalar> v = values<Scalar>(name);
        RowMatrix<Scalar> m(rows, cols);
        if (!v.empty()) std::memcpy(m.data(), v.data(), v.size() * sizeof(Scalar));
        return m;
    }

    /// A 1-D tensor as a vector. \throws shape_error when it is not 1-D; io_error as values().
    template <class Scalar>
    Vector<Scalar> vector(const std::string& name) const {
        const TensorInfo& t = info(name);
        if (t.shape.size() != 1)
            throw shape_error("gattn::SafetensorsFile::vector: tensor '" + name + "' must be 1-D, got shape " +
                              shape_text(t.shape));
        const std::vector<Scalar> v = values<Scalar>(name);
        return Eigen::Map<const Vector<Scalar>>(v.data(), static_cast<Index>(v.size()));
    }

    /// "[d0, d1, …]" for messages.
    static std::string shape_text(const std::vector<Index>& s) {
        std::string r = "[";
        for (std::size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
        return r + "]";
    }

private:
    [[noreturn]] void fail(const std::string& what) const {
        throw io_error("gattn::SafetensorsFile: " + m_path + ": " + what);
    }

    void check_converts(const std::string& name, const TensorInfo& t) const {
        if (t.dtype != "F32" && t.dtype != "F64" && t.dtype != "F16" && t.dtype != "BF16" && t.dtype != "I64" &&
            t.dtype != "I32")
            fail("tensor '" + name + "' has dtype " + t.dtype + "; only F16, BF16, F32, F64, I32 and I64 convert");
    }

    /// Elements [first, first + n) of tensor t (in its row-major order, within it), read from
    /// the file (open in `in`) and converted into out.
    template <class Scalar>
    void read_converted(std::ifstream& in, const std::string& name, const TensorInfo& t, std::size_t first,
                        std::size_t n, Scalar* out) const {
        const std::size_t width = dtype_bytes(t.dtype);
        std::vector<unsigned char> raw(n * width);
        in.seekg(static_cast<std::streamoff>(m_data_offset + t.begin + first * width));
        in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(raw.size()));
        if (!in) fail("cannot read tensor '" + name + "'");
        const unsigned char* p = raw.data();
        // A 16-bit tensor read as its own type: the bits as stored (a bf16 checkpoint loads
        // without widening or rounding; NaN payloads kept).
        if constexpr (std::is_same_v<Scalar, bfloat16> || std::is_same_v<Scalar, half>) {
            if (t.dtype == (std::is_same_v<Scalar, bfloat16> ? "BF16" : "F16")) {
                for (std::size_t i = 0; i < n; ++i) {
                    const std::uint16_t h = static_cast<std::uint16_t>(p[2 * i] | (p[2 * i + 1] << 8));
                    out[i] = Eigen::numext::bit_cast<Scalar>(h);
                }
                return;
            }
        }
        if (t.dtype == "F32") {
            for (std::size_t i = 0; i < n; ++i) {
                float f;
                std::memcpy(&f, p + 4 * i, 4);
                out[i] = static_cast<Scalar>(f);
            }
        } else if (t.dtype == "F64") {
            for (std::size_t i = 0; i < n; ++i) {
                double d;
                std::memcpy(&d, p + 8 * i, 8);
                out[i] = static_cast<Scalar>(d);
            }
        } else if (t.dtype == "F16" || t.dtype == "BF16") {
            const bool half = t.dtype == "F16";
            for (std::size_t i = 0; i < n; ++i) {
                const std::uint16_t h = static_cast<std::uint16_t>(p[2 * i] | (p[2 * i + 1] << 8));
                out[i] = static_cast<Scalar>(half ? detail::half_to_float(h) : detail::bf16_to_float(h));
            }
        } else {  // I64 or I32: positions, lengths
            const bool wide = t.dtype == "I64";
            for (std::size_t i = 0; i < n; ++i) {
                std::int64_t v64 = 0;
                if (wide) {
                    std::memcpy(&v64, p + 8 * i, 8);
                } else {
                    std::int32_t v32;
                    std::memcpy(&v32, p + 4 * i, 4);
                    v64 = v32;
                }
                out[i] = static_cast<Scalar>(v64);
            }
        }
    }

    static std::size_t dtype_bytes(const std::string& dtype) noexcept { return detail::dtype_bits(dtype) / 8; }

    static constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;  // as the reference reader
    static constexpr std::uint64_t kMaxElements = std::uint64_t(1) << 48;

    std::string m_path;
    std::uint64_t m_data_offset = 0;
    std::map<std::string, TensorInfo> m_tensors;
    std::map<std::string, std::string> m_metadata;
};

namespace detail {

/// Which tensors of `file` end in the HF name `name` (up to three, then a count): a wrong or
/// missing prefix is the usual reason a layer's tensor is not found.
inline std::string tensors_named(const SafetensorsFile& file, const std::string& name) {
    std::string held;
    int count = 0;
    for (const auto& n : file.names()) {
        const bool ends = n.size() >= name.size() && n.compare(n.size() - name.size(), name.size(), name) == 0;
        if (ends && ++count <= 3) held += (count > 1 ? ", '" : "'") + n + "'";
    }
    if (count == 0) return "no tensor of the file ends in '" + name + "'";
    if (count > 3) held += " and " + std::to_string(count - 3) + " more";
    return "the file has " + held;
}

/// Throws io_error (naming `fn`, the tensor and `where`) unless `t` holds a weight's dtype: F32,
/// F16, BF16 or F64 (integer tensors convert for positions and lengths, never for weights).
inline void check_weight_dtype(const TensorInfo& t, const std::string& full, const std::string& where, const char* fn) {
    if (t.dtype != "F32" && t.dtype != "F16" && t.dtype != "BF16" && t.dtype != "F64")
        throw io_error(std::string(fn) + ": " + full + " has dtype " + t.dtype + where +
                       "; weights must be F32, F16, BF16 or F64");
}

/// The full name of the weight tensor of expected shape `s` under `prefix`. Throws io_error
/// (naming `fn`) when the file does not have it or holds it in a dtype other than F32, F16, BF16
/// or F64 (integer tensors convert for positions and lengths, never for weights), shape_error
/// when its shape differs.
inline std::string checked_tensor(const SafetensorsFile& file, const TensorShape& s, const std::string& prefix,
                                  const char* fn) {
    const std::string full = prefix + s.name;
    if (!file.contains(full))
        throw io_error(std::string(fn) + ": " + file.path() + ": missing tensor '" + full + "' (prefix '" + prefix +
                       "'); " + tensors_named(file, s.name));
    const TensorInfo& t = file.info(full);
    check_weight_dtype(t, full, " in " + file.path(), fn);
    if (t.shape != s.shape)
        throw shape_error(std::string(fn) + ": " + full + " must have shape " + SafetensorsFile::shape_text(s.shape) +
                          ", got " + SafetensorsFile::shape_text(t.shape) + " in " + file.path());
    return full;
}

}  // namespace detail

/// Loads every weight a layer with `config` expects (expected_weight_shapes) from `file`, each
/// named `prefix + HF name`, e.g. prefix "model.layers.3.self_attn." and "q_proj.weight".
/// \throws io_error for a missing tensor or a dtype other than F32, F16, BF16 and F64;
///         shape_error when a tensor's shape differs from what the config expects (the message
///         names tensor, expected and actual shape; e.g. a headwise checkpoint read with an
///         elementwise config); std::invalid_argument for an invalid config (validate_config).
template <class Scalar>
AttentionWeights<Scalar> load_attention_weights(const SafetensorsFile& file, const AttentionConfig& config,
                                                const std::string& prefix = "") {
    constexpr const char* fn = "gattn::load_attention_weights";
    validate_config(config, fn);
    AttentionWeights<Scalar> w;
    const auto shapes = expected_weight_shapes(config);
    w.for_each([&](const char* name, auto* p) {
        for (const auto& s : shapes) {
            if (s.name != name) continue;
            const std::string full = detail::checked_tensor(file, s, prefix, fn);
            using T = std::decay_t<decltype(*p)>;
            if constexpr (T::ColsAtCompileTime == 1)
                *p = file.vector<Scalar>(full);
            else
                *p = file.matrix<Scalar>(full);
        }
    });
    return w;
}

/// One head-parallel shard of the layer load_attention_weights would load: its config and
/// weights as shard_attention (layers/attention_shard.hpp) cuts them from the whole layer's,
/// but each read from the file as only the shard's rows and columns of each tensor
/// (SafetensorsFile::block), so that each rank reads its part and never the whole layer (a
/// head-shared gate's gate_proj and a G5 gate's are read whole).
/// \throws what load_attention_weights throws (every expected tensor is checked, present and
///         of its shape, before anything is read), and std::invalid_argument as shard_attention
///         (ALiBi, a shard head_shard could not give).
template <class Scalar>
std::pair<AttentionConfig, AttentionWeights<Scalar>> load_attention_shard(const SafetensorsFile& file,
                                                                          const AttentionConfig& config,
                                                                          const HeadShard& shard,
                                                                          const std::string& prefix = "") {
    constexpr const char* fn = "gattn::load_attention_shard";
    validate_config(config, fn);
    for (const auto& s : expected_weight_shapes(config)) detail::checked_tensor(file, s, prefix, fn);
    auto read = [&](const std::string& name, Index first_row, Index rows, Index first_col, Index cols) {
        const std::string full = prefix + name;
        if (file.info(full).shape.size() == 1)  // a 1-D tensor is one row of the file's view
            return RowMatrix<Scalar>(file.block<Scalar>(full, 0, 1, first_row, rows).transpose());
        return file.block<Scalar>(full, first_row, rows, first_col, cols);
    };
    return detail::shard_attention_from<Scalar>(config, shard, read, fn);
}

GATTN_END_ISA_NAMESPACE
