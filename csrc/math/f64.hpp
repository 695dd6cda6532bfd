// Binary64 exp_f64, log_f64, pow_f64 (construction-time tables, SPEC.md 3.4/4.4) and the binary64
// cores the binary32 routines round once. exp: Cody-Waite x - n*ln2 (ln2 = 42 + 53 bits, fma),
// Taylor 1/k! to r^13 (ours), 2^n scaling. log: x = 2^k*m, log m = 2*atanh((m-1)/(m+1)) as a
// double-double, series 1/(2j+1). pow(x, y) = exp(y*log x) carried as double-doubles.
// Measured (math_check.cpp, 2e6 samples each vs long double): exp 0.98, log 0.52, pow 1.39 ulp.
// exp: +inf above 709.79, +0 below -745.2 (subnormals in between); log(0) = -inf; NaN -> NaN.
#pragma once
#include "math/abi.hpp"

#include <cmath>  // std::fma, std::floor only

#include "math/guard.hpp"

namespace eb::math {
EB_MATH_ABI_BEGIN

namespace detail {

inline constexpr double kLog2e = 0x1.71547652b82fep+0;
// ln2 = kLn2Hi + kLn2Lo; kLn2Hi has 42 significant bits so n*kLn2Hi is exact for |n| < 2^11.
inline constexpr double kLn2Hi = 0x1.62e42fefa3800p-1;
inline constexpr double kLn2Lo = 0x1.ef35793c76730p-45;

// 1/k! for k = 13, 12, ..., 2 (ours: rounded to binary64), in Horner order. The vectorised
// exps (simd/vec_*.hpp exp_array) run the same chain over this table.
inline constexpr double kExpTaylor[12] = {
    0x1.6124613a86d09p-33, 0x1.1eed8eff8d898p-29, 0x1.ae64567f544e4p-26, 0x1.27e4fb7789f5cp-22,
    0x1.71de3a556c734p-19, 0x1.a01a01a01a01ap-16, 0x1.a01a01a01a01ap-13, 0x1.6c16c16c16c17p-10,
    0x1.1111111111111p-7,  0x1.5555555555555p-5,  0x1.5555555555555p-3,  0x1.0000000000000p-1};

// e^r - 1 for |r| <= ~0.35: Taylor series r + r^2 * sum_{k=2..13} r^(k-2)/k!, Horner order.
inline double expm1_reduced(double r) {
  double q = kExpTaylor[0];
  for (int k = 1; k < 12; ++k) q = std::fma(q, r, kExpTaylor[k]);
  return std::fma(r * r, q, r);
}

// e^(hi + lo) for -745.2 <= hi <= 709.79 and |lo| <= 2^-40 |hi| (lo may be 0).
inline double exp_dd(double hi, double lo) {
  const double n = round_to_int_f64(hi * kLog2e);
  double r = std::fma(-n, kLn2Hi, hi);  // exact: n*kLn2Hi is exact and r is tiny vs hi
  r = std::fma(-n, kLn2Lo, r);
  r = r + lo;
  const double y = 1.0 + expm1_reduced(r);
  return scale_f64(y, static_cast<int>(n));
}

// e^a - 1 for 0 <= a <= 36 (so 2^n - 1 is exact), relative error a few 2^-53:
// e^a - 1 = 2^n * (e^r - 1) + (2^n - 1), both terms exact, one rounding (n = 0: e^r - 1 itself).
inline double expm1_nonneg(double a) {
  const double n = round_to_int_f64(a * kLog2e);
  double r = std::fma(-n, kLn2Hi, a);
  r = std::fma(-n, kLn2Lo, r);
  const double p = expm1_reduced(r);
  const double two_n = pow2_f64(static_cast<int>(n));
  return std::fma(two_n, p, two_n - 1.0);
}

// log(x) = hi + lo (double-double, relative error ~2^-100 + series truncation ~2^-106) for
// finite x > 0.
inline void log_dd(double x, double& hi, double& lo) {
  int k = 0;
  std::uint64_t u = f64_bits(x);
  if (u < 0x0010000000000000ull) {  // subnormal: make it normal first (exact)
    x = x * 0x1p54;
    k = -54;
    u = f64_bits(x);
  }
  k += static_cast<int>(u >> 52) - 1023;
  // m in [1, 2): x with its exponent field set to 0.
  double m = f64_from_bits((u & 0x000FFFFFFFFFFFFFull) | 0x3FF0000000000000ull);
  if (m > 0x1.6a09e667f3bcdp+0) {  // sqrt(2): fold m into [sqrt(1/2), sqrt(2))
    m = m * 0.5;
    k += 1;
  }
  const double f = m - 1.0;  // exact (Sterbenz)
  double den, den_lo;
  two_sum(m, 1.0, den, den_lo);  // m + 1 = den + den_lo exactly
  const double s = f / den;
  const double res = std::fma(-s, den, f);       // exact remainder f - s*den
  const double s_lo = (res - s * den_lo) / den;  // s + s_lo = f / (m + 1) to ~2^-104
  const double z = s * s;
  // atanh(s)/s - 1 = sum_{j>=1} z^j/(2j+1); |z| <= 0.0295, 11 terms: truncation < 2^-60 z.
  double q = 0x1.642c8590b2164p-5;           // 1/23
  q = std::fma(q, z, 0x1.8618618618618p-5);  // 1/21
  q = std::fma(q, z, 0x1.af286bca1af28p-5);  // 1/19
  q = std::fma(q, z, 0x1.e1e1e1e1e1e1ep-5);  // 1/17
  q = std::fma(q, z, 0x1.1111111111111p-4);  // 1/15
  q = std::fma(q, z, 0x1.3b13b13b13b14p-4);  // 1/13
  q = std::fma(q, z, 0x1.745d1745d1746p-4);  // 1/11
  q = std::fma(q, z, 0x1.c71c71c71c71cp-4);  // 1/9
  q = std::fma(q, z, 0x1.2492492492492p-3);  // 1/7
  q = std::fma(q, z, 0x1.999999999999ap-3);  // 1/5
  q = std::fma(q, z, 0x1.5555555555555p-2);  // 1/3
  // log m = 2s + 2 s_lo + 2 s z q(z)
  const double m_hi = 2.0 * s;
  const double m_lo = 2.0 * std::fma(s * z, q, s_lo);
  const double kd = static_cast<double>(k);
  double t_hi, t_err;
  two_sum(kd * kLn2Hi, m_hi, t_hi, t_err);  // kd*kLn2Hi is exact
  const double t_lo = t_err + std::fma(kd, kLn2Lo, m_lo);
  fast_two_sum(t_hi, t_lo, hi, lo);
}

}  // namespace detail

// e^x in binary64 (within 1 ulp). NaN in -> quiet NaN out.
inline double exp_f64(double x) {
  if (detail::is_nan_f64(x)) return detail::canon_nan_f64();
  if (x > 709.79) return detail::f64_from_bits(0x7FF0000000000000ull);
  if (x < -745.2) return 0.0;
  return detail::exp_dd(x, 0.0);
}

// Natural log in binary64 (within 1 ulp). log(0) = -inf, log(+inf) = +inf, x < 0 or NaN -> NaN.
inline double log_f64(double x) {
  if (detail::is_nan_f64(x) || x < 0.0) return detail::canon_nan_f64();
  if (x == 0.0) return -detail::f64_from_bits(0x7FF0000000000000ull);
  if (x == detail::f64_from_bits(0x7FF0000000000000ull)) return x;
  double hi, lo;
  detail::log_dd(x, hi, lo);
  return hi + lo;
}

// x^y for x > 0 in binary64 (a few ulp at most; exp(y*log x) with double-double log and
// product). pow(1, y) = 1, pow(x, 0) = 1; x <= 0 other than +0, or NaN -> NaN.
inline double pow_f64(double x, double y) {
  const double inf = detail::f64_from_bits(0x7FF0000000000000ull);
  if (detail::is_nan_f64(x) || detail::is_nan_f64(y) || x < 0.0) {
    return detail::canon_nan_f64();
  }
  if (y == 0.0 || x == 1.0) return 1.0;
  if (x == 0.0) return y > 0.0 ? 0.0 : inf;
  if (x == inf) return y > 0.0 ? inf : 0.0;
  double h, l;
  detail::log_dd(x, h, l);
  const double p = y * h;
  if (p > 709.79) return inf;  // also covers p = +inf
  if (p < -745.2) return 0.0;  // also covers p = -inf
  const double p_lo = std::fma(y, h, -p) + y * l;
  return detail::exp_dd(p, p_lo);
}

EB_MATH_ABI_END
}  // namespace eb::math
