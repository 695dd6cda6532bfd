// HeadModel: the resolved config and the packed weights of a model's output head (built once).
// logits[m] = W_head · N(x[m]) per token row m: the final norm (ops/norm.hpp, L16 sums) then
// the packed GEMM (ops/gemm, SEQ FMA chains), the blocks' own arithmetic, so the logits are
// part of the bitwise promise (a row's logits depend only on that row). The binding composes
// the two through the kernel table. The one arithmetic of this layer is finish_logits: the
// scalar per-logit division and softcap HF applies after lm_head (Granite, Gemma 2/3), one
// correctly rounded division and the library's own tanh_f32 per logit, the same on every ISA.
#pragma once
#include <vector>

#include "blocks/head/config.hpp"
#include "ops/gemm/format.hpp"

namespace eb::blocks {

struct HeadModel {
  HeadConfig cfg;
  float norm_eps = 0.0f;        // cfg.norm_eps rounded to float32 once
  std::vector<float> norm_w;    // (d_model,); (1 + w) rounded once for rmsnorm_offset
  std::vector<float> norm_b;    // (d_model,) with norm_bias, else empty
  ops::PackedMatrix w_head;     // lm_head (vocab_size, d_model), or the tied embedding
  float logits_scaling = 1.0f;  // cfg.logits_scaling rounded to float32 once
  float logit_softcap = 0.0f;   // cfg.logit_softcap rounded to float32 once (0 = none)

  // norm_weight (d_model,), norm_bias (d_model,) or nullptr, head_weight (vocab_size, d_model)
  // row-major float32 or GGUF blocks (rows set here); shapes checked by Python. The arrays are
  // copied and packed; none is kept.
  HeadModel(const HeadConfig& c, const float* norm_weight, const float* norm_bias,
            ops::MatrixSource head_weight);

  // In place over n logits: z = z / logits_scaling (when != 1), then z = tanh_f32(z / c) * c
  // (when c = logit_softcap > 0): HF's float32 `logits / s` and `tanh(logits / c) * c`.
  void finish_logits(float* z, int64_t n) const;
  bool has_finish() const { return logits_scaling != 1.0f || logit_softcap > 0.0f; }
};

}  // namespace eb::blocks
