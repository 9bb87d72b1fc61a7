// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// A key/value cache for decoding: per sequence, the keys and values of every token seen so far
/// (or, with a window, of those the next tokens can still see).
///
/// Storage is one [B·capacity, H_kv·d] matrix for keys and one for values: sequence b's stored
/// token t sits in row b·capacity + t, so the cache is directly the key/value input of
/// scaled_dot_product_attention with key_lengths = lengths(). Slots past a sequence's length are
/// never read (masked keys are skipped), so they need no initialisation.
///
/// A cache with a window w (a sliding-window layer's: Mistral, Gemma 2, gpt-oss) keeps only what
/// the next tokens can see: when an append does not fit, each sequence's last w − 1 tokens move
/// to the front of its rows (the older ones are dropped; first_positions() counts them), and the
/// rows grow only when one call brings more tokens than fit beside them. Tokens stay in position
/// order, so causal and window masks, ALiBi and sinks apply unchanged; decoding runs
/// indefinitely in O(w) memory (capacity 2w: one row moved per token appended, amortised).
///
/// An int8 cache (KVCache<std::int8_t>) takes float keys and values and stores int8 codes with
/// one float scale per (token, KV head) (ops/int8_rows.hpp): 3.9× fewer bytes than float at
/// d = 256 (4·d / (d + 4)). Its layers' SDPA reads the codes in place (key_operand()).
///
/// The keys' and values' storage is advised into transparent huge pages where the system uses
/// them (cache/huge_pages.hpp; huge_page_bytes() says how much was).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gattn/cache/huge_pages.hpp"
#include "gattn/ops/int8_rows.hpp"
#include "gattn/ops/sdpa.hpp"
#include "gattn/types.hpp"

GATTN_BEGIN_ISA_NAMESPACE

/// Identity of a layer, for the caches it makes: unique within the process for every layer
/// constructed (copies of a layer share it: they hold the same weights). 0 is no layer.
using LayerId = std::uint64_t;

namespace detail {
inline LayerId next_layer_id() noexcept {
    static std::atomic<LayerId> last{0};
    return ++last;
}
}  // namespace detail

/// The keys and values of up to `capacity` tokens of each of `batch` sequences, stored as
/// Scalar (float, double, gattn::bfloat16, gattn::half, or std::int8_t: int8 codes and scales
/// of float keys and values), as in HF transformers' Cache: the decoding state of one attention
/// layer.
template <class Scalar>
class KVCache {
    static_assert(is_supported_storage_v<Scalar> || std::is_same_v<Scalar, std::int8_t>,
                  "GATTN_CACHE_STORES_FLOAT_DOUBLE_BFLOAT16_HALF_OR_INT8");
    static constexpr bool kInt8 = std::is_same_v<Scalar, std::int8_t>;

public:
    /// What append takes: float for an int8 cache, else Scalar.
    using Input = std::conditional_t<kInt8, float, Scalar>;
    /// What SDPA reads the keys and values through: Int8Rows for an int8 cache, else a matrix.
    using Operand = std::conditional_t<kInt8, Int8Rows, ConstMatrixRef<Scalar>>;

    /// Keys [batch·capacity, num_kv_heads·head_dim], values [batch·capacity,
    /// num_kv_heads·value_head_dim] (value_head_dim 0 = head_dim), all lengths 0.
    /// \param batch          sequences.
    /// \param capacity       tokens each sequence can hold.
    /// \param num_kv_heads   key/value heads (H_kv).
    /// \param head_dim       features per key head (d_k).
    /// \param value_head_dim features per value head (d_v); 0 = head_dim.
    /// \param owner the layer this cache belongs to (its layer_id(); a layer's make_cache sets
    ///              it): any other layer refuses the cache. 0: any layer of these heads takes it.
    /// \throws std::invalid_argument for sizes < 1 (value_head_dim < 0) or whose products
    ///         overflow Index; std::bad_alloc or std::length_error when the storage cannot be
    ///         allocated.
    /// \param window  w ≥ 1: keep only the tokens a sliding window of w keys (counting the
    ///                diagonal) still needs, and grow past `capacity` when a call needs it;
    ///                0: keep every token, up to `capacity`.
    /// \throws std::invalid_argument also for window < 0.
    KVCache(Index batch, Index capacity, Index num_kv_heads, Index head_dim, Index value_head_dim = 0,
            LayerId owner = 0, Index window = 0)
        : m_owner(owner),
          m_window(validated_window(window)),
          m_capacity(validated_capacity(batch, capacity, num_kv_heads, head_dim, value_head_dim)),
          m_num_kv_heads(num_kv_heads),
          m_head_dim(head_dim),
          m_value_head_dim(value_head_dim > 0 ? value_head_dim : head_dim),
          m_lengths(static_cast<std::size_t>(batch), 0),
          m_first(static_cast<std::size_t>(batch), 0) {
        m_keys.resize(batch * capacity, num_kv_heads * head_dim);
        m_values.resize(batch * capacity, num_kv_heads * m_value_head_dim);
        m_huge_page_bytes = detail::advise_storage(m_keys) + detail::advise_storage(m_values);
        if constexpr (kInt8) {
            m_key_scales.resize(batch * capacity, num_kv_heads);
            m_value_scales.resize(batch * capacity, num_kv_heads);
        }
    }

