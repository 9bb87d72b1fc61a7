// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// A paged key/value pool (vLLM's PagedAttention, FlashInfer's paged KV cache): the keys and
/// values of one attention layer for many sequences of unknown length, in pages of P tokens.
///
/// A page holds P tokens of all the layer's KV heads: page p's token slot r is row p·P + r of
/// one [num_pages·P, H_kv·d_k] key matrix and one [num_pages·P, H_kv·d_v] value matrix, in the
/// row formats of KVCache (float, double, bf16, fp16; int8 codes with one float scale per
/// (row, KV head), ops/int8_rows.hpp). A sequence is its list of pages plus its length; every
/// page but the last is full. A sliding-window layer's sequence releases the pages at its front
/// that its window no longer sees (release_outside_window), so that it holds about (w + n) / P
/// + 1 pages after a step of n tokens, however long it runs, as KVCache's window caches keep 2w
/// rows. Pages are reference counted: fork() makes a sequence that shares its parent's pages,
/// and a page shared by more than one sequence is never written: appending to a sequence whose
/// partial last page is shared first copies that page (copy on write). A page whose count drops to 0 returns to the
/// free list and is reused (last freed, first reused). SDPA reads the pages in place
/// (ops/paged_sdpa.hpp), with bitwise the result of a KVCache holding the same tokens.
///
/// Every function that changes the pool validates everything first: on an exception the pool
/// is unchanged (its pages, counts, free list, sequences and stored rows).
///
/// The keys' and values' storage is advised into transparent huge pages where the system uses
/// them (cache/huge_pages.hpp; huge_page_bytes() says how much was).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gattn/cache/huge_pages.hpp"
#include "gattn/cache/page_table.hpp"
#include "gattn/errors.hpp"
#include "gattn/ops/int8_rows.hpp"
#include "gattn/ops/sdpa.hpp"
#include "gattn/types.hpp"

GATTN_BEGIN_ISA_NAMESPACE

/// Identifies a sequence of a PagedKVPool (ids of freed sequences are reused).
using SequenceId = Index;

namespace detail {

/// Checks a ragged batch's row offsets (FlashInfer's qo_indptr): B + 1 entries from 0,
/// non-decreasing, ending at rows (rows_name names that count in the message).
/// \throws shape_error for a size other than B + 1; std::invalid_argument otherwise.
inline void check_qo_indptr(const char* fn, const std::vector<Index>& qo_indptr, Index B, Index rows,
                            const char* rows_name) {
    if (static_cast<Index>(qo_indptr.size()) != B + 1)
        throw_shape(fn, "qo_indptr", shape_string({B + 1}), shape_string({static_cast<Index>(qo_indptr.size())}));
    if (qo_indptr.front() != 0 || qo_indptr.back() != rows)
        throw_invalid(fn, "qo_indptr",
                      std::string("must run from 0 to ") + rows_name + " = " + std::to_string(rows) + ", got " +
                          std::to_string(qo_indptr.front()) + " ... " + std::to_string(qo_indptr.back()));
    for (std::size_t b = 0; b + 1 < qo_indptr.size(); ++b)
        if (qo_indptr[b + 1] < qo_indptr[b])
            throw_invalid(fn, "qo_indptr[" + std::to_string(b + 1) + "]",
                          "must be >= qo_indptr[" + std::to_string(b) + "] = " + std::to_string(qo_indptr[b]) +
                              ", got " + std::to_string(qo_indptr[b + 1]) + " < " + std::to_string(qo_indptr[b]));
}

/// Checks a page table's layout for pages of page_size tokens, whatever the pool: page_size
/// >= 1; indptr has batch() + 1 entries, runs from 0 to indices.size() and does not decrease (so
/// every sequence's pages lie inside indices); last_page_len[b] is in [1, page_size] for a
/// sequence with pages and 0 for one without.
/// \throws shape_error when indptr has not batch() + 1 entries; std::invalid_argument otherwise.
inline void check_table_layout(const char* fn, const PageTable& table, Index page_size) {
    if (page_size < 1) throw_invalid(fn, "page_size", "must be >= 1, got " + std::to_string(page_size));
    const Index B = table.batch();
    if (static_cast<Index>(table.indptr.size()) != B + 1)
        throw_shape(fn, "table.indptr", shape_string({B + 1}), shape_string({static_cast<Index>(table.indptr.size())}));
    if (table.indptr[0] != 0 || table.indptr[static_cast<std::size_t>(B)] != Index(table.indices.size()))
        throw_invalid(fn, "table.indptr",
                      "must run from 0 to indices.size() = " + std::to_string(table.indices.size()) + ", got " +
                          std::to_string(table.indptr[0]) + " to " +
                          std::to_string(table.indptr[static_cast<std::size_t>(B)]));
    for (std::size_t b = 0; b < static_cast<std::size_t>(B); ++b)
        if (table.indptr[b + 1] < table.indptr[b])
            throw_invalid(fn, "table.indptr",
                          "must not decrease: the sequence at table position " + std::to_string(b) + " has " +
                              std::to_string(table.indptr[b + 1] - table.indptr[b]) + " pages");
    for (std::size_t b = 0; b < static_cast<std::size_t>(B); ++b) {
        const Index last = table.last_page_len[b];
        const bool paged = table.indptr[b + 1] > table.indptr[b];
        if (paged ? (last < 1 || last > page_size) : last != 0)
            throw_invalid(fn, "table.last_page_len[" + std::to_string(b) + "]",
                          "must be " +
                              (paged ? "in [1, " + std::to_string(page_size) + "]"
                                     : "0 (the sequence at table position " + std::to_string(b) + " has no pages)") +
                              ", got " + std::to_string(last));
    }
}

/// Whether view shares an element with the pool's storage (keys, values, int8 scales).
template <class View, class Pool>
bool holds_pool_storage(const View& view, const Pool& pool) noexcept {
    return views_overlap(view, pool.keys()) || views_overlap(view, pool.values()) ||
           views_overlap(view, pool.key_scales()) || views_overlap(view, pool.value_scales());
}

/// A layer step over a pool: checks qo_indptr against x's rows and returns each row's
/// position, after its sequence's tokens in the pool (RoPE).
/// \throws as check_qo_indptr, and std::invalid_argument for an id not in the pool or given
///         twice (PagedKVPool::check_sequences).
template <class Pool>
std::vector<Index> paged_step_positions(const char* fn, Index rows, const std::vector<Index>& qo_indptr,
                                        const Pool& pool, const std::vector<Index>& seqs) {
    const auto B = static_cast<Index>(seqs.size());
    check_qo_indptr(fn, qo_indptr, B, rows, "x.rows()");
    pool.check_sequences(fn, seqs);  // every id, also those without rows in this step
    std::vector<Index> positions;
    positions.reserve(static_cast<std::size_t>(rows));
    for (std::size_t b = 0; b < seqs.size(); ++b) {
        const Index r0 = qo_indptr[b], r1 = qo_indptr[b + 1];
        const Index seen = r1 > r0 ? pool.length(seqs[b]) : 0;
        for (Index r = r0; r < r1; ++r) positions.push_back(seen + r - r0);
    }
    return positions;
}

}  // namespace detail

