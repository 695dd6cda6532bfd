// RoPE on one vector (ref.hpp, SPEC 4.4): the angle by one binary32 multiply, the library's own
// cos and sin, and each rotated component from two separately rounded products.
#include "math/sincos.hpp"
#include "ops/ref/ref.hpp"

namespace eb::ops::ref {

void rope_ref(float* v, int64_t rope_dim, int64_t pos, const float* inv_freq) {
  const int64_t half = rope_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float angle = static_cast<float>(pos) * inv_freq[i];
    const float c = math::cos_f32(angle), s = math::sin_f32(angle);
    const float a = v[i], b = v[i + half];
    const float ac = a * c, bs = b * s, bc = b * c, as = a * s;
    v[i] = ac - bs;
    v[i + half] = bc + as;
  }
}

}  // namespace eb::ops::ref
