// TransformerConfig: every resolved size and option of one decoder block, as one typed struct.
// Python fills it in one place (exactblocks/transformer/config.py) after validating every
// value; the binding exposes its fields under the same names. Real options are kept as the
// caller's binary64 values and rounded to float32 once, in the model's constructor, under the
// FP-environment guard (a caller's rounding mode must not move their bits).
#pragma once
#include <cstdint>

#include "ops/activations.hpp"
#include "ops/norm.hpp"
#include "ops/rope.hpp"

namespace eb::blocks {

struct TransformerConfig {
  // Sizes, derived from the weight shapes (SPEC 4.2).
  int64_t d_model = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, intermediate = 0;
  // Attention (SPEC 4.3 step 6): window 0 = causal; attn_softcap 0 = none.
  int64_t window = 0;
  double attn_softcap = 0.0;
  // RoPE (SPEC 4.4): the first rope_dim dims of each head rotate.
  int64_t rope_dim = 0;
  double rope_theta = 10000.0;
  ops::RopeScaling rope_scaling = ops::kRopeDefault;
  double rope_factor = 1.0, rope_low_freq_factor = 1.0, rope_high_freq_factor = 4.0;
  int64_t rope_original_max = 8192;
  int64_t max_positions = 0;
  // Norms: the block norms' kind and epsilon (also the q/k norms'); LayerNorm biases.
  ops::NormKind norm = ops::kRmsNorm;
  double norm_eps = 1e-6;
  bool norm_bias = false;
  bool qk_norm = false;
  // Projections and MLP.
  bool qkv_bias = false, o_bias = false;
  ops::MlpKind mlp = ops::kSwiGlu;
  bool mlp_bias = false;
  // Storage, not arithmetic: whether the packer may pick a compact exact format (the bits are
  // those of float32 panels either way; tests build a block both ways and compare).
  bool compact_weights = true;
};

}  // namespace eb::blocks
