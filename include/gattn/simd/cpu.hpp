// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What the CPU and the operating system offer at run time, and which kernel an SDPA call on
/// bf16 inputs, or decoding against an int8 cache, runs (and why no faster one): gattn never
/// falls back silently.
///
/// Kernels for 16-bit inputs, fastest first:
///  - Amx: the AMX tile unit (TDPBF16PS) for the matrix products, AVX512-BF16 around them;
///    needs a translation unit built with AMX-TILE, AMX-BF16 and AVX512-BF16 (e.g.
///    -march=native or -march=sapphirerapids), a CPU that has them, and Linux's permission to
///    use the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, asked once per process, on first use).
///  - Avx512Bf16: VDPBF16PS products of bf16 pairs into float accumulators
///    (ops/bf16_flash_kernel.hpp); needs a translation unit built with AVX512-BF16
///    (e.g. -march=native on Zen 4/5, Cooper Lake, Sapphire Rapids) and a CPU that has it.
///  - Bfdot (ARM64): BFDOT products of bf16 pairs into float lanes (simd/arm_neon_bf16.hpp),
///    for the prefill tiles, decoding and PackedLinear. Compiled in every ARM64 build (a target
///    attribute, the build stays ARMv8-A); needs a CPU with the BF16 instructions (HWCAP2 bf16).
///  - WidenedFloat: inputs widened to float block by block inside the float kernel.
///
/// Kernels for decoding against an int8 KV cache (int8_kernel()), fastest first:
///  - Vnni: both products as exact integer sums (VPDPWSSD) of the codes and 16-bit codes of
///    the query and the weights; needs a unit built with AVX512-VNNI (and BW).
///  - AvxVnni: the same integer products with the VEX-encoded VPDPWSSD on 256-bit registers
///    (AVX-VNNI: Intel Alder Lake and later client CPUs, AMD Zen 5); needs a unit built with
///    AVX-VNNI, AVX2 and FMA (-march=native on such a CPU, -march=alderlake, or -mavx2 -mfma
///    -mavxvnni) and a CPU that reports AVX-VNNI (CPUID).
///  - Sdot (ARM64): the logits as exact integer sums (SDOT) of the key codes and the query's
///    16-bit codes split into two bytes; the value sum widens the codes to float. Compiled in
///    every ARM64 build (a target attribute, the build stays ARMv8-A); needs a CPU with the
///    dot-product instructions (HWCAP asimddp).
///  - WidenedFloat: the codes widened to float FMAs.
///
/// ARM64 (AArch64): features come from Linux's HWCAP words (getauxval), the SVE vector length
/// from prctl(PR_SVE_GET_VL). The float kernels use NEON (128-bit) on every ARM64 CPU: xsimd
/// 8.1 has no SVE, so a CPU with wider SVE vectors still runs NEON, and instruction_sets() says
/// so. bf16 decoding runs BFDOT where the CPU has it, and bf16 prefill widens to float in NEON
/// registers (bf16_kernel() says so); int8 decoding runs SDOT where the CPU has it
/// (int8_kernel()).

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#if defined(__GNUC__) || defined(__clang__)
#include <cpuid.h>
#define GATTN_HAS_CPUID 1
#endif
#endif

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#include <sys/prctl.h>
#define GATTN_HAS_AUXV 1
#endif

#include "gattn/config.hpp"

