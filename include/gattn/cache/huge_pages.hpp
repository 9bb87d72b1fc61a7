// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Transparent huge pages for the KV caches' storage. Decoding reads every K and V row of a
/// cache once per token. In a [N, H_kv·d] layout a row of 8 KV heads at d = 128 (float) fills
/// one 4 KiB page, so every row costs a TLB miss and a page walk, and the hardware
/// prefetchers, which stop at a page's end, start again on every row; one 2 MiB page serves
/// 512 such rows. KVCache and PagedKVPool advise their K and V storage when they allocate it.
/// Measured (BM_DecodeFromCache in bench_sdpa: one token, 8 query heads, d = 128, one thread,
/// AMD Zen 4): a KVCache 1.10–1.28× faster than plain matrices of the same rows in small pages,
/// at 8k and 32k keys on 2 and 8 KV heads.
///
/// The cost is memory that is touched in whole huge pages: a sequence of a KVCache holds at
/// most one partly used huge page of keys and one of values more than it would in small pages.
/// Linux's /sys/kernel/mm/transparent_hugepage/enabled decides: "always" or "madvise" take the
/// advice, "never" refuses it (then every function here advises nothing).

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

#include "gattn/config.hpp"

#if defined(__linux__)
#include <sys/mman.h>
#endif

GATTN_BEGIN_ISA_NAMESPACE

namespace detail {
/// The huge page size that the kernel's transparent huge pages use (hpage_pmd_size; 2 MiB on
/// x86-64), or 0 where they are unavailable or turned off ("[never]").
inline std::size_t transparent_huge_page_bytes() noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    static const std::size_t bytes = []() -> std::size_t {
        try {
            std::ifstream enabled("/sys/kernel/mm/transparent_hugepage/enabled");
            std::string mode;
            if (!std::getline(enabled, mode) || mode.find("[never]") != std::string::npos) return 0;
            std::ifstream size("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
            std::size_t b = 0;
            if (!(size >> b) || b == 0 || (b & (b - 1)) != 0) return 0;
            return b;
        } catch (...) {
            return 0;
        }
    }();
    return bytes;
#else
    return 0;
#endif
}
}  // namespace detail

/// Asks the operating system to back the whole huge pages inside [data, data + bytes) with
/// transparent huge pages (Linux: madvise(MADV_HUGEPAGE)). Call it before the memory is first
/// written: a page written before keeps its small pages until the kernel merges them. The
/// memory's contents and its use are unchanged; only its page size is.
/// \return the bytes advised, from the first huge-page boundary in the range to the last: 0
///         elsewhere than Linux, when transparent huge pages are turned off, when the range
///         holds no whole huge page, or when the kernel refuses.
/// Never throws.
inline std::size_t advise_huge_pages(void* data, std::size_t bytes) noexcept {
    const std::size_t page = detail::transparent_huge_page_bytes();
    if (page == 0 || data == nullptr) return 0;
    const auto begin = reinterpret_cast<std::uintptr_t>(data);
    const std::uintptr_t first = (begin + page - 1) / page * page, last = (begin + bytes) / page * page;
    if (last <= first) return 0;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE) != 0) return 0;
    return last - first;
#else
    return 0;
#endif
}

namespace detail {
/// advise_huge_pages over the storage of a matrix m (m.data(), m.size() elements), before it is
/// written: what the caches call on their keys and values.
template <class Matrix>
inline std::size_t advise_storage(Matrix& m) noexcept {
    return advise_huge_pages(m.data(), sizeof(*m.data()) * static_cast<std::size_t>(m.size()));
}
}  // namespace detail

GATTN_END_ISA_NAMESPACE
