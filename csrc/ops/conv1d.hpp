// Causal depthwise conv1d, per channel (SPEC 7.3 step 3):
//   c = SEQ_k=0..K-1 (w[k] * u[k]) (+ bias), u oldest first (u[K-1] is the current token).
// Prefill and decode call this same function on the same window, so they agree bitwise.
// Source: HF Mamba2Mixer conv1d (groups = conv_dim, padding K-1). Reference twin:
// conv1d_token<VecScalar> (tests: every ISA == scalar, bitwise).
#pragma once
#include <cmath>
#include <cstdint>

namespace eb::ops {

// One token of the conv for nc consecutive channels, vectorised across channels with the same
// per-channel order for every ISA: c[ch] = SEQ_k fma(w[k][ch], u_k[ch]) (+ bias[ch]).
// wt: (K, ld) tap-major weights starting at the block's first channel; tap(k) -> u_k for the
// block's channels (k = 0 is the oldest input, K-1 the current token). out: nc floats.
template <class V, class Tap>
inline void conv1d_token(const float* wt, int64_t ld, int64_t nc, int64_t k_taps, const float* bias,
                         Tap tap, float* out) {
  const int64_t nc_vec = nc - nc % V::kLanes;
  const auto vectors = [&](auto tap_at) {
    for (int64_t ch = 0; ch < nc_vec; ch += V::kLanes) {
      V acc = V::zero();
      for (int64_t k = 0; k < k_taps; ++k)
        acc = V::fma(V::load(wt + k * ld + ch), V::load(tap_at(k) + ch), acc);
      if (bias) acc = V::add(acc, V::load(bias + ch));
      acc.store(out + ch);
    }
  };
  constexpr int64_t kMaxHoisted = 16;
  if (k_taps <= kMaxHoisted) {  // the usual K = 4: tap pointers looked up once per token
    const float* taps[kMaxHoisted];
    for (int64_t k = 0; k < k_taps; ++k) taps[k] = tap(k);
    vectors([&](int64_t k) { return taps[k]; });
  } else {
    vectors(tap);
  }
  for (int64_t ch = nc_vec; ch < nc; ++ch) {
    float acc = 0.0f;
    for (int64_t k = 0; k < k_taps; ++k) acc = std::fma(wt[k * ld + ch], tap(k)[ch], acc);
    out[ch] = bias ? acc + bias[ch] : acc;
  }
}

}  // namespace eb::ops
