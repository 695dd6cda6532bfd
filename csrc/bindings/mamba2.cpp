// _core.Mamba2Core: one Mamba-2 mixer block built from its typed config (configs.cpp) and its
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
#include "blocks/mamba2/model.hpp"
#include "blocks/stack.hpp"
#include "dispatch/kernel_table.hpp"

namespace eb::bindings {
namespace {

using blocks::Mamba2Call;
using blocks::Mamba2Config;
using blocks::Mamba2Model;

// The packed matrix a core stores under `name` (the names of weight_storage).
const ops::PackedMatrix& packed_by_name(const Mamba2Model& t, const std::string& name) {
  if (name == "in_proj") return t.w_in;
  if (name == "out_proj") return t.w_out;
  throw nb::value_error(("no packed matrix " + name).c_str());
}

}  // namespace

void bind_mamba2(nb::module_& m) {
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
      // start, row_tokens: the state's counters before the call and the array they live in,
      // set to start + lengths after conv_window and h in the same native step; None for a
      // state-less call.
      .def(
          "forward",
          [](const Mamba2Model& mdl,
             nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu> x, IArr lengths,
             MArr conv_window, MArr h, Workspace* ws, bool check_state, std::optional<IArr> start,
             std::optional<IOut> row_tokens, UndoLog* undo) -> nb::object {
            const int64_t B = static_cast<int64_t>(x.shape(0)),
                          L = static_cast<int64_t>(x.shape(1));
            const Mamba2Config& c = mdl.cfg;
            EB_CHECK(static_cast<int64_t>(x.shape(2)) == c.d_model, "x last dim != d_model");
            check_rows(lengths, B, "lengths");
            EB_CHECK(start.has_value() == row_tokens.has_value(),
                     "start and row_tokens go together");
            if (row_tokens) {
              check_rows(*start, B, "start");
              EB_CHECK(static_cast<int64_t>(row_tokens->shape(0)) == B,
                       "row_tokens must have batch entries");
            }
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
            OutArr y = new_output(B, L, c.d_model);
            nb::object out = nb::cast(y);  // before the call: nothing can fail after the commit
            int state_bad = 0;
            const int64_t tokens = total_tokens(lengths);
            int64_t advancing = 0;
            for (int64_t b = 0; b < B; ++b) advancing += lengths.data()[b] > 0;
            runtime::CallScratch scratch(ws);
            SignalPoll poll(blocks::mamba2_flops(mdl, static_cast<double>(tokens)));
            // A long call that may be stopped saves what it overwrites in an undo log of its
            // own, unless it writes into the caller's (a whole-model call).
            UndoLog own_undo;
            UndoLog* saving = undo;
            if (saving == nullptr && poll.watched() && tokens >= kSaveMinTokensPerRow * advancing)
              saving = &own_undo;
            Mamba2Call call{x.data(),
                            y.data(),
                            B,
                            L,
                            lengths.data(),
                            conv_window.data(),
                            h.data(),
                            runtime::num_threads(),
                            scratch.get(),
                            check_state ? &state_bad : nullptr,
                            saving};
            IOut* rt = row_tokens ? &*row_tokens : nullptr;
            run_kernel(ws, call.ws, tokens, poll, saving, [&] {
              if (undo != nullptr && rt != nullptr)
                undo->add_saved(rt->data(), static_cast<size_t>(B));
              kernels().mamba2_forward(mdl, call);
              if (!state_bad && rt) commit_counters(rt, *start, lengths, B);
            });
            if (state_bad) return nb::none();  // a read state value is not finite; untouched
            return out;
          },
          nb::arg("x"), nb::arg("lengths"), nb::arg("conv_window"), nb::arg("h"),
          nb::arg("workspace").none() = nb::none(), nb::arg("check_state") = false,
          nb::arg("start").none() = nb::none(), nb::arg("row_tokens").none() = nb::none(),
          nb::arg("undo").none() = nb::none());
}

}  // namespace eb::bindings
