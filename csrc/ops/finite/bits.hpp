// Whether p[0..n) holds a NaN or an infinity: exponent all ones <=> (u & 0x7F800000) +
// 0x00800000 sets bit 31, an integer OR reduction the compiler vectorises with the ISA's
// registers. A template over the ISA's vector type, so every ISA object has its own copy
// (docs/architecture.md, "One binary, several ISAs").
#pragma once
#include <cstdint>

namespace eb::ops {

template <class V>
inline bool any_nonfinite(const float* p, int64_t n) {
  typedef uint32_t __attribute__((may_alias)) u32_alias;
  const u32_alias* u = reinterpret_cast<const u32_alias*>(p);
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= (u[i] & 0x7F800000u) + 0x00800000u;
  return (bad & 0x80000000u) != 0;
}

}  // namespace eb::ops