namespace gattn {

/// Kernel families for bf16 SDPA, fastest first.
enum class Bf16Kernel {
    Amx,           ///< AMX tiles (TDPBF16PS)
    Avx512Bf16,    ///< AVX512-BF16 (VDPBF16PS)
    Bfdot,         ///< ARM64 BF16 (BFDOT)
    WidenedFloat,  ///< bf16 widened to float inside the float kernel
};

/// Kernel families for decoding against an int8 KV cache, fastest first.
enum class Int8Kernel {
    Vnni,          ///< AVX512-VNNI (VPDPWSSD) for both products
    AvxVnni,       ///< AVX-VNNI (VEX VPDPWSSD on 256-bit registers) for both products
    Sdot,          ///< ARM64 dot product (SDOT) for the logits
    WidenedFloat,  ///< codes widened to float FMAs
};

/// The kernel of family Kernel (Bf16Kernel, Int8Kernel) a call will run and, when it is not
/// the fastest, why.
template <class Kernel>
struct BasicKernelChoice {
    Kernel kernel = Kernel::WidenedFloat;
    /// One line per faster kernel that is not used, e.g. "AMX: this CPU has no AMX-BF16";
    /// empty when the fastest family runs.
    std::string reason;
};
/// The bf16 SDPA kernel a call will run (bf16_kernel()).
using KernelChoice = BasicKernelChoice<Bf16Kernel>;
/// The int8-cache decoding kernel a call will run (int8_kernel()).
using Int8KernelChoice = BasicKernelChoice<Int8Kernel>;

}  // namespace gattn

GATTN_BEGIN_ISA_NAMESPACE

/// CPU features that gattn's kernels dispatch on, read once: on x86 with CPUID and XGETBV, on
/// ARM64 Linux from the HWCAP words (getauxval; names as in /proc/cpuinfo). The other
/// architecture's fields stay false.
struct CpuFeatures {
    bool avx2_fma = false;    ///< AVX2 and FMA, and the OS saves the ymm state
    bool avx512f = false;     ///< AVX-512 Foundation, and the OS saves the zmm state
    bool avx512bf16 = false;  ///< AVX512-BF16 (VDPBF16PS), with the zmm state saved
    bool avx512vnni = false;  ///< AVX512-VNNI (VPDPWSSD), with the zmm state saved
    bool avxvnni = false;     ///< AVX-VNNI (VEX VPDPWSSD on ymm), with AVX2 and FMA and the ymm state saved
    bool amx_bf16 = false;    ///< AMX-TILE and AMX-BF16 (CPUID), and the OS enables the tile state (XCR0)
    bool asimd = false;       ///< ARM64 Advanced SIMD, NEON (HWCAP_ASIMD)
    bool asimddp = false;     ///< ARM64 dot products of int8 quadruples, SDOT/UDOT (HWCAP_ASIMDDP)
    bool sve = false;         ///< ARM64 SVE (HWCAP_SVE)
    bool sve2 = false;        ///< ARM64 SVE2 (HWCAP2_SVE2)
    bool bf16 = false;        ///< ARM64 BF16: BFDOT, BFMMLA, BFCVT (HWCAP2_BF16)
    bool i8mm = false;        ///< ARM64 int8 matrix multiply, SMMLA (HWCAP2_I8MM)
    int sve_bits = 0;         ///< ARM64 SVE vector length of this thread in bits, 0 without SVE
};

