// Shared-prefix (cascade) decoding (ops/cascade_sdpa.hpp): B sequences forked from one prompt,
// each with its own (ragged or empty) suffix, attend with N_q new rows. The result is checked
// against plain double-precision attention written here over the same stored keys and values,
// and against paged_attention over each sequence's full table (within float rounding: the
// cascade sums the prefix and the suffix apart and merges them, a different order of the same
// terms), for float, fp16, bf16 and int8 pools, page sizes 16 and 64, GQA 8-on-2, MHA
// and MQA, causal or not, with sinks and softcap, bitwise the same on 1, 2 and 3 threads; and
// errors leave `out` unchanged.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "gattn/cache/paged_kv_pool.hpp"
#include "gattn/gattn.hpp"
#include "gattn/ops/cascade_sdpa.hpp"
#include "gattn/ops/paged_sdpa.hpp"
#include "support/compare.hpp"
#include "support/reference.hpp"

namespace cascade_test {

using gattn::Index;
using gattn::PagedKVPool;
using gattn::PageTable;
using gattn::RowMatrix;
using gattn::SequenceId;

template <class S>
RowMatrix<S> random_rows(Index rows, Index cols, std::mt19937& rng) {
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    RowMatrix<S> m(rows, cols);
    for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<S>(dist(rng));
    return m;
}

struct Case {
    Index page_size, heads, kv_heads, nq;
    std::vector<Index> suffix;  // per-sequence suffix tokens
    bool sinks, softcap, causal;
};

template <class S>
using QueryOf = std::conditional_t<std::is_same_v<S, std::int8_t>, float, S>;

/// Stored value of pool row `row`, column `col` (keys or values) as a double.
template <class S>
double stored(const PagedKVPool<S>& pool, bool key, Index row, Index col, Index d) {
    const auto& m = key ? pool.keys() : pool.values();
    double x = static_cast<double>(static_cast<float>(m(row, col)));
    if constexpr (std::is_same_v<S, std::int8_t>) {
        const auto& s = key ? pool.key_scales() : pool.value_scales();
        x *= static_cast<double>(s(row, col / d));
    }
    return x;
}

template <class S>
void check(const Case& c, int threads) {
    using Q = QueryOf<S>;
    const Index d = 32, P = c.page_size, B = static_cast<Index>(c.suffix.size()), H = c.heads, Hkv = c.kv_heads;
    const Index prefix_len = 2 * P;
    std::mt19937 rng(static_cast<unsigned>(P + H + B + c.nq));
    PagedKVPool<S> pool(64, P, Hkv, d);
    const SequenceId root = pool.allocate();
    {
        const RowMatrix<Q> k = random_rows<Q>(prefix_len, Hkv * d, rng), v = random_rows<Q>(prefix_len, Hkv * d, rng);
        pool.append({root}, k, v, {prefix_len});
    }
    std::vector<SequenceId> seqs;
    for (Index b = 0; b < B; ++b) {
        seqs.push_back(pool.fork(root));
        const Index n = c.suffix[static_cast<std::size_t>(b)];
        if (n == 0) continue;
        const RowMatrix<Q> k = random_rows<Q>(n, Hkv * d, rng), v = random_rows<Q>(n, Hkv * d, rng);
        pool.append({seqs.back()}, k, v, {n});
    }
    const PageTable full = pool.page_table(seqs);
    const auto split = gattn::split_shared_prefix(full, P);
    ASSERT_EQ(gattn::shared_prefix_pages(full, P), 2);
    const RowMatrix<Q> query = random_rows<Q>(B * c.nq, H * d, rng);
    using T = gattn::compute_t<Q>;
    gattn::SdpaOptions<T> opt;
    opt.mask.causal = c.causal;
    if (c.softcap) opt.logit_softcap = 5.0;
    if (c.sinks)
        for (Index h = 0; h < H; ++h) opt.sinks.push_back(T(0.5) - T(0.25) * static_cast<T>(h % 4));
#ifdef _OPENMP
    omp_set_num_threads(threads);
#else
    (void)threads;
#endif
    RowMatrix<Q> got(B * c.nq, H * d), plain(B * c.nq, H * d);
    gattn::cascade_attention<S, Q>(query, pool, split.first, split.second, H, got, opt);
    gattn::paged_attention<S, Q>(query, pool, full, H, plain, opt);
    // Any other thread count gives the same bits (the work splits, the sums do not).
    for (int other : {1, 3}) {
        if (other == threads) continue;
#ifdef _OPENMP
        omp_set_num_threads(other);
#else
        continue;
#endif
        RowMatrix<Q> again = RowMatrix<Q>::Constant(B * c.nq, H * d, Q(7));
        gattn::cascade_attention<S, Q>(query, pool, split.first, split.second, H, again, opt);
        EXPECT_TRUE(gattn_test::same_bytes(again, got)) << threads << " and " << other << " threads";
    }
#ifdef _OPENMP
    omp_set_num_threads(1);
#endif
    const double tol = std::is_same_v<S, float> ? 2e-5 : 1.6e-2;  // bf16 outputs round to 8 bits
    const double scale = 1.0 / std::sqrt(double(d));
    for (Index b = 0; b < B; ++b) {
        const Index L = full.length(b, P);
        for (Index i = 0; i < c.nq; ++i)
            for (Index h = 0; h < H; ++h) {
                const Index row = b * c.nq + i, g = h / (H / Hkv);
                const Index end = c.causal ? std::min(L, L - c.nq + i + 1) : L;
                std::vector<double> logit;
                double mx = c.sinks ? double(opt.sinks[h]) : -1e300;
                for (Index j = 0; j < end; ++j) {
                    const Index prow = full.indices[full.indptr[b] + j / P] * P + j % P;
                    double s = 0;
                    for (Index e = 0; e < d; ++e)
                        s += double(static_cast<float>(query(row, h * d + e))) * stored(pool, true, prow, g * d + e, d);
                    s *= scale;
                    if (c.softcap) s = 5.0 * std::tanh(s / 5.0);
                    logit.push_back(s);
                    mx = std::max(mx, s);
                }
                double den = c.sinks ? std::exp(double(opt.sinks[h]) - mx) : 0.0;
                for (double& l : logit) den += (l = std::exp(l - mx));
                for (Index e = 0; e < d; ++e) {
                    double ref = 0;
                    for (Index j = 0; j < end; ++j) {
                        const Index prow = full.indices[full.indptr[b] + j / P] * P + j % P;
                        ref += logit[static_cast<std::size_t>(j)] * stored(pool, false, prow, g * d + e, d);
                    }
                    ref /= den;
                    const double x = static_cast<float>(got(row, h * d + e)),
                                 y = static_cast<float>(plain(row, h * d + e));
                    // int8 rows: the kernels quantize the queries too; the reference uses float queries.
                    const double ref_tol = std::is_same_v<S, std::int8_t> ? 3e-2 : tol;
                    ASSERT_NEAR(x, ref, ref_tol) << "b " << b << " i " << i << " h " << h << " e " << e;
                    ASSERT_NEAR(x, y, tol) << "b " << b << " i " << i << " h " << h << " e " << e;
                }
            }
    }
}

template <class S>
void check_all() {
    for (Index P : {16, 64})
        for (auto [H, Hkv] : {std::pair<Index, Index>{8, 2}, {4, 4}, {4, 1}})
            for (int threads : {1, 2}) {
                SCOPED_TRACE("P " + std::to_string(P) + " H " + std::to_string(H) + "/" + std::to_string(Hkv) +
                             " threads " + std::to_string(threads));
                check<S>({P, H, Hkv, 1, {0, 0, 0}, false, false, true}, threads);
                check<S>({P, H, Hkv, 1, {1, 5, 0, P + 3}, true, true, true}, threads);
                check<S>({P, H, Hkv, 2, {2, 7, 20}, true, false, true}, threads);
                check<S>({P, H, Hkv, 3, {4, 0, 9}, false, true, false}, threads);  // every row sees every key
            }
}

TEST(CascadeAttention, FloatMatchesReferenceAndPagedAttention) { check_all<float>(); }
TEST(CascadeAttention, Bf16MatchesReferenceAndPagedAttention) { check_all<gattn::bfloat16>(); }
TEST(CascadeAttention, Int8MatchesReferenceAndPagedAttention) { check_all<std::int8_t>(); }
TEST(CascadeAttention, HalfMatchesReferenceAndPagedAttention) { check_all<gattn::half>(); }

TEST(CascadeAttention, SharedPrefixPagesStopAtTheFirstDifferenceOrPartialPage) {
    PageTable t;
    t.indptr = {0, 3, 6};
    t.indices = {4, 5, 6, 4, 5, 7};
    t.last_page_len = {16, 3};
    EXPECT_EQ(gattn::shared_prefix_pages(t, 16), 2);
    t.indices = {4, 5, 6, 4, 5, 6};  // the second's last page (6) is partial there
    EXPECT_EQ(gattn::shared_prefix_pages(t, 16), 2);
    t.last_page_len = {16, 16};
    EXPECT_EQ(gattn::shared_prefix_pages(t, 16), 3);
    // A table whose indptr overruns indices is refused before a page is read.
    gattn::PageTable overrun;
    overrun.indptr = {0, 3};
    overrun.indices = {0};
    overrun.last_page_len = {16};
    for (auto* call : {+[](const gattn::PageTable& x) { (void)gattn::shared_prefix_pages(x, 16); },
                       +[](const gattn::PageTable& x) { (void)gattn::split_shared_prefix(x, 16); }}) {
        try {
            call(overrun);
            ADD_FAILURE() << "no exception";
        } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find(
                          "shared_prefix_pages: table.indptr must run from 0 to indices.size() = 1"),
                      std::string::npos)
                << e.what();
        }
    }
}

