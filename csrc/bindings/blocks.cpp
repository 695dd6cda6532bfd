// The two blocks and their typed configs (blocks/*/config.hpp). Python fills a config in one
// place (exactblocks/{transformer,mamba2}/config.py) and builds a core from it and the
// canonical weights; each call checks cheap invariants, builds the call struct and runs the
// kernel table's forward with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/check.hpp"
#include "base/fpenv.hpp"
#include "base/runtime.hpp"
#include "base/workspace.hpp"
#include "bindings/common.hpp"
#include "blocks/mamba2/model.hpp"
#include "blocks/transformer/model.hpp"
#include "dispatch/kernel_table.hpp"

namespace eb::bindings {
namespace {

using blocks::Mamba2Call;
using blocks::Mamba2Config;
using blocks::Mamba2Model;
using blocks::TransformerCall;
using blocks::TransformerConfig;
using blocks::TransformerModel;

using U8Arr = nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>;

// weights: name -> float32 array; blocks: name -> (ggml type, uint8 array of GGUF blocks) for
// projection matrices read straight from a GGUF file (their sizes were checked by Python).
WeightMap weight_map(const nb::dict& weights, const nb::dict& blocks, std::vector<CArr>& keep,
                     std::vector<nb::object>& keep_blocks) {
  WeightMap out;
  for (auto [k, v] : weights) {
    keep.push_back(nb::cast<CArr>(v, false));
    out.f32[nb::cast<std::string>(k)] = keep.back().data();
  }
  for (auto [k, v] : blocks) out.blocks[nb::cast<std::string>(k)] = matrix_source(v, keep_blocks);
  return out;
}

// The packed matrix a core stores under `name` (the names of weight_storage).
template <class Model>
const ops::PackedMatrix& packed_by_name(const Model& t, const std::string& name);

template <>
const ops::PackedMatrix& packed_by_name(const TransformerModel& t, const std::string& name) {
  if (name == "qkv_proj") return t.w_qkv;
  if (name == "o_proj") return t.w_o;
  if (name == "gate_up_proj" || name == "up_proj") return t.w_gu;
  if (name == "down_proj") return t.w_down;
  throw nb::value_error(("no packed matrix " + name).c_str());
}

template <>
const ops::PackedMatrix& packed_by_name(const Mamba2Model& t, const std::string& name) {
  if (name == "in_proj") return t.w_in;
  if (name == "out_proj") return t.w_out;
  throw nb::value_error(("no packed matrix " + name).c_str());
}

void check_rows(const IArr& a, int64_t batch, const char* name) {
  EB_CHECK(static_cast<int64_t>(a.shape(0)) == batch,
           std::string(name) + " must have batch entries");
}

nb::list storage_list(
    std::initializer_list<std::pair<const char*, const ops::PackedMatrix*>> items) {
  nb::list out;
  for (const auto& [name, pm] : items)
    out.append(nb::make_tuple(std::string(name), std::string(pm->format_name()), pm->bytes()));
  return out;
}

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
void bind_configs(nb::module_& m) {
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

OutArr unpack_array(const ops::PackedMatrix& w, int64_t r0, int64_t r1) {
  EB_CHECK(0 <= r0 && r0 <= r1 && r1 <= w.n_out, "unpack: rows out of range");
  OutArr y = new_array({static_cast<size_t>(r1 - r0), static_cast<size_t>(w.k_in)});
  nb::gil_scoped_release release;
  ops::unpack_rows(w, r0, r1, y.data());
  return y;
}

ops::MatrixSource matrix_source(const nb::handle& value, std::vector<nb::object>& keep) {
  ops::MatrixSource s;
  if (nb::isinstance<nb::tuple>(value)) {
    nb::tuple t = nb::cast<nb::tuple>(value);
    EB_CHECK(t.size() == 2, "GGUF blocks must be given as (ggml type, uint8 array)");
    s.type = nb::cast<int>(t[0]);
    EB_CHECK(ops::ggml_block_size(s.type) > 0, "unsupported GGUF block type");
    keep.push_back(nb::borrow(t[1]));
    s.blocks = nb::cast<U8Arr>(t[1], false).data();
  } else {
    keep.push_back(nb::borrow(value));
    s.f32 = nb::cast<CArr>(value, false).data();
  }
  return s;
}

void bind_blocks(nb::module_& m) {
  bind_kinds(m);
  bind_configs(m);
  // GGUF blocks -> float32 with gguf.quants' operations (the values the packer stores)
  m.def(
      "dequantize_gguf",
      [](int type, U8Arr blocks) {
        const int64_t bs = ops::ggml_block_size(type), ts = ops::ggml_type_size(type);
        EB_CHECK(bs > 0 && static_cast<int64_t>(blocks.size()) % ts == 0,
                 "dequantize_gguf: unsupported type, or a partial block");
        const int64_t n = static_cast<int64_t>(blocks.size()) / ts * bs;
        OutArr y = new_array({static_cast<size_t>(n)});
        nb::gil_scoped_release release;
        ops::dequantize_gguf(blocks.data(), type, n, y.data());
        return y;
      },
      nb::arg("type"), nb::arg("blocks"));
  // (weights per block, bytes per block) of a GGUF type the packer reads directly, or (0, 0)
  m.def("gguf_block_layout", [](int type) {
    return nb::make_tuple(ops::ggml_block_size(type), ops::ggml_type_size(type));
  });
  nb::class_<TransformerModel>(m, "TransformerCore")
      // [(matrix, format, bytes)] of the packed projections (ops/gemm/format.hpp PanelFormat)
      // [(matrix, format, bytes)] of the packed projections (ops/gemm/format.hpp PanelFormat);
      // a half block lists its own half's only.
      .def_prop_ro("weight_storage",
                   [](const TransformerModel& t) {
                     const char* gu = ops::mlp_is_gated(t.cfg.mlp) ? "gate_up_proj" : "up_proj";
                     if (!blocks::has_mlp(t.cfg))
                       return storage_list({{"qkv_proj", &t.w_qkv}, {"o_proj", &t.w_o}});
                     if (!blocks::has_attention(t.cfg))
                       return storage_list({{gu, &t.w_gu}, {"down_proj", &t.w_down}});
                     return storage_list({{"qkv_proj", &t.w_qkv},
                                          {"o_proj", &t.w_o},
                                          {gu, &t.w_gu},
                                          {"down_proj", &t.w_down}});
                   })
      // The float32 RoPE tables the block rotates with: (inv_freq per set, attention factor).
      // longrope: [short, long]; otherwise one set; no rotation: [[]].
      .def_prop_ro("rope_tables",
                   [](const TransformerModel& t) {
                     const int64_t half = blocks::has_attention(t.cfg) ? t.cfg.rope_dim / 2 : 0;
                     nb::list sets;
                     const auto add = [&](const std::vector<float>& v) {
                       sets.append(std::vector<float>(v.begin(), v.begin() + half));
                     };
                     add(t.inv_freq);
                     if (!t.inv_freq_long.empty()) add(t.inv_freq_long);
                     return nb::make_tuple(sets, t.rope_factor);
                   })
      // cfg: the typed config (copied); weights: canonical short names -> float32 arrays,
      // exactly the set the config needs. Real options become float32 in the constructor,
      // under the FP-environment guard.
      .def(
          "__init__",
          [](TransformerModel* self, const TransformerConfig& cfg, nb::dict weights,
             nb::dict blocks) {
            std::vector<CArr> keep;
            std::vector<nb::object> keep_blocks;
            const WeightMap w = weight_map(weights, blocks, keep, keep_blocks);
            nb::gil_scoped_release release;
            new (self) TransformerModel(cfg, w);
          },
          nb::arg("cfg"), nb::arg("weights"), nb::arg("blocks") = nb::dict())
      // rows [r0, r1) of a packed matrix (a weight_storage name) as float32, rebuilt with the
      // kernels' own operations: the weights it was built from, bit for bit
      .def(
          "unpack",
          [](const TransformerModel& t, const std::string& name, int64_t r0, int64_t r1) {
            return unpack_array(packed_by_name(t, name), r0, r1);
          },
          nb::arg("matrix"), nb::arg("r0"), nb::arg("r1"))
      .def_prop_ro("cfg", [](const TransformerModel& t) { return t.cfg; })
      // check_cache: check the slots each row reads (SPEC 5) while reading them; returns None,
      // with the cache untouched, when one is not finite (Python then names the element).
      // rope_set: longrope's table for this call, 0 = short, 1 = long (TransformerCall). An
      // mlp_only block ignores the caches (any float32 arrays, e.g. empty) and the positions.
      .def(
          "forward",
          [](const TransformerModel& mdl,
             nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu> x, IArr lengths,
             IArr start, MArr k_cache, MArr v_cache, Workspace* ws, bool check_cache,
             int rope_set) -> nb::object {
            const int64_t B = static_cast<int64_t>(x.shape(0)),
                          L = static_cast<int64_t>(x.shape(1));
            const TransformerConfig& c = mdl.cfg;
            EB_CHECK(static_cast<int64_t>(x.shape(2)) == c.d_model, "x last dim != d_model");
            check_rows(lengths, B, "lengths");
            check_rows(start, B, "start");
            EB_CHECK(rope_set == 0 || (rope_set == 1 && c.rope_scaling == ops::kRopeLongrope),
                     "rope_set must be 0, or 0 or 1 with longrope");
            const bool attn = blocks::has_attention(c);
            int64_t cap = 0;
            if (attn) {  // an MLP-only block reads no cache and no positions (caches ignored)
              EB_CHECK(k_cache.ndim() == 4 && v_cache.ndim() == 4, "cache rank");
              cap = static_cast<int64_t>(k_cache.shape(2));
              EB_CHECK(static_cast<int64_t>(k_cache.shape(0)) == B &&
                           static_cast<int64_t>(k_cache.shape(1)) == c.n_kv_heads &&
                           static_cast<int64_t>(k_cache.shape(3)) == c.head_dim && cap >= 0,
                       "k_cache shape");
              for (size_t i = 0; i < 4; ++i)
                EB_CHECK(k_cache.shape(i) == v_cache.shape(i), "v_cache shape");
              // capacity 0: a state-less call (nothing cached before, nothing kept after)
              for (int64_t b = 0; b < B && cap == 0; ++b)
                EB_CHECK(start.data()[b] == 0, "a call without a cache must start at position 0");
            }
            for (int64_t b = 0; b < B; ++b)
              EB_CHECK(lengths.data()[b] >= 0 && lengths.data()[b] <= L && start.data()[b] >= 0 &&
                           (!attn || start.data()[b] + lengths.data()[b] <= c.max_positions),
                       "lengths/start out of range");
            OutArr y = new_array(
                {static_cast<size_t>(B), static_cast<size_t>(L), static_cast<size_t>(c.d_model)});
            int cache_bad = 0;
            TransformerCall call{x.data(),
                                 y.data(),
                                 B,
                                 L,
                                 lengths.data(),
                                 start.data(),
                                 k_cache.data(),
                                 v_cache.data(),
                                 cap,
                                 runtime::num_threads(),
                                 runtime::call_workspace(ws),
                                 check_cache && attn ? &cache_bad : nullptr,
                                 rope_set};
            {
              nb::gil_scoped_release release;
              kernels().transformer_forward(mdl, call);
              runtime::trim_workspace(ws, call.ws);
            }
            if (cache_bad) return nb::none();  // a read slot is not finite; the cache is untouched
            return nb::cast(y);
          },
          nb::arg("x"), nb::arg("lengths"), nb::arg("start"), nb::arg("k_cache"),
          nb::arg("v_cache"), nb::arg("workspace").none() = nb::none(),
          nb::arg("check_cache") = false, nb::arg("rope_set") = 0);

  nb::class_<Mamba2Model>(m, "Mamba2Core")
      .def_prop_ro("weight_storage",
                   [](const Mamba2Model& t) {
                     return storage_list({{"in_proj", &t.w_in}, {"out_proj", &t.w_out}});
                   })
      // cfg: the typed config (copied); weights: canonical short names -> float32 arrays,
      // exactly the set the config needs. Real options become float32 in the constructor,
      // under the FP-environment guard.
      .def(
          "__init__",
          [](Mamba2Model* self, const Mamba2Config& cfg, nb::dict weights, nb::dict blocks) {
            std::vector<CArr> keep;
            std::vector<nb::object> keep_blocks;
            const WeightMap w = weight_map(weights, blocks, keep, keep_blocks);
            nb::gil_scoped_release release;
            new (self) Mamba2Model(cfg, w);
          },
          nb::arg("cfg"), nb::arg("weights"), nb::arg("blocks") = nb::dict())
      // rows [r0, r1) of a packed matrix (a weight_storage name) as float32, rebuilt with the
      // kernels' own operations: the weights it was built from, bit for bit
      .def(
          "unpack",
          [](const Mamba2Model& t, const std::string& name, int64_t r0, int64_t r1) {
            return unpack_array(packed_by_name(t, name), r0, r1);
          },
          nb::arg("matrix"), nb::arg("r0"), nb::arg("r1"))
      .def_prop_ro("cfg", [](const Mamba2Model& t) { return t.cfg; })
      // check_state: check what the call reads of each advancing row (SPEC 8) before writing;
      // returns None, with the state untouched, when a value is not finite.
      .def(
          "forward",
          [](const Mamba2Model& mdl,
             nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu> x, IArr lengths,
             MArr conv_window, MArr h, Workspace* ws, bool check_state) -> nb::object {
            const int64_t B = static_cast<int64_t>(x.shape(0)),
                          L = static_cast<int64_t>(x.shape(1));
            const Mamba2Config& c = mdl.cfg;
            EB_CHECK(static_cast<int64_t>(x.shape(2)) == c.d_model, "x last dim != d_model");
            check_rows(lengths, B, "lengths");
            EB_CHECK(conv_window.ndim() == 3 && static_cast<int64_t>(conv_window.shape(0)) == B &&
                         static_cast<int64_t>(conv_window.shape(1)) == c.conv_dim &&
                         static_cast<int64_t>(conv_window.shape(2)) == c.conv_kernel,
                     "conv_window shape");
            EB_CHECK(h.ndim() == 4 && static_cast<int64_t>(h.shape(0)) == B &&
                         static_cast<int64_t>(h.shape(1)) == c.n_heads &&
                         static_cast<int64_t>(h.shape(2)) == c.head_dim &&
                         static_cast<int64_t>(h.shape(3)) == c.d_state,
                     "h shape");
            for (int64_t b = 0; b < B; ++b)
              EB_CHECK(lengths.data()[b] >= 0 && lengths.data()[b] <= L, "lengths out of range");
            OutArr y = new_array(
                {static_cast<size_t>(B), static_cast<size_t>(L), static_cast<size_t>(c.d_model)});
            int state_bad = 0;
            Mamba2Call call{x.data(),
                            y.data(),
                            B,
                            L,
                            lengths.data(),
                            conv_window.data(),
                            h.data(),
                            runtime::num_threads(),
                            runtime::call_workspace(ws),
                            check_state ? &state_bad : nullptr};
            {
              nb::gil_scoped_release release;
              kernels().mamba2_forward(mdl, call);
              runtime::trim_workspace(ws, call.ws);
            }
            if (state_bad) return nb::none();  // a read state value is not finite; untouched
            return nb::cast(y);
          },
          nb::arg("x"), nb::arg("lengths"), nb::arg("conv_window"), nb::arg("h"),
          nb::arg("workspace").none() = nb::none(), nb::arg("check_state") = false);
}

}  // namespace eb::bindings
