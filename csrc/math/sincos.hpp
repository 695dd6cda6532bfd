// sin_f32, cos_f32 in binary32 (SPEC.md 3.4). x = k*pi/2 + r in binary64: Cody-Waite for |x| < 2^20
// (pi/2 in 3 binary64 parts, explicit fma), Payne-Hanek above (240 bits of 2/pi, double-double
// sums). Kernels: Taylor sin to r^15, cos to r^16 (coefficients ours: +-1/n! in binary64); rounded
// once. Measured max error 0.5000000 ulp for ALL finite x, not only |x| <= 2^20 (math_check.cpp:
// every 41st binary32, ~1e8, vs long double). sin(+-0) = +-0, cos(+-0) = 1; no overflow/underflow;
// +-inf or NaN -> 0x7FC00000.
#pragma once
#include "math/abi.hpp"

#include <cmath>  // std::fma, std::floor
#include <cstdint>

#include "math/guard.hpp"

namespace eb::math {
EB_MATH_ABI_BEGIN

namespace detail {

// pi/2 = kPio2_1 + kPio2_2 + kPio2_3 (+ O(2^-163)).
inline constexpr double kPio2_1 = 0x1.921fb54442d18p+0;
inline constexpr double kPio2_2 = 0x1.1a62633145c07p-54;
inline constexpr double kPio2_3 = -0x1.f1976b7ed8fbcp-110;
inline constexpr double kTwoOverPi = 0x1.45f306dc9c883p-1;

// 2/pi = sum_j kTwoOverPiBits[j] * 2^(-24(j+1)) (truncated after 240 bits).
inline constexpr std::uint32_t kTwoOverPiBits[10] = {
    0xA2F983, 0x6E4E44, 0x1529FC, 0x2757D1, 0xF534DD,
    0xC0DB62, 0x95993C, 0x439041, 0xFE5163, 0xABDEBB,
};

// a - 4*floor(a/4) (exact for the integer-times-power-of-two values it is used on).
inline double mod4(double a) { return a - 4.0 * std::floor(a * 0.25); }

// Payne-Hanek for finite binary32 ax >= 2^20: returns k mod 4 and r (binary64) with
// ax = (4j + k) * pi/2 + r for some integer j.
inline int reduce_pio2_large(float ax, double& r) {
  const std::uint32_t bits = f32_bits(ax);
  const int e = static_cast<int>(bits >> 23) - 127 - 23;  // ax = mant * 2^e, e in [-3, 104]
  const double mant = static_cast<double>((bits & 0x7FFFFFu) | 0x800000u);
  // Chunks j < j0 give multiples of 4 (mant * chunk * 2^(e - 24(j+1)) with exponent >= 2).
  const int j0 = e > 25 ? (e - 25 + 23) / 24 : 0;
  double t[6];
  for (int i = 0; i < 6; ++i) {
    const int j = j0 + i;
    const double chunk = static_cast<double>(kTwoOverPiBits[j]);
    t[i] = (mant * chunk) * pow2_f64(e - 24 * (j + 1));  // < 2^48 times 2^s: exact
  }
  const double a0 = mod4(t[0]);
  const double a1 = mod4(t[1]);
  const double k = round_to_int_f64((a0 + a1) + t[2]);
  double hi = a0 - k;  // exact: a0 has bits 2^1 .. 2^-27, k is a small integer
  double lo = 0.0;
  for (int i = 1; i < 6; ++i) {
    const double term = i == 1 ? a1 : t[i];
    double s, err;
    two_sum(hi, term, s, err);
    hi = s;
    lo = lo + err;
  }
  double f_hi, f_lo;
  fast_two_sum(hi, lo, f_hi, f_lo);  // fraction of ax*2/pi, |f| <= ~0.5
  const double p_hi = f_hi * kPio2_1;
  const double p_lo = std::fma(f_hi, kPio2_1, -p_hi) + std::fma(f_hi, kPio2_2, f_lo * kPio2_1);
  r = p_hi + p_lo;
  return static_cast<int>(k) & 3;
}

// k mod 4 and r with ax = k*pi/2 + r, for finite binary32 ax >= 0.
inline int reduce_pio2(float ax, double& r) {
  if (ax >= 0x1p20f) return reduce_pio2_large(ax, r);
  const double a = static_cast<double>(ax);
  const double k = round_to_int_f64(a * kTwoOverPi);  // k < 2^20
  double rr = std::fma(-k, kPio2_1, a);
  rr = std::fma(-k, kPio2_2, rr);
  r = std::fma(-k, kPio2_3, rr);
  return static_cast<int>(k) & 3;
}

// sin r for |r| <= ~0.786: r + r^3 * sum_{j=1..7} (-1)^j r^(2j-2)/(2j+1)!.
inline double sin_kernel(double r) {
  const double z = r * r;
  double q = -0x1.ae7f3e733b81fp-41;           // -1/15!
  q = std::fma(q, z, 0x1.6124613a86d09p-33);   // 1/13!
  q = std::fma(q, z, -0x1.ae64567f544e4p-26);  // -1/11!
  q = std::fma(q, z, 0x1.71de3a556c734p-19);   // 1/9!
  q = std::fma(q, z, -0x1.a01a01a01a01ap-13);  // -1/7!
  q = std::fma(q, z, 0x1.1111111111111p-7);    // 1/5!
  q = std::fma(q, z, -0x1.5555555555555p-3);   // -1/3!
  return std::fma(r * z, q, r);
}

// cos r for |r| <= ~0.786: 1 + z * sum_{j=1..8} (-1)^j z^(j-1)/(2j)!, z = r^2.
inline double cos_kernel(double r) {
  const double z = r * r;
  double q = 0x1.ae7f3e733b81fp-45;            // 1/16!
  q = std::fma(q, z, -0x1.93974a8c07c9dp-37);  // -1/14!
  q = std::fma(q, z, 0x1.1eed8eff8d898p-29);   // 1/12!
  q = std::fma(q, z, -0x1.27e4fb7789f5cp-22);  // -1/10!
  q = std::fma(q, z, 0x1.a01a01a01a01ap-16);   // 1/8!
  q = std::fma(q, z, -0x1.6c16c16c16c17p-10);  // -1/6!
  q = std::fma(q, z, 0x1.5555555555555p-5);    // 1/4!
  q = std::fma(q, z, -0x1.0000000000000p-1);   // -1/2!
  return std::fma(z, q, 1.0);
}

inline bool is_finite_f32(float x) { return (f32_bits(x) & 0x7F800000u) != 0x7F800000u; }

}  // namespace detail

// sin x (radians). Odd by construction: computed on |x|, sign applied at the end.
inline float sin_f32(float x) {
  if (!detail::is_finite_f32(x)) return detail::canon_nan_f32();
  if (x == 0.0f) return x;
  double r;
  const int q = detail::reduce_pio2(detail::abs_f32(x), r);
  double v = (q & 1) ? detail::cos_kernel(r) : detail::sin_kernel(r);
  if (q & 2) v = -v;
  const float s = static_cast<float>(v);
  return (detail::f32_bits(x) & 0x80000000u) ? -s : s;
}

// cos x (radians). Even by construction: computed on |x|.
inline float cos_f32(float x) {
  if (!detail::is_finite_f32(x)) return detail::canon_nan_f32();
  double r;
  const int q = detail::reduce_pio2(detail::abs_f32(x), r);
  double v = (q & 1) ? detail::sin_kernel(r) : detail::cos_kernel(r);
  if ((q + 1) & 2) v = -v;
  return static_cast<float>(v);
}

EB_MATH_ABI_END
}  // namespace eb::math