// Arguments checked before anything else is read: the head count, and the page size and last
// pages' lengths that shared_prefix_pages trusts.
TEST(CascadeAttention, NamesABadHeadCountPageSizeOrLastPageLength) {
    const Index d = 8, P = 16;
    PagedKVPool<float> pool(8, P, 2, d);
    std::mt19937 rng(4);
    const SequenceId root = pool.allocate();
    const RowMatrix<float> k = random_rows<float>(P, 2 * d, rng), v = random_rows<float>(P, 2 * d, rng);
    pool.append({root}, k, v, {P});
    const SequenceId a = pool.fork(root), b = pool.fork(root);
    pool.append({a, b}, k.topRows(2), v.topRows(2), {1, 1});
    const auto split = gattn::split_shared_prefix(pool.page_table({a, b}), P);
    for (const Index heads : {Index(0), Index(-4), Index(3)}) {
        const RowMatrix<float> query = random_rows<float>(2, 4 * d, rng);
        RowMatrix<float> out = RowMatrix<float>::Constant(2, 4 * d, 7.0f);
        const RowMatrix<float> before = out;
        try {
            gattn::cascade_attention<float, float>(query, pool, split.first, split.second, heads, out);
            ADD_FAILURE() << "no error for num_heads = " << heads;
        } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find("num_heads"), std::string::npos) << e.what();
        }
        EXPECT_EQ(out, before);
    }
    const PageTable table = pool.page_table({a, b});
    EXPECT_THROW(gattn::shared_prefix_pages(table, 0), std::invalid_argument);
    EXPECT_THROW(gattn::split_shared_prefix(table, -5), std::invalid_argument);
    PageTable long_last = table;
    long_last.last_page_len[0] = P + 1;
    try {
        gattn::shared_prefix_pages(long_last, P);
        ADD_FAILURE() << "no error for last_page_len > page_size";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("last_page_len"), std::string::npos) << e.what();
    }
    // A sequence without pages holds no tokens, so its last page holds none either.
    PageTable empty_last;
    empty_last.indptr = {0, 0};
    empty_last.last_page_len = {3};
    try {
        gattn::shared_prefix_pages(empty_last, P);
        ADD_FAILURE() << "no error for last_page_len 3 without pages";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("last_page_len[0]"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("has no pages"), std::string::npos) << e.what();
    }
}

