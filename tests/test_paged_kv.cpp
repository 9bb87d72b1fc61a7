// The paged KV pool (cache/paged_kv_pool.hpp) and attention over its pages (ops/paged_sdpa.hpp).
// The pool: pages taken, shared by fork, copied on write, released by truncate and free and
// reused, and every error leaving the pool byte for byte as it was. Attention, decoding and
// prefill: every storage type (float, double, bf16, fp16, int8), page sizes 16 to 256 and every
// mask or variant against scaled_dot_product_attention over a KVCache holding the same tokens,
// which the paged call must equal bitwise (outputs, log-sum-exp, first-key probability), on
// every kernel family this CPU offers, with 1 and 2 threads.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <sys/mman.h>

#include "gattn/cache/paged_kv_pool.hpp"
#include "gattn/gattn.hpp"
#include "gattn/ops/paged_sdpa.hpp"
#include "support/compare.hpp"
#include "support/kernel_limit.hpp"

namespace paged_kv_test {

using gattn::Index;
using gattn::PagedKVPool;
using gattn::RowMatrix;
using gattn::SequenceId;

template <class M>
std::string bytes_of(const M& m) {
    return std::string(reinterpret_cast<const char*>(m.data()), sizeof(*m.data()) * static_cast<std::size_t>(m.size()));
}

/// Everything a pool holds: stored rows, page counts, free pages, sequences and their pages.
template <class S>
std::string snapshot(const PagedKVPool<S>& pool, const std::vector<SequenceId>& seqs) {
    std::string s = bytes_of(pool.keys()) + bytes_of(pool.values()) + bytes_of(pool.key_scales()) +
                    bytes_of(pool.value_scales()) + "|free " + std::to_string(pool.free_pages()) + "|seqs " +
                    std::to_string(pool.num_sequences());
    for (Index p = 0; p < pool.num_pages(); ++p) s += "," + std::to_string(pool.ref_count(p));
    for (SequenceId id : seqs) {
        s += "|" + std::to_string(pool.length(id)) + ":";
        for (Index p : pool.pages(id)) s += std::to_string(p) + " ";
    }
    return s;
}

template <class S>
RowMatrix<S> random_rows(Index rows, Index cols, std::mt19937& rng) {
    std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
    RowMatrix<S> m(rows, cols);
    for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<S>(dist(rng));
    return m;
}

/// Pool row `row` of keys (all heads) as floats.
template <class S>
float key_at(const PagedKVPool<S>& pool, Index row, Index col) {
    return static_cast<float>(pool.keys()(row, col));
}

TEST(PagedKVPool, PagesTakenSharedCopiedAndReused) {
    PagedKVPool<float> pool(8, 16, 2, 4);  // 8 pages of 16 tokens, rows of 2·4 floats
    EXPECT_EQ(pool.free_pages(), 8);
    const SequenceId a = pool.allocate();
    EXPECT_EQ(a, 0);
    std::mt19937 rng(1);
    const RowMatrix<float> k = random_rows<float>(40, 8, rng), v = random_rows<float>(40, 8, rng);
    pool.append({a}, k.topRows(20), v.topRows(20), {20});  // pages 0 (full) and 1 (4 tokens)
    EXPECT_EQ(pool.length(a), 20);
    EXPECT_EQ(pool.pages(a), (std::vector<Index>{0, 1}));
    EXPECT_EQ(pool.free_pages(), 6);
    // Token 17 sits in page 1, slot 1.
    EXPECT_EQ(pool.keys().row(1 * 16 + 1), k.row(17));
    EXPECT_EQ(pool.values().row(1 * 16 + 1), v.row(17));

    // fork shares both pages; appending to the child copies the shared partial page 1 first.
    const SequenceId c = pool.fork(a);
    EXPECT_EQ(c, 1);
    EXPECT_EQ(pool.ref_count(0), 2);
    EXPECT_EQ(pool.ref_count(1), 2);
    const RowMatrix<float> parent_page1 = pool.keys().middleRows(16, 16);
    pool.append({c}, k.middleRows(20, 2), v.middleRows(20, 2), {2});
    EXPECT_EQ(pool.pages(c), (std::vector<Index>{0, 2}));  // page 2: a copy of page 1, then 2 tokens
    EXPECT_EQ(pool.ref_count(0), 2);
    EXPECT_EQ(pool.ref_count(1), 1);
    EXPECT_EQ(pool.ref_count(2), 1);
    EXPECT_EQ(pool.keys().middleRows(16, 4), parent_page1.topRows(4));  // the parent's page untouched
    EXPECT_EQ(pool.keys().middleRows(32, 4), parent_page1.topRows(4));  // copied
    EXPECT_EQ(pool.keys().middleRows(36, 2), k.middleRows(20, 2));      // the child's own tokens
    // Nothing written into page 1: its unwritten slots hold whatever the allocator left, NaN
    // patterns included, so the page is compared byte by byte.
    EXPECT_TRUE(gattn_test::same_bytes(pool.keys().middleRows(16, 16), parent_page1));
    // The parent, now the only holder of page 1, appends into it in place.
    pool.append({a}, k.middleRows(30, 1), v.middleRows(30, 1), {1});
    EXPECT_EQ(pool.pages(a), (std::vector<Index>{0, 1}));
    EXPECT_EQ(pool.keys().row(16 + 4), k.row(30));

    // Two forks of a parent sharing its partial page, appended in one call: both copy it (the
    // parent still holds it), and the parent is left its only holder.
    const SequenceId d = pool.fork(a), e = pool.fork(a);
    EXPECT_EQ(pool.ref_count(1), 3);
    pool.append({d, e}, k.topRows(2), v.topRows(2), {1, 1});
    EXPECT_EQ(pool.ref_count(1), 1);
    EXPECT_NE(pool.pages(d)[1], 1);
    EXPECT_NE(pool.pages(e)[1], 1);
    EXPECT_NE(pool.pages(d)[1], pool.pages(e)[1]);

    // truncate releases whole pages past the length (shared ones only lose a holder).
    EXPECT_EQ(pool.free_pages(), 3);
    pool.truncate(c, 16);
    EXPECT_EQ(pool.pages(c), (std::vector<Index>{0}));
    EXPECT_EQ(pool.ref_count(2), 0);
    EXPECT_EQ(pool.free_pages(), 4);
    // The freed page is the next one taken (last freed, first reused).
    pool.append({c}, k.topRows(1), v.topRows(1), {1});
    EXPECT_EQ(pool.pages(c), (std::vector<Index>{0, 2}));
    // free releases every page and the id is reused.
    for (SequenceId s : {a, c, d, e}) pool.free(s);
    EXPECT_EQ(pool.free_pages(), 8);
    EXPECT_EQ(pool.num_sequences(), 0);
    EXPECT_EQ(pool.allocate(), 0);
    // A page table in FlashInfer's layout.
    const SequenceId f = pool.allocate();
    pool.append({0, f}, k.topRows(40), v.topRows(40), {17, 3});
    const gattn::PageTable t = pool.page_table({f, 0});
    EXPECT_EQ(t.indptr, (std::vector<Index>{0, 1, 3}));
    EXPECT_EQ(t.last_page_len, (std::vector<Index>{3, 1}));
    EXPECT_EQ(t.length(0, 16), 3);
    EXPECT_EQ(t.length(1, 16), 17);
    EXPECT_NO_THROW(pool.check_table("test", t));
}

TEST(PagedKVPool, Int8PoolQuantizesAsTheCacheDoes) {
    PagedKVPool<std::int8_t> pool(4, 16, 2, 8);
    gattn::KVCache<std::int8_t> cache(1, 20, 2, 8);
    std::mt19937 rng(2);
    const RowMatrix<float> k = random_rows<float>(20, 16, rng), v = random_rows<float>(20, 16, rng);
    const SequenceId s = pool.allocate();
    pool.append({s}, k, v, {20});
    cache.append(k, v, {20});
    const Index page1 = pool.pages(s)[1];
    EXPECT_EQ(pool.keys().middleRows(page1 * 16, 4), cache.keys().middleRows(16, 4));
    EXPECT_EQ(pool.value_scales().middleRows(page1 * 16, 4), cache.value_scales().middleRows(16, 4));
    EXPECT_EQ(pool.storage_bytes(), 4 * 16 * (2 * 16 + 4 * 4));
}

/// A sliding window of w keys: the pages whose tokens all come before token length − w + 1 go
/// (hand-counted below with P = 16); the rest stay in place, in order, and appending goes on
/// after them. A page a fork still holds is not freed.
TEST(PagedKVPool, ReleaseOutsideWindowDropsHiddenFrontPages) {
    PagedKVPool<float> pool(8, 16, 1, 4);
    std::mt19937 rng(7);
    const RowMatrix<float> k = random_rows<float>(60, 4, rng), v = random_rows<float>(60, 4, rng);
    const SequenceId a = pool.allocate();
    pool.append({a}, k.topRows(50), v.topRows(50), {50});  // pages 0..3, 50 tokens
    const std::vector<Index> pages = pool.pages(a);
    const SequenceId child = pool.fork(a);
    // The next token (50) sees tokens 31..50 with w = 20: tokens 0..15 (page 0) are hidden,
    // page 1 holds token 31.
    EXPECT_EQ(pool.release_outside_window(a, 20), 1);
    EXPECT_EQ(pool.first_position(a), 16);
    EXPECT_EQ(pool.min_truncate_length(a), 35);  // token 35 would see 16..35
    EXPECT_EQ(pool.min_truncate_length(child), 0);
    EXPECT_EQ(pool.length(a), 50);
    EXPECT_EQ(pool.pages(a), std::vector<Index>(pages.begin() + 1, pages.end()));
    EXPECT_EQ(pool.ref_count(pages[0]), 1);  // the fork still holds it
    EXPECT_EQ(pool.free_pages(), 4);
    gattn::PageTable table = pool.page_table({a});
    EXPECT_EQ(table.length(0, 16), 34);
    EXPECT_EQ(table.last_page_len[0], 2);
    EXPECT_EQ(pool.release_outside_window(a, 20), 0);  // nothing more is hidden
    EXPECT_EQ(pool.page_table({child}).length(0, 16), 50);
    pool.free(child);  // page 0 is free now; pages 1..3 are a's alone
    EXPECT_EQ(pool.free_pages(), 5);
    // w = 35: token 50 sees 16..50; nothing goes. w = 3: tokens up to 47 are hidden, pages 1
    // and 2 (tokens 16..47) go.
    EXPECT_EQ(pool.release_outside_window(a, 35), 0);
    EXPECT_EQ(pool.min_truncate_length(a), 50);  // 16 + 34
    EXPECT_EQ(pool.release_outside_window(a, 3), 2);
    EXPECT_EQ(pool.first_position(a), 48);
    EXPECT_EQ(pool.min_truncate_length(a), 50);  // the last call's window: token 50 sees 48..50
    EXPECT_EQ(pool.free_pages(), 7);
    // Appending goes on in the last page: tokens 50..51 at slots 2..3 of page 3.
    pool.append({a}, k.middleRows(50, 2), v.middleRows(50, 2), {2});
    EXPECT_EQ(pool.pages(a), std::vector<Index>{pages[3]});
    EXPECT_EQ(pool.keys().row(pages[3] * 16 + 3), k.row(51));
    EXPECT_EQ(pool.keys().row(pages[3] * 16 + 0), k.row(48));
    // w = 1: the next token sees only itself; every page goes, even the partial last one.
    EXPECT_EQ(pool.release_outside_window(a, 1), 1);
    EXPECT_EQ(pool.first_position(a), 52);
    EXPECT_TRUE(pool.pages(a).empty());
    EXPECT_EQ(pool.page_table({a}).last_page_len[0], 0);
    pool.append({a}, k.middleRows(52, 3), v.middleRows(52, 3), {3});  // a new page, slots 0..2
    ASSERT_EQ(pool.pages(a).size(), 1u);
    EXPECT_EQ(pool.keys().row(pool.pages(a)[0] * 16 + 2), k.row(54));
    EXPECT_EQ(pool.length(a), 55);
    // Released tokens cannot come back; the rest can be rolled back.
    EXPECT_THROW(pool.truncate(a, 51), std::invalid_argument);
    pool.truncate(a, 52);
    EXPECT_TRUE(pool.pages(a).empty());
    EXPECT_EQ(pool.length(a), 52);
    EXPECT_EQ(pool.free_pages(), 8);
    // A wider window afterwards: the floor stops at the length (52 + 39 would pass it).
    EXPECT_EQ(pool.release_outside_window(a, 40), 0);
    EXPECT_EQ(pool.min_truncate_length(a), 52);
    pool.truncate(a, 52);
}

/// release_outside_window from an earlier token: what token `position` and later no longer see,
/// so that a rollback to `position` stays possible (a layer's step releases from its first new
/// token). Hand-counted with P = 16, w = 4.
TEST(PagedKVPool, ReleaseFromAnEarlierTokenKeepsItsWindow) {
    PagedKVPool<float> pool(8, 16, 1, 4);
    std::mt19937 rng(11);
    const RowMatrix<float> k = random_rows<float>(70, 4, rng), v = random_rows<float>(70, 4, rng);
    const SequenceId a = pool.allocate();
    pool.append({a}, k.topRows(41), v.topRows(41), {41});                // pages 0..2
    pool.append({a}, k.middleRows(41, 24), v.middleRows(41, 24), {24});  // a step of 24: 65 tokens, pages 0..4
    // From the step's first token, 41: it sees 38..41, so pages 0 and 1 (tokens 0..31) go; from
    // the next token, 65, page 2 (tokens 32..47) would go too.
    EXPECT_EQ(pool.release_outside_window(a, 4, 41), 2);
    EXPECT_EQ(pool.first_position(a), 32);
    EXPECT_EQ(pool.min_truncate_length(a), 35);
    pool.truncate(a, 41);  // the rollback of the step
    EXPECT_EQ(pool.length(a), 41);
    EXPECT_EQ(pool.keys().row(pool.pages(a)[0] * 16 + 6), k.row(38));  // token 38 is where it was
    EXPECT_EQ(pool.release_outside_window(a, 4, 0), 0);                // nothing is hidden from token 0
    EXPECT_EQ(pool.release_outside_window(a, 4), 0);                   // token 41 sees 38..41: page 2 stays
    EXPECT_EQ(pool.first_position(a), 32);
}

// The widest window (every key visible, as large as Index allows) sets a rollback bound that
// must not overflow: truncate may not go below the tokens already released.
TEST(PagedKVPool, TheWidestWindowKeepsTheRollbackBound) {
    PagedKVPool<float> pool(8, 16, 1, 8);
    std::mt19937 rng(12);
    const RowMatrix<float> k = random_rows<float>(41, 8, rng), v = random_rows<float>(41, 8, rng);
    const SequenceId a = pool.allocate();
    pool.append({a}, k.topRows(40), v.topRows(40), {40});
    EXPECT_EQ(pool.release_outside_window(a, 8), 2);  // token 40 sees 33..40: tokens 0..31 go
    EXPECT_EQ(pool.first_position(a), 32);
    EXPECT_EQ(pool.release_outside_window(a, std::numeric_limits<Index>::max()), 0);
    EXPECT_EQ(pool.min_truncate_length(a), 40);  // the next token's window reaches every stored key
    EXPECT_THROW(pool.truncate(a, 16), std::invalid_argument);
    EXPECT_EQ(pool.length(a), 40);
    pool.append({a}, k.bottomRows(1), v.bottomRows(1), {1});
    EXPECT_EQ(pool.length(a), 41);
    EXPECT_EQ(pool.keys().row(pool.pages(a)[0] * 16 + 8), k.row(40));  // token 40: page of 32..47, slot 8
}

// A full pool is a state a server handles (free or preempt, then retry), so it has its own type.
TEST(PagedKVPool, TooFewFreePagesThrowOutOfPages) {
    PagedKVPool<float> pool(2, 16, 1, 4);
    std::mt19937 rng(13);
    const RowMatrix<float> k = random_rows<float>(40, 4, rng), v = random_rows<float>(40, 4, rng);
    const SequenceId a = pool.allocate();
    try {
        pool.append({a}, k, v, {40});  // 3 pages needed, 2 free
        ADD_FAILURE() << "no error";
    } catch (const gattn::out_of_pages& e) {
        EXPECT_NE(std::string(e.what()).find("free_pages()"), std::string::npos) << e.what();
    }
    EXPECT_EQ(pool.length(a), 0);
    EXPECT_EQ(pool.free_pages(), 2);
    EXPECT_THROW(pool.append({a}, k, v, {40}), std::invalid_argument);  // still one of those
}

// A forked sequence whose append copied its shared partial page, then restored to its mark:
// it shares the page again (the copy goes back), so the next append of either sequence copies
// as it would have; a mark older than a truncate is refused.
TEST(PagedKVPool, RestoreSharesAgainWhatACopyOnWriteTookApart) {
    PagedKVPool<float> pool(8, 16, 1, 4);
    std::mt19937 rng(14);
    const RowMatrix<float> k = random_rows<float>(22, 4, rng), v = random_rows<float>(22, 4, rng);
    const SequenceId root = pool.allocate();
    pool.append({root}, k.topRows(20), v.topRows(20), {20});  // pages: 16 + 4 tokens
    const SequenceId f = pool.fork(root);
    const std::vector<Index> shared = pool.pages(root);
    const auto mark = pool.mark(f);
    pool.append({f}, k.middleRows(20, 1), v.middleRows(20, 1), {1});  // copies the shared last page
    EXPECT_NE(pool.pages(f)[1], shared[1]);
    EXPECT_EQ(pool.free_pages(), 5);
    pool.restore(mark);
    EXPECT_EQ(pool.pages(f), shared);
    EXPECT_EQ(pool.length(f), 20);
    EXPECT_EQ(pool.ref_count(shared[1]), 2);
    EXPECT_EQ(pool.free_pages(), 6);
    pool.append({root}, k.bottomRows(1), v.bottomRows(1), {1});  // shared again: root copies now
    EXPECT_NE(pool.pages(root)[1], shared[1]);
    EXPECT_EQ(pool.pages(f), shared);
    for (Index t = 0; t < 4; ++t) EXPECT_EQ(pool.keys().row(shared[1] * 16 + t), k.row(16 + t));
    const auto before_truncate = pool.mark(f);
    pool.truncate(f, 20);  // even to its own length: marks taken before are refused
    const std::string bytes = snapshot(pool, {root, f});
    EXPECT_THROW(pool.restore(before_truncate), std::invalid_argument);
    EXPECT_EQ(snapshot(pool, {root, f}), bytes);
}

// A page that a sequence let go of by copying it on write goes back to it on restore only if
// its tokens of the mark are still there: not once another sequence took the page from the free
// list, nor once the one sequence still holding it truncated and wrote over those slots. Writes
// into fresh slots of that page, or a mark taken after a truncate, restore as before.
TEST(PagedKVPool, RestoreRefusesACopiedPageTakenOrRewrittenSince) {
    const RowMatrix<float> ones = RowMatrix<float>::Constant(16, 4, 1.0f);
    const RowMatrix<float> twos = RowMatrix<float>::Constant(16, 4, 2.0f);
    // Sequence a holds 10 tokens of ones in page 0, which b shares; a's mark, then a's append
    // copies page 0 (a holds page 1 after it, b page 0 alone).
    auto start = [&](PagedKVPool<float>& pool, SequenceId& a, SequenceId& b) {
        a = pool.allocate();
        pool.append({a}, ones.topRows(10), ones.topRows(10), {10});
        b = pool.fork(a);
        auto mark = pool.mark(a);
        pool.append({a}, twos.topRows(1), twos.topRows(1), {1});
        EXPECT_EQ(pool.pages(a), std::vector<Index>{1});
        EXPECT_EQ(pool.pages(b), std::vector<Index>{0});
        return mark;
    };
    {  // b freed, page 0 taken again by a new sequence c
        PagedKVPool<float> pool(4, 16, 1, 4);
        SequenceId a, b;
        const auto mark = start(pool, a, b);
        pool.free(b);
        const SequenceId c = pool.allocate();
        pool.append({c}, twos, twos, {16});
        EXPECT_EQ(pool.pages(c), std::vector<Index>{0});
        const std::string bytes = snapshot(pool, {a, c});
        EXPECT_THROW(pool.restore(mark), std::invalid_argument);
        EXPECT_THROW(pool.check_restore(mark), std::invalid_argument);
        EXPECT_EQ(snapshot(pool, {a, c}), bytes);
    }
    {  // b rolled back to 5 tokens and wrote slots 5..9 of page 0, a's tokens 5..9
        PagedKVPool<float> pool(4, 16, 1, 4);
        SequenceId a, b;
        const auto mark = start(pool, a, b);
        pool.truncate(b, 5);
        pool.append({b}, twos.topRows(5), twos.topRows(5), {5});
        const std::string bytes = snapshot(pool, {a, b});
        EXPECT_THROW(pool.restore(mark), std::invalid_argument);
        EXPECT_EQ(snapshot(pool, {a, b}), bytes);
    }
    {  // b wrote only slots past a's tokens: a gets page 0 back, its 10 tokens of ones intact
        PagedKVPool<float> pool(4, 16, 1, 4);
        SequenceId a, b;
        const auto mark = start(pool, a, b);
        pool.append({b}, twos.topRows(3), twos.topRows(3), {3});
        pool.restore(mark);
        EXPECT_EQ(pool.pages(a), std::vector<Index>{0});
        EXPECT_EQ(pool.length(a), 10);
        EXPECT_EQ(pool.ref_count(0), 2);
        for (Index t = 0; t < 10; ++t) EXPECT_EQ(pool.keys().row(t), ones.row(0)) << "token " << t;
    }
    {  // a rolled back (speculative tokens rejected), marked, then wrote over its own old slots
        PagedKVPool<float> pool(4, 16, 1, 4);
        const SequenceId a = pool.allocate();
        pool.append({a}, ones.topRows(12), ones.topRows(12), {12});
        pool.truncate(a, 8);
        const auto mark = pool.mark(a);
        pool.append({a}, twos.topRows(2), twos.topRows(2), {2});  // slots 8 and 9 again
        pool.restore(mark);
        EXPECT_EQ(pool.length(a), 8);
        EXPECT_EQ(pool.pages(a), std::vector<Index>{0});
    }
}

// A step that a later layer refused, rolled back in every layer by restore: one page table
// serves every layer again, and the next step takes the same pages everywhere.
TEST(PagedKVPoolSet, RestoreGivesEveryLayerTheSamePagesAgain) {
    gattn::AttentionConfig config;
    config.d_model = 32;
    config.num_heads = 2;
    config.num_kv_heads = 1;
    config.head_dim = 16;
    config.causal = true;
    const gattn::GatedMultiHeadAttention<float> layer0(config, gattn::make_random_weights<float>(config, 1));
    const gattn::GatedMultiHeadAttention<float> layer1(config, gattn::make_random_weights<float>(config, 2));
    const std::vector<const gattn::GatedMultiHeadAttention<float>*> layers{&layer0, &layer1};
    gattn::PagedKVPoolSet<float> pools(layers, 8, 16);
    std::mt19937 rng(15);
    const RowMatrix<float> k = random_rows<float>(22, 16, rng), v = random_rows<float>(22, 16, rng);
    const SequenceId root = pools.allocate();
    for (std::size_t i = 0; i < pools.size(); ++i) pools[i].append({root}, k.topRows(20), v.topRows(20), {20});
    const SequenceId f = pools.fork(root);
    const auto marks = pools.mark({f});
    pools[0].append({f}, k.middleRows(20, 1), v.middleRows(20, 1), {1});  // layer 0 appended, layer 1 refused
    EXPECT_NE(pools[0].pages(f), pools[1].pages(f));
    pools.restore(marks);
    EXPECT_EQ(pools[0].pages(f), pools[1].pages(f));
    EXPECT_EQ(pools[0].pages(root), pools[1].pages(root));
    for (std::size_t i = 0; i < pools.size(); ++i) pools[i].append({root}, k.bottomRows(1), v.bottomRows(1), {1});
    EXPECT_EQ(pools[0].pages(root), pools[1].pages(root));
    EXPECT_EQ(pools[0].pages(f), pools[1].pages(f));
    EXPECT_THROW(pools.restore({}), std::invalid_argument);  // not one list per pool
}

// A table of no sequences takes no query rows, and says so (not "a multiple of 0").
TEST(PagedAttention, AnEmptyTableNamesTheRowsItTakes) {
    PagedKVPool<float> pool(4, 16, 1, 8);
    gattn::PageTable empty;
    empty.indptr = {0};
    const RowMatrix<float> query = RowMatrix<float>::Ones(3, 8);
    RowMatrix<float> out = RowMatrix<float>::Constant(3, 8, 7.0f);
    try {
        gattn::paged_attention<float, float>(query, pool, empty, 1, out);
        ADD_FAILURE() << "no error";
    } catch (const gattn::shape_error& e) {
        EXPECT_NE(std::string(e.what()).find("[0 (batch 0), 8]"), std::string::npos) << e.what();
    }
    EXPECT_TRUE((out.array() == 7.0f).all());
}

// An empty set holds no sequence: releasing or rolling one back is an error, as for any id.
TEST(PagedKVPoolSet, AnEmptySetHoldsNoSequence) {
    gattn::PagedKVPoolSet<float> set;
    EXPECT_THROW(set.free(0), std::out_of_range);
    EXPECT_THROW(set.truncate(0, 0), std::out_of_range);
    EXPECT_THROW(set.allocate(), std::out_of_range);
}

/// write: rows outside the page's slots, also where slot + n overflows, change nothing.
TEST(PagedKVPool, WriteOutsideThePageSlotsThrows) {
    PagedKVPool<float> pool(4, 16, 1, 8);
    std::mt19937 rng(5);
    const RowMatrix<float> k = random_rows<float>(2, 8, rng), v = random_rows<float>(2, 8, rng);
    const SequenceId a = pool.allocate();
    pool.append({a}, k.topRows(1), v.topRows(1), {1});
    const Index page = pool.pages(a)[0];
    const std::string before = snapshot(pool, {a});
    for (const auto& [slot, rows] : std::vector<std::pair<Index, Index>>{{-1, 1},
                                                                         {16, 1},
                                                                         {15, 2},
                                                                         {std::numeric_limits<Index>::max(), 1},
                                                                         {std::numeric_limits<Index>::max(), 2}}) {
        try {
            pool.write(page, slot, k.topRows(rows), v.topRows(rows));
            ADD_FAILURE() << "slot " << slot << ", " << rows << " rows: no error";
        } catch (const std::invalid_argument& e) {
            const std::string what = e.what();
            EXPECT_NE(what.find("slot"), std::string::npos) << what;
            EXPECT_NE(what.find("[0, 16)"), std::string::npos) << what;
            EXPECT_NE(what.find(std::to_string(slot)), std::string::npos) << what;
        }
        EXPECT_EQ(snapshot(pool, {a}), before);
    }
    pool.write(page, 14, k, v);  // the page's last two slots
    EXPECT_EQ(pool.keys().row(page * 16 + 15), k.row(1));
}

/// Every error: a clear message naming what is wrong, and the pool unchanged.
TEST(PagedKVPool, ErrorsLeaveThePoolUnchanged) {
    PagedKVPool<std::int8_t> pool(4, 16, 1, 8);
    std::mt19937 rng(3);
    const RowMatrix<float> k = random_rows<float>(80, 8, rng), v = random_rows<float>(80, 8, rng);
    const SequenceId a = pool.allocate(), b = pool.allocate();
    pool.append({a}, k.topRows(20), v.topRows(20), {20});  // pages 0, 1
    const SequenceId c = pool.fork(a);                     // 2, sharing pages 0 and 1
    pool.free(b);
    const std::vector<SequenceId> live{a, c};
    const std::string before = snapshot(pool, live);
    auto expect_error = [&](auto&& call, const std::vector<std::string>& words) {
        try {
            call();
            ADD_FAILURE() << "no exception";
        } catch (const std::invalid_argument& e) {
            for (const std::string& w : words)
                EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what() << " lacks " << w;
        }
        EXPECT_EQ(snapshot(pool, live), before);
    };
    // Appending past the pool's pages: 40 more tokens of a need its pages 1 to 3 (a copy of the
    // shared page 1 and two more); 2 are free.
    expect_error(
        [&] {
            pool.append({c, a}, k.topRows(80), v.topRows(80), {0, 40});
        },
        {"PagedKVPool::append", "counts[1]", "sequence 0", "its pages 1 to 3", "copy of a shared page",
         "2 of the pool's 4 pages are free"});
    // c copies the shared page first; a, then its only holder, writes it in place: 1 + 2 pages.
    expect_error(
        [&] {
            pool.append({c, a}, k.topRows(80), v.topRows(80), {2, 40});
        },
        {"counts[1]", "its pages 2 to 3", "1 of the pool's 4 pages are free"});
    expect_error([&] { pool.append({b}, k.topRows(1), v.topRows(1), {1}); }, {"seqs[0]", "got 1", "freed"});
    expect_error([&] { pool.append({a, a}, k.topRows(2), v.topRows(2), {1, 1}); }, {"seqs[1]", "also seqs[0]"});
    expect_error([&] { pool.append({a}, k.topRows(2), v.topRows(2), {3}); },
                 {"counts[0]", "k.rows() / seqs.size() = 2]"});
    expect_error([&] { pool.release_outside_window(a, 0); }, {"release_outside_window", "window", "got 0"});
    expect_error([&] { pool.release_outside_window(b, 4); }, {"seq", "got 1", "freed"});
    const std::string a_length = std::to_string(pool.length(a));
    expect_error([&] { pool.release_outside_window(a, 4, pool.length(a) + 1); },
                 {"release_outside_window", "position", "[0, length(seq) = " + a_length + "]"});
    expect_error([&] { pool.release_outside_window(a, 4, -1); }, {"position", "got -1"});
    RowMatrix<float> bad = k.topRows(2);
    bad(1, 3) = std::numeric_limits<float>::quiet_NaN();
    expect_error(
        [&] {
            pool.append({a, c}, bad, v.topRows(2), {1, 1});
        },
        {"row 1", "sequence 2", "column 3", "finite"});
    // k or v inside the pool's own storage (here: its key scales).
    const Eigen::Map<const RowMatrix<float>> inside(pool.key_scales().data(), 1, 8);
    expect_error([&] { pool.append({a}, inside, v.topRows(1), {1}); }, {"append", "k must not share an element"});
    expect_error([&] { pool.append({c}, k.topRows(1), inside, {1}); }, {"append", "v must not share an element"});
    // Writing into a shared page, a free page, a page out of range, or past a page's slots.
    expect_error([&] { pool.write(1, 4, k.topRows(1), v.topRows(1)); }, {"PagedKVPool::write", "page", "shared by 2"});
    expect_error([&] { pool.write(3, 0, k.topRows(1), v.topRows(1)); }, {"page", "3 is free"});
    expect_error([&] { pool.write(4, 0, k.topRows(1), v.topRows(1)); }, {"page", "[0, 4)", "got 4"});
    expect_error([&] { pool.write(-1, 0, k.topRows(1), v.topRows(1)); }, {"got -1"});
    expect_error([&] { pool.truncate(a, 21); }, {"truncate", "length", "[0, 20]", "sequence 0"});
    expect_error([&] { pool.fork(7); }, {"fork", "parent", "got 7"});
    expect_error([&] { pool.free(b); }, {"free", "got 1"});
    // Tables checked against the pool: a page out of range or free, more pages than the pool.
    gattn::PageTable t = pool.page_table({a, c});
    t.indices[3] = 9;
    expect_error([&] { pool.check_table("fn", t); },
                 {"fn: table.indices", "sequence at table position 1, its page 1: page index 9", "outside [0, 4)"});
    t.indices[3] = 2;
    expect_error([&] { pool.check_table("fn", t); },
                 {"sequence at table position 1, its page 1: page index 2 is free"});
    // An indptr that goes past indices and back: refused before any page is read.
    gattn::PageTable back = pool.page_table({a, c});
    back.indptr = {0, 5, 4};
    expect_error([&] { pool.check_table("fn", back); },
                 {"fn: table.indptr", "must not decrease", "table position 1 has -1 pages"});
    // No sequences: nothing to append, and k, v and counts must say so.
    expect_error([&] { pool.append({}, k.topRows(1), v.topRows(1), {}); }, {"PagedKVPool::append", "k", "[0, 8]"});
    expect_error([&] { pool.append({}, k.topRows(0), v.topRows(0), {1}); }, {"counts", "[0]", "[1]"});
    pool.append({}, k.topRows(0), v.topRows(0), {});
    gattn::PageTable long_table;
    long_table.indices.assign(5, 0);
    long_table.indptr = {0, 5};
    long_table.last_page_len = {1};
    expect_error([&] { pool.check_table("fn", long_table); }, {"sequence at table position 0 has 5 pages", "pool's 4"});
    long_table.indices.assign(1, 0);
    long_table.indptr = {0, 1};
    long_table.last_page_len = {17};
    expect_error([&] { pool.check_table("fn", long_table); }, {"last_page_len[0]", "[1, 16]", "got 17"});
    // The attention call checks its table first and writes nothing.
    RowMatrix<float> q = random_rows<float>(2, 8, rng), out = RowMatrix<float>::Constant(2, 8, 5.0f);
    t.indices[3] = 2;
    expect_error([&] { gattn::paged_attention<std::int8_t, float>(q, pool, t, 1, out); },
                 {"gattn::paged_attention", "page index 2 is free"});
    EXPECT_TRUE((out.array() == 5.0f).all());
    RowMatrix<float> q_wide = random_rows<float>(2, 16, rng);
    expect_error(
        [&] {
            gattn::paged_attention<std::int8_t, float>(q_wide, pool, pool.page_table({a, c}), 1, out);
        },
        {"gattn::paged_attention", "query", "pool.head_dim() = 8", "got [2, 16]"});
    gattn::SdpaOptions<float> with_lengths;
    with_lengths.mask.key_lengths = {1, 1};
    expect_error(
        [&] {
            gattn::paged_attention<std::int8_t, float>(q, pool, pool.page_table({a, c}), 1, out, with_lengths);
        },
        {"key_lengths", "must be empty"});
    EXPECT_TRUE((out.array() == 5.0f).all());
    // A constructor's bad page size.
    EXPECT_THROW(PagedKVPool<float>(4, 24, 1, 8), std::invalid_argument);
    EXPECT_THROW(PagedKVPool<float>(4, 512, 1, 8), std::invalid_argument);
}

// ---- decoding over pages, bitwise against the contiguous cache ----

template <class S>
using QueryOf = std::conditional_t<std::is_same_v<S, std::int8_t>, float, S>;

/// Runs the next calls on `threads` threads (0: as many as the machine has); false where that
/// many cannot run (more than 1 without OpenMP).
bool use_threads(int threads) {
#ifdef _OPENMP
    omp_set_num_threads(threads > 0 ? threads : omp_get_num_procs());
    return true;
#else
    return threads <= 1;
#endif
}

/// B sequences appended in interleaved rounds (so their pages interleave in the pool), the third
/// forked from the first part-way (sharing its pages, then copying on write), and a KVCache of
/// capacity max L_b holding the same tokens.
template <class S>
struct PagedSetup {
    using In = typename PagedKVPool<S>::Input;
    static constexpr Index kDk = 64, kDv = 32;
    Index hkv;  // KV heads
    PagedKVPool<S> pool;
    std::vector<SequenceId> ids;
    std::vector<std::vector<RowMatrix<In>>> keys, values;  // per sequence, its token rows
    Index max_len = 0;

