// Attention of one query head (ref.hpp, SPEC 4.3 step 6): a score per key in L16 order, the
// softmax, then the output as one SEQ fma chain per component over the keys in position order.
#include <cmath>

#include "ops/ref/ref.hpp"

namespace eb::ops::ref {

void attention_ref(const float* q, const float* k, const float* v, int64_t ld, int64_t head_dim,
                   int64_t j0, int64_t p, float scale, float softcap, float* probs, float* o) {
  const int64_t n = p - j0 + 1;
  for (int64_t i = 0; i < n; ++i) probs[i] = dot_l16_ref(q, k + (j0 + i) * ld, head_dim);
  softmax_ref(probs, n, scale, softcap);
  for (int64_t d = 0; d < head_dim; ++d) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s = std::fma(probs[i], v[(j0 + i) * ld + d], s);
    o[d] = s;
  }
}

}  // namespace eb::ops::ref
