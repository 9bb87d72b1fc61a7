// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// oneDNN's bf16 matmul (bf16 x and weights, float accumulation and output) as PackedLinear's
/// optional backend. Compiled only with GATTN_WITH_ONEDNN defined and libdnnl linked (CMake:
/// -DGATTN_WITH_ONEDNN=ON); the rest of gattn needs no oneDNN.
///
/// The weights are reordered once, at construction, into the blocked layout oneDNN chooses for
/// a 512-row product on this CPU (for AMX or AVX512-BF16), and only that copy is kept. One
/// primitive is created per distinct row count (and output stride) and cached; every call gets
/// its own stream and scratchpad, so concurrent calls are safe.

// Without GATTN_WITH_ONEDNN this header declares nothing (PackedLinear then has no oneDNN
// backend and says so).
#if defined(GATTN_WITH_ONEDNN)

#include <dnnl.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gattn/types.hpp"

GATTN_BEGIN_ISA_NAMESPACE
namespace detail {

class OneDnnLinear {
    using dt = dnnl::memory::data_type;
    using dims = dnnl::memory::dims;

public:
    OneDnnLinear() = default;

    /// \param weight [out, in] bf16 (nn.Linear layout, any row stride).
    /// \param bias   [out] float, or empty.
    /// \throws dnnl::error when oneDNN has no bf16 matmul for this CPU.
    OneDnnLinear(ConstMatrixRef<bfloat16> weight, const Vector<float>& bias) : m_state(std::make_shared<State>()) {
        State& s = *m_state;
        s.in = weight.cols();
        s.out = weight.rows();
        s.bias = bias;
        const dims wdims{s.in, s.out};
        // Our [out, in] rows are oneDNN's [in, out] weights with strides {1, row stride}.
        const dnnl::memory::desc user_md(wdims, dt::bf16, dims{1, weight.outerStride()});
        const auto pd = primitive_desc(s, kReferenceRows, s.out, dnnl::memory::desc(wdims, dt::bf16, dnnl::memory::format_tag::any));
        s.weights_md = pd.weights_desc();
        s.implementation = pd.impl_info_str();
        s.weights = dnnl::memory(s.weights_md, s.engine);
        dnnl::memory user(user_md, s.engine, const_cast<bfloat16*>(weight.data()));
        dnnl::stream stream(s.engine);
        dnnl::reorder(user, s.weights).execute(stream, user, s.weights);
        stream.wait();
    }

    /// oneDNN's name for the implementation it chose, e.g. "brg:avx512_core_amx_bf16".
    const std::string& implementation() const noexcept { return m_state->implementation; }

    /// Bytes of the reordered weights and the bias.
    std::size_t bytes() const noexcept {
        return m_state ? m_state->weights_md.get_size() + sizeof(float) * static_cast<std::size_t>(m_state->bias.size())
                       : 0;
    }

    /// y [rows, out] (row stride ldy) = x [rows, in] (contiguous bf16)·wᵀ + b.
    /// \throws dnnl::error when oneDNN cannot create the primitive for this row count.
    void forward(const bfloat16* x, Index rows, float* y, Index ldy) const {
        State& s = *m_state;
        const Primitive& p = primitive_for(rows, ldy);
        thread_local std::vector<std::uint8_t> scratch;
        if (scratch.size() < p.scratchpad_bytes) scratch.resize(p.scratchpad_bytes);
        dnnl::stream stream(s.engine);
        dnnl::memory src(p.src_md, s.engine, const_cast<bfloat16*>(x));
        dnnl::memory dst(p.dst_md, s.engine, y);
        dnnl::memory pad(p.scratchpad_md, s.engine, scratch.data());
        std::unordered_map<int, dnnl::memory> args{
            {DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, s.weights}, {DNNL_ARG_DST, dst}, {DNNL_ARG_SCRATCHPAD, pad}};
        if (s.bias.size()) args.emplace(DNNL_ARG_BIAS, dnnl::memory(bias_md(s), s.engine, s.bias.data()));
        p.matmul.execute(stream, args);
        stream.wait();
    }

private:
    static constexpr Index kReferenceRows = 512;

    struct Primitive {
        dnnl::matmul matmul;
        dnnl::memory::desc src_md, dst_md, scratchpad_md;
        std::size_t scratchpad_bytes = 0;
    };
    struct State {
        dnnl::engine engine{dnnl::engine::kind::cpu, 0};
        Index in = 0, out = 0;
        Vector<float> bias;
        dnnl::memory::desc weights_md;
        dnnl::memory weights;
        std::string implementation;
        std::mutex mutex;  // guards primitives
        std::map<std::pair<Index, Index>, Primitive> primitives;  // by (rows, ldy)
    };

    static dnnl::memory::desc bias_md(const State& s) { return dnnl::memory::desc(dims{1, s.out}, dt::f32, dims{s.out, 1}); }

    static dnnl::matmul::primitive_desc primitive_desc(const State& s, Index rows, Index ldy,
                                                       const dnnl::memory::desc& weights_md) {
        const dnnl::memory::desc src_md(dims{rows, s.in}, dt::bf16, dims{s.in, 1});
        const dnnl::memory::desc dst_md(dims{rows, s.out}, dt::f32, dims{ldy, 1});
        dnnl::primitive_attr attr;
        attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
        const auto desc = s.bias.size() ? dnnl::matmul::desc(src_md, weights_md, bias_md(s), dst_md)
                                        : dnnl::matmul::desc(src_md, weights_md, dst_md);
        return dnnl::matmul::primitive_desc(desc, attr, s.engine);
    }

    const Primitive& primitive_for(Index rows, Index ldy) const {
        State& s = *m_state;
        std::lock_guard<std::mutex> lock(s.mutex);
        const auto key = std::make_pair(rows, ldy);
        auto it = s.primitives.find(key);
        if (it != s.primitives.end()) return it->second;
        const auto pd = primitive_desc(s, rows, ldy, s.weights_md);
        Primitive p{dnnl::matmul(pd), pd.src_desc(), pd.dst_desc(), pd.scratchpad_desc(), pd.scratchpad_desc().get_size()};
        return s.primitives.emplace(key, std::move(p)).first->second;  // std::map: references stay valid
    }

    std::shared_ptr<State> m_state;  // shared by copies: the weights are read-only after construction
};

}  // namespace detail
GATTN_END_ISA_NAMESPACE

#endif  // GATTN_WITH_ONEDNN