    PagedSetup(Index page_size, const std::vector<Index>& lengths, std::mt19937& rng, Index max_tokens = 3000,
               Index num_kv_heads = 2)
        : hkv(num_kv_heads), pool(2 + max_tokens / page_size * 2, page_size, num_kv_heads, kDk, kDv) {
        const Index B = static_cast<Index>(lengths.size());
        keys.resize(lengths.size());
        values.resize(lengths.size());
        for (Index b = 0; b < B; ++b) ids.push_back(b == 2 ? -1 : pool.allocate());
        std::uniform_int_distribution<Index> count(1, 90);
        std::vector<Index> have(lengths.size(), 0);
        bool forked = false;
        for (bool more = true; more;) {
            more = false;
            for (Index b = 0; b < B; ++b) {
                if (b == 2 && !forked) {
                    if (have[0] < 200 && have[0] < lengths[0]) continue;
                    ids[2] = pool.fork(ids[0]);  // shares sequence 0's first tokens
                    keys[2] = keys[0];
                    values[2] = values[0];
                    have[2] = have[0];
                    forked = true;
                }
                const Index n = std::min(count(rng), lengths[b] - have[b]);
                if (n <= 0) continue;
                more = true;
                RowMatrix<In> k = random_rows<In>(n, hkv * kDk, rng), v = random_rows<In>(n, hkv * kDv, rng);
                pool.append({ids[b]}, k, v, {n});
                keys[b].push_back(k);
                values[b].push_back(v);
                have[b] += n;
            }
        }
        for (Index b = 0; b < B; ++b) {
            EXPECT_EQ(pool.length(ids[b]), lengths[b]);
            max_len = std::max(max_len, lengths[b]);
        }
    }

