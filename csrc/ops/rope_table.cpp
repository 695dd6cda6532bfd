// Construction-time RoPE inverse-frequency table (binary64, own pow; SPEC 3.4, 4.4).
// Computing it in float32 instead would move cos/sin by an ulp at some positions.
#include "math/f64.hpp"
#include "ops/rope.hpp"

namespace eb::ops {

void rope_inv_freq(int64_t rope_dim, double theta, RopeScaling kind, double factor,
                   double low_freq_factor, double high_freq_factor, double original_max,
                   float* out) {
  const double two_pi = 6.283185307179586476925286766559;
  for (int64_t i = 0; i < rope_dim / 2; ++i) {
    double inv = math::pow_f64(theta, -static_cast<double>(2 * i) / static_cast<double>(rope_dim));
    if (kind == kRopeLinear) {
      inv = inv / factor;
    } else if (kind == kRopeLlama3) {
      const double low_wavelen = original_max / low_freq_factor;
      const double high_wavelen = original_max / high_freq_factor;
      const double wavelen = two_pi / inv;
      if (wavelen > low_wavelen) {
        inv = inv / factor;
      } else if (wavelen >= high_wavelen) {
        const double g =
            (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
        inv = (1.0 - g) * inv / factor + g * inv;
      }
    }
    out[i] = static_cast<float>(inv);
  }
}

}  // namespace eb::ops
