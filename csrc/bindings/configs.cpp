// The typed configs of the two blocks (blocks/*/config.hpp) and the enums their fields take.
// Python fills a config in one place (exactblocks/{transformer,mamba2}/config.py) and builds a
// core from it (transformer.cpp, mamba2.cpp).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings/common.hpp"
#include "blocks/mamba2/config.hpp"
#include "blocks/transformer/config.hpp"

namespace eb::bindings {
namespace {

using blocks::Mamba2Config;
using blocks::TransformerConfig;

void bind_kinds(nb::module_& m) {
  nb::enum_<ops::NormKind>(m, "NormKind")
      .value("rmsnorm", ops::kRmsNorm)
      .value("layernorm", ops::kLayerNorm)
      .value("rmsnorm_offset", ops::kRmsNormOffset);
  nb::enum_<ops::MlpKind>(m, "MlpKind")
      .value("swiglu", ops::kSwiGlu)
      .value("geglu", ops::kGeGlu)
      .value("geglu_tanh", ops::kGeGluTanh)
      .value("gelu", ops::kGelu)
      .value("gelu_tanh", ops::kGeluTanh)
      .value("relu2", ops::kRelu2);
  nb::enum_<ops::RopeScaling>(m, "RopeScaling")
      .value("default", ops::kRopeDefault)
      .value("linear", ops::kRopeLinear)
      .value("llama3", ops::kRopeLlama3)
      .value("yarn", ops::kRopeYarn)
      .value("longrope", ops::kRopeLongrope);
  nb::enum_<blocks::NormPlacement>(m, "NormPlacement")
      .value("pre", blocks::kNormPre)
      .value("sandwich", blocks::kNormSandwich)
      .value("post", blocks::kNormPost)
      .value("parallel", blocks::kNormParallel);
  nb::enum_<blocks::BlockParts>(m, "BlockParts")
      .value("full", blocks::kBlockFull)
      .value("attention_only", blocks::kBlockAttentionOnly)
      .value("mlp_only", blocks::kBlockMlpOnly);
  nb::enum_<blocks::QkNormScope>(m, "QkNormScope")
      .value("head", blocks::kQkNormHead)
      .value("all_heads", blocks::kQkNormAllHeads)
      .value("per_head_weights", blocks::kQkNormPerHeadWeights);
}

// Every field under its C++ name; Python reads and writes them as attributes.
void bind_config_classes(nb::module_& m) {
  nb::class_<TransformerConfig>(m, "TransformerConfig")
      .def(nb::init<>())
      .def_rw("d_model", &TransformerConfig::d_model)
      .def_rw("n_heads", &TransformerConfig::n_heads)
      .def_rw("n_kv_heads", &TransformerConfig::n_kv_heads)
      .def_rw("head_dim", &TransformerConfig::head_dim)
      .def_rw("intermediate", &TransformerConfig::intermediate)
      .def_rw("block_parts", &TransformerConfig::block_parts)
      .def_rw("norm_placement", &TransformerConfig::norm_placement)
      .def_rw("window", &TransformerConfig::window)
      .def_rw("attn_softcap", &TransformerConfig::attn_softcap)
      .def_rw("attn_scale", &TransformerConfig::attn_scale)
      .def_rw("residual_multiplier", &TransformerConfig::residual_multiplier)
      .def_rw("rope_dim", &TransformerConfig::rope_dim)
      .def_rw("rope_theta", &TransformerConfig::rope_theta)
      .def_rw("rope_scaling", &TransformerConfig::rope_scaling)
      .def_rw("rope_factor", &TransformerConfig::rope_factor)
      .def_rw("rope_low_freq_factor", &TransformerConfig::rope_low_freq_factor)
      .def_rw("rope_high_freq_factor", &TransformerConfig::rope_high_freq_factor)
      .def_rw("rope_original_max", &TransformerConfig::rope_original_max)
      .def_rw("rope_beta_fast", &TransformerConfig::rope_beta_fast)
      .def_rw("rope_beta_slow", &TransformerConfig::rope_beta_slow)
      .def_rw("rope_truncate", &TransformerConfig::rope_truncate)
      .def_rw("rope_mscale", &TransformerConfig::rope_mscale)
      .def_rw("rope_mscale_all_dim", &TransformerConfig::rope_mscale_all_dim)
      .def_rw("rope_attention_factor", &TransformerConfig::rope_attention_factor)
      .def_rw("rope_short_factor", &TransformerConfig::rope_short_factor)
      .def_rw("rope_long_factor", &TransformerConfig::rope_long_factor)
      .def_rw("max_positions", &TransformerConfig::max_positions)
      .def_rw("norm", &TransformerConfig::norm)
      .def_rw("norm_eps", &TransformerConfig::norm_eps)
      .def_rw("norm_bias", &TransformerConfig::norm_bias)
      .def_rw("qk_norm", &TransformerConfig::qk_norm)
      .def_rw("qk_norm_scope", &TransformerConfig::qk_norm_scope)
      .def_rw("qkv_bias", &TransformerConfig::qkv_bias)
      .def_rw("o_bias", &TransformerConfig::o_bias)
      .def_rw("mlp", &TransformerConfig::mlp)
      .def_rw("mlp_bias", &TransformerConfig::mlp_bias)
      .def_rw("num_experts", &TransformerConfig::num_experts)
      .def_rw("num_experts_per_tok", &TransformerConfig::num_experts_per_tok)
      .def_rw("norm_topk_prob", &TransformerConfig::norm_topk_prob)
      .def_rw("shared_intermediate", &TransformerConfig::shared_intermediate)
      .def_rw("compact_weights", &TransformerConfig::compact_weights);
  nb::class_<Mamba2Config>(m, "Mamba2Config")
      .def(nb::init<>())
      .def_rw("d_model", &Mamba2Config::d_model)
      .def_rw("d_inner", &Mamba2Config::d_inner)
      .def_rw("n_heads", &Mamba2Config::n_heads)
      .def_rw("head_dim", &Mamba2Config::head_dim)
      .def_rw("d_state", &Mamba2Config::d_state)
      .def_rw("n_groups", &Mamba2Config::n_groups)
      .def_rw("conv_dim", &Mamba2Config::conv_dim)
      .def_rw("conv_kernel", &Mamba2Config::conv_kernel)
      .def_rw("norm_eps", &Mamba2Config::norm_eps)
      .def_rw("dt_min", &Mamba2Config::dt_min)
      .def_rw("dt_max", &Mamba2Config::dt_max)
      .def_rw("conv_bias", &Mamba2Config::conv_bias)
      .def_rw("proj_bias", &Mamba2Config::proj_bias)
      .def_rw("compact_weights", &Mamba2Config::compact_weights);
}

}  // namespace

void bind_configs(nb::module_& m) {
  bind_kinds(m);
  bind_config_classes(m);
}

}  // namespace eb::bindings
