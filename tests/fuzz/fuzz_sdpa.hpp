// SPDX-License-Identifier: Apache-2.0
// The parts of the fuzz_sdpa harness (fuzz_sdpa.cpp says what each checks): the input reader and
// the three checks, in two translation units so that the harness builds on two cores at once.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gattn/gattn.hpp"

namespace fuzz_sdpa {

using gattn::Index;
using Matrix = gattn::RowMatrix<float>;

/// Reads the input front to back; past the end every read gives 0.
class Reader {
public:
    Reader(const std::uint8_t* data, std::size_t size) : m_data(data), m_size(size) {}
    std::uint8_t byte() { return m_pos < m_size ? m_data[m_pos++] : 0; }
    /// Integer in [lo, hi].
    int range(int lo, int hi) { return lo + static_cast<int>(byte() % static_cast<unsigned>(hi - lo + 1)); }
    bool flag() { return byte() & 1; }
    std::size_t remaining() const { return m_size - m_pos; }

private:
    const std::uint8_t* m_data;
    std::size_t m_size;
    std::size_t m_pos = 0;
};

/// Values: the remaining input bytes first, then a PRNG seeded from the input, mapped to
/// multiples of 1/32 in [−4, 4).
class Values {
public:
    explicit Values(Reader& r) : m_reader(r) {
        for (int i = 0; i < 8; ++i) m_state = (m_state << 8 | r.byte()) * 0x9E3779B97F4A7C15ull + 1;
    }
    float next() {
        std::uint8_t b;
        if (m_reader.remaining() > 0) {
            b = m_reader.byte();
        } else {
            m_state ^= m_state << 13;
            m_state ^= m_state >> 7;
            m_state ^= m_state << 17;
            b = static_cast<std::uint8_t>(m_state >> 24);
        }
        return static_cast<float>(static_cast<std::int8_t>(b)) / 32.0f;
    }

private:
    Reader& m_reader;
    std::uint64_t m_state = 0x243F6A8885A308D3ull;
};

/// A divisor of heads (1 ≤ heads ≤ 8) read from the input: a number of KV heads that heads
/// query heads can share.
inline int kv_heads_of(Reader& in, int heads) {
    int divisors[8], n = 0;
    for (int d = 1; d <= heads; ++d)
        if (heads % d == 0) divisors[n++] = d;
    return divisors[in.byte() % n];
}

/// Fills a rows × cols block of m (which may be wider: a strided view) with values.
template <class M>
void fill(M& m, Index cols, Values& values) {
    for (Index r = 0; r < m.rows(); ++r)
        for (Index e = 0; e < cols; ++e) m(r, e) = values.next();
}

/// SDPA in float and double against the float64 reference (fuzz_sdpa.cpp).
void run_sdpa(Reader& in);
/// The gated layer's forward on finite input (fuzz_sdpa_layer.cpp).
void run_layer(Reader& in);
/// The layer decoding through a KV cache, invalid calls among the valid ones (fuzz_sdpa_layer.cpp).
void run_decode(Reader& in);

}  // namespace fuzz_sdpa