namespace detail {

inline CpuFeatures read_cpu_features() noexcept {
    CpuFeatures f;
#if defined(GATTN_HAS_CPUID)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_max(0, nullptr) < 7) return f;
    __cpuid(1, a, b, c, d);
    const bool osxsave = (c >> 27) & 1u;
    unsigned long long xcr0 = 0;
    if (osxsave) {
        unsigned lo = 0, hi = 0;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        xcr0 = (static_cast<unsigned long long>(hi) << 32) | lo;
    }
    const bool os_ymm = (xcr0 & 0x6) == 0x6;    // SSE, AVX
    const bool os_zmm = (xcr0 & 0xE6) == 0xE6;  // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
    const bool fma = (c >> 12) & 1u;
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2_fma = os_ymm && fma && ((b >> 5) & 1u);
    f.avx512f = os_zmm && ((b >> 16) & 1u);
    f.avx512vnni = f.avx512f && ((c >> 11) & 1u);
    const bool amx_tile = (d >> 24) & 1u, amx_bf16 = (d >> 22) & 1u;
    const bool os_tiles = ((xcr0 >> 17) & 3u) == 3u;  // XTILECFG, XTILEDATA
    f.amx_bf16 = amx_tile && amx_bf16 && os_tiles;
    __cpuid_count(7, 1, a, b, c, d);
    f.avx512bf16 = f.avx512f && ((a >> 5) & 1u);
    f.avxvnni = f.avx2_fma && ((a >> 4) & 1u);
#elif defined(GATTN_HAS_AUXV)
    // Bits of Linux's arch/arm64/include/uapi/asm/hwcap.h (stable ABI).
    const unsigned long hwcap = getauxval(AT_HWCAP), hwcap2 = getauxval(AT_HWCAP2);
    f.asimd = (hwcap >> 1) & 1u;
    f.asimddp = (hwcap >> 20) & 1u;
    f.sve = (hwcap >> 22) & 1u;
    f.sve2 = (hwcap2 >> 1) & 1u;
    f.i8mm = (hwcap2 >> 13) & 1u;
    f.bf16 = (hwcap2 >> 14) & 1u;
    if (f.sve) {
        constexpr int kSveGetVl = 51, kSveVlLenMask = 0xffff;  // PR_SVE_GET_VL, PR_SVE_VL_LEN_MASK
        const int vl = prctl(kSveGetVl, 0, 0, 0, 0);
        if (vl > 0) f.sve_bits = (vl & kSveVlLenMask) * 8;
    }
#endif
    return f;
}

/// The kernel family bf16 SDPA is limited to (set_bf16_kernel_limit); atomic-free: set it
/// before calls, not during them.
inline Bf16Kernel& bf16_kernel_limit() noexcept {
    static Bf16Kernel limit = Bf16Kernel::Amx;
    return limit;
}

/// The kernel family int8-cache decoding is limited to (set_int8_kernel_limit).
inline Int8Kernel& int8_kernel_limit() noexcept {
    static Int8Kernel limit = Int8Kernel::Vnni;
    return limit;
}

/// Whether float decoding may run the ARM64 SVE kernel (set_sve_kernels).
inline bool& sve_kernels_allowed() noexcept {
    static bool allowed = true;
    return allowed;
}

}  // namespace detail

/// The CPU's features (read once).
inline const CpuFeatures& cpu_features() noexcept {
    static const CpuFeatures f = detail::read_cpu_features();
    return f;
}

/// Limits bf16 SDPA (each call) and PackedLinear (at its construction) to `slowest_allowed` or
/// slower families: Avx512Bf16 keeps AMX out, Bfdot keeps both out (on ARM64 every limit but
/// WidenedFloat allows BFDOT), WidenedFloat runs the float kernels on widened inputs. For
/// comparisons and tests; set it before calls, from one thread (it is not
/// synchronised). Default: Amx (no limit).
inline void set_bf16_kernel_limit(Bf16Kernel slowest_allowed) noexcept {
    detail::bf16_kernel_limit() = slowest_allowed;
}

/// Limits decoding against an int8 KV cache to `slowest_allowed` or slower families, as
/// set_bf16_kernel_limit does for bf16 (AvxVnni keeps AVX512-VNNI out, WidenedFloat both).
/// Default: Vnni (no limit).
inline void set_int8_kernel_limit(Int8Kernel slowest_allowed) noexcept {
    detail::int8_kernel_limit() = slowest_allowed;
}

/// Lets float decoding on ARM64 run the SVE kernel where the CPU's SVE vectors are wider than
/// NEON's (true, the default), or keeps it on NEON (false). For comparisons and tests; set it
/// before calls, from one thread (it is not synchronised). No effect elsewhere.
inline void set_sve_kernels(bool allowed) noexcept { detail::sve_kernels_allowed() = allowed; }

/// Whether this translation unit contains the AVX512-BF16 kernel (built with -march=native on a
/// CPU that has it, -march=znver4/sapphirerapids/cooperlake, or -march=x86-64-v4 -mavx512bf16).
inline constexpr bool compiled_with_avx512bf16() noexcept {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    return true;
#else
    return false;
#endif
}

/// Whether this translation unit contains the AMX kernels (AMX-TILE, AMX-BF16 and the
/// AVX512-BF16 kernel: -march=native on a CPU with AMX, or -march=sapphirerapids).
inline constexpr bool compiled_with_amx() noexcept {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    return compiled_with_avx512bf16();
#else
    return false;
#endif
}