/// The pages of `num_pages`·P tokens of one attention layer's keys and values, shared by the
/// sequences it holds (see the file comment). Scalar: float, double, gattn::bfloat16,
/// gattn::half, or std::int8_t (int8 codes and scales of float keys and values).
template <class Scalar>
class PagedKVPool {
    static_assert(is_supported_storage_v<Scalar> || std::is_same_v<Scalar, std::int8_t>,
                  "GATTN_POOL_STORES_FLOAT_DOUBLE_BFLOAT16_HALF_OR_INT8");
    static constexpr bool kInt8 = std::is_same_v<Scalar, std::int8_t>;

public:
    /// What append takes: float for an int8 pool, else Scalar.
    using Input = std::conditional_t<kInt8, float, Scalar>;

    /// Smallest page size, in tokens.
    static constexpr Index kMinPageSize = 16;
    /// Largest page size, in tokens.
    static constexpr Index kMaxPageSize = 256;
    /// A page size is a multiple of this, so that the decoding kernel's key blocks (16 keys at
    /// most) never straddle two pages.
    static constexpr Index kPageAlign = 16;

    /// An empty pool of num_pages pages of page_size tokens, all free.
    /// \param num_pages      pages (≥ 1).
    /// \param page_size      tokens per page, P: a multiple of 16 in [16, 256].
    /// \param num_kv_heads   key/value heads (H_kv).
    /// \param head_dim       features per key head (d_k).
    /// \param value_head_dim features per value head (d_v); 0 = head_dim.
    /// \throws std::invalid_argument for a size < 1 (value_head_dim < 0), a page size outside
    ///         the above, or sizes whose products overflow Index; std::bad_alloc when the
    ///         storage cannot be allocated.
    PagedKVPool(Index num_pages, Index page_size, Index num_kv_heads, Index head_dim, Index value_head_dim = 0)
        : m_page_size(validated(num_pages, page_size, num_kv_heads, head_dim, value_head_dim)),
          m_num_kv_heads(num_kv_heads),
          m_head_dim(head_dim),
          m_value_head_dim(value_head_dim > 0 ? value_head_dim : head_dim),
          m_refs(static_cast<std::size_t>(num_pages), 0),
          m_generation(static_cast<std::size_t>(num_pages), 0),
          m_written(static_cast<std::size_t>(num_pages), 0) {
        m_keys.resize(num_pages * page_size, num_kv_heads * head_dim);
        m_values.resize(num_pages * page_size, num_kv_heads * m_value_head_dim);
        m_huge_page_bytes = detail::advise_storage(m_keys) + detail::advise_storage(m_values);
        if constexpr (kInt8) {
            m_key_scales.resize(num_pages * page_size, num_kv_heads);
            m_value_scales.resize(num_pages * page_size, num_kv_heads);
        }
        m_free.reserve(static_cast<std::size_t>(num_pages));
        for (Index p = num_pages; p-- > 0;) m_free.push_back(p);  // page 0 is taken first
    }

    /// Pages in the pool.
    Index num_pages() const noexcept { return static_cast<Index>(m_refs.size()); }
    /// Tokens per page (P).
    Index page_size() const noexcept { return m_page_size; }
    /// Pages no sequence holds.
    Index free_pages() const noexcept { return static_cast<Index>(m_free.size()); }
    /// Key/value heads (H_kv).
    Index num_kv_heads() const noexcept { return m_num_kv_heads; }
    /// Features per key head (d_k).
    Index head_dim() const noexcept { return m_head_dim; }
    /// Features per value head (d_v).
    Index value_head_dim() const noexcept { return m_value_head_dim; }
    /// Bytes of the keys' and values' storage advised into transparent huge pages
    /// (cache/huge_pages.hpp): 0 where the system does not use them.
    std::size_t huge_page_bytes() const noexcept { return m_huge_page_bytes; }
    /// Bytes of the pool's storage (keys, values and an int8 pool's scales).
    Index storage_bytes() const noexcept {
        return (m_keys.size() + m_values.size()) * Index(sizeof(Scalar)) +
               (m_key_scales.size() + m_value_scales.size()) * Index(sizeof(float));
    }
    /// Bytes a page takes (P rows of keys, values and an int8 pool's scales).
    Index page_bytes() const noexcept { return storage_bytes() / num_pages(); }
    /// Sequences that can be given to the other functions right now.
    Index num_sequences() const noexcept {
        return static_cast<Index>(std::count(m_alive.begin(), m_alive.end(), true));
    }
    /// Sequences holding page p (0: free). \throws std::invalid_argument for p outside
    /// [0, num_pages()).
    Index ref_count(Index page) const {
        check_page("gattn::PagedKVPool::ref_count", "page", page);
        return m_refs[static_cast<std::size_t>(page)];
    }

    /// Keys [num_pages·P, H_kv·d_k]: page p's slot r is row p·P + r (rows past a page's tokens
    /// hold anything).
    const RowMatrix<Scalar>& keys() const noexcept { return m_keys; }
    /// Values [num_pages·P, H_kv·d_v], rows as keys().
    const RowMatrix<Scalar>& values() const noexcept { return m_values; }
    /// int8 pool: [num_pages·P, H_kv], each key row's scale per KV head (empty otherwise).
    const RowMatrix<float>& key_scales() const noexcept { return m_key_scales; }
    /// int8 pool: [num_pages·P, H_kv], the value rows' scales (empty otherwise).
    const RowMatrix<float>& value_scales() const noexcept { return m_value_scales; }

