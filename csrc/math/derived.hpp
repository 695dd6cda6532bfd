// silu, softplus, gelu, gelu_tanh in the exact binary32 op order of SPEC.md 3.4 (one IEEE rounding
// per op, no fusion) on top of exp/log1p/erf/tanh, and canon_nan (SPEC.md 3.5). No own polynomial.
// Not 1-ulp functions: gelu(v << 0) cancels in 1 + erf(..); silu(v < -88.72) = -0 as exp(-v) = inf.
// Measured where well conditioned (math_check.cpp, every 41st binary32): silu 2.27 ulp (v >= -80),
// softplus 1.45 (v >= -80), gelu 1.61 (v >= 0), gelu_tanh 1.74 (v >= 0). softplus(v > 20) = v.
#pragma once
#include "math/abi.hpp"

#include "math/erf.hpp"
#include "math/exp.hpp"
#include "math/guard.hpp"
#include "math/log1p.hpp"
#include "math/tanh.hpp"

namespace eb::math {
EB_MATH_ABI_BEGIN

// float32(1/sqrt(2)) = 0.70710677 and float32(sqrt(2/pi)) = 0.7978846.
inline constexpr float kGeluC = 0x1.6a09e6p-1f;
inline constexpr float kGeluTanhK = 0x1.988454p-1f;
inline constexpr float kGeluTanhA = 0.044715f;

// silu(v) = v / (1 + exp(-v))   (HF SiLU / nn.functional.silu)
inline float silu_f32(float v) { return v / (1.0f + exp_f32(-v)); }

// softplus(v) = v if v > 20 else log1p(exp(v))   (torch.nn.functional.softplus, threshold 20)
inline float softplus_f32(float v) { return v > 20.0f ? v : log1p_f32(exp_f32(v)); }

// gelu(v) = (v * 0.5) * (1 + erf(v * c)), c = float32(1/sqrt(2))   (HF GELUActivation, erf form)
inline float gelu_f32(float v) { return (v * 0.5f) * (1.0f + erf_f32(v * kGeluC)); }

// gelu_tanh(v) = (0.5 * v) * (1 + tanh(k * (v + 0.044715 * ((v * v) * v)))),
// k = float32(sqrt(2/pi))
// (HF gelu_pytorch_tanh / NewGELUActivation order)
inline float gelu_tanh_f32(float v) {
  const float cube = (v * v) * v;
  const float inner = kGeluTanhK * (v + kGeluTanhA * cube);
  return (0.5f * v) * (1.0f + tanh_f32(inner));
}

// Any NaN -> the quiet NaN 0x7FC00000; every other value unchanged (bit for bit).
inline float canon_nan(float x) { return detail::is_nan_f32(x) ? detail::canon_nan_f32() : x; }

EB_MATH_ABI_END
}  // namespace eb::math
