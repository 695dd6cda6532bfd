// The L16 order written out (ref.hpp): 16 partial sums, then the w = 8, 4, 2, 1 tree.
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
  for (int64_t i = 0; i < n; ++i) s[i % 16] = std::fma(a[i], b[i], s[i % 16]);
  return tree16(s);
}

float sum_l16_ref(const float* a, int64_t n) {
  float s[16];
  for (int j = 0; j < 16; ++j) s[j] = 0.0f;
  for (int64_t i = 0; i < n; ++i) s[i % 16] = s[i % 16] + a[i];
  return tree16(s);
}

}  // namespace eb::ops::ref