    gattn::KVCache<S> contiguous() const {
        const Index B = static_cast<Index>(ids.size());
        gattn::KVCache<S> cache(B, std::max<Index>(max_len, 1), hkv, kDk, kDv);
        for (Index b = 0; b < B; ++b)
            for (std::size_t i = 0; i < keys[b].size(); ++i) {
                const Index n = keys[b][i].rows();
                RowMatrix<In> k = RowMatrix<In>::Zero(B * n, hkv * kDk), v = RowMatrix<In>::Zero(B * n, hkv * kDv);
                k.middleRows(b * n, n) = keys[b][i];
                v.middleRows(b * n, n) = values[b][i];
                std::vector<Index> counts(static_cast<std::size_t>(B), 0);
                counts[static_cast<std::size_t>(b)] = n;
                cache.append(k, v, counts);
            }
        return cache;
    }
};

/// One mask or variant of the decoding call.
struct Variant {
    const char* name;
    int kind;
};
const Variant kVariants[] = {{"plain", 0},         {"causal", 1}, {"window", 2},           {"bool_mask", 3},
                             {"bias", 4},          {"sinks", 5},  {"softcap", 6},          {"alibi", 7},
                             {"query_offsets", 8}, {"all", 9},    {"causal_top_left", 10}, {"bool_mask_per_query", 11}};

/// prefill: 0 for a decoding step (the decoding kernel), else that many queries per sequence
/// (the tile kernels). Hkv KV heads with `group` query heads each (0: 4, or for decoding as many
/// as the kernel decodes together, up to 4); 1 is multi-head attention, Hkv = 1 multi-query.
template <class S>
void check_paged_equals_contiguous(Index page_size, const Variant& variant, Index prefill, unsigned seed, Index Hkv = 2,
                                   Index group = 0) {
    using Q = QueryOf<S>;
    using T = gattn::compute_t<Q>;
    using Setup = PagedSetup<S>;
    std::mt19937 rng(seed);
    // Lengths: empty, inside a page, across chunks of 512 keys and pages.
    const std::vector<Index> lengths{1100, 0, 700, 37};
    Setup setup(page_size, lengths, rng, 3000, Hkv);
    const Index B = 4, dk = Setup::kDk, dv = Setup::kDv;
    const Index max_pairs = gattn::kernel::FlashGeometry<T>::kDecodePairs;  // decoding several rows
    if (group == 0) group = prefill ? 4 : std::min<Index>(4, max_pairs);
    const Index H = Hkv * group;
    const Index Nq = prefill ? prefill : max_pairs >= 8 ? 2 : 1;
    const Index Nk = setup.max_len;
    const RowMatrix<Q> q = random_rows<Q>(B * Nq, H * dk, rng);
    gattn::SdpaOptions<T> opt;
    std::vector<char> bool_storage;
    RowMatrix<T> bias;
    const int kind = variant.kind;
    if (kind == 1 || kind == 9) opt.mask.causal = true;
    if (kind == 2 || kind == 9) opt.mask.sliding_window = 300;
    if (kind == 3 || kind == 9 || kind == 11) {  // [B, 1, 1, N_k], or [B, H, N_q, N_k]
        const Index heads = kind == 11 ? H : 1, rows = kind == 11 ? Nq : 1;
        bool_storage.resize(static_cast<std::size_t>(B * heads * rows * Nk));
        for (char& c : bool_storage) c = (rng() % 4) != 0;
        opt.mask.bool_mask = {reinterpret_cast<const bool*>(bool_storage.data()), B, heads, rows, Nk};
    }
    if (kind == 10) {  // query i at key position i, whatever the sequence's length
        opt.mask.causal = true;
        opt.mask.alignment = gattn::CausalAlignment::TopLeft;
    }
    if (kind == 4 || kind == 9) {
        bias = random_rows<T>(B * H * Nq, Nk, rng);
        for (Index i = 0; i < bias.size(); i += 7) bias.data()[i] = -std::numeric_limits<T>::infinity();
        opt.mask.bias = {bias.data(), B, H, Nq, Nk};
    }
    if (kind == 5 || kind == 9) opt.sinks = std::vector<T>(static_cast<std::size_t>(H), T(0.5));
    if (kind == 6 || kind == 9) opt.logit_softcap = 2.0;
    if (kind == 7 || kind == 9) opt.alibi_slopes = gattn::alibi_slopes<T>(H);
    if (kind == 8) {  // explicit positions, ending before the last keys of some sequences
        opt.mask.query_offsets = {900, 0, 650, 20};
        opt.mask.causal = true;
        opt.mask.sliding_window = 300;
        opt.mask.query_lengths = {Nq, Nq, 1, Nq};
    }
    const gattn::KVCache<S> cache = setup.contiguous();
    gattn::SdpaOptions<T> copt = opt;
    copt.mask.key_lengths = cache.lengths();
    ASSERT_EQ(cache.capacity(), Nk);
    RowMatrix<Q> expected(B * Nq, H * dv), got(B * Nq, H * dv);
    RowMatrix<T> lse_expected, lse_got, first_expected, first_got;
    gattn::SdpaOutputs<T> cextra, pextra;
    cextra.log_sum_exp = &lse_expected;
    cextra.first_key_probability = &first_expected;
    pextra.log_sum_exp = &lse_got;
    pextra.first_key_probability = &first_got;
    const gattn::HeadLayout heads{B, H, Hkv};
    if constexpr (std::is_same_v<S, std::int8_t>)
        gattn::scaled_dot_product_attention(q, cache.key_operand(), cache.value_operand(), heads, expected, copt,
                                            cextra);
    else
        gattn::scaled_dot_product_attention<S>(q, cache.keys(), cache.values(), heads, expected, copt, cextra);
    const gattn::PageTable table = setup.pool.page_table(setup.ids);
    const std::string where = std::string(variant.name) + ", page size " + std::to_string(page_size) + ", " +
                              std::to_string(Nq) + " queries, " + std::to_string(H) + " heads on " +
                              std::to_string(Hkv);
    // Two threads for all masks together (the rest would repeat what those show).
    for (int threads : {1, 2}) {
        if ((threads > 1 && kind != 9) || !use_threads(threads)) break;
        got.setConstant(Q(7));
        gattn::paged_attention<S, Q>(q, setup.pool, table, H, got, opt, pextra);
        EXPECT_EQ(bytes_of(got), bytes_of(expected)) << where << ", " << threads << " threads";
        EXPECT_EQ(bytes_of(lse_got), bytes_of(lse_expected)) << where;
        EXPECT_EQ(bytes_of(first_got), bytes_of(first_expected)) << where;
    }
    use_threads(0);
    // The result is attention, not two equal wrong answers: sequence 1 has no keys, so its rows
    // are 0, and the others are not all 0.
    for (Index c = 0; c < got.cols(); ++c) EXPECT_EQ(static_cast<float>(got(1 * Nq, c)), 0.0f) << where;
    EXPECT_NE(static_cast<float>(got.row(0).cwiseAbs().maxCoeff()), 0.0f) << where;
}

/// Decoding: every variant with pages of 16 tokens (a decoding key block of 16 keys is a page);
/// plain, explicit positions and all masks together with pages of 64 and 256. Prefill (40
/// queries): every variant with pages of 16 (each 64-key block over four pages, copied), the
/// three with pages of 48 (blocks over one or two pages), 64 and 256 (in place). Multi-query
/// (1 KV head) and multi-head (one query head per KV head): plain and all masks together, pages
/// of 16 and 64.
template <class S>
void check_all(unsigned seed) {
    for (Index prefill : {0, 40}) {
        for (Index page_size : {16, 48, 64, 256})
            for (const Variant& v : kVariants)
                if ((page_size == 16 || v.kind == 0 || v.kind == 8 || v.kind == 9) && (prefill || page_size != 48))
                    check_paged_equals_contiguous<S>(page_size, v, prefill, seed++);
        for (Index page_size : {16, 64})
            for (const Variant& v : kVariants)
                if (v.kind == 0 || v.kind == 9) {
                    check_paged_equals_contiguous<S>(page_size, v, prefill, seed++, 1, 4);  // MQA
                    check_paged_equals_contiguous<S>(page_size, v, prefill, seed++, 3, 1);  // MHA
                }
    }
}

TEST(PagedAttention, FloatEqualsContiguousBitwise) { check_all<float>(10); }
TEST(PagedAttention, DoubleEqualsContiguousBitwise) { check_all<double>(20); }
TEST(PagedAttention, HalfEqualsContiguousBitwise) { check_all<gattn::half>(30); }
TEST(PagedAttention, Bf16EqualsContiguousBitwiseOnEveryKernel) {
    for (gattn::Bf16Kernel k : {gattn::Bf16Kernel::Amx, gattn::Bf16Kernel::WidenedFloat}) {
        gattn_test::KernelLimit limit(k);
        check_all<gattn::bfloat16>(40);
    }
}
TEST(PagedAttention, Int8EqualsContiguousBitwiseOnEveryKernel) {
    for (gattn::Int8Kernel k : {gattn::Int8Kernel::Vnni, gattn::Int8Kernel::AvxVnni, gattn::Int8Kernel::WidenedFloat}) {
        gattn_test::Int8KernelLimit limit(k);
        check_all<std::int8_t>(50);
    }
}

/// Decoding over more K and V than kDecodeFromMemoryBytes, where the kernel reads two key
/// blocks ahead of its use through the page table (the pages of the two sequences interleave,
/// so a block ahead often lies in another page): bitwise the contiguous cache, 1 and 2 threads.
/// `group` query heads on each of Hkv KV heads; 1 (multi-head) reads each key block in address
/// order.
template <class S>
void check_decoding_from_memory(unsigned seed, Index group = 2, Index Hkv = 2) {
    using Q = QueryOf<S>;
    using T = gattn::compute_t<Q>;
    using Setup = PagedSetup<S>;
    const Index dk = Setup::kDk, dv = Setup::kDv, H = group * Hkv;
    const Index length = (gattn::kernel::kDecodeFromMemoryBytes / (Hkv * (dk + dv) * Index(sizeof(S)))) / 2 + 1001;
    for (Index page_size : {16, 64}) {
        std::mt19937 rng(seed++);
        Setup setup(page_size, {length, length - 333}, rng, 2 * length, Hkv);
        const gattn::KVCache<S> cache = setup.contiguous();
        const RowMatrix<Q> q = random_rows<Q>(2, H * dk, rng);
        gattn::SdpaOptions<T> copt;
        copt.mask.key_lengths = cache.lengths();
        RowMatrix<Q> expected(2, H * dv), got(2, H * dv);
        gattn::scaled_dot_product_attention<S>(q, cache.keys(), cache.values(), {2, H, Hkv}, expected, copt);
        const gattn::PageTable table = setup.pool.page_table(setup.ids);
        for (int threads : {1, 2}) {
            if (!use_threads(threads)) break;
            got.setConstant(Q(7));
            gattn::paged_attention<S, Q>(q, setup.pool, table, H, got);
            EXPECT_EQ(bytes_of(got), bytes_of(expected))
                << "page size " << page_size << ", " << H << " heads on " << Hkv << ", " << threads << " threads";
        }
        use_threads(0);
        EXPECT_NE(static_cast<float>(got.cwiseAbs().maxCoeff()), 0.0f);
    }
}

TEST(PagedAttention, DecodingFromMemoryEqualsContiguousBitwise) {
    check_decoding_from_memory<float>(60);
    check_decoding_from_memory<float>(65, 1);
    check_decoding_from_memory<float>(75, 1, 1);
    check_decoding_from_memory<gattn::bfloat16>(70);
}

// ---- mixed batches: decoding steps and prompt chunks in one call ----

/// A ragged batch (qo_indptr) against one call per sequence: sequence 0 decodes one token over
/// 1100 keys, 1 (no keys) sits out or brings one row, 2 brings a 40-token prompt chunk (the tile
/// kernels), 3 decodes over 37 keys. Every sequence's rows are bitwise those of its own call.
template <class S>
void check_mixed_batch(unsigned seed) {
    using Q = QueryOf<S>;
    using T = gattn::compute_t<Q>;
    using Setup = PagedSetup<S>;
    std::mt19937 rng(seed);
    Setup setup(64, {1100, 0, 700, 37}, rng);
    const Index Hkv = setup.hkv, dk = Setup::kDk, dv = Setup::kDv;
    const Index group = std::min<Index>(4, gattn::kernel::FlashGeometry<T>::kQueries / 4), H = Hkv * group;
    for (int variant = 0; variant < 4; ++variant)
        for (const std::vector<Index>& counts : {std::vector<Index>{1, 0, 40, 1}, std::vector<Index>{1, 1, 40, 1}}) {
            std::vector<Index> indptr{0};
            for (Index n : counts) indptr.push_back(indptr.back() + n);
            const RowMatrix<Q> q = random_rows<Q>(indptr.back(), H * dk, rng);
            gattn::SdpaOptions<T> opt;
            if (variant == 1) {
                opt.mask.causal = true;
                opt.mask.sliding_window = 300;
            }
            if (variant == 2) {
                opt.mask.causal = true;
                opt.sinks = std::vector<T>(static_cast<std::size_t>(H), T(0.5));
                opt.logit_softcap = 2.0;
                opt.alibi_slopes = gattn::alibi_slopes<T>(H);
            }
            if (variant == 3) {  // explicit positions, before the last keys of sequence 0
                opt.mask.causal = true;
                opt.mask.query_offsets = {900, 0, 650, 20};
            }
            const std::string where = "variant " + std::to_string(variant) + ", sequence 1 brings " +
                                      std::to_string(counts[1]) + " rows";
            RowMatrix<Q> got = RowMatrix<Q>::Constant(indptr.back(), H * dv, Q(7));
            RowMatrix<T> lse;
            gattn::SdpaOutputs<T> extra;
            extra.log_sum_exp = &lse;
            use_threads(2);
            gattn::paged_attention<S, Q>(q, indptr, setup.pool, setup.pool.page_table(setup.ids), H, got, opt, extra);
            use_threads(1);
            for (Index b = 0; b < 4; ++b) {
                const Index n = counts[static_cast<std::size_t>(b)], r0 = indptr[static_cast<std::size_t>(b)];
                if (n == 0) continue;
                gattn::SdpaOptions<T> one = opt;
                if (!opt.mask.query_offsets.empty()) one.mask.query_offsets = {opt.mask.query_offsets[b]};
                RowMatrix<Q> expected(n, H * dv);
                RowMatrix<T> lse_expected;
                gattn::SdpaOutputs<T> one_extra;
                one_extra.log_sum_exp = &lse_expected;
                gattn::paged_attention<S, Q>(q.middleRows(r0, n), setup.pool, setup.pool.page_table({setup.ids[b]}), H,
                                             expected, one, one_extra);
                EXPECT_EQ(bytes_of(RowMatrix<Q>(got.middleRows(r0, n))), bytes_of(expected))
                    << where << ", sequence " << b;
                EXPECT_EQ(bytes_of(RowMatrix<T>(lse.middleRows(r0, n))), bytes_of(lse_expected))
                    << where << ", sequence " << b;
            }
            // Sequence 1 has no keys: its row (if any) is 0; the prompt chunk is attention.
            if (counts[1] == 1) {
                EXPECT_EQ(static_cast<float>(got.row(1).cwiseAbs().maxCoeff()), 0.0f) << where;
            }
            EXPECT_NE(static_cast<float>(got.row(indptr[2]).cwiseAbs().maxCoeff()), 0.0f) << where;
        }
    use_threads(0);
}

TEST(PagedAttention, MixedBatchEqualsOneCallPerSequence) {
    check_mixed_batch<float>(60);
    check_mixed_batch<gattn::half>(61);
    for (gattn::Bf16Kernel k : {gattn::Bf16Kernel::Amx, gattn::Bf16Kernel::WidenedFloat}) {
        gattn_test::KernelLimit limit(k);
        check_mixed_batch<gattn::bfloat16>(62);
    }
    for (gattn::Int8Kernel k : {gattn::Int8Kernel::Vnni, gattn::Int8Kernel::WidenedFloat}) {
        gattn_test::Int8KernelLimit limit(k);
        check_mixed_batch<std::int8_t>(63);
    }
}

/// Pages that free() gave back serve the next sequence: they hold its tokens only (what the
/// freed sequence wrote there is not read), and attention over them is bitwise that of a
/// contiguous cache holding the same tokens; the sequence that stayed reads what it read before.
TEST(PagedAttention, FreedPagesServeTheNextSequence) {
    const Index P = 16, Hkv = 2, d = 32, H = 4;
    PagedKVPool<float> pool(7, P, Hkv, d);  // exactly the pages of the three sequences below
    std::mt19937 rng(81);
    const SequenceId a = pool.allocate(), b = pool.allocate();
    const RowMatrix<float> ka = random_rows<float>(60, Hkv * d, rng), va = random_rows<float>(60, Hkv * d, rng);
    const RowMatrix<float> kb = random_rows<float>(40, Hkv * d, rng), vb = random_rows<float>(40, Hkv * d, rng);
    pool.append({a}, ka, va, {60});  // 4 pages, the last with 12 tokens
    pool.append({b}, kb, vb, {40});  // 3 pages
    EXPECT_EQ(pool.free_pages(), 0);
    const RowMatrix<float> q = random_rows<float>(2, H * d, rng);
    gattn::SdpaOptions<float> opt;
    opt.mask.causal = true;
    RowMatrix<float> b_before(1, H * d);
    gattn::paged_attention<float, float>(q.bottomRows(1), pool, pool.page_table({b}), H, b_before, opt);
    const std::vector<Index> a_pages = pool.pages(a);
    pool.free(a);
    const SequenceId c = pool.allocate();
    const RowMatrix<float> kc = random_rows<float>(50, Hkv * d, rng), vc = random_rows<float>(50, Hkv * d, rng);
    pool.append({c}, kc, vc, {50});  // 4 pages, the last with 2 tokens: a's, reused
    std::vector<Index> c_pages = pool.pages(c), a_sorted = a_pages;
    std::sort(c_pages.begin(), c_pages.end());
    std::sort(a_sorted.begin(), a_sorted.end());
    EXPECT_EQ(c_pages, a_sorted);
    gattn::KVCache<float> cache(2, 50, Hkv, d);
    RowMatrix<float> k2(100, Hkv * d), v2(100, Hkv * d);  // [c's 50 rows, b's 40 rows and 10 unused]
    k2 << kc, kb, RowMatrix<float>::Zero(10, Hkv * d);
    v2 << vc, vb, RowMatrix<float>::Zero(10, Hkv * d);
    cache.append(k2, v2, {50, 40});
    gattn::SdpaOptions<float> copt = opt;
    copt.mask.key_lengths = cache.lengths();
    RowMatrix<float> expected(2, H * d), got = RowMatrix<float>::Constant(2, H * d, 7.0f);
    gattn::scaled_dot_product_attention<float>(q, cache.keys(), cache.values(), {2, H, Hkv}, expected, copt);
    gattn::paged_attention<float, float>(q, pool, pool.page_table({c, b}), H, got, opt);
    EXPECT_EQ(bytes_of(got), bytes_of(expected));
    EXPECT_EQ(bytes_of(RowMatrix<float>(got.bottomRows(1))), bytes_of(b_before));
    EXPECT_NE(got.row(0).cwiseAbs().maxCoeff(), 0.0f);
}

TEST(PagedAttention, MixedBatchErrorsWriteNothing) {
    std::mt19937 rng(64);
    PagedSetup<float> setup(16, {20, 5}, rng);
    const gattn::PageTable table = setup.pool.page_table(setup.ids);
    const Index H = 2, dk = PagedSetup<float>::kDk, dv = PagedSetup<float>::kDv;
    const RowMatrix<float> q = random_rows<float>(4, H * dk, rng);
    RowMatrix<float> out = RowMatrix<float>::Constant(4, H * dv, 5.0f);
    auto expect_error = [&](const std::vector<Index>& indptr, const gattn::SdpaOptions<float>& opt,
                            const std::vector<std::string>& words) {
        try {
            gattn::paged_attention<float, float>(q, indptr, setup.pool, table, H, out, opt);
            ADD_FAILURE() << "no exception";
        } catch (const std::invalid_argument& e) {
            for (const std::string& w : words)
                EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what() << " lacks " << w;
        }
        EXPECT_TRUE((out.array() == 5.0f).all());
    };
    expect_error({0, 4}, {}, {"gattn::paged_attention", "qo_indptr", "[3]", "[2]"});
    expect_error({0, 1, 3}, {}, {"qo_indptr", "from 0 to query.rows() = 4", "0 ... 3"});
    expect_error({1, 2, 4}, {}, {"qo_indptr", "1 ... 4"});
    expect_error({0, 5, 4}, {}, {"qo_indptr[2]", "must be >= qo_indptr[1]", "4 < 5"});
    std::vector<char> keep(2 * 20, 1);
    gattn::SdpaOptions<float> with_mask;
    with_mask.mask.bool_mask = {reinterpret_cast<const bool*>(keep.data()), 2, 1, 1, 20};
    expect_error({0, 3, 4}, with_mask, {"options.mask.bool_mask", "must be empty", "qo_indptr"});
    gattn::SdpaOptions<float> with_query_lengths;
    with_query_lengths.mask.query_lengths = {3, 1};
    expect_error({0, 3, 4}, with_query_lengths, {"options.mask.query_lengths", "must be empty"});
    gattn::SdpaOptions<float> with_key_lengths;
    with_key_lengths.mask.key_lengths = {20, 5};
    expect_error({0, 3, 4}, with_key_lengths, {"options.mask.key_lengths", "must be empty"});
    // A head count the pool's KV heads do not divide is named as the argument it is.
    for (const Index heads : {Index(0), Index(3)}) {
        try {
            gattn::paged_attention<float, float>(q, setup.pool, table, heads, out);
            ADD_FAILURE() << "no exception for num_heads = " << heads;
        } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find("num_heads must be a positive multiple of pool.num_kv_heads() = " +
                                                 std::to_string(setup.pool.num_kv_heads()) + ", got " +
                                                 std::to_string(heads)),
                      std::string::npos)
                << e.what();
        }
        EXPECT_TRUE((out.array() == 5.0f).all());
    }
    // The same call without the mask runs: three rows of sequence 0, one of sequence 1.
    gattn::paged_attention<float, float>(q, {0, 3, 4}, setup.pool, table, H, out);
    EXPECT_TRUE((out.array() != 5.0f).all());
}

