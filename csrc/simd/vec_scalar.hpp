// Scalar "vector" of one lane: the reference path of every kernel (STYLE 5.1).
// Same small API as vec_avx2.hpp / vec_avx512.hpp; fma is std::fma (one rounding).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include "simd/vec_common.hpp"

#include "math/exp.hpp"

namespace eb::simd {

struct VecScalar {
  static constexpr int kLanes = 1;
  float v;
  static VecScalar zero() { return {0.0f}; }
  static VecScalar set1(float a) { return {a}; }
  static VecScalar load(const float* p) { return {p[0]}; }
  void store(float* p) const { p[0] = v; }
  static VecScalar fma(VecScalar a, VecScalar b, VecScalar c) { return {std::fma(a.v, b.v, c.v)}; }
  static VecScalar add(VecScalar a, VecScalar b) { return {a.v + b.v}; }
  // y[i] = exp_f32(x[i]) (math/exp.hpp); x and y may alias. The SIMD types run the same
  // binary64 algorithm in 8 or 4 lanes and give the same bits (tests/unit/test_math.py).
  static void exp_array(const float* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = math::exp_f32(x[i]);
  }
  // The L16 tree over 16 lanes held in 16 / kLanes vectors: s_j += s_(j+w), w = 8, 4, 2, 1.
  // out[i] = reduce16 of the 16 lanes at acc + 16 * i, for i = 0..15.
  static void reduce16_x16(const float* acc, float* out) {
    reduce16_x16_by_lanes<VecScalar>(acc, out);
  }
  static float reduce16(const VecScalar* acc) {
    float s[16];
    for (int j = 0; j < 16; ++j) s[j] = acc[j].v;
    for (int w = 8; w >= 1; w /= 2)
      for (int j = 0; j < w; ++j) s[j] = s[j] + s[j + w];
    return s[0];
  }
  // max(a, b) that keeps b when a is NaN (a > b ? a : b); exact, so order-free.
  static VecScalar max(VecScalar a, VecScalar b) { return {a.v > b.v ? a.v : b.v}; }
  static VecScalar mul(VecScalar a, VecScalar b) { return {a.v * b.v}; }
  // Exact small-integer loads of compact weight codes (ops/gemm/format.hpp): an int8 -> float, and
  // a byte -> ((byte >> Shift) & 15) -> float.
  static VecScalar from_i8(const int8_t* p) { return {static_cast<float>(p[0])}; }
  template <int Shift>
  static VecScalar from_u4(const uint8_t* p) {
    return {static_cast<float>((p[0] >> Shift) & 15)};
  }
  // A bfloat16 bit pattern -> the float32 value it is the top half of (exact).
  static VecScalar from_bf16(const uint16_t* p) {
    const uint32_t u = static_cast<uint32_t>(p[0]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return {f};
  }
};

}  // namespace eb::simd