    /// A new sequence with no tokens (it holds no page until something is appended).
    /// \returns its id (the lowest id not in use).
    SequenceId allocate() {
        const auto it = std::find(m_alive.begin(), m_alive.end(), false);
        const auto id = static_cast<SequenceId>(it - m_alive.begin());
        if (it == m_alive.end()) {
            m_sequences.emplace_back();
            m_alive.push_back(true);
        } else {
            m_sequences[static_cast<std::size_t>(id)] = Sequence{};
            *it = true;
        }
        m_sequences[static_cast<std::size_t>(id)].epoch = ++m_epochs;
        return id;
    }

    /// A new sequence holding the same tokens as `parent` by sharing its pages (each page's
    /// count goes up by one; nothing is copied until one of them appends into a shared partial
    /// page). \returns the new id. \throws std::invalid_argument when parent is not a sequence
    /// of the pool.
    SequenceId fork(SequenceId parent) {
        check_sequence("gattn::PagedKVPool::fork", "parent", parent);
        Sequence copy = m_sequences[static_cast<std::size_t>(parent)];  // may throw: nothing changed yet
        const SequenceId id = allocate();
        for (Index p : copy.pages) ++m_refs[static_cast<std::size_t>(p)];
        copy.epoch = ++m_epochs;
        m_sequences[static_cast<std::size_t>(id)] = std::move(copy);
        return id;
    }

    /// Releases a sequence: each of its pages' counts goes down by one (a page no one holds is
    /// free again), and the id may be reused by allocate or fork.
    /// \throws std::invalid_argument when seq is not a sequence of the pool.
    void free(SequenceId seq) {
        check_sequence("gattn::PagedKVPool::free", "seq", seq);
        Sequence& s = m_sequences[static_cast<std::size_t>(seq)];
        m_free.reserve(m_free.size() + s.pages.size());  // may throw: nothing changed yet
        release(s.pages, 0);
        s = Sequence{};
        m_alive[static_cast<std::size_t>(seq)] = false;
    }

    /// Tokens of sequence seq (every token appended, including any released from its front).
    /// \throws std::invalid_argument when seq is not a sequence of the pool.
    Index length(SequenceId seq) const {
        check_sequence("gattn::PagedKVPool::length", "seq", seq);
        return m_sequences[static_cast<std::size_t>(seq)].length;
    }
    /// Tokens released from the front of sequence seq (release_outside_window; 0 otherwise): its
    /// pages hold tokens [first_position(seq), length(seq)), and token t of its page table is
    /// token first_position(seq) + t of the sequence.
    /// \throws std::invalid_argument when seq is not a sequence of the pool.
    Index first_position(SequenceId seq) const {
        check_sequence("gattn::PagedKVPool::first_position", "seq", seq);
        return m_sequences[static_cast<std::size_t>(seq)].first;
    }
    /// The shortest length truncate(seq, ·) accepts: 0, or once tokens of seq were released,
    /// first_position(seq) + w − 1 for the window w of its last release_outside_window call, so
    /// that the window of the token appended next still finds all its keys stored (as a window
    /// KVCache keeps at least w − 1 tokens); never more than length(seq).
    /// \throws std::invalid_argument when seq is not a sequence of the pool.
    Index min_truncate_length(SequenceId seq) const {
        check_sequence("gattn::PagedKVPool::min_truncate_length", "seq", seq);
        const Sequence& s = m_sequences[static_cast<std::size_t>(seq)];
        // first + min(w − 1, length − first): min(first + w − 1, length) for any window up to
        // the Index maximum, without overflow.
        return s.first > 0 ? s.first + std::min(s.window - 1, s.length - s.first) : 0;
    }
    /// The pages of sequence seq, in token order. \throws std::invalid_argument when seq is not a
    /// sequence of the pool.
    const std::vector<Index>& pages(SequenceId seq) const {
        check_sequence("gattn::PagedKVPool::pages", "seq", seq);
        return m_sequences[static_cast<std::size_t>(seq)].pages;
    }

    /// The page table of the sequences seqs, in that order (a sequence may appear more than
    /// once). \throws std::invalid_argument when an id is not a sequence of the pool.
    PageTable page_table(const std::vector<SequenceId>& seqs) const {
        PageTable t;
        t.indptr.reserve(seqs.size() + 1);
        t.last_page_len.reserve(seqs.size());
        for (std::size_t b = 0; b < seqs.size(); ++b) {
            check_sequence("gattn::PagedKVPool::page_table", "seqs[" + std::to_string(b) + "]", seqs[b]);
            const Sequence& s = m_sequences[static_cast<std::size_t>(seqs[b])];
            t.indices.insert(t.indices.end(), s.pages.begin(), s.pages.end());
            t.indptr.push_back(static_cast<Index>(t.indices.size()));
            t.last_page_len.push_back(s.pages.empty() ? 0 : s.stored() - (Index(s.pages.size()) - 1) * m_page_size);
        }
        return t;
    }

    /// Checks that seqs are distinct sequences of the pool (allocated or forked, not freed).
    /// \param fn   the calling function, which the message names (with seqs[b]).
    /// \param seqs the ids to check.
    /// \throws std::invalid_argument for an id that is not a sequence of the pool or one given twice.
    void check_sequences(const char* fn, const std::vector<SequenceId>& seqs) const {
        // Every layer step checks its ids (and append_ragged again): strings only on error.
        auto arg = [](std::size_t b) { return "seqs[" + std::to_string(b) + "]"; };
        for (std::size_t b = 0; b < seqs.size(); ++b) {
            if (!alive(seqs[b])) check_sequence(fn, arg(b), seqs[b]);
            for (std::size_t c = 0; c < b; ++c)
                if (seqs[c] == seqs[b])
                    detail::throw_invalid(fn, arg(b),
                                          "is sequence " + std::to_string(seqs[b]) + ", also seqs[" +
                                              std::to_string(c) + "]: each sequence at most once per call");
        }
    }