namespace detail {
/// Whether this unit compiles ARM64 kernels above the ARMv8-A baseline (SDOT, BFDOT): every
/// ARM64 build with GCC or Clang, through target attributes; they run where the CPU has them.
#if defined(__aarch64__) && defined(__ARM_NEON) && (defined(__GNUC__) || defined(__clang__))
inline constexpr bool kArmTargetKernels = true;
#else
inline constexpr bool kArmTargetKernels = false;
#endif
}  // namespace detail

/// Whether this translation unit contains the ARM64 BFDOT bf16 kernels (every ARM64
/// build with GCC or Clang: it is compiled with a target attribute and chosen at run time).
inline constexpr bool compiled_with_bfdot() noexcept { return detail::kArmTargetKernels; }

/// Whether this translation unit contains the ARM64 SVE float decoding kernel (every ARM64
/// build with GCC, through a target attribute; with Clang, builds that enable SVE: Clang 14's
/// arm_sve.h needs it). The condition of simd/arm_sve.hpp's kEnabled.
inline constexpr bool compiled_with_sve() noexcept {
#if defined(__aarch64__) && ((defined(__GNUC__) && !defined(__clang__)) || defined(__ARM_FEATURE_SVE))
    return true;
#else
    return false;
#endif
}

namespace detail {
/// Why float decoding does not run the SVE kernel here (empty when it does).
inline const char* sve_refusal() noexcept {
    const CpuFeatures& f = cpu_features();
    if (!f.sve) return "this CPU has no SVE";
    if (f.sve_bits <= 128) return "SVE vectors of 128 bits give nothing over NEON";
    if (!sve_kernels_allowed()) return "SVE kernel excluded by set_sve_kernels(false)";
    if (!compiled_with_sve()) return "no SVE kernel compiled in (needs GCC, or Clang with SVE enabled)";
    return "";
}

/// Whether float decoding runs the SVE kernel (decode_sve) here.
inline bool sve_float_decoding() noexcept { return *sve_refusal() == '\0'; }
}  // namespace detail

namespace detail {
/// Asks Linux once per process for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA; Linux 5.16 and later); true when granted. Other systems: false.
inline bool amx_tile_permission() noexcept {
    static const bool granted = [] {
#if defined(__linux__) && defined(SYS_arch_prctl)
        constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
        return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
#else
        return false;
#endif
    }();
    return granted;
}

/// Why the AMX kernels do not run here (empty when they do).
inline const char* amx_refusal() noexcept {
    if (bf16_kernel_limit() != Bf16Kernel::Amx) return "excluded by set_bf16_kernel_limit";
    if (!cpu_features().amx_bf16) return "this CPU has no AMX-BF16 (or the OS does not enable its tiles)";
    if (!compiled_with_amx()) return "not compiled with the flags (build with -march=native, or -march=sapphirerapids)";
    if (!amx_tile_permission()) return "Linux refused the tile permission (arch_prctl ARCH_REQ_XCOMP_PERM)";
    return "";
}

/// bf16_kernel().kernel without the reasons (no allocation): what an SDPA call dispatches on.
inline Bf16Kernel bf16_kernel_family() noexcept {
    const Bf16Kernel limit = bf16_kernel_limit();
    if (*amx_refusal() == '\0') return Bf16Kernel::Amx;
    if ((limit == Bf16Kernel::Amx || limit == Bf16Kernel::Avx512Bf16) && cpu_features().avx512bf16 &&
        compiled_with_avx512bf16())
        return Bf16Kernel::Avx512Bf16;
    if (limit != Bf16Kernel::WidenedFloat && cpu_features().bf16 && compiled_with_bfdot()) return Bf16Kernel::Bfdot;
    return Bf16Kernel::WidenedFloat;
}
}  // namespace detail