    /// Sequences (B).
    Index batch() const noexcept { return static_cast<Index>(m_lengths.size()); }
    /// The layer the cache belongs to (0: none recorded).
    LayerId owner() const noexcept { return m_owner; }
    /// Rows each sequence has (tokens it can hold; a window cache grows it when a call needs more).
    Index capacity() const noexcept { return m_capacity; }
    /// The sliding window the cache keeps tokens for (0: it keeps every token).
    Index window() const noexcept { return m_window; }
    /// Per sequence, the position of its first stored token (tokens dropped; always 0 without a
    /// window). Stored token t is token first_positions()[b] + t of the sequence.
    const std::vector<Index>& first_positions() const noexcept { return m_first; }
    /// Per sequence, tokens appended so far: the position of its next token (lengths() without
    /// a window).
    std::vector<Index> tokens_seen() const {
        std::vector<Index> t = m_lengths;
        for (std::size_t b = 0; b < t.size(); ++b) t[b] += m_first[b];
        return t;
    }
    /// Per sequence, the tokens stored after appending counts[b] more (dropping those a window
    /// no longer needs); counts must be valid for append. \throws shape_error when counts has
    /// not batch() entries.
    std::vector<Index> lengths_after(const std::vector<Index>& counts) const {
        check_counts("gattn::KVCache::lengths_after", counts);
        std::vector<Index> l = m_lengths;
        for (std::size_t b = 0; b < l.size(); ++b)
            l[b] = (m_window > 0 && l[b] + counts[b] > m_capacity ? kept(l[b]) : l[b]) + counts[b];
        return l;
    }
    /// The capacity after appending counts (as append grows a window cache). \throws
    /// shape_error when counts has not batch() entries.
    Index capacity_after(const std::vector<Index>& counts) const {
        check_counts("gattn::KVCache::capacity_after", counts);
        Index needed = m_capacity;
        if (m_window > 0)
            for (std::size_t b = 0; b < m_lengths.size(); ++b)
                if (m_lengths[b] + counts[b] > m_capacity) needed = std::max(needed, kept(m_lengths[b]) + counts[b]);
        return needed == m_capacity ? m_capacity : std::max(needed, 2 * m_window);
    }
    /// The heads the cache was made for (value_head_dim as resolved: head_dim when given as 0).
    Index num_kv_heads() const noexcept { return m_num_kv_heads; }
    /// Features per key head (d_k).
    Index head_dim() const noexcept { return m_head_dim; }
    /// Features per value head (d_v).
    Index value_head_dim() const noexcept { return m_value_head_dim; }
    /// Tokens stored per sequence (tokens seen, without a window).
    const std::vector<Index>& lengths() const noexcept { return m_lengths; }
    /// [B·capacity, H_kv·d_k]; rows b·capacity + t for t < lengths()[b] are valid.
    const RowMatrix<Scalar>& keys() const noexcept { return m_keys; }
    /// [B·capacity, H_kv·d_v].
    const RowMatrix<Scalar>& values() const noexcept { return m_values; }
    /// Bytes of keys() and values() advised into transparent huge pages (cache/huge_pages.hpp):
    /// 0 where the system does not use them.
    std::size_t huge_page_bytes() const noexcept { return m_huge_page_bytes; }
    /// int8 cache: [B·capacity, H_kv], the scale of each stored key row of each KV head
    /// (empty for other storage).
    const RowMatrix<float>& key_scales() const noexcept { return m_key_scales; }
    /// int8 cache: [B·capacity, H_kv], the scales of the value rows (empty for other storage).
    const RowMatrix<float>& value_scales() const noexcept { return m_value_scales; }
    /// The keys as SDPA reads them: keys(), or (int8) the codes with their scales.
    Operand key_operand() const noexcept { return operand(m_keys, m_key_scales); }
    /// The values as SDPA reads them: values(), or (int8) the codes with their scales.
    Operand value_operand() const noexcept { return operand(m_values, m_value_scales); }

