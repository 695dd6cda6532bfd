// TransformerConfig: every resolved size and option of one decoder block, as one typed struct.
// Python fills it in one place (exactblocks/transformer/config.py) after validating every
// value; the binding exposes its fields under the same names. Real options are kept as the
// caller's binary64 values and rounded to float32 once, in the model's constructor, under the
// FP-environment guard (a caller's rounding mode must not move their bits).
//
// Every field's default keeps the bits of the plain pre-norm LlamaDecoderLayer block (SPEC 4.3);
// a setting adds arithmetic only where it is used.
//
// Weights the model packs (canonical short names, torch [out, in] layout; QW = n_heads
// head_dim, KW = n_kv_heads head_dim, IT = intermediate, d = d_model):
//   attention half (block_parts full | attention_only):
//     q_proj (QW, d), k_proj (KW, d), v_proj (KW, d), o_proj (d, QW); .bias (rows,) when given
//     q_norm / k_norm when qk_norm: (head_dim,) [qk_norm_scope head], (QW,) / (KW,)
//       [all_heads], (n_heads, head_dim) / (n_kv_heads, head_dim) [per_head_weights]
//     input_layernorm (d,)           the norm on the attention input     [pre, sandwich,
//                                    (and on the MLP input under parallel)  parallel]
//     post_attention_layernorm (d,)  the norm on the attention output    [sandwich, post]
//   MLP half (block_parts full | mlp_only):
//     gate_proj (IT, d) [gated mlp], up_proj (IT, d), down_proj (d, IT); .bias when given
//     post_attention_layernorm (d,)  the norm on the MLP input           [pre]
//     pre_feedforward_layernorm (d,) the norm on the MLP input           [sandwich]
//     post_feedforward_layernorm (d,) the norm on the MLP output         [sandwich, post]
//   Every block norm has a .bias (d,) too when norm_bias.
//   MoE MLP half (num_experts > 0; SPEC 4.8), in place of gate/up/down_proj (IT = the expert
//   width):
//     router.weight (E, d); experts.gate_up_proj (E, 2 IT, d) and experts.down_proj (E, d, IT):
//     expert e is the e-th (2 IT, d) = [gate_e; up_e] / (d, IT) slice (HF 5.x's stacking);
//     shared_expert.{gate,up}_proj.weight (SIT, d), shared_expert.down_proj.weight (d, SIT) and
//     shared_expert_gate.weight (1, d) when shared_intermediate SIT > 0 (Qwen2-MoE).
#pragma once
#include <cstdint>
#include <vector>

#include "ops/activations.hpp"
#include "ops/moe.hpp"
#include "ops/norm.hpp"
#include "ops/rope.hpp"

