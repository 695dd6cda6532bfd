// AVX2 + FMA vector of 8 float lanes; same API as vec_scalar.hpp. Compiled only into the
// avx2/avx512 kernel translation units (their own -m flags), never into generic code.
#pragma once
#include <immintrin.h>
#include "simd/vec_common.hpp"

#include <cstdint>

#include "math/exp.hpp"

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
  // y[i] = exp_f32(x[i]) (math/exp.hpp, detail::exp_dd with lo = 0) in binary64 lanes, the
  // same operations in the same order as the scalar routine: n = (x*log2e + S) - S,
  // r = fma(-n, ln2_hi, x), r = fma(-n, ln2_lo, r), r = r + 0, Horner fma chain of 1/k!,
  // e = fma(r*r, q, r), y = 1 + e, y * 2^n (exact here: n in [-159, 128]), one rounding to
  // binary32. Special inputs (NaN, overflow, x < -110) are blended afterwards. Tails use the
  // scalar routine. x and y may alias.
  static void exp_array(const float* x, float* y, int64_t n) {
    int64_t i = 0;
    // kExpU vectors per pass, each step applied to all before the next (as VecAvx512): the
    // independent chains interleave in program order and keep the scheduler fed.
    for (; i + 4 * kExpU <= n; i += 4 * kExpU) exp_vectors<kExpU>(x + i, y + i);
    for (; i + 4 <= n; i += 4) exp_vectors<1>(x + i, y + i);
    for (; i < n; ++i) y[i] = math::exp_f32(x[i]);
  }
  static constexpr int kExpU = 4;  // measured: 1 -> 2.2, 2 -> 2.2, 4 -> 1.9 ns per exp
  template <int U>
  static inline void exp_vectors(const float* x, float* y) {
    __m128 xf[U], over[U], under[U], nan[U], out[U];
    __m256d xd[U], nd[U], r[U], q[U];
    for (int u = 0; u < U; ++u) {
      xf[u] = _mm_loadu_ps(x + 4 * u);
      over[u] = _mm_cmp_ps(xf[u], _mm_set1_ps(math::detail::kExpF32Inf), _CMP_GT_OQ);
      under[u] = _mm_cmp_ps(xf[u], _mm_set1_ps(math::detail::kExpF32Zero), _CMP_LT_OQ);
      nan[u] = _mm_cmp_ps(xf[u], xf[u], _CMP_UNORD_Q);
      xd[u] = _mm256_cvtps_pd(xf[u]);
    }
    for (int u = 0; u < U; ++u)
      xd[u] = _mm256_min_pd(_mm256_max_pd(xd[u], _mm256_set1_pd(math::detail::kExpF32Zero)),
                            _mm256_set1_pd(math::detail::kExpClampHi));
    const __m256d shifter = _mm256_set1_pd(0x1.8p52);
    for (int u = 0; u < U; ++u) nd[u] = _mm256_mul_pd(xd[u], _mm256_set1_pd(math::detail::kLog2e));
    for (int u = 0; u < U; ++u) nd[u] = _mm256_sub_pd(_mm256_add_pd(nd[u], shifter), shifter);
    for (int u = 0; u < U; ++u)
      r[u] = _mm256_fnmadd_pd(nd[u], _mm256_set1_pd(math::detail::kLn2Hi), xd[u]);
    for (int u = 0; u < U; ++u)
      r[u] = _mm256_fnmadd_pd(nd[u], _mm256_set1_pd(math::detail::kLn2Lo), r[u]);
    for (int u = 0; u < U; ++u) r[u] = _mm256_add_pd(r[u], _mm256_setzero_pd());
    const double* taylor = math::detail::kExpTaylor;
    for (int u = 0; u < U; ++u) q[u] = _mm256_set1_pd(taylor[0]);
    for (int k = 1; k < 12; ++k)
      for (int u = 0; u < U; ++u) q[u] = _mm256_fmadd_pd(q[u], r[u], _mm256_set1_pd(taylor[k]));
    for (int u = 0; u < U; ++u) {
      const __m256d e = _mm256_fmadd_pd(_mm256_mul_pd(r[u], r[u]), q[u], r[u]);
      const __m256d yd = _mm256_add_pd(_mm256_set1_pd(1.0), e);
      const __m256i ni = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(nd[u]));
      const __m256d p2 = _mm256_castsi256_pd(
          _mm256_slli_epi64(_mm256_add_epi64(ni, _mm256_set1_epi64x(1023)), 52));
      out[u] = _mm256_cvtpd_ps(_mm256_mul_pd(yd, p2));
    }
    for (int u = 0; u < U; ++u) {
      out[u] = _mm_blendv_ps(out[u], _mm_set1_ps(__builtin_huge_valf()), over[u]);
      out[u] = _mm_blendv_ps(out[u], _mm_setzero_ps(), under[u]);
      out[u] = _mm_blendv_ps(out[u], _mm_castsi128_ps(_mm_set1_epi32(0x7FC00000)), nan[u]);
      _mm_storeu_ps(y + 4 * u, out[u]);
    }
  }
  // out[i] = reduce16 of the 16 lanes at acc + 16 * i, for i = 0..15: the same tree for 16
  // accumulators at once, pairing them across registers with shuffles; each lane add is one of
  // reduce16's adds (same operands, same order), so the bits are equal.
  static void reduce16_x16(const float* acc, float* out) {
    __m256 t[16], u[8], v[4], w[2];
    for (int i = 0; i < 16; ++i)  // w = 8
      t[i] = _mm256_add_ps(_mm256_loadu_ps(acc + 16 * i), _mm256_loadu_ps(acc + 16 * i + 8));
    for (int k = 0; k < 8; ++k)  // w = 4: halves hold a_k, a_(k+8)
      u[k] = _mm256_add_ps(_mm256_permute2f128_ps(t[k], t[k + 8], 0x20),
                           _mm256_permute2f128_ps(t[k], t[k + 8], 0x31));
    for (int k = 0; k < 4; ++k)  // w = 2: lo (a_k, a_(k+4)), hi (a_(k+8), a_(k+12))
      v[k] = _mm256_add_ps(_mm256_shuffle_ps(u[k], u[k + 4], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm256_shuffle_ps(u[k], u[k + 4], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 2; ++k)  // w = 1: lo (a_k, a_(k+4), a_(k+2), a_(k+6)), hi the same + 8
      w[k] = _mm256_add_ps(_mm256_shuffle_ps(v[k], v[k + 2], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm256_shuffle_ps(v[k], v[k + 2], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m256 x = _mm256_unpacklo_ps(w[0], w[1]);  // lo a0 a1 a4 a5, hi a8 a9 a12 a13
    const __m256 y = _mm256_unpackhi_ps(w[0], w[1]);  // lo a2 a3 a6 a7, hi a10 a11 a14 a15
    const __m256 p = _mm256_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0));  // a0..a3 | a8..a11
    const __m256 q = _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2));  // a4..a7 | a12..a15
    _mm256_storeu_ps(out, _mm256_permute2f128_ps(p, q, 0x20));
    _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(p, q, 0x31));
  }
  // The L16 tree: acc[0] holds lanes 0..7, acc[1] lanes 8..15; s_j += s_(j+w), w = 8, 4, 2, 1.
  static float reduce16(const VecAvx2* acc) {
    const __m256 t8 = _mm256_add_ps(acc[0].v, acc[1].v);  // w = 8
    const __m128 lo4 = _mm256_castps256_ps128(t8), hi4 = _mm256_extractf128_ps(t8, 1);
    const __m128 t4 = _mm_add_ps(lo4, hi4);                       // w = 4
    const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));      // w = 2: lanes 0,1
    const __m128 t1 = _mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1));  // w = 1
    return _mm_cvtss_f32(t1);
  }
  // max(a, b) keeping b when either is NaN (maxps returns its second operand then).
  static VecAvx2 max(VecAvx2 a, VecAvx2 b) { return {_mm256_max_ps(a.v, b.v)}; }
  static VecAvx2 mul(VecAvx2 a, VecAvx2 b) { return {_mm256_mul_ps(a.v, b.v)}; }
  // Exact small-integer loads of compact weight codes (ops/gemm/format.hpp): kLanes int8 -> float,
  // and kLanes bytes -> ((byte >> Shift) & 15) -> float.
  static VecAvx2 from_i8(const int8_t* p) {
    return {_mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
  }
  template <int Shift>
  static VecAvx2 from_u4(const uint8_t* p) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return {
        _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, Shift), _mm256_set1_epi32(15)))};
  }
  // kLanes bfloat16 bit patterns -> the float32 values they are the top halves of (exact).
  static VecAvx2 from_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
  }
};

}  // namespace eb::simd