    /// Checks a page table (made by hand or kept from an earlier state) against the pool:
    /// indptr has batch() + 1 non-decreasing entries from 0 to indices.size(); no sequence has
    /// more pages than the pool; every page index is in [0, num_pages()) and held by some
    /// sequence (not free); last_page_len[b] is in [1, P] (0 for a sequence without pages).
    /// \param fn    the calling function, which the message names.
    /// \param table the table to check.
    /// \throws shape_error when indptr has not batch() + 1 entries; std::invalid_argument for
    ///         the rest, naming the sequence (its position in the table) and the page.
    void check_table(const char* fn, const PageTable& table) const {
        detail::check_table_layout(fn, table, m_page_size);  // before any page is read
        const Index B = table.batch();
        for (Index b = 0; b < B; ++b) {
            const std::string seq = "the sequence at table position " + std::to_string(b);
            const Index n = table.indptr[static_cast<std::size_t>(b) + 1] - table.indptr[static_cast<std::size_t>(b)];
            if (n > num_pages())
                detail::throw_invalid(fn, "table",
                                      seq + " has " + std::to_string(n) + " pages, more than the pool's " +
                                          std::to_string(num_pages()));
            for (Index i = 0; i < n; ++i) {
                const Index p = table.indices[static_cast<std::size_t>(table.indptr[static_cast<std::size_t>(b)] + i)];
                const std::string where = seq + ", its page " + std::to_string(i) + ": page index " + std::to_string(p);
                if (p < 0 || p >= num_pages())
                    detail::throw_invalid(fn, "table.indices",
                                          where + " is outside [0, " + std::to_string(num_pages()) + ")");
                if (m_refs[static_cast<std::size_t>(p)] == 0)
                    detail::throw_invalid(fn, "table.indices", where + " is free (no sequence holds it)");
            }
        }
    }

    /// Appends counts[b] tokens to sequence seqs[b]: rows b·n + t (t < counts[b]) of k and v,
    /// n = k.rows() / seqs.size(). A sequence takes new pages from the free list as it fills its
    /// last one; a shared partial last page is first copied to a page of its own (copy on
    /// write). An int8 pool quantizes each row (ops/int8_rows.hpp).
    /// \param seqs   B distinct sequences of the pool.
    /// \param k      [B·n, H_kv·d_k]; \param v [B·n, H_kv·d_v].
    /// \param counts B entries in [0, n]. (No seqs: k and v of no rows, counts empty.)
    /// \throws shape_error for k or v of the wrong shape or counts without B entries;
    ///         std::invalid_argument for an id that is not a sequence of the pool or appears
    ///         twice, a count outside [0, n], k or v sharing an element with the pool's storage,
    ///         or (int8) a value that is not finite; gattn::out_of_pages (a
    ///         std::invalid_argument) when more pages are needed than are free (free_pages(); the
    ///         message names the first sequence and page that do not fit). Nothing is changed on
    ///         error.
    void append(const std::vector<SequenceId>& seqs, ConstMatrixRef<Input> k, ConstMatrixRef<Input> v,
                const std::vector<Index>& counts) {
        constexpr const char* fn = "gattn::PagedKVPool::append";
        const auto B = static_cast<Index>(seqs.size());
        if (B == 0) {  // nothing to append: k, v and counts must be empty too
            detail::check_shape(fn, "k", k.rows(), k.cols(), 0, m_keys.cols());
            detail::check_shape(fn, "v", v.rows(), v.cols(), 0, m_values.cols());
            if (!counts.empty())
                detail::throw_shape(fn, "counts", detail::shape_string({0}),
                                    detail::shape_string({static_cast<Index>(counts.size())}));
            return;
        }
        if (k.rows() % B != 0 || k.cols() != m_keys.cols())
            detail::throw_shape(fn, "k", "[B*n, " + std::to_string(m_keys.cols()) + "] with B = " + std::to_string(B),
                                detail::shape_string({k.rows(), k.cols()}));
        const Index n = k.rows() / B;
        detail::check_shape(fn, "v", v.rows(), v.cols(), k.rows(), m_values.cols());
        if (static_cast<Index>(counts.size()) != B)
            detail::throw_shape(fn, "counts", detail::shape_string({B}),
                                detail::shape_string({static_cast<Index>(counts.size())}));
        std::vector<Index> first_row(static_cast<std::size_t>(B));
        for (Index b = 0; b < B; ++b) {
            if (counts[b] < 0 || counts[b] > n)
                detail::throw_invalid(fn, "counts[" + std::to_string(b) + "]",
                                      "must be in [0, n = k.rows() / seqs.size() = " + std::to_string(n) + "], got " +
                                          std::to_string(counts[b]));
            first_row[static_cast<std::size_t>(b)] = b * n;
        }
        append_rows(fn, seqs, k, v, first_row, counts);
    }

    /// Appends a ragged batch's tokens: sequence seqs[b] gets rows [qo_indptr[b],
    /// qo_indptr[b + 1]) of k and v (the row layout of paged_attention's mixed batches).
    /// \param seqs      B distinct sequences of the pool.
    /// \param k         [qo_indptr[B], H_kv·d_k]; \param v [qo_indptr[B], H_kv·d_v].
    /// \param qo_indptr B + 1 row offsets from 0, non-decreasing, ending at k.rows().
    /// \throws shape_error for k or v of the wrong shape or a qo_indptr without B + 1 entries;
    ///         std::invalid_argument for offsets that do not fit k, and as append. Nothing is
    ///         changed on error.
    void append_ragged(const std::vector<SequenceId>& seqs, ConstMatrixRef<Input> k, ConstMatrixRef<Input> v,
                       const std::vector<Index>& qo_indptr) {
        constexpr const char* fn = "gattn::PagedKVPool::append_ragged";
        const auto B = static_cast<Index>(seqs.size());
        if (k.cols() != m_keys.cols())
            detail::throw_shape(fn, "k", "[rows, " + std::to_string(m_keys.cols()) + "]",
                                detail::shape_string({k.rows(), k.cols()}));
        detail::check_shape(fn, "v", v.rows(), v.cols(), k.rows(), m_values.cols());
        detail::check_qo_indptr(fn, qo_indptr, B, k.rows(), "k.rows()");
        std::vector<Index> first_row(qo_indptr.begin(), qo_indptr.end() - 1), counts(static_cast<std::size_t>(B));
        for (Index b = 0; b < B; ++b)
            counts[static_cast<std::size_t>(b)] = qo_indptr[static_cast<std::size_t>(b) + 1] - first_row[b];
        if (B > 0) append_rows(fn, seqs, k, v, first_row, counts);
    }