namespace eb::blocks {

// Where the block norms sit (HF names of the weights above):
//   pre      x1 = x + m*attn(N_in(x));            y = x1 + m*mlp(N_post_attn(x1))   Llama
//   sandwich x1 = x + m*N_post_attn(attn(N_in(x))); y = x1 + m*N_post_ff(mlp(N_pre_ff(x1)))
//                                                                            Gemma 2, Gemma 3
//   post     x1 = x + m*N_post_attn(attn(x));     y = x1 + m*N_post_ff(mlp(x1))    OLMo 2
//   parallel h = N_in(x); x1 = x + m*attn(h);     y = x1 + m*mlp(h)    (full blocks only)
//                               StableLM 2 12B / GPT-NeoX use_parallel_residual, one norm
// m = residual_multiplier (the multiply is skipped when it is 1).
enum NormPlacement : int { kNormPre = 0, kNormSandwich = 1, kNormPost = 2, kNormParallel = 3 };

// Which halves the block has, each with its own norm(s) and residual add:
//   full            attention half then MLP half (a decoder layer)
//   attention_only  the attention half only (Nemotron-H attention layers)
//   mlp_only        the MLP half only (Nemotron-H MLP layers; the dense half of a Granite-4.0-H
//                   layer, after its Mamba-2 half); no K/V cache, no positions
enum BlockParts : int { kBlockFull = 0, kBlockAttentionOnly = 1, kBlockMlpOnly = 2 };

// The span of the q/k norms (kind and eps of the block norm):
//   head              each head over head_dim, one (head_dim,) weight shared by the heads
//                     (Qwen3, Gemma 3)
//   all_heads         q over all n_heads*head_dim values, k over all n_kv_heads*head_dim, one
//                     weight element per value (OLMo 2 q_norm/k_norm)
//   per_head_weights  each head over head_dim, each head its own weight row (StableLM 2
//                     StableLmLayerNormPerHead, norm = layernorm without bias)
enum QkNormScope : int { kQkNormHead = 0, kQkNormAllHeads = 1, kQkNormPerHeadWeights = 2 };

struct TransformerConfig {
  // Sizes, derived from the weight shapes (SPEC 4.2). An mlp_only block may leave the
  // attention sizes 0; an attention_only block may leave intermediate 0.
  int64_t d_model = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, intermediate = 0;
  BlockParts block_parts = kBlockFull;
  NormPlacement norm_placement = kNormPre;
  // Attention (SPEC 4.3 step 6): window 0 = causal; attn_softcap 0 = none.
  int64_t window = 0;
  double attn_softcap = 0.0;
  // Score scale s = (q.k) * scale: 0 = the float32 nearest head_dim^-1/2 (default); > 0 = this
  // binary64 value rounded to float32 once (Gemma 2/3: query_pre_attn_scalar^-1/2 computed in
  // binary64; Granite: attention_multiplier).
  double attn_scale = 0.0;
  // Both residual adds become x + branch * m (float32 m, one multiply then one add, not fused),
  // the branch being the sublayer's output after its post norm if any. HF Granite /
  // GraniteMoeHybrid residual_multiplier. 1 = plain add (no multiply).
  double residual_multiplier = 1.0;
  // RoPE (SPEC 4.4): the first rope_dim dims of each head rotate; rope_dim 0 = no rotation
  // (NoPE layers: SmolLM3 no_rope_layers, Nemotron-H, Granite-4.0-H attention).
  int64_t rope_dim = 0;
  double rope_theta = 10000.0;
  ops::RopeScaling rope_scaling = ops::kRopeDefault;
  // factor: linear / llama3 / yarn factor; longrope: the factor of its attention factor
  // (HF: max_position_embeddings / original_max_position_embeddings when not given).
  double rope_factor = 1.0, rope_low_freq_factor = 1.0, rope_high_freq_factor = 4.0;
  int64_t rope_original_max = 8192;  // original_max_position_embeddings (llama3, yarn, longrope)
  // yarn (HF _compute_yarn_parameters): beta_fast, beta_slow, truncate; mscale and
  // mscale_all_dim (0 = not given) for the attention factor.
  double rope_beta_fast = 32.0, rope_beta_slow = 1.0;
  bool rope_truncate = true;
  double rope_mscale = 0.0, rope_mscale_all_dim = 0.0;
  // yarn / longrope: the factor HF multiplies into cos and sin; 0 = derive it as HF does
  // (binary64, own log and sqrt), > 0 = this value. Rounded to float32 once.
  double rope_attention_factor = 0.0;
  // longrope (HF _compute_longrope_parameters): rope_dim/2 factors each; set 0 (short) and set 1
  // (long) tables are both built, the call picks one (TransformerCall::rope_set).
  std::vector<double> rope_short_factor, rope_long_factor;
  int64_t max_positions = 0;
  // Norms: the block norms' kind and epsilon (also the q/k norms'); LayerNorm biases.
  ops::NormKind norm = ops::kRmsNorm;
  double norm_eps = 1e-6;
  bool norm_bias = false;
  bool qk_norm = false;
  QkNormScope qk_norm_scope = kQkNormHead;
  // Projections and MLP.
  bool qkv_bias = false, o_bias = false;
  ops::MlpKind mlp = ops::kSwiGlu;
  bool mlp_bias = false;
  // Mixture of experts (SPEC 4.8, ops/moe.hpp): num_experts 0 = the dense MLP above. Else the
  // MLP half is the MoE MLP with experts of `intermediate` width and kind `mlp` (gated, no
  // biases), num_experts_per_tok chosen per token, norm_topk_prob renormalising their weights,
  // and a shared expert of width shared_intermediate (0 = none) with its sigmoid gate.
  int64_t num_experts = 0, num_experts_per_tok = 0;
  bool norm_topk_prob = false;
  ops::RouterKind router = ops::kRouterSoftmax;
  int64_t shared_intermediate = 0;
  // Storage, not arithmetic: whether the packer may pick a compact exact format (the bits are
  // those of float32 panels either way; tests build a block both ways and compare).
  bool compact_weights = true;
};

inline bool has_attention(const TransformerConfig& c) { return c.block_parts != kBlockMlpOnly; }
inline bool has_mlp(const TransformerConfig& c) { return c.block_parts != kBlockAttentionOnly; }

}  // namespace eb::blocks
