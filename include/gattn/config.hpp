// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Build configuration: C++17 check, assertions and the instruction-set namespace.
///
/// Every function gattn defines lives in an inline namespace named after the instruction set the
/// translation unit is compiled for (e.g. `gattn::isa_avx2_fma`, or for AVX-512
/// `gattn::isa_avx512f_bw_dq_vl_vnni_bf16_amx`, one suffix per extension that gattn's code
/// tests; code still writes `gattn::scaled_dot_product_attention`). Two translation units built with different -m flags
/// therefore get different symbols and the linker cannot mix an AVX-512 body into an SSE2 caller
/// (the ODR problem seen in numpy#25274). Only exception types, enums and plain option structs
/// stay in `gattn` itself, so that `catch (const gattn::shape_error&)` works across such units.
/// Eigen's own functions are shared by all units: a program that mixes -m flags needs one
/// EIGEN_MAX_ALIGN_BYTES in all of them, which these headers do not set (the gattn::gattn CMake
/// target carries it only when configured with GATTN_EIGEN_MAX_ALIGN_BYTES; docs/conventions.md,
/// "Instruction sets"). Eigen objects must not cross units built with different flags.

#if __cplusplus < 201703L && !(defined(_MSVC_LANG) && _MSVC_LANG >= 201703L)
#error "gattn requires C++17"
#endif

#include <cassert>

// The namespace's name: the base instruction set, then (AVX-512) one suffix for each extension
// that gattn's code tests, so that units differing in any of them get separate symbols.
#define GATTN_ISA_CAT_(a, b) a##b
#define GATTN_ISA_CAT(a, b) GATTN_ISA_CAT_(a, b)
#if defined(__AVX512F__)
#if defined(__AVX512BW__)
#define GATTN_ISA_BW_ _bw
#else
#define GATTN_ISA_BW_
#endif
#if defined(__AVX512DQ__)
#define GATTN_ISA_DQ_ _dq
#else
#define GATTN_ISA_DQ_
#endif
#if defined(__AVX512VL__)
#define GATTN_ISA_VL_ _vl
#else
#define GATTN_ISA_VL_
#endif
#if defined(__AVX512VNNI__)
#define GATTN_ISA_VNNI_ _vnni  // the int8 decoding kernel (VPDPWSSD)
#else
#define GATTN_ISA_VNNI_
#endif
#if defined(__AVX512BF16__)
#define GATTN_ISA_BF16_ _bf16  // the AVX512-BF16 kernels
#else
#define GATTN_ISA_BF16_
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define GATTN_ISA_AMX_ _amx  // the AMX kernels
#else
#define GATTN_ISA_AMX_
#endif
#define GATTN_ISA_AVX512_ \
    GATTN_ISA_CAT(GATTN_ISA_CAT(GATTN_ISA_CAT(isa_avx512f, GATTN_ISA_BW_), GATTN_ISA_DQ_), GATTN_ISA_VL_)
#define GATTN_ISA_NAMESPACE \
    GATTN_ISA_CAT(GATTN_ISA_CAT(GATTN_ISA_CAT(GATTN_ISA_AVX512_, GATTN_ISA_VNNI_), GATTN_ISA_BF16_), GATTN_ISA_AMX_)
#elif defined(__AVX2__) && defined(__FMA__)
#define GATTN_ISA_NAMESPACE isa_avx2_fma
#elif defined(__AVX2__)
#define GATTN_ISA_NAMESPACE isa_avx2
#elif defined(__AVX__)
#define GATTN_ISA_NAMESPACE isa_avx
#elif defined(__SSE4_2__)
#define GATTN_ISA_NAMESPACE isa_sse4_2
#elif defined(__SSE2__) || defined(_M_X64)
#define GATTN_ISA_NAMESPACE isa_sse2
#elif defined(__ARM_NEON) || defined(__ARM_NEON__)
#define GATTN_ISA_NAMESPACE isa_neon
#else
#define GATTN_ISA_NAMESPACE isa_scalar
#endif

/// Opens `namespace gattn { inline namespace isa_<name> {`.
#define GATTN_BEGIN_ISA_NAMESPACE \
    namespace gattn {             \
    inline namespace GATTN_ISA_NAMESPACE {
/// Closes what GATTN_BEGIN_ISA_NAMESPACE opened.
#define GATTN_END_ISA_NAMESPACE \
    }                           \
    }

/// On a function that a kernel's hot loop calls (a prefetcher's step inside a product's k-loop):
/// inlined whatever its size, since a call there makes the compiler keep the loop's tile of
/// accumulators on the stack (vector registers do not survive a call). An attribute: a
/// function outside a class still says `inline`.
#if defined(__GNUC__) || defined(__clang__)
#define GATTN_ALWAYS_INLINE __attribute__((always_inline))
#else
#define GATTN_ALWAYS_INLINE
#endif

/// Around code that passes Eigen's packet types (vector registers) as template arguments:
/// g++ warns that their attributes are dropped, which is harmless while the packets stay
/// inside the function.
#if defined(__GNUC__) && !defined(__clang__)
#define GATTN_EIGEN_PACKETS_BEGIN \
    _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wignored-attributes\"")
#define GATTN_EIGEN_PACKETS_END _Pragma("GCC diagnostic pop")
#else
#define GATTN_EIGEN_PACKETS_BEGIN
#define GATTN_EIGEN_PACKETS_END
#endif

/// Internal consistency check inside kernels (input is validated at the public boundary);
/// compiled out under NDEBUG. Users may define it before including gattn.
#ifndef GATTN_DEBUG_ASSERT
#define GATTN_DEBUG_ASSERT(cond) assert(cond)
#endif

/// Before a loop whose trip count is a compile-time constant, over an array of vector
/// registers (a kernel's tile of accumulators) or a few scalars: unrolls it completely, so that
/// the array lives in registers. GCC at -O2 unrolls only loops whose copies do not grow the
/// code, which left such arrays on the stack, a load and a store around every multiply-add:
/// float prefill ran at a quarter of its -O3 speed, decoding at 0.6 (AMD Zen 5, one thread).
/// Define GATTN_NO_UNROLL to leave the loops to the compiler (faster builds, e.g. under
/// sanitizers, where speed does not matter; the results are the same).
#if defined(GATTN_NO_UNROLL)
#define GATTN_UNROLL
#elif defined(__clang__)
#define GATTN_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define GATTN_UNROLL _Pragma("GCC unroll 64")
#else
#define GATTN_UNROLL
#endif
