// HeadModel construction: copy the final norm's weights ((1 + w) rounded once for the Gemma
// norm, as the blocks do) and pack the vocabulary projection once (SPEC 2.1: the caller's
// arrays are never kept).
#include "blocks/head/model.hpp"

#include "base/check.hpp"
#include "base/fpenv.hpp"
#include "math/tanh.hpp"

namespace eb::blocks {

HeadModel::HeadModel(const HeadConfig& c, const float* norm_weight, const float* norm_bias,
                     ops::MatrixSource head_weight)
    : cfg(c) {
  // eps, (1 + w) and the packer's checks: the caller's FP mode must not move them (SPEC 3.2)
  FpEnvGuard guard;
  EB_CHECK(c.d_model > 0 && c.vocab_size > 0, "head sizes must be positive");
  EB_CHECK(norm_weight != nullptr && (head_weight.f32 != nullptr || head_weight.blocks != nullptr),
           "head weights missing");
  EB_CHECK(c.norm_bias == (norm_bias != nullptr), "norm_bias flag and bias array disagree");
  norm_eps = static_cast<float>(c.norm_eps);
  EB_CHECK(c.logits_scaling > 0.0 && c.logit_softcap >= 0.0,
           "logits_scaling must be > 0 and logit_softcap >= 0");
  logits_scaling = static_cast<float>(c.logits_scaling);
  logit_softcap = static_cast<float>(c.logit_softcap);
  EB_CHECK(logits_scaling > 0.0f && logits_scaling <= 3.4e38f && logit_softcap <= 3.4e38f &&
               (c.logit_softcap == 0.0 || logit_softcap > 0.0f),
           "logits_scaling and logit_softcap must be finite and nonzero in float32");
  norm_w.assign(norm_weight, norm_weight + c.d_model);
  if (c.norm == ops::kRmsNormOffset)
    for (float& v : norm_w) v = 1.0f + v;  // GemmaRMSNorm scales by (1 + w): rounded once, here
  if (norm_bias) norm_b.assign(norm_bias, norm_bias + c.d_model);
  head_weight.rows = c.vocab_size;
  w_head = ops::pack_sources({head_weight}, c.d_model, {nullptr}, c.compact_weights);
}

void HeadModel::finish_logits(float* z, int64_t n) const {
  const float s = logits_scaling, c = logit_softcap;
  if (s != 1.0f)
    for (int64_t i = 0; i < n; ++i) z[i] = z[i] / s;
  if (c > 0.0f)
    for (int64_t i = 0; i < n; ++i) z[i] = math::tanh_f32(z[i] / c) * c;
}

}  // namespace eb::blocks