/// The kernel family an SDPA call on bf16 query, key and value runs here, and why no faster
/// one (CPU lacks it, this unit was not compiled with the flags, the limit set by
/// set_bf16_kernel_limit, Linux refused the AMX tile permission). fp16 inputs always run
/// WidenedFloat. May be called from several threads (set_bf16_kernel_limit may not). The first
/// call on a CPU with AMX asks Linux for the tile permission. ARM64: Bfdot where the CPU has
/// the BF16 instructions (an empty reason), else WidenedFloat and the reason says why.
inline KernelChoice bf16_kernel() {
    KernelChoice choice;
#if defined(__aarch64__)
    choice.kernel = detail::bf16_kernel_family();
    if (choice.kernel == Bf16Kernel::Bfdot) return choice;
    if (detail::bf16_kernel_limit() == Bf16Kernel::WidenedFloat)
        choice.reason = "BF16 (BFDOT): excluded by set_bf16_kernel_limit";
    else if (!cpu_features().bf16)
        choice.reason = "BF16 (BFDOT): this CPU has none";
    else
        choice.reason = "BF16 (BFDOT): not compiled in (needs GCC or Clang)";
    return choice;
#else
    const CpuFeatures& f = cpu_features();
    const Bf16Kernel limit = detail::bf16_kernel_limit();
    std::string why;
    auto add = [&](const std::string& line) { why += (why.empty() ? "" : "; ") + line; };
    const std::string amx = detail::amx_refusal();
    if (amx.empty()) {
        choice.kernel = Bf16Kernel::Amx;
        return choice;
    }
    add("AMX: " + amx);
    if (limit == Bf16Kernel::WidenedFloat || limit == Bf16Kernel::Bfdot) {
        add("AVX512-BF16: excluded by set_bf16_kernel_limit");
    } else if (!f.avx512bf16) {
        add("AVX512-BF16: this CPU has none");
    } else if (!compiled_with_avx512bf16()) {
        add("AVX512-BF16: not compiled with the flags (build with -march=native, or -march=x86-64-v4 -mavx512bf16)");
    } else {
        choice.kernel = Bf16Kernel::Avx512Bf16;
    }
    choice.reason = why;
    return choice;
#endif
}

/// Whether this translation unit contains the AVX512-VNNI int8 decoding kernel.
inline constexpr bool compiled_with_vnni() noexcept {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return true;
#else
    return false;
#endif
}

/// Whether this translation unit contains the AVX-VNNI int8 decoding kernel (AVX-VNNI, AVX2
/// and FMA: -march=native on a CPU that has it, -march=alderlake, -mavx2 -mfma -mavxvnni).
inline constexpr bool compiled_with_avxvnni() noexcept {
#if defined(__AVXVNNI__) && defined(__AVX2__) && defined(__FMA__)
    return true;
#else
    return false;
#endif
}

/// Whether this translation unit contains the ARM64 SDOT int8 decoding kernel (every ARM64
/// build with GCC or Clang: it is compiled with a target attribute and chosen at run time).
inline constexpr bool compiled_with_sdot() noexcept { return detail::kArmTargetKernels; }

namespace detail {
/// int8_kernel().kernel without the reasons (no allocation): what a decoding call dispatches on.
inline Int8Kernel int8_kernel_family() noexcept {
    const Int8Kernel limit = int8_kernel_limit();
    if (limit == Int8Kernel::Vnni && compiled_with_vnni() && cpu_features().avx512vnni) return Int8Kernel::Vnni;
    if (limit != Int8Kernel::WidenedFloat && compiled_with_avxvnni() && cpu_features().avxvnni)
        return Int8Kernel::AvxVnni;
    if (limit != Int8Kernel::WidenedFloat && compiled_with_sdot() && cpu_features().asimddp) return Int8Kernel::Sdot;
    return Int8Kernel::WidenedFloat;
}
}  // namespace detail

