// The MLP's activation and GLU product (ref.hpp, SPEC 4.3 step 9, 3.4), element by element with
// the scalar activations of math/derived.hpp.
#include "math/derived.hpp"
#include "ops/activations.hpp"
#include "ops/ref/ref.hpp"

namespace eb::ops::ref {

void mlp_combine_ref(int kind, const float* gu, int64_t it, float* u) {
  for (int64_t i = 0; i < it; ++i) {
    const float v = gu[i];
    float act;
    if (kind == kSwiGlu) {
      act = math::silu_f32(v);
    } else if (kind == kGeGlu || kind == kGelu) {
      act = math::gelu_f32(v);
    } else {
      act = math::gelu_tanh_f32(v);
    }
    const bool gated = kind == kSwiGlu || kind == kGeGlu || kind == kGeGluTanh;
    u[i] = gated ? act * gu[it + i] : act;
  }
}

}  // namespace eb::ops::ref
