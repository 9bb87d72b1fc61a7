// Training beside PyTorch's C++ API (libtorch, Debian's libtorch-dev 1.13; built only when CMake
// finds it): the forward and backward pass of attention, and of a G1-gated layer, in gattn and
// in libtorch's autograd, timed in turn within every iteration of one process.
//
// BM_SdpaTrainVsTorch: gattn's scaled_dot_product_attention (with its log-sum-exp) and
// scaled_dot_product_attention_backward against autograd of softmax(Q Kᵀ · scale + causal mask)
// V written with torch::matmul and torch::softmax, which materialises the N × N scores (1.13 has
// no fused CPU attention). Counters: gattn_ms and torch_ms (forward + backward),
// speedup_vs_torch = torch / gattn.
//
// BM_GatedLayerTrainVsTorch: GatedMultiHeadAttention::forward_train and backward (G1
// elementwise sigmoid gate, GQA) against the same layer built from torch::nn::Linear modules
// (q, k, v, gate and output projections) and the same attention, backward through autograd to
// the input and every weight. Counters as above.
//
// The benchmark context names libtorch's version and BLAS (at::show_config(): Debian's 1.13 says
// BLAS_INFO=generic, the reference BLAS).
// Run: OMP_NUM_THREADS=1 build/bench/bench/bench_torch --benchmark_counters_tabular=true

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <cmath>
#include <string>
#include <utility>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <gattn/gattn.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using Matrix = gattn::RowMatrix<float>;

void set_threads(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n);
#endif
    at::set_num_threads(n);
}

/// A torch tensor viewing a row-major gattn matrix (no copy).
torch::Tensor view(const Matrix& m) {
    return torch::from_blob(const_cast<float*>(m.data()), {m.rows(), m.cols()}, torch::kFloat32);
}

/// softmax(Q Kᵀ · scale + mask) V per head, [N, H·d] in and out, K and V of Hkv heads (GQA:
/// each KV head's rows repeated for its group), as eager attention is written in PyTorch.
torch::Tensor torch_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t h,
                              int64_t hkv, int64_t d, bool causal) {
    const int64_t n = q.size(0);
    auto heads = [&](const torch::Tensor& t, int64_t count) { return t.view({n, count, d}).transpose(0, 1); };
    torch::Tensor qh = heads(q, h), kh = heads(k, hkv), vh = heads(v, hkv);
    if (hkv != h) {
        kh = kh.repeat_interleave(h / hkv, 0);
        vh = vh.repeat_interleave(h / hkv, 0);
    }
    torch::Tensor scores = torch::matmul(qh, kh.transpose(1, 2)) * (1.0 / std::sqrt(double(d)));
    if (causal) scores = scores.masked_fill(torch::ones({n, n}, torch::kBool).triu(1), -INFINITY);
    return torch::matmul(torch::softmax(scores, -1), vh).transpose(0, 1).reshape({n, h * d});
}

/// Times a and b in turn (gattn_bench::time_in_turn) after one untimed call of each, which
/// takes the allocations and thread pools' start out of the first timed iteration.
template <class A, class B>
std::pair<double, double> warm_then_time(benchmark::State& state, const A& a, const B& b) {
    a();
    b();
    return gattn_bench::time_in_turn(state, a, b);
}

/// Args: N, d, causal, threads. 8 heads, one sequence.
void BM_SdpaTrainVsTorch(benchmark::State& state) {
    const gattn::Index n = state.range(0), d = state.range(1), h = 8;
    const bool causal = state.range(2) != 0;
    set_threads(static_cast<int>(state.range(3)));
    const Matrix q = Matrix::Random(n, h * d), k = Matrix::Random(n, h * d), v = Matrix::Random(n, h * d);
    const Matrix d_out = Matrix::Random(n, h * d);
    Matrix out(n, h * d), lse, dq(n, h * d), dk(n, h * d), dv(n, h * d);
    gattn::SdpaOptions<float> opt;
    opt.mask.causal = causal;
    gattn::SdpaOutputs<float> extra;
    extra.log_sum_exp = &lse;
    const gattn::HeadLayout heads{1, h, h};
    const torch::Tensor tq = view(q).clone().requires_grad_(), tk = view(k).clone().requires_grad_(),
                        tv = view(v).clone().requires_grad_(), t_dout = view(d_out);
    const auto [t_gattn, t_torch] = warm_then_time(
        state,
        [&] {
            gattn::scaled_dot_product_attention<float>(q, k, v, heads, out, opt, extra);
            gattn::scaled_dot_product_attention_backward<float>(q, k, v, heads, out, lse, d_out, dq, dk, dv, opt);
            benchmark::DoNotOptimize(dq.data());
        },
        [&] {
            for (const torch::Tensor* t : {&tq, &tk, &tv})
                if (t->grad().defined()) t->mutable_grad().zero_();
            torch_attention(tq, tk, tv, h, h, d, causal).backward(t_dout);
            benchmark::DoNotOptimize(tq.grad().data_ptr());
        });
    const double iterations = static_cast<double>(state.iterations());
    state.counters["gattn_ms"] = 1e3 * t_gattn / iterations;
    state.counters["torch_ms"] = 1e3 * t_torch / iterations;
    state.counters["speedup_vs_torch"] = t_torch / t_gattn;
}

