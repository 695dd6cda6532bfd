// The L16 order written out (ref.hpp, SPEC 3.3): 16 partial sums over n rounded up to a multiple
// of 16, the terms past n being +0.0 (they turn a lane holding -0.0 into +0.0), then the
// w = 8, 4, 2, 1 tree.
#include <cmath>

#include "ops/ref/ref.hpp"

namespace eb::ops::ref {

namespace {

float tree16(float* s) {
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) s[j] = s[j] + s[j + w];
  return s[0];
}

}  // namespace

float dot_l16_ref(const float* a, const float* b, int64_t n) {
  float s[16];
  for (int j = 0; j < 16; ++j) s[j] = 0.0f;
  const int64_t padded = (n + 15) / 16 * 16;
  for (int64_t i = 0; i < padded; ++i)
    s[i % 16] = i < n ? std::fma(a[i], b[i], s[i % 16]) : std::fma(0.0f, 0.0f, s[i % 16]);
  return tree16(s);
}

float sum_l16_ref(const float* a, int64_t n) {
  float s[16];
  for (int j = 0; j < 16; ++j) s[j] = 0.0f;
  const int64_t padded = (n + 15) / 16 * 16;
  for (int64_t i = 0; i < padded; ++i) s[i % 16] = s[i % 16] + (i < n ? a[i] : 0.0f);
  return tree16(s);
}

}  // namespace eb::ops::ref