    /// Appends counts[b] tokens to sequence b: rows b·n + t (t < counts[b]) of k and v, where
    /// n = k.rows() / batch(). A window cache first drops the tokens the window no longer needs
    /// when they do not fit (see the class), and grows when they still do not.
    /// An int8 cache quantizes each appended row (ops/int8_rows.hpp).
    /// \throws std::invalid_argument when a count is outside [0, n], a sequence would exceed the
    /// capacity (without a window), k or v shares an element with the cache's storage, or (int8
    /// cache) an appended value is NaN or infinite (the message names the tensor, row and
    /// column); shape_error for k/v of the wrong shape or counts without batch() entries. Nothing
    /// is written on error.
    void append(ConstMatrixRef<Input> k, ConstMatrixRef<Input> v, const std::vector<Index>& counts) {
        constexpr const char* fn = "gattn::KVCache::append";
        const Index B = batch();
        if (k.rows() % B != 0 || k.cols() != m_keys.cols())
            detail::throw_shape(fn, "k",
                                "[B*n, " + std::to_string(m_keys.cols()) + "] (B = the cache's batch, " +
                                    std::to_string(B) + ")",
                                detail::shape_string({k.rows(), k.cols()}));
        const Index n = k.rows() / B;
        detail::check_shape(fn, "v", v.rows(), v.cols(), k.rows(), m_values.cols());
        if (static_cast<Index>(counts.size()) != B)
            detail::throw_shape(fn, "counts", detail::shape_string({B}),
                                detail::shape_string({static_cast<Index>(counts.size())}));
        for (Index b = 0; b < B; ++b) {
            if (counts[b] < 0 || counts[b] > n)
                detail::throw_invalid(fn, "counts[" + std::to_string(b) + "]",
                                      "must be in [0, " + std::to_string(n) + "], got " + std::to_string(counts[b]));
            if (m_window == 0 && m_lengths[b] + counts[b] > m_capacity)
                detail::throw_invalid(fn, "counts[" + std::to_string(b) + "]",
                                      "would exceed the capacity " + std::to_string(m_capacity) + " (sequence holds " +
                                          std::to_string(m_lengths[b]) + ")");
        }
        // Rows are copied in place: k or v inside the cache's own storage would be overwritten
        // while being read.
        for (const auto& [view, name] : {std::pair<const ConstMatrixRef<Input>*, const char*>{&k, "k"}, {&v, "v"}}) {
            if (gattn::detail::views_overlap(*view, m_keys) || gattn::detail::views_overlap(*view, m_values) ||
                gattn::detail::views_overlap(*view, m_key_scales) ||
                gattn::detail::views_overlap(*view, m_value_scales))
                detail::throw_invalid(fn, name, "must not share an element with the cache's keys or values");
            if constexpr (kInt8) {  // int8 codes stand for finite values only
                const Index d = view == &k ? m_head_dim : m_value_head_dim;
                for (Index b = 0; b < B; ++b)
                    for (Index r = b * n; r < b * n + counts[b]; ++r)
                        for (Index c = 0; c < view->cols(); ++c)
                            if (!std::isfinite((*view)(r, c)))
                                detail::throw_invalid(
                                    fn, name,
                                    "row " + std::to_string(r) + " (sequence " + std::to_string(b) + ", new token " +
                                        std::to_string(r - b * n) + "), column " + std::to_string(c) + " (KV head " +
                                        std::to_string(c / d) + ", feature " + std::to_string(c % d) + ") is " +
                                        std::to_string((*view)(r, c)) +
                                        ": an int8 cache stores finite values only (a layer appends the keys and "
                                        "values it projects: a NaN or infinity in its input or weights ends here)");
            }
        }
        if (m_window > 0) make_room(counts);
        for (Index b = 0; b < B; ++b) {
            const Index at = b * m_capacity + m_lengths[b];
            if constexpr (kInt8) {
                for (Index t = 0; t < counts[b]; ++t) {
                    quantize_int8_row(k.row(b * n + t).data(), m_num_kv_heads, m_head_dim, m_keys.row(at + t).data(),
                                      m_key_scales.row(at + t).data());
                    quantize_int8_row(v.row(b * n + t).data(), m_num_kv_heads, m_value_head_dim,
                                      m_values.row(at + t).data(), m_value_scales.row(at + t).data());
                }
            } else {
                m_keys.middleRows(at, counts[b]) = k.middleRows(b * n, counts[b]);
                m_values.middleRows(at, counts[b]) = v.middleRows(b * n, counts[b]);
            }
            m_lengths[b] += counts[b];
        }
    }

