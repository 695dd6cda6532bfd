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

// ---------------------------------------------------------------------------------------------
// The same recurrence over a run of T tokens of one head, with each row of h held in registers
// across the tokens (no load/store of h per token). Per (token, row) it does exactly the
// operations of ssm_scan_step, in the same order: dtb[n] = dt * B[n]; h = fma(h, da, dtb * x);
// the L16 dot from +0.0 with fma(C, h, acc) per lane; y = reduce16 + x * D. So it has
// ssm_scan_step's bits for every input (a test pins this for every ISA).
// Used when d_state is a multiple of 16 and at most 16 * kScanMaxGroups.

constexpr int64_t kScanChunk = 32;     // tokens per register pass
constexpr int64_t kScanMaxGroups = 8;  // d_state <= 128 takes the register path

// Scratch floats ssm_scan_tokens needs for d_state = ns.
inline int64_t ssm_scan_scratch_floats(int64_t ns) {
  return kScanChunk * (ns + 1) + kScanChunk * kReduceLanes * kReduceLanes;
}

namespace detail {

template <class V, int NJ>
constexpr int scan_rows() {  // rows per register pass: about half the vector registers for h
  constexpr int per_row = NJ * (kReduceLanes / V::kLanes);
  constexpr int budget = V::kLanes >= 16 ? 16 : 8;
  return budget / per_row >= 4 ? 4 : (budget / per_row >= 2 ? 2 : 1);  // divides 16
}

// Rows p0..p0+R of h over tokens 0..T: h stays in registers; the 16 L16 lane sums of
// y[t][p0+r] go to acc + t * acc_t_stride + r * 16.
template <class V, int NJ, int R>
inline void scan_rows_chunk(float* h, int64_t ns, int64_t p0, int64_t T, const float* da,
                            const float* dtb, const float* const* x, const float* const* cv,
                            float* acc, int64_t acc_t_stride) {
  constexpr int NV = kReduceLanes / V::kLanes, NVEC = NJ * NV;
  V hr[R][NVEC];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NVEC; ++j) hr[r][j] = V::load(h + (p0 + r) * ns + j * V::kLanes);
  for (int64_t t = 0; t < T; ++t) {
    const V dav = V::set1(da[t]);
    const float* db = dtb + t * ns;
    const float* c = cv[t];
    V xp[R], a[R][NV];
    for (int r = 0; r < R; ++r) {
      xp[r] = V::set1(x[t][p0 + r]);
      for (int k = 0; k < NV; ++k) a[r][k] = V::zero();
    }
    for (int j = 0; j < NVEC; ++j) {
      const V b = V::load(db + j * V::kLanes), cc = V::load(c + j * V::kLanes);
      for (int r = 0; r < R; ++r) {
        hr[r][j] = V::fma(hr[r][j], dav, V::mul(b, xp[r]));
        a[r][j % NV] = V::fma(cc, hr[r][j], a[r][j % NV]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < NV; ++k)
        a[r][k].store(acc + t * acc_t_stride + r * kReduceLanes + k * V::kLanes);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NVEC; ++j) hr[r][j].store(h + (p0 + r) * ns + j * V::kLanes);
}

template <class V, int NJ>
inline void scan_chunk(float* h, int64_t hd, int64_t ns, int64_t T, const float* da,
                       const float* dtb, float dd, const float* const* x, const float* const* cv,
                       float* const* y, float* acc) {
  constexpr int R = scan_rows<V, NJ>();
  constexpr int NV = kReduceLanes / V::kLanes;
  int64_t p = 0;
  const auto finish = [&](int64_t p0, int rows) {  // y[t][p0 + r] from the lane sums
    const int64_t n_acc = T * rows;
    int64_t i = 0, t = 0, r = 0;  // accumulator i belongs to token t, row r
    float s16[kReduceLanes];
    for (; i + kReduceLanes <= n_acc; i += kReduceLanes) {
      V::reduce16_x16(acc + i * kReduceLanes, s16);
      for (int64_t k = 0; k < kReduceLanes; ++k) {
        y[t][p0 + r] = s16[k] + x[t][p0 + r] * dd;
        if (++r == rows) r = 0, ++t;
      }
    }
    for (; i < n_acc; ++i) {
      V lanes[NV];
      for (int k = 0; k < NV; ++k) lanes[k] = V::load(acc + i * kReduceLanes + k * V::kLanes);
      y[t][p0 + r] = V::reduce16(lanes) + x[t][p0 + r] * dd;
      if (++r == rows) r = 0, ++t;
    }
  };
  if (hd % kReduceLanes == 0) {
    // Groups of 16 rows: acc is (T, 16 rows, 16 lanes); per token, one 16-way reduction gives
    // the group's 16 sums, and y = s + x * D runs as whole vectors (same ops per element).
    for (; p < hd; p += kReduceLanes) {
      for (int64_t r0 = 0; r0 < kReduceLanes; r0 += R)
        scan_rows_chunk<V, NJ, R>(h, ns, p + r0, T, da, dtb, x, cv, acc + r0 * kReduceLanes,
                                  kReduceLanes * kReduceLanes);
      float s16[kReduceLanes];
      const V ddv = V::set1(dd);
      for (int64_t t = 0; t < T; ++t) {
        V::reduce16_x16(acc + t * kReduceLanes * kReduceLanes, s16);
        for (int k = 0; k < NV; ++k)
          V::add(V::load(s16 + k * V::kLanes), V::mul(V::load(x[t] + p + k * V::kLanes), ddv))
              .store(y[t] + p + k * V::kLanes);
      }
    }
    return;
  }
  for (; p + R <= hd; p += R) {
    scan_rows_chunk<V, NJ, R>(h, ns, p, T, da, dtb, x, cv, acc, R * kReduceLanes);
    finish(p, R);
  }
  for (; p < hd; ++p) {
    scan_rows_chunk<V, NJ, 1>(h, ns, p, T, da, dtb, x, cv, acc, kReduceLanes);
    finish(p, 1);
  }
}

}  // namespace detail

// T <= kScanChunk tokens of one head (the caller walks a row in such runs): token t has
// dt[t] (after softplus and clamp), x[t] (head_dim), B[t] and C[t] (d_state) and writes y[t]
// (head_dim). h as in ssm_scan_step. scratch holds ssm_scan_scratch_floats(ns) floats. Bits
// equal T calls of ssm_scan_step.
template <class V>
inline void ssm_scan_tokens(float* h, int64_t hd, int64_t ns, int64_t T, const float* dt, float a,
                            float dd, const float* const* x, const float* const* bv,
                            const float* const* cv, float* const* y, float* scratch) {
  const int64_t groups = ns / kReduceLanes;
  if (ns % kReduceLanes != 0 || groups < 1 || groups > kScanMaxGroups) {
    for (int64_t t = 0; t < T; ++t)
      ssm_scan_step<V>(h, hd, ns, dt[t], a, dd, x[t], bv[t], cv[t], scratch, y[t]);
    return;
  }
  float* da = scratch;
  float* dtb = da + kScanChunk;
  float* acc = dtb + kScanChunk * ns;
  for (int64_t t = 0; t < T; ++t) {  // dA and dt * B per token, as ssm_scan_step computes them
    da[t] = math::exp_f32(dt[t] * a);
    const V dtv = V::set1(dt[t]);
    for (int64_t i = 0; i < ns; i += V::kLanes)
      V::mul(dtv, V::load(bv[t] + i)).store(dtb + t * ns + i);
  }
  switch (groups) {
    case 1: detail::scan_chunk<V, 1>(h, hd, ns, T, da, dtb, dd, x, cv, y, acc); break;
    case 2: detail::scan_chunk<V, 2>(h, hd, ns, T, da, dtb, dd, x, cv, y, acc); break;
    case 3: detail::scan_chunk<V, 3>(h, hd, ns, T, da, dtb, dd, x, cv, y, acc); break;
    case 4: detail::scan_chunk<V, 4>(h, hd, ns, T, da, dtb, dd, x, cv, y, acc); break;
    case 5: detail::scan_chunk<V, 5>(h, hd, ns, T, da, dtb, dd, x, cv, y, acc); break;
    case 6: detail::scan_chunk<V, 6>(h, hd, ns, T, da, dtb, dd, x, cv, y, acc); break;
    case 7: detail::scan_chunk<V, 7>(h, hd, ns, T, da, dtb, dd, x, cv, y, acc); break;
    default: detail::scan_chunk<V, 8>(h, hd, ns, T, da, dtb, dd, x, cv, y, acc); break;
  }
}

}  // namespace eb::ops
