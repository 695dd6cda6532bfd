// The adjoint of the Mamba-2 recurrence for one (row, head) from a zero state (SPEC 7.5 step
// 6): a reverse-time scan over lambda = dLoss/dh. Per token t = n-1 down to 0, with h_t the
// forward's state after token t (h_-1 = 0), da_t = exp(dt_t * a) and da_n = +0.0:
//   lam[p][n] = fma(lam[p][n], da_(t+1), C[n] * dy[p])
//   s1[p] = L16_n(lam[p][n] * B[n]),  s2[p] = L16_n(lam[p][n] * h_(t-1)[p][n])
//   dx[p] = dy[p] * D + dt * s1[p]
//   dB[n] = dt * SEQ_p fma(lam[p][n], x[p], acc);   dC[n] = SEQ_p fma(h_t[p][n], dy[p], acc)
//   S1 = SEQ_p fma(s1[p], x[p], acc), S2 = SEQ_p (acc + s2[p]), dD_t = SEQ_p fma(dy[p], x[p], acc)
//   ddt = S1 + S2 * (a * da_t);   dA_t = S2 * (dt * da_t)
// (SEQ_p: p = 0..head_dim-1 from +0.0.) The states are recomputed, not stored: the forward
// keeps h before every kScanChunk-th token (the checkpoints), and each chunk's states are
// rebuilt from its checkpoint with the forward's own step (h = fma(h, da, (dt * B) * x), the
// bits of ssm_scan_step). Vectorised across n (elementwise, plus dot_l16's fixed lanes), so
// every ISA gives the same bits. Reference twin: ops::ref::ssm_scan_backward_ref.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "math/exp.hpp"
#include "ops/reduce.hpp"
#include "ops/ssm_scan.hpp"