    /// Rolls sequences back to fewer stored tokens (e.g. rejected speculative tokens). A window
    /// cache that has dropped tokens of a sequence keeps at least its last w − 1 (the next
    /// token's window would reach tokens no longer stored).
    /// \throws shape_error when lengths has not batch() entries.
    /// \throws std::invalid_argument when a length is negative, longer than the current one, or
    ///         below w − 1 in a window cache's sequence that has dropped tokens.
    void truncate(const std::vector<Index>& lengths) {
        check_truncate(lengths);
        m_lengths = lengths;
    }

    /// Throws what truncate(lengths) would throw, and changes nothing.
    void check_truncate(const std::vector<Index>& lengths) const {
        constexpr const char* fn = "gattn::KVCache::truncate";
        if (lengths.size() != m_lengths.size())
            detail::throw_shape(fn, "lengths", detail::shape_string({batch()}),
                                detail::shape_string({static_cast<Index>(lengths.size())}));
        for (std::size_t b = 0; b < lengths.size(); ++b)
            if (lengths[b] < min_length(b) || lengths[b] > m_lengths[b])
                detail::throw_invalid(fn, "lengths[" + std::to_string(b) + "]",
                                      "must be in [" + std::to_string(min_length(b)) + ", " +
                                          std::to_string(m_lengths[b]) + "], got " + std::to_string(lengths[b]) +
                                          (min_length(b) > 0 ? " (after dropping tokens a window cache keeps "
                                                               "at least window − 1)"
                                                             : ""));
    }

    /// Forgets every token (lengths and first positions back to 0).
    void clear() noexcept {
        for (auto& l : m_lengths) l = 0;
        for (auto& f : m_first) f = 0;
    }

    /// The fewest tokens sequence b can be truncated to: w − 1 once a window cache has dropped
    /// some of its tokens, else 0.
    Index min_length(std::size_t b) const noexcept { return m_window > 0 && m_first[b] > 0 ? m_window - 1 : 0; }

private:
    static Index validated_window(Index window) {
        if (window < 0 || window > (Index(1) << 40))
            detail::throw_invalid("gattn::KVCache", "window",
                                  "must be in [0, 2^40] (0 = keep every token), got " + std::to_string(window));
        return window;
    }

    void check_counts(const char* fn, const std::vector<Index>& counts) const {
        if (counts.size() != m_lengths.size())
            detail::throw_shape(fn, "counts", detail::shape_string({batch()}),
                                detail::shape_string({static_cast<Index>(counts.size())}));
    }

    static Operand operand(const RowMatrix<Scalar>& m, [[maybe_unused]] const RowMatrix<float>& scales) noexcept {
        if constexpr (kInt8)
            return Int8Rows{m.data(), m.rows(), m.cols(), m.cols(), scales.data(), scales.cols()};
        else
            return Operand(m);
    }

    // Tokens of `length` stored that the next token's window still sees: the last w − 1.
    Index kept(Index length) const noexcept { return std::min(length, m_window - 1); }

