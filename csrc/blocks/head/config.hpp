// HeadConfig: the model's output head after the last block (final norm, the vocabulary
// projection, then an optional logit scaling and softcap), as one typed struct. Python fills it in
// one place (exactblocks/models/base.py) after validating every value; the binding exposes the
// fields under the same names. eps is kept as the caller's binary64 value and rounded to float32
// once, in the model's constructor.
#pragma once
#include <cstdint>

#include "ops/norm.hpp"

namespace eb::blocks {

struct HeadConfig {
  int64_t d_model = 0, vocab_size = 0;
  // The final norm (HF LlamaModel.norm, Mamba2Model.norm_f): its kind, epsilon and bias.
  ops::NormKind norm = ops::kRmsNorm;
  double norm_eps = 1e-6;
  bool norm_bias = false;
  // After the projection, per logit, in this order (each skipped at its neutral value):
  //   logits_scaling  z = z / s            (HF Granite, GraniteMoeHybrid: logits / logits_scaling)
  //   logit_softcap   z = tanh(z / c) * c  (HF Gemma 2/3 final_logit_softcapping)
  // Both are the caller's binary64 values rounded to float32 once, in the model's constructor.
  double logits_scaling = 1.0;
  double logit_softcap = 0.0;  // 0 = none
  // Storage, not arithmetic: whether the packer may pick a compact exact format for the
  // projection (the bits are those of float32 panels either way).
  bool compact_weights = true;
};

}  // namespace eb::blocks
