// TransformerModel construction: copy and pack the weights once (SPEC 2.1: the caller's
// arrays are never kept), build the RoPE table and the (1 + w) norm weights.
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

}  // namespace

TransformerModel::TransformerModel(const TransformerConfig& c, const WeightMap& w) : cfg(c) {
  FpEnvGuard guard;  // the RoPE table, (1 + w) and the packer's checks: the caller's FTZ/rounding
                     // mode must not change them (SPEC 3.2)
  EB_CHECK(c.n_heads > 0 && c.n_kv_heads > 0 && c.n_heads % c.n_kv_heads == 0, "bad head counts");
  EB_CHECK(c.rope_dim % 2 == 0 && c.rope_dim <= c.head_dim, "bad rope_dim");
  const int64_t d = c.d_model, qw = c.n_heads * c.head_dim, kw = c.n_kv_heads * c.head_dim;
  const int64_t it = c.intermediate;
  attn_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  norm_eps = static_cast<float>(c.norm_eps);  // rounded to nearest under the guard
  attn_softcap = static_cast<float>(c.attn_softcap);
  inv_freq.assign(static_cast<size_t>(c.rope_dim / 2 + 1), 0.0f);
  ops::rope_inv_freq(c.rope_dim, c.rope_theta, c.rope_scaling, c.rope_factor,
                     c.rope_low_freq_factor, c.rope_high_freq_factor,
                     static_cast<double>(c.rope_original_max), inv_freq.data());
  norm_in_w = norm_weight(need_weight(w, "input_layernorm.weight"), d, c.norm);
  norm_post_w = norm_weight(need_weight(w, "post_attention_layernorm.weight"), d, c.norm);
  if (c.norm_bias) {
    const float* b1 = need_weight(w, "input_layernorm.bias");
    const float* b2 = need_weight(w, "post_attention_layernorm.bias");
    norm_in_b.assign(b1, b1 + d);
    norm_post_b.assign(b2, b2 + d);
  }
  if (c.qk_norm) {
    q_norm_w = norm_weight(need_weight(w, "q_norm.weight"), c.head_dim, c.norm);
    k_norm_w = norm_weight(need_weight(w, "k_norm.weight"), c.head_dim, c.norm);
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

}  // namespace eb::blocks