    // Window cache: drops, in each sequence whose counts do not fit, the tokens the window no
    // longer needs (moving the kept ones to the front), and grows the rows when they still do
    // not fit (capacity_after).
    void make_room(const std::vector<Index>& counts) {
        const Index B = batch(), capacity = capacity_after(counts);
        std::vector<Index> keep(static_cast<std::size_t>(B));
        for (Index b = 0; b < B; ++b)
            keep[b] = m_lengths[b] + counts[b] > m_capacity ? kept(m_lengths[b]) : m_lengths[b];
        // Each matrix of rows (keys, values, and an int8 cache's scales) keeps the same rows.
        if (capacity != m_capacity) {
            // Every grown matrix first, then swaps (which cannot throw): a failed allocation
            // leaves the cache as it was.
            // The keys and values (not the scales) in huge pages, advised before they are written.
            std::size_t advised = 0;
            auto grown = [&](const auto& m, bool huge) {
                std::decay_t<decltype(m)> g(m.size() == 0 ? m.rows() : B * capacity, m.cols());
                if (huge) advised += detail::advise_storage(g);
                if (m.size() != 0)
                    for (Index b = 0; b < B; ++b)
                        g.middleRows(b * capacity, keep[b]) =
                            m.middleRows(b * m_capacity + m_lengths[b] - keep[b], keep[b]);
                return g;
            };
            auto keys = grown(m_keys, true), values = grown(m_values, true);
            auto key_scales = grown(m_key_scales, false), value_scales = grown(m_value_scales, false);
            m_keys.swap(keys);
            m_values.swap(values);
            m_huge_page_bytes = advised;
            m_key_scales.swap(key_scales);
            m_value_scales.swap(value_scales);
        } else {
            auto keep_rows = [&](auto& m) {
                using M = std::decay_t<decltype(m)>;
                // Rows are contiguous: memmove handles the overlap of the kept rows and the front.
                for (Index b = 0; b < B && m.size() != 0; ++b) {
                    if (keep[b] == m_lengths[b] || keep[b] == 0) continue;
                    const Index from = b * m_capacity + m_lengths[b] - keep[b], to = b * m_capacity;
                    std::memmove(m.row(to).data(), m.row(from).data(),
                                 sizeof(typename M::Scalar) * static_cast<std::size_t>(keep[b] * m.cols()));
                }
            };
            keep_rows(m_keys);
            keep_rows(m_values);
            keep_rows(m_key_scales);
            keep_rows(m_value_scales);
        }
        for (Index b = 0; b < B; ++b) {
            m_first[b] += m_lengths[b] - keep[b];
            m_lengths[b] = keep[b];
        }
        m_capacity = capacity;
    }

    // Checks the constructor's sizes before anything is allocated; returns capacity.
    static Index validated_capacity(Index batch, Index capacity, Index num_kv_heads, Index head_dim,
                                    Index value_head_dim) {
        constexpr const char* fn = "gattn::KVCache";
        auto positive = [&](Index v, const char* name) {
            if (v < 1) detail::throw_invalid(fn, name, "must be >= 1, got " + std::to_string(v));
        };
        positive(batch, "batch");
        positive(capacity, "capacity");
        positive(num_kv_heads, "num_kv_heads");
        positive(head_dim, "head_dim");
        if (value_head_dim < 0)
            detail::throw_invalid(fn, "value_head_dim",
                                  "must be >= 0 (0 = head_dim), got " + std::to_string(value_head_dim));
        const Index width = std::max(head_dim, value_head_dim), max = std::numeric_limits<Index>::max();
        if (capacity > max / batch || num_kv_heads > max / width || batch * capacity > max / (num_kv_heads * width))
            detail::throw_invalid(fn, "capacity",
                                  "batch·capacity·num_kv_heads·head_dim overflows: batch " + std::to_string(batch) +
                                      ", capacity " + std::to_string(capacity) + ", num_kv_heads " +
                                      std::to_string(num_kv_heads) + ", head_dim " + std::to_string(width));
        return capacity;
    }

    LayerId m_owner;
    Index m_window;
    Index m_capacity, m_num_kv_heads, m_head_dim, m_value_head_dim;
    std::vector<Index> m_lengths, m_first;
    RowMatrix<Scalar> m_keys, m_values;
    RowMatrix<float> m_key_scales, m_value_scales;  // int8: [B·capacity, H_kv]; else empty
    std::size_t m_huge_page_bytes = 0;              // of m_keys and m_values (advise_huge_pages)
};

