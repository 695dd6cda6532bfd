// exactblocks._core.mamba2_backward: the Mamba-2 block's backward (SPEC 7.5) as one typed
// entry point. The Python layer (exactblocks/mamba2/block.py) has validated every argument;
// this file only checks what would be memory-unsafe, allocates the zero-filled outputs and
// runs the kernel with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <optional>

#include "base/cancel.hpp"
#include "base/check.hpp"
#include "base/runtime.hpp"
#include "bindings/common.hpp"
#include "bindings/interrupts.hpp"
#include "blocks/mamba2/backward_call.hpp"
#include "blocks/mamba2/model.hpp"
#include "blocks/stack.hpp"
#include "dispatch/kernel_table.hpp"

namespace eb::bindings {

void bind_mamba2_backward(nb::module_& m) {
  // Returns (dx, {short weight name: gradient}); conv1d.weight's gradient is (conv_dim,
  // conv_kernel). naive: the kernels' plain twins (tests).
  m.def(
      "mamba2_backward",
      [](const blocks::Mamba2Model& mdl, CArr3 x, CArr3 grad_output, IArr lengths, bool naive) {
        const blocks::Mamba2Config& c = mdl.cfg;
        const auto B = static_cast<int64_t>(x.shape(0)), L = static_cast<int64_t>(x.shape(1));
        EB_CHECK(static_cast<int64_t>(x.shape(2)) == c.d_model, "x last dim != d_model");
        EB_CHECK(grad_output.shape(0) == x.shape(0) && grad_output.shape(1) == x.shape(1) &&
                     grad_output.shape(2) == x.shape(2),
                 "grad_output shape != x shape");
        EB_CHECK(static_cast<int64_t>(lengths.shape(0)) == B, "lengths must have batch entries");
        for (int64_t b = 0; b < B; ++b)
          EB_CHECK(lengths.data()[b] >= 0 && lengths.data()[b] <= L, "lengths out of range");
        const auto n_in = static_cast<size_t>(mdl.w_in.n_out);
        const auto d = static_cast<size_t>(c.d_model), di = static_cast<size_t>(c.d_inner);
        const auto nh = static_cast<size_t>(c.n_heads), cd = static_cast<size_t>(c.conv_dim);
        const auto K = static_cast<size_t>(c.conv_kernel);
        OutArr dx = new_array({static_cast<size_t>(B), static_cast<size_t>(L), d});
        nb::dict grads;
        const auto add = [&](const char* name, std::initializer_list<size_t> shape) {
          OutArr a = new_array(shape);
          grads[name] = a;
          return a.data();
        };
        blocks::Mamba2BackwardCall call{};
        call.x = x.data();
        call.gy = grad_output.data();
        call.batch = B;
        call.n_tokens = L;
        call.lengths = lengths.data();
        call.dx = dx.data();
        call.d_block_norm_w = add("block_norm.weight", {d});
        call.d_in_w = add("in_proj.weight", {n_in, d});
        call.d_in_b = c.proj_bias ? add("in_proj.bias", {n_in}) : nullptr;
        call.d_conv_w = add("conv1d.weight", {cd, K});
        call.d_conv_b = c.conv_bias ? add("conv1d.bias", {cd}) : nullptr;
        call.d_dt_bias = add("dt_bias", {nh});
        call.d_a_log = add("A_log", {nh});
        call.d_d = add("D", {nh});
        call.d_norm_w = add("norm.weight", {di});
        call.d_out_w = add("out_proj.weight", {d, di});
        call.d_out_b = c.proj_bias ? add("out_proj.bias", {d}) : nullptr;
        call.n_threads = runtime::num_threads();
        call.naive = naive;
        // Ctrl-C stops a long backward as it stops a forward (SPEC 2.5): the call writes only
        // into the arrays made above, so a stop has nothing to roll back. Its cost is about three
        // forwards (the recompute, then the adjoint's products and scan).
        int64_t tokens = 0;
        for (int64_t b = 0; b < B; ++b) tokens += lengths.data()[b];
        SignalPoll poll(3.0 * blocks::mamba2_flops(mdl, static_cast<double>(tokens)));
        bool stopped = false;
        {
          nb::gil_scoped_release release;
          try {
            std::optional<cancel::Watch> watch;
            if (poll.watched()) watch.emplace(poll.poller(), cancel::estimate_ns(poll.flops()));
            kernels().mamba2_backward(mdl, call);
          } catch (const cancel::Stopped&) {
            stopped = true;
          }
        }
        if (stopped) poll.raise();
        return nb::make_tuple(dx, grads);
      },
      nb::arg("core"), nb::arg("x"), nb::arg("grad_output"), nb::arg("lengths"),
      nb::arg("naive") = false);
}

}  // namespace eb::bindings
