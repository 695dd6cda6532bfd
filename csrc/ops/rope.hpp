// Rotary position embedding, HF rotate_half (NeoX) layout, partial rotary (SPEC 4.4):
//   angle_i = float32(pos) * inv_freq_i (one binary32 multiply), c = cos, s = sin (own routines),
//   for i < rope_dim/2:  a = v[i], b = v[i + rope_dim/2];  a' = a*c - b*s,  b' = b*c + a*s.
// Components at index >= rope_dim pass through. Products are not fused (two roundings each),
// as in HF's `q * cos + rotate_half(q) * sin`. Source: HF apply_rotary_pos_emb;
// RoFormer arXiv:2104.09864. The inv_freq table is built in ops/rope_table.cpp.
#pragma once
#include <cstdint>

#include "math/abi.hpp"
#include "math/sincos.hpp"

namespace eb::ops {

// Per-ISA copies (math/abi.hpp): rope_cos_sin is called from two places and can be left out of
// line, and each ISA object must keep its own copy.
EB_MATH_ABI_BEGIN

inline void rope_cos_sin(const float* inv_freq, int64_t half, int64_t pos, float* cs, float* sn) {
  const float p = static_cast<float>(pos);  // exact: pos < 2^24
  for (int64_t i = 0; i < half; ++i) {
    const float angle = p * inv_freq[i];
    cs[i] = math::cos_f32(angle);
    sn[i] = math::sin_f32(angle);
  }
}

// The same, then cos and sin each times a float32 attention factor (yarn / longrope: HF's
// `emb.cos() * attention_scaling`, one binary32 multiply after our cos/sin).
inline void rope_cos_sin_scaled(const float* inv_freq, int64_t half, int64_t pos, float factor,
                                float* cs, float* sn) {
  rope_cos_sin(inv_freq, half, pos, cs, sn);
  for (int64_t i = 0; i < half; ++i) {
    cs[i] = cs[i] * factor;
    sn[i] = sn[i] * factor;
  }
}

inline void rope_apply(float* v, int64_t half, const float* cs, const float* sn) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cs[i] - b * sn[i];
    v[i + half] = b * cs[i] + a * sn[i];
  }
}

EB_MATH_ABI_END

// RoPE scaling kinds (SPEC 4.4; HF rope_type): none/'default', 'linear', 'llama3', 'yarn',
// 'longrope'.
enum RopeScaling : int {
  kRopeDefault = 0,
  kRopeLinear = 1,
  kRopeLlama3 = 2,
  kRopeYarn = 3,
  kRopeLongrope = 4
};

// inv_freq table (rope_dim/2 floats): theta^(-2i/rope_dim) in binary64 with the library's own
// pow, scaled in binary64 (linear: / factor; llama3 as HF _compute_llama3_parameters), rounded
// to float32 once.
void rope_inv_freq(int64_t rope_dim, double theta, RopeScaling kind, double factor,
                   double low_freq_factor, double high_freq_factor, double original_max,
                   float* out);

// yarn inv_freq table (HF _compute_yarn_parameters), all in binary64, rounded once:
//   pos_i = theta^(2i/r), extrapolation 1/pos_i, interpolation 1/(factor*pos_i);
//   corr(rot) = r*log(O/(rot*2*pi)) / (2*log(theta)); low = corr(beta_fast), high =
//   corr(beta_slow), floor/ceil when truncate, low = max(low, 0), high = min(high, r - 1)
//   (HF's bound), high += 0.001 when equal; ramp_i = clamp((i - low)/(high - low), 0, 1),
//   e_i = 1 - ramp_i, inv_i = interpolation*(1 - e_i) + extrapolation*e_i.
void rope_yarn_inv_freq(int64_t rope_dim, double theta, double factor, double beta_fast,
                        double beta_slow, double original_max, bool truncate, float* out);

// yarn attention factor (HF get_mscale): g(s, m) = 1 for s <= 1, else 0.1*m*log(s) + 1;
// mscale and mscale_all_dim both nonzero: g(factor, mscale) / g(factor, mscale_all_dim),
// else g(factor, 1). Binary64 with the library's log.
double rope_yarn_attention_factor(double factor, double mscale, double mscale_all_dim);

// longrope inv_freq table (HF _compute_longrope_parameters): inv_i = 1 / (ext_i * theta^(2i/r)),
// ext = the short or the long factors (rope_dim/2 of them), binary64, rounded once.
void rope_longrope_inv_freq(int64_t rope_dim, double theta, const double* ext, float* out);

// longrope attention factor: 1 for factor <= 1, else sqrt(1 + log(factor)/log(O)) (binary64).
double rope_longrope_attention_factor(double factor, double original_max);

}  // namespace eb::ops
