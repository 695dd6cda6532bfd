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
  float s[kReduceLanes];
  for (int j = 0; j < NV; ++j) acc[j].store(s + j * V::kLanes);
  return combine_l16(s);
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
  float s[kReduceLanes];
  for (int j = 0; j < NV; ++j) acc[j].store(s + j * V::kLanes);
  return combine_l16(s);
}

}  // namespace eb::ops
