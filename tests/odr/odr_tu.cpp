// SPDX-License-Identifier: Apache-2.0
// One translation unit of test_odr, compiled twice into the same executable: with the baseline
// flags (GATTN_ODR_SUFFIX=baseline) and with -mavx2 -mfma (GATTN_ODR_SUFFIX=avx2). Eigen
// objects stay inside; the test sees raw float buffers only (tests/odr/odr_api.h).

#include "gattn/gattn.hpp"
#include "odr/odr_api.h"

#ifndef GATTN_ODR_SUFFIX
#error "define GATTN_ODR_SUFFIX (baseline or avx2)"
#endif

#define GATTN_ODR_CAT2(a, b) a##b
#define GATTN_ODR_CAT(a, b) GATTN_ODR_CAT2(a, b)
#define GATTN_ODR_NAME(name) GATTN_ODR_CAT(name, GATTN_ODR_SUFFIX)
#define GATTN_ODR_STR2(x) #x
#define GATTN_ODR_STR(x) GATTN_ODR_STR2(x)

namespace {

using gattn::Index;
using Matrix = gattn::RowMatrix<float>;
using ConstMap = Eigen::Map<const Matrix>;
using Map = Eigen::Map<Matrix>;

}  // namespace

extern "C" {

const char* GATTN_ODR_NAME(gattn_odr_arch_)(void) { return gattn::simd::arch_name(); }

const char* GATTN_ODR_NAME(gattn_odr_namespace_)(void) { return GATTN_ODR_STR(GATTN_ISA_NAMESPACE); }

int GATTN_ODR_NAME(gattn_odr_gate_count_)(void) {
    return static_cast<int>(gattn::all_valid_gate_specs().size());
}

int GATTN_ODR_NAME(gattn_odr_sdpa_)(const GattnOdrSdpaCase* c, const float* q, const float* k,
                                    const float* v, float* out) {
    try {
        const Index B = c->batch, H = c->heads, Hkv = c->kv_heads;
        const ConstMap qm(q, B * c->nq, H * c->dk);
        const ConstMap km(k, B * c->nk, Hkv * c->dk);
        const ConstMap vm(v, B * c->nk, Hkv * c->dv);
        Map om(out, B * c->nq, H * c->dv);
        gattn::SdpaOptions<float> options;
        options.mask.causal = c->causal != 0;
        if (c->window > 0) options.mask.sliding_window = c->window;
        if (c->key_lengths) options.mask.key_lengths.assign(c->key_lengths, c->key_lengths + B);
        gattn::scaled_dot_product_attention<float>(qm, km, vm, {B, H, Hkv}, om, options);
        return 0;
    } catch (...) {
        return -1;
    }
}

int GATTN_ODR_NAME(gattn_odr_layer_)(int gate, unsigned seed, const float* x, int batch, int tokens,
                                     float* out) {
    try {
        gattn::AttentionConfig config;
        config.d_model = GATTN_ODR_D_MODEL;
        config.num_heads = 4;
        config.num_kv_heads = 2;
        config.head_dim = 8;
        config.causal = true;
        config.o_bias = true;
        config.gate = gattn::all_valid_gate_specs().at(static_cast<std::size_t>(gate));
        const gattn::GatedMultiHeadAttention<float> layer(config, gattn::make_random_weights<float>(config, seed));
        const Index rows = Index(batch) * tokens;
        const ConstMap xm(x, rows, GATTN_ODR_D_MODEL);
        Map om(out, rows, GATTN_ODR_D_MODEL);
        layer.forward(xm, batch, om);
        return 0;
    } catch (...) {
        return -1;
    }
}

}  // extern "C"
