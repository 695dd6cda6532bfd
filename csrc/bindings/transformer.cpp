// _core.TransformerCore: one decoder block built from its typed config (configs.cpp) and its
// canonical weights. Each call checks cheap invariants, builds the call struct and runs the
// kernel table's forward with the GIL released (call.hpp run_kernel).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "base/check.hpp"
#include "base/runtime.hpp"
#include "base/undo.hpp"
#include "base/workspace.hpp"
#include "bindings/call.hpp"
#include "bindings/common.hpp"
#include "bindings/interrupts.hpp"
#include "blocks/stack.hpp"
#include "blocks/transformer/model.hpp"
#include "dispatch/kernel_table.hpp"

namespace eb::bindings {
namespace {

using blocks::TransformerCall;
using blocks::TransformerConfig;
using blocks::TransformerModel;

// The packed matrix a core stores under `name` (the names of weight_storage).
const ops::PackedMatrix& packed_by_name(const TransformerModel& t, const std::string& name) {
  if (name == "qkv_proj") return t.w_qkv;
  if (name == "o_proj") return t.w_o;
  if (name == "gate_up_proj" || name == "up_proj") return t.w_gu;
  if (name == "down_proj") return t.w_down;
  if (name == "router") return t.w_router;  // MoE (moe_storage's names)
  if (name == "shared_expert.gate_up_proj") return t.w_sh_gu;
  if (name == "shared_expert.down_proj") return t.w_sh_down;
  if (name == "shared_expert_gate") return t.w_sh_gate;
  if (name.rfind("experts.", 0) == 0) {  // experts.<e>.gate_up_proj | experts.<e>.down_proj
    const size_t dot = name.find('.', 8);
    const std::string idx = name.substr(8, dot == std::string::npos ? 0 : dot - 8);
    const std::string leaf = dot == std::string::npos ? "" : name.substr(dot + 1);
    if (!idx.empty() && idx.find_first_not_of("0123456789") == std::string::npos) {
      const size_t e = std::stoul(idx);
      if (e < t.w_exp_gu.size() && leaf == "gate_up_proj") return t.w_exp_gu[e];
      if (e < t.w_exp_down.size() && leaf == "down_proj") return t.w_exp_down[e];
    }
  }
  throw nb::value_error(("no packed matrix " + name).c_str());
}

// weight_storage of an MoE block: the attention half's, the router's, then per expert e
// experts.e.gate_up_proj and experts.e.down_proj, then the shared expert's (when present).
nb::list moe_storage(const TransformerModel& t) {
  nb::list out = blocks::has_attention(t.cfg)
                     ? storage_list({{"qkv_proj", &t.w_qkv}, {"o_proj", &t.w_o}})
                     : nb::list();
  const auto add = [&](const std::string& name, const ops::PackedMatrix& pm) {
    for (nb::handle h : storage_list({{"", &pm}})) out.append(nb::make_tuple(name, h[1], h[2]));
  };
  add("router", t.w_router);
  for (size_t e = 0; e < t.w_exp_gu.size(); ++e) {
    add("experts." + std::to_string(e) + ".gate_up_proj", t.w_exp_gu[e]);
    add("experts." + std::to_string(e) + ".down_proj", t.w_exp_down[e]);
  }
  if (t.cfg.shared_intermediate > 0) {
    add("shared_expert.gate_up_proj", t.w_sh_gu);
    add("shared_expert.down_proj", t.w_sh_down);
    add("shared_expert_gate", t.w_sh_gate);
  }
  return out;
}

}  // namespace

void bind_transformer(nb::module_& m) {
  nb::class_<TransformerModel>(m, "TransformerCore")
      // [(matrix, format, bytes)] of the packed projections (ops/gemm/format.hpp PanelFormat);
      // a half block lists its own half's only.
      .def_prop_ro("weight_storage",
                   [](const TransformerModel& t) {
                     const char* gu = ops::mlp_is_gated(t.cfg.mlp) ? "gate_up_proj" : "up_proj";
                     if (t.moe()) return moe_storage(t);
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
      // row_tokens: the state's counters, set to start + lengths after the cache, in the same
      // native step (an interrupt cannot separate them); None for a state-less call.
      .def(
          "forward",
          [](const TransformerModel& mdl,
             nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu> x, IArr lengths,
             IArr start, MArr k_cache, MArr v_cache, Workspace* ws, bool check_cache, int rope_set,
             std::optional<IOut> row_tokens, UndoLog* undo) -> nb::object {
            const int64_t B = static_cast<int64_t>(x.shape(0)),
                          L = static_cast<int64_t>(x.shape(1));
            const TransformerConfig& c = mdl.cfg;
            EB_CHECK(static_cast<int64_t>(x.shape(2)) == c.d_model, "x last dim != d_model");
            check_rows(lengths, B, "lengths");
            check_rows(start, B, "start");
            EB_CHECK(rope_set == 0 || (rope_set == 1 && c.rope_scaling == ops::kRopeLongrope),
                     "rope_set must be 0, or 0 or 1 with longrope");
            if (row_tokens)
              EB_CHECK(static_cast<int64_t>(row_tokens->shape(0)) == B,
                       "row_tokens must have batch entries");
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
            OutArr y = new_output(B, L, c.d_model);
            nb::object out = nb::cast(y);  // before the call: nothing can fail after the commit
            int cache_bad = 0;
            runtime::CallScratch scratch(ws);
            SignalPoll poll(blocks::transformer_flops(mdl, lengths.data(), start.data(),
                                                      static_cast<int64_t>(lengths.shape(0))));
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
                                 scratch.get(),
                                 check_cache && attn ? &cache_bad : nullptr,
                                 rope_set,
                                 undo};
            IOut* rt = row_tokens ? &*row_tokens : nullptr;
            run_kernel(ws, call.ws, total_tokens(lengths), poll, undo, [&] {
              if (undo != nullptr && rt != nullptr)
                undo->add_saved(rt->data(), static_cast<size_t>(B));
              kernels().transformer_forward(mdl, call);
              if (!cache_bad) commit_counters(rt, start, lengths, B);
            });
            if (cache_bad) return nb::none();  // a read slot is not finite; the cache is untouched
            return out;
          },
          nb::arg("x"), nb::arg("lengths"), nb::arg("start"), nb::arg("k_cache"),
          nb::arg("v_cache"), nb::arg("workspace").none() = nb::none(),
          nb::arg("check_cache") = false, nb::arg("rope_set") = 0,
          nb::arg("row_tokens").none() = nb::none(), nb::arg("undo").none() = nb::none());
}

}  // namespace eb::bindings
