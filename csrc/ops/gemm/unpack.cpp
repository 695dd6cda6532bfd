// Unpacking: a packed matrix's rows back as float32, each weight rebuilt with the kernels' own
// operations (format.hpp), so that packing then unpacking gives back the weights bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "base/check.hpp"
#include "base/fpenv.hpp"
#include "ops/gemm/format.hpp"

namespace eb::ops {

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

}  // namespace eb::ops
