// SPDX-License-Identifier: Apache-2.0
// SDPA on 16-bit storage (bf16, fp16) against the float64 reference on the same rounded inputs:
// every shape and mask of the float sweep (prefill tiles and, for few queries per KV head, the
// decoding kernel reading the 16-bit cache in place), through each kernel this machine can run (AMX and
// AVX512-BF16 where compiled and present, BFDOT on ARM64 with BF16, widened float always), with bf16, fp16 and float outputs; NaN in
// masked keys, including keys only some queries of a key block see; fully masked rows; thread
// count invariance; the kernel report.
//
// Tolerances, from the rounding each path does (docs/conventions.md, "Numerics"):
//  - widened float, float output: the float kernel's own 1e-5 (nothing is rounded after the
//    inputs);
//  - any bf16 or fp16 output: one rounding of the float result, |err| ≤ 2⁻⁸·|ref| (bf16) or
//    2⁻¹¹·|ref| (fp16), plus the float kernel's error;
//  - AVX512-BF16, AMX, BFDOT: P rounded to bf16 before the PV product (relative error ≤ 2⁻⁸ per weight) moves
//    an output by at most 2⁻⁷·max|v| and the log-sum-exp by at most 2⁻⁸ (the row sum adds the
//    rounded weights). NMSE bounds (2e-5 for bf16 outputs) sit about 3× above the worst observed.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "gattn/ops/sdpa.hpp"
#include "gattn/simd/cpu.hpp"
#include "support/compare.hpp"
#include "support/kernel_limit.hpp"
#include "support/reference.hpp"
#include "support/sdpa_cases.hpp"

