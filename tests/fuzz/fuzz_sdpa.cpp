// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness for gattn's SDPA and gated layer (clang -fsanitize=fuzzer,address,undefined;
// scripts/fuzz.sh builds and runs it).
//
// The input decodes to small shapes (B, N_q, N_k, H, H_kv | H, d_k, d_v), a combination of
// masks (causal, sliding window, key lengths, boolean mask and additive bias with −∞, each
// broadcast or not), an optional explicit scale, optional extra outputs, row strides, and the
// values (multiples of 1/32 in [−4, 4)); keys that no query of their sequence can see are
// filled with NaN ("masked keys are never read"). gattn's SDPA is compared with a plain float64
// reference written below (loops, three-pass softmax, masked keys skipped, fully masked rows 0):
//  - in float, to atol 1e-4 + rtol 1e-3, the relative part taken of the larger of |reference|
//    and Σ_j p_j·|v_j| (an output that cancels large values is only as exact as its terms);
//  - in double, to atol 1e-9 + rtol 1e-7, which leaves no room for a wrong mask or index.
// A difference beyond that, NaN where the reference is finite, or an exception stops the run
// with __builtin_trap() after printing the case. A GatedMultiHeadAttention<float> with the gate
// all_valid_gate_specs()[i] then runs on finite input and must give finite output.
//
// Decoding: a causal GatedMultiHeadAttention<float> (any valid gate, sinks, window, softcap,
// ALiBi, q/k norm, RoPE) decodes B sequences through a float or int8 KVCache (a window cache
// when the window is small beside the capacity) in up to 8 steps: forward calls with counts
// per sequence, rollbacks (truncate), clears, and invalid calls (counts of the wrong length or
// out of range, x or out of the wrong shape, a capacity exceeded, a NaN key for an int8 cache,
// another layer's cache, out overlapping x, x inside the cache, truncations out of range). The
// oracles: an invalid call throws std::invalid_argument (shape_error included) and leaves every
// byte of the caches (keys, values, scales, lengths, first positions, capacity) and of out as
// they were; a valid call with a float cache gives, for each new token, the output of the
// float64 layer_reference (tests/support/reference.hpp) run on its sequence's whole history, to
// atol 2e-3 + rtol 2e-3 of the row's largest magnitude (an int8 cache: finite outputs; its
// quantized keys move the logits beyond any tight tolerance).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gattn/gattn.hpp"
#include "support/reference.hpp"

