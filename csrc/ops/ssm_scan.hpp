// One token of the Mamba-2 SSM recurrence for one head (SPEC 7.3 step 6):
//   dA = exp(dt * A);  h[p,n] = fma(h[p,n], dA, (dt * B[n]) * x[p])
//   y[p] = L16_n(h[p,n] * C[n]) + x[p] * D
// h: (head_dim, d_state) row-major, updated in place; vectorised across n (elementwise fma,
// so every ISA gives the same bits). Source: HF Mamba2Mixer recurrent update; SSD
// arXiv:2405.21060. dtb: scratch of d_state floats. Reference twin: <VecScalar>.
#pragma once
#include <cmath>
#include <cstdint>

#include "math/exp.hpp"
#include "ops/reduce.hpp"

namespace eb::ops {

template <class V>
inline void ssm_scan_step(float* h, int64_t head_dim, int64_t d_state, float dt, float a, float dd,
                          const float* x, const float* bv, const float* cv, float* dtb, float* y) {
  const float da = math::exp_f32(dt * a);
  for (int64_t n = 0; n < d_state; ++n) dtb[n] = dt * bv[n];
  const int64_t n_vec = d_state - d_state % V::kLanes;
  const V da_v = V::set1(da);
  for (int64_t p = 0; p < head_dim; ++p) {
    float* hp = h + p * d_state;
    const float xp = x[p];
    const V xp_v = V::set1(xp);
    for (int64_t n = 0; n < n_vec; n += V::kLanes) {
      const V term = V::mul(V::load(dtb + n), xp_v);
      V::fma(V::load(hp + n), da_v, term).store(hp + n);
    }
    for (int64_t n = n_vec; n < d_state; ++n) hp[n] = std::fma(hp[n], da, dtb[n] * xp);
  }
  // y[p] = L16_n(h[p,n] * C[n]) + x[p] * D, four rows at a time (independent chains).
  int64_t p = 0;
  for (; p + 4 <= head_dim; p += 4) {
    const float* rows[4] = {h + p * d_state, h + (p + 1) * d_state, h + (p + 2) * d_state,
                            h + (p + 3) * d_state};
    float s4[4];
    dot_l16_x4<V>(cv, rows, d_state, s4);
    for (int r = 0; r < 4; ++r) y[p + r] = s4[r] + x[p + r] * dd;
  }
  for (; p < head_dim; ++p) y[p] = dot_l16<V>(h + p * d_state, cv, d_state) + x[p] * dd;
}

}  // namespace eb::ops
