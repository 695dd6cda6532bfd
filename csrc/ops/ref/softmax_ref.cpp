// Softmax of attention scores (ref.hpp, SPEC 4.3 step 6): element by element, the library's
// own exp and tanh (math/), the denominator in L16 order.
#include <limits>

#include "math/exp.hpp"
#include "math/tanh.hpp"
#include "ops/ref/ref.hpp"

namespace eb::ops::ref {

void softmax_ref(float* s, int64_t n, float scale, float softcap) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    float x = s[j] * scale;
    if (softcap > 0.0f) x = math::tanh_f32(x / softcap) * softcap;
    s[j] = x;
    if (x > m) m = x;
  }
  for (int64_t j = 0; j < n; ++j) s[j] = math::exp_f32(s[j] - m);
  const float z = sum_l16_ref(s, n);
  for (int64_t j = 0; j < n; ++j) s[j] = s[j] / z;
}

}  // namespace eb::ops::ref