/// The caches of a model: one per layer, made by the layers' make_cache (so each layer takes
/// only its own), for the same sequences, truncated and cleared together.
template <class Scalar>
class KVCacheSet {
public:
    KVCacheSet() = default;

    /// One cache per layer, in the layers' order: layers[i]->make_cache<Scalar>(batch, capacity)
    /// (Scalar: the layers' storage, std::int8_t for int8 caches of float-computing layers, or
    /// bf16 or fp16 for 16-bit caches of float layers).
    /// Layer: any layer with make_cache (GatedMultiHeadAttention, Qwen3NextAttention).
    /// \throws as KVCache's constructor.
    template <class Layer>
    KVCacheSet(const std::vector<const Layer*>& layers, Index batch, Index capacity) {
        m_caches.reserve(layers.size());
        for (const Layer* layer : layers) m_caches.push_back(layer->template make_cache<Scalar>(batch, capacity));
    }

    /// Caches (layers).
    std::size_t size() const noexcept { return m_caches.size(); }
    /// Layer i's cache. \throws std::out_of_range for i ≥ size().
    KVCache<Scalar>& operator[](std::size_t i) { return m_caches.at(i); }
    /// Layer i's cache. \throws std::out_of_range for i ≥ size().
    const KVCache<Scalar>& operator[](std::size_t i) const { return m_caches.at(i); }
    /// Tokens seen per sequence (KVCache::tokens_seen of the first layer; every layer's after a
    /// model step), whether or not a layer keeps only a window of them.
    /// \throws std::out_of_range when the set is empty.
    std::vector<Index> lengths() const { return m_caches.at(0).tokens_seen(); }

    /// Rolls every layer's sequences back to `lengths` tokens seen, all or none (a window
    /// layer's cache only as far as KVCache::truncate allows).
    /// \throws shape_error when lengths has not batch entries; std::invalid_argument when a
    ///         length is outside what some layer's cache can roll back to (the message gives
    ///         the range in tokens seen). Checked on every cache before any changes.
    void truncate(const std::vector<Index>& lengths) {
        constexpr const char* fn = "gattn::KVCacheSet::truncate";
        for (const KVCache<Scalar>& c : m_caches) {
            if (lengths.size() != c.lengths().size())
                detail::throw_shape(fn, "lengths", detail::shape_string({c.batch()}),
                                    detail::shape_string({static_cast<Index>(lengths.size())}));
            const std::vector<Index> seen = c.tokens_seen();
            for (std::size_t b = 0; b < lengths.size(); ++b) {
                const Index lo = c.first_positions()[b] + c.min_length(b), hi = seen[b];
                if (lengths[b] < lo || lengths[b] > hi)
                    detail::throw_invalid(fn, "lengths[" + std::to_string(b) + "]",
                                          "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                              "] tokens seen, got " + std::to_string(lengths[b]));
            }
        }
        for (KVCache<Scalar>& c : m_caches) c.truncate(stored(c, lengths));
    }
    /// Forgets every token of every layer.
    void clear() noexcept {
        for (KVCache<Scalar>& c : m_caches) c.clear();
    }

private:
    // Tokens seen → tokens stored in cache c.
    static std::vector<Index> stored(const KVCache<Scalar>& c, std::vector<Index> tokens) {
        for (std::size_t b = 0; b < tokens.size() && b < c.first_positions().size(); ++b)
            tokens[b] -= c.first_positions()[b];
        return tokens;
    }

    std::vector<KVCache<Scalar>> m_caches;
};

