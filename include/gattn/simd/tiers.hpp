// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The instruction-set tiers behind one interface. Each tier is one header of this folder that
/// holds its intrinsics code (micro-kernels, widening loads) and its per-tier constants (tile
/// shapes), with a `kEnabled` flag that says whether the translation unit is compiled for it;
/// where it is not, its kernels are declared only. The kernel drivers (ops/: tiling, masks,
/// online softmax, threads) include this header alone and choose with `if constexpr` on the
/// flags, so they carry no instruction-set `#if`.
///
/// | tier | header | what it holds |
/// |---|---|---|
/// | portable (SSE2, NEON arithmetic, scalar) | portable.hpp | tile shapes for 16 × 128-bit registers, SSE2 streaming stores |
/// | x86 AVX2 + FMA | x86_avx2.hpp | tile shapes for 16 × 256-bit registers, int8/bf16/fp16 widening |
/// | x86 AVX-512 | x86_avx512.hpp | tile shapes for 32 × 512-bit registers, int8/bf16/fp16 widening, FMAs, exp/sigmoid steps |
/// | x86 AVX512-BF16 | x86_avx512bf16.hpp | VDPBF16PS kernels: bf16 prefill and decoding |
/// | x86 AVX512-VNNI | x86_avx512vnni.hpp | VPDPWSSD kernels: int8 decoding |
/// | x86 AVX-VNNI | x86_avxvnni.hpp | VEX VPDPWSSD kernels on ymm: int8 decoding on AVX2 machines |
/// | x86 AMX | x86_amx.hpp | TDPBF16PS tile code: bf16 prefill |
/// | ARM64 NEON | arm_neon.hpp | bf16/fp16/int8 widening, division, bit casts, shifts |
/// | ARM64 dot product (run-time, HWCAP asimddp) | arm_neon_dotprod.hpp | SDOT kernel: int8 decoding logits |
/// | ARM64 BF16 (run-time, HWCAP2 bf16) | arm_neon_bf16.hpp | BFDOT kernels: bf16 prefill, decoding and PackedLinear |
/// | ARM64 SVE (run-time, HWCAP sve, vectors over 128 bits) | arm_sve.hpp | float decoding in the CPU's vector length |
///
/// Adding a tier: a header with its namespace simd::TIER (kEnabled, its kernels, and
/// declarations of them for builds without it), one include here, and where it sets a shape, its
/// place in the selection below. Which tier runs at run time within what the build allows is
/// simd/cpu.hpp's (instruction_sets(), bf16_kernel(), int8_kernel()).

#include <cstdint>
#include <type_traits>

#include "gattn/simd/arm_neon.hpp"
#include "gattn/simd/arm_neon_bf16.hpp"
#include "gattn/simd/arm_neon_dotprod.hpp"
#include "gattn/simd/arm_sve.hpp"
#include "gattn/simd/portable.hpp"
#include "gattn/simd/x86_amx.hpp"
#include "gattn/simd/x86_avx2.hpp"
#include "gattn/simd/x86_avx512.hpp"
#include "gattn/simd/x86_avx512bf16.hpp"
#include "gattn/simd/x86_avx512vnni.hpp"
#include "gattn/simd/x86_avxvnni.hpp"

GATTN_BEGIN_ISA_NAMESPACE
#if !defined(GATTN_HAS_AVX512BF16_KERNEL) && !defined(GATTN_HAS_BFDOT_KERNEL)
// The bf16 dot-product micro-kernels (AVX512-BF16 or BFDOT: the prefill tiles' and
// PackedLinear's), declared only where no tier compiled them, for the drivers' `if constexpr`
// branches that never instantiate them.
namespace kernel {
namespace bf16 {
template <class Block>
void pack_query_pairs(const Block& blk, Index dk, std::uint32_t* qp) noexcept;
bool pack_value_pairs(const bfloat16* value, Index value_stride, Index nk, Index dv, std::uint32_t* vt) noexcept;
template <int R, bool Masked, class Transform>
void scores_tile(const bfloat16* key, Index key_stride, const std::uint32_t* qp, Index dk, Index p_begin, float* st,
                 Index j0, const float* lane_begin, const float* lane_end, B* bmax, float c, const bfloat16* next_key,
                 const Transform* tf) noexcept;
template <int R>
void values_tile(const std::uint32_t* vt, const std::uint32_t* pt, Index pairs, const B* alpha, float* ot) noexcept;
B pack_weight_pair(const B& pa, const B& pb, std::uint32_t* dst, const B& lsum) noexcept;
}  // namespace bf16
}  // namespace kernel
namespace detail {
template <class X>
void linear_pack_x(const X* x, Index n, std::uint32_t* dst) noexcept;
template <int R>
void linear_tile(const std::uint32_t* x_pairs, Index pairs, const std::uint32_t* panel, const float* bias, float* out,
                 Index out_stride, Index n) noexcept;
}  // namespace detail
#endif

namespace simd {

/// Tile shape of the float flash kernel: the widest tier compiled in that sets one.
using FlashTiles =
    std::conditional_t<avx512::kEnabled, avx512::FlashTiles,
                       std::conditional_t<avx2::kEnabled && avx2::kFma, avx2::FlashTiles, portable::FlashTiles>>;

/// Rows and registers of the decoding kernel: the widest tier compiled in that sets them.
using DecodeTiles = std::conditional_t<avx512::kEnabled, avx512::DecodeTiles, portable::DecodeTiles>;

}  // namespace simd
GATTN_END_ISA_NAMESPACE
