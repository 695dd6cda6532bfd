// log1p_f32: log(1 + x) in binary32 for x >= -1 (SPEC.md 3.4). Computed in binary64: 1 + x (exact
// for 2^-29 <= |x| < 2^29), x = 2^k*m, m in [sqrt(1/2), sqrt(2)), log m = 2*atanh((m-1)/(m+1)) as
// a double-double, atanh by its Taylor series (1/(2j+1), ours); |x| < 2^-29 uses x - x^2/2.
// Measured max error 0.5000000 ulp (math_check.cpp: every 41st binary32, ~1e8, vs long double).
// log1p(+-0) = +-0, log1p(-1) = -inf, log1p(+inf) = +inf; x < -1 or NaN -> 0x7FC00000.
#pragma once
#include "math/abi.hpp"

#include <cmath>  // std::fma

#include "math/f64.hpp"
#include "math/guard.hpp"

namespace eb::math {
EB_MATH_ABI_BEGIN

inline float log1p_f32(float x) {
  if (detail::is_nan_f32(x) || x < -1.0f) return detail::canon_nan_f32();
  if (x == -1.0f) return detail::f32_from_bits(0xFF800000u);
  if (x == detail::f32_from_bits(0x7F800000u)) return x;
  const double xd = static_cast<double>(x);
  if (detail::abs_f32(x) < 0x1p-29f) {
    // log1p x = x - x^2/2 + O(x^3): relative error < 2^-58 here; keeps -0 and subnormals.
    return static_cast<float>(std::fma(-0.5 * xd, xd, xd));
  }
  double hi, lo;
  detail::log_dd(1.0 + xd, hi, lo);
  return static_cast<float>(hi + lo);
}

EB_MATH_ABI_END
}  // namespace eb::math
