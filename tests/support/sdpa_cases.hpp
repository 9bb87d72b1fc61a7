// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The SDPA sweep's shapes and mask kinds, shared by the float/double tests (test_sdpa.cpp) and
/// the 16-bit storage tests (test_narrow_sdpa.cpp): masks in the library's broadcast form and
/// their dense expansion for the float64 reference, and NaN poisoning of keys no query sees.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gattn/ops/sdpa.hpp"
#include "support/compare.hpp"
#include "support/reference.hpp"

namespace gattn_test {
namespace sweep {

using gattn::Index;

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
inline constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------------------------
// Shapes and mask kinds of the sweep.

struct Shape {
    const char* name;
    Index B, Nq, Nk, H, Hkv, dk, dv;
};

inline const Shape kShapes[] = {
    {"Tiny", 1, 1, 1, 1, 1, 1, 1},
    {"DecodeMqaDk128", 2, 1, 113, 8, 1, 128, 128},
    {"N15Mqa", 2, 15, 15, 3, 1, 8, 8},
    {"N16Gqa", 2, 16, 16, 8, 2, 40, 40},
    {"N17MhaDk72", 1, 17, 17, 8, 8, 72, 72},
    {"N33Dk128", 1, 33, 33, 3, 3, 128, 128},
    {"N113GqaDvNarrower", 1, 113, 113, 8, 4, 40, 8},
    {"QShorterDvWider", 2, 15, 33, 3, 1, 40, 72},
    {"QLongerDvNarrower", 2, 33, 16, 8, 4, 72, 40},
    {"QLongerN113Dv1", 1, 113, 17, 3, 3, 8, 1},
    {"Dk1Dv8", 2, 17, 16, 1, 1, 1, 8},
    {"KeysN113Dk128Dv40", 1, 16, 113, 8, 2, 128, 40},
    // Enough query blocks per KV head that several of them walk the keys together.
    {"N250GqaGroupedBlocks", 2, 250, 250, 4, 2, 24, 20},
};

enum class MaskKind {
    None,
    ExplicitScale,
    Causal,
    Window,
    CausalWindow,
    WindowOne,
    KeyLengths,
    KeyLengthsWithEmpty,
    CausalKeyLengths,
    WindowKeyLengths,
    BoolFull,
    BoolKeyRow,
    BoolHeadQuery,
    BiasFull,
    BiasBroadcast,
    CausalBoolBias,
    Combined,
    CausalQueryLengths,
    WindowQueryLengths,
    CausalTopLeft,
    WindowTopLeftKeyLengths,
    CausalWindowOffsets,
    SinksCausal,
    SinksKeyLengthsWithEmpty,
    Softcap,
    SoftcapCausalBias,
    Alibi,
    AlibiCausalWindowKeyLengths,
    AlibiTopLeftBool,
    AlibiSoftcapSinksOffsets,
};

inline const MaskKind kMaskKinds[] = {
    MaskKind::None,       MaskKind::ExplicitScale,       MaskKind::Causal,
    MaskKind::Window,     MaskKind::CausalWindow,        MaskKind::WindowOne,
    MaskKind::KeyLengths, MaskKind::KeyLengthsWithEmpty, MaskKind::CausalKeyLengths,
    MaskKind::WindowKeyLengths, MaskKind::BoolFull,      MaskKind::BoolKeyRow,
    MaskKind::BoolHeadQuery, MaskKind::BiasFull,         MaskKind::BiasBroadcast,
    MaskKind::CausalBoolBias, MaskKind::Combined,      MaskKind::CausalQueryLengths,
    MaskKind::WindowQueryLengths, MaskKind::CausalTopLeft, MaskKind::WindowTopLeftKeyLengths,
    MaskKind::CausalWindowOffsets, MaskKind::SinksCausal, MaskKind::SinksKeyLengthsWithEmpty,
    MaskKind::Softcap, MaskKind::SoftcapCausalBias, MaskKind::Alibi, MaskKind::AlibiCausalWindowKeyLengths,
    MaskKind::AlibiTopLeftBool, MaskKind::AlibiSoftcapSinksOffsets,
};

inline const char* mask_name(MaskKind k) {
    switch (k) {
        case MaskKind::None: return "NoMask";
        case MaskKind::ExplicitScale: return "ExplicitScale";
        case MaskKind::Causal: return "Causal";
        case MaskKind::Window: return "Window";
        case MaskKind::CausalWindow: return "CausalWindow";
        case MaskKind::WindowOne: return "WindowOne";
        case MaskKind::KeyLengths: return "KeyLengths";
        case MaskKind::KeyLengthsWithEmpty: return "KeyLengthsWithEmpty";
        case MaskKind::CausalKeyLengths: return "CausalKeyLengths";
        case MaskKind::WindowKeyLengths: return "WindowKeyLengths";
        case MaskKind::BoolFull: return "BoolFull";
        case MaskKind::BoolKeyRow: return "BoolKeyRow";
        case MaskKind::BoolHeadQuery: return "BoolHeadQuery";
        case MaskKind::BiasFull: return "BiasFull";
        case MaskKind::BiasBroadcast: return "BiasBroadcast";
        case MaskKind::CausalBoolBias: return "CausalBoolBias";
        case MaskKind::Combined: return "Combined";
        case MaskKind::CausalQueryLengths: return "CausalQueryLengths";
        case MaskKind::WindowQueryLengths: return "WindowQueryLengths";
        case MaskKind::CausalTopLeft: return "CausalTopLeft";
        case MaskKind::WindowTopLeftKeyLengths: return "WindowTopLeftKeyLengths";
        case MaskKind::CausalWindowOffsets: return "CausalWindowOffsets";
        case MaskKind::SinksCausal: return "SinksCausal";
        case MaskKind::SinksKeyLengthsWithEmpty: return "SinksKeyLengthsWithEmpty";
        case MaskKind::Softcap: return "Softcap";
        case MaskKind::SoftcapCausalBias: return "SoftcapCausalBias";
        case MaskKind::Alibi: return "Alibi";
        case MaskKind::AlibiCausalWindowKeyLengths: return "AlibiCausalWindowKeyLengths";
        case MaskKind::AlibiTopLeftBool: return "AlibiTopLeftBool";
        case MaskKind::AlibiSoftcapSinksOffsets: return "AlibiSoftcapSinksOffsets";
    }
    return "Unknown";
}

// ---------------------------------------------------------------------------------------------
// Mask construction: a broadcastable source for the library and its dense expansion.

/// Masks in the library's broadcast form (dims [B|1, H|1, Nq|1, Nk]) plus the dense reference form.
struct MaskBuild {
    std::optional<double> scale;
    bool causal = false;
    std::optional<Index> window;
    std::vector<Index> key_lengths;
    std::vector<Index> query_lengths;
    bool top_left = false;
    std::vector<Index> query_offsets;
    std::vector<double> sinks;  ///< [H] learned sink logits, −∞ for a head without; empty = none
    std::optional<double> softcap;
    std::vector<double> alibi_slopes;  ///< [H]; empty = none
    std::unique_ptr<bool[]> bool_data;
    Index bool_dims[3] = {0, 0, 0};
    std::vector<double> bias_src;
    Index bias_dims[3] = {0, 0, 0};
    Index Nk = 0;
};

/// Expands a [db, dh, dq, Nk] source to dense [B, H, Nq, Nk].
template <class T, class Out>
void expand(const T* src, const Index dims[3], Index B, Index H, Index Nq, Index Nk, Out& out) {
    out.assign(static_cast<std::size_t>(B * H * Nq * Nk), typename Out::value_type{});
    for (Index b = 0; b < B; ++b)
        for (Index h = 0; h < H; ++h)
            for (Index i = 0; i < Nq; ++i)
                for (Index j = 0; j < Nk; ++j) {
                    const Index bb = dims[0] == 1 ? 0 : b, hh = dims[1] == 1 ? 0 : h,
                                ii = dims[2] == 1 ? 0 : i;
                    out[static_cast<std::size_t>(((b * H + h) * Nq + i) * Nk + j)] =
                        src[((bb * dims[1] + hh) * dims[2] + ii) * Nk + j];
                }
}

inline void set_bool(MaskBuild& m, Index db, Index dh, Index dq, Index Nk, std::uint64_t seed,
              double p_true = 0.7) {
    m.bool_dims[0] = db;
    m.bool_dims[1] = dh;
    m.bool_dims[2] = dq;
    const Index n = db * dh * dq * Nk;
    m.bool_data = std::make_unique<bool[]>(static_cast<std::size_t>(std::max<Index>(n, 1)));
    gattn_test::UniformSource src(seed);
    for (Index k = 0; k < n; ++k) m.bool_data[k] = (src.next() + 1.0) * 0.5 < p_true;
}

inline void set_bias(MaskBuild& m, Index db, Index dh, Index dq, Index Nk, std::uint64_t seed,
              double p_neg_inf = 0.15) {
    m.bias_dims[0] = db;
    m.bias_dims[1] = dh;
    m.bias_dims[2] = dq;
    const Index n = db * dh * dq * Nk;
    m.bias_src.resize(static_cast<std::size_t>(n));
    gattn_test::UniformSource src(seed);
    for (Index k = 0; k < n; ++k) {
        const double u = (src.next() + 1.0) * 0.5;
        m.bias_src[static_cast<std::size_t>(k)] = u < p_neg_inf ? -kInf : src.next(2.0);
    }
}

inline std::vector<Index> partial_lengths(Index B, Index Nk) {
    std::vector<Index> L(static_cast<std::size_t>(B));
    for (Index b = 0; b < B; ++b) L[static_cast<std::size_t>(b)] = std::max<Index>(1, Nk - 1 - (b * Nk) / 2);
    return L;
}

/// Valid query counts of a padded batch: all N_q in the first sequence when B > 1 (so that
/// Q_b = N_q meets L_b < N_k), fewer in the others (at least 1).
inline std::vector<Index> partial_query_lengths(Index B, Index Nq) {
    std::vector<Index> Q(static_cast<std::size_t>(B));
    for (Index b = 0; b < B; ++b) Q[static_cast<std::size_t>(b)] = b == 0 && B > 1 ? Nq : std::max<Index>(1, Nq / (b + 2));
    return Q;
}

inline MaskBuild make_masks(MaskKind kind, const Shape& s, std::uint64_t seed) {
    MaskBuild m;
    m.Nk = s.Nk;
    switch (kind) {
        case MaskKind::None: break;
        case MaskKind::ExplicitScale: m.scale = 0.37; break;
        case MaskKind::Causal: m.causal = true; break;
        case MaskKind::Window: m.window = 5; break;
        case MaskKind::CausalWindow:
            m.causal = true;
            m.window = 3;
            break;
        case MaskKind::WindowOne: m.window = 1; break;
        case MaskKind::KeyLengths: m.key_lengths = partial_lengths(s.B, s.Nk); break;
        case MaskKind::KeyLengthsWithEmpty:
            m.key_lengths.assign(static_cast<std::size_t>(s.B), s.Nk);
            m.key_lengths[0] = 0;
            break;
        case MaskKind::CausalKeyLengths:
            m.causal = true;
            m.key_lengths = partial_lengths(s.B, s.Nk);
            break;
        case MaskKind::WindowKeyLengths:
            m.window = 4;
            m.key_lengths = partial_lengths(s.B, s.Nk);
            break;
        case MaskKind::BoolFull: set_bool(m, s.B, s.H, s.Nq, s.Nk, seed); break;
        case MaskKind::BoolKeyRow: set_bool(m, s.B, 1, 1, s.Nk, seed); break;
        case MaskKind::BoolHeadQuery: set_bool(m, 1, s.H, s.Nq, s.Nk, seed); break;
        case MaskKind::BiasFull: set_bias(m, s.B, s.H, s.Nq, s.Nk, seed); break;
        case MaskKind::BiasBroadcast: set_bias(m, 1, 1, s.Nq, s.Nk, seed); break;
        case MaskKind::CausalBoolBias:
            m.causal = true;
            set_bool(m, s.B, s.H, s.Nq, s.Nk, seed);
            set_bias(m, s.B, s.H, s.Nq, s.Nk, seed + 1);
            break;
        case MaskKind::Combined:
            m.scale = 0.25;
            m.causal = true;
            m.window = 7;
            m.key_lengths = partial_lengths(s.B, s.Nk);
            set_bool(m, s.B, 1, s.Nq, s.Nk, seed, 0.8);
            set_bias(m, 1, s.H, 1, s.Nk, seed + 1, 0.1);
            break;
        case MaskKind::CausalQueryLengths:
            m.causal = true;
            m.key_lengths = partial_lengths(s.B, s.Nk);
            m.query_lengths = partial_query_lengths(s.B, s.Nq);
            break;
        case MaskKind::WindowQueryLengths:
            m.window = 4;
            m.key_lengths = partial_lengths(s.B, s.Nk);
            m.query_lengths = partial_query_lengths(s.B, s.Nq);
            break;
        case MaskKind::CausalTopLeft:
            m.causal = true;
            m.top_left = true;
            break;
        case MaskKind::WindowTopLeftKeyLengths:
            m.window = 3;
            m.top_left = true;
            m.key_lengths = partial_lengths(s.B, s.Nk);
            break;
        case MaskKind::SinksCausal:
        case MaskKind::SinksKeyLengthsWithEmpty: {
            // Sinks in (−1.5, 2.5) (logits here are about ±1), every fourth head without one.
            gattn_test::UniformSource src(seed);
            for (Index h = 0; h < s.H; ++h) m.sinks.push_back(h % 4 == 3 ? -kInf : 0.5 + src.next(2.0));
            if (kind == MaskKind::SinksCausal) {
                m.causal = true;
            } else {  // a sequence with no key: its rows give 0 and log-sum-exp s_h
                m.key_lengths.assign(static_cast<std::size_t>(s.B), s.Nk);
                m.key_lengths[0] = 0;
            }
            break;
        }
        case MaskKind::Softcap:
            // Logits here are about ±1–3: a cap of 0.75 bends all of them.
            m.softcap = 0.75;
            break;
        case MaskKind::SoftcapCausalBias:
            m.softcap = 1.25;
            m.causal = true;
            set_bias(m, s.B, 1, s.Nq, s.Nk, seed);
            break;
        case MaskKind::Alibi:
            m.alibi_slopes = gattn::alibi_slopes<double>(s.H);
            break;
        case MaskKind::AlibiCausalWindowKeyLengths:
            // Slopes of either sign and 0, large enough that the distances dominate.
            for (Index h = 0; h < s.H; ++h) m.alibi_slopes.push_back(h % 3 == 2 ? 0.0 : (h % 2 ? -0.2 : 0.45) * (h + 1));
            m.causal = true;
            m.window = 9;
            m.key_lengths = partial_lengths(s.B, s.Nk);
            break;
        case MaskKind::AlibiTopLeftBool:
            m.alibi_slopes = gattn::alibi_slopes<double>(s.H);
            for (double& x : m.alibi_slopes) x *= 4;
            m.causal = true;
            m.top_left = true;
            set_bool(m, s.B, s.H, s.Nq, s.Nk, seed);
            break;
        case MaskKind::AlibiSoftcapSinksOffsets: {
            gattn_test::UniformSource src(seed);
            for (Index h = 0; h < s.H; ++h) {
                m.sinks.push_back(0.5 + src.next(1.0));
                m.alibi_slopes.push_back(0.1 + 0.25 * static_cast<double>(h % 4));
            }
            m.softcap = 2.0;
            m.causal = true;
            for (Index b = 0; b < s.B; ++b) m.query_offsets.push_back(b % 2 == 0 ? -std::min<Index>(1, s.Nq) : s.Nk / 3);
            break;
        }
        case MaskKind::CausalWindowOffsets:
            // Offsets from before the first key (early queries see nothing) to past the last.
            m.causal = true;
            m.window = 6;
            for (Index b = 0; b < s.B; ++b)
                m.query_offsets.push_back(b % 3 == 0 ? -std::min<Index>(2, s.Nq) : b % 3 == 1 ? s.Nk / 2 : s.Nk);
            break;
    }
    return m;
}

/// Library options for the masks; bias_store keeps the Scalar copy of the bias alive.
template <class S>
gattn::SdpaOptions<S> library_options(const MaskBuild& m, std::vector<S>& bias_store) {
    gattn::SdpaOptions<S> o;
    o.scale = m.scale;
    o.mask.causal = m.causal;
    o.mask.sliding_window = m.window;
    o.mask.key_lengths = m.key_lengths;
    o.mask.query_lengths = m.query_lengths;
    o.mask.alignment = m.top_left ? gattn::CausalAlignment::TopLeft : gattn::CausalAlignment::BottomRight;
    o.mask.query_offsets = m.query_offsets;
    for (double x : m.sinks) o.sinks.push_back(static_cast<S>(x));
    o.logit_softcap = m.softcap;
    for (double x : m.alibi_slopes) o.alibi_slopes.push_back(static_cast<S>(x));
    if (m.bool_data) o.mask.bool_mask = {m.bool_data.get(), m.bool_dims[0], m.bool_dims[1], m.bool_dims[2], m.Nk};
    if (!m.bias_src.empty() || m.bias_dims[0] > 0) {
        bias_store.assign(m.bias_src.begin(), m.bias_src.end());
        for (auto& v : bias_store) v = static_cast<S>(v);
        o.mask.bias = {bias_store.data(), m.bias_dims[0], m.bias_dims[1], m.bias_dims[2], m.Nk};
    }
    return o;
}

/// The same masks in dense reference form (bias rounded to S, as the library sees it).
template <class S>
RefMasks reference_masks(const MaskBuild& m, Index B, Index H, Index Nq, Index Nk) {
    RefMasks r;
    r.causal = m.causal;
    r.sliding_window = m.window;
    r.key_lengths = m.key_lengths;
    r.query_lengths = m.query_lengths;
    r.top_left = m.top_left;
    r.query_offsets = m.query_offsets;
    for (double x : m.sinks) r.sinks.push_back(static_cast<double>(static_cast<S>(x)));  // as the library sees it
    if (m.softcap) r.softcap = static_cast<double>(static_cast<S>(*m.softcap));
    for (double x : m.alibi_slopes) r.alibi_slopes.push_back(static_cast<double>(static_cast<S>(x)));
    if (m.bool_data) expand(m.bool_data.get(), m.bool_dims, B, H, Nq, Nk, r.bool_mask);
    if (m.bias_dims[0] > 0) {
        std::vector<double> rounded(m.bias_src.size());
        for (std::size_t k = 0; k < rounded.size(); ++k)
            rounded[k] = static_cast<double>(static_cast<S>(m.bias_src[k]));
        expand(rounded.data(), m.bias_dims, B, H, Nq, Nk, r.bias);
    }
    return r;
}

/// Sets K and V rows to NaN for every key that no (head, query) of its sequence may see through
/// the structural masks (key lengths, causal, window, boolean). Returns how many rows.
inline Index poison_invisible_keys(const RefMasks& r, Index B, Index H, Index Nq, Index Nk, Mat& k, Mat& v) {
    Index poisoned = 0;
    for (Index b = 0; b < B; ++b)
        for (Index j = 0; j < Nk; ++j) {
            bool seen = false;
            for (Index h = 0; h < H && !seen; ++h)
                for (Index i = 0; i < Nq && !seen; ++i)
                    seen = gattn_test::key_visible(r, H, b, h, i, j, Nq, Nk, /*include_bias=*/false);
            if (seen) continue;
            k.row(b * Nk + j).setConstant(kNaN);
            v.row(b * Nk + j).setConstant(kNaN);
            ++poisoned;
        }
    return poisoned;
}

/// Rows and head blocks that the reference says see no key must be exactly 0 (and not NaN).
template <class S>
void expect_masked_rows_zero(const gattn::RowMatrix<S>& out, const Mat& ref_lse, Index dv,
                             const std::string& label) {
    long bad = 0;
    Index first_row = -1, first_head = -1;
    for (Index r = 0; r < ref_lse.rows(); ++r)
        for (Index h = 0; h < ref_lse.cols(); ++h) {
            if (ref_lse(r, h) != -kInf) continue;
            for (Index d = 0; d < dv; ++d)
                if (!(out(r, h * dv + d) == S(0))) {
                    if (bad++ == 0) {
                        first_row = r;
                        first_head = h;
                    }
                    break;
                }
        }
    EXPECT_EQ(bad, 0) << label << ": fully masked (row, head) blocks not exactly zero; first at row "
                      << first_row << " head " << first_head;
}

}  // namespace sweep
}  // namespace gattn_test
