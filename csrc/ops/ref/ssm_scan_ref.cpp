// One token of the Mamba-2 SSM recurrence for one head (ref.hpp, SPEC 7.3 step 6): the state
// update element by element, then each output as an L16 dot over d_state plus x * D.
#include <cmath>

#include "math/exp.hpp"
#include "ops/ref/ref.hpp"

namespace eb::ops::ref {

void ssm_scan_step_ref(float* h, int64_t head_dim, int64_t d_state, float dt, float a, float d,
                       const float* x, const float* b, const float* c, float* y) {
  const float da = math::exp_f32(dt * a);
  for (int64_t p = 0; p < head_dim; ++p) {
    float* hp = h + p * d_state;
    for (int64_t n = 0; n < d_state; ++n) {
      const float dtb = dt * b[n];
      hp[n] = std::fma(hp[n], da, dtb * x[p]);
    }
    y[p] = dot_l16_ref(hp, c, d_state) + x[p] * d;
  }
}

}  // namespace eb::ops::ref
