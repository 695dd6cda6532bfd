// exp_f32: e^x in binary32 (SPEC.md 3.4). Computed in binary64 by detail::exp_dd (f64.hpp):
// n = round(x/ln2), Cody-Waite r = x - n*ln2 with explicit fma, Taylor 1/k! to r^13 (coefficients
// are ours: 1/k! rounded to binary64), exact 2^n scaling; rounded to binary32 once.
// Measured max error 0.4999999 ulp (math_check.cpp: every 41st binary32, ~1e8, vs long double).
// exp(+-0) = 1; x >= 0x1.62e430p6 (88.7228394) -> +inf; x <= -0x1.9fe36ap6 (-103.972084) -> +0,
// reached through every subnormal; NaN -> 0x7FC00000.
#pragma once
#include "math/abi.hpp"

#include "math/f64.hpp"
#include "math/guard.hpp"

namespace eb::math {
EB_MATH_ABI_BEGIN

namespace detail {
// exp_f32's special ranges, shared with the vectorised exps (simd/vec_*.hpp exp_array). From
// 0x1.62e430p6 = 88.72283935546875 up (x > kExpF32Inf), e^x rounds to +inf; below that the
// binary64 result is < FLT_MAX, so the final conversion never goes out of range. Below
// kExpF32Zero the result rounds to +0 anyway; the vector paths clamp x to [kExpF32Zero,
// kExpClampHi] in binary64 before the chain (their special lanes are replaced afterwards), which
// keeps n inside the range detail::exp_dd handles.
inline constexpr float kExpF32Inf = 0x1.62e42ep6f;
inline constexpr float kExpF32Zero = -110.0f;
inline constexpr double kExpClampHi = 89.0;
}  // namespace detail

inline float exp_f32(float x) {
  if (detail::is_nan_f32(x)) return detail::canon_nan_f32();
  if (x > detail::kExpF32Inf) return detail::f32_from_bits(0x7F800000u);
  if (x < detail::kExpF32Zero) return 0.0f;
  return static_cast<float>(detail::exp_dd(static_cast<double>(x), 0.0));
}

EB_MATH_ABI_END
}  // namespace eb::math
