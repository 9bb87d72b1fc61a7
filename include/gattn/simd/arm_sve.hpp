// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// ARM64 SVE tier (HWCAP_SVE, chosen at run time): both products of decoding over a float
/// cache (kernel::decode_sve, driven by ops/decode_kernel.hpp) in vectors of the CPU's length,
/// for CPUs whose SVE vectors are wider than NEON's 128 bits (256-bit on Neoverse V1, 512-bit
/// on A64FX); at 128 bits NEON runs, which gives the same width. Vector-length agnostic: each
/// loop steps by svcntw() floats and a predicate (WHILELT) takes the last, partial vector, so
/// any d_k and d_v run without a scalar tail.
///
/// The drivers' blocks stay NEON's (4 keys, features in the lanes here): per key and row the
/// dot product over d_k accumulates in one vector and is reduced across lanes (FADDV); the value
/// sum adds each key's V row times its weight (FMLA, one key after another, as NEON does, so it
/// gives NEON's bits), with the FMLA of a key a row skips (logit −∞) predicated off, so a
/// non-finite V row of a masked key never reaches the sum.
///
/// Compiled in every ARM64 build with GCC (target attribute arch=armv8.2-a+sve; the build stays
/// at the ARMv8-A baseline), or with Clang when the build enables SVE; elsewhere (kEnabled
/// false) the kernels are only declared, for drivers that name them in `if constexpr` branches
/// they never instantiate. Which runs: instruction_sets().unused and set_sve_kernels
/// (simd/cpu.hpp).

#include <cmath>
#include <cstdint>
#include <limits>

#include "gattn/config.hpp"
#include "gattn/simd/compat.hpp"
#include "gattn/types.hpp"

#if defined(__aarch64__) && ((defined(__GNUC__) && !defined(__clang__)) || defined(__ARM_FEATURE_SVE))
#include <arm_sve.h>
#define GATTN_HAS_SVE_KERNEL 1
/// Compiles a function for ARMv8.2-A with SVE.
#define GATTN_TARGET_SVE __attribute__((target("arch=armv8.2-a+sve")))
#endif

GATTN_BEGIN_ISA_NAMESPACE
namespace simd {
namespace sve {
#if defined(GATTN_HAS_SVE_KERNEL)
inline constexpr bool kEnabled = true;  ///< ARM64: the SVE kernels are compiled in (run where HWCAP says)
#else
inline constexpr bool kEnabled = false;
#endif
}  // namespace sve
}  // namespace simd

