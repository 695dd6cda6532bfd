// Packing of weight matrices into the GEMM's panel layout, and the scalar GEMM reference.
// Packing moves bytes only; it cannot change a bit of any weight.
#include <algorithm>
#include <cmath>

#include "ops/gemm.hpp"

namespace eb::ops {

PackedMatrix pack_matrices(const std::vector<const float*>& parts, const std::vector<int64_t>& rows,
                           int64_t k_in, const std::vector<const float*>& biases) {
  PackedMatrix pm;
  pm.k_in = k_in;
  for (int64_t r : rows) pm.n_out += r;
  pm.n_panels = (pm.n_out + kGemmNR - 1) / kGemmNR;
  pm.data.assign(static_cast<size_t>(pm.n_panels * k_in * kGemmNR), 0.0f);
  bool any_bias = false;
  for (const float* b : biases) any_bias = any_bias || b != nullptr;
  if (any_bias) pm.bias.assign(static_cast<size_t>(pm.n_out), 0.0f);
  int64_t n = 0;
  for (size_t part = 0; part < parts.size(); ++part) {
    for (int64_t r = 0; r < rows[part]; ++r, ++n) {
      const float* src = parts[part] + r * k_in;
      float* dst = pm.data.data() + (n / kGemmNR) * k_in * kGemmNR + (n % kGemmNR);
      for (int64_t k = 0; k < k_in; ++k) dst[k * kGemmNR] = src[k];
      if (any_bias) pm.bias[static_cast<size_t>(n)] = biases[part][r];
    }
  }
  return pm;
}

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
