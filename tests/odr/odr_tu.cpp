// SPDX-License-Identifier: Apache-2.0
// One translation unit of test_odr, compiled twice into the same executable: with the baseline
// flags (GATTN_ODR_SUFFIX=baseline) and with -mavx2 -mfma (GATTN_ODR_SUFFIX=avx2). Eigen
// objects stay inside; the test sees raw float buffers only (tests/odr/odr_api.h).

#include <random>
#include <vector>

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

int GATTN_ODR_NAME(gattn_odr_eigen_alignment_)(void) { return EIGEN_DEFAULT_ALIGN_BYTES; }

void GATTN_ODR_NAME(gattn_odr_throw_shape_error_)(void) {
    const gattn::RowMatrix<float> q(2, 8), k(2, 6), v(2, 8);  // key width 6 does not fit d_k = 8
    gattn::scaled_dot_product_attention<float>(q, k, v, {1, 1, 1});
}

int GATTN_ODR_NAME(gattn_odr_catch_shape_error_)(void (*f)(void)) {
    try {
        f();
    } catch (const gattn::shape_error&) {
        return 1;
    } catch (...) {
        return 2;
    }
    return 0;
}

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
        gattn::ForwardOptions<float> options;
        options.key_lengths.assign(static_cast<std::size_t>(batch), tokens);
        if (batch > 0 && tokens > 0) options.key_lengths.back() = tokens - 1;
        gattn::ForwardTrace<float> trace;
        layer.forward(xm, batch, om, options, &trace);
        return 0;
    } catch (...) {
        return -1;
    }
}

int GATTN_ODR_NAME(gattn_odr_qwen3_next_)(unsigned seed, const float* x, int batch, int tokens, float* out) {
    try {
        gattn::Qwen3NextConfig config;
        config.hidden_size = GATTN_ODR_D_MODEL;
        config.num_attention_heads = 4;
        config.num_key_value_heads = 2;
        config.head_dim = 8;
        gattn::Qwen3NextAttentionWeights<float> w;
        std::mt19937 rng(seed);
        std::uniform_real_distribution<float> u(-0.3f, 0.3f);
        const auto shapes = gattn::qwen3_next_weight_shapes(config);
        w.for_each([&](const char* name, auto* t) {
            for (const auto& shape : shapes) {
                if (shape.name != name) continue;
                t->resize(shape.shape[0], shape.shape.size() > 1 ? shape.shape[1] : 1);
                for (Index i = 0; i < t->size(); ++i) t->data()[i] = u(rng);
            }
        });
        const gattn::Qwen3NextAttention<float> layer(config, w);
        auto cache = layer.make_cache(batch, tokens + 1);
        const Index rows = Index(batch) * tokens;
        std::vector<Index> positions(static_cast<std::size_t>(rows)), counts(static_cast<std::size_t>(batch), tokens);
        if (batch > 1) counts[1] = tokens - 1;
        for (Index r = 0; r < rows; ++r) positions[static_cast<std::size_t>(r)] = r % tokens;
        Map prefill(out, rows, GATTN_ODR_D_MODEL);
        layer.forward(ConstMap(x, rows, GATTN_ODR_D_MODEL), positions, cache, prefill, counts);
        Map step(out + rows * GATTN_ODR_D_MODEL, batch, GATTN_ODR_D_MODEL);
        layer.forward(ConstMap(x + rows * GATTN_ODR_D_MODEL, batch, GATTN_ODR_D_MODEL), cache.lengths(), cache, step);
        return 0;
    } catch (...) {
        return -1;
    }
}

}  // extern "C"
