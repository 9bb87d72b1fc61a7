// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The portable tier: what runs where no wider tier is compiled in (SSE2 and the other x86
/// builds without AVX2 + FMA, ARM64's NEON, other CPUs), through xsimd's code for the
/// translation unit's instruction set. It holds no intrinsics, only the tile shapes for 16
/// registers of 128 bits, which the tiers that do not set their own take.

#include "gattn/config.hpp"

GATTN_BEGIN_ISA_NAMESPACE
namespace simd {
namespace portable {

/// Tile geometry of the float flash kernel (kernel::FlashGeometry) on 16 registers.
struct FlashTiles {
    static constexpr int kCols = 2;
    static constexpr int kRows = 6;  // 6 × 2 = 12 accumulators of 16 registers
    static constexpr int kMaskedRows = kRows;
};

/// Decoding (kernel::decode_chunk): query rows that share each K and V register load, and the
/// value sum's accumulator registers.
struct DecodeTiles {
    static constexpr int kRows = 2, kValueRegisters = 8;
};

}  // namespace portable
}  // namespace simd
GATTN_END_ISA_NAMESPACE
