// Depthwise causal conv1d, one token (ref.hpp, SPEC 7.3 step 3): per channel one SEQ fma
// chain over the taps, oldest first, then the bias.
#include <cmath>

#include "ops/ref/ref.hpp"

namespace eb::ops::ref {

void conv1d_ref(const float* w, const float* u, int64_t ld, int64_t nc, int64_t k_taps,
                const float* bias, float* out) {
  for (int64_t ch = 0; ch < nc; ++ch) {
    float s = 0.0f;
    for (int64_t k = 0; k < k_taps; ++k) s = std::fma(w[k * ld + ch], u[k * ld + ch], s);
    out[ch] = bias ? s + bias[ch] : s;
  }
}

}  // namespace eb::ops::ref
