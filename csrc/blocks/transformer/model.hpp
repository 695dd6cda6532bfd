// TransformerModel: one decoder block's resolved config and packed weights (built once),
// and TransformerCall: the arrays of one forward call. The block composes ops only
// (forward.hpp); the Python layer has validated everything before a call.
#pragma once
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/undo.hpp"
#include "base/workspace.hpp"
#include "blocks/transformer/config.hpp"
#include "blocks/weight_map.hpp"
#include "ops/gemm/format.hpp"

namespace eb::blocks {

// One block norm's weight (and bias under norm_bias); empty when the block has no such norm.
struct BlockNorm {
  std::vector<float> w, b;  // (d_model,); w holds float32(1 + w) for rmsnorm_offset
  bool on() const { return !w.empty(); }
  const float* bias() const { return b.empty() ? nullptr : b.data(); }
};

struct TransformerModel {
  TransformerConfig cfg;
  float attn_scale = 1.0f;           // cfg.attn_scale, or the float32 nearest to head_dim^-1/2
  float norm_eps = 0.0f;             // cfg.norm_eps rounded to float32 once
  float attn_softcap = 0.0f;         // cfg.attn_softcap rounded to float32 once (0 = none)
  float residual_mult = 1.0f;        // cfg.residual_multiplier rounded once (applied when != 1)
  float rope_factor = 1.0f;          // yarn / longrope attention factor on cos and sin (1 = none)
  std::vector<float> inv_freq;       // (rope_dim / 2,) [longrope: the short set, rope_set 0]
  std::vector<float> inv_freq_long;  // longrope: the long set (rope_set 1); empty otherwise
  // The block norms by their place in the op order (config.hpp: which HF weight each is):
  // on the attention input, the attention output, the MLP input, the MLP output.
  BlockNorm n_attn_in, n_attn_out, n_mlp_in, n_mlp_out;
  std::vector<float> q_norm_w, k_norm_w;  // config.hpp qk_norm_scope shapes
  ops::PackedMatrix w_qkv;   // [q_proj; k_proj; v_proj]  (QW + 2 KW, d_model)   attention half
  ops::PackedMatrix w_o;     // o_proj                     (d_model, QW)          attention half
  ops::PackedMatrix w_gu;    // [gate_proj; up_proj] or [up_proj]  ((2|1) IT, d_model)  MLP half
  ops::PackedMatrix w_down;  // down_proj                  (d_model, IT)          MLP half
  // MoE MLP half (cfg.num_experts > 0), in place of w_gu / w_down: the router, per expert e
  // [gate_e; up_e] (2 IT, d_model) and down_e (d_model, IT); the shared expert (Qwen2-MoE).
  ops::PackedMatrix w_router;  // (num_experts, d_model)
  std::vector<ops::PackedMatrix> w_exp_gu, w_exp_down;
  ops::PackedMatrix w_sh_gu, w_sh_down, w_sh_gate;
  bool moe() const { return cfg.num_experts > 0; }
  ops::MoeMlp moe_mlp() const;  // the op's view of the matrices above

  // weights: canonical short names -> contiguous float32 data (shapes checked by Python).
  TransformerModel(const TransformerConfig& c, const WeightMap& weights);
};

struct TransformerCall {
  const float* x;  // (batch, n_tokens, d_model)
  // mlp_only blocks read no cache and no positions: k_cache / v_cache may be null, capacity 0.
  float* y;  // (batch, n_tokens, d_model), zero-filled by the caller
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
  // longrope: which inv_freq set rotates this call's tokens, 0 = short, 1 = long. HF picks by
  // the sequence length, which would make a decode differ from a prefill; the caller picks
  // once per state instead (long when its max_tokens > original_max_position_embeddings).
  int rope_set = 0;
  // A whole-model call's undo log (base/undo.hpp): the cache slots the call overwrites are
  // saved into it first, so that the model can restore them if a later layer fails. nullptr:
  // nothing is saved (a block call writes its cache last, after every point it can stop at).
  UndoLog* undo = nullptr;
};

}  // namespace eb::blocks
