// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The page table of a batch of sequences in a paged KV pool (cache/paged_kv_pool.hpp), in the
/// layout of vLLM's block tables and FlashInfer's paged caches: for sequence b, its pages are
/// indices[indptr[b] .. indptr[b + 1]) in token order, every page full except the last, which
/// holds last_page_len[b] tokens. Token t of sequence b sits in page indices[indptr[b] + t / P],
/// slot t mod P (P: the pool's page size).

#include <string>
#include <vector>

#include "gattn/config.hpp"
#include "gattn/types.hpp"

namespace gattn {

/// Pages of a batch of sequences (see the file comment). A table made by
/// PagedKVPool::page_table is valid for that pool until the pool changes; one made by hand is
/// checked by the functions that take it (PagedKVPool::check_table).
struct PageTable {
    /// B + 1 offsets into indices, indptr[0] = 0, non-decreasing.
    std::vector<Index> indptr{0};
    /// The pages of every sequence, one after another.
    std::vector<Index> indices;
    /// B entries: the tokens in each sequence's last page, in [1, P] (0 for a sequence with no
    /// pages).
    std::vector<Index> last_page_len;

    /// Sequences (B).
    Index batch() const noexcept { return static_cast<Index>(last_page_len.size()); }
    /// Pages of sequence b. Requires b < batch() and a consistent indptr.
    Index pages(Index b) const noexcept { return indptr[b + 1] - indptr[b]; }
    /// Tokens of sequence b with pages of page_size tokens: (pages − 1)·P + last_page_len[b],
    /// 0 without pages. Requires b < batch() and a consistent indptr.
    Index length(Index b, Index page_size) const noexcept {
        const Index n = pages(b);
        return n == 0 ? 0 : (n - 1) * page_size + last_page_len[b];
    }
};

}  // namespace gattn
