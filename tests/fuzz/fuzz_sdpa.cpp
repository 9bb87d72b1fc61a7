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
//
// This file holds the SDPA check and the entry points, fuzz_sdpa_layer.cpp the layer's two checks
// (two units, which build on two cores at once).

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

#include "fuzz_sdpa.hpp"

namespace fuzz_sdpa {
namespace {

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

}  // namespace

void run_sdpa(Reader& in) {
    Case c;
    c.B = in.range(1, 3);
    const bool long_keys = in.byte() % 16 == 0;  // past one 2048-key decoding chunk
    c.Nq = in.range(1, long_keys ? 2 : 40);
    c.Nk = long_keys ? in.range(2040, 2100) : in.range(0, 150);
    c.H = in.range(1, 6);
    c.Hkv = kv_heads_of(in, c.H);
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

}  // namespace fuzz_sdpa

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
    fuzz_sdpa::Reader in(data + 1, size - 1);
    if (mode == 3) {
        fuzz_sdpa::run_layer(in);
    } else if (mode == 7) {
        fuzz_sdpa::run_decode(in);
    } else {
        fuzz_sdpa::run_sdpa(in);
    }
    return 0;
}
