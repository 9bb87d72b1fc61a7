// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The paged pools of a model: one PagedKVPool per layer, holding the same sequences in the
/// same pages, so that one page table serves every layer (as vLLM's block tables do), except
/// where a sliding-window layer has released pages its window no longer sees.

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gattn/cache/paged_kv_pool.hpp"

GATTN_BEGIN_ISA_NAMESPACE

/// One PagedKVPool per layer (made by the layers' make_pool), whose sequences are allocated,
/// forked, truncated and freed in every layer at once. Each layer's forward appends its own
/// keys and values; after a model step every pool holds the same tokens in the same pages
/// (pages are taken in the same order; a sliding-window layer's pool releases pages of its own,
/// PagedKVPool::release_outside_window), and each layer's forward reads its pool through the
/// pool's own page table. A step that throws part-way (a later layer refusing its append) leaves the
/// earlier layers appended: restore() the marks taken before the step (mark()), which gives
/// every pool the same tokens in the same pages again. truncate() to the lengths before it gives
/// the same tokens, not always the same pages: where an earlier layer's append copied a shared
/// partial page (a forked sequence), that layer keeps its copy while the others still share the
/// page (each layer's forward reads its own pool's table, so the results are the same either
/// way). A window layer's forward keeps the tokens that either rollback needs. free_pages() says
/// how many pages every pool can still give a step.
template <class Scalar>
class PagedKVPoolSet {
public:
    PagedKVPoolSet() = default;

    /// One pool per layer, in the layers' order: layers[i]->make_pool<Scalar>(num_pages,
    /// page_size). Layer: GatedMultiHeadAttention or Qwen3NextAttention.
    /// \throws as PagedKVPool's constructor.
    template <class Layer>
    PagedKVPoolSet(const std::vector<const Layer*>& layers, Index num_pages, Index page_size) {
        m_pools.reserve(layers.size());
        for (const Layer* l : layers) m_pools.push_back(l->template make_pool<Scalar>(num_pages, page_size));
    }

    /// Pools (layers).
    std::size_t size() const noexcept { return m_pools.size(); }
    /// Layer i's pool. \throws std::out_of_range for i ≥ size().
    PagedKVPool<Scalar>& operator[](std::size_t i) { return m_pools.at(i); }
    /// Layer i's pool. \throws std::out_of_range for i ≥ size().
    const PagedKVPool<Scalar>& operator[](std::size_t i) const { return m_pools.at(i); }

    /// A new sequence with no tokens in every layer. \returns its id (the same in every pool).
    /// \throws std::out_of_range when the set is empty.
    SequenceId allocate() {
        const SequenceId id = m_pools.at(0).allocate();
        for (std::size_t i = 1; i < m_pools.size(); ++i) m_pools[i].allocate();
        return id;
    }

    /// A sequence sharing parent's pages in every layer (PagedKVPool::fork).
    /// \throws std::invalid_argument when parent is not a sequence of the pools (checked in the
    ///         first pool before any changes).
    SequenceId fork(SequenceId parent) {
        const SequenceId id = m_pools.at(0).fork(parent);
        for (std::size_t i = 1; i < m_pools.size(); ++i) m_pools[i].fork(parent);
        return id;
    }

    /// Releases a sequence in every layer (PagedKVPool::free).
    /// \throws std::out_of_range when the set is empty; std::invalid_argument when seq is not a
    ///         sequence of the pools (nothing changed).
    void free(SequenceId seq) {
        if (m_pools.empty()) throw std::out_of_range("gattn::PagedKVPoolSet::free: the set holds no pool");
        for (const PagedKVPool<Scalar>& p : m_pools) p.length(seq);  // checks before any change
        for (PagedKVPool<Scalar>& p : m_pools) p.free(seq);
    }

    /// Rolls seq back to `length` tokens in every layer (PagedKVPool::truncate).
    /// \throws std::out_of_range when the set is empty; std::invalid_argument when seq is not a
    ///         sequence of every pool or length is outside [PagedKVPool::min_truncate_length, its
    ///         length] in one of them (a layer with a sliding window may have released tokens the
    ///         others keep; checked on every pool before any changes).
    void truncate(SequenceId seq, Index length) {
        if (m_pools.empty()) throw std::out_of_range("gattn::PagedKVPoolSet::truncate: the set holds no pool");
        for (std::size_t i = 0; i < m_pools.size(); ++i) {
            const Index have = m_pools[i].length(seq), shortest = m_pools[i].min_truncate_length(seq);
            if (length < shortest || length > have)
                detail::throw_invalid("gattn::PagedKVPoolSet::truncate", "length",
                                      "must be in [" + std::to_string(shortest) + ", " + std::to_string(have) +
                                          "] (sequence " + std::to_string(seq) + " in layer " + std::to_string(i) +
                                          "'s pool), got " + std::to_string(length));
        }
        for (PagedKVPool<Scalar>& p : m_pools) p.truncate(seq, length);
    }

    /// Every pool's PagedKVPool::mark of each of seqs, [pool][sequence]: taken before a model
    /// step, for restore. \throws std::invalid_argument for an id not in every pool.
    std::vector<std::vector<typename PagedKVPool<Scalar>::SequenceMark>> mark(
        const std::vector<SequenceId>& seqs) const {
        std::vector<std::vector<typename PagedKVPool<Scalar>::SequenceMark>> marks(m_pools.size());
        for (std::size_t i = 0; i < m_pools.size(); ++i)
            for (SequenceId seq : seqs) marks[i].push_back(m_pools[i].mark(seq));
        return marks;
    }

    /// Brings every pool's sequences back to marks (from mark(), PagedKVPool::restore): after a
    /// step that a later layer refused, the same tokens in the same pages in every pool.
    /// \throws std::invalid_argument when marks has not one list per pool, or as
    ///         PagedKVPool::restore in one of them (checked on every pool before any changes).
    void restore(const std::vector<std::vector<typename PagedKVPool<Scalar>::SequenceMark>>& marks) {
        if (marks.size() != m_pools.size())
            detail::throw_invalid("gattn::PagedKVPoolSet::restore", "marks",
                                  "must hold one list per pool (" + std::to_string(m_pools.size()) + "), holds " +
                                      std::to_string(marks.size()));
        for (std::size_t i = 0; i < m_pools.size(); ++i)
            for (const auto& m : marks[i]) m_pools[i].check_restore(m);
        for (std::size_t i = 0; i < m_pools.size(); ++i)
            for (const auto& m : marks[i]) m_pools[i].restore(m);
    }

    /// Tokens of seq (in the first layer's pool; every layer's after a model step).
    /// \throws std::out_of_range when the set is empty; std::invalid_argument for an unknown seq.
    Index length(SequenceId seq) const { return m_pools.at(0).length(seq); }
    /// Pages free in every pool: the fewest any pool has (a sliding-window layer's pool, which
    /// releases pages, may have more). \throws std::out_of_range when the set is empty.
    Index free_pages() const {
        Index fewest = m_pools.at(0).free_pages();
        for (const PagedKVPool<Scalar>& p : m_pools) fewest = std::min(fewest, p.free_pages());
        return fewest;
    }
    /// Bytes of every pool's storage.
    Index storage_bytes() const noexcept {
        Index n = 0;
        for (const PagedKVPool<Scalar>& p : m_pools) n += p.storage_bytes();
        return n;
    }

private:
    std::vector<PagedKVPool<Scalar>> m_pools;
};

GATTN_END_ISA_NAMESPACE