namespace detail {

/// Validates the arguments a layer's cache forward shares (GatedMultiHeadAttention,
/// Qwen3NextAttention) and returns the lengths the cache will have after the call.
/// x: [B·N, width] with B = cache.batch() (N new token slots per sequence); out: [B·N, width],
/// sharing no element with x or with the cache's keys or values (the layers append to the cache
/// before they are done reading x, and write out after reading the cache); the cache's heads:
/// the layer's (num_kv_heads, head_dim, value_head_dim), which its widths alone would not tell
/// apart; the cache's owner: this layer or none; the cache's window: none, or the layer's
/// sliding window (window, 0 = none: a cache that drops tokens would hide keys the layer sees);
/// counts: B entries in [0, N] that fit the capacity (empty becomes N for every sequence).
/// \throws shape_error for x, out, counts or the cache's heads; std::invalid_argument for a
///         cache made by another layer, a count outside [0, N], a sequence that would exceed the
///         capacity, or out or x overlapping what they must not. Every message is named by fn
///         and the argument.
template <class Scalar, class X, class Y>
std::vector<Index> validate_cache_call(const char* fn, LayerId layer, const KVCache<Scalar>& cache,
                                       const ConstMatrixRef<X>& x, const MatrixRef<Y>& out, const char* width_name,
                                       Index width, Index num_kv_heads, Index head_dim, Index value_head_dim,
                                       Index window, std::vector<Index>& counts) {
    const Index B = cache.batch();
    if (x.cols() != width || x.rows() % B != 0)
        throw_shape(fn, "x",
                    "[B*N, " + std::string(width_name) + "] = [multiple of " + std::to_string(B) + ", " +
                        std::to_string(width) + "] (B = the cache's batch, " + std::to_string(B) + ")",
                    shape_string({x.rows(), x.cols()}));
    const Index N = x.rows() / B;
    check_output(fn, "out", out, x.rows(), width);
    if (views_overlap(out, x)) throw_invalid(fn, "out", "must not overlap x");
    auto heads = [](Index h, Index d, Index dv) {
        return "num_kv_heads " + std::to_string(h) + ", head_dim " + std::to_string(d) + ", value_head_dim " +
               std::to_string(dv);
    };
    // Heads first: a cache of other heads is a shape_error whoever made it.
    if (cache.num_kv_heads() != num_kv_heads || cache.head_dim() != head_dim ||
        cache.value_head_dim() != value_head_dim)
        throw shape_error(std::string(fn) + ": cache must hold this layer's heads (" +
                          heads(num_kv_heads, head_dim, value_head_dim) + "), got " +
                          heads(cache.num_kv_heads(), cache.head_dim(), cache.value_head_dim()));
    if (cache.owner() != 0 && cache.owner() != layer)
        throw_invalid(fn, "cache",
                      "belongs to another layer (made by make_cache of layer " + std::to_string(cache.owner()) +
                          "; this is layer " + std::to_string(layer) +
                          "; layer_id() numbers layers in the order they are constructed): every layer needs its "
                          "own cache, made by its make_cache");
    if (cache.window() != 0 && cache.window() != window)
        throw_invalid(fn, "cache",
                      "keeps only a window of " + std::to_string(cache.window()) + " tokens; this layer's window is " +
                          (window ? std::to_string(window) : std::string("none (it sees every token)")));
    auto holds = [&](const auto& view) {  // shares an element with the cache's storage
        return views_overlap(view, cache.keys()) || views_overlap(view, cache.values()) ||
               views_overlap(view, cache.key_scales()) || views_overlap(view, cache.value_scales());
    };
    for (const auto& [overlaps, name] : {std::pair<bool, const char*>{holds(x), "x"}, {holds(out), "out"}})
        if (overlaps) throw_invalid(fn, name, "must not share an element with the cache's keys or values");
    if (counts.empty()) counts.assign(static_cast<std::size_t>(B), N);
    if (static_cast<Index>(counts.size()) != B)
        throw_shape(fn, "counts", shape_string({B}), shape_string({static_cast<Index>(counts.size())}));
    for (Index b = 0; b < B; ++b) {
        if (counts[b] < 0 || counts[b] > N)
            throw_invalid(fn, "counts[" + std::to_string(b) + "]",
                          "must be in [0, " + std::to_string(N) + "], got " + std::to_string(counts[b]));
    }
    if (cache.window() > 0) return cache.lengths_after(counts);  // it makes room
    std::vector<Index> lengths = cache.lengths();
    for (Index b = 0; b < B; ++b) {
        if (lengths[b] + counts[b] > cache.capacity())
            throw_invalid(fn, "cache",
                          "sequence " + std::to_string(b) + " would exceed the capacity " +
                              std::to_string(cache.capacity()) + " (holds " + std::to_string(lengths[b]) + ", adding " +
                              std::to_string(counts[b]) + ")");
        lengths[b] += counts[b];
    }
    return lengths;
}

}  // namespace detail

GATTN_END_ISA_NAMESPACE
