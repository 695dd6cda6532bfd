// Rotary position embedding, HF rotate_half (NeoX) layout, partial rotary (SPEC 4.4):
//   angle_i = float32(pos) * inv_freq_i (one binary32 multiply), c = cos, s = sin (own routines),
//   for i < rope_dim/2:  a = v[i], b = v[i + rope_dim/2];  a' = a*c - b*s,  b' = b*c + a*s.
// Components at index >= rope_dim pass through. Products are not fused (two roundings each),
// as in HF's `q * cos + rotate_half(q) * sin`. Source: HF apply_rotary_pos_emb;
// RoFormer arXiv:2104.09864. The inv_freq table is built in ops/rope_table.cpp.
#pragma once
#include <cstdint>

#include "math/sincos.hpp"

namespace eb::ops {

inline void rope_cos_sin(const float* inv_freq, int64_t half, int64_t pos, float* cs, float* sn) {
  const float p = static_cast<float>(pos);  // exact: pos < 2^24
  for (int64_t i = 0; i < half; ++i) {
    const float angle = p * inv_freq[i];
    cs[i] = math::cos_f32(angle);
    sn[i] = math::sin_f32(angle);
  }
}

inline void rope_apply(float* v, int64_t half, const float* cs, const float* sn) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cs[i] - b * sn[i];
    v[i + half] = b * cs[i] + a * sn[i];
  }
}

// RoPE scaling kinds (SPEC 4.4; HF rope_type): none/'default', 'linear', 'llama3'.
enum RopeScaling : int { kRopeDefault = 0, kRopeLinear = 1, kRopeLlama3 = 2 };

// inv_freq table (rope_dim/2 floats): theta^(-2i/rope_dim) in binary64 with the library's own
// pow, scaled in binary64 (linear: / factor; llama3 as HF _compute_llama3_parameters), rounded
// to float32 once.
void rope_inv_freq(int64_t rope_dim, double theta, RopeScaling kind, double factor,
                   double low_freq_factor, double high_freq_factor, double original_max,
                   float* out);

}  // namespace eb::ops