    /// Writes n tokens into slots [slot, slot + n) of page `page`, which exactly one sequence
    /// holds (for callers that manage their own tables; the sequence's length does not change).
    /// \param page the page, in [0, num_pages()).
    /// \param slot the first slot written, in [0, P − n].
    /// \param k [n, H_kv·d_k]; \param v [n, H_kv·d_v].
    /// \throws shape_error for k or v of the wrong shape; std::invalid_argument for a page
    ///         outside [0, num_pages()), a free page, a page shared by more than one sequence,
    ///         slots outside [0, P), k or v sharing an element with the pool's storage, or (int8) a
    ///         value that is not finite. Nothing is changed on error.
    void write(Index page, Index slot, ConstMatrixRef<Input> k, ConstMatrixRef<Input> v) {
        constexpr const char* fn = "gattn::PagedKVPool::write";
        check_page(fn, "page", page);
        const Index refs = m_refs[static_cast<std::size_t>(page)];
        if (refs == 0) detail::throw_invalid(fn, "page", std::to_string(page) + " is free (no sequence holds it)");
        if (refs > 1)
            detail::throw_invalid(fn, "page",
                                  std::to_string(page) + " is shared by " + std::to_string(refs) +
                                      " sequences: a shared page is never written (append copies it first)");
        if (k.cols() != m_keys.cols())
            detail::throw_shape(fn, "k", "[n, " + std::to_string(m_keys.cols()) + "]",
                                detail::shape_string({k.rows(), k.cols()}));
        detail::check_shape(fn, "v", v.rows(), v.cols(), k.rows(), m_values.cols());
        if (slot < 0 || slot > m_page_size - k.rows())  // not slot + n: that overflows near INT64_MAX
            detail::throw_invalid(fn, "slot",
                                  "and the rows must lie in the page's slots [0, " + std::to_string(m_page_size) +
                                      "), got " + std::to_string(k.rows()) + " rows from slot " + std::to_string(slot) +
                                      " of page " + std::to_string(page));
        check_outside(fn, k, v);
        if constexpr (kInt8)
            for (const auto& [view, name] : {std::pair<const ConstMatrixRef<Input>*, const char*>{&k, "k"}, {&v, "v"}})
                for (Index r = 0; r < view->rows(); ++r)
                    for (Index c = 0; c < view->cols(); ++c)
                        if (!std::isfinite((*view)(r, c)))
                            detail::throw_invalid(fn, name,
                                                  "row " + std::to_string(r) + ", column " + std::to_string(c) +
                                                      " is " + detail::number_string((*view)(r, c)) +
                                                      ": an int8 pool stores finite values only");
        note_write(page, slot, k.rows());
        for (Index r = 0; r < k.rows(); ++r) write_row(page * m_page_size + slot + r, k.row(r).data(), v.row(r).data());
    }

    /// Rolls sequence seq back to `length` tokens (e.g. rejected speculative tokens): the pages
    /// past them are released (freed when no other sequence holds them). The rows stay as they
    /// are; a shared partial last page is copied when the sequence next appends.
    /// \throws std::invalid_argument when seq is not a sequence of the pool or length is outside
    ///         [min_truncate_length(seq), length(seq)] (released tokens cannot come back, and the
    ///         next token's window must find its keys). Nothing is changed on error.
    void truncate(SequenceId seq, Index length) {
        constexpr const char* fn = "gattn::PagedKVPool::truncate";
        const Index shortest = min_truncate_length(seq);
        Sequence& s = m_sequences[static_cast<std::size_t>(seq)];
        if (length < shortest || length > s.length)
            detail::throw_invalid(fn, "length",
                                  "must be in [" + std::to_string(shortest) + ", " + std::to_string(s.length) +
                                      "] (sequence " + std::to_string(seq) +
                                      (s.first > 0 ? ", whose first " + std::to_string(s.first) +
                                                         " tokens are released: the window of " +
                                                         std::to_string(s.window) + " keys of its next token would " +
                                                         "reach them below " + std::to_string(shortest)
                                                   : std::string()) +
                                      "), got " + std::to_string(length));
        const auto keep = static_cast<std::size_t>((length - s.first + m_page_size - 1) / m_page_size);
        m_free.reserve(m_free.size() + (s.pages.size() - keep));  // may throw: nothing changed yet
        release(s.pages, keep);
        s.pages.resize(keep);
        s.length = length;
        s.epoch = ++m_epochs;  // marks taken before no longer restore
    }

    /// What restore needs to bring a sequence back to its state when mark() was called: its
    /// length, its first stored token, its page list and what each page held then.
    struct SequenceMark {
        SequenceId seq = -1;                     ///< the sequence
        Index length = 0;                        ///< its tokens then
        Index first = 0;                         ///< its first stored token then (first_position)
        std::vector<Index> pages;                ///< its pages then, in token order
        std::vector<std::uint64_t> generations;  ///< each page's generation then (see restore)
        std::uint64_t epoch = 0;                 ///< which allocate, fork or truncate of the sequence it follows
    };

    /// Sequence seq's state now, for restore (taken before a step that may be rolled back).
    /// \throws std::invalid_argument when seq is not a sequence of the pool.
    SequenceMark mark(SequenceId seq) const {
        check_sequence("gattn::PagedKVPool::mark", "seq", seq);
        const Sequence& s = m_sequences[static_cast<std::size_t>(seq)];
        std::vector<std::uint64_t> generations(s.pages.size());
        for (std::size_t i = 0; i < s.pages.size(); ++i)
            generations[i] = m_generation[static_cast<std::size_t>(s.pages[i])];
        return {seq, s.length, s.first, s.pages, std::move(generations), s.epoch};
    }

