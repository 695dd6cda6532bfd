// Exact format fitting of float32 weights (pack_detail.hpp pack_compact): a compact format is
// chosen only when every weight rebuilt from it with the kernels' own operation has the
// original's bits. Fitting finds scales and codes; it never rounds a weight.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ops/gemm/format.hpp"
#include "ops/gemm/pack_detail.hpp"

namespace eb::ops::detail {
namespace {

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// Scale candidates near `est`: est itself, then the binary16 values nearest it (GGUF stores
// d and m as binary16), so a block written by llama.cpp's quantiser is found in one or two tries.
int scale_candidates(float est, float* out) {
  int n = 0;
  out[n++] = est;
  if (!(est > 0.0f) || !std::isfinite(est)) return n;
  int e = 0;
  std::frexp(static_cast<double>(est), &e);
  const double ulp = std::ldexp(1.0, std::max(e - 11, -24));
  const double base = std::nearbyint(static_cast<double>(est) / ulp) * ulp;
  for (int delta : {0, -1, 1, -2, 2}) out[n++] = static_cast<float>(base + delta * ulp);
  return n;
}

// One block of kQBlock consecutive weights x as w = fma(d, q, m), q in 0..qmax (15: kPanelQ4,
// 31: kPanelQ5), d >= 0. m is the block's least weight: llama.cpp's Q4_1 / Q5_1 quantisers give
// the least weight code 0, and its Q4_K / Q5_K ones give code 0 in every sub-block of 32, so
// then m = fma(d, 0, m) is that weight exactly. For d, each code t of the greatest weight is
// tried, qmax first: with the codes r_i that the estimate (max - min) / t gives, every weight
// x_i = round(d * r_i + m) bounds d to [(x_i - h_i - m) / r_i, (x_i + h_i - m) / r_i] (h_i half
// an ulp of x_i; computed in binary64 and widened a little), and the float32 values in the
// intersection are tried. Any fit is verified weight by weight with the kernels' operation.
bool fit_affine(const float* x, int qmax, float* d_out, float* m_out, uint8_t* q_out) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < kQBlock; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  if (!std::isfinite(lo) || !std::isfinite(hi)) return false;
  auto verify = [&](float d) {
    for (int i = 0; i < kQBlock; ++i) {
      const float q = d > 0.0f ? std::nearbyint((x[i] - lo) / d) : 0.0f;
      q_out[i] = static_cast<uint8_t>(std::min(static_cast<float>(qmax), std::max(0.0f, q)));
      if (bits(std::fma(d, static_cast<float>(q_out[i]), lo)) != bits(x[i])) return false;
    }
    *d_out = d;
    *m_out = lo;
    return true;
  };
  if (hi == lo) return verify(0.0f) || verify(-0.0f);  // fma(-0, 0, -0) keeps a -0.0 block
  const double span = static_cast<double>(hi) - static_cast<double>(lo);
  for (int t = qmax; t >= 1; --t) {
    const double est = span / t;
    double d_lo = 0.0, d_hi = std::numeric_limits<double>::infinity();
    bool ok = true;
    for (int i = 0; i < kQBlock && ok; ++i) {
      const double v = static_cast<double>(x[i]) - static_cast<double>(lo);  // exact
      const double r = std::nearbyint(v / est);
      if (r == 0.0) {
        ok = x[i] == lo;
        continue;
      }
      ok = r <= qmax;
      const double h = std::ldexp(1.0, std::max(std::ilogb(x[i]), -126) - 24);
      d_lo = std::max(d_lo, (v - h) / r);
      d_hi = std::min(d_hi, (v + h) / r);
    }
    const double slack = 0x1p-40 * d_hi;
    if (!ok || !(d_lo - slack <= d_hi + slack)) continue;
    // from the float32 just below d_lo (a cast may round up past a valid d)
    float d = std::nextafter(static_cast<float>(d_lo - slack), 0.0f);
    for (int c = 0; c < 64 && static_cast<double>(d) <= d_hi + slack; ++c) {
      if (d > 0.0f && verify(d)) return true;
      d = std::nextafter(d, std::numeric_limits<float>::infinity());
    }
  }
  return false;
}

// kQHalf consecutive weights x as w = d * q (the kernels' float32 product), q int8: the half
// blocks of kPanelQ6. Where a fit exists, the weight of largest magnitude is d * t for some
// t in 1..128 and then |d| = amax / t exactly (a quotient that is representable is exact),
// so every t is tried (GGUF Q6_K's quantiser gives |t| near 32 first). The sign of d is that
// of the block's zeros (d * 0 keeps d's sign: -0.0 needs d < 0); a block with zeros of both
// signs has a fit only when it is all zeros (Q6_K's d * sc = +0.0 times codes of either sign:
// d = +0.0, q = -1 or 0).
bool fit_q6(const float* x, float* d_out, int8_t* q_out) {
  float amax = 0.0f;
  bool pos_zero = false, neg_zero = false;
  for (int i = 0; i < kQHalf; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    if (x[i] == 0.0f) (std::signbit(x[i]) ? neg_zero : pos_zero) = true;
  }
  if (amax == 0.0f) {  // zeros, or NaN (which fails the check)
    *d_out = 0.0f;
    for (int i = 0; i < kQHalf; ++i) {
      q_out[i] = static_cast<int8_t>(std::signbit(x[i]) ? -1 : 0);
      if (bits(0.0f * static_cast<float>(q_out[i])) != bits(x[i])) return false;
    }
    return true;
  }
  if (pos_zero && neg_zero) return false;
  const float sign = neg_zero ? -1.0f : 1.0f;
  if (!std::isfinite(amax)) return false;
  for (int k = 0; k < 128; ++k) {
    const int t = k < 32 ? 32 - k : k + 1;  // 32, 31, ..., 1, then 33, ..., 128
    const float d = sign * (amax / static_cast<float>(t));
    if (!(std::fabs(d) > 0.0f) || !std::isfinite(d)) continue;
    bool ok = true;
    for (int i = 0; i < kQHalf && ok; ++i) {
      const float q = std::nearbyint(x[i] / d);
      ok = q >= -128.0f && q <= 127.0f;
      q_out[i] = static_cast<int8_t>(ok ? q : 0.0f);
      ok = ok && bits(d * static_cast<float>(q_out[i])) == bits(x[i]);
    }
    if (ok) {
      *d_out = d;
      return true;
    }
  }
  return false;
}

// One block as w = d * q (the kernels' float32 product), q int8. The largest |q| is 127 in
// GGUF Q8_0, 8 or 7 in Q4_0 (d * (q - 8)), 16 or 15 in Q5_0: d is tried from each. Q4_0 and
// Q5_0 scales are negative when the block's extreme is positive (d = max / -8), and then a
// zero code is -0.0: negative d is tried too.
bool fit_q8(const float* x, float* d_out, int8_t* q_out) {
  float amax = 0.0f;
  for (int i = 0; i < kQBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
  for (float qmax : {127.0f, 8.0f, 7.0f, 16.0f, 15.0f, -8.0f, -7.0f, -16.0f, -15.0f}) {
    float cand[8];
    const int nc = scale_candidates(amax / std::fabs(qmax), cand);
    for (int c = 0; c < nc; ++c) {
      const float d = qmax < 0.0f ? -cand[c] : cand[c];
      if (!std::isfinite(d)) continue;
      bool ok = true;
      for (int i = 0; i < kQBlock && ok; ++i) {
        const float v = x[i];
        const float q = d != 0.0f ? std::nearbyint(v / d) : 0.0f;
        q_out[i] = static_cast<int8_t>(std::min(127.0f, std::max(-128.0f, q)));
        // verify with the stored code (an int8 0 rebuilds +0.0, never -0.0)
        ok = bits(d * static_cast<float>(q_out[i])) == bits(v);
      }
      if (ok) {
        *d_out = d;
        return true;
      }
    }
  }
  return false;
}

}  // namespace

bool pack_compact(PackedMatrix& pm, const Rows& rows, int format) {
  pm.format = format;
  const int64_t nkb = pm.k_blocks();
  pm.data.assign(static_cast<size_t>(pm.n_panels * nkb * pm.scale_floats()), 0.0f);
  pm.codes.assign(static_cast<size_t>(pm.n_panels * nkb * pm.code_bytes()), 0);
  for (int64_t n = 0; n < pm.n_out; ++n) {
    const int64_t p = n / kGemmNR, col = n % kGemmNR;
    for (int64_t b = 0; b < nkb; ++b) {
      float* sc = pm.data.data() + (p * nkb + b) * pm.scale_floats();
      uint8_t* cb = pm.codes.data() + (p * nkb + b) * pm.code_bytes();
      const float* x = rows.row(n) + b * kQBlock;
      if (format == kPanelBF16) {
        uint16_t* cw = reinterpret_cast<uint16_t*>(cb);
        for (int i = 0; i < kQBlock; ++i) {
          const uint32_t u = bits(x[i]);
          if ((u & 0xFFFFu) != 0) return false;
          cw[i * kGemmNR + col] = static_cast<uint16_t>(u >> 16);
        }
      } else if (format == kPanelQ4) {
        uint8_t q[kQBlock];
        if (!fit_affine(x, 15, sc + col, sc + kGemmNR + col, q)) return false;
        for (int i = 0; i < kQBlock / 2; ++i)
          cb[i * kGemmNR + col] = static_cast<uint8_t>(q[2 * i] | (q[2 * i + 1] << 4));
      } else if (format == kPanelQ5) {
        uint8_t q[kQBlock];
        if (!fit_affine(x, 31, sc + col, sc + kGemmNR + col, q)) return false;
        for (int i = 0; i < kQBlock; ++i) cb[i * kGemmNR + col] = q[i];
      } else if (format == kPanelQ6) {
        int8_t q[kQBlock];
        for (int h = 0; h < 2; ++h)
          if (!fit_q6(x + h * kQHalf, sc + h * kGemmNR + col, q + h * kQHalf)) return false;
        for (int i = 0; i < kQBlock; ++i) cb[i * kGemmNR + col] = static_cast<uint8_t>(q[i]);
      } else {
        int8_t q[kQBlock];
        if (!fit_q8(x, sc + col, q)) return false;
        for (int i = 0; i < kQBlock; ++i) cb[i * kGemmNR + col] = static_cast<uint8_t>(q[i]);
      }
    }
  }
  return true;
}

}  // namespace eb::ops::detail
