// Packing of weight matrices into the GEMM's panel layout (format.hpp), with exact format
// detection. Packing moves bytes only; it cannot change a bit of any weight: a compact format is
// chosen only when every weight rebuilt from it (with the kernels' own operation) has the
// original's bits, and otherwise the matrix keeps float32 panels.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "base/fpenv.hpp"
#include "ops/gemm/format.hpp"

namespace eb::ops {
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

// One block of kQBlock consecutive weights x as w = fma(d, q, m), q in 0..15.
bool fit_q4(const float* x, float* d_out, float* m_out, uint8_t* q_out) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < kQBlock; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  float cand[8];
  const int nc = scale_candidates((hi - lo) / 15.0f, cand);
  for (int c = 0; c < nc; ++c) {
    const float d = cand[c];
    if (!std::isfinite(d) || d < 0.0f) continue;
    bool ok = true;
    for (int i = 0; i < kQBlock && ok; ++i) {
      const float v = x[i];
      float q = d > 0.0f ? std::nearbyint((v - lo) / d) : 0.0f;
      q_out[i] = static_cast<uint8_t>(std::min(15.0f, std::max(0.0f, q)));
      // verify with the stored code, exactly as the kernels rebuild the weight
      ok = bits(std::fma(d, static_cast<float>(q_out[i]), lo)) == bits(v);
    }
    if (ok) {
      *d_out = d;
      *m_out = lo;
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

// Rows of the stacked matrix, in order: row n of part i.
struct Rows {
  std::vector<const float*> ptr;
  const float* row(int64_t n) const { return ptr[static_cast<size_t>(n)]; }
};

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
        if (!fit_q4(x, sc + col, sc + kGemmNR + col, q)) return false;
        for (int i = 0; i < kQBlock / 2; ++i)
          cb[i * kGemmNR + col] = static_cast<uint8_t>(q[2 * i] | (q[2 * i + 1] << 4));
      } else {
        int8_t q[kQBlock];
        if (!fit_q8(x, sc + col, q)) return false;
        for (int i = 0; i < kQBlock; ++i) cb[i * kGemmNR + col] = static_cast<uint8_t>(q[i]);
      }
    }
  }
  return true;
}

}  // namespace

PackedMatrix pack_matrices(const std::vector<const float*>& parts, const std::vector<int64_t>& rows,
                           int64_t k_in, const std::vector<const float*>& biases,
                           bool allow_compact) {
  FpEnvGuard guard;  // the format checks must see the kernels' FP mode, not the caller's
  PackedMatrix pm;
  pm.k_in = k_in;
  Rows all;
  for (size_t part = 0; part < parts.size(); ++part)
    for (int64_t r = 0; r < rows[part]; ++r) all.ptr.push_back(parts[part] + r * k_in);
  pm.n_out = static_cast<int64_t>(all.ptr.size());
  pm.n_panels = (pm.n_out + kGemmNR - 1) / kGemmNR;
  bool any_bias = false;
  for (const float* b : biases) any_bias = any_bias || b != nullptr;
  if (any_bias) {
    pm.bias.assign(static_cast<size_t>(pm.n_out), 0.0f);
    int64_t n = 0;
    for (size_t part = 0; part < parts.size(); ++part)
      for (int64_t r = 0; r < rows[part]; ++r, ++n)
        if (biases[part]) pm.bias[static_cast<size_t>(n)] = biases[part][r];
  }
  if (allow_compact && k_in > 0 && k_in % kQBlock == 0 && pm.n_out > 0) {
    for (int format : {kPanelQ4, kPanelQ8, kPanelBF16})
      if (pack_compact(pm, all, format)) return pm;
    pm.codes = AlignedVector<uint8_t>();
  }
  pm.format = kPanelF32;
  pm.data.assign(static_cast<size_t>(pm.n_panels * k_in * kGemmNR), 0.0f);
  for (int64_t n = 0; n < pm.n_out; ++n) {
    const float* src = all.row(n);
    float* dst = pm.data.data() + (n / kGemmNR) * k_in * kGemmNR + (n % kGemmNR);
    for (int64_t k = 0; k < k_in; ++k) dst[k * kGemmNR] = src[k];
  }
  return pm;
}

}  // namespace eb::ops
