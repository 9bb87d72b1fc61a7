// SPDX-License-Identifier: Apache-2.0
// The SDPA backward pass: central finite differences of the double forward for every option
// (masks alone and combined, GQA/MQA, d_v ≠ d_k, sinks and their gradient, softcap, ALiBi);
// a plain double reference backward written out here (materialised P, textbook formulas)
// against the float, double, bfloat16 and half paths on shapes that cross the 64-row tiles; NaN in keys no
// query sees; bitwise thread-count invariance; the error cases, with nothing written.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "gattn/ops/sdpa.hpp"
#include "gattn/ops/sdpa_backward.hpp"
#include "gattn/threads.hpp"
#include "support/compare.hpp"

namespace {

using gattn::Index;
using Mat = gattn::RowMatrix<double>;
constexpr double kInf = std::numeric_limits<double>::infinity();

/// One attention problem: shapes and every option, in double (cast for float).
struct Problem {
    std::string name;
    Index B = 2, Nq = 5, Nk = 7, H = 4, Hkv = 2, dk = 3, dv = 4;
    std::optional<double> scale;
    bool causal = false;
    gattn::CausalAlignment alignment = gattn::CausalAlignment::BottomRight;
    std::vector<Index> query_offsets, key_lengths, query_lengths;
    std::optional<Index> window;
    bool bool_mask = false;  // [B, 1, 1, N_k] hiding the first key of sequence 1, and a few per row
    bool bias = false;       // [B, H, N_q, N_k] random, with some −∞
    std::vector<double> sinks, alibi;
    std::optional<double> softcap;
};

/// GoogleTest prints a problem by its name.
void PrintTo(const Problem& p, std::ostream* os) { *os << p.name; }

/// The masks and tensors of a problem.
struct Data {
    Mat q, k, v, d_out;
    std::vector<char> bool_store;  // as bool below
    std::vector<double> bias_store;
    Index bool_heads = 1, bool_queries = 1;
};

Data make_data(const Problem& p, std::uint64_t seed) {
    Data d;
    d.q = gattn_test::random_matrix(p.B * p.Nq, p.H * p.dk, seed, 1.5);
    d.k = gattn_test::random_matrix(p.B * p.Nk, p.Hkv * p.dk, seed + 1, 1.5);
    d.v = gattn_test::random_matrix(p.B * p.Nk, p.Hkv * p.dv, seed + 2);
    d.d_out = gattn_test::random_matrix(p.B * p.Nq, p.H * p.dv, seed + 3);
    if (p.bool_mask) {
        d.bool_heads = p.H;
        d.bool_queries = p.Nq;
        d.bool_store.assign(static_cast<std::size_t>(p.B * p.H * p.Nq * p.Nk), 1);
        gattn_test::UniformSource src(seed + 4);
        for (auto& x : d.bool_store) x = src.next(1.0) > -0.6;  // about 20 % hidden
    }
    if (p.bias) {
        d.bias_store.resize(static_cast<std::size_t>(p.B * p.H * p.Nq * p.Nk));
        gattn_test::UniformSource src(seed + 5);
        for (auto& x : d.bias_store) {
            x = src.next(1.0);
            if (x > 0.8) x = -kInf;
        }
    }
    return d;
}

template <class S>
gattn::SdpaOptions<S> options_of(const Problem& p, const Data& d, std::vector<S>& bias_cast) {
    gattn::SdpaOptions<S> o;
    o.scale = p.scale;
    o.mask.causal = p.causal;
    o.mask.alignment = p.alignment;
    o.mask.query_offsets = p.query_offsets;
    o.mask.key_lengths = p.key_lengths;
    o.mask.query_lengths = p.query_lengths;
    o.mask.sliding_window = p.window;
    if (p.bool_mask) {
        o.mask.bool_mask.data = reinterpret_cast<const bool*>(d.bool_store.data());
        o.mask.bool_mask.batch = p.B;
        o.mask.bool_mask.heads = d.bool_heads;
        o.mask.bool_mask.query_len = d.bool_queries;
        o.mask.bool_mask.key_len = p.Nk;
    }
    if (p.bias) {
        bias_cast.assign(d.bias_store.begin(), d.bias_store.end());
        o.mask.bias = {bias_cast.data(), p.B, p.H, p.Nq, p.Nk};
    }
    o.sinks.assign(p.sinks.begin(), p.sinks.end());
    o.alibi_slopes.assign(p.alibi.begin(), p.alibi.end());
    o.logit_softcap = p.softcap;
    return o;
}

// ---------------------------------------------------------------------------------------------
// The reference: the textbook forward and backward in double with the N_q × N_k matrices
// materialised, the masks written from their definitions (docs/conventions.md, "Masks").

struct Reference {
    Mat out, lse, dq, dk, dv;
    std::vector<double> d_sinks;
    // Per head, for the sinks' gradient −Σ_i e^(s − lse_i)·D_i: Σ_i e^(s − lse_i)·Σ_c |dO_ic·O_ic|
    // (the size of its terms, before they cancel) and Σ_i e^(s − lse_i)·Σ_c |dO_ic|·Σ_j P_ij·|V_jc|
    // (what a relative error u in each product P_ij·V_jc moves it by at most, per u).
    std::vector<double> d_sinks_terms, d_sinks_rounding;
};

bool visible(const Problem& p, const Data& d, Index b, Index h, Index i, Index j) {
    const Index L = p.key_lengths.empty() ? p.Nk : p.key_lengths[b];
    const Index Q = p.query_lengths.empty() ? p.Nq : p.query_lengths[b];
    if (i >= Q || j >= L) return false;
    Index pos = i + (L - Q);
    if (p.alignment == gattn::CausalAlignment::TopLeft) pos = i;
    if (!p.query_offsets.empty()) pos = p.query_offsets[b] + i;
    if (p.causal && j > pos) return false;
    if (p.window) {
        const Index w = *p.window;
        if (!(pos - w < j)) return false;
        if (!p.causal && !(j < pos + w)) return false;
    }
    const std::size_t e = static_cast<std::size_t>(((b * p.H + h) * p.Nq + i) * p.Nk + j);
    if (p.bool_mask && !d.bool_store[e]) return false;
    if (p.bias && d.bias_store[e] == -kInf) return false;
    return true;
}

/// Position of query i among the keys (for ALiBi).
Index position(const Problem& p, Index b, Index i) {
    const Index L = p.key_lengths.empty() ? p.Nk : p.key_lengths[b];
    const Index Q = p.query_lengths.empty() ? p.Nq : p.query_lengths[b];
    if (!p.query_offsets.empty()) return p.query_offsets[b] + i;
    return p.alignment == gattn::CausalAlignment::TopLeft ? i : i + (L - Q);
}

/// given_out, given_lse: the output and log-sum-exp the backward is given, from which it forms
/// D = rowsum(dO ⊙ O) and P = e^(ℓ − lse) (as FlashAttention's backward does); null: the
/// reference's own.
Reference reference(const Problem& p, const Data& d, const Mat* given_out = nullptr, const Mat* given_lse = nullptr) {
    Reference r;
    r.out = Mat::Zero(p.B * p.Nq, p.H * p.dv);
    r.lse = Mat::Zero(p.B * p.Nq, p.H);
    r.dq = Mat::Zero(p.B * p.Nq, p.H * p.dk);
    r.dk = Mat::Zero(p.B * p.Nk, p.Hkv * p.dk);
    r.dv = Mat::Zero(p.B * p.Nk, p.Hkv * p.dv);
    r.d_sinks.assign(static_cast<std::size_t>(p.H), 0.0);
    r.d_sinks_terms.assign(static_cast<std::size_t>(p.H), 0.0);
    r.d_sinks_rounding.assign(static_cast<std::size_t>(p.H), 0.0);
    const double scale = p.scale ? *p.scale : 1.0 / std::sqrt(double(p.dk));
    const Index group = p.H / p.Hkv;
    for (Index b = 0; b < p.B; ++b)
        for (Index h = 0; h < p.H; ++h) {
            const Index g = h / group;
            Mat logit = Mat::Constant(p.Nq, p.Nk, -kInf), dlogit_dx = Mat::Ones(p.Nq, p.Nk);
            for (Index i = 0; i < p.Nq; ++i)
                for (Index j = 0; j < p.Nk; ++j) {
                    if (!visible(p, d, b, h, i, j)) continue;
                    double x = 0;
                    for (Index c = 0; c < p.dk; ++c)
                        x += d.q(b * p.Nq + i, h * p.dk + c) * d.k(b * p.Nk + j, g * p.dk + c);
                    x *= scale;
                    if (p.softcap) {
                        const double t = std::tanh(x / *p.softcap);
                        x = *p.softcap * t;
                        dlogit_dx(i, j) = 1 - t * t;
                    }
                    if (!p.alibi.empty()) x -= p.alibi[h] * double(std::abs(position(p, b, i) - j));
                    if (p.bias) x += d.bias_store[static_cast<std::size_t>(((b * p.H + h) * p.Nq + i) * p.Nk + j)];
                    logit(i, j) = x;
                }
            const double sink = p.sinks.empty() ? -kInf : p.sinks[h];
            for (Index i = 0; i < p.Nq; ++i) {
                const Index row = b * p.Nq + i;
                double m = sink;
                for (Index j = 0; j < p.Nk; ++j) m = std::max(m, logit(i, j));
                if (m == -kInf) {
                    r.lse(row, h) = -kInf;
                    continue;
                }
                double z = std::exp(sink - m);
                for (Index j = 0; j < p.Nk; ++j) z += std::exp(logit(i, j) - m);
                r.lse(row, h) = m + std::log(z);
                const double lse = given_lse ? (*given_lse)(row, h) : r.lse(row, h);
                std::vector<double> P(static_cast<std::size_t>(p.Nk)), abs_pv(static_cast<std::size_t>(p.dv), 0.0);
                for (Index j = 0; j < p.Nk; ++j) P[j] = std::exp(logit(i, j) - lse);
                for (Index j = 0; j < p.Nk; ++j)
                    for (Index c = 0; c < p.dv; ++c) {
                        const double v_jc = d.v(b * p.Nk + j, g * p.dv + c);
                        r.out(row, h * p.dv + c) += P[j] * v_jc;
                        abs_pv[c] += P[j] * std::abs(v_jc);  // Σ_j P_ij·|V_jc|
                    }
                const Mat& o = given_out ? *given_out : r.out;
                double D = 0, terms = 0, rounding = 0;
                for (Index c = 0; c < p.dv; ++c) {
                    const double d_o = d.d_out(row, h * p.dv + c);
                    D += d_o * o(row, h * p.dv + c);
                    terms += std::abs(d_o * o(row, h * p.dv + c));
                    rounding += std::abs(d_o) * abs_pv[c];
                }
                if (sink != -kInf) {
                    const double p_sink = std::exp(sink - lse);
                    r.d_sinks[h] -= p_sink * D;
                    r.d_sinks_terms[h] += p_sink * terms;
                    r.d_sinks_rounding[h] += p_sink * rounding;
                }
                for (Index j = 0; j < p.Nk; ++j) {
                    if (P[j] == 0) continue;
                    double dp = 0;
                    for (Index c = 0; c < p.dv; ++c) dp += d.d_out(row, h * p.dv + c) * d.v(b * p.Nk + j, g * p.dv + c);
                    const double dx = P[j] * (dp - D) * dlogit_dx(i, j) * scale;
                    for (Index c = 0; c < p.dk; ++c) {
                        r.dq(row, h * p.dk + c) += dx * d.k(b * p.Nk + j, g * p.dk + c);
                        r.dk(b * p.Nk + j, g * p.dk + c) += dx * d.q(row, h * p.dk + c);
                    }
                    for (Index c = 0; c < p.dv; ++c)
                        r.dv(b * p.Nk + j, g * p.dv + c) += P[j] * d.d_out(row, h * p.dv + c);
                }
            }
        }
    return r;
}

/// gattn's forward and backward in S.
template <class S>
struct Result {
    gattn::RowMatrix<S> out, lse, dq, dk, dv;
    std::vector<S> d_sinks;
};

template <class S>
Result<S> run_gattn(const Problem& p, const Data& d) {
    std::vector<S> bias_cast;
    const gattn::SdpaOptions<S> o = options_of<S>(p, d, bias_cast);
    const gattn::HeadLayout heads{p.B, p.H, p.Hkv};
    const gattn::RowMatrix<S> q = d.q.cast<S>(), k = d.k.cast<S>(), v = d.v.cast<S>(), d_out = d.d_out.cast<S>();
    Result<S> r;
    r.out.resize(p.B * p.Nq, p.H * p.dv);
    gattn::SdpaOutputs<S> extra;
    extra.log_sum_exp = &r.lse;
    gattn::scaled_dot_product_attention<S>(q, k, v, heads, r.out, o, extra);
    r.dq.setConstant(q.rows(), q.cols(), S(-777));
    r.dk.setConstant(k.rows(), k.cols(), S(-777));
    r.dv.setConstant(v.rows(), v.cols(), S(-777));
    gattn::scaled_dot_product_attention_backward<S>(q, k, v, heads, r.out, r.lse, d_out, r.dq, r.dk, r.dv, o,
                                                    p.sinks.empty() ? nullptr : &r.d_sinks);
    return r;
}

/// gattn's 16-bit forward and backward (S = bfloat16 or half): the tensors in S, the
/// log-sum-exp, the options and the sinks' gradient in float; everything returned in double.
template <class S>
Reference run_gattn_narrow(const Problem& p, const Data& d) {
    using M = gattn::RowMatrix<S>;
    std::vector<float> bias_cast;
    const gattn::SdpaOptions<float> o = options_of<float>(p, d, bias_cast);
    const gattn::HeadLayout heads{p.B, p.H, p.Hkv};
    const M q = d.q.cast<S>(), k = d.k.cast<S>(), v = d.v.cast<S>(), d_out = d.d_out.cast<S>();
    M out(p.B * p.Nq, p.H * p.dv);
    gattn::RowMatrix<float> lse;
    gattn::SdpaOutputs<float> extra;
    extra.log_sum_exp = &lse;
    gattn::scaled_dot_product_attention<S>(q, k, v, heads, out, o, extra);
    M dq = M::Constant(q.rows(), q.cols(), S(-777.0f)), dk = M::Constant(k.rows(), k.cols(), S(-777.0f)),
      dv = M::Constant(v.rows(), v.cols(), S(-777.0f));
    std::vector<float> d_sinks;
    gattn::scaled_dot_product_attention_backward<S>(q, k, v, heads, out, lse, d_out, dq, dk, dv, o,
                                                    p.sinks.empty() ? nullptr : &d_sinks);
    Reference r;
    r.out = out.template cast<double>();
    r.lse = lse.cast<double>();
    r.dq = dq.template cast<double>();
    r.dk = dk.template cast<double>();
    r.dv = dv.template cast<double>();
    r.d_sinks.assign(d_sinks.begin(), d_sinks.end());
    return r;
}

/// L = Σ d_out ⊙ out, by gattn's double forward.
double loss(const Problem& p, const Data& d) {
    std::vector<double> bias_cast;
    const gattn::SdpaOptions<double> o = options_of<double>(p, d, bias_cast);
    Mat out(p.B * p.Nq, p.H * p.dv);
    gattn::scaled_dot_product_attention<double>(d.q, d.k, d.v, {p.B, p.H, p.Hkv}, out, o);
    return (out.array() * d.d_out.array()).sum();
}

/// max |a − b| / max |b| over a tensor (b the finite-difference or reference value); ∞ when a
/// and b differ by NaN.
double relative_error(const Mat& a, const Mat& b) {
    if ((a - b).hasNaN()) return kInf;  // maxCoeff would skip a NaN
    const double scale = std::max(b.cwiseAbs().maxCoeff(), 1e-300);
    return (a - b).cwiseAbs().maxCoeff() / scale;
}

/// Central differences of the loss in every element of m (a member of Data).
Mat finite_differences(const Problem& p, Data& d, Mat Data::*m) {
    const double step = 1e-5;
    Mat& x = d.*m;
    Mat grad(x.rows(), x.cols());
    for (Index r = 0; r < x.rows(); ++r)
        for (Index c = 0; c < x.cols(); ++c) {
            const double keep = x(r, c);
            x(r, c) = keep + step;
            const double up = loss(p, d);
            x(r, c) = keep - step;
            const double down = loss(p, d);
            x(r, c) = keep;
            grad(r, c) = (up - down) / (2 * step);
        }
    return grad;
}

std::vector<Problem> option_problems() {
    std::vector<Problem> ps;
    auto add = [&](const std::string& name, auto edit) {
        Problem p;
        p.name = name;
        edit(p);
        ps.push_back(p);
    };
    add("plain", [](Problem&) {});
    add("scale", [](Problem& p) { p.scale = 0.9; });
    add("mha_dv_equal", [](Problem& p) {
        p.Hkv = 4;
        p.dv = 3;
    });
    add("mqa", [](Problem& p) { p.Hkv = 1; });
    add("causal_bottom_right", [](Problem& p) { p.causal = true; });
    add("causal_top_left", [](Problem& p) {
        p.causal = true;
        p.alignment = gattn::CausalAlignment::TopLeft;
    });
    add("causal_offsets", [](Problem& p) {
        p.causal = true;
        p.query_offsets = {0, 3};
    });
    add("window", [](Problem& p) { p.window = 2; });
    add("causal_window", [](Problem& p) {
        p.causal = true;
        p.window = 3;
    });
    add("key_query_lengths", [](Problem& p) {
        p.key_lengths = {7, 4};
        p.query_lengths = {5, 3};
        p.causal = true;
    });
    add("bool_mask", [](Problem& p) { p.bool_mask = true; });
    add("bias", [](Problem& p) { p.bias = true; });
    add("sinks", [](Problem& p) { p.sinks = {0.3, -kInf, 1.5, -0.7}; });
    add("softcap", [](Problem& p) {
        p.softcap = 1.2;
        p.scale = 1.0;
    });
    add("alibi", [](Problem& p) { p.alibi = {0.5, 0.25, 0.125, 0.0625}; });
    add("everything", [](Problem& p) {
        p.causal = true;
        p.query_offsets = {1, 2};
        p.window = 4;
        p.key_lengths = {7, 6};
        p.bool_mask = true;
        p.bias = true;
        p.sinks = {0.3, -kInf, 1.5, -0.7};
        p.softcap = 2.0;
        p.alibi = {0.5, 0.25, 0.125, 0.0625};
        p.Hkv = 1;
    });
    return ps;
}

// ---------------------------------------------------------------------------------------------

class SdpaBackwardOptions : public ::testing::TestWithParam<Problem> {};

// Every option: gattn's double backward and the written-out reference both agree with central
// differences of gattn's double forward (step 1e-5: truncation and rounding ≈ 1e-10 relative)
// within 1e-6 relative to the tensor's largest gradient.
TEST_P(SdpaBackwardOptions, MatchesFiniteDifferences) {
    const Problem& p = GetParam();
    Data d = make_data(p, 91);
    const Result<double> g = run_gattn<double>(p, d);
    const Reference ref = reference(p, d);
    EXPECT_LT(relative_error(g.out, ref.out), 1e-12) << p.name << ": the reference forward";

    const Mat fd_q = finite_differences(p, d, &Data::q);
    const Mat fd_k = finite_differences(p, d, &Data::k);
    const Mat fd_v = finite_differences(p, d, &Data::v);
    EXPECT_LT(relative_error(g.dq, fd_q), 1e-6) << p.name << ": dQ";
    EXPECT_LT(relative_error(g.dk, fd_k), 1e-6) << p.name << ": dK";
    EXPECT_LT(relative_error(g.dv, fd_v), 1e-6) << p.name << ": dV";
    EXPECT_LT(relative_error(ref.dq, fd_q), 1e-6) << p.name << ": reference dQ";
    EXPECT_LT(relative_error(ref.dk, fd_k), 1e-6) << p.name << ": reference dK";
    EXPECT_LT(relative_error(ref.dv, fd_v), 1e-6) << p.name << ": reference dV";
    EXPECT_GT(fd_q.cwiseAbs().maxCoeff(), 1e-3) << p.name << ": the gradients are not all 0";
    if (!p.sinks.empty()) {
        ASSERT_EQ(g.d_sinks.size(), p.sinks.size());
        double largest = 0;
        std::vector<double> fd(p.sinks.size());
        for (std::size_t h = 0; h < p.sinks.size(); ++h) {
            if (p.sinks[h] == -kInf) continue;
            Problem up = p, down = p;
            up.sinks[h] += 1e-5;
            down.sinks[h] -= 1e-5;
            fd[h] = (loss(up, d) - loss(down, d)) / 2e-5;
            largest = std::max(largest, std::abs(fd[h]));
        }
        for (std::size_t h = 0; h < p.sinks.size(); ++h) {
            EXPECT_LE(std::abs(g.d_sinks[h] - fd[h]), 1e-6 * largest) << p.name << ": d_sinks[" << h << "]";
            EXPECT_LE(std::abs(ref.d_sinks[h] - fd[h]), 1e-6 * largest) << p.name << ": reference d_sinks[" << h << "]";
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Options, SdpaBackwardOptions, ::testing::ValuesIn(option_problems()),
                         [](const auto& info) { return info.param.name; });

/// Shapes that cross the 64 × 64 tiles, with the options combined.
std::vector<Problem> tiled_problems() {
    std::vector<Problem> ps;
    Problem p;
    p.name = "tiles_plain";
    p.B = 1, p.Nq = 70, p.Nk = 101, p.H = 2, p.Hkv = 1, p.dk = 16, p.dv = 24;
    ps.push_back(p);
    p.name = "tiles_causal_window_sinks";
    p.causal = true, p.window = 40, p.sinks = {0.5, -1.0};
    ps.push_back(p);
    p.name = "tiles_everything";
    p.B = 2, p.Nq = 70, p.Nk = 90, p.H = 4, p.Hkv = 2, p.dk = 8, p.dv = 8;
    p.causal = true, p.window = 30, p.key_lengths = {90, 75}, p.query_lengths = {70, 66}, p.bool_mask = true,
    p.bias = true, p.sinks = {0.3, -kInf, 1.5, -0.7}, p.softcap = 3.0, p.alibi = {0.1, 0.05, 0.02, 0.01};
    ps.push_back(p);
    return ps;
}

class SdpaBackwardTiles : public ::testing::TestWithParam<Problem> {};

// The reference against the double path (rounding only: 1e-12 relative) and the float path.
// float: inputs are exact in float; the forward's logits, exp and the tile products round at
// ε = 6e-8 relative per operation over sums of ~100 terms of both signs, and dℓ = P·(dP − D)
// cancels where dP ≈ D. The worst seen is 4.0e-7 of the tensor's largest gradient (tiles_plain,
// dQ); the bound, 5e-6, leaves 10×.
TEST_P(SdpaBackwardTiles, MatchesTheReference) {
    const Problem& p = GetParam();
    Data d = make_data(p, 17);
    const Reference ref = reference(p, d);
    const Result<double> g = run_gattn<double>(p, d);
    EXPECT_LT(relative_error(g.dq, ref.dq), 1e-12) << p.name;
    EXPECT_LT(relative_error(g.dk, ref.dk), 1e-12) << p.name;
    EXPECT_LT(relative_error(g.dv, ref.dv), 1e-12) << p.name;
    const Result<float> f = run_gattn<float>(p, d);
    EXPECT_LT(relative_error(f.dq.cast<double>(), ref.dq), 5e-6) << p.name;
    EXPECT_LT(relative_error(f.dk.cast<double>(), ref.dk), 5e-6) << p.name;
    EXPECT_LT(relative_error(f.dv.cast<double>(), ref.dv), 5e-6) << p.name;
    if (!p.sinks.empty()) {
        double largest = 0;
        for (double x : ref.d_sinks) largest = std::max(largest, std::abs(x));
        for (std::size_t h = 0; h < p.sinks.size(); ++h) {
            EXPECT_LE(std::abs(g.d_sinks[h] - ref.d_sinks[h]), 1e-12 * largest) << p.name;
            EXPECT_LE(std::abs(f.d_sinks[h] - ref.d_sinks[h]), 5e-6 * largest) << p.name;
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Tiles, SdpaBackwardTiles, ::testing::ValuesIn(tiled_problems()),
                         [](const auto& info) { return info.param.name; });

// 16-bit storage, on the tiled shapes and on one whose sinks' gradient cancels: the inputs
// rounded to S first (so they are exact in every type). u = 2⁻⁸ (bfloat16) or 2⁻¹¹ (half), the
// unit roundoff of S. Bounds are fractions of each tensor's largest element.
// - Against the double backward given the same 16-bit output and log-sum-exp (D = rowsum(dO ⊙ O)
//   and P = e^(ℓ − lse) formed from them, as the backward does): each gradient element is the
//   float gradient of those inputs (errors ~1e-6) rounded to S once (at most u of itself), so
//   dQ, dK and dV are within 1.5u (worst seen 0.92u); the sinks' gradient, a float sum, is
//   within 1e-6 of the size of its terms (worst seen 3e-8).
// - Against the double backward of the exact output: dV = Pᵀ·dO does not use D (1.5u). D
//   takes the output's errors: its rounding to S (u·|O_ic|) and the 16-bit forward's (at most
//   u·Σ_j P_ij·|V_jc|), so |ΔD_i| ≤ 2u·Σ_c |dO_ic|·Σ_j P_ij·|V_jc|, and the sinks' gradient
//   −Σ_i e^(s − lse_i)·D_i moves by at most 2u·d_sinks_rounding. Where the D_i cancel, that is
//   many u of the gradient itself (sink_cancels: N = d = 128, sink logit 0; the bound is 900u
//   of it there; the worst seen anywhere is 6.8u, tiles_causal_window_sinks). dQ and dK take ΔD
//   through P·(dP − D); they stay within 4u here (worst seen 0.92u).
template <class S>
void expect_narrow_matches_reference(double u, const char* type) {
    std::vector<Problem> problems = tiled_problems();
    Problem cancels;
    cancels.name = "sink_cancels";
    cancels.B = 1, cancels.Nq = 128, cancels.Nk = 128, cancels.H = 1, cancels.Hkv = 1, cancels.dk = 128,
    cancels.dv = 128, cancels.sinks = {0.0};
    problems.push_back(cancels);
    for (const Problem& p : problems) {
        Data d = make_data(p, 29);
        for (Mat* m : {&d.q, &d.k, &d.v, &d.d_out}) *m = m->cast<S>().template cast<double>();
        const Reference exact = reference(p, d);
        const Reference g = run_gattn_narrow<S>(p, d);
        const Reference given = reference(p, d, &g.out, &g.lse);
        EXPECT_LT(relative_error(g.dv, given.dv), 1.5 * u) << type << " " << p.name << ": dV";
        EXPECT_LT(relative_error(g.dq, given.dq), 1.5 * u) << type << " " << p.name << ": dQ";
        EXPECT_LT(relative_error(g.dk, given.dk), 1.5 * u) << type << " " << p.name << ": dK";
        EXPECT_LT(relative_error(g.dv, exact.dv), 1.5 * u) << type << " " << p.name << ": dV, exact output";
        EXPECT_LT(relative_error(g.dq, exact.dq), 4 * u) << type << " " << p.name << ": dQ, exact output";
        EXPECT_LT(relative_error(g.dk, exact.dk), 4 * u) << type << " " << p.name << ": dK, exact output";
        for (std::size_t h = 0; h < p.sinks.size(); ++h) {
            EXPECT_LE(std::abs(g.d_sinks[h] - given.d_sinks[h]), 1e-6 * given.d_sinks_terms[h])
                << type << " " << p.name << ": d_sinks[" << h << "]";
            EXPECT_LE(std::abs(g.d_sinks[h] - exact.d_sinks[h]),
                      2 * u * exact.d_sinks_rounding[h] + 1e-5 * exact.d_sinks_terms[h])
                << type << " " << p.name << ": d_sinks[" << h << "], exact output";
        }
    }
}

TEST(SdpaBackwardNarrow, Bfloat16MatchesTheReference) {
    expect_narrow_matches_reference<gattn::bfloat16>(std::ldexp(1.0, -8), "bfloat16");
}

TEST(SdpaBackwardNarrow, HalfMatchesTheReference) {
    expect_narrow_matches_reference<gattn::half>(std::ldexp(1.0, -11), "half");
}

// Keys that no query sees (left padding by the boolean mask, keys past the key lengths) may
// hold NaN: they are never read into a gradient, and their own dK and dV are 0.
TEST(SdpaBackward, NaNInKeysNoQuerySeesDoesNotLeak) {
    Problem p;
    p.B = 2, p.Nq = 40, p.Nk = 70, p.H = 2, p.Hkv = 1, p.dk = 8, p.dv = 8, p.key_lengths = {70, 60};
    p.bool_mask = true;
    Data d = make_data(p, 5);
    // The boolean mask [B, 1, 1, N_k]: sequence 0 hides keys 0..4 (left padding).
    d.bool_heads = 1, d.bool_queries = 1;
    d.bool_store.assign(static_cast<std::size_t>(p.B * p.Nk), 1);
    for (Index j = 0; j < 5; ++j) d.bool_store[static_cast<std::size_t>(j)] = 0;
    // Expected: the gradients of the same problem with the hidden keys holding 0.
    auto expand = [&](Data x) {  // the reference reads a full [B, H, N_q, N_k] boolean mask
        std::vector<char> full(static_cast<std::size_t>(p.B * p.H * p.Nq * p.Nk));
        for (Index b = 0; b < p.B; ++b)
            for (Index r = 0; r < p.H * p.Nq; ++r)
                for (Index j = 0; j < p.Nk; ++j)
                    full[static_cast<std::size_t>((b * p.H * p.Nq + r) * p.Nk + j)] =
                        x.bool_store[static_cast<std::size_t>(b * p.Nk + j)];
        x.bool_store = full;
        x.bool_heads = p.H, x.bool_queries = p.Nq;
        return x;
    };
    for (Index j = 0; j < 5; ++j) d.k.row(j).setZero(), d.v.row(j).setZero();
    for (Index j = 60; j < 70; ++j) d.k.row(p.Nk + j).setZero(), d.v.row(p.Nk + j).setZero();
    const Reference ref = reference(p, expand(d));
    for (Index j = 0; j < 5; ++j)
        d.k.row(j).setConstant(std::numeric_limits<double>::quiet_NaN()),
            d.v.row(j).setConstant(std::numeric_limits<double>::quiet_NaN());
    for (Index j = 60; j < 70; ++j)
        d.k.row(p.Nk + j).setConstant(std::numeric_limits<double>::quiet_NaN()),
            d.v.row(p.Nk + j).setConstant(std::numeric_limits<double>::quiet_NaN());
    const Result<double> g = run_gattn<double>(p, d);
    ASSERT_TRUE(g.dq.allFinite());
    ASSERT_TRUE(g.dk.allFinite());
    ASSERT_TRUE(g.dv.allFinite());
    EXPECT_LT(relative_error(g.dq, ref.dq), 1e-12);
    EXPECT_LT(relative_error(g.dk, ref.dk), 1e-12);
    EXPECT_LT(relative_error(g.dv, ref.dv), 1e-12);
    EXPECT_EQ(g.dk.topRows(5).cwiseAbs().maxCoeff(), 0.0);
    EXPECT_EQ(g.dv.bottomRows(10).cwiseAbs().maxCoeff(), 0.0);
    // bfloat16 widens K and V per tile: the hidden rows still reach no gradient.
    const Reference g16 = run_gattn_narrow<gattn::bfloat16>(p, d);
    ASSERT_TRUE(g16.dq.allFinite() && g16.dk.allFinite() && g16.dv.allFinite());
    EXPECT_LT(relative_error(g16.dq, ref.dq), 1e-2);
    EXPECT_EQ(g16.dk.topRows(5).cwiseAbs().maxCoeff(), 0.0);
    EXPECT_EQ(g16.dv.bottomRows(10).cwiseAbs().maxCoeff(), 0.0);
}

// Query rows that a −∞ bias row or the boolean mask hides from every key, in a call with finite
// sinks (their log-sum-exp is the sink's, not −∞), may hold NaN: they are never read into dK.
// Expected: the reference on the same problem with those rows holding 0.
TEST(SdpaBackward, NaNInQueriesThatSeeNoKeyDoesNotLeak) {
    for (const bool by_bias : {true, false}) {
        Problem p;
        p.B = 2, p.Nq = 70, p.Nk = 20, p.H = 2, p.Hkv = 1, p.dk = 8, p.dv = 4;
        p.sinks = {0.5, -0.25};
        p.bias = by_bias;
        p.bool_mask = !by_bias;
        Data d = make_data(p, 21);
        // Query rows 3 and 66 of sequence 1, head 1, see nothing; every other entry is visible.
        if (by_bias) std::fill(d.bias_store.begin(), d.bias_store.end(), 0.0);
        if (!by_bias) std::fill(d.bool_store.begin(), d.bool_store.end(), 1);
        const Index hidden[] = {3, 66};
        for (const Index i : hidden)
            for (Index j = 0; j < p.Nk; ++j) {
                const std::size_t e = static_cast<std::size_t>(((1 * p.H + 1) * p.Nq + i) * p.Nk + j);
                if (by_bias) d.bias_store[e] = -kInf;
                if (!by_bias) d.bool_store[e] = 0;
            }
        for (const Index i : hidden) d.q.row(p.Nq + i).segment(p.dk, p.dk).setZero();
        const Reference ref = reference(p, d);
        for (const Index i : hidden)
            d.q.row(p.Nq + i).segment(p.dk, p.dk).setConstant(std::numeric_limits<double>::quiet_NaN());
        const std::string what = by_bias ? "bias" : "bool_mask";
        const Result<double> g = run_gattn<double>(p, d);
        EXPECT_TRUE(g.dk.allFinite()) << what;
        EXPECT_LT(relative_error(g.dq, ref.dq), 1e-12) << what;
        EXPECT_LT(relative_error(g.dk, ref.dk), 1e-12) << what;
        EXPECT_LT(relative_error(g.dv, ref.dv), 1e-12) << what;
        const Result<float> f = run_gattn<float>(p, d);
        EXPECT_TRUE(f.dk.allFinite()) << what;
        EXPECT_LT(relative_error(f.dk.cast<double>(), ref.dk), 5e-6) << what;
        for (std::size_t h = 0; h < 2; ++h) EXPECT_NEAR(g.d_sinks[h], ref.d_sinks[h], 1e-12) << what;
    }
}

// Rows that see no key (query padding, an empty causal range with no sink) get dQ = 0; keys no
// query sees get dK = dV = 0; no key at all gives zeros.
TEST(SdpaBackward, EmptyRowsAndKeysGiveZeros) {
    Problem p;
    p.B = 1, p.Nq = 4, p.Nk = 6, p.H = 1, p.Hkv = 1, p.dk = 2, p.dv = 2;
    p.causal = true, p.query_offsets = {-2};  // queries 0 and 1 see nothing
    Data d = make_data(p, 3);
    const Result<double> g = run_gattn<double>(p, d);
    EXPECT_EQ(g.dq.topRows(2).cwiseAbs().maxCoeff(), 0.0);
    EXPECT_GT(g.dq.bottomRows(2).cwiseAbs().maxCoeff(), 0.0);
    EXPECT_EQ(g.dk.bottomRows(4).cwiseAbs().maxCoeff(), 0.0);  // keys 2..5 are after every query
    EXPECT_EQ(g.dv.bottomRows(4).cwiseAbs().maxCoeff(), 0.0);

    p.Nk = 0;
    p.causal = false, p.query_offsets.clear();
    p.sinks = {0.5};
    d = make_data(p, 3);
    const Result<double> none = run_gattn<double>(p, d);
    EXPECT_EQ(none.dq.cwiseAbs().maxCoeff(), 0.0);
    ASSERT_EQ(none.d_sinks.size(), 1u);
    EXPECT_EQ(none.d_sinks[0], 0.0);
}

// A query row whose every key carries a bias of −FLT_MAX (Hugging Face's padding value): the
// logits round to −FLT_MAX alike, so the forward averages V (P = 1/N_k), and its log-sum-exp
// rounds to −FLT_MAX, losing log N_k. The backward must still use P = 1/N_k: with dO only on
// that row, dV_j = dO/N_k, and dQ, dK follow from dS_j = (dO·V_j − dO·O)/N_k, worked here by
// hand. 70 keys: two key tiles.
template <class T>
void check_min_bias_row() {
    using M = gattn::RowMatrix<T>;
    const Index Nq = 3, Nk = 70, d = 4, flagged = 1;
    const M q = M::Random(Nq, d), k = M::Random(Nk, d), v = M::Random(Nk, d);
    std::vector<T> bias(static_cast<std::size_t>(Nq * Nk), T(0));
    std::fill(bias.begin() + flagged * Nk, bias.begin() + (flagged + 1) * Nk, -std::numeric_limits<float>::max());
    gattn::SdpaOptions<T> opt;
    opt.mask.bias = gattn::MaskView<T>{bias.data(), 1, 1, Nq, Nk};
    M out(Nq, d), lse;
    gattn::SdpaOutputs<T> extra;
    extra.log_sum_exp = &lse;
    gattn::scaled_dot_product_attention<T>(q, k, v, {1, 1, 1}, out, opt, extra);
    M d_out = M::Zero(Nq, d);
    d_out.row(flagged) << T(1), T(0.5), T(-0.25), T(2);
    M dq(Nq, d), dk(Nk, d), dv(Nk, d);
    gattn::scaled_dot_product_attention_backward<T>(q, k, v, {1, 1, 1}, out, lse, d_out, dq, dk, dv, opt);
    const double n = double(Nk), scale = 1.0 / std::sqrt(double(d)), tol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
    std::vector<double> mean_v(d, 0.0), dq_ref(d, 0.0);
    for (Index j = 0; j < Nk; ++j)
        for (Index c = 0; c < d; ++c) mean_v[c] += double(v(j, c)) / n;
    double do_o = 0;
    for (Index c = 0; c < d; ++c) {
        do_o += double(d_out(flagged, c)) * mean_v[c];
        EXPECT_NEAR(double(out(flagged, c)), mean_v[c], tol) << "the forward averages V";
    }
    for (Index j = 0; j < Nk; ++j) {
        double do_v = 0;
        for (Index c = 0; c < d; ++c) do_v += double(d_out(flagged, c)) * double(v(j, c));
        const double ds = (do_v - do_o) / n;
        for (Index c = 0; c < d; ++c) {
            EXPECT_NEAR(double(dv(j, c)), double(d_out(flagged, c)) / n, tol) << "key " << j;
            EXPECT_NEAR(double(dk(j, c)), scale * ds * double(q(flagged, c)), tol) << "key " << j;
            dq_ref[c] += scale * ds * double(k(j, c));
        }
    }
    for (Index c = 0; c < d; ++c) EXPECT_NEAR(double(dq(flagged, c)), dq_ref[c], tol);
    EXPECT_EQ(dq.row(0).cwiseAbs().maxCoeff(), T(0));  // no upstream gradient on the other rows
}

TEST(SdpaBackward, RowBiasedToMinusFltMaxKeepsItsAverage) {
    check_min_bias_row<double>();
    check_min_bias_row<float>();
}

// Gradients are bitwise the same on 1 and 2 threads, in shapes large enough to run in parallel:
// one task per (sequence, KV head) on both (4 of them), and one KV head, which one thread runs
// in one pass and two threads in two (dQ by query tiles, then dK and dV by key tiles).
TEST(SdpaBackward, BitwiseIndependentOfThreads) {
    if (!gattn::compiled_with_openmp()) GTEST_SKIP() << "built without OpenMP: one thread only";
    std::vector<Problem> problems(2);
    Problem& p = problems[0];
    p.B = 2, p.Nq = 150, p.Nk = 190, p.H = 4, p.Hkv = 2, p.dk = 32, p.dv = 24;
    p.causal = true, p.sinks = {0.1, 0.2, 0.3, 0.4};
    Problem& one_kv_head = problems[1];
    one_kv_head.B = 1, one_kv_head.Nq = 200, one_kv_head.Nk = 230, one_kv_head.H = 2, one_kv_head.Hkv = 1;
    one_kv_head.dk = 40, one_kv_head.dv = 32, one_kv_head.causal = true, one_kv_head.window = 120;
    one_kv_head.key_lengths = {220}, one_kv_head.bool_mask = true, one_kv_head.softcap = 5.0;
    one_kv_head.sinks = {0.5, -1.0};
    const int keep = gattn::num_threads();
    for (const Problem& q : problems) {
        const Data d = make_data(q, 8);
        gattn::set_num_threads(1);
        const Result<float> one = run_gattn<float>(q, d);
        gattn::set_num_threads(2);
        const Result<float> two = run_gattn<float>(q, d);
        gattn::set_num_threads(keep);
        auto same = [](const auto& a, const auto& b) {
            return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * std::size_t(a.size())) == 0;
        };
        EXPECT_TRUE(same(one.dq, two.dq)) << q.B * q.Hkv << " (sequence, KV head) pairs";
        EXPECT_TRUE(same(one.dk, two.dk)) << q.B * q.Hkv << " (sequence, KV head) pairs";
        EXPECT_TRUE(same(one.dv, two.dv)) << q.B * q.Hkv << " (sequence, KV head) pairs";
        EXPECT_TRUE(one.d_sinks == two.d_sinks);
        EXPECT_GT(one.dq.cwiseAbs().maxCoeff(), 0.0f);
        // bfloat16 (always two passes), widened exactly to double.
        gattn::set_num_threads(1);
        const Reference one16 = run_gattn_narrow<gattn::bfloat16>(q, d);
        gattn::set_num_threads(2);
        const Reference two16 = run_gattn_narrow<gattn::bfloat16>(q, d);
        gattn::set_num_threads(keep);
        EXPECT_TRUE(one16.dq == two16.dq && one16.dk == two16.dk && one16.dv == two16.dv) << "bfloat16";
        EXPECT_TRUE(one16.d_sinks == two16.d_sinks) << "bfloat16";
        EXPECT_GT(one16.dq.cwiseAbs().maxCoeff(), 0.0);
    }
}

// Bad input: the message names the function and the argument; the gradients keep their bytes.
TEST(SdpaBackward, ErrorsNameTheArgumentAndWriteNothing) {
    Problem p;
    p.B = 1, p.Nq = 3, p.Nk = 4, p.H = 2, p.Hkv = 1, p.dk = 2, p.dv = 3;
    const Data d = make_data(p, 4);
    Result<double> r = run_gattn<double>(p, d);
    const gattn::HeadLayout heads{p.B, p.H, p.Hkv};
    const Mat dq0 = Mat::Constant(r.dq.rows(), r.dq.cols(), 5.0), dk0 = Mat::Constant(r.dk.rows(), r.dk.cols(), 6.0),
              dv0 = Mat::Constant(r.dv.rows(), r.dv.cols(), 7.0);
    struct Case {
        std::string what;
        std::string needle;
        bool shape;
    };
    auto expect_throw = [&](const Case& c, Mat d_out, Mat lse, Mat out, gattn::SdpaOptions<double> o,
                            std::vector<double>* d_sinks) {
        Mat dq = dq0, dk = dk0, dv = dv0;
        try {
            gattn::scaled_dot_product_attention_backward<double>(d.q, d.k, d.v, heads, out, lse, d_out, dq, dk, dv, o,
                                                                 d_sinks);
            ADD_FAILURE() << c.what << ": no exception";
        } catch (const gattn::shape_error& e) {
            EXPECT_TRUE(c.shape) << c.what << ": " << e.what();
            EXPECT_NE(std::string(e.what()).find("gattn::scaled_dot_product_attention_backward"), std::string::npos);
            EXPECT_NE(std::string(e.what()).find(c.needle), std::string::npos) << e.what();
        } catch (const std::invalid_argument& e) {
            EXPECT_FALSE(c.shape) << c.what << ": " << e.what();
            EXPECT_NE(std::string(e.what()).find("gattn::scaled_dot_product_attention_backward"), std::string::npos);
            EXPECT_NE(std::string(e.what()).find(c.needle), std::string::npos) << e.what();
        }
        EXPECT_TRUE(dq == dq0 && dk == dk0 && dv == dv0) << c.what << ": a gradient was written";
    };
    const Mat d_out = d.d_out;
    expect_throw({"d_out of the wrong shape", "d_out must have shape [3, 6], got [3, 5]", true}, d_out.leftCols(5),
                 r.lse, r.out, {}, nullptr);
    expect_throw({"log-sum-exp of the wrong shape", "log_sum_exp must have shape [3, 2], got [3, 1]", true}, d_out,
                 r.lse.leftCols(1), r.out, {}, nullptr);
    expect_throw({"out of the wrong shape", "out must have shape [3, 6], got [2, 6]", true}, d_out, r.lse,
                 r.out.topRows(2), {}, nullptr);
    Mat nan_out = d_out;
    nan_out(2, 4) = std::numeric_limits<double>::quiet_NaN();
    expect_throw({"NaN in d_out", "d_out must be finite, got nan at (2, 4)", false}, nan_out, r.lse, r.out, {},
                 nullptr);
    Mat inf_out = d_out;
    inf_out(0, 1) = -kInf;
    expect_throw({"-inf in d_out", "d_out must be finite, got -inf at (0, 1)", false}, inf_out, r.lse, r.out, {},
                 nullptr);
    std::vector<double> ds;
    expect_throw({"d_sinks without sinks", "d_sinks must be null", false}, d_out, r.lse, r.out, {}, &ds);
    gattn::SdpaOptions<double> bad_window;
    bad_window.mask.sliding_window = 0;
    expect_throw({"a window the forward refuses", "mask.sliding_window", false}, d_out, r.lse, r.out, bad_window,
                 nullptr);
    // d_query is d_out itself.
    Mat alias = Mat::Zero(3, 6);
    {
        Mat dq = dq0, dk = dk0, dv = dv0;
        EXPECT_THROW(gattn::scaled_dot_product_attention_backward<double>(d.q, d.k, d.v, heads, r.out, r.lse, alias,
                                                                          alias.leftCols(4), dk, dv),
                     std::invalid_argument);
        EXPECT_TRUE(dk == dk0 && dv == dv0);
    }
    // A wrong gradient shape.
    {
        Mat dq(3, 3), dk = dk0, dv = dv0;
        try {
            gattn::scaled_dot_product_attention_backward<double>(d.q, d.k, d.v, heads, r.out, r.lse, d_out, dq, dk, dv);
            ADD_FAILURE() << "d_query of the wrong shape: no exception";
        } catch (const gattn::shape_error& e) {
            EXPECT_NE(std::string(e.what()).find("d_query must have shape [3, 4], got [3, 3]"), std::string::npos)
                << e.what();
        }
        EXPECT_TRUE(dk == dk0 && dv == dv0);
    }
}

// ---------------------------------------------------------------------------------------------
// Random combinations of every option on small and odd shapes (N = 0 and 1, d = 1, odd d_v,
// ragged key and query lengths, all masks together). Each problem: gattn's double backward
// against central differences of its double forward, the written-out reference against the
// same differences, and the float path against the reference. Fixed seeds; 200 problems.

/// A random problem from seed: every option on or off, shapes from N = 0 up.
Problem random_problem(std::uint64_t seed) {
    gattn_test::UniformSource src(seed);
    auto pick = [&](Index lo, Index hi) {  // uniform in [lo, hi]
        const double u = 0.5 * (src.next(1.0) + 1.0);
        return std::min(hi, lo + static_cast<Index>(u * double(hi - lo + 1)));
    };
    auto coin = [&](double p_on) { return 0.5 * (src.next(1.0) + 1.0) < p_on; };
    Problem p;
    p.name = "random_" + std::to_string(seed);
    p.B = pick(1, 3);
    p.Nq = pick(0, 6);
    p.Nk = pick(0, 7);
    p.Hkv = pick(1, 2);
    p.H = p.Hkv * pick(1, 3);
    p.dk = pick(1, 5);
    p.dv = pick(1, 5);
    if (coin(0.3)) p.scale = 0.3 + src.next(0.2);
    p.causal = coin(0.5);
    if (coin(0.3)) p.alignment = gattn::CausalAlignment::TopLeft;
    if (coin(0.3))
        for (Index b = 0; b < p.B; ++b) p.query_offsets.push_back(pick(-p.Nq, p.Nk));
    if (coin(0.4)) p.window = pick(1, 4);
    if (coin(0.4))
        for (Index b = 0; b < p.B; ++b) p.key_lengths.push_back(pick(0, p.Nk));
    if (coin(0.4))
        for (Index b = 0; b < p.B; ++b) p.query_lengths.push_back(pick(0, p.Nq));
    p.bool_mask = coin(0.3);
    p.bias = coin(0.3);
    if (coin(0.4))
        for (Index h = 0; h < p.H; ++h) p.sinks.push_back(coin(0.2) ? -kInf : src.next(2.0));
    if (coin(0.3)) p.softcap = 0.5 + 0.5 * (src.next(1.0) + 1.0);
    if (coin(0.3))
        for (Index h = 0; h < p.H; ++h) p.alibi.push_back(0.5 * (src.next(1.0) + 1.0));
    return p;
}

/// max |a − b| ≤ tol · (max |b| + floor): relative to the tensor, with an absolute floor for
/// tensors that are (nearly) all 0. Where a gradient is 0 in exact arithmetic (one key: P = 1,
/// dP = D) rounding leaves terms of the size of the products, O(1) here: floor 1 for the
/// float path and double-against-reference, 1e-3 against finite differences.
::testing::AssertionResult close(const Mat& a, const Mat& b, double tol, double floor, const std::string& what) {
    if (a.rows() != b.rows() || a.cols() != b.cols()) return ::testing::AssertionFailure() << what << ": shape";
    if (a.size() == 0) return ::testing::AssertionSuccess();
    if (!a.allFinite()) return ::testing::AssertionFailure() << what << ": not finite";
    const double err = (a - b).cwiseAbs().maxCoeff(), bound = tol * (b.cwiseAbs().maxCoeff() + floor);
    if (err <= bound) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << what << ": max error " << err << " > " << bound;
}

// bfloat16: a NaN in d_out and a log-sum-exp of the wrong shape are refused as in float, and
// the gradients keep their bytes.
TEST(SdpaBackwardNarrow, ErrorsNameTheArgumentAndWriteNothing) {
    using M = gattn::RowMatrix<gattn::bfloat16>;
    Problem p;
    p.B = 1, p.Nq = 3, p.Nk = 4, p.H = 2, p.Hkv = 1, p.dk = 2, p.dv = 3;
    const Data d = make_data(p, 4);
    const M q = d.q.cast<gattn::bfloat16>(), k = d.k.cast<gattn::bfloat16>(), v = d.v.cast<gattn::bfloat16>();
    M out(3, 6), d_out = d.d_out.cast<gattn::bfloat16>();
    gattn::RowMatrix<float> lse;
    gattn::SdpaOutputs<float> extra;
    extra.log_sum_exp = &lse;
    const gattn::HeadLayout heads{p.B, p.H, p.Hkv};
    gattn::scaled_dot_product_attention<gattn::bfloat16>(q, k, v, heads, out, {}, extra);
    const M dq0 = M::Constant(3, 4, gattn::bfloat16(5.0f)), dk0 = M::Constant(4, 2, gattn::bfloat16(6.0f)),
            dv0 = M::Constant(4, 3, gattn::bfloat16(7.0f));
    M dq = dq0, dk = dk0, dv = dv0;
    d_out(1, 2) = gattn::bfloat16(std::numeric_limits<float>::quiet_NaN());
    try {
        gattn::scaled_dot_product_attention_backward<gattn::bfloat16>(q, k, v, heads, out, lse, d_out, dq, dk, dv);
        ADD_FAILURE() << "NaN in d_out: no exception";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("d_out must be finite, got nan at (1, 2)"), std::string::npos) << e.what();
    }
    d_out(1, 2) = gattn::bfloat16(0.5f);
    try {
        gattn::scaled_dot_product_attention_backward<gattn::bfloat16>(q, k, v, heads, out, lse.leftCols(1), d_out, dq,
                                                                      dk, dv);
        ADD_FAILURE() << "log-sum-exp of the wrong shape: no exception";
    } catch (const gattn::shape_error& e) {
        EXPECT_NE(std::string(e.what()).find("log_sum_exp must have shape [3, 2], got [3, 1]"), std::string::npos)
            << e.what();
    }
    EXPECT_TRUE(dq == dq0 && dk == dk0 && dv == dv0);
}

TEST(SdpaBackwardRandom, EveryOptionCombinationMatchesFiniteDifferences) {
    for (std::uint64_t seed = 1000; seed < 1200; ++seed) {
        const Problem p = random_problem(seed);
        Data d = make_data(p, seed);
        const Result<double> g = run_gattn<double>(p, d);
        const Reference ref = reference(p, d);
        ASSERT_TRUE(close(g.out, ref.out, 1e-12, 1e-3, p.name + " forward"));
        const Mat fd_q = finite_differences(p, d, &Data::q);
        const Mat fd_k = finite_differences(p, d, &Data::k);
        const Mat fd_v = finite_differences(p, d, &Data::v);
        EXPECT_TRUE(close(g.dq, fd_q, 1e-6, 1e-3, p.name + " dQ"));
        EXPECT_TRUE(close(g.dk, fd_k, 1e-6, 1e-3, p.name + " dK"));
        EXPECT_TRUE(close(g.dv, fd_v, 1e-6, 1e-3, p.name + " dV"));
        EXPECT_TRUE(close(ref.dq, fd_q, 1e-6, 1e-3, p.name + " reference dQ"));
        EXPECT_TRUE(close(ref.dk, fd_k, 1e-6, 1e-3, p.name + " reference dK"));
        EXPECT_TRUE(close(ref.dv, fd_v, 1e-6, 1e-3, p.name + " reference dV"));
        const Result<float> f = run_gattn<float>(p, d);
        EXPECT_TRUE(close(f.dq.cast<double>(), ref.dq, 1e-5, 1.0, p.name + " float dQ"));
        EXPECT_TRUE(close(f.dk.cast<double>(), ref.dk, 1e-5, 1.0, p.name + " float dK"));
        EXPECT_TRUE(close(f.dv.cast<double>(), ref.dv, 1e-5, 1.0, p.name + " float dV"));
        for (std::size_t h = 0; h < p.sinks.size(); ++h) {
            if (p.sinks[h] == -kInf) {
                EXPECT_EQ(g.d_sinks[h], 0.0) << p.name;
                continue;
            }
            Problem up = p, down = p;
            up.sinks[h] += 1e-5;
            down.sinks[h] -= 1e-5;
            const double fd = (loss(up, d) - loss(down, d)) / 2e-5;
            EXPECT_NEAR(g.d_sinks[h], fd, 1e-6 * (std::abs(fd) + 1e-3)) << p.name << " d_sinks[" << h << "]";
            EXPECT_NEAR(double(f.d_sinks[h]), ref.d_sinks[h], 1e-5 * (std::abs(ref.d_sinks[h]) + 1e-3)) << p.name;
        }
    }
}

// Shapes one off the 64-row tiles and the SIMD widths (d_k = 17, d_v = 1 and 33), N = 1 and
// N_k = 63/65/129, many heads (32 over 8 KV heads, 64 over 1), ragged key lengths, each against
// the reference in double and float.
TEST(SdpaBackwardRandom, ShapesOneOffTheTilesMatchTheReference) {
    struct Shape {
        Index B, Nq, Nk, H, Hkv, dk, dv;
        bool causal;
    };
    const Shape shapes[] = {{1, 1, 65, 2, 1, 17, 1, false}, {2, 63, 1, 3, 3, 1, 33, false},
                            {1, 65, 63, 2, 2, 9, 7, true},  {1, 129, 129, 1, 1, 16, 16, true},
                            {3, 64, 65, 2, 1, 5, 3, true},  {3, 9, 33, 32, 8, 4, 3, false},
                            {2, 5, 70, 64, 1, 2, 1, true}};
    int n = 0;
    for (const Shape& s : shapes) {
        Problem p;
        p.name = "shape_" + std::to_string(n++);
        p.B = s.B, p.Nq = s.Nq, p.Nk = s.Nk, p.H = s.H, p.Hkv = s.Hkv, p.dk = s.dk, p.dv = s.dv, p.causal = s.causal;
        if (p.B > 1)
            p.key_lengths.assign(static_cast<std::size_t>(p.B), p.Nk), p.key_lengths[1] = std::max<Index>(0, p.Nk - 2);
        const Data d = make_data(p, 40 + static_cast<std::uint64_t>(n));
        const Reference ref = reference(p, d);
        const Result<double> g = run_gattn<double>(p, d);
        EXPECT_TRUE(close(g.dq, ref.dq, 1e-12, 1.0, p.name + " dQ"));
        EXPECT_TRUE(close(g.dk, ref.dk, 1e-12, 1.0, p.name + " dK"));
        EXPECT_TRUE(close(g.dv, ref.dv, 1e-12, 1.0, p.name + " dV"));
        const Result<float> f = run_gattn<float>(p, d);
        EXPECT_TRUE(close(f.dq.cast<double>(), ref.dq, 5e-6, 1.0, p.name + " float dQ"));
        EXPECT_TRUE(close(f.dk.cast<double>(), ref.dk, 5e-6, 1.0, p.name + " float dK"));
        EXPECT_TRUE(close(f.dv.cast<double>(), ref.dv, 5e-6, 1.0, p.name + " float dV"));
    }
}

// Large logits (inputs ×100: logits up to ~1e4 before the max is taken), sinks of +30 and −∞,
// ALiBi slopes of 8: the double path matches the reference; nothing is NaN.
TEST(SdpaBackwardRandom, LargeLogitsAndSinksMatchTheReference) {
    Problem p;
    p.name = "large";
    p.B = 1, p.Nq = 6, p.Nk = 9, p.H = 3, p.Hkv = 1, p.dk = 4, p.dv = 3;
    p.sinks = {30.0, -kInf, 0.0};
    p.alibi = {8.0, 0.0, 1.0};
    Data d = make_data(p, 77);
    d.q *= 100.0;
    d.k *= 100.0;
    const Reference ref = reference(p, d);
    const Result<double> g = run_gattn<double>(p, d);
    EXPECT_TRUE(close(g.dq, ref.dq, 1e-9, 1e-3, "dQ"));
    EXPECT_TRUE(close(g.dk, ref.dk, 1e-9, 1e-3, "dK"));
    EXPECT_TRUE(close(g.dv, ref.dv, 1e-9, 1e-3, "dV"));
    for (std::size_t h = 0; h < 3; ++h) EXPECT_NEAR(g.d_sinks[h], ref.d_sinks[h], 1e-9) << h;
}

// Q, K and V as column blocks of one fused QKV matrix, and dQ, dK, dV as column blocks of one
// fused gradient (outer strides, no copies): the same bits as contiguous matrices; the fused
// gradient's columns are all written.
TEST(SdpaBackwardRandom, FusedStridedViewsGiveTheSameBits) {
    Problem p;
    p.B = 2, p.Nq = 67, p.Nk = 67, p.H = 4, p.Hkv = 2, p.dk = 6, p.dv = 6;
    p.causal = true, p.sinks = {0.1, 0.2, 0.3, 0.4};
    const Data d = make_data(p, 31);
    const Result<double> plain = run_gattn<double>(p, d);
    const Index cq = p.H * p.dk, ck = p.Hkv * p.dk, cv = p.Hkv * p.dv;
    Mat qkv(p.B * p.Nq, cq + ck + cv);
    qkv << d.q, d.k, d.v;
    Mat grad = Mat::Constant(qkv.rows(), qkv.cols(), -777.0);
    std::vector<double> bias_cast, d_sinks;
    const gattn::SdpaOptions<double> o = options_of<double>(p, d, bias_cast);
    gattn::scaled_dot_product_attention_backward<double>(qkv.leftCols(cq), qkv.middleCols(cq, ck), qkv.rightCols(cv),
                                                         {p.B, p.H, p.Hkv}, plain.out, plain.lse, d.d_out,
                                                         grad.leftCols(cq), grad.middleCols(cq, ck), grad.rightCols(cv),
                                                         o, &d_sinks);
    EXPECT_TRUE(grad.leftCols(cq) == plain.dq);
    EXPECT_TRUE(grad.middleCols(cq, ck) == plain.dk);
    EXPECT_TRUE(grad.rightCols(cv) == plain.dv);
    EXPECT_TRUE(d_sinks == plain.d_sinks);
}

// 1, 2 and 3 threads, and a call from inside a user's parallel region, give the same bits.
TEST(SdpaBackwardRandom, ThreeThreadsAndNestedRegionsGiveTheSameBits) {
    if (!gattn::compiled_with_openmp()) GTEST_SKIP() << "built without OpenMP: one thread only";
    Problem p;
    p.B = 2, p.Nq = 130, p.Nk = 140, p.H = 4, p.Hkv = 2, p.dk = 24, p.dv = 16;
    p.causal = true, p.sinks = {0.1, 0.2, 0.3, 0.4}, p.softcap = 4.0, p.bias = true;
    const Data d = make_data(p, 12);
    const int keep = gattn::num_threads();
    std::vector<Result<float>> results;
    for (int t : {1, 2, 3}) {
        gattn::set_num_threads(t);
        results.push_back(run_gattn<float>(p, d));
    }
    gattn::set_num_threads(2);
    Result<float> nested[2];
#ifdef _OPENMP
#pragma omp parallel num_threads(2)
    nested[omp_get_thread_num()] = run_gattn<float>(p, d);
#else
    nested[0] = nested[1] = run_gattn<float>(p, d);
#endif
    results.push_back(nested[0]);
    results.push_back(nested[1]);
    gattn::set_num_threads(keep);
    auto same = [](const auto& a, const auto& b) {
        return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * std::size_t(a.size())) == 0;
    };
    for (std::size_t i = 1; i < results.size(); ++i) {
        EXPECT_TRUE(same(results[0].dq, results[i].dq)) << i;
        EXPECT_TRUE(same(results[0].dk, results[i].dk)) << i;
        EXPECT_TRUE(same(results[0].dv, results[i].dv)) << i;
        EXPECT_TRUE(results[0].d_sinks == results[i].d_sinks) << i;
    }
}

}  // namespace
