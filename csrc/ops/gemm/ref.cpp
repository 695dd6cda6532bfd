// The GEMM's scalar reference (ref.hpp), compiled once with the baseline flags.
#include "ops/gemm/ref.hpp"

#include <cmath>

namespace eb::ops {

void gemm_ref(const float* a, int64_t m, int64_t lda, const float* w, int64_t n_out, int64_t k_in,
              const float* bias, float* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t n = 0; n < n_out; ++n) {
      float s = 0.0f;
      for (int64_t k = 0; k < k_in; ++k) s = std::fma(a[i * lda + k], w[n * k_in + k], s);
      c[i * ldc + n] = bias ? s + bias[n] : s;
    }
}

}  // namespace eb::ops