namespace {

using gattn::Bf16Kernel;
using gattn::bfloat16;
using gattn::half;
using gattn::Index;
using gattn_test::expect_close;
using gattn_test::Mat;
using gattn_test::random_matrix;
using gattn_test::RefMasks;
using gattn_test::rounded;
using namespace gattn_test::sweep;

using gattn_test::KernelLimit;

/// The kernel families this build and CPU can run for bf16 (the fastest first).
std::vector<Bf16Kernel> runnable_kernels() {
    std::vector<Bf16Kernel> ks;
    const Bf16Kernel best = gattn::bf16_kernel().kernel;
    if (best == Bf16Kernel::Amx) ks.push_back(Bf16Kernel::Amx);
    if (best == Bf16Kernel::Amx || best == Bf16Kernel::Avx512Bf16) ks.push_back(Bf16Kernel::Avx512Bf16);
    if (best == Bf16Kernel::Bfdot) ks.push_back(Bf16Kernel::Bfdot);  // ARM64
    ks.push_back(Bf16Kernel::WidenedFloat);
    return ks;
}

/// Tolerances of one (storage, output, kernel) combination against the float64 reference.
struct NarrowTol {
    double atol, rtol, nmse, lse_atol, first_rtol;
};

template <class S, class Out>
NarrowTol tolerance(Bf16Kernel k) {
    const bool tiles = std::is_same_v<S, bfloat16> && k != Bf16Kernel::WidenedFloat;
    const double out_rtol = std::is_same_v<Out, bfloat16> ? 0x1p-8 : std::is_same_v<Out, half> ? 0x1p-11 : 0.0;
    NarrowTol t{1e-5, 1e-5 + out_rtol, 1e-10, 1e-5, 1e-5};
    if (out_rtol > 0) t.nmse = std::is_same_v<Out, bfloat16> ? 2e-5 : 2e-7;
    if (tiles) {
        t.atol = 0x1p-7;  // inputs in (−1, 1): max|v| ≤ 1
        t.nmse = 2e-5;
        t.lse_atol = 0x1p-8;
        t.first_rtol = 0x1p-7;
    }
    return t;
}

/// Whether bf16 decoding with kernel k runs products on bf16 pairs (P rounded to bf16) at these
/// head sizes: VDPBF16PS (AMX and AVX512-BF16 builds) for multiples of 32, BFDOT for multiples of 8.
bool decodes_with_dot(Bf16Kernel k, Index dk, Index dv) {
    if (k == Bf16Kernel::Bfdot) return dk % 8 == 0 && dv % 8 == 0;
    return k != Bf16Kernel::WidenedFloat && dk % 32 == 0 && dv % 32 == 0;
}

const char* kernel_label(Bf16Kernel k) {
    return k == Bf16Kernel::Avx512Bf16 ? "Avx512Bf16"
           : k == Bf16Kernel::Amx      ? "Amx"
           : k == Bf16Kernel::Bfdot    ? "Bfdot"
                                       : "Widened";
}

template <class S>
const char* storage_label() {
    return std::is_same_v<S, bfloat16> ? "Bf16" : std::is_same_v<S, half> ? "Half" : "Float";
}

/// One sweep case with storage S, output Out and kernel limit k.
template <class S, class Out>
void run_case(const Shape& s, MaskKind kind, Bf16Kernel k) {
    KernelLimit limit(k);
    const std::uint64_t seed = 5000u + static_cast<std::uint64_t>(kind) * 37u +
                               static_cast<std::uint64_t>(s.Nq * 131 + s.Nk * 7 + s.dk);
    const std::string label = std::string("Sdpa") + storage_label<S>() + "To" + storage_label<Out>() + "/" +
                              kernel_label(k) + "/" + s.name + "/" + mask_name(kind);
    Mat q = rounded<S>(random_matrix(s.B * s.Nq, s.H * s.dk, seed));
    Mat key = rounded<S>(random_matrix(s.B * s.Nk, s.Hkv * s.dk, seed + 1));
    Mat v = rounded<S>(random_matrix(s.B * s.Nk, s.Hkv * s.dv, seed + 2));
    const MaskBuild masks = make_masks(kind, s, seed + 3);
    const RefMasks ref_masks = reference_masks<float>(masks, s.B, s.H, s.Nq, s.Nk);
    poison_invisible_keys(ref_masks, s.B, s.H, s.Nq, s.Nk, key, v);
    const auto ref = gattn_test::sdpa_reference(q, key, v, s.B, s.H, s.Hkv, masks.scale, ref_masks);

    const gattn::RowMatrix<S> qs = q.cast<S>(), ks = key.cast<S>(), vs = v.cast<S>();
    std::vector<float> bias_store;
    const gattn::SdpaOptions<float> opt = library_options<float>(masks, bias_store);
    gattn::RowMatrix<Out> out = gattn::RowMatrix<Out>::Constant(s.B * s.Nq, s.H * s.dv, Out(-777));
    gattn::RowMatrix<float> lse, probs, first;
    gattn::SdpaOutputs<float> extra;
    extra.log_sum_exp = &lse;
    extra.probabilities = &probs;
    extra.first_key_probability = &first;
    gattn::scaled_dot_product_attention<S, Out>(qs, ks, vs, gattn::HeadLayout{s.B, s.H, s.Hkv}, out, opt, extra);

    const NarrowTol t = tolerance<S, Out>(k);
    const Mat got = out.template cast<float>().template cast<double>();
    expect_close(got, ref.out, t.atol, t.rtol, label + "/out", t.nmse);
    expect_close(lse, ref.log_sum_exp, t.lse_atol, 1e-5, label + "/lse");
    expect_close(probs, ref.probabilities, 1e-5, 1e-5, label + "/probabilities");
    expect_close(first, ref.first_key, 1e-5, t.first_rtol, label + "/first_key");
    expect_masked_rows_zero<Out>(out, ref.log_sum_exp, s.dv, label);
}

class NarrowSweep : public ::testing::TestWithParam<std::tuple<Shape, MaskKind>> {};

TEST_P(NarrowSweep, Bf16MatchesReference) {
    const auto& [shape, kind] = GetParam();
    for (Bf16Kernel k : runnable_kernels()) {
        run_case<bfloat16, bfloat16>(shape, kind, k);
        run_case<bfloat16, float>(shape, kind, k);
    }
}

TEST_P(NarrowSweep, HalfMatchesReference) {
    const auto& [shape, kind] = GetParam();
    run_case<half, half>(shape, kind, Bf16Kernel::Amx);
    run_case<half, float>(shape, kind, Bf16Kernel::Amx);
}

INSTANTIATE_TEST_SUITE_P(ShapesAndMasks, NarrowSweep,
                         ::testing::Combine(::testing::ValuesIn(kShapes), ::testing::ValuesIn(kMaskKinds)),
                         [](const ::testing::TestParamInfo<NarrowSweep::ParamType>& info) {
                             return std::string(std::get<0>(info.param).name) + mask_name(std::get<1>(info.param));
                         });

/// A NaN key j is visible to queries i ≥ j only: the earlier queries of its key block (which the
/// AVX512-BF16 kernel multiplies with P = −0 for it) stay finite and match the reference, the
/// later ones are NaN. Odd and even key counts, the poisoned key in every position of a block.
TEST(NarrowSdpa, NaNInCausalFutureKeysDoesNotLeak) {
    const Index B = 2, H = 4, Hkv = 2, dk = 8, dv = 8;
    for (Bf16Kernel k : runnable_kernels()) {
        KernelLimit limit(k);
        for (const auto& [N, poisoned] :
             {std::pair<Index, Index>{16, 11}, {100, 11}, {100, 37}, {100, 70}, {101, 99}, {130, 64}, {130, 127}}) {
            SCOPED_TRACE(std::string(kernel_label(k)) + ", N = " + std::to_string(N) + ", poisoned key " +
                         std::to_string(poisoned));
            Mat q = rounded<bfloat16>(random_matrix(B * N, H * dk, 91)),
                key = rounded<bfloat16>(random_matrix(B * N, Hkv * dk, 92)),
                v = rounded<bfloat16>(random_matrix(B * N, Hkv * dv, 93));
            for (Index b = 0; b < B; ++b) {
                key.row(b * N + poisoned).setConstant(kNaN);
                v.row(b * N + poisoned).setConstant(b == 0 ? kNaN : kInf);
            }
            const gattn::RowMatrix<bfloat16> qs = q.cast<bfloat16>(), ks = key.cast<bfloat16>(),
                                             vs = v.cast<bfloat16>();
            gattn::SdpaOptions<float> opt;
            opt.mask.causal = true;
            gattn::RowMatrix<float> got(B * N, H * dv);
            gattn::scaled_dot_product_attention<bfloat16, float>(qs, ks, vs, gattn::HeadLayout{B, H, Hkv}, got, opt);
            RefMasks rm;
            rm.causal = true;
            const auto ref = gattn_test::sdpa_reference(q, key, v, B, H, Hkv, {}, rm);
            const NarrowTol t = tolerance<bfloat16, float>(k);
            for (Index b = 0; b < B; ++b) {
                const auto got_b = got.middleRows(b * N, poisoned);
                EXPECT_TRUE(got_b.allFinite()) << "a future key's NaN or ∞ leaked into earlier queries";
                expect_close(got_b, ref.out.middleRows(b * N, poisoned), t.atol, t.rtol, "NarrowNaNFuture/out");
                EXPECT_TRUE(got.middleRows(b * N + poisoned, N - poisoned).array().isNaN().all())
                    << "a query that sees the NaN key must be NaN";
            }
        }
    }
}

/// Key lengths that end inside a key pair: the key after the last one (NaN, past the length)
/// shares its packed pair with a visible key and must not reach the output.
TEST(NarrowSdpa, KeyPastAnOddLengthDoesNotLeak) {
    const Index B = 2, N = 70, H = 2, Hkv = 1, d = 16;
    for (Bf16Kernel k : runnable_kernels()) {
        KernelLimit limit(k);
        for (Index len : {Index(1), Index(5), Index(63), Index(65), Index(69)}) {
            SCOPED_TRACE(std::string(kernel_label(k)) + ", length " + std::to_string(len));
            Mat q = rounded<bfloat16>(random_matrix(B * N, H * d, 7)),
                key = rounded<bfloat16>(random_matrix(B * N, Hkv * d, 8)),
                v = rounded<bfloat16>(random_matrix(B * N, Hkv * d, 9));
            for (Index b = 0; b < B; ++b)
                for (Index j = len; j < N; ++j) {
                    key.row(b * N + j).setConstant(kNaN);
                    v.row(b * N + j).setConstant(kInf);
                }
            gattn::SdpaOptions<float> opt;
            opt.mask.key_lengths.push_back(len);
            opt.mask.key_lengths.push_back(N);
            // The second sequence sees its NaN keys: only the first is checked.
            gattn::RowMatrix<float> got(B * N, H * d);
            gattn::scaled_dot_product_attention<bfloat16, float>(q.cast<bfloat16>(), key.cast<bfloat16>(),
                                                                 v.cast<bfloat16>(), {B, H, Hkv}, got, opt);
            RefMasks first_only;
            first_only.key_lengths.push_back(len);
            const auto ref =
                gattn_test::sdpa_reference(q.topRows(N), key.topRows(N), v.topRows(N), 1, H, Hkv, {}, first_only);
            const NarrowTol t = tolerance<bfloat16, float>(k);
            EXPECT_TRUE(got.topRows(N).allFinite());
            expect_close(got.topRows(N), ref.out, t.atol, t.rtol, "NarrowOddLength/out");
        }
    }
}

/// Decoding (a few queries per KV head) reads a 16-bit cache where it lies: several 512-key
/// chunks merged through the log-sum-exp, GQA, key lengths ending mid-chunk (and mid key pair)
/// with NaN and ∞ in the unused slots, a window; bitwise the same on 1 and 2 threads. Head
/// sizes that the dot-product kernels take (VDPBF16PS: multiples of 32; ARM64's BFDOT:
/// multiples of 8) run them (P rounded to bf16, the tiles' tolerance); others widen to float
/// (float math on exact inputs).
TEST(NarrowSdpa, DecodingOverLongCacheMatchesReference) {
    const Index B = 2, Nq = 1, H = 8, Hkv = 2;
    // 26000 keys: more K and V than kDecodeFromMemoryBytes, prefetched two blocks ahead.
    for (Index Nk : {Index(1500), Index(26000)})
        for (Index d : {72, 128})
            for (bool window : {false, true}) {
                SCOPED_TRACE((window ? "window 700, d " : "no window, d ") + std::to_string(d) + ", " +
                             std::to_string(Nk) + " keys");
                Mat q = rounded<bfloat16>(random_matrix(B * Nq, H * d, 31)),
                    key = rounded<bfloat16>(random_matrix(B * Nk, Hkv * d, 32)),
                    v = rounded<bfloat16>(random_matrix(B * Nk, Hkv * d, 33));
                const std::vector<Index> lengths = {Nk - 399, Nk};
                for (Index j = lengths[0]; j < Nk; ++j) {
                    key.row(j).setConstant(kNaN);
                    v.row(j).setConstant(kInf);
                }
                gattn::SdpaOptions<float> opt;
                opt.mask.key_lengths = lengths;
                if (window) opt.mask.sliding_window = 700;
                opt.mask.causal = true;
                RefMasks rm;
                rm.key_lengths = lengths;
                rm.causal = true;
                if (window) rm.sliding_window = 700;
                const auto ref = gattn_test::sdpa_reference(q, key, v, B, H, Hkv, {}, rm);
                const gattn::RowMatrix<bfloat16> qs = q.cast<bfloat16>(), ks = key.cast<bfloat16>(),
                                                 vs = v.cast<bfloat16>();
                for (Bf16Kernel k : runnable_kernels()) {
                    KernelLimit limit(k);
                    gattn::RowMatrix<float> lse;
                    gattn::SdpaOutputs<float> extra;
                    extra.log_sum_exp = &lse;
                    gattn::RowMatrix<float> out(B * Nq, H * d);
                    gattn::scaled_dot_product_attention<bfloat16, float>(qs, ks, vs, {B, H, Hkv}, out, opt, extra);
                    const bool dot = decodes_with_dot(k, d, d);
                    const NarrowTol t = dot ? tolerance<bfloat16, float>(k) : tolerance<float, float>(k);
                    const NarrowTol t16 = dot ? tolerance<bfloat16, bfloat16>(k) : tolerance<float, bfloat16>(k);
                    expect_close(out, ref.out, t.atol, t.rtol, "NarrowDecode/out", t.nmse);
                    expect_close(lse, ref.log_sum_exp, t.lse_atol, 1e-5, "NarrowDecode/lse");
                    const gattn::RowMatrix<bfloat16> out16 =
                        gattn::scaled_dot_product_attention<bfloat16>(qs, ks, vs, {B, H, Hkv}, opt);
                    expect_close(out16.cast<float>(), ref.out, t16.atol, t16.rtol, "NarrowDecode/out16", t16.nmse);
#ifdef _OPENMP
                    const int saved = omp_get_max_threads();
                    omp_set_num_threads(saved == 1 ? 2 : 1);
                    gattn::RowMatrix<float> again(B * Nq, H * d);
                    gattn::scaled_dot_product_attention<bfloat16, float>(qs, ks, vs, {B, H, Hkv}, again, opt);
                    omp_set_num_threads(saved);
                    EXPECT_TRUE(again == out) << "thread count changed a decoding result";
#endif
                }
            }
}

/// Runs bf16 SDPA with the dot-product kernel and with the widened one: both within their
/// tolerances of ref_out (the float64 reference), and not equal bit for bit (else the dot
/// kernel did not run).
void expect_dot_kernel_ran(Bf16Kernel dot_kernel, const Mat& q, const Mat& key, const Mat& v, gattn::HeadLayout layout,
                           const gattn::SdpaOptions<float>& opt, const Mat& ref_out, const std::string& label) {
    const gattn::RowMatrix<bfloat16> qs = q.cast<bfloat16>(), ks = key.cast<bfloat16>(), vs = v.cast<bfloat16>();
    gattn::RowMatrix<float> out_dot(ref_out.rows(), ref_out.cols()), out_wide(ref_out.rows(), ref_out.cols());
    {
        KernelLimit limit(dot_kernel);
        gattn::scaled_dot_product_attention<bfloat16, float>(qs, ks, vs, layout, out_dot, opt);
    }
    {
        KernelLimit limit(Bf16Kernel::WidenedFloat);
        gattn::scaled_dot_product_attention<bfloat16, float>(qs, ks, vs, layout, out_wide, opt);
    }
    const NarrowTol t_dot = tolerance<bfloat16, float>(dot_kernel),
                    t_wide = tolerance<float, float>(Bf16Kernel::WidenedFloat);
    expect_close(out_dot, ref_out, t_dot.atol, t_dot.rtol, "Dot" + label + "/out", t_dot.nmse);
    expect_close(out_wide, ref_out, t_wide.atol, t_wide.rtol, "Widened" + label + "/out", t_wide.nmse);
    EXPECT_FALSE(out_dot == out_wide) << kernel_label(dot_kernel)
                                      << " gave the widened kernel's output bit for bit: did it run?";
}

/// Where the CPU has a dot-product kernel for bf16 (VDPBF16PS, or BFDOT on ARM64), decoding runs
/// it, not the widened path: its weights are rounded to bf16, so its output differs from the
/// widened kernel's, and both stay within their tolerances of the float64 reference. MHA and
/// GQA, a partial last key block, keys past a length holding NaN, a masked key mid-block.
/// Head-major keys and values (HeadMajorRows, [B·H_kv·N_k, d]) in bf16 and fp16, through each
/// runnable kernel: the bits of the token-major call, and the float64 reference's values within
/// the kernel's tolerance. Prefill tiles (causal, GQA) and decoding (GQA and one row per KV head;
/// d = 64 takes the dot-product decoding kernels); sequence 0 sees N_k − 3 keys, the rest NaN.
template <class S>
void check_head_major() {
    struct Shape {
        Index Nq, Nk, H, Hkv, d;
    };
    const Index B = 2;
    unsigned seed = 70;
    for (const Shape& c : {Shape{37, 75, 4, 2, 32}, Shape{1, 300, 8, 4, 64}, Shape{1, 300, 4, 4, 64}}) {
        SCOPED_TRACE("N_q " + std::to_string(c.Nq) + ", " + std::to_string(c.H) + " on " + std::to_string(c.Hkv));
        const Mat q = rounded<S>(random_matrix(B * c.Nq, c.H * c.d, seed++));
        Mat key = rounded<S>(random_matrix(B * c.Nk, c.Hkv * c.d, seed++)),
            v = rounded<S>(random_matrix(B * c.Nk, c.Hkv * c.d, seed++));
        key.middleRows(c.Nk - 3, 3).setConstant(kNaN);
        v.middleRows(c.Nk - 3, 3).setConstant(kNaN);
        RefMasks rm;
        rm.key_lengths = {c.Nk - 3, c.Nk};
        rm.causal = true;
        const auto ref = gattn_test::sdpa_reference(q, key, v, B, c.H, c.Hkv, {}, rm);
        gattn::SdpaOptions<float> opt;
        opt.mask.key_lengths = rm.key_lengths;
        opt.mask.causal = true;
        const gattn::RowMatrix<S> qs = q.cast<S>(), ks = key.cast<S>(), vs = v.cast<S>();
        gattn::RowMatrix<S> k_hm(B * c.Hkv * c.Nk, c.d), v_hm(B * c.Hkv * c.Nk, c.d);
        for (Index b = 0; b < B; ++b)
            for (Index g = 0; g < c.Hkv; ++g) {
                k_hm.middleRows((b * c.Hkv + g) * c.Nk, c.Nk) = ks.block(b * c.Nk, g * c.d, c.Nk, c.d);
                v_hm.middleRows((b * c.Hkv + g) * c.Nk, c.Nk) = vs.block(b * c.Nk, g * c.d, c.Nk, c.d);
            }
        for (Bf16Kernel k : runnable_kernels()) {
            SCOPED_TRACE(gattn::kernel_name(k));
            KernelLimit limit(k);
            gattn::RowMatrix<float> out(B * c.Nq, c.H * c.d), out_hm(B * c.Nq, c.H * c.d), lse, lse_hm;
            gattn::SdpaOutputs<float> extra, extra_hm;
            extra.log_sum_exp = &lse;
            extra_hm.log_sum_exp = &lse_hm;
            gattn::scaled_dot_product_attention<S, float>(qs, ks, vs, {B, c.H, c.Hkv}, out, opt, extra);
            gattn::scaled_dot_product_attention<S, float>(qs, gattn::HeadMajorRows<S>(k_hm),
                                                          gattn::HeadMajorRows<S>(v_hm), {B, c.H, c.Hkv}, out_hm, opt,
                                                          extra_hm);
            const NarrowTol t = tolerance<S, float>(k);
            expect_close(out_hm, ref.out, t.atol, t.rtol, "HeadMajor/out", t.nmse);
            expect_close(lse_hm, ref.log_sum_exp, t.lse_atol, 1e-5, "HeadMajor/lse");
            EXPECT_TRUE(out_hm == out) << "head-major keys and values gave other bits";
            EXPECT_TRUE(lse_hm == lse) << "head-major keys and values gave another log-sum-exp";
        }
    }
}

TEST(NarrowSdpa, HeadMajorKeysAndValuesBf16) { check_head_major<bfloat16>(); }
TEST(NarrowSdpa, HeadMajorKeysAndValuesHalf) { check_head_major<half>(); }

TEST(NarrowSdpa, DecodingRunsTheDotProductKernel) {
    const Bf16Kernel best = gattn::bf16_kernel().kernel;
    if (best == Bf16Kernel::WidenedFloat)
        GTEST_SKIP() << "no bf16 dot-product kernel here: " << gattn::bf16_kernel().reason;
    const Bf16Kernel dot_kernel = best == Bf16Kernel::Bfdot ? Bf16Kernel::Bfdot : Bf16Kernel::Avx512Bf16;
    const Index B = 2, Nk = 203, d = 64;
    // Up to 2 (head, query) pairs per KV head: the decoding kernel on every tier (NEON runs
    // more pairs on tiles).
    for (auto [H, Hkv] : {std::pair<Index, Index>{8, 8}, {4, 2}}) {
        SCOPED_TRACE(std::to_string(H) + " heads on " + std::to_string(Hkv));
        Mat q = rounded<bfloat16>(random_matrix(B, H * d, 41)),
            key = rounded<bfloat16>(random_matrix(B * Nk, Hkv * d, 42)),
            v = rounded<bfloat16>(random_matrix(B * Nk, Hkv * d, 43));
        const std::vector<Index> lengths = {Nk - 6, Nk};
        for (Index j = lengths[0]; j < Nk; ++j) {
            key.row(j).setConstant(kNaN);
            v.row(j).setConstant(kNaN);
        }
        gattn::SdpaOptions<float> opt;
        opt.mask.key_lengths = lengths;
        // Key 101 of the second sequence hidden by a bias of −∞ ([B, H, 1, N_k]), its value row NaN.
        std::vector<double> bias(static_cast<std::size_t>(B * H * Nk), 0.0);
        for (Index h = 0; h < H; ++h) bias[static_cast<std::size_t>((H + h) * Nk + 101)] = -kInf;
        v.row(Nk + 101).setConstant(kNaN);
        const std::vector<float> bias_f(bias.begin(), bias.end());
        opt.mask.bias = {bias_f.data(), B, H, 1, Nk};
        RefMasks rm;
        rm.key_lengths = lengths;
        rm.bias = bias;
        const auto ref = gattn_test::sdpa_reference(q, key, v, B, H, Hkv, {}, rm);
        expect_dot_kernel_ran(dot_kernel, q, key, v, {B, H, Hkv}, opt, ref.out, "Decode");
    }
}

/// Where the CPU has a dot-product kernel for bf16 (VDPBF16PS, or BFDOT on ARM64), the prefill
/// tiles run it: its output differs from the widened kernel's and both stay within their
/// tolerances of the float64 reference. Causal GQA over three key blocks (the last partial),
/// an odd d_k (a last feature paired with 0, pairs past the last whole register), d_v ≠ d_k,
/// keys past a length holding NaN.
TEST(NarrowSdpa, PrefillRunsTheDotProductKernel) {
    const Bf16Kernel best = gattn::bf16_kernel().kernel;
    if (best == Bf16Kernel::WidenedFloat)
        GTEST_SKIP() << "no bf16 dot-product kernel here: " << gattn::bf16_kernel().reason;
    const Bf16Kernel dot_kernel = best == Bf16Kernel::Bfdot ? Bf16Kernel::Bfdot : Bf16Kernel::Avx512Bf16;
    const Index B = 2, N = 150, H = 4, Hkv = 2, dk = 37, dv = 40;
    Mat q = rounded<bfloat16>(random_matrix(B * N, H * dk, 51)),
        key = rounded<bfloat16>(random_matrix(B * N, Hkv * dk, 52)),
        v = rounded<bfloat16>(random_matrix(B * N, Hkv * dv, 53));
    const std::vector<Index> lengths = {N, N - 9};
    for (Index j = N + lengths[1]; j < 2 * N; ++j) {
        key.row(j).setConstant(kNaN);
        v.row(j).setConstant(kNaN);
    }
    gattn::SdpaOptions<float> opt;
    opt.mask.causal = true;
    opt.mask.key_lengths = lengths;
    RefMasks rm;
    rm.causal = true;
    rm.key_lengths = lengths;
    const auto ref = gattn_test::sdpa_reference(q, key, v, B, H, Hkv, {}, rm);
    expect_dot_kernel_ran(dot_kernel, q, key, v, {B, H, Hkv}, opt, ref.out, "Prefill");
}

/// Rows with no visible key give 0 and log-sum-exp −∞, never NaN, in every output type.
TEST(NarrowSdpa, FullyMaskedRowsAreZero) {
    const Index B = 2, N = 40, H = 2, d = 24;
    for (Bf16Kernel k : runnable_kernels()) {
        KernelLimit limit(k);
        const gattn::RowMatrix<bfloat16> q = random_matrix(B * N, H * d, 1).cast<bfloat16>(),
                                         key = random_matrix(B * N, H * d, 2).cast<bfloat16>(),
                                         v = random_matrix(B * N, H * d, 3).cast<bfloat16>();
        gattn::SdpaOptions<float> opt;
        opt.mask.key_lengths.push_back(0);
        opt.mask.key_lengths.push_back(N);
        gattn::RowMatrix<float> lse;
        gattn::SdpaOutputs<float> extra;
        extra.log_sum_exp = &lse;
        gattn::RowMatrix<bfloat16> out = gattn::RowMatrix<bfloat16>::Constant(B * N, H * d, bfloat16(5.0f));
        gattn::scaled_dot_product_attention<bfloat16>(q, key, v, {B, H, H}, out, opt, extra);
        for (Index r = 0; r < N; ++r)
            for (Index c = 0; c < H * d; ++c) ASSERT_EQ(static_cast<float>(out(r, c)), 0.0f) << kernel_label(k);
        EXPECT_TRUE((lse.topRows(N).array() == -std::numeric_limits<float>::infinity()).all());
        EXPECT_TRUE(out.bottomRows(N).template cast<float>().allFinite());
    }
}

/// Views with a row stride (column blocks of a fused QKV output) and an output block of a wider
/// matrix: same result as contiguous copies, columns around the output untouched.
TEST(NarrowSdpa, StridedViewsMatchContiguous) {
    const Index N = 75, H = 4, Hkv = 2, d = 36;
    const gattn::RowMatrix<bfloat16> qkv = random_matrix(N, (H + 2 * Hkv) * d, 11).cast<bfloat16>();
    const auto q = qkv.leftCols(H * d), key = qkv.middleCols(H * d, Hkv * d), v = qkv.rightCols(Hkv * d);
    gattn::SdpaOptions<float> opt;
    opt.mask.causal = true;
    for (Bf16Kernel k : runnable_kernels()) {
        KernelLimit limit(k);
        gattn::RowMatrix<bfloat16> wide = gattn::RowMatrix<bfloat16>::Constant(N, H * d + 8, bfloat16(3.0f));
        gattn::scaled_dot_product_attention<bfloat16>(q, key, v, {1, H, Hkv}, wide.middleCols(4, H * d), opt);
        const gattn::RowMatrix<bfloat16> qc = q, kc = key, vc = v;
        const gattn::RowMatrix<bfloat16> dense =
            gattn::scaled_dot_product_attention<bfloat16>(qc, kc, vc, {1, H, Hkv}, opt);
        EXPECT_TRUE(wide.middleCols(4, H * d) == dense) << kernel_label(k);
        EXPECT_TRUE((wide.leftCols(4).cast<float>().array() == 3.0f).all());
        EXPECT_TRUE((wide.rightCols(4).cast<float>().array() == 3.0f).all());
    }
}

/// Logits that jump up and down by several nats from one 64-key block to the next (the AMX
/// kernel rescales O in vectors, outside the tiles, only when a lane's max moves): every kernel
/// matches the float64 reference. Query all ones, key j all c_j, so the logit of key j is 8·c_j; d_k = 72
/// and d_v = 40 also exercise the tiles' feature tails.
TEST(NarrowSdpa, LogitJumpsBetweenKeyBlocks) {
    const Index N = 64 * 5 + 17, Nq = 70, dk = 72, dv = 40;
    // Nats: a jump of 10, equal, down, up by 1, a partial block.
    const double block_level[6] = {0.0, 10.0, 10.0, 4.0, 11.0, 2.0};
    Mat q = Mat::Constant(Nq, dk, 1.0), key(N, dk);
    for (Index j = 0; j < N; ++j) {
        const double u = 0.3 * static_cast<double>((j * 37) % 17);  // 0 to 4.8 nats within a block
        key.row(j).setConstant((block_level[j / 64] + u) / 8.0);
    }
    key = rounded<bfloat16>(key);
    const Mat v = rounded<bfloat16>(random_matrix(N, dv, 77));
    const double scale = 1.0 / 9.0;  // logits = sum over 72 features / 9 = 8 c_j
    const auto ref = gattn_test::sdpa_reference(q, key, v, 1, 1, 1, scale);
    gattn::SdpaOptions<float> opt;
    opt.scale = scale;
    const gattn::RowMatrix<bfloat16> qs = q.cast<bfloat16>(), ks = key.cast<bfloat16>(), vs = v.cast<bfloat16>();
    for (Bf16Kernel k : runnable_kernels()) {
        KernelLimit limit(k);
        gattn::RowMatrix<float> out(Nq, dv), lse;
        gattn::SdpaOutputs<float> extra;
        extra.log_sum_exp = &lse;
        gattn::scaled_dot_product_attention<bfloat16, float>(qs, ks, vs, {1, 1, 1}, out, opt, extra);
        expect_close(out, ref.out, 0x1p-7, 1e-5, std::string("LogitJumps/") + kernel_label(k), 2e-5);
        expect_close(lse, ref.log_sum_exp, 0x1p-6, 1e-4, std::string("LogitJumps/lse/") + kernel_label(k));
    }
}

/// Logits and biases near float's largest value: the 16-bit kernels take them as the float
/// kernel does (no log₂e folded into the scale or the bias, so that nothing in
/// (FLT_MAX/log₂e, FLT_MAX] overflows). Causal, 70 queries on 70 keys (two key
/// blocks), d = 32; key j all a·(1 + j/128) (exact in bf16), so that the logits rise with j and
/// query i puts its weight on key i. Cases:
///  - scale 3e38 on logits of 2⁻¹⁵: scaled logits up to 1.4e34, scale·log₂e past FLT_MAX;
///  - q·k up to 2.6e38 at scale 1;
///  - a bias of +3e38 on key (i·7) mod (i + 1) of row i, which then takes the weight;
///  - Hugging Face's padding, a bias of −FLT_MAX: every key of rows 60–69 (a uniform average
///    of their visible keys' values, as in float, not a fully masked row) and keys 40–69 of the
///    others.
/// All against the float64 reference, through every kernel.
TEST(NarrowSdpa, LogitsAndBiasesNearFloatsLargestValue) {
    const Index N = 70, d = 32;
    struct Case {
        const char* name;
        double q, k, scale;
        int bias;  // 0 none, 1 +3e38 on one key, 2 padding
    };
    const Case cases[] = {{"Scale3e38", 0x1p-10, 0x1p-10, 3e38, 0},
                          {"DotProduct2.6e38", 0x1p61, 0x1p61, 1.0, 0},
                          {"BiasPlus3e38", 0x1p-3, 0x1p-3, 1.0, 1},
                          {"PaddingBiasMinusFltMax", 0x1p-3, 0x1p-3, 1.0, 2}};
    for (const Case& c : cases) {
        Mat q = Mat::Constant(N, d, c.q), key(N, d);
        for (Index j = 0; j < N; ++j) key.row(j).setConstant(c.k * (1.0 + static_cast<double>(j) / 128.0));
        const Mat v = rounded<bfloat16>(random_matrix(N, d, 91));
        std::vector<float> bias;
        RefMasks ref_masks;
        ref_masks.causal = true;
        if (c.bias != 0) {
            bias.assign(static_cast<std::size_t>(N * N), 0.0f);
            for (Index i = 0; i < N; ++i)
                for (Index j = 0; j < N; ++j) {
                    float& b = bias[static_cast<std::size_t>(i * N + j)];
                    if (c.bias == 1 && j == (i * 7) % (i + 1)) b = 3e38f;
                    if (c.bias == 2 && (i >= 60 || j >= 40)) b = -std::numeric_limits<float>::max();
                }
            ref_masks.bias.assign(bias.begin(), bias.end());
        }
        const auto ref = gattn_test::sdpa_reference(q, key, v, 1, 1, 1, c.scale, ref_masks);
        if (c.bias == 2) {  // the reference's own padded rows: the mean of their visible values
            for (Index i = 60; i < N; ++i)
                ASSERT_NEAR(ref.out(i, 0), v.topRows(i + 1).col(0).mean(), 1e-12) << "reference";
        }
        gattn::SdpaOptions<float> opt;
        opt.scale = c.scale;
        opt.mask.causal = true;
        if (!bias.empty()) opt.mask.bias = {bias.data(), 1, 1, N, N};
        const gattn::RowMatrix<bfloat16> qs = q.cast<bfloat16>(), ks = key.cast<bfloat16>(), vs = v.cast<bfloat16>();
        for (Bf16Kernel k : runnable_kernels()) {
            KernelLimit limit(k);
            const std::string label = std::string("NearFltMax/") + c.name + "/" + kernel_label(k);
            gattn::RowMatrix<float> out(N, d), lse;
            gattn::SdpaOutputs<float> extra;
            extra.log_sum_exp = &lse;
            gattn::scaled_dot_product_attention<bfloat16, float>(qs, ks, vs, {1, 1, 1}, out, opt, extra);
            EXPECT_TRUE(out.allFinite()) << label;
            expect_close(out, ref.out, 0x1p-7, 1e-5, label, 2e-5);
            // Up to the largest logit (2.6e38), or −FLT_MAX + ln(i + 1) on padded rows.
            for (Index i = 0; i < N; ++i) {
                const double want = ref.log_sum_exp(i, 0);
                EXPECT_NEAR(lse(i, 0), want, 1e-5 * std::abs(want) + 0x1p-6) << label << " row " << i;
            }
        }
    }
}

/// The result is bitwise the same on 1, 2 and 3 threads (causal GQA prefill, several query
/// block groups per KV head).
TEST(NarrowSdpa, ThreadCountDoesNotChangeResults) {
#ifdef _OPENMP
    const Index B = 2, N = 300, H = 8, Hkv = 2, d = 64;
    const gattn::RowMatrix<bfloat16> q = random_matrix(B * N, H * d, 21).cast<bfloat16>(),
                                     key = random_matrix(B * N, Hkv * d, 22).cast<bfloat16>(),
                                     v = random_matrix(B * N, Hkv * d, 23).cast<bfloat16>();
    gattn::SdpaOptions<float> opt;
    opt.mask.causal = true;
    const int saved = omp_get_max_threads();
    for (Bf16Kernel k : runnable_kernels()) {
        KernelLimit limit(k);
        std::vector<gattn::RowMatrix<float>> outs;
        for (int threads : {1, 2, 3}) {
            omp_set_num_threads(threads);
            gattn::RowMatrix<float> out(B * N, H * d);
            gattn::scaled_dot_product_attention<bfloat16, float>(q, key, v, {B, H, Hkv}, out, opt);
            outs.push_back(out);
        }
        EXPECT_TRUE(outs[0] == outs[1] && outs[0] == outs[2]) << kernel_label(k);
    }
    omp_set_num_threads(saved);
#else
    GTEST_SKIP() << "built without OpenMP";
#endif
}

/// The same with value rows that hold NaN where a bias of −∞ hides their keys, just past where
/// a query block's keys end inside a key block: whether its step goes key by key must depend on
/// its own keys, not on the keys of the query blocks grouped with it (which the thread count
/// sets). Bottom-right causal over 16 or 21 more keys than queries (an even and an odd count of
/// keys in each query block's last key block; with 21 the NaN key pairs with the block's last).
TEST(NarrowSdpa, ThreadCountDoesNotChangeResultsWithHiddenNaNValues) {
#ifdef _OPENMP
    const Index B = 1, Nq = 512, H = 2, Hkv = 1, d = 40;
    const int saved = omp_get_max_threads();
    for (Index Nk : {Nq + 16, Nq + 21}) {
        Mat q = rounded<bfloat16>(random_matrix(Nq, H * d, 61)),
            key = rounded<bfloat16>(random_matrix(Nk, Hkv * d, 62)),
            v = rounded<bfloat16>(random_matrix(Nk, Hkv * d, 63));
        std::vector<float> bias(static_cast<std::size_t>(Nk), 0.0f);
        for (Index j = 64 + Nk - Nq; j < Nk; j += 64) {
            bias[static_cast<std::size_t>(j)] = -std::numeric_limits<float>::infinity();
            v.row(j).setConstant(kNaN);
        }
        gattn::SdpaOptions<float> opt;
        opt.mask.causal = true;
        opt.mask.bias = {bias.data(), 1, 1, 1, Nk};
        RefMasks rm;
        rm.causal = true;
        for (Index r = 0; r < B * H * Nq; ++r) rm.bias.insert(rm.bias.end(), bias.begin(), bias.end());  // dense
        const auto ref = gattn_test::sdpa_reference(q, key, v, B, H, Hkv, {}, rm);
        const gattn::RowMatrix<bfloat16> qs = q.cast<bfloat16>(), ks = key.cast<bfloat16>(), vs = v.cast<bfloat16>();
        for (Bf16Kernel k : runnable_kernels()) {
            KernelLimit limit(k);
            const NarrowTol t = tolerance<bfloat16, float>(k);
            std::vector<gattn::RowMatrix<float>> outs;
            for (int threads : {1, 2, 3}) {
                omp_set_num_threads(threads);
                gattn::RowMatrix<float> out(Nq, H * d);
                gattn::scaled_dot_product_attention<bfloat16, float>(qs, ks, vs, {B, H, Hkv}, out, opt);
                expect_close(out, ref.out, t.atol, t.rtol,
                             std::string("HiddenNaN/") + kernel_label(k) + "/Nk" + std::to_string(Nk), t.nmse);
                outs.push_back(out);
            }
            EXPECT_TRUE(outs[0] == outs[1] && outs[0] == outs[2]) << kernel_label(k) << " Nk " << Nk;
        }
    }
    omp_set_num_threads(saved);
#else
    GTEST_SKIP() << "built without OpenMP";
#endif
}

/// Bad shapes are refused with the argument named, before anything is written.
TEST(NarrowSdpa, BadShapesThrowAndLeaveOutputUntouched) {
    const gattn::RowMatrix<bfloat16> q = gattn::RowMatrix<bfloat16>::Zero(10, 16),
                                     key = gattn::RowMatrix<bfloat16>::Zero(10, 12);
    gattn::RowMatrix<bfloat16> out = gattn::RowMatrix<bfloat16>::Constant(10, 16, bfloat16(2.0f));
    try {
        gattn::scaled_dot_product_attention<bfloat16>(q, key, key, {1, 2, 1}, out);
        ADD_FAILURE() << "no exception";
    } catch (const gattn::shape_error& e) {
        EXPECT_NE(std::string(e.what()).find("key"), std::string::npos) << e.what();
    }
    EXPECT_TRUE((out.cast<float>().array() == 2.0f).all());
}

/// The kernel report follows the CPU, the build and the limit. ARM64: BFDOT runs where the CPU
/// has BF16; elsewhere the report says why not.
TEST(NarrowSdpa, KernelReportExplainsTheChoice) {
    const gattn::CpuFeatures& f = gattn::cpu_features();
#if defined(__aarch64__)
    const gattn::KernelChoice arm = gattn::bf16_kernel();
    EXPECT_EQ(gattn::detail::bf16_kernel_family(), arm.kernel);  // what SDPA dispatches on
    if (f.bf16) {
        EXPECT_EQ(arm.kernel, Bf16Kernel::Bfdot);
        EXPECT_EQ(arm.reason, "");
        EXPECT_EQ(gattn::describe(arm), "BFDOT");
    } else {
        EXPECT_EQ(arm.kernel, Bf16Kernel::WidenedFloat);
        EXPECT_EQ(arm.reason, "BF16 (BFDOT): this CPU has none");
    }
    KernelLimit limit(Bf16Kernel::WidenedFloat);
    const gattn::KernelChoice widened = gattn::bf16_kernel();
    EXPECT_EQ(widened.kernel, Bf16Kernel::WidenedFloat);
    EXPECT_EQ(gattn::detail::bf16_kernel_family(), Bf16Kernel::WidenedFloat);
    EXPECT_EQ(widened.reason, "BF16 (BFDOT): excluded by set_bf16_kernel_limit");
#else
    const gattn::KernelChoice best = gattn::bf16_kernel();
    if (f.amx_bf16 && gattn::compiled_with_amx() && gattn::detail::amx_tile_permission()) {
        EXPECT_EQ(best.kernel, Bf16Kernel::Amx) << best.reason;
        EXPECT_EQ(best.reason, "");
    } else if (f.avx512bf16 && gattn::compiled_with_avx512bf16()) {
        EXPECT_EQ(best.kernel, Bf16Kernel::Avx512Bf16) << best.reason;
    } else {
        EXPECT_EQ(best.kernel, Bf16Kernel::WidenedFloat) << best.reason;
    }
    EXPECT_EQ(gattn::detail::bf16_kernel_family(), best.kernel);  // what SDPA dispatches on
    if (!f.amx_bf16) {
        EXPECT_NE(best.reason.find("AMX: this CPU has no AMX-BF16"), std::string::npos) << best.reason;
    } else if (!gattn::compiled_with_amx()) {
        EXPECT_NE(best.reason.find("AMX: not compiled with the flags"), std::string::npos) << best.reason;
    }
    if (!f.avx512bf16) {
        EXPECT_NE(best.reason.find("AVX512-BF16: this CPU has none"), std::string::npos) << best.reason;
    }
    {
        KernelLimit no_amx(Bf16Kernel::Avx512Bf16);
        const gattn::KernelChoice c = gattn::bf16_kernel();
        EXPECT_NE(c.kernel, Bf16Kernel::Amx);
        EXPECT_NE(c.reason.find("AMX: excluded by set_bf16_kernel_limit"), std::string::npos) << c.reason;
        EXPECT_EQ(gattn::detail::bf16_kernel_family(), c.kernel);
    }
    KernelLimit limit(Bf16Kernel::WidenedFloat);
    const gattn::KernelChoice widened = gattn::bf16_kernel();
    EXPECT_EQ(widened.kernel, Bf16Kernel::WidenedFloat);
    EXPECT_EQ(gattn::detail::bf16_kernel_family(), Bf16Kernel::WidenedFloat);
    EXPECT_NE(widened.reason.find("AVX512-BF16: excluded by set_bf16_kernel_limit"), std::string::npos)
        << widened.reason;
    EXPECT_EQ(gattn::describe(widened).rfind("widened float (", 0), 0u) << gattn::describe(widened);
#endif
}

}  // namespace
