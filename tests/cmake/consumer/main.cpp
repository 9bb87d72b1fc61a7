// Builds a gated layer through the installed or vendored package and checks one value by hand,
// and that the target defines the expected EIGEN_MAX_ALIGN_BYTES (before Eigen is included).
#if GATTN_CONSUMER_EIGEN_ALIGN
#if !defined(EIGEN_MAX_ALIGN_BYTES) || EIGEN_MAX_ALIGN_BYTES != GATTN_CONSUMER_EIGEN_ALIGN
#error "gattn::gattn does not define the expected EIGEN_MAX_ALIGN_BYTES"
#endif
#elif defined(EIGEN_MAX_ALIGN_BYTES)
#error "gattn::gattn defines EIGEN_MAX_ALIGN_BYTES although GATTN_EIGEN_MAX_ALIGN_BYTES is empty"
#endif

#include <gattn/gattn.hpp>

#include <cmath>
#include <cstdio>

int main() {
    // One token attends only to itself, so SDPA returns its value row.
    gattn::RowMatrix<float> q(1, 2), k(1, 2), v(1, 2);
    q << 1, 2;
    k << 3, 4;
    v << 5, -6;
    const auto out = gattn::scaled_dot_product_attention<float>(q, k, v, {1, 1, 1});
    const bool ok = out(0, 0) == 5.0f && out(0, 1) == -6.0f;
    std::printf("gattn %d.%d.%d consumer: %s\n", GATTN_VERSION_MAJOR, GATTN_VERSION_MINOR, GATTN_VERSION_PATCH,
                ok ? "ok" : "wrong result");
    return ok ? 0 : 1;
}
