// Common base of csrc/math/: refuses fast-math builds and holds the exact bit-level helpers
// (bit casts, round-to-integer, powers of two, error-free sums) that every routine shares.
// Everything here is a plain IEEE-754 binary32/binary64 operation or an integer operation, so
// the results are the same on every compiler, CPU and C library (SPEC.md 3.2, 3.4).
// Nothing here calls libm; the build must use -ffp-contract=off (every fused multiply-add
// in csrc/math/ is an explicit std::fma).
#pragma once
#include "math/abi.hpp"

// GCC and Clang always define __FINITE_MATH_ONLY__ (0 normally, 1 under -ffinite-math-only or
// -ffast-math), so its value is tested, not just its presence.
#if defined(__FAST_MATH__) || (defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__)
#error "exactblocks: never build with -ffast-math or -ffinite-math-only (SPEC.md 3.2)"
#endif

#include <cstdint>
#include <cstring>

namespace eb::math {
EB_MATH_ABI_BEGIN
namespace detail {

// Bits of the canonical quiet NaN written into every output (SPEC.md 3.5).
inline constexpr std::uint32_t kCanonNanBits = 0x7FC00000u;

inline std::uint32_t f32_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline float f32_from_bits(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

inline std::uint64_t f64_bits(double x) {
  std::uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline double f64_from_bits(std::uint64_t u) {
  double x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

inline float canon_nan_f32() { return f32_from_bits(kCanonNanBits); }

inline double canon_nan_f64() { return f64_from_bits(0x7FF8000000000000ull); }

// True for NaN without relying on the compiler honouring NaN semantics in comparisons.
inline bool is_nan_f32(float x) { return (f32_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }

inline bool is_nan_f64(double x) {
  return (f64_bits(x) & 0x7FFFFFFFFFFFFFFFull) > 0x7FF0000000000000ull;
}

// x with its sign bit replaced by the sign bit of s (exact).
inline float copysign_f32(float x, float s) {
  return f32_from_bits((f32_bits(x) & 0x7FFFFFFFu) | (f32_bits(s) & 0x80000000u));
}

inline float abs_f32(float x) { return f32_from_bits(f32_bits(x) & 0x7FFFFFFFu); }

// Nearest integer (ties to even) of a double with |a| < 2^51, as a double: adding and
// subtracting 1.5*2^52 pushes the fraction bits out of the significand. Two IEEE additions,
// so no dependence on std::nearbyint or on the current rounding-mode API.
inline double round_to_int_f64(double a) {
  constexpr double kShifter = 0x1.8p52;
  return (a + kShifter) - kShifter;
}

// 2^n as a double for -1022 <= n <= 1023 (exact; built from the exponent field).
inline double pow2_f64(int n) { return f64_from_bits(static_cast<std::uint64_t>(n + 1023) << 52); }

// y * 2^n for -2044 <= n <= 2046, rounded once (the first factor keeps y normal, so only the
// second multiplication can round: subnormal results are correctly rounded, big ones go inf).
inline double scale_f64(double y, int n) {
  const int n1 = n / 2;
  const int n2 = n - n1;
  return (y * pow2_f64(n1)) * pow2_f64(n2);
}

// Error-free sum: s + e == a + b exactly, s = fl(a + b) (Knuth's TwoSum, 6 additions).
inline void two_sum(double a, double b, double& s, double& e) {
  s = a + b;
  const double bb = s - a;
  e = (a - (s - bb)) + (b - bb);
}

// Error-free sum when |a| >= |b| or a == 0 (Dekker's FastTwoSum).
inline void fast_two_sum(double a, double b, double& s, double& e) {
  s = a + b;
  e = b - (s - a);
}

}  // namespace detail
EB_MATH_ABI_END
}  // namespace eb::math