    /// Brings sequence m.seq back to mark m, taken since the sequence was last allocated, forked
    /// or truncated (it has only appended and released front pages since): its length and its
    /// pages then, so that a page it shared and copied on write since is shared again and the
    /// copy released, as are the pages it took. Unlike truncate, this gives back the same page
    /// list, so the pools of a model's layers stay alike after a step that a later layer refused
    /// (PagedKVPoolSet::restore). Front pages released since (release_outside_window) stay
    /// released: first_position(seq) does not move back.
    /// A page the sequence let go of since the mark (its copy on write) may since have gone to
    /// another sequence, or been rewritten in place by the one sequence still holding it after
    /// a truncate: each page has a generation, which moves on when the page is taken from the
    /// free list or a slot below the highest one written since is written again, and restore
    /// takes such a page back only in the generation the mark recorded.
    /// \throws std::invalid_argument when m.seq is not a sequence of the pool, or the mark is
    ///         not of its present run: taken before its last allocate, fork or truncate (or of
    ///         another pool), m.length above length(seq) or below first_position(seq), pages
    ///         that do not hold m.length tokens, or a page whose tokens of the mark are no longer
    ///         there (freed, taken again or rewritten since). Nothing is changed on error.
    void restore(const SequenceMark& m) {
        auto [target, same] = restore_pages("gattn::PagedKVPool::restore", m);
        Sequence& s = m_sequences[static_cast<std::size_t>(m.seq)];
        m_free.reserve(m_free.size() + (s.pages.size() - same));  // may throw: nothing changed yet
        for (std::size_t i = same; i < target.size(); ++i) ++m_refs[static_cast<std::size_t>(target[i])];
        release(s.pages, same);
        s.pages = std::move(target);
        s.length = m.length;
    }

    /// Whether restore(m) would succeed. \throws what restore throws, changing nothing.
    void check_restore(const SequenceMark& m) const { restore_pages("gattn::PagedKVPool::restore", m); }

    /// Releases the pages at the front of sequence seq that a causal sliding window of `window`
    /// keys (counting the diagonal, as SdpaMask::sliding_window) hides from token `position` and
    /// every later one: the pages whose tokens all come before token position − window + 1, the
    /// first key that token sees. position defaults to length(seq), the next token; an earlier
    /// one keeps what a rollback to it needs (truncate(seq, position) stays possible, for a
    /// window no wider than those of the earlier calls: a wider one cannot bring released
    /// tokens back, and min_truncate_length follows the window of the last call). Each
    /// such page's count goes down by one (freed when no other sequence holds it) and
    /// first_position(seq) moves past its tokens. Attention over the page table is unchanged:
    /// the masks align each sequence's queries with the end of its keys, and ALiBi and the
    /// window depend only on distances. GatedMultiHeadAttention's forward over a pool calls
    /// this after each step when its config has a causal sliding window, with position the
    /// step's first token (vLLM likewise frees the blocks a sliding window has left).
    /// \returns the pages released.
    /// \throws std::invalid_argument when seq is not a sequence of the pool, window < 1, or
    ///         position is outside [0, length(seq)]. Nothing is changed on error.
    Index release_outside_window(SequenceId seq, Index window, std::optional<Index> position = std::nullopt) {
        constexpr const char* fn = "gattn::PagedKVPool::release_outside_window";
        check_sequence(fn, "seq", seq);
        if (window < 1)
            detail::throw_invalid(fn, "window", "must be >= 1 (it counts the diagonal), got " + std::to_string(window));
        Sequence& s = m_sequences[static_cast<std::size_t>(seq)];
        const Index from = position.value_or(s.length);
        if (from < 0 || from > s.length)
            detail::throw_invalid(fn, "position",
                                  "must be in [0, length(seq) = " + std::to_string(s.length) + "], got " +
                                      std::to_string(from));
        s.window = window;  // truncate keeps what this window needs (min_truncate_length)
        // Stored tokens hidden from token `from` on; all of them when from is the next token and
        // the window sees only that token itself.
        // (from − first) − (w − 1), formed without overflow for any window up to the Index maximum.
        const Index span = from - s.first;
        const Index hidden = span > window - 1 ? span - (window - 1) : 0;
        const Index drop = hidden >= s.stored() ? Index(s.pages.size()) : hidden / m_page_size;
        if (drop == 0) return 0;
        m_free.reserve(m_free.size() + static_cast<std::size_t>(drop));  // may throw: nothing changed yet
        for (Index i = 0; i < drop; ++i)
            if (--m_refs[static_cast<std::size_t>(s.pages[static_cast<std::size_t>(i)])] == 0)
                m_free.push_back(s.pages[static_cast<std::size_t>(i)]);
        s.first += std::min(drop * m_page_size, s.stored());
        s.pages.erase(s.pages.begin(), s.pages.begin() + drop);
        return drop;
    }

private:
    struct Sequence {
        std::vector<Index> pages;
        std::uint64_t epoch = 0;  // the pool's count of allocate, fork and truncate calls at its last one
        Index length = 0;         // tokens appended
        Index first = 0;          // tokens released from the front (release_outside_window)
        Index window = 0;         // the window of the last release_outside_window call
        // Tokens in the pages: token first + t sits in page pages[t / P], slot t mod P.
        Index stored() const noexcept { return length - first; }
    };