/// The kernel family that decoding against an int8 KV cache (few queries per KV head) runs
/// here, and why no faster one (one reason per faster family, joined by "; "). Head sizes
/// choose too: the VNNI logits (both families) need d_k a multiple of 32 and their value sum
/// d_v a multiple of 64; other sizes widen to float. Prefill (many
/// queries) always widens the codes to float. May be called from several threads
/// (set_int8_kernel_limit may not). Throws only std::bad_alloc (for the reason's text). ARM64:
/// Sdot where the CPU has the dot-product instructions (its logits need d_k a multiple of 16;
/// the value sum always widens), else WidenedFloat and the reason says why.
inline Int8KernelChoice int8_kernel() {
    Int8KernelChoice choice;
    choice.kernel = detail::int8_kernel_family();
#if defined(__aarch64__)
    if (choice.kernel == Int8Kernel::Sdot) return choice;
    if (detail::int8_kernel_limit() == Int8Kernel::WidenedFloat)
        choice.reason = "dot product (SDOT): excluded by set_int8_kernel_limit";
    else if (!cpu_features().asimddp)
        choice.reason = "dot product (SDOT): this CPU has none";
    else
        choice.reason = "dot product (SDOT): not compiled in (needs GCC or Clang)";
#else
    if (choice.kernel == Int8Kernel::Vnni) return choice;
    // The same order as bf16_kernel(): the limit, the CPU, then the build.
    const Int8Kernel limit = detail::int8_kernel_limit();
    if (limit != Int8Kernel::Vnni)
        choice.reason = "AVX512-VNNI: excluded by set_int8_kernel_limit";
    else if (!cpu_features().avx512vnni)
        choice.reason = "AVX512-VNNI: this CPU has none";
    else
        choice.reason = "AVX512-VNNI: not compiled with the flags (build with -march=native)";
    if (choice.kernel == Int8Kernel::AvxVnni) return choice;
    if (limit == Int8Kernel::WidenedFloat)
        choice.reason += "; AVX-VNNI: excluded by set_int8_kernel_limit";
    else if (!cpu_features().avxvnni)
        choice.reason += "; AVX-VNNI: this CPU has none";
    else
        choice.reason +=
            "; AVX-VNNI: not compiled with the flags (build with -march=native, or -mavx2 -mfma -mavxvnni)";
#endif
    return choice;
}

/// "AMX", "AVX512-BF16", "BFDOT" or "widened float".
inline const char* kernel_name(Bf16Kernel k) noexcept {
    switch (k) {
        case Bf16Kernel::Amx: return "AMX";
        case Bf16Kernel::Avx512Bf16: return "AVX512-BF16";
        case Bf16Kernel::Bfdot: return "BFDOT";
        default: return "widened float";
    }
}

/// "AVX512-VNNI", "AVX-VNNI", "SDOT" or "widened float".
inline const char* kernel_name(Int8Kernel k) noexcept {
    switch (k) {
        case Int8Kernel::Vnni: return "AVX512-VNNI";
        case Int8Kernel::AvxVnni: return "AVX-VNNI";
        case Int8Kernel::Sdot: return "SDOT";
        default: return "widened float";
    }
}

/// One line for logs and benchmark context: "<kernel> (<reasons>)".
template <class Kernel>
std::string describe(const BasicKernelChoice<Kernel>& c) {
    return std::string(kernel_name(c.kernel)) + (c.reason.empty() ? "" : " (" + c.reason + ")");
}

/// The vector instruction set gattn's kernels were compiled for in this translation unit and
/// the widest one the CPU offers, as the kernel families see them ("SSE2", "AVX2+FMA",
/// "AVX2+FMA+AVX-VNNI", "AVX-512"; on ARM64 "NEON", and the CPU's "NEON", "SVE (256-bit)", "SVE2 (512-bit)", …).
/// A build without -march runs the SSE2 kernels everywhere: on an AVX-512 machine
/// (AMD Zen 4) the G1-gated layer (D = 2048, N = 1024, one thread) took 2.4–2.6× as long as
/// with -march=native.
struct InstructionSets {
    const char* compiled = "SSE2";  ///< what this translation unit's kernels use
    const char* cpu = "SSE2";       ///< the widest family the CPU and OS offer
    /// The CPU's vectors are at least twice as wide as the build's: expect 2× or more from a
    /// build with -march=native.
    bool slow_build = false;
    /// Why wider vectors the CPU has go unused whatever the build flags, empty when none do
    /// (ARM64 with SVE vectors over 128 bits: only float decoding runs SVE, the rest NEON; or
    /// why not even that).
    const char* unused = "";
};

