// AVX-512F vector of 16 float lanes; same API as vec_scalar.hpp.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "math/exp.hpp"

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
  // y[i] = exp_f32(x[i]) (math/exp.hpp, detail::exp_dd with lo = 0) in binary64 lanes, the
  // same operations in the same order as the scalar routine: n = (x*log2e + S) - S,
  // r = fma(-n, ln2_hi, x), r = fma(-n, ln2_lo, r), r = r + 0, Horner fma chain of 1/k!,
  // e = fma(r*r, q, r), y = 1 + e, y * 2^n (exact here: n in [-159, 128]), one rounding to
  // binary32. Special inputs (NaN, overflow, x < -110) are blended afterwards. Tails use the
  // scalar routine. x and y may alias.
  static void exp_array(const float* x, float* y, int64_t n) {
    int64_t i = 0;
    // kU vectors per pass, each step applied to all of them before the next: the chain of one
    // vector is ~100 cycles long, and interleaving independent chains in program order keeps
    // the scheduler fed (run one after the other they fill it with waiting operations).
    for (; i + 8 * kExpU <= n; i += 8 * kExpU) exp_vectors<kExpU>(x + i, y + i);
    for (; i + 8 <= n; i += 8) exp_vectors<1>(x + i, y + i);
    for (; i < n; ++i) y[i] = math::exp_f32(x[i]);
  }
  static constexpr int kExpU = 4;  // measured: 2 -> 1.3, 4 -> 1.2, 6 -> 1.15 ns per exp
  template <int U>
  static inline void exp_vectors(const float* x, float* y) {
    __m256 xf[U], out[U];
    __mmask8 over[U], under[U], nan[U];
    __m512d xd[U], nd[U], r[U], q[U];
    for (int u = 0; u < U; ++u) {
      xf[u] = _mm256_loadu_ps(x + 8 * u);
      over[u] = _mm256_cmp_ps_mask(xf[u], _mm256_set1_ps(math::detail::kExpF32Inf), _CMP_GT_OQ);
      under[u] = _mm256_cmp_ps_mask(xf[u], _mm256_set1_ps(math::detail::kExpF32Zero), _CMP_LT_OQ);
      nan[u] = _mm256_cmp_ps_mask(xf[u], xf[u], _CMP_UNORD_Q);
      xd[u] = _mm512_cvtps_pd(xf[u]);
    }
    for (int u = 0; u < U; ++u)
      xd[u] = _mm512_min_pd(_mm512_max_pd(xd[u], _mm512_set1_pd(math::detail::kExpF32Zero)),
                            _mm512_set1_pd(math::detail::kExpClampHi));
    const __m512d shifter = _mm512_set1_pd(0x1.8p52);
    for (int u = 0; u < U; ++u) nd[u] = _mm512_mul_pd(xd[u], _mm512_set1_pd(math::detail::kLog2e));
    for (int u = 0; u < U; ++u) nd[u] = _mm512_sub_pd(_mm512_add_pd(nd[u], shifter), shifter);
    for (int u = 0; u < U; ++u)
      r[u] = _mm512_fnmadd_pd(nd[u], _mm512_set1_pd(math::detail::kLn2Hi), xd[u]);
    for (int u = 0; u < U; ++u)
      r[u] = _mm512_fnmadd_pd(nd[u], _mm512_set1_pd(math::detail::kLn2Lo), r[u]);
    for (int u = 0; u < U; ++u) r[u] = _mm512_add_pd(r[u], _mm512_setzero_pd());
    const double* taylor = math::detail::kExpTaylor;
    for (int u = 0; u < U; ++u) q[u] = _mm512_set1_pd(taylor[0]);
    for (int k = 1; k < 12; ++k)
      for (int u = 0; u < U; ++u) q[u] = _mm512_fmadd_pd(q[u], r[u], _mm512_set1_pd(taylor[k]));
    for (int u = 0; u < U; ++u) {
      const __m512d e = _mm512_fmadd_pd(_mm512_mul_pd(r[u], r[u]), q[u], r[u]);
      const __m512d yd = _mm512_add_pd(_mm512_set1_pd(1.0), e);
      const __m512i ni = _mm512_cvtpd_epi64(nd[u]);
      const __m512d p2 =
          _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_add_epi64(ni, _mm512_set1_epi64(1023)), 52));
      out[u] = _mm512_cvtpd_ps(_mm512_mul_pd(yd, p2));
    }
    for (int u = 0; u < U; ++u) {
      out[u] = _mm256_mask_blend_ps(over[u], out[u], _mm256_set1_ps(__builtin_huge_valf()));
      out[u] = _mm256_mask_blend_ps(under[u], out[u], _mm256_setzero_ps());
      out[u] =
          _mm256_mask_blend_ps(nan[u], out[u], _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)));
      _mm256_storeu_ps(y + 8 * u, out[u]);
    }
  }
  // out[i] = reduce16 of the 16 lanes at acc + 16 * i, for i = 0..15: the same L16 tree
  // (s_j += s_(j+w), w = 8, 4, 2, 1), run for 16 accumulators at once by pairing them across
  // registers with shuffles; each lane add is one of reduce16's adds, so the bits are equal.
  static void reduce16_x16(const float* acc, float* out) {
    __m512 a[16], b[8], c[4], d[2];
    for (int i = 0; i < 16; ++i) a[i] = _mm512_loadu_ps(acc + 16 * i);
    for (int k = 0; k < 8; ++k)  // w = 8: b[k] = [a_k 0..7 | a_(k+8) 0..7]
      b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[k], a[k + 8], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(a[k], a[k + 8], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 4; ++k)  // w = 4: quarters hold a_k, a_(k+8), a_(k+4), a_(k+12)
      c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[k], b[k + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(b[k], b[k + 4], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int k = 0; k < 2; ++k)  // w = 2
      d[k] = _mm512_add_ps(_mm512_shuffle_ps(c[k], c[k + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(c[k], c[k + 2], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 e =  // w = 1: lane 4q + (0, 1, 2, 3) holds a_i, i = q-th of (0 8 4 12), (2 10 6
                      // 14), (1 9 5 13), (3 11 7 15)
        _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i idx = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(idx, e));
  }
  // The L16 tree over the 16 lanes: s_j += s_(j+w), w = 8, 4, 2, 1.
  static float reduce16(const VecAvx512* acc) {
    const __m256 t8 =
        _mm256_add_ps(_mm512_castps512_ps256(acc[0].v),
                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[0].v), 1)));
    const __m128 lo4 = _mm256_castps256_ps128(t8), hi4 = _mm256_extractf128_ps(t8, 1);
    const __m128 t4 = _mm_add_ps(lo4, hi4);                       // w = 4
    const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));      // w = 2: lanes 0,1
    const __m128 t1 = _mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1));  // w = 1
    return _mm_cvtss_f32(t1);
  }
  // max(a, b) keeping b when either is NaN (maxps returns its second operand then).
  static VecAvx512 max(VecAvx512 a, VecAvx512 b) { return {_mm512_max_ps(a.v, b.v)}; }
  static VecAvx512 mul(VecAvx512 a, VecAvx512 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  // Exact small-integer loads of compact weight codes (ops/gemm/format.hpp): kLanes int8 -> float,
  // and kLanes bytes -> ((byte >> Shift) & 15) -> float.
  static VecAvx512 from_i8(const int8_t* p) {
    return {_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  // The nibble indexes a table of 0.0f..15.0f (vpermps reads only an index's low 4 bits), which
  // saves the mask and the int-to-float conversion.
  template <int Shift>
  static VecAvx512 from_u4(const uint8_t* p) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if constexpr (Shift != 0) b = _mm512_srli_epi32(b, Shift);
    const __m512 table = _mm512_setr_ps(0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f, 8.0f, 9.0f,
                                        10.0f, 11.0f, 12.0f, 13.0f, 14.0f, 15.0f);
    return {_mm512_permutexvar_ps(b, table)};
  }
  // kLanes bfloat16 bit patterns -> the float32 values they are the top halves of (exact).
  static VecAvx512 from_bf16(const uint16_t* p) {
    const __m512i w =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
};

}  // namespace eb::simd
