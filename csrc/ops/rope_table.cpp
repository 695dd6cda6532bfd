// Construction-time RoPE inverse-frequency table (binary64, own pow; SPEC 3.4, 4.4).
// Computing it in float32 instead would move cos/sin by an ulp at some positions.
#include <cmath>
#include <cstdint>

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

namespace {

constexpr double kTwoPi = 6.283185307179586476925286766559;

// floor and ceil of a value well inside the int64 range (exact; no libm).
double floor_small(double x) {
  double f = static_cast<double>(static_cast<int64_t>(x));
  if (f > x) f -= 1.0;
  return f;
}

double ceil_small(double x) {
  double f = static_cast<double>(static_cast<int64_t>(x));
  if (f < x) f += 1.0;
  return f;
}

}  // namespace

void rope_yarn_inv_freq(int64_t rope_dim, double theta, double factor, double beta_fast,
                        double beta_slow, double original_max, bool truncate, float* out) {
  const double dim = static_cast<double>(rope_dim);
  const double log_theta = math::log_f64(theta);
  const auto corr = [&](double rot) {
    return (dim * math::log_f64(original_max / (rot * kTwoPi))) / (2.0 * log_theta);
  };
  double low = corr(beta_fast), high = corr(beta_slow);
  if (truncate) {
    low = floor_small(low);
    high = ceil_small(high);
  }
  if (low < 0.0) low = 0.0;
  if (high > dim - 1.0) high = dim - 1.0;
  if (low == high) high += 0.001;  // HF: prevent the singularity
  for (int64_t i = 0; i < rope_dim / 2; ++i) {
    const double pos = math::pow_f64(theta, static_cast<double>(2 * i) / dim);
    const double extrapolation = 1.0 / pos;
    const double interpolation = 1.0 / (factor * pos);
    double ramp = (static_cast<double>(i) - low) / (high - low);
    if (ramp < 0.0) ramp = 0.0;
    if (ramp > 1.0) ramp = 1.0;
    const double e = 1.0 - ramp;
    out[i] = static_cast<float>(interpolation * (1.0 - e) + extrapolation * e);
  }
}

double rope_yarn_attention_factor(double factor, double mscale, double mscale_all_dim) {
  const auto g = [&](double m) {
    return factor <= 1.0 ? 1.0 : 0.1 * m * math::log_f64(factor) + 1.0;
  };
  if (mscale != 0.0 && mscale_all_dim != 0.0) return g(mscale) / g(mscale_all_dim);
  return g(1.0);
}

void rope_longrope_inv_freq(int64_t rope_dim, double theta, const double* ext, float* out) {
  const double dim = static_cast<double>(rope_dim);
  for (int64_t i = 0; i < rope_dim / 2; ++i) {
    const double pos = math::pow_f64(theta, static_cast<double>(2 * i) / dim);
    out[i] = static_cast<float>(1.0 / (ext[i] * pos));
  }
}

double rope_longrope_attention_factor(double factor, double original_max) {
  if (factor <= 1.0) return 1.0;
  return std::sqrt(1.0 + math::log_f64(factor) / math::log_f64(original_max));
}

}  // namespace eb::ops