namespace {

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

struct Case {
    int B = 1, Nq = 1, Nk = 1, H = 1, Hkv = 1, dk = 1, dv = 1;
    bool causal = false;
    Index window = 0;                // 0 = none
    std::vector<Index> key_lengths;  // empty = none
    // Boolean mask and bias: [mb, mh, mq, Nk] with each of mb, mh, mq 1 or the full size.
    bool has_bool = false, has_bias = false;
    int bool_b = 1, bool_h = 1, bool_q = 1, bias_b = 1, bias_h = 1, bias_q = 1;
    std::unique_ptr<bool[]> bool_mask;  // not std::vector<bool>: MaskView<bool> needs a bool array
    std::vector<float> bias;
    bool explicit_scale = false;
    double scale = 1.0;
};

Index mask_index(Index nb, Index nh, Index nq, Index nk, Index b, Index h, Index i, Index j) {
    return (((nb == 1 ? 0 : b) * nh + (nh == 1 ? 0 : h)) * nq + (nq == 1 ? 0 : i)) * nk + j;
}

/// The visibility rule of docs/conventions.md, written independently of gattn's.
bool visible(const Case& c, Index b, Index h, Index i, Index j) {
    const Index len = c.key_lengths.empty() ? c.Nk : c.key_lengths[b];
    const Index pos = i + (len - c.Nq);
    if (j >= len) return false;
    if (c.causal && j > pos) return false;
    if (c.window > 0) {  // i' − w < j and j < i' + w, written so that any w ≥ 1 is safe
        if (!(pos - j < c.window)) return false;
        if (!c.causal && !(j - pos < c.window)) return false;
    }
    if (c.has_bool && !c.bool_mask[mask_index(c.bool_b, c.bool_h, c.bool_q, c.Nk, b, h, i, j)]) return false;
    if (c.has_bias &&
        c.bias[mask_index(c.bias_b, c.bias_h, c.bias_q, c.Nk, b, h, i, j)] == -std::numeric_limits<float>::infinity())
        return false;
    return true;
}

struct Reference {
    std::vector<double> out;    // [B·N_q, H·d_v]
    std::vector<double> mag;    // [B·N_q, H·d_v]: Σ_j p_j·|v_j|, the size of out's terms
    std::vector<double> lse;    // [B·N_q, H]
    std::vector<double> probs;  // [B·H·N_q, N_k]
};

/// Float64 SDPA: for each row, max, then sum of exponentials, then the weighted values.
Reference reference_sdpa(const Case& c, const Matrix& q, const Matrix& k, const Matrix& v) {
    const Index B = c.B, Nq = c.Nq, Nk = c.Nk, H = c.H, group = c.H / c.Hkv;
    const double scale = c.explicit_scale ? c.scale : 1.0 / std::sqrt(double(c.dk));
    Reference r;
    r.out.assign(std::size_t(B * Nq * H * c.dv), 0.0);
    r.mag.assign(std::size_t(B * Nq * H * c.dv), 0.0);
    r.lse.assign(std::size_t(B * Nq * H), -std::numeric_limits<double>::infinity());
    r.probs.assign(std::size_t(B * H * Nq * Nk), 0.0);
    std::vector<double> logit(static_cast<std::size_t>(Nk));
    for (Index b = 0; b < B; ++b)
        for (Index h = 0; h < H; ++h)
            for (Index i = 0; i < Nq; ++i) {
                const Index g = h / group, row = b * Nq + i;
                double m = -std::numeric_limits<double>::infinity();
                for (Index j = 0; j < Nk; ++j) {
                    if (!visible(c, b, h, i, j)) continue;
                    double s = 0;
                    for (Index e = 0; e < c.dk; ++e)
                        s += double(q(row, h * c.dk + e)) * double(k(b * Nk + j, g * c.dk + e));
                    s *= scale;
                    if (c.has_bias) s += double(c.bias[mask_index(c.bias_b, c.bias_h, c.bias_q, Nk, b, h, i, j)]);
                    logit[j] = s;
                    m = std::max(m, s);
                }
                if (m == -std::numeric_limits<double>::infinity()) continue;  // fully masked: 0
                double sum = 0;
                for (Index j = 0; j < Nk; ++j)
                    if (visible(c, b, h, i, j)) sum += std::exp(logit[j] - m);
                r.lse[row * H + h] = m + std::log(sum);
                for (Index j = 0; j < Nk; ++j) {
                    if (!visible(c, b, h, i, j)) continue;
                    const double p = std::exp(logit[j] - m) / sum;
                    r.probs[((b * H + h) * Nq + i) * Nk + j] = p;
                    for (Index e = 0; e < c.dv; ++e) {
                        const double x = double(v(b * Nk + j, g * c.dv + e));
                        r.out[std::size_t(row * H * c.dv + h * c.dv + e)] += p * x;
                        r.mag[std::size_t(row * H * c.dv + h * c.dv + e)] += p * std::abs(x);
                    }
                }
            }
    return r;
}

void describe(const Case& c) {
    std::fprintf(stderr, "case: B=%d Nq=%d Nk=%d H=%d Hkv=%d dk=%d dv=%d causal=%d window=%ld", c.B, c.Nq, c.Nk, c.H,
                 c.Hkv, c.dk, c.dv, int(c.causal), long(c.window));
    if (!c.key_lengths.empty()) {
        std::fprintf(stderr, " key_lengths=");
        for (Index l : c.key_lengths) std::fprintf(stderr, "%ld,", long(l));
    }
    if (c.has_bool) std::fprintf(stderr, " bool_mask=[%d,%d,%d,%d]", c.bool_b, c.bool_h, c.bool_q, c.Nk);
    if (c.has_bias) std::fprintf(stderr, " bias=[%d,%d,%d,%d]", c.bias_b, c.bias_h, c.bias_q, c.Nk);
    if (c.explicit_scale) std::fprintf(stderr, " scale=%g", c.scale);
    std::fprintf(stderr, "\n");
}

[[noreturn]] void fail(const Case& c, const char* what, long index, double got, double want) {
    describe(c);
    std::fprintf(stderr, "MISMATCH in %s at flat index %ld: gattn %.9g, reference %.9g\n", what, index, got, want);
    __builtin_trap();
}

/// Tolerance atol + rtol·max(|want|, magnitude).
struct Tolerance {
    double atol, rtol;
};

/// Checks got against the float64 reference; NaN where the reference is finite fails; where the
/// reference is not finite, infinities must match exactly. magnitude: optional per-element size
/// of the terms that were summed (see Reference::mag).
template <class T>
void compare(const Case& c, const char* what, const T* got, Index rows, Index cols, Index stride,
             const std::vector<double>& want, Tolerance tol, const std::vector<double>* magnitude = nullptr) {
    for (Index r = 0; r < rows; ++r)
        for (Index e = 0; e < cols; ++e) {
            const std::size_t n = std::size_t(r * cols + e);
            const double g = got[r * stride + e], w = want[n];
            if (std::isfinite(w)) {
                const double size = std::max(std::abs(w), magnitude ? (*magnitude)[n] : 0.0);
                if (!(std::abs(g - w) <= tol.atol + tol.rtol * size)) fail(c, what, long(n), g, w);
            } else if (!std::isnan(w) && g != w) {
                fail(c, what, long(r * cols + e), g, w);
            }
        }
}

/// Fills a rows × cols block of m (which may be wider: a strided view) with values.
template <class M>
void fill(M& m, Index cols, Values& values) {
    for (Index r = 0; r < m.rows(); ++r)
        for (Index e = 0; e < cols; ++e) m(r, e) = values.next();
}

/// Runs gattn's SDPA in T on q, k, v (whose columns past the heads are padding, passed as a
/// strided view) and compares out and, if want_extra, the log-sum-exp, probabilities and
/// first-key probability with the reference.
template <class T>
void check_gattn(const Case& c, const gattn::RowMatrix<T>& q, const gattn::RowMatrix<T>& k,
                 const gattn::RowMatrix<T>& v, bool want_extra, const Reference& ref, Tolerance tol, const char* type) {
    using M = gattn::RowMatrix<T>;
    const Index B = c.B, Nq = c.Nq, Nk = c.Nk, H = c.H, Hkv = c.Hkv;
    const Index pad = q.cols() - H * c.dk;
    const std::vector<T> bias(c.bias.begin(), c.bias.end());
    gattn::SdpaOptions<T> options;
    options.mask.causal = c.causal;
    if (c.window > 0) options.mask.sliding_window = c.window;
    options.mask.key_lengths = c.key_lengths;
    if (c.has_bool) options.mask.bool_mask = {c.bool_mask.get(), c.bool_b, c.bool_h, c.bool_q, Nk};
    if (c.has_bias) options.mask.bias = {bias.data(), c.bias_b, c.bias_h, c.bias_q, Nk};
    if (c.explicit_scale) options.scale = c.scale;
    M lse, probs, first;
    gattn::SdpaOutputs<T> extra;
    if (want_extra) {
        extra.log_sum_exp = &lse;
        extra.probabilities = &probs;
        extra.first_key_probability = &first;
    }
    M out = M::Constant(B * Nq, H * c.dv + pad, T(-12345));
    try {
        gattn::scaled_dot_product_attention<T>(q.leftCols(H * c.dk), k.leftCols(Hkv * c.dk), v.leftCols(Hkv * c.dv),
                                               {B, H, Hkv}, out.leftCols(H * c.dv), options, extra);
    } catch (const std::exception& e) {
        describe(c);
        std::fprintf(stderr, "gattn (%s) threw on a valid call: %s\n", type, e.what());
        __builtin_trap();
    }
    std::string what = std::string(type) + " ";
    for (Index r = 0; r < out.rows(); ++r)
        for (Index e = H * c.dv; e < out.cols(); ++e)
            if (out(r, e) != T(-12345))
                fail(c, (what + "out padding column (written)").c_str(), long(r), out(r, e), -12345.0);
    compare(c, (what + "out").c_str(), out.data(), B * Nq, H * c.dv, out.outerStride(), ref.out, tol, &ref.mag);
    if (!want_extra) return;
    if (lse.rows() != B * Nq || lse.cols() != H || probs.rows() != B * H * Nq || probs.cols() != Nk ||
        first.rows() != B * Nq || first.cols() != H)
        fail(c, (what + "extra output shape").c_str(), 0, 0, 0);
    compare(c, (what + "log_sum_exp").c_str(), lse.data(), B * Nq, H, H, ref.lse, tol);
    // gattn derives the probabilities from the log-sum-exp, p = e^(s − lse) in T, so their
    // relative error grows with |lse|·eps(T): with every visible logit near −1e30 (a row masked
    // by a large finite bias) lse absorbs log(n) and each p comes out as 1 instead of 1/n.
    // That known limitation is allowed for here, through the magnitude of each element.
    std::vector<double> p_size(ref.probs.size());
    for (Index b = 0; b < B; ++b)
        for (Index h = 0; h < H; ++h)
            for (Index i = 0; i < Nq; ++i) {
                const double l = std::abs(ref.lse[std::size_t((b * Nq + i) * H + h)]);
                const double grow = std::isfinite(l) ? 1.0 + 8.0 * l * std::numeric_limits<T>::epsilon() / tol.rtol
                                                     : 1.0;
                for (Index j = 0; j < Nk; ++j) {
                    const std::size_t n = std::size_t(((b * H + h) * Nq + i) * Nk + j);
                    p_size[n] = ref.probs[n] * grow;
                }
            }
    compare(c, (what + "probabilities").c_str(), probs.data(), B * H * Nq, Nk, Nk, ref.probs, tol, &p_size);
    std::vector<double> first_ref(std::size_t(B * Nq * H), 0.0);
    if (Nk > 0)
        for (Index b = 0; b < B; ++b)
            for (Index h = 0; h < H; ++h)
                for (Index i = 0; i < Nq; ++i)
                    first_ref[std::size_t((b * Nq + i) * H + h)] = ref.probs[std::size_t(((b * H + h) * Nq + i) * Nk)];
    compare(c, (what + "first_key_probability").c_str(), first.data(), B * Nq, H, H, first_ref, tol);
}

void run_sdpa(Reader& in) {
    Case c;
    c.B = in.range(1, 3);
    const bool long_keys = in.byte() % 16 == 0;  // past one 2048-key decoding chunk
    c.Nq = in.range(1, long_keys ? 2 : 40);
    c.Nk = long_keys ? in.range(2040, 2100) : in.range(0, 150);
    c.H = in.range(1, 6);
    {
        int divisors[6], n = 0;
        for (int d = 1; d <= c.H; ++d)
            if (c.H % d == 0) divisors[n++] = d;
        c.Hkv = divisors[in.byte() % n];
    }
    c.dk = in.range(1, 20);
    c.dv = in.flag() ? c.dk : in.range(1, 20);
    const std::uint8_t masks = in.byte();
    c.causal = masks & 1;
    if (masks & 2) {
        const std::uint8_t w = in.byte();
        c.window = w == 255 ? std::numeric_limits<Index>::max() : w == 254 ? Index(1) << 40 : 1 + w % (c.Nk + 3);
    }
    if (masks & 4)
        for (int b = 0; b < c.B; ++b) c.key_lengths.push_back(in.range(0, c.Nk));
    c.has_bool = masks & 8;
    c.has_bias = masks & 16;
    const bool strided = masks & 32;
    const bool want_extra = masks & 64;
    const bool poison = !(masks & 128);  // NaN in keys that no query can see
    if (c.has_bool) {
        const std::uint8_t dims = in.byte();
        c.bool_b = dims & 1 ? c.B : 1;
        c.bool_h = dims & 2 ? c.H : 1;
        c.bool_q = dims & 4 ? c.Nq : 1;
        const int density = in.range(0, 8);  // 0: all false, 8: all true
        const std::size_t size = std::size_t(c.bool_b * c.bool_h * c.bool_q * c.Nk);
        c.bool_mask.reset(new bool[size]);
        std::uint8_t bits = 0;
        for (std::size_t n = 0; n < size; ++n) {
            bits = n % 2 == 0 ? in.byte() : std::uint8_t(bits >> 4);
            c.bool_mask[n] = density == 8 || int(bits & 7) < density;
        }
    }
    if (c.has_bias) {
        const std::uint8_t dims = in.byte();
        c.bias_b = dims & 1 ? c.B : 1;
        c.bias_h = dims & 2 ? c.H : 1;
        c.bias_q = dims & 4 ? c.Nq : 1;
        c.bias.resize(std::size_t(c.bias_b * c.bias_h * c.bias_q * c.Nk));
        for (auto& x : c.bias) {
            const std::uint8_t b = in.byte();
            x = b < 24   ? -std::numeric_limits<float>::infinity()
                : b < 28 ? -1e30f
                         : float(int(b) - 142) / 8.0f;  // [−14.25, 14.125]
        }
    }
    if (in.flag()) {
        c.explicit_scale = true;
        c.scale = in.range(1, 128) / 64.0;  // exact in float, so float and double agree on it
    }

    Values values(in);
    const Index B = c.B, Nq = c.Nq, Nk = c.Nk, H = c.H, Hkv = c.Hkv;
    const Index pad = strided ? 3 : 0;
    Matrix q(B * Nq, H * c.dk + pad), k(B * Nk, Hkv * c.dk + pad), v(B * Nk, Hkv * c.dv + pad);
    q.setConstant(std::numeric_limits<float>::quiet_NaN());  // padding columns: never read
    k.setConstant(std::numeric_limits<float>::quiet_NaN());
    v.setConstant(std::numeric_limits<float>::quiet_NaN());
    fill(q, H * c.dk, values);
    fill(k, Hkv * c.dk, values);
    fill(v, Hkv * c.dv, values);
    if (poison) {
        // Key j of KV head g in sequence b that no (head, query) of the group sees is never read.
        const Index group = H / Hkv;
        for (Index b = 0; b < B; ++b)
            for (Index g = 0; g < Hkv; ++g)
                for (Index j = 0; j < Nk; ++j) {
                    bool seen = false;
                    for (Index h = g * group; h < (g + 1) * group && !seen; ++h)
                        for (Index i = 0; i < Nq && !seen; ++i) seen = visible(c, b, h, i, j);
                    if (seen) continue;
                    for (Index e = 0; e < c.dk; ++e)
                        k(b * Nk + j, g * c.dk + e) = std::numeric_limits<float>::quiet_NaN();
                    for (Index e = 0; e < c.dv; ++e)
                        v(b * Nk + j, g * c.dv + e) = std::numeric_limits<float>::quiet_NaN();
                }
    }

    const Reference ref = reference_sdpa(c, q, k, v);
    check_gattn<float>(c, q, k, v, want_extra, ref, {1e-4, 1e-3}, "float");
    check_gattn<double>(c, q.cast<double>(), k.cast<double>(), v.cast<double>(), want_extra, ref, {1e-9, 1e-7},
                        "double");
}

void run_layer(Reader& in) {
    static const std::vector<gattn::GateSpec> specs = gattn::all_valid_gate_specs();
    gattn::AttentionConfig config;
    config.gate = specs[in.byte() % specs.size()];
    config.d_model = in.range(1, 24);
    config.num_heads = in.range(1, 6);
    {
        int divisors[6], n = 0;
        for (int d = 1; d <= config.num_heads; ++d)
            if (config.num_heads % d == 0) divisors[n++] = d;
        config.num_kv_heads = divisors[in.byte() % n];
    }
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

void run_decode(Reader& in) {
    static const std::vector<gattn::GateSpec> specs = gattn::all_valid_gate_specs();
    gattn::AttentionConfig config;
    config.gate = specs[in.byte() % specs.size()];
    config.d_model = in.range(1, 16);
    config.num_heads = in.range(1, 4);
    {
        int divisors[4], n = 0;
        for (int d = 1; d <= config.num_heads; ++d)
            if (config.num_heads % d == 0) divisors[n++] = d;
        config.num_kv_heads = divisors[in.byte() % n];
    }
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

}  // namespace

#define GATTN_FUZZ_STR2(x) #x
#define GATTN_FUZZ_STR(x) GATTN_FUZZ_STR2(x)

// Says which of gattn's instruction-set builds runs (scripts/fuzz.sh fuzzes more than one).
extern "C" int LLVMFuzzerInitialize(int*, char***) {
    std::fprintf(stderr, "fuzz_sdpa: gattn::%s, xsimd arch %s\n", GATTN_FUZZ_STR(GATTN_ISA_NAMESPACE),
                 gattn::simd::arch_name());
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    if (size < 2) return 0;
    // The first byte picks the SDPA check (6 of 8 values), the layer check (3 mod 8) or decoding
    // with a cache (7 mod 8).
    const std::uint8_t mode = data[0] % 8;
    Reader in(data + 1, size - 1);
    if (mode == 3) {
        run_layer(in);
    } else if (mode == 7) {
        run_decode(in);
    } else {
        run_sdpa(in);
    }
    return 0;
}
