// SPDX-License-Identifier: Apache-2.0
// One float SDPA call of gattn, built as a shared object against one revision's headers by
// scripts/ab_revisions.sh, so that bench_revisions can load two revisions into one process and
// time them in turn. Only gattn_ab_sdpa is exported (built with -fvisibility=hidden), so the
// two objects' inline functions never mix.
#include <cstdio>
#include <exception>

#include <gattn/gattn.hpp>

/// out[N_q, H·d] = SDPA of q[N_q, H·d] over k, v[N_k, H_kv·d] (one sequence; causal: bottom-
/// right aligned), or over k, v as head-major rows [H_kv·N_k, d] (head_major). Returns 0, or 1
/// when gattn threw or the revision has no head-major SDPA (the message is printed).
extern "C" __attribute__((visibility("default"))) int gattn_ab_sdpa(const float* q, const float* k, const float* v,
                                                                    float* out, long n_q, long n_k, long heads,
                                                                    long kv_heads, long head_dim, int causal,
                                                                    int head_major) {
    using Rows = Eigen::Map<const gattn::RowMatrix<float>>;
    try {
        const Rows query(q, n_q, heads * head_dim);
        Eigen::Map<gattn::RowMatrix<float>> result(out, n_q, heads * head_dim);
        gattn::SdpaOptions<float> options;
        options.mask.causal = causal != 0;
        const gattn::HeadLayout layout{1, heads, kv_heads};
        if (head_major) {
#if __has_include(<gattn/ops/head_major_rows.hpp>)
            const Rows key(k, kv_heads * n_k, head_dim), value(v, kv_heads * n_k, head_dim);
            gattn::scaled_dot_product_attention<float>(query, gattn::HeadMajorRows<float>(key),
                                                       gattn::HeadMajorRows<float>(value), layout, result, options);
            return 0;
#else
            std::fprintf(stderr, "gattn_ab_sdpa: this revision has no head-major SDPA\n");
            return 1;
#endif
        }
        const Rows key(k, n_k, kv_heads * head_dim), value(v, n_k, kv_heads * head_dim);
        gattn::scaled_dot_product_attention<float>(query, key, value, layout, result, options);
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "gattn_ab_sdpa: %s\n", e.what());
        return 1;
    } catch (...) {
        std::fprintf(stderr, "gattn_ab_sdpa: an exception that is not a std::exception\n");
        return 1;
    }
}
