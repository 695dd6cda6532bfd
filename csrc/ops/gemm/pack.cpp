// Packing of weight matrices into the GEMM's panel layout (format.hpp), with exact format
// detection. Packing moves bytes only; it cannot change a bit of any weight: a compact format is
// chosen only when every weight rebuilt from it (with the kernels' own operation) has the
// original's bits, and otherwise the matrix keeps float32 panels.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "base/check.hpp"
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

// IEEE binary16 -> binary32, exact (GGUF stores d and m as binary16).
float half_to_float(const uint8_t* p) {
  const uint32_t h = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8);
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t u;
  if (exp == 0x1Fu) {
    u = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal binary16: a normal binary32 (man * 2^-24)
    int e = -1;
    uint32_t mm = man;
    while ((mm & 0x400u) == 0) {
      mm <<= 1;
      ++e;
    }
    u = sign | ((112u - static_cast<uint32_t>(e)) << 23) | ((mm & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The compact format a GGUF type maps onto (kPanelF32 = none).
int direct_format(int type) {
  switch (type) {
    case kGgmlQ4_1:
    case kGgmlQ4_K: return kPanelQ4;
    case kGgmlQ4_0:
    case kGgmlQ5_0:
    case kGgmlQ8_0: return kPanelQ8;
    case kGgmlQ5_1:
    case kGgmlQ5_K: return kPanelQ5;
    case kGgmlQ6_K: return kPanelQ6;
    default: return kPanelF32;
  }
}

// Sub-block j (0..7) scale and min codes of a Q4_K super-block (llama.cpp get_scale_min_k4).
void q4k_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Block b (kQBlock weights) of one row of GGUF blocks as the compact format's scales and
// codes, exactly gguf's values: d[0] and m (affine formats: w = fma(d[0], q, m), q 0..15 or
// 0..31), or d[0] for k 0..15 and d[1] for k 16..31 (w = d[h] * q, q int8; d[1] = d[0] for
// every type but Q6_K). Layouts and operations: llama.cpp ggml-quants.c dequantize_row_*,
// gguf-py gguf/quants.py (the same values).
void gguf_block(const uint8_t* row, int type, int64_t b, float* d, float* m, int* q) {
  switch (type) {
    case kGgmlQ4_1: {
      const uint8_t* blk = row + b * 20;
      d[0] = d[1] = half_to_float(blk);
      *m = half_to_float(blk + 2);
      for (int i = 0; i < 16; ++i) {
        q[i] = blk[4 + i] & 0x0F;
        q[i + 16] = blk[4 + i] >> 4;
      }
      return;
    }
    case kGgmlQ4_K: {
      const uint8_t* blk = row + (b / 8) * 144;
      const int j = static_cast<int>(b % 8);
      int sc = 0, mn = 0;
      q4k_scale_min(blk + 4, j, &sc, &mn);
      // (d * sc) and (dmin * mn) are exact float32 products (11 x 6 significant bits)
      d[0] = d[1] = half_to_float(blk) * static_cast<float>(sc);
      *m = -(half_to_float(blk + 2) * static_cast<float>(mn));
      const uint8_t* qs = blk + 16 + (j / 2) * 32;
      const int shift = (j % 2) * 4;
      for (int i = 0; i < 32; ++i) q[i] = (qs[i] >> shift) & 0x0F;
      return;
    }
    case kGgmlQ5_1: {  // d (f16), m (f16), qh (32 high bits), qs (16 bytes of two nibbles)
      const uint8_t* blk = row + b * 24;
      d[0] = d[1] = half_to_float(blk);
      *m = half_to_float(blk + 2);
      const uint32_t qh = static_cast<uint32_t>(blk[4]) | (static_cast<uint32_t>(blk[5]) << 8) |
                          (static_cast<uint32_t>(blk[6]) << 16) |
                          (static_cast<uint32_t>(blk[7]) << 24);
      for (int i = 0; i < 16; ++i) {
        q[i] = static_cast<int>((blk[8 + i] & 0x0F) | (((qh >> i) & 1u) << 4));
        q[i + 16] = static_cast<int>((blk[8 + i] >> 4) | (((qh >> (i + 16)) & 1u) << 4));
      }
      return;
    }
    case kGgmlQ5_K: {  // d, dmin (f16), scales (12, as Q4_K), qh (32), qs (128)
      const uint8_t* blk = row + (b / 8) * 176;
      const int j = static_cast<int>(b % 8);
      int sc = 0, mn = 0;
      q4k_scale_min(blk + 4, j, &sc, &mn);
      // (d * sc) and (dmin * mn) are exact float32 products (11 x 6 significant bits)
      d[0] = d[1] = half_to_float(blk) * static_cast<float>(sc);
      *m = -(half_to_float(blk + 2) * static_cast<float>(mn));
      const uint8_t* qh = blk + 16;
      const uint8_t* qs = blk + 48 + (j / 2) * 32;
      const int shift = (j % 2) * 4;
      for (int i = 0; i < 32; ++i) q[i] = ((qs[i] >> shift) & 0x0F) | (((qh[i] >> j) & 1) << 4);
      return;
    }
    case kGgmlQ6_K: {  // ql (128), qh (64), scales (16 int8), d (f16) at byte 208
      const uint8_t* blk = row + (b / 8) * 210;
      const int j = static_cast<int>(b % 8);  // 32 weights e = 32 j + i of the 256
      const float dd = half_to_float(blk + 208);
      const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
      // (d * sc): an exact float32 product (11 x 7 significant bits; format.hpp kPanelQ6)
      d[0] = dd * static_cast<float>(scales[2 * j]);
      d[1] = dd * static_cast<float>(scales[2 * j + 1]);
      *m = 0.0f;
      // e = 128 half + 32 s + i (s = j % 4): low nibble of ql[64 half + 32 (s % 2) + i]
      // shifted by 4 (s / 2), high two bits of qh[32 half + i] shifted by 2 s
      const int half = j / 4, s = j % 4;
      const uint8_t* ql = blk + 64 * half + 32 * (s % 2);
      const uint8_t* qh = blk + 128 + 32 * half;
      for (int i = 0; i < 32; ++i)
        q[i] =
            static_cast<int>(((ql[i] >> (4 * (s / 2))) & 0x0F) | (((qh[i] >> (2 * s)) & 3) << 4)) -
            32;
      return;
    }
    case kGgmlQ4_0: {
      const uint8_t* blk = row + b * 18;
      d[0] = d[1] = half_to_float(blk);
      for (int i = 0; i < 16; ++i) {
        q[i] = (blk[2 + i] & 0x0F) - 8;
        q[i + 16] = (blk[2 + i] >> 4) - 8;
      }
      return;
    }
    case kGgmlQ5_0: {
      const uint8_t* blk = row + b * 22;
      d[0] = d[1] = half_to_float(blk);
      const uint32_t qh = static_cast<uint32_t>(blk[2]) | (static_cast<uint32_t>(blk[3]) << 8) |
                          (static_cast<uint32_t>(blk[4]) << 16) |
                          (static_cast<uint32_t>(blk[5]) << 24);
      for (int i = 0; i < 16; ++i) {
        q[i] = static_cast<int>((blk[6 + i] & 0x0F) | (((qh >> i) & 1u) << 4)) - 16;
        q[i + 16] = static_cast<int>((blk[6 + i] >> 4) | (((qh >> (i + 16)) & 1u) << 4)) - 16;
      }
      return;
    }
    default: {  // kGgmlQ8_0
      const uint8_t* blk = row + b * 34;
      d[0] = d[1] = half_to_float(blk);
      for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(blk[2 + i]);
      return;
    }
  }
}

// A mixed stack (PackedMatrix::parts) of n parts with k_in inputs: each run of consecutive
// parts of one format_of(i) packed together by pack(i, j) (parts [i, j)).
template <class FormatOf, class Pack>
PackedMatrix pack_runs(size_t n, int64_t k_in, FormatOf format_of, Pack pack) {
  PackedMatrix pm;
  pm.k_in = k_in;
  for (size_t i = 0; i < n;) {
    size_t j = i + 1;
    while (j < n && format_of(j) == format_of(i)) ++j;
    pm.parts.push_back(pack(i, j));
    pm.n_out += pm.parts.back().n_out;
    i = j;
  }
  return pm;
}

// Elements [i, j) of v.
template <class T>
std::vector<T> slice(const std::vector<T>& v, size_t i, size_t j) {
  return std::vector<T>(v.begin() + static_cast<std::ptrdiff_t>(i),
                        v.begin() + static_cast<std::ptrdiff_t>(j));
}

}  // namespace

int64_t ggml_block_size(int type) {
  switch (type) {
    case kGgmlQ4_0:
    case kGgmlQ4_1:
    case kGgmlQ5_0:
    case kGgmlQ5_1:
    case kGgmlQ8_0: return 32;
    case kGgmlQ4_K:
    case kGgmlQ5_K:
    case kGgmlQ6_K: return 256;
    default: return 0;
  }
}

int64_t ggml_type_size(int type) {
  switch (type) {
    case kGgmlQ4_0: return 18;
    case kGgmlQ4_1: return 20;
    case kGgmlQ5_0: return 22;
    case kGgmlQ5_1: return 24;
    case kGgmlQ8_0: return 34;
    case kGgmlQ4_K: return 144;
    case kGgmlQ5_K: return 176;
    case kGgmlQ6_K: return 210;
    default: return 0;
  }
}

void dequantize_gguf(const uint8_t* blocks, int type, int64_t n, float* out) {
  FpEnvGuard guard;
  const int fmt = direct_format(type);
  EB_CHECK(fmt != kPanelF32 && n % ggml_block_size(type) == 0,
           "dequantize_gguf: unsupported type or size");
  float d[2] = {0.0f, 0.0f}, m = 0.0f;
  int q[kQBlock];
  for (int64_t b = 0; b < n / kQBlock; ++b) {
    gguf_block(blocks, type, b, d, &m, q);
    float* o = out + b * kQBlock;
    // gguf.quants' operations: d * q + m (Q4_1, Q5_1; d * q exact), d*sc * q - dmin*m (Q4_K,
    // Q5_K), d * q (Q8_0, Q4_0, Q5_0), (d*sc) * q (Q6_K, per 16): the same roundings as the
    // kernels' fma(d, q, m) and d * q (format.hpp)
    for (int i = 0; i < kQBlock; ++i)
      o[i] = fmt == kPanelQ4 || fmt == kPanelQ5 ? std::fma(d[0], static_cast<float>(q[i]), m)
                                                : d[i / kQHalf] * static_cast<float>(q[i]);
  }
}

PackedMatrix pack_sources(const std::vector<MatrixSource>& parts, int64_t k_in,
                          const std::vector<const float*>& biases, bool allow_compact) {
  int fmt = -1;
  bool any_blocks = false;
  for (const MatrixSource& s : parts) {
    const int f = s.blocks ? direct_format(s.type) : kPanelF32;
    if (s.blocks) {
      any_blocks = true;
      EB_CHECK(f != kPanelF32 && k_in % ggml_block_size(s.type) == 0,
               "pack_sources: unsupported GGUF type or row length");
    }
    fmt = fmt == -1 || fmt == f ? f : kPanelF32;
  }
  const bool direct =
      any_blocks && allow_compact && fmt != kPanelF32 && k_in > 0 && k_in % kQBlock == 0;
  // Every part GGUF blocks of a compact type, but not all of one format (a Q4_K q|k with a
  // Q6_K v): each run of one format packed on its own, instead of a float32 copy of them all.
  bool mixed = !direct && allow_compact && parts.size() > 1 && k_in > 0 && k_in % kQBlock == 0;
  for (const MatrixSource& s : parts)
    mixed = mixed && s.blocks != nullptr && direct_format(s.type) != kPanelF32;
  if (mixed)
    return pack_runs(
        parts.size(), k_in, [&](size_t i) { return direct_format(parts[i].type); },
        [&](size_t i, size_t j) {
          return pack_sources(slice(parts, i, j), k_in, slice(biases, i, j), true);
        });
  if (!direct) {  // float32 (dequantised here where needed) through the detecting packer
    std::vector<std::vector<float>> owned;
    std::vector<const float*> ptrs;
    std::vector<int64_t> rows;
    for (const MatrixSource& s : parts) {
      rows.push_back(s.rows);
      if (s.blocks) {
        owned.emplace_back(static_cast<size_t>(s.rows * k_in));
        dequantize_gguf(s.blocks, s.type, s.rows * k_in, owned.back().data());
        ptrs.push_back(owned.back().data());
      } else {
        ptrs.push_back(s.f32);
      }
    }
    return pack_matrices(ptrs, rows, k_in, biases, allow_compact);
  }
  FpEnvGuard guard;
  PackedMatrix pm;
  pm.k_in = k_in;
  pm.format = fmt;
  for (const MatrixSource& s : parts) pm.n_out += s.rows;
  pm.n_panels = (pm.n_out + kGemmNR - 1) / kGemmNR;
  bool any_bias = false;
  for (const float* b : biases) any_bias = any_bias || b != nullptr;
  if (any_bias) {
    pm.bias.assign(static_cast<size_t>(pm.n_out), 0.0f);
    int64_t n = 0;
    for (size_t part = 0; part < parts.size(); ++part)
      for (int64_t r = 0; r < parts[part].rows; ++r, ++n)
        if (biases[part]) pm.bias[static_cast<size_t>(n)] = biases[part][r];
  }
  const int64_t nkb = pm.k_blocks();
  pm.data.assign(static_cast<size_t>(pm.n_panels * nkb * pm.scale_floats()), 0.0f);
  pm.codes.assign(static_cast<size_t>(pm.n_panels * nkb * pm.code_bytes()), 0);
  int64_t n = 0;
  int q[kQBlock];
  for (const MatrixSource& s : parts) {
    const int64_t row_bytes = k_in / ggml_block_size(s.type) * ggml_type_size(s.type);
    for (int64_t r = 0; r < s.rows; ++r, ++n) {
      const uint8_t* row = s.blocks + r * row_bytes;
      const int64_t p = n / kGemmNR, col = n % kGemmNR;
      for (int64_t b = 0; b < nkb; ++b) {
        float* sc = pm.data.data() + (p * nkb + b) * pm.scale_floats();
        uint8_t* cb = pm.codes.data() + (p * nkb + b) * pm.code_bytes();
        float d[2], m = 0.0f;
        gguf_block(row, s.type, b, d, &m, q);
        sc[col] = d[0];
        if (fmt == kPanelQ4) {
          sc[kGemmNR + col] = m;
          for (int i = 0; i < kQBlock / 2; ++i)
            cb[i * kGemmNR + col] = static_cast<uint8_t>(q[2 * i] | (q[2 * i + 1] << 4));
        } else if (fmt == kPanelQ5) {
          sc[kGemmNR + col] = m;
          for (int i = 0; i < kQBlock; ++i) cb[i * kGemmNR + col] = static_cast<uint8_t>(q[i]);
        } else {
          if (fmt == kPanelQ6) sc[kGemmNR + col] = d[1];
          for (int i = 0; i < kQBlock; ++i)
            cb[i * kGemmNR + col] = static_cast<uint8_t>(static_cast<int8_t>(q[i]));
        }
      }
    }
  }
  return pm;
}

void unpack_rows(const PackedMatrix& w, int64_t r0, int64_t r1, float* out) {
  FpEnvGuard guard;  // the kernels' FP mode: fma and products round as in the tiles
  EB_CHECK(0 <= r0 && r0 <= r1 && r1 <= w.n_out, "unpack_rows: rows out of range");
  if (!w.parts.empty()) {  // a mixed stack: the rows each part holds
    int64_t first = 0;
    for (const PackedMatrix& p : w.parts) {
      const int64_t a = std::max(r0, first), b = std::min(r1, first + p.n_out);
      if (a < b) unpack_rows(p, a - first, b - first, out + (a - r0) * w.k_in);
      first += p.n_out;
    }
    return;
  }
  const int64_t k_in = w.k_in, nkb = w.format == kPanelF32 ? 0 : w.k_blocks();
  for (int64_t n = r0; n < r1; ++n) {
    const int64_t p = n / kGemmNR, col = n % kGemmNR;
    float* o = out + (n - r0) * k_in;
    if (w.format == kPanelF32) {
      const float* src = w.data.data() + p * k_in * kGemmNR + col;
      for (int64_t k = 0; k < k_in; ++k) o[k] = src[k * kGemmNR];
      continue;
    }
    for (int64_t b = 0; b < nkb; ++b) {
      const float* sc = w.data.data() + (p * nkb + b) * w.scale_floats();
      const uint8_t* cb = w.codes.data() + (p * nkb + b) * w.code_bytes();
      float* ob = o + b * kQBlock;
      if (w.format == kPanelQ4) {
        const float d = sc[col], m = sc[kGemmNR + col];
        for (int i = 0; i < kQBlock / 2; ++i) {
          const uint8_t byte = cb[i * kGemmNR + col];
          ob[2 * i] = std::fma(d, static_cast<float>(byte & 0x0F), m);
          ob[2 * i + 1] = std::fma(d, static_cast<float>(byte >> 4), m);
        }
      } else if (w.format == kPanelQ5) {
        const float d = sc[col], m = sc[kGemmNR + col];
        for (int i = 0; i < kQBlock; ++i)
          ob[i] = std::fma(d, static_cast<float>(static_cast<int8_t>(cb[i * kGemmNR + col])), m);
      } else if (w.format == kPanelQ8 || w.format == kPanelQ6) {
        const int64_t group = w.format == kPanelQ6 ? kQHalf : kQBlock;
        for (int i = 0; i < kQBlock; ++i)
          ob[i] = sc[(i / group) * kGemmNR + col] *
                  static_cast<float>(static_cast<int8_t>(cb[i * kGemmNR + col]));
      } else {  // kPanelBF16
        const uint16_t* cw = reinterpret_cast<const uint16_t*>(cb);
        for (int i = 0; i < kQBlock; ++i) {
          const uint32_t u = static_cast<uint32_t>(cw[i * kGemmNR + col]) << 16;
          std::memcpy(ob + i, &u, sizeof u);
        }
      }
    }
  }
}

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
    // smallest first: 0.75, 1.125, 1.25, 1.25 and 2 bytes per weight
    for (int format : {kPanelQ4, kPanelQ8, kPanelQ5, kPanelQ6, kPanelBF16})
      if (pack_compact(pm, all, format)) return pm;
    pm.codes = AlignedVector<uint8_t>();
    // No one format holds the whole stack (a q|k|v rebuilt from GGUF types that share none,
    // by a pickle or set_params): each part searched on its own and consecutive parts of one
    // format packed together, as pack_sources keeps such blocks, when any part is compact.
    if (parts.size() > 1) {
      std::vector<PackedMatrix> each;
      bool any_compact = false;
      for (size_t i = 0; i < parts.size(); ++i) {
        each.push_back(pack_matrices({parts[i]}, {rows[i]}, k_in, {biases[i]}, true));
        any_compact = any_compact || each.back().format != kPanelF32;
      }
      if (any_compact)
        return pack_runs(
            parts.size(), k_in, [&](size_t i) { return each[i].format; },
            [&](size_t i, size_t j) {
              return j == i + 1 ? std::move(each[i])
                                : pack_matrices(slice(parts, i, j), slice(rows, i, j), k_in,
                                                slice(biases, i, j), true);
            });
    }
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
