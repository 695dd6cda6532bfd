// tanh_f32: tanh x in binary32 (SPEC.md 3.4). Computed in binary64 on a = |x|: tanh a =
// em/(em + 2), em = e^(2a) - 1 by detail::expm1_nonneg (f64.hpp: Cody-Waite, Taylor 1/k!, ours),
// rounded once, sign of x copied back (exactly odd, tanh(+-0) = +-0).
// Measured max error 0.4999999 ulp (math_check.cpp: every 41st binary32, ~1e8, vs long double).
// |x| >= 10 -> +-1 exactly (the rounded value is already +-1 from |x| > 9.0109134);
// NaN -> 0x7FC00000.
#pragma once
#include "math/abi.hpp"

#include "math/f64.hpp"
#include "math/guard.hpp"

namespace eb::math {
EB_MATH_ABI_BEGIN

inline float tanh_f32(float x) {
  if (detail::is_nan_f32(x)) return detail::canon_nan_f32();
  const float ax = detail::abs_f32(x);
  if (ax >= 10.0f) return detail::copysign_f32(1.0f, x);
  const double a = static_cast<double>(ax);
  const double em = detail::expm1_nonneg(2.0 * a);
  const float t = static_cast<float>(em / (em + 2.0));
  return detail::copysign_f32(t, x);
}

EB_MATH_ABI_END
}  // namespace eb::math