/// Args: N, threads. D = 1024, 16 heads on 2 KV heads, head_dim 64, causal, G1 elementwise gate.
void BM_GatedLayerTrainVsTorch(benchmark::State& state) {
    const gattn::Index n = state.range(0), dm = 1024, h = 16, hkv = 2, d = 64;
    set_threads(static_cast<int>(state.range(1)));
    gattn::AttentionConfig c;
    c.d_model = dm;
    c.num_heads = h;
    c.num_kv_heads = hkv;
    c.head_dim = d;
    c.causal = true;
    c.gate = gattn::GateSpec::g1_elementwise(gattn::GateLayout::Separate);
    const gattn::AttentionWeights<float> w = gattn::make_random_weights<float>(c, 7);
    const gattn::GatedMultiHeadAttention<float> layer(c, w);
    const Matrix x = Matrix::Random(n, dm), d_out = Matrix::Random(n, dm);
    Matrix out(n, dm), d_x(n, dm);
    gattn::ForwardActivations<float> saved;
    gattn::AttentionWeights<float> grads;

    auto linear = [](const Matrix& weight) {
        torch::nn::Linear l(torch::nn::LinearOptions(weight.cols(), weight.rows()).bias(false));
        torch::NoGradGuard no_grad;
        l->weight.copy_(view(weight));
        return l;
    };
    torch::nn::Linear q_proj = linear(w.q_proj_weight), k_proj = linear(w.k_proj_weight),
                      v_proj = linear(w.v_proj_weight), gate_proj = linear(w.gate_proj_weight),
                      o_proj = linear(w.o_proj_weight);
    const torch::Tensor tx = view(x).clone().requires_grad_(), t_dout = view(d_out);
    const auto [t_gattn, t_torch] = warm_then_time(
        state,
        [&] {
            layer.forward_train(x, 1, out, saved);
            layer.backward(x, saved, d_out, grads, d_x);
            benchmark::DoNotOptimize(d_x.data());
        },
        [&] {
            for (torch::nn::Linear* l : {&q_proj, &k_proj, &v_proj, &gate_proj, &o_proj}) (*l)->zero_grad();
            if (tx.grad().defined()) tx.mutable_grad().zero_();
            const torch::Tensor u = torch_attention(q_proj(tx), k_proj(tx), v_proj(tx), h, hkv, d, true);
            o_proj(u * torch::sigmoid(gate_proj(tx))).backward(t_dout);
            benchmark::DoNotOptimize(tx.grad().data_ptr());
        });
    const double iterations = static_cast<double>(state.iterations());
    state.counters["gattn_ms"] = 1e3 * t_gattn / iterations;
    state.counters["torch_ms"] = 1e3 * t_torch / iterations;
    state.counters["speedup_vs_torch"] = t_torch / t_gattn;
}

}  // namespace

BENCHMARK(BM_SdpaTrainVsTorch)
    ->ArgNames({"N", "d", "causal", "threads"})
    ->ArgsProduct({{512, 2048}, {64, 128}, {0, 1}, {1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_GatedLayerTrainVsTorch)
    ->ArgNames({"N", "threads"})
    ->ArgsProduct({{512, 2048}, {1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

int main(int argc, char** argv) {
    // libtorch's version and the BLAS it was built with, in the benchmark context.
    const std::string config = at::show_config();
    std::string blas = "BLAS_INFO unknown";
    if (const auto at = config.find("BLAS_INFO="); at != std::string::npos)
        blas = config.substr(at, config.find_first_of(",\n", at) - at);
    benchmark::AddCustomContext("libtorch", std::string(TORCH_VERSION) + ", " + blas);
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
}
