// AVX-512F vector of 16 float lanes; same API as vec_scalar.hpp.
#pragma once
#include <immintrin.h>

namespace eb::simd {

struct VecAvx512 {
  static constexpr int kLanes = 16;
  __m512 v;
  static VecAvx512 zero() { return {_mm512_setzero_ps()}; }
  static VecAvx512 set1(float a) { return {_mm512_set1_ps(a)}; }
  static VecAvx512 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  static VecAvx512 fma(VecAvx512 a, VecAvx512 b, VecAvx512 c) {
    return {_mm512_fmadd_ps(a.v, b.v, c.v)};
  }
  static VecAvx512 add(VecAvx512 a, VecAvx512 b) { return {_mm512_add_ps(a.v, b.v)}; }
  static VecAvx512 mul(VecAvx512 a, VecAvx512 b) { return {_mm512_mul_ps(a.v, b.v)}; }
};

}  // namespace eb::simd
