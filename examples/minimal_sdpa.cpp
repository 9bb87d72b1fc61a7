// The smallest useful gattn program: causal grouped-query attention on random activations.
//
// Activations are row-major [B·N, H·d] matrices (B sequences of N tokens, H heads of d features),
// the layout a projection GEMM produces, so no reshapes or transposes are needed.

#include <cstdio>

#include <gattn/gattn.hpp>

int main() {
    const gattn::Index batch = 2, seq_len = 5, num_heads = 4, num_kv_heads = 2, head_dim = 8;
    using Matrix = gattn::RowMatrix<float>;
    const Matrix query = Matrix::Random(batch * seq_len, num_heads * head_dim);
    const Matrix key = Matrix::Random(batch * seq_len, num_kv_heads * head_dim);
    const Matrix value = Matrix::Random(batch * seq_len, num_kv_heads * head_dim);

    gattn::SdpaOptions<float> options;  // scale defaults to 1/sqrt(head_dim)
    options.mask.causal = true;         // bottom-right aligned
    Matrix log_sum_exp;
    gattn::SdpaOutputs<float> extra;
    extra.log_sum_exp = &log_sum_exp;

    const Matrix out = gattn::scaled_dot_product_attention<float>(
        query, key, value, {batch, num_heads, num_kv_heads}, options, extra);

    std::printf("out: %ld x %ld (B·N x H·d)\n", static_cast<long>(out.rows()), static_cast<long>(out.cols()));
    std::printf("first token of sequence 0, head 0: ");
    for (gattn::Index e = 0; e < head_dim; ++e) std::printf("%.4f ", out(0, e));
    // The first token attends only to itself under the causal mask, so its output is its value.
    std::printf("\nits value row:                      ");
    for (gattn::Index e = 0; e < head_dim; ++e) std::printf("%.4f ", value(0, e));
    std::printf("\nlog-sum-exp of token 0, head 0: %.4f\n", log_sum_exp(0, 0));
    return 0;
}
