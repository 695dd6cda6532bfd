// Mamba2Model construction: copy and pack the weights once; A = -exp(A_log) with the
// library's own exp (SPEC 7.2). Conv weights are stored (conv_dim, conv_kernel).
#include "blocks/mamba2/model.hpp"

#include "base/check.hpp"
#include "base/fpenv.hpp"
#include "blocks/weight_map.hpp"
#include "math/exp.hpp"

namespace eb::blocks {
namespace {

std::vector<float> copy(const float* p, int64_t n) { return std::vector<float>(p, p + n); }

}  // namespace

Mamba2Model::Mamba2Model(const Mamba2Config& c, const WeightMap& w) : cfg(c) {
  FpEnvGuard guard;  // A = -exp(A_log) and the packer's checks ignore the caller's FP mode
  EB_CHECK(c.n_groups > 0 && c.n_heads % c.n_groups == 0 && c.d_inner % c.n_groups == 0,
           "bad n_groups");
  EB_CHECK(c.conv_dim == c.d_inner + 2 * c.n_groups * c.d_state, "bad conv_dim");
  norm_eps = static_cast<float>(c.norm_eps);  // rounded to nearest under the guard
  dt_min = static_cast<float>(c.dt_min);
  dt_max = static_cast<float>(c.dt_max);
  const int64_t n_in = c.d_inner + c.conv_dim + c.n_heads;
  block_norm_w = copy(need_weight(w, "block_norm.weight"), c.d_model);
  w_in = ops::pack_sources({need_matrix(w, "in_proj.weight", n_in)}, c.d_model,
                           {maybe_weight(w, "in_proj.bias")}, c.compact_weights);
  conv_w = copy(need_weight(w, "conv1d.weight"), c.conv_dim * c.conv_kernel);
  conv_w_t.resize(conv_w.size());
  for (int64_t ch = 0; ch < c.conv_dim; ++ch)
    for (int64_t k = 0; k < c.conv_kernel; ++k)
      conv_w_t[k * c.conv_dim + ch] = conv_w[ch * c.conv_kernel + k];
  if (const float* b = maybe_weight(w, "conv1d.bias")) conv_b = copy(b, c.conv_dim);
  dt_bias = copy(need_weight(w, "dt_bias"), c.n_heads);
  d = copy(need_weight(w, "D"), c.n_heads);
  const float* a_log = need_weight(w, "A_log");
  a.resize(static_cast<size_t>(c.n_heads));
  for (int64_t i = 0; i < c.n_heads; ++i) a[i] = -math::exp_f32(a_log[i]);
  gated_norm_w = copy(need_weight(w, "norm.weight"), c.d_inner);
  w_out = ops::pack_sources({need_matrix(w, "out_proj.weight", c.d_model)}, c.d_inner,
                            {maybe_weight(w, "out_proj.bias")}, c.compact_weights);
}

}  // namespace eb::blocks