// Transparent huge pages (cache/huge_pages.hpp), checked against what the kernel reports in
// /proc/self/smaps: the "hg" flag of the mapping that holds an address (madvise(MADV_HUGEPAGE)).
bool mapping_advised_huge(const void* p) {
    std::ifstream smaps("/proc/self/smaps");
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    bool inside = false;
    for (std::string line; std::getline(smaps, line);) {
        unsigned long lo = 0, hi = 0;
        if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) {
            inside = lo <= at && at < hi;
        } else if (inside && line.rfind("VmFlags:", 0) == 0) {
            return (line + " ").find(" hg ") != std::string::npos;
        }
    }
    return false;
}

TEST(HugePages, AdviseTheWholeHugePagesOfARange) {
    const std::size_t page = gattn::detail::transparent_huge_page_bytes();
    float small[64] = {};
    EXPECT_EQ(gattn::advise_huge_pages(nullptr, std::size_t(8) << 20), 0u);
    EXPECT_EQ(gattn::advise_huge_pages(small, sizeof small), 0u);  // no whole huge page
    if (page == 0) GTEST_SKIP() << "transparent huge pages are turned off or unavailable on this system";
    // Four huge pages of a fresh mapping (malloc may hand out memory advised before); the range
    // starts 100 bytes in and holds three pages' bytes, so the two whole huge pages after its
    // first boundary are advised, not the first or the last.
    const std::size_t mapped = 5 * page;
    void* mapping = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(mapping, MAP_FAILED);
    auto* buffer =
        reinterpret_cast<unsigned char*>((reinterpret_cast<std::uintptr_t>(mapping) + page - 1) / page * page);
    for (std::size_t i = 0; i < 4 * page; i += 4096) buffer[i] = static_cast<unsigned char>(i / 4096);
    EXPECT_EQ(gattn::advise_huge_pages(buffer + 100, 3 * page), 2 * page);
    EXPECT_FALSE(mapping_advised_huge(buffer + page - 1));
    EXPECT_TRUE(mapping_advised_huge(buffer + page));
    EXPECT_TRUE(mapping_advised_huge(buffer + 3 * page - 1));
    EXPECT_FALSE(mapping_advised_huge(buffer + 3 * page));
    bool unchanged = true;
    for (std::size_t i = 0; i < 4 * page; i += 4096)
        unchanged = unchanged && buffer[i] == static_cast<unsigned char>(i / 4096);
    EXPECT_TRUE(unchanged) << "advising changed the memory's contents";
    munmap(mapping, mapped);
}

