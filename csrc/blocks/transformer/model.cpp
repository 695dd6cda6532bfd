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

}  // namespace

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
    if (ops::mlp_is_gated(c.mlp)) {
      w_gu = ops::pack_sources(
          {need_matrix(w, "gate_proj.weight", it), need_matrix(w, "up_proj.weight", it)}, d,
          {maybe_weight(w, "gate_proj.bias"), maybe_weight(w, "up_proj.bias")}, c.compact_weights);
    } else {
      w_gu = ops::pack_sources({need_matrix(w, "up_proj.weight", it)}, d,
                               {maybe_weight(w, "up_proj.bias")}, c.compact_weights);
    }
    w_down = ops::pack_sources({need_matrix(w, "down_proj.weight", d)}, it,
                               {maybe_weight(w, "down_proj.bias")}, c.compact_weights);
  }
}

}  // namespace eb::blocks
