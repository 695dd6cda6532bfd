// AVX2 + FMA vector of 8 float lanes; same API as vec_scalar.hpp. Compiled only into the
// avx2/avx512 kernel translation units (their own -m flags), never into generic code.
#pragma once
#include <immintrin.h>

namespace eb::simd {

struct VecAvx2 {
  static constexpr int kLanes = 8;
  __m256 v;
  static VecAvx2 zero() { return {_mm256_setzero_ps()}; }
  static VecAvx2 set1(float a) { return {_mm256_set1_ps(a)}; }
  static VecAvx2 load(const float* p) { return {_mm256_loadu_ps(p)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  static VecAvx2 fma(VecAvx2 a, VecAvx2 b, VecAvx2 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static VecAvx2 add(VecAvx2 a, VecAvx2 b) { return {_mm256_add_ps(a.v, b.v)}; }
  static VecAvx2 mul(VecAvx2 a, VecAvx2 b) { return {_mm256_mul_ps(a.v, b.v)}; }
};

}  // namespace eb::simd