namespace detail {
/// "SVE (256-bit)", "SVE2 (512-bit)", … for the CPU's SVE vector length; built once.
inline const char* sve_name(const CpuFeatures& f) noexcept {
    static const char* name = [&f] {
        static char text[32];
        std::snprintf(text, sizeof text, "%s (%d-bit)", f.sve2 ? "SVE2" : "SVE", f.sve_bits);
        return text;
    }();
    return name;
}
}  // namespace detail

/// What this unit was compiled for and what the CPU offers (CPUID, or HWCAP on ARM64 Linux;
/// read once).
inline InstructionSets instruction_sets() noexcept {
    InstructionSets s;
#if defined(__aarch64__)
    // xsimd 8.1 has NEON only: every build runs the same 128-bit tiles; float decoding runs
    // SVE where its vectors are wider (arm_sve.hpp).
    s.compiled = compiled_with_sve() ? "NEON, SVE (float decoding)" : "NEON";
    const CpuFeatures& f = cpu_features();
    s.cpu = f.sve ? detail::sve_name(f) : "NEON";
    if (f.sve_bits > 128)
        s.unused = detail::sve_float_decoding()
                       ? "float decoding runs SVE; prefill tiles, projections and narrow caches run NEON"
                       : detail::sve_refusal();
    return s;
#else
#if defined(__AVX512F__)
    constexpr int compiled_bits = 512;
    s.compiled = "AVX-512";
#elif defined(__AVX2__) && defined(__FMA__)
    constexpr int compiled_bits = 256;
    s.compiled = compiled_with_avxvnni() ? "AVX2+FMA+AVX-VNNI" : "AVX2+FMA";
#else
    constexpr int compiled_bits = 128;
#endif
    const CpuFeatures& f = cpu_features();
    const int cpu_bits = f.avx512f ? 512 : f.avx2_fma ? 256 : 128;
    s.cpu = f.avx512f ? "AVX-512" : f.avxvnni ? "AVX2+FMA+AVX-VNNI" : f.avx2_fma ? "AVX2+FMA" : "SSE2";
    s.slow_build = cpu_bits >= 2 * compiled_bits;
    return s;
#endif
}

/// One line for logs: "compiled for AVX2+FMA, CPU has AVX-512", plus advice when slow_build,
/// or why the CPU's wider vectors go unused.
inline std::string describe(const InstructionSets& s) {
    std::string line = std::string("compiled for ") + s.compiled + ", CPU has " + s.cpu;
    if (s.slow_build) line += " (build with -march=native for 2x or more)";
    if (*s.unused) line += std::string(" (") + s.unused + ")";
    return line;
}

namespace detail {
inline bool& instruction_set_warning_enabled() noexcept {
    static bool enabled = true;
    return enabled;
}

/// Prints describe(instruction_sets()) to stderr once per process (per instruction set gattn
/// was compiled for) when the build is slow for this CPU, unless turned off by
/// set_instruction_set_warning(false) or the environment variable GATTN_NO_ISA_WARNING.
inline void warn_once_if_slow_build() noexcept {
    static const bool done = [] {
        const InstructionSets s = instruction_sets();
        if (s.slow_build && instruction_set_warning_enabled() && !std::getenv("GATTN_NO_ISA_WARNING"))
            std::fprintf(stderr, "gattn: %s; set GATTN_NO_ISA_WARNING=1 to silence\n", describe(s).c_str());
        return true;
    }();
    (void)done;
}
}  // namespace detail

/// Turns the one-time warning about a slow build off (false) or on; call it before the first
/// layer is constructed. The environment variable GATTN_NO_ISA_WARNING also turns it off.
inline void set_instruction_set_warning(bool enabled) noexcept { detail::instruction_set_warning_enabled() = enabled; }

GATTN_END_ISA_NAMESPACE