TEST(HugePages, CachesAdviseTheirKeysAndValues) {
    const std::size_t page = gattn::detail::transparent_huge_page_bytes();
    // 8 KV heads, d = 128, float: 4 KiB a row, 4096 rows = 16 MiB per matrix.
    gattn::KVCache<float> cache(2, 2048, 8, 128);
    PagedKVPool<float> pool(256, 16, 8, 128);
    const std::size_t bytes = std::size_t(4096) * 8 * 128 * sizeof(float);
    if (page == 0) {
        EXPECT_EQ(cache.huge_page_bytes(), 0u);
        EXPECT_EQ(pool.huge_page_bytes(), 0u);
        GTEST_SKIP() << "transparent huge pages are turned off or unavailable on this system";
    }
    // Each matrix: its whole huge pages, all but at most one at each end.
    for (std::size_t advised : {cache.huge_page_bytes(), pool.huge_page_bytes()}) {
        EXPECT_GE(advised, 2 * (bytes - 2 * page));
        EXPECT_LE(advised, 2 * bytes);
        EXPECT_EQ(advised % page, 0u);
    }
    EXPECT_TRUE(mapping_advised_huge(cache.keys().data() + cache.keys().size() / 2));
    EXPECT_TRUE(mapping_advised_huge(cache.values().data() + cache.values().size() / 2));
    EXPECT_TRUE(mapping_advised_huge(pool.keys().data() + pool.keys().size() / 2));
    EXPECT_TRUE(mapping_advised_huge(pool.values().data() + pool.values().size() / 2));
    // A window cache that grows advises its new rows.
    gattn::KVCache<float> window(1, 16, 8, 128, 0, 0, 8);
    const RowMatrix<float> rows = RowMatrix<float>::Random(4096, 8 * 128);
    window.append(rows, rows, {4096});
    EXPECT_GE(window.huge_page_bytes(), 2 * (bytes / 2 - 2 * page));
    EXPECT_TRUE(mapping_advised_huge(window.keys().data() + window.keys().size() / 2));
}

}  // namespace paged_kv_test
