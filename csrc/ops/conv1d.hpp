// Causal depthwise conv1d, one channel, one output (SPEC 7.3 step 3):
//   c = SEQ_k=0..K-1 (w[k] * u[k]) (+ bias), u oldest first (u[K-1] is the current token).
// Prefill and decode call this same function on the same window, so they agree bitwise.
// Source: HF Mamba2Mixer conv1d (groups = conv_dim, padding K-1). Reference twin: itself.
#pragma once
#include <cmath>
#include <cstdint>

namespace eb::ops {

inline float conv1d_tap_sum(const float* u, const float* w, int64_t k_taps, const float* bias) {
  float s = 0.0f;
  for (int64_t k = 0; k < k_taps; ++k) s = std::fma(w[k], u[k], s);
  return bias ? s + *bias : s;
}

}  // namespace eb::ops
