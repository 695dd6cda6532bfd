// Helpers shared by the vector types (each header defines one type with the same API).
#pragma once

namespace eb::simd {

// out[i] = V::reduce16 of the 16 lanes at acc + 16 * i, i = 0..15: the generic form of
// reduce16_x16 (VecAvx512 has a faster one with the same adds).
template <class V>
inline void reduce16_x16_by_lanes(const float* acc, float* out) {
  constexpr int nv = 16 / V::kLanes;
  for (int i = 0; i < 16; ++i) {
    V lanes[nv];
    for (int k = 0; k < nv; ++k) lanes[k] = V::load(acc + 16 * i + k * V::kLanes);
    out[i] = V::reduce16(lanes);
  }
}

}  // namespace eb::simd
