// GGUF weight blocks (ggml types Q4_0 .. Q6_K): their sizes, their decoding into the compact
// formats' scales and codes (pack_detail.hpp gguf_block), and their float32 values with
// gguf.quants' operations (dequantize_gguf).
#include <cmath>
#include <cstring>

#include "base/check.hpp"
#include "base/fpenv.hpp"
#include "ops/gemm/format.hpp"
#include "ops/gemm/pack_detail.hpp"

namespace eb::ops {
namespace {

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

}  // namespace

namespace detail {

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

}  // namespace detail

using detail::direct_format;
using detail::gguf_block;

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

}  // namespace eb::ops
