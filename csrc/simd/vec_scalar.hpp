// Scalar "vector" of one lane: the reference path of every kernel (STYLE 5.1).
// Same small API as vec_avx2.hpp / vec_avx512.hpp; fma is std::fma (one rounding).
#pragma once
#include <cmath>

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
  static VecScalar mul(VecScalar a, VecScalar b) { return {a.v * b.v}; }
};

}  // namespace eb::simd
