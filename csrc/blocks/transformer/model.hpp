// TransformerModel: one decoder block's resolved config and packed weights (built once),
// and TransformerCall: the arrays of one forward call. The block composes ops only
// (forward.hpp); the Python layer has validated everything before a call.
#pragma once
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/workspace.hpp"
#include "blocks/transformer/config.hpp"
#include "blocks/weight_map.hpp"
#include "ops/gemm/format.hpp"

namespace eb::blocks {

struct TransformerModel {
  TransformerConfig cfg;
  float attn_scale = 1.0f;      // float32 nearest to head_dim^-1/2
  float norm_eps = 0.0f;        // cfg.norm_eps rounded to float32 once
  float attn_softcap = 0.0f;    // cfg.attn_softcap rounded to float32 once (0 = none)
  std::vector<float> inv_freq;  // (rope_dim / 2,)
  std::vector<float> norm_in_w, norm_in_b, norm_post_w, norm_post_b;  // (d_model,)
  std::vector<float> q_norm_w, k_norm_w;                              // (head_dim,)
  ops::PackedMatrix w_qkv;   // [q_proj; k_proj; v_proj]  (QW + 2 KW, d_model)
  ops::PackedMatrix w_o;     // o_proj                     (d_model, QW)
  ops::PackedMatrix w_gu;    // [gate_proj; up_proj] or [up_proj]  ((2|1) IT, d_model)
  ops::PackedMatrix w_down;  // down_proj                  (d_model, IT)

  // weights: canonical short names -> contiguous float32 data (shapes checked by Python).
  TransformerModel(const TransformerConfig& c, const WeightMap& weights);
};

struct TransformerCall {
  const float* x;  // (batch, n_tokens, d_model)
  float* y;        // (batch, n_tokens, d_model), zero-filled by the caller
  int64_t batch, n_tokens;
  const int64_t* lengths;  // (batch,) real tokens per row, 0..n_tokens
  const int64_t* start;    // (batch,) absolute position of each row's first token
  float* k_cache;          // (batch, n_kv_heads, capacity, head_dim)
  float* v_cache;
  int64_t capacity;
  int n_threads;
  Workspace* ws;  // scratch kept between calls (a decode session's), or nullptr
  // SPEC 2.4 / 5 reading rule, checked while the cache is read: when the slots a row reads
  // hold a NaN or an infinity, the call sets *cache_nonfinite = 1 and returns before writing
  // the cache (y is then garbage; the caller raises). nullptr: the caller checked already.
  int* cache_nonfinite = nullptr;
};

}  // namespace eb::blocks