// min_suffix_tokens keeps a causal batch's new tokens out of the prefix: c holds 35 tokens
// (root's 2 full pages and 3 of its own), e root's 32 alone, so with 2 new query rows a sequence
// (min_suffix_tokens 1) the prefix stops after page 0: e's 32 − 1 tokens fill only one page.
TEST(CascadeAttention, ASplitThatLeavesTheNewTokensServesACausalBatch) {
    const Index d = 16, P = 16;
    PagedKVPool<float> pool(8, P, 1, d);
    std::mt19937 rng(5);
    const SequenceId root = pool.allocate();
    const RowMatrix<float> k = random_rows<float>(2 * P, d, rng), v = random_rows<float>(2 * P, d, rng);
    pool.append({root}, k, v, {2 * P});
    const SequenceId c = pool.fork(root), e = pool.fork(root);
    pool.append({c}, k.topRows(3), v.topRows(3), {3});
    const PageTable table = pool.page_table({c, e});
    EXPECT_EQ(gattn::shared_prefix_pages(table, P), 2);
    EXPECT_EQ(gattn::shared_prefix_pages(table, P, 1), 1);
    EXPECT_EQ(gattn::shared_prefix_pages(table, P, 16), 1);                // e keeps page 1 whole
    EXPECT_EQ(gattn::shared_prefix_pages(table, P, 17), 0);                // and one token of page 0
    EXPECT_EQ(gattn::shared_prefix_pages(pool.page_table({c}), P, 3), 2);  // one sequence: 35 − 3 = 32
    EXPECT_THROW(gattn::shared_prefix_pages(table, P, -1), std::invalid_argument);
    const auto split = gattn::split_shared_prefix(table, P, 1);
    EXPECT_EQ(split.first.indices, std::vector<Index>{pool.pages(root)[0]});
    EXPECT_EQ(split.second.length(0, P), 19);
    EXPECT_EQ(split.second.length(1, P), 16);
    const RowMatrix<float> query = random_rows<float>(4, 2 * d, rng);
    gattn::SdpaOptions<float> causal;
    causal.mask.causal = true;
    RowMatrix<float> got(4, 2 * d), plain(4, 2 * d);
    gattn::cascade_attention<float, float>(query, pool, split.first, split.second, 2, got, causal);
    gattn::paged_attention<float, float>(query, pool, table, 2, plain, causal);
    EXPECT_LE((got - plain).cwiseAbs().maxCoeff(), 2e-6f);
    // And the float64 reference over each sequence's tokens: c's 35 (root's 32, then k's first
    // 3 rows), e's 32 (padding past them), the last 2 of each the queries' positions.
    gattn_test::Mat keys = gattn_test::Mat::Zero(2 * 35, d), values = gattn_test::Mat::Zero(2 * 35, d);
    for (Index b = 0; b < 2; ++b) {
        keys.middleRows(b * 35, 2 * P) = k.cast<double>();
        values.middleRows(b * 35, 2 * P) = v.cast<double>();
    }
    keys.middleRows(2 * P, 3) = k.topRows(3).cast<double>();
    values.middleRows(2 * P, 3) = v.topRows(3).cast<double>();
    gattn_test::RefMasks masks;
    masks.causal = true;
    masks.key_lengths = {35, 32};
    const auto ref = gattn_test::sdpa_reference(query.cast<double>(), keys, values, 2, 2, 1, {}, masks);
    EXPECT_LE((got.cast<double>() - ref.out).cwiseAbs().maxCoeff(), 2e-5);
    // The default split puts e's new tokens in the prefix, which the error names.
    const auto whole = gattn::split_shared_prefix(table, P);
    try {
        gattn::cascade_attention<float, float>(query, pool, whole.first, whole.second, 2, got, causal);
        ADD_FAILURE() << "no error for new tokens in the prefix";
    } catch (const std::invalid_argument& err) {
        EXPECT_NE(std::string(err.what()).find("split_shared_prefix(table, page_size, 1)"), std::string::npos)
            << err.what();
    }
}

