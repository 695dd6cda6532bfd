// Mamba2Config: every resolved size and option of one Mamba-2 block (SPEC 7), as one typed
// struct filled by exactblocks/mamba2/config.py. Real options are kept as binary64 and rounded
// to float32 once, in the model's constructor, under the FP-environment guard.
#pragma once
#include <cstdint>

namespace eb::blocks {

struct Mamba2Config {
  // Sizes, derived from the weight shapes (SPEC 7.2).
  int64_t d_model = 0, d_inner = 0, n_heads = 0, head_dim = 0, d_state = 0, n_groups = 1;
  int64_t conv_dim = 0, conv_kernel = 0;
  // Options: norm epsilon (both norms), dt clamp (dt_max may be +inf).
  double norm_eps = 1e-5, dt_min = 0.0, dt_max = 0.0;
  // Optional tensors present.
  bool conv_bias = false, proj_bias = false;
  // Storage, not arithmetic (see TransformerConfig::compact_weights).
  bool compact_weights = true;
};

}  // namespace eb::blocks