    // append and append_ragged after their shape checks: sequence seqs[b] takes counts[b] rows
    // of k and v from first_row[b].
    void append_rows(const char* fn, const std::vector<SequenceId>& seqs, const ConstMatrixRef<Input>& k,
                     const ConstMatrixRef<Input>& v, const std::vector<Index>& first_row,
                     const std::vector<Index>& counts) {
        const auto B = static_cast<Index>(seqs.size());
        check_sequences(fn, seqs);
        check_outside(fn, k, v);
        if constexpr (kInt8)  // int8 codes stand for finite values only
            for (const auto& [view, name] : {std::pair<const ConstMatrixRef<Input>*, const char*>{&k, "k"}, {&v, "v"}})
                for (Index b = 0; b < B; ++b)
                    for (Index r = first_row[b]; r < first_row[b] + counts[b]; ++r)
                        for (Index c = 0; c < view->cols(); ++c)
                            if (!std::isfinite((*view)(r, c)))
                                detail::throw_invalid(fn, name,
                                                      "row " + std::to_string(r) + " (sequence " +
                                                          std::to_string(seqs[b]) + "), column " + std::to_string(c) +
                                                          " is " + detail::number_string((*view)(r, c)) +
                                                          ": an int8 pool stores finite values only");
        // Pages each sequence takes: a copy of a shared partial last page, and new ones.
        // A sequence that copies a shared page drops its reference: a later sequence of the
        // call that shares the page with fewer others may then write it in place.
        Index needed = 0;
        std::vector<Index> takes(static_cast<std::size_t>(B), 0), copied;
        for (Index b = 0; b < B; ++b) {
            const Sequence& s = m_sequences[static_cast<std::size_t>(seqs[b])];
            if (counts[b] == 0) continue;
            const Index have = static_cast<Index>(s.pages.size());
            const Index want = (s.stored() + counts[b] + m_page_size - 1) / m_page_size;
            const bool copy = s.stored() % m_page_size != 0 &&
                              m_refs[static_cast<std::size_t>(s.pages.back())] -
                                      std::count(copied.begin(), copied.end(), s.pages.back()) >
                                  1;
            if (copy) copied.push_back(s.pages.back());
            takes[static_cast<std::size_t>(b)] = want - have + (copy ? 1 : 0);
            if (needed + takes[static_cast<std::size_t>(b)] > free_pages())
                throw out_of_pages(std::string(fn) + ": counts[" + std::to_string(b) + "] " +
                                   "needs more pages than the pool has free: sequence " + std::to_string(seqs[b]) +
                                   " (" + std::to_string(s.stored()) + " tokens in pages) needs " +
                                   std::to_string(takes[static_cast<std::size_t>(b)]) + " more (its pages " +
                                   std::to_string(copy ? have - 1 : have) + " to " + std::to_string(want - 1) +
                                   (copy ? ", the first a copy of a shared page" : "") + ") for " +
                                   std::to_string(counts[b]) + " tokens, and " + std::to_string(free_pages() - needed) +
                                   " of the pool's " + std::to_string(num_pages()) +
                                   " pages are free for it (free_pages())");
            needed += takes[static_cast<std::size_t>(b)];
        }
        // Grow every page list first: past this point nothing allocates or throws.
        for (Index b = 0; b < B; ++b) {
            Sequence& s = m_sequences[static_cast<std::size_t>(seqs[b])];
            s.pages.reserve(s.pages.size() + static_cast<std::size_t>(takes[static_cast<std::size_t>(b)]));
        }
        for (Index b = 0; b < B; ++b) {
            Sequence& s = m_sequences[static_cast<std::size_t>(seqs[b])];
            if (counts[b] == 0) continue;
            const Index fill = s.stored() % m_page_size;
            if (fill != 0 && m_refs[static_cast<std::size_t>(s.pages.back())] > 1) {  // copy on write
                const Index page = take_page();
                note_write(page, 0, fill);
                copy_rows(s.pages.back() * m_page_size, page * m_page_size, fill);
                --m_refs[static_cast<std::size_t>(s.pages.back())];
                s.pages.back() = page;
            }
            for (Index t = 0; t < counts[b]; ++t) {
                const Index pos = s.stored() + t;
                if (pos % m_page_size == 0) s.pages.push_back(take_page());
                note_write(s.pages[static_cast<std::size_t>(pos / m_page_size)], pos % m_page_size, 1);
                write_row(s.pages[static_cast<std::size_t>(pos / m_page_size)] * m_page_size + pos % m_page_size,
                          k.row(first_row[b] + t).data(), v.row(first_row[b] + t).data());
            }
            s.length += counts[b];
        }
    }

    bool alive(SequenceId seq) const noexcept {
        return seq >= 0 && seq < static_cast<Index>(m_alive.size()) && m_alive[static_cast<std::size_t>(seq)];
    }
    void check_sequence(const char* fn, const std::string& arg, SequenceId seq) const {
        if (!alive(seq))
            detail::throw_invalid(
                fn, arg, "must be a sequence of the pool (allocated or forked, not freed), got " + std::to_string(seq));
    }
    // restore's checks; returns the page list sequence m.seq gets back (the mark's, less the
    // front pages released since) and how many of its leading pages the sequence still holds.
    std::pair<std::vector<Index>, std::size_t> restore_pages(const char* fn, const SequenceMark& m) const {
        check_sequence(fn, "m.seq", m.seq);
        const Sequence& s = m_sequences[static_cast<std::size_t>(m.seq)];
        if (m.epoch != s.epoch)
            detail::throw_invalid(fn, "m",
                                  "must be a mark of sequence " + std::to_string(m.seq) +
                                      " taken since it was last allocated, forked or truncated in this pool");
        const Index P = m_page_size, drop = (s.first - m.first) / P;
        if (m.length > s.length || m.length < s.first || m.first > s.first || (s.first - m.first) % P != 0 ||
            static_cast<Index>(m.pages.size()) - drop != (m.length - s.first + P - 1) / P)
            detail::throw_invalid(fn, "m",
                                  "must be a mark of sequence " + std::to_string(m.seq) + "'s past (length " +
                                      std::to_string(m.length) + " from token " + std::to_string(m.first) + " in " +
                                      std::to_string(m.pages.size()) + " pages; the sequence has " +
                                      std::to_string(s.length) + " tokens from " + std::to_string(s.first) + ")");
        if (m.generations.size() != m.pages.size())
            detail::throw_shape(fn, "m.generations", detail::shape_string({static_cast<Index>(m.pages.size())}),
                                detail::shape_string({static_cast<Index>(m.generations.size())}));
        std::vector<Index> target(m.pages.begin() + drop, m.pages.end());
        // Since the mark the sequence has only appended (new pages, or a copy in place of its
        // shared last page) and released front pages: the two lists agree up to their first
        // difference, past which each current page is one it took and each marked page one it
        // let go of. The pages it still holds keep their tokens; those it let go of must be as
        // the mark left them.
        std::size_t same = 0;
        while (same < target.size() && same < s.pages.size() && target[same] == s.pages[same]) ++same;
        for (std::size_t i = 0; i < target.size(); ++i) {
            const Index p = target[i];
            check_page(fn, "m.pages", p);
            if (m_refs[static_cast<std::size_t>(p)] == 0)
                detail::throw_invalid(fn, "m.pages",
                                      "page " + std::to_string(p) + " of sequence " + std::to_string(m.seq) +
                                          "'s mark is free now: the mark is older than a truncate or free");
            if (i >= same &&
                m_generation[static_cast<std::size_t>(p)] != m.generations[static_cast<std::size_t>(drop) + i])
                detail::throw_invalid(fn, "m.pages",
                                      "page " + std::to_string(p) + " of sequence " + std::to_string(m.seq) +
                                          "'s mark has changed since: the sequence let go of it (copy on write), "
                                          "and it was then taken from the free list again or its slots rewritten");
        }
        return {std::move(target), same};
    }
    void check_page(const char* fn, const char* arg, Index page) const {
        if (page < 0 || page >= num_pages())
            detail::throw_invalid(fn, arg,
                                  "must be in [0, " + std::to_string(num_pages()) + "), got " + std::to_string(page));
    }