namespace kernel {

/// Decoding products over a float cache in SVE vectors (see the file comment).
namespace decode_sve {

#if defined(GATTN_HAS_SVE_KERNEL)
// SVE registers are sizeless: no arrays of them, so the (at most 2) rows are written out.

/// logits[r] lane kk = Σ_d q_r[d]·key[kk][d] for R ≤ 2 rows and the keys kk < nk ≤ 4 of the
/// block (lanes kk ≥ nk are 0), unscaled, over all d_k features.
template <int R>
GATTN_TARGET_SVE inline void logits(const float* const* q, const float* key, Index key_stride, Index nk, Index dk,
                                    simd::Batch<float>* logits) noexcept {
    static_assert(R >= 1 && R <= 2, "decode_sve takes 1 or 2 rows");
    svfloat32_t a0 = svdup_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;  // row 0, keys 0–3
    svfloat32_t b0 = a0, b1 = a0, b2 = a0, b3 = a0;                 // row 1
    // Keys past nk read key 0's row again (in the block, always readable); their lanes are cleared.
    const float *k0 = key, *k1 = key + (nk > 1 ? key_stride : 0), *k2 = key + (nk > 2 ? 2 * key_stride : 0),
                *k3 = key + (nk > 3 ? 3 * key_stride : 0);
    const Index step = static_cast<Index>(svcntw());
    for (Index d = 0; d < dk; d += step) {
        const svbool_t pg = svwhilelt_b32(static_cast<std::int64_t>(d), static_cast<std::int64_t>(dk));
        const svfloat32_t x0 = svld1_f32(pg, k0 + d), x1 = svld1_f32(pg, k1 + d), x2 = svld1_f32(pg, k2 + d),
                          x3 = svld1_f32(pg, k3 + d);
        const svfloat32_t q0 = svld1_f32(pg, q[0] + d);
        a0 = svmla_f32_m(pg, a0, q0, x0);
        a1 = svmla_f32_m(pg, a1, q0, x1);
        a2 = svmla_f32_m(pg, a2, q0, x2);
        a3 = svmla_f32_m(pg, a3, q0, x3);
        if constexpr (R == 2) {
            const svfloat32_t q1 = svld1_f32(pg, q[1] + d);
            b0 = svmla_f32_m(pg, b0, q1, x0);
            b1 = svmla_f32_m(pg, b1, q1, x1);
            b2 = svmla_f32_m(pg, b2, q1, x2);
            b3 = svmla_f32_m(pg, b3, q1, x3);
        }
    }
    const svbool_t all = svptrue_b32();
    auto reduce = [&](float* dots, svfloat32_t y0, svfloat32_t y1, svfloat32_t y2, svfloat32_t y3) GATTN_TARGET_SVE {
        dots[0] = svaddv_f32(all, y0);
        dots[1] = nk > 1 ? svaddv_f32(all, y1) : 0.0f;
        dots[2] = nk > 2 ? svaddv_f32(all, y2) : 0.0f;
        dots[3] = nk > 3 ? svaddv_f32(all, y3) : 0.0f;
    };
    alignas(16) float dots[2][4];
    reduce(dots[0], a0, a1, a2, a3);
    logits[0] = simd::Batch<float>::load_aligned(dots[0]);
    if constexpr (R == 2) {
        reduce(dots[1], b0, b1, b2, b3);
        logits[1] = simd::Batch<float>::load_aligned(dots[1]);
    }
}

/// acc[r][d] += Σ_kk p[r][kk]·V[kk][d] for R ≤ 2 rows over the keys kk < nk ≤ 4 of the block,
/// one key after another, with the FMLA of a key row r does not see (score[r][kk] = −∞)
/// predicated off.
template <int R>
GATTN_TARGET_SVE inline void values(const float (*score)[4], const float (*p)[4], Index nk, const float* value,
                                    Index value_stride, float* const* acc, Index dv) noexcept {
    static_assert(R >= 1 && R <= 2, "decode_sve takes 1 or 2 rows");
    bool live[2][4] = {};
    GATTN_UNROLL
    for (int r = 0; r < R; ++r)
        for (Index kk = 0; kk < nk; ++kk) live[r][kk] = score[r][kk] != -std::numeric_limits<float>::infinity();
    const Index step = static_cast<Index>(svcntw());
    for (Index j = 0; j < dv; j += step) {
        const svbool_t pg = svwhilelt_b32(static_cast<std::int64_t>(j), static_cast<std::int64_t>(dv)),
                       none = svpfalse_b();
        svfloat32_t a0 = svld1_f32(pg, acc[0] + j), a1 = a0;
        if constexpr (R == 2) a1 = svld1_f32(pg, acc[1] + j);
        for (Index kk = 0; kk < nk; ++kk) {
            const svfloat32_t v = svld1_f32(pg, value + kk * value_stride + j);
            a0 = svmla_n_f32_m(live[0][kk] ? pg : none, a0, v, p[0][kk]);
            if constexpr (R == 2) a1 = svmla_n_f32_m(live[1][kk] ? pg : none, a1, v, p[1][kk]);
        }
        svst1_f32(pg, acc[0] + j, a0);
        if constexpr (R == 2) svst1_f32(pg, acc[1] + j, a1);
    }
}
#else
template <int R>
void logits(const float* const* q, const float* key, Index key_stride, Index nk, Index dk,
            simd::Batch<float>* logits) noexcept;
template <int R>
void values(const float (*score)[4], const float (*p)[4], Index nk, const float* value, Index value_stride,
            float* const* acc, Index dv) noexcept;
#endif  // GATTN_HAS_SVE_KERNEL

}  // namespace decode_sve
}  // namespace kernel
GATTN_END_ISA_NAMESPACE