TEST(CascadeAttention, ErrorsLeaveOutUnchanged) {
    const Index d = 16, P = 16;
    PagedKVPool<float> pool(8, P, 1, d);
    std::mt19937 rng(3);
    const SequenceId root = pool.allocate();
    const RowMatrix<float> k = random_rows<float>(2 * P, d, rng), v = random_rows<float>(2 * P, d, rng);
    pool.append({root}, k, v, {2 * P});
    const SequenceId a = pool.fork(root), b = pool.fork(root);
    pool.append({a, b}, k.topRows(2), v.topRows(2), {1, 1});
    const auto split = gattn::split_shared_prefix(pool.page_table({a, b}), P);
    const RowMatrix<float> query = random_rows<float>(2, 2 * d, rng);
    RowMatrix<float> out = RowMatrix<float>::Constant(2, 2 * d, 7.0f);
    const RowMatrix<float> before = out;
    auto expect_error = [&](const PageTable& prefix, const PageTable& suffix, const gattn::SdpaOptions<float>& o,
                            const std::string& names) {
        try {
            gattn::cascade_attention<float, float>(query, pool, prefix, suffix, 2, out, o);
            ADD_FAILURE() << "no error for " << names;
        } catch (const std::exception& e) {
            EXPECT_NE(std::string(e.what()).find(names), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find("cascade_attention"), std::string::npos) << e.what();
        }
        EXPECT_EQ(out, before);
    };
    PageTable bad = split.first;
    bad.indices[0] = 99;  // out of range
    expect_error(bad, split.second, {}, "table");
    PageTable three = split.second;  // 3 sequences for 2 query rows
    three.indices.push_back(three.indices.back());
    three.indptr.push_back(three.indptr.back() + 1);
    three.last_page_len.push_back(1);
    expect_error(split.first, three, {}, "suffix");
    // Causal with 2 new rows per sequence needs at least 1 suffix token each: here the whole
    // sequences (32 tokens, 2 full pages) are the prefix, which row 0 must not see entirely.
    const SequenceId c = pool.fork(root), e = pool.fork(root);
    const auto whole = gattn::split_shared_prefix(pool.page_table({c, e}), P);
    const RowMatrix<float> four_rows = random_rows<float>(4, 2 * d, rng);
    RowMatrix<float> out4 = RowMatrix<float>::Constant(4, 2 * d, 7.0f);
    const RowMatrix<float> before4 = out4;
    gattn::SdpaOptions<float> causal;
    causal.mask.causal = true;
    try {
        gattn::cascade_attention<float, float>(four_rows, pool, whole.first, whole.second, 2, out4, causal);
        ADD_FAILURE() << "no error for a causal batch whose new tokens are in the prefix";
    } catch (const std::invalid_argument& err) {
        EXPECT_NE(std::string(err.what()).find("suffix"), std::string::npos) << err.what();
    }
    EXPECT_EQ(out4, before4);
    gattn::SdpaOptions<float> window;
    window.mask.sliding_window = 8;
    expect_error(split.first, split.second, window, "options.mask.sliding_window");
    gattn::SdpaOptions<float> alibi;
    alibi.alibi_slopes = {0.5f, 0.25f};
    expect_error(split.first, split.second, alibi, "options.alibi_slopes");
    // An output inside the pool's own storage would overwrite keys or values.
    const RowMatrix<float> values = pool.values();
    Eigen::Map<RowMatrix<float>> inside(const_cast<float*>(pool.values().data()), 2, 2 * d);
    try {
        gattn::cascade_attention<float, float>(query, pool, split.first, split.second, 2, inside);
        ADD_FAILURE() << "no error for an output in the pool";
    } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("out"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(gattn_test::same_bytes(pool.values(), values));
}

}  // namespace cascade_test
