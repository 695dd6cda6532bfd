// Row norms (SPEC 4.3, 7.3), over n elements, sums in L16 order (ops/reduce.hpp):
//   rmsnorm        r = 1 / sqrt(L16(x*x)/n + eps),  y = w * (x * r)        HF LlamaRMSNorm
//   rmsnorm_offset y = (x * r) * w1, w1 = float32(1 + w) made once at load HF GemmaRMSNorm
//   layernorm      mu = L16(x)/n, c = x - mu, r = 1/sqrt(L16(c*c)/n + eps),
//                  y = (c * r) * w (+ b)                                    torch LayerNorm
// y may alias x. The mean is sum / float32(n); 1/sqrt is two correctly rounded IEEE ops.
// Reference twin: norm_row<VecScalar>.
#pragma once
#include <cmath>
#include <cstdint>

#include "ops/reduce.hpp"

namespace eb::ops {

enum NormKind : int { kRmsNorm = 0, kLayerNorm = 1, kRmsNormOffset = 2 };

template <class V>
inline void norm_row(int kind, const float* x, int64_t n, const float* w, const float* b, float eps,
                     float* y) {
  const float nf = static_cast<float>(n);
  if (kind == kLayerNorm) {
    const float mu = sum_l16<V>(x, n) / nf;
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] - mu;
    const float r = 1.0f / std::sqrt(dot_l16<V>(y, y, n) / nf + eps);
    if (b) {
      for (int64_t i = 0; i < n; ++i) y[i] = (y[i] * r) * w[i] + b[i];
    } else {
      for (int64_t i = 0; i < n; ++i) y[i] = (y[i] * r) * w[i];
    }
    return;
  }
  const float r = 1.0f / std::sqrt(dot_l16<V>(x, x, n) / nf + eps);
  if (kind == kRmsNormOffset) {
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * r) * w[i];
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
  }
}

}  // namespace eb::ops