namespace eb::ops {

// One (row, head) of the adjoint: n tokens; token t's inputs at x + t * s_act (head_dim), b and
// c + t * s_act (d_state), dy + t * s_dy (head_dim), dt[t * s_dt]; outputs dx + t * s_dx
// (head_dim), db and dc + t * s_bc (d_state), ddt, da_t and dd_t [t * s_sc].
struct ScanBackwardArgs {
  int64_t n = 0, head_dim = 0, d_state = 0;
  float a = 0.0f, d = 0.0f;
  const float *x = nullptr, *b = nullptr, *c = nullptr;
  int64_t s_act = 0;
  const float* dy = nullptr;
  int64_t s_dy = 0;
  const float* dt = nullptr;
  int64_t s_dt = 0;
  float* dx = nullptr;
  int64_t s_dx = 0;
  float *db = nullptr, *dc = nullptr;
  int64_t s_bc = 0;
  float *ddt = nullptr, *da_t = nullptr, *dd_t = nullptr;
  int64_t s_sc = 0;
};

// Floats of the fast kernel's scratch: a chunk's states, lambda, two d_state accumulators.
inline int64_t ssm_scan_backward_scratch_floats(int64_t hd, int64_t ns) {
  return (kScanChunk + 2) * hd * ns + 2 * ns;
}

// ckpt: ceil(n / kScanChunk) states (head_dim, d_state), the state before tokens 0, kScanChunk,
// 2 kScanChunk, ... (the first is zero).
template <class V>
void ssm_scan_backward(const ScanBackwardArgs& g, const float* ckpt, float* scratch) {
  const int64_t hd = g.head_dim, ns = g.d_state, hn = hd * ns;
  const int64_t n_vec = ns - ns % V::kLanes;
  constexpr int NV = kReduceLanes / V::kLanes;
  const bool fused = ns % kReduceLanes == 0;
  float* hs = scratch;                      // (kScanChunk + 1) states: h_(t0-1) .. h_(t0+T-1)
  float* lam = hs + (kScanChunk + 1) * hn;  // (head_dim, d_state)
  float* acc_b = lam + hn;                  // d_state
  float* acc_c = acc_b + ns;                // d_state
  for (int64_t i = 0; i < hn; ++i) lam[i] = 0.0f;
  float da_next = 0.0f;
  const int64_t n_chunks = (g.n + kScanChunk - 1) / kScanChunk;
  for (int64_t ci = n_chunks - 1; ci >= 0; --ci) {
    const int64_t t0 = ci * kScanChunk, T = std::min(kScanChunk, g.n - t0);
    std::memcpy(hs, ckpt + ci * hn, sizeof(float) * static_cast<size_t>(hn));
    for (int64_t t = 0; t < T; ++t) {  // rebuild the chunk's states: the forward's step
      const int64_t tt = t0 + t;
      const float dt = g.dt[tt * g.s_dt], da = math::exp_f32(dt * g.a);
      const float* bv = g.b + tt * g.s_act;
      const float* xv = g.x + tt * g.s_act;
      for (int64_t n = 0; n < ns; ++n) acc_b[n] = dt * bv[n];  // dtb
      const float* src = hs + t * hn;
      float* dst = hs + (t + 1) * hn;
      const V da_v = V::set1(da);
      for (int64_t p = 0; p < hd; ++p) {
        const V xp_v = V::set1(xv[p]);
        for (int64_t n = 0; n < n_vec; n += V::kLanes)
          V::fma(V::load(src + p * ns + n), da_v, V::mul(V::load(acc_b + n), xp_v))
              .store(dst + p * ns + n);
        for (int64_t n = n_vec; n < ns; ++n)
          dst[p * ns + n] = std::fma(src[p * ns + n], da, acc_b[n] * xv[p]);
      }
    }
    for (int64_t t = T - 1; t >= 0; --t) {
      const int64_t tt = t0 + t;
      const float dt = g.dt[tt * g.s_dt], da = math::exp_f32(dt * g.a);
      const float* xv = g.x + tt * g.s_act;
      const float* bv = g.b + tt * g.s_act;
      const float* cv = g.c + tt * g.s_act;
      const float* dy = g.dy + tt * g.s_dy;
      const float* hp = hs + t * hn;        // h_(t-1)
      const float* ht = hs + (t + 1) * hn;  // h_t
      float* dx = g.dx + tt * g.s_dx;
      for (int64_t n = 0; n < ns; ++n) acc_b[n] = acc_c[n] = 0.0f;
      float s1_sum = 0.0f, s2_sum = 0.0f, dd_sum = 0.0f;
      const V dan_v = V::set1(da_next);
      for (int64_t p = 0; p < hd; ++p) {
        float* lp = lam + p * ns;
        const float dyp = dy[p], xp = xv[p];
        const V dy_v = V::set1(dyp), x_v = V::set1(xp);
        float s1, s2;
        if (fused) {  // lam update, both L16 dots and the dB / dC sums in one pass
          V a1[NV], a2[NV];
          for (int j = 0; j < NV; ++j) a1[j] = a2[j] = V::zero();
          for (int64_t i = 0; i < ns; i += kReduceLanes)
            for (int j = 0; j < NV; ++j) {
              const int64_t n = i + j * V::kLanes;
              const V l = V::fma(V::load(lp + n), dan_v, V::mul(V::load(cv + n), dy_v));
              l.store(lp + n);
              a1[j] = V::fma(l, V::load(bv + n), a1[j]);
              a2[j] = V::fma(l, V::load(hp + p * ns + n), a2[j]);
              V::fma(l, x_v, V::load(acc_b + n)).store(acc_b + n);
              V::fma(V::load(ht + p * ns + n), dy_v, V::load(acc_c + n)).store(acc_c + n);
            }
          s1 = V::reduce16(a1);
          s2 = V::reduce16(a2);
        } else {
          for (int64_t n = 0; n < n_vec; n += V::kLanes)
            V::fma(V::load(lp + n), dan_v, V::mul(V::load(cv + n), dy_v)).store(lp + n);
          for (int64_t n = n_vec; n < ns; ++n) lp[n] = std::fma(lp[n], da_next, cv[n] * dyp);
          s1 = dot_l16<V>(lp, bv, ns);
          s2 = dot_l16<V>(lp, hp + p * ns, ns);
          for (int64_t n = 0; n < n_vec; n += V::kLanes) {
            V::fma(V::load(lp + n), x_v, V::load(acc_b + n)).store(acc_b + n);
            V::fma(V::load(ht + p * ns + n), dy_v, V::load(acc_c + n)).store(acc_c + n);
          }
          for (int64_t n = n_vec; n < ns; ++n) {
            acc_b[n] = std::fma(lp[n], xp, acc_b[n]);
            acc_c[n] = std::fma(ht[p * ns + n], dyp, acc_c[n]);
          }
        }
        dx[p] = dyp * g.d + dt * s1;
        s1_sum = std::fma(s1, xp, s1_sum);
        s2_sum = s2_sum + s2;
        dd_sum = std::fma(dyp, xp, dd_sum);
      }
      float* db = g.db + tt * g.s_bc;
      float* dc = g.dc + tt * g.s_bc;
      for (int64_t n = 0; n < ns; ++n) {
        db[n] = dt * acc_b[n];
        dc[n] = acc_c[n];
      }
      g.ddt[tt * g.s_sc] = s1_sum + s2_sum * (g.a * da);
      g.da_t[tt * g.s_sc] = s2_sum * (dt * da);
      g.dd_t[tt * g.s_sc] = dd_sum;
      da_next = da;
    }
  }
}

}  // namespace eb::ops