    // Rows are copied in place: k or v inside the pool's own storage would be overwritten while
    // being read.
    void check_outside(const char* fn, const ConstMatrixRef<Input>& k, const ConstMatrixRef<Input>& v) const {
        for (const auto& [view, name] : {std::pair<const ConstMatrixRef<Input>*, const char*>{&k, "k"}, {&v, "v"}})
            if (gattn::detail::views_overlap(*view, m_keys) || gattn::detail::views_overlap(*view, m_values) ||
                gattn::detail::views_overlap(*view, m_key_scales) ||
                gattn::detail::views_overlap(*view, m_value_scales))
                detail::throw_invalid(fn, name, "must not share an element with the pool's keys, values or scales");
    }

    // A free page, now held once (the caller has checked there is one).
    Index take_page() noexcept {
        const Index p = m_free.back();
        m_free.pop_back();
        m_refs[static_cast<std::size_t>(p)] = 1;
        ++m_generation[static_cast<std::size_t>(p)];  // marks that held it before no longer restore it
        m_written[static_cast<std::size_t>(p)] = 0;
        return p;
    }
    // Rows are about to be written to slots [slot, slot + n) of page: writing again below the
    // highest slot written since the page was taken changes tokens a mark may hold.
    void note_write(Index page, Index slot, Index n) noexcept {
        Index& written = m_written[static_cast<std::size_t>(page)];
        if (slot < written) ++m_generation[static_cast<std::size_t>(page)];
        written = std::max(written, slot + n);
    }
    // Drops one reference to pages[from..]; a page no one holds returns to the free list (whose
    // room the caller has reserved).
    void release(const std::vector<Index>& pages, std::size_t from) noexcept {
        for (std::size_t i = pages.size(); i-- > from;)
            if (--m_refs[static_cast<std::size_t>(pages[i])] == 0) m_free.push_back(pages[i]);
    }

    // Stores one token's key and value rows (all KV heads) in pool row `row`.
    void write_row(Index row, const Input* k, const Input* v) noexcept {
        if constexpr (kInt8) {
            quantize_int8_row(k, m_num_kv_heads, m_head_dim, m_keys.row(row).data(), m_key_scales.row(row).data());
            quantize_int8_row(v, m_num_kv_heads, m_value_head_dim, m_values.row(row).data(),
                              m_value_scales.row(row).data());
        } else {
            std::memcpy(m_keys.row(row).data(), k, sizeof(Scalar) * static_cast<std::size_t>(m_keys.cols()));
            std::memcpy(m_values.row(row).data(), v, sizeof(Scalar) * static_cast<std::size_t>(m_values.cols()));
        }
    }
    // Copies `rows` pool rows from row `from` to row `to` (distinct pages).
    void copy_rows(Index from, Index to, Index rows) noexcept {
        auto copy = [&](auto& m) {
            if (m.size() == 0) return;
            std::memcpy(m.row(to).data(), m.row(from).data(),
                        sizeof(typename std::decay_t<decltype(m)>::Scalar) * static_cast<std::size_t>(rows * m.cols()));
        };
        copy(m_keys);
        copy(m_values);
        copy(m_key_scales);
        copy(m_value_scales);
    }

    // Checks the constructor's sizes before anything is allocated; returns page_size.
    static Index validated(Index num_pages, Index page_size, Index num_kv_heads, Index head_dim, Index value_head_dim) {
        constexpr const char* fn = "gattn::PagedKVPool";
        auto positive = [&](Index v, const char* name) {
            if (v < 1) detail::throw_invalid(fn, name, "must be >= 1, got " + std::to_string(v));
        };
        positive(num_pages, "num_pages");
        positive(num_kv_heads, "num_kv_heads");
        positive(head_dim, "head_dim");
        if (page_size < kMinPageSize || page_size > kMaxPageSize || page_size % kPageAlign != 0)
            detail::throw_invalid(fn, "page_size",
                                  "must be a multiple of " + std::to_string(kPageAlign) + " in [" +
                                      std::to_string(kMinPageSize) + ", " + std::to_string(kMaxPageSize) + "], got " +
                                      std::to_string(page_size));
        if (value_head_dim < 0)
            detail::throw_invalid(fn, "value_head_dim",
                                  "must be >= 0 (0 = head_dim), got " + std::to_string(value_head_dim));
        const Index width = std::max(head_dim, value_head_dim), max = std::numeric_limits<Index>::max();
        if (num_pages > max / page_size || num_kv_heads > max / width ||
            num_pages * page_size > max / (num_kv_heads * width))
            detail::throw_invalid(fn, "num_pages",
                                  "num_pages·page_size·num_kv_heads·head_dim overflows: num_pages " +
                                      std::to_string(num_pages) + ", page_size " + std::to_string(page_size) +
                                      ", num_kv_heads " + std::to_string(num_kv_heads) + ", head_dim " +
                                      std::to_string(width));
        return page_size;
    }

    Index m_page_size, m_num_kv_heads, m_head_dim, m_value_head_dim;
    std::vector<Index> m_refs;                      // per page: sequences holding it
    std::vector<std::uint64_t> m_generation;        // per page: takings and rewrites (restore)
    std::vector<Index> m_written;                   // per page: slots [0, this) written since taken
    std::vector<Index> m_free;                      // free pages, the next one taken last
    std::vector<Sequence> m_sequences;              // by id
    std::vector<bool> m_alive;                      // by id: in use
    std::uint64_t m_epochs = 0;                     // allocate, fork and truncate calls so far
    RowMatrix<Scalar> m_keys, m_values;             // [num_pages·P, H_kv·d]
    RowMatrix<float> m_key_scales, m_value_scales;  // int8: [num_pages·P, H_kv]; else empty
    std::size_t m_huge_page_bytes = 0;              // of m_keys and m_values (advise_huge_pages)
};

GATTN_END_ISA_NAMESPACE
