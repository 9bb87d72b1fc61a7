// SPDX-License-Identifier: Apache-2.0
// C interface of the two translation units of test_odr. odr_tu.cpp is compiled twice, once
// with the compiler's baseline flags (suffix _baseline) and once with -mavx2 -mfma (suffix
// _avx2); only plain C types and raw float buffers cross between them and the test.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

/// One SDPA call: Q [batch·nq, heads·dk], K [batch·nk, kv_heads·dk], V [batch·nk, kv_heads·dv],
/// out [batch·nq, heads·dv], all row-major and contiguous.
typedef struct GattnOdrSdpaCase {
    int batch, nq, nk, heads, kv_heads, dk, dv;
    int causal;              /* 0 or 1 */
    int window;              /* sliding window in keys, 0 = none */
    const int* key_lengths;  /* batch entries, or NULL */
} GattnOdrSdpaCase;

/// Shape of the layer that gattn_odr_layer_* runs (x and out are [batch·tokens, d_model]).
enum { GATTN_ODR_D_MODEL = 16 };

#define GATTN_ODR_DECLARE(suffix)                                                                \
    /* xsimd's name of the instruction set the unit was compiled for. */                         \
    const char* gattn_odr_arch_##suffix(void);                                                   \
    /* gattn's inline SIMD namespace of the unit, e.g. "isa_sse2". */                             \
    const char* gattn_odr_namespace_##suffix(void);                                              \
    /* Eigen's heap alignment in the unit (EIGEN_DEFAULT_ALIGN_BYTES). */                        \
    int gattn_odr_eigen_alignment_##suffix(void);                                                \
    /* Calls a scaled_dot_product_attention<float> with a bad shape: throws gattn::shape_error. */ \
    void gattn_odr_throw_shape_error_##suffix(void);                                             \
    /* Calls f: 1 when it threw gattn::shape_error (caught as such), 2 for another exception. */  \
    int gattn_odr_catch_shape_error_##suffix(void (*f)(void));                                   \
    /* Number of valid gate specs (gattn::all_valid_gate_specs().size()). */                    \
    int gattn_odr_gate_count_##suffix(void);                                                     \
    /* scaled_dot_product_attention<float>; 0 on success, -1 when gattn threw. */                \
    int gattn_odr_sdpa_##suffix(const GattnOdrSdpaCase* c, const float* q, const float* k,       \
                                const float* v, float* out);                                     \
    /* Causal GQA layer (d_model 16, 4 heads, 2 KV heads, head_dim 8) with random weights of */  \
    /* the seed and gate all_valid_gate_specs()[gate], the last sequence's last key padding; */  \
    /* 0 on success, -1 when gattn threw. */                                                     \
    int gattn_odr_layer_##suffix(int gate, unsigned seed, const float* x, int batch, int tokens, \
                                 float* out);                                                    \
    /* Qwen3-Next layer (same shapes) with random weights of the seed: prefill of x's first */   \
    /* batch·tokens rows (the second sequence one token short), then one decoding step on the */ \
    /* last batch rows; x and out are [batch·(tokens + 1), d_model]; 0, or -1 when it threw. */ \
    int gattn_odr_qwen3_next_##suffix(unsigned seed, const float* x, int batch, int tokens,      \
                                      float* out);

GATTN_ODR_DECLARE(baseline)
GATTN_ODR_DECLARE(avx2)

#ifdef __cplusplus
}
#endif
