// The backward kernels' naive twins (backward_ref.hpp): plain scalar loops.
#include "ops/ref/backward_ref.hpp"

#include <cmath>
#include <vector>

#include "math/exp.hpp"
#include "ops/ref/ref.hpp"

namespace eb::ops::ref {

void outer_gemm_ref(const float* A, int64_t sak, int64_t sar, const float* Bm, int64_t ldb,
                    int64_t R, int64_t N, int64_t K, float* C, int64_t ldc) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < N; ++j) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(A[k * sak + r * sar], Bm[k * ldb + j], acc);
      C[r * ldc + j] = acc;
    }
}

void col_reduce_ref(const float* A, int64_t lda, const float* Bm, int64_t ldb, int64_t M, int64_t N,
                    float* out) {
  for (int64_t j = 0; j < N; ++j) {
    float acc = 0.0f;
    for (int64_t m = 0; m < M; ++m)
      acc = Bm ? std::fma(A[m * lda + j], Bm[m * ldb + j], acc) : acc + A[m * lda + j];
    out[j] = acc;
  }
}

void ssm_scan_backward_ref(const ScanBackwardArgs& g) {
  const int64_t hd = g.head_dim, ns = g.d_state, hn = hd * ns;
  // h[t + 1] = state after token t, h[0] = 0
  std::vector<float> h(static_cast<size_t>((g.n + 1) * hn), 0.0f);
  for (int64_t t = 0; t < g.n; ++t) {
    const float dt = g.dt[t * g.s_dt], da = math::exp_f32(dt * g.a);
    const float* x = g.x + t * g.s_act;
    const float* b = g.b + t * g.s_act;
    for (int64_t p = 0; p < hd; ++p)
      for (int64_t n = 0; n < ns; ++n)
        h[(t + 1) * hn + p * ns + n] = std::fma(h[t * hn + p * ns + n], da, (dt * b[n]) * x[p]);
  }
  std::vector<float> lam(static_cast<size_t>(hn), 0.0f), sb(static_cast<size_t>(ns)),
      sc(static_cast<size_t>(ns));
  float da_next = 0.0f;
  for (int64_t t = g.n - 1; t >= 0; --t) {
    const float dt = g.dt[t * g.s_dt], da = math::exp_f32(dt * g.a);
    const float* x = g.x + t * g.s_act;
    const float* b = g.b + t * g.s_act;
    const float* c = g.c + t * g.s_act;
    const float* dy = g.dy + t * g.s_dy;
    const float* hp = &h[t * hn];
    const float* ht = &h[(t + 1) * hn];
    for (int64_t n = 0; n < ns; ++n) sb[n] = sc[n] = 0.0f;
    float s1_sum = 0.0f, s2_sum = 0.0f, dd_sum = 0.0f;
    for (int64_t p = 0; p < hd; ++p) {
      float* lp = &lam[p * ns];
      for (int64_t n = 0; n < ns; ++n) lp[n] = std::fma(lp[n], da_next, c[n] * dy[p]);
      const float s1 = dot_l16_ref(lp, b, ns), s2 = dot_l16_ref(lp, hp + p * ns, ns);
      g.dx[t * g.s_dx + p] = dy[p] * g.d + dt * s1;
      for (int64_t n = 0; n < ns; ++n) {
        sb[n] = std::fma(lp[n], x[p], sb[n]);
        sc[n] = std::fma(ht[p * ns + n], dy[p], sc[n]);
      }
      s1_sum = std::fma(s1, x[p], s1_sum);
      s2_sum = s2_sum + s2;
      dd_sum = std::fma(dy[p], x[p], dd_sum);
    }
    for (int64_t n = 0; n < ns; ++n) {
      g.db[t * g.s_bc + n] = dt * sb[n];
      g.dc[t * g.s_bc + n] = sc[n];
    }
    g.ddt[t * g.s_sc] = s1_sum + s2_sum * (g.a * da);
    g.da_t[t * g.s_sc] = s2_sum * (dt * da);
    g.dd_t[t * g.s_sc] = dd_sum;
    da_next = da;
  }
}

}  // namespace eb::ops::ref
