// The canonical L16 reduction (SPEC 3.3, docs/numerics.md): 16 partial sums, lane j takes the
// terms i = j (mod 16) in increasing i, products fused (acc = fma(a_i, b_i, acc)); the lanes are
// then combined as s_j += s_(j+w) for w = 8, 4, 2, 1. One AVX-512 register, two AVX2 registers
// or sixteen scalars hold the lanes; a tail is zero-padded, which leaves every lane unchanged
// (a lane that starts at +0.0 can never become -0.0). Reference twin: dot_l16<VecScalar>.
#pragma once
#include <cstdint>
#include <cstring>

namespace eb::ops {

constexpr int kReduceLanes = 16;

inline float combine_l16(float* s) {
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) s[j] = s[j] + s[j + w];
  return s[0];
}

// sum_i a[i] * b[i] (fused), L16 order.
template <class V>
float dot_l16(const float* a, const float* b, int64_t n) {
  constexpr int NV = kReduceLanes / V::kLanes;
  V acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = V::zero();
  int64_t i = 0;
  for (; i + kReduceLanes <= n; i += kReduceLanes)
    for (int j = 0; j < NV; ++j)
      acc[j] = V::fma(V::load(a + i + j * V::kLanes), V::load(b + i + j * V::kLanes), acc[j]);
  if (i < n) {
    float ta[kReduceLanes] = {0}, tb[kReduceLanes] = {0};
    std::memcpy(ta, a + i, sizeof(float) * static_cast<size_t>(n - i));
    std::memcpy(tb, b + i, sizeof(float) * static_cast<size_t>(n - i));
    for (int j = 0; j < NV; ++j)
      acc[j] = V::fma(V::load(ta + j * V::kLanes), V::load(tb + j * V::kLanes), acc[j]);
  }
  return V::reduce16(acc);
}

// Four dots q . k_r (r = 0..3) at once, each in its own L16 lanes: interleaving independent
// chains hides the FMA latency; every result has exactly dot_l16's bits.
template <class V>
inline void dot_l16_x4(const float* q, const float* const* k, int64_t n, float* out) {
  constexpr int NV = kReduceLanes / V::kLanes;
  V acc[4][NV];
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = V::zero();
  int64_t i = 0;
  for (; i + kReduceLanes <= n; i += kReduceLanes)
    for (int j = 0; j < NV; ++j) {
      const V qv = V::load(q + i + j * V::kLanes);
      for (int r = 0; r < 4; ++r)
        acc[r][j] = V::fma(qv, V::load(k[r] + i + j * V::kLanes), acc[r][j]);
    }
  if (i < n) {
    float tq[kReduceLanes] = {0};
    std::memcpy(tq, q + i, sizeof(float) * static_cast<size_t>(n - i));
    for (int r = 0; r < 4; ++r) {
      float tk[kReduceLanes] = {0};
      std::memcpy(tk, k[r] + i, sizeof(float) * static_cast<size_t>(n - i));
      for (int j = 0; j < NV; ++j)
        acc[r][j] = V::fma(V::load(tq + j * V::kLanes), V::load(tk + j * V::kLanes), acc[r][j]);
    }
  }
  for (int r = 0; r < 4; ++r) out[r] = V::reduce16(acc[r]);
}

// sum_i a[i] (plain adds), L16 order.
template <class V>
float sum_l16(const float* a, int64_t n) {
  constexpr int NV = kReduceLanes / V::kLanes;
  V acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = V::zero();
  int64_t i = 0;
  for (; i + kReduceLanes <= n; i += kReduceLanes)
    for (int j = 0; j < NV; ++j) acc[j] = V::add(acc[j], V::load(a + i + j * V::kLanes));
  if (i < n) {
    float ta[kReduceLanes] = {0};
    std::memcpy(ta, a + i, sizeof(float) * static_cast<size_t>(n - i));
    for (int j = 0; j < NV; ++j) acc[j] = V::add(acc[j], V::load(ta + j * V::kLanes));
  }
  return V::reduce16(acc);
}

}  // namespace eb::ops
