// TransformerModel construction: copy and pack the weights once (SPEC 2.1: the caller's
// arrays are never kept), build the RoPE tables and the (1 + w) norm weights. Which weights
// each block shape needs: config.hpp.
#include "blocks/transformer/model.hpp"

#include <cmath>

#include "base/check.hpp"
#include "base/fpenv.hpp"
#include "blocks/weight_map.hpp"
#include "ops/norm.hpp"
#include "ops/rope.hpp"

namespace eb::blocks {
namespace {

std::vector<float> norm_weight(const float* w, int64_t n, ops::NormKind kind) {
  std::vector<float> out(w, w + n);
  if (kind == ops::kRmsNormOffset)
    for (float& v : out) v = 1.0f + v;  // GemmaRMSNorm scales by (1 + w): rounded once, here
  return out;
}

BlockNorm block_norm(const WeightMap& w, const std::string& name, const TransformerConfig& c) {
  BlockNorm n;
  n.w = norm_weight(need_weight(w, name + ".weight"), c.d_model, c.norm);
  if (c.norm_bias) {
    const float* b = need_weight(w, name + ".bias");
    n.b.assign(b, b + c.d_model);
  }
  return n;
}

void build_rope(TransformerModel& m, const TransformerConfig& c) {
  const int64_t half = c.rope_dim / 2;
  m.inv_freq.assign(static_cast<size_t>(half + 1), 0.0f);
  double factor = 1.0;  // the attention factor on cos and sin (yarn, longrope)
  if (c.rope_scaling == ops::kRopeYarn) {
    ops::rope_yarn_inv_freq(c.rope_dim, c.rope_theta, c.rope_factor, c.rope_beta_fast,
                            c.rope_beta_slow, static_cast<double>(c.rope_original_max),
                            c.rope_truncate, m.inv_freq.data());
    factor = ops::rope_yarn_attention_factor(c.rope_factor, c.rope_mscale, c.rope_mscale_all_dim);
  } else if (c.rope_scaling == ops::kRopeLongrope) {
    EB_CHECK(static_cast<int64_t>(c.rope_short_factor.size()) == half &&
                 static_cast<int64_t>(c.rope_long_factor.size()) == half,
             "longrope needs rope_dim/2 short and long factors");
    m.inv_freq_long.assign(static_cast<size_t>(half + 1), 0.0f);
    ops::rope_longrope_inv_freq(c.rope_dim, c.rope_theta, c.rope_short_factor.data(),
                                m.inv_freq.data());
    ops::rope_longrope_inv_freq(c.rope_dim, c.rope_theta, c.rope_long_factor.data(),
                                m.inv_freq_long.data());
    factor = ops::rope_longrope_attention_factor(c.rope_factor,
                                                 static_cast<double>(c.rope_original_max));
  } else {
    ops::rope_inv_freq(c.rope_dim, c.rope_theta, c.rope_scaling, c.rope_factor,
                       c.rope_low_freq_factor, c.rope_high_freq_factor,
                       static_cast<double>(c.rope_original_max), m.inv_freq.data());
  }
  if (c.rope_scaling == ops::kRopeYarn || c.rope_scaling == ops::kRopeLongrope) {
    if (c.rope_attention_factor > 0.0) factor = c.rope_attention_factor;
    m.rope_factor = static_cast<float>(factor);  // rounded once, under the guard
  }
}

// Expert e's slice of a stacked (E, rows, k_in) tensor: float32 rows, or GGUF blocks.
ops::MatrixSource expert_slice(const WeightMap& w, const std::string& name, int64_t e, int64_t rows,
                               int64_t k_in) {
  ops::MatrixSource s = need_matrix(w, name, rows);
  if (s.blocks != nullptr) {
    const int64_t row_bytes = k_in / ops::ggml_block_size(s.type) * ops::ggml_type_size(s.type);
    s.blocks += e * rows * row_bytes;
  } else {
    s.f32 += e * rows * k_in;
  }
  return s;
}

void pack_moe(TransformerModel& m, const WeightMap& w, const TransformerConfig& c) {
  const int64_t d = c.d_model, it = c.intermediate, n_e = c.num_experts;
  EB_CHECK(ops::mlp_is_gated(c.mlp) && !c.mlp_bias, "MoE experts are gated MLPs without biases");
  EB_CHECK(c.num_experts_per_tok >= 1 && c.num_experts_per_tok <= n_e, "bad num_experts_per_tok");
  const bool cw = c.compact_weights;
  m.w_router = ops::pack_sources({need_matrix(w, "router.weight", n_e)}, d, {nullptr}, cw);
  m.w_exp_gu.reserve(static_cast<size_t>(n_e));
  m.w_exp_down.reserve(static_cast<size_t>(n_e));
  for (int64_t e = 0; e < n_e; ++e) {
    // expert e's [gate_e; up_e]: rows [2 e IT, 2 (e + 1) IT) of the stack, one matrix
    m.w_exp_gu.push_back(ops::pack_sources({expert_slice(w, "experts.gate_up_proj", e, 2 * it, d)},
                                           d, {nullptr}, cw));
    m.w_exp_down.push_back(
        ops::pack_sources({expert_slice(w, "experts.down_proj", e, d, it)}, it, {nullptr}, cw));
  }
  const int64_t sit = c.shared_intermediate;
  if (sit > 0) {
    m.w_sh_gu = ops::pack_sources({need_matrix(w, "shared_expert.gate_proj.weight", sit),
                                   need_matrix(w, "shared_expert.up_proj.weight", sit)},
                                  d, {nullptr, nullptr}, cw);
    m.w_sh_down = ops::pack_sources({need_matrix(w, "shared_expert.down_proj.weight", d)}, sit,
                                    {nullptr}, cw);
    m.w_sh_gate =
        ops::pack_sources({need_matrix(w, "shared_expert_gate.weight", 1)}, d, {nullptr}, cw);
  }
}

}  // namespace

ops::MoeMlp TransformerModel::moe_mlp() const {
  ops::MoeMlp e;
  e.router = &w_router;
  e.gu = w_exp_gu.data();
  e.down = w_exp_down.data();
  e.n_experts = cfg.num_experts;
  e.top_k = cfg.num_experts_per_tok;
  e.d = cfg.d_model;
  e.it = cfg.intermediate;
  e.mlp = cfg.mlp;
  e.router_kind = cfg.router;
  e.norm_topk = cfg.norm_topk_prob;
  if (cfg.shared_intermediate > 0) {
    e.shared_gu = &w_sh_gu;
    e.shared_down = &w_sh_down;
    e.shared_gate = &w_sh_gate;
    e.it_shared = cfg.shared_intermediate;
  }
  return e;
}

TransformerModel::TransformerModel(const TransformerConfig& c, const WeightMap& w) : cfg(c) {
  FpEnvGuard guard;  // the RoPE table, (1 + w) and the packer's checks: the caller's FTZ/rounding
                     // mode must not change them (SPEC 3.2)
  const bool attn = has_attention(c), mlp = has_mlp(c);
  const NormPlacement np = c.norm_placement;
  EB_CHECK(np != kNormParallel || c.block_parts == kBlockFull,
           "the parallel placement needs a full block");
  const int64_t d = c.d_model;
  norm_eps = static_cast<float>(c.norm_eps);  // rounded to nearest under the guard
  residual_mult = static_cast<float>(c.residual_multiplier);
  if (attn) {
    EB_CHECK(c.n_heads > 0 && c.n_kv_heads > 0 && c.n_heads % c.n_kv_heads == 0, "bad head counts");
    EB_CHECK(c.rope_dim >= 0 && c.rope_dim % 2 == 0 && c.rope_dim <= c.head_dim, "bad rope_dim");
    const int64_t hd = c.head_dim, qw = c.n_heads * hd, kw = c.n_kv_heads * hd;
    attn_scale = c.attn_scale > 0.0 ? static_cast<float>(c.attn_scale)
                                    : static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
    attn_softcap = static_cast<float>(c.attn_softcap);
    build_rope(*this, c);
    if (np != kNormPost) n_attn_in = block_norm(w, "input_layernorm", c);
    if (np == kNormSandwich || np == kNormPost)
      n_attn_out = block_norm(w, "post_attention_layernorm", c);
    if (c.qk_norm) {
      int64_t nq = hd, nk = hd;  // kQkNormHead: one row shared by the heads
      if (c.qk_norm_scope != kQkNormHead) nq = qw, nk = kw;
      q_norm_w = norm_weight(need_weight(w, "q_norm.weight"), nq, c.norm);
      k_norm_w = norm_weight(need_weight(w, "k_norm.weight"), nk, c.norm);
    }
    w_qkv =
        ops::pack_sources({need_matrix(w, "q_proj.weight", qw), need_matrix(w, "k_proj.weight", kw),
                           need_matrix(w, "v_proj.weight", kw)},
                          d,
                          {maybe_weight(w, "q_proj.bias"), maybe_weight(w, "k_proj.bias"),
                           maybe_weight(w, "v_proj.bias")},
                          c.compact_weights);
    w_o = ops::pack_sources({need_matrix(w, "o_proj.weight", d)}, qw,
                            {maybe_weight(w, "o_proj.bias")}, c.compact_weights);
  }
  if (mlp) {
    const int64_t it = c.intermediate;
    EB_CHECK(it > 0, "bad intermediate");
    // parallel: the MLP reads the attention's input norm (n_attn_in), no norm of its own
    if (np == kNormPre) n_mlp_in = block_norm(w, "post_attention_layernorm", c);
    if (np == kNormSandwich) n_mlp_in = block_norm(w, "pre_feedforward_layernorm", c);
    if (np == kNormSandwich || np == kNormPost)
      n_mlp_out = block_norm(w, "post_feedforward_layernorm", c);
    if (c.num_experts > 0) {
      pack_moe(*this, w, c);
    } else if (ops::mlp_is_gated(c.mlp)) {
      w_gu = ops::pack_sources(
          {need_matrix(w, "gate_proj.weight", it), need_matrix(w, "up_proj.weight", it)}, d,
          {maybe_weight(w, "gate_proj.bias"), maybe_weight(w, "up_proj.bias")}, c.compact_weights);
    } else {
      w_gu = ops::pack_sources({need_matrix(w, "up_proj.weight", it)}, d,
                               {maybe_weight(w, "up_proj.bias")}, c.compact_weights);
    }
    if (c.num_experts == 0)
      w_down = ops::pack_sources({need_matrix(w, "down_proj.weight", d)}, it,
                                 {maybe_weight(w, "down_proj.bias")}, c.compact_weights);
  }
}

}  // namespace eb::blocks
