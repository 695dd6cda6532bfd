// _core.layer_stack: the layers of one model call in one native call (blocks/stack.hpp runs
// them). Here: the layers cast from the Python side's tuples, their buffers checked as the
// block's own call checks them, and each layer's call wrapped in the signal watch with the GIL
// released (call.hpp run_kernel), as its block's binding runs it.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <vector>

#include "base/runtime.hpp"
#include "base/state_lock.hpp"
#include "base/undo.hpp"
#include "base/workspace.hpp"
#include "bindings/call.hpp"
#include "bindings/common.hpp"
#include "bindings/interrupts.hpp"
#include "blocks/mamba2/model.hpp"
#include "blocks/stack.hpp"
#include "blocks/transformer/model.hpp"
#include "dispatch/kernel_table.hpp"

namespace eb::bindings {
namespace {

using blocks::Mamba2Model;
using blocks::StackLayer;
using blocks::TransformerModel;

// The shape of an array, as StackBuffers holds it.
template <class A>
std::vector<int64_t> shape_of(const A& a) {
  std::vector<int64_t> s(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) s[i] = static_cast<int64_t>(a.shape(i));
  return s;
}

// Casts layer `h` of a stack call: a transformer layer's tuple (core, lock, k_cache, v_cache,
// row_tokens, max_tokens, rope_set, n_kv_heads, capacity, head_dim) of a state the Python side
// found to belong to the core's configuration, or a Mamba-2 layer's (core, lock, conv_window,
// h, row_tokens). The arrays are taken as they are (never a converted copy: float32 / int64,
// C-contiguous, writable) and checked by blocks/stack.cpp as the block's own call checks them:
// false, with nothing done, when anything is off (the block's own call then raises the error).
bool stack_layer(nb::handle h, int64_t B, int64_t d, StackLayer& out) {
  nb::tuple t;
  if (!nb::try_cast(h, t, false) || (t.size() != 5 && t.size() != 10)) return false;
  StateLock* lock = nullptr;
  if (!nb::try_cast(t[1], lock, false) || lock == nullptr) return false;
  MArr a, b;
  IOut rt;
  if (!nb::try_cast(t[2], a, false) || !nb::try_cast(t[3], b, false) ||
      !nb::try_cast(t[4], rt, false))
    return false;
  blocks::StackBuffers buf;
  buf.a = a.data();
  buf.a_shape = shape_of(a);
  buf.b = b.data();
  buf.b_shape = shape_of(b);
  buf.row_tokens = rt.data();
  buf.n_rows = static_cast<int64_t>(rt.shape(0));
  if (t.size() == 5) {
    const Mamba2Model* core = nullptr;
    if (!nb::try_cast(t[0], core, false) || core == nullptr) return false;
    return blocks::fit_mamba2_layer(*core, lock, buf, B, d, out);
  }
  const TransformerModel* core = nullptr;
  if (!nb::try_cast(t[0], core, false) || core == nullptr ||
      !nb::try_cast(t[5], buf.max_tokens, false) || !nb::try_cast(t[6], buf.rope_set, false) ||
      !nb::try_cast(t[7], buf.n_kv_heads, false) || !nb::try_cast(t[8], buf.capacity, false) ||
      !nb::try_cast(t[9], buf.head_dim, false))
    return false;
  return blocks::fit_transformer_layer(*core, lock, buf, B, d, out);
}

}  // namespace

void bind_stack(nb::module_& m) {
  // The layers of one model call in one native call (Model's layers, SPEC 2.5: transformer
  // and Mamba-2 layers, in any order): layer i's output is layer i+1's input, each layer
  // exactly the block's own forward
  // (same kernels, same bits; its state claimed, its slots saved into `undo`, its counters
  // committed right after its kernel). It stops before the first layer it cannot run as the
  // block's call would (a layer that does not cast or fit, a busy state, a non-finite input or
  // cache slot, scratch that cannot be allocated), having changed nothing of that layer, and
  // returns (output of the last layer run or None, layers run): the caller runs that layer
  // through the block's own call, which raises the error the block names.
  m.def(
      "layer_stack",
      [](nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu> x, IArr lengths,
         nb::list layers, Workspace* ws, bool check_cache, UndoLog* undo) -> nb::tuple {
        const int64_t B = static_cast<int64_t>(x.shape(0)), L = static_cast<int64_t>(x.shape(1)),
                      d = static_cast<int64_t>(x.shape(2));
        check_rows(lengths, B, "lengths");
        const int64_t* lens = lengths.data();
        std::vector<StackLayer> run(layers.size());
        size_t n = 0;
        while (n < run.size() && stack_layer(layers[n], B, d, run[n])) ++n;
        if (n == 0) return nb::make_tuple(nb::none(), 0);
        run.resize(n);
        OutArr ya = new_output(B, L, d), yb = new_output(B, L, d);
        nb::object oa = nb::cast(ya), ob = nb::cast(yb);
        runtime::CallScratch scratch(ws);
        const int64_t tokens = total_tokens(lengths);
        int64_t advancing = 0;
        for (int64_t b = 0; b < B; ++b) advancing += lens[b] > 0;
        blocks::StackCall call;
        call.x = x.data();
        call.batch = B;
        call.n_tokens = L;
        call.d_model = d;
        call.lengths = lens;
        call.y_a = ya.data();
        call.y_b = yb.data();
        call.n_threads = runtime::num_threads();
        call.ws = scratch.get();
        call.check_cache = check_cache;
        call.undo = undo;
        const blocks::StackKernels table{kernels().transformer_forward, kernels().mamba2_forward};
        // Each layer as its block's own call: its own signal watch (a layer disarms its watch
        // for its last, short cache copy), then (blocks/stack.cpp) its lock, its counters read
        // and checked under the lock, its kernel and its counters committed.
        const auto runner = [&](const StackLayer& ly, const blocks::StackLayerBody& body) {
          bool ran = false;
          if (ly.mamba != nullptr) {  // as the Mamba-2 block's forward binding (mamba2.cpp)
            SignalPoll poll(blocks::mamba2_flops(*ly.mamba, static_cast<double>(tokens)));
            UndoLog own_undo;  // a long, watched call outside a model transaction saves here
            UndoLog* saving = undo;
            if (saving == nullptr && poll.watched() && tokens >= kSaveMinTokensPerRow * advancing)
              saving = &own_undo;
            run_kernel(ws, scratch.get(), tokens, poll, saving, [&] { ran = body(saving); });
          } else {
            // the counters seen now (read again under the lock): only an estimate
            SignalPoll poll(blocks::transformer_flops(*ly.core, lens, ly.row_tokens, B));
            run_kernel(ws, scratch.get(), tokens, poll, undo, [&] { ran = body(undo); });
          }
          return ran;
        };
        const size_t done = blocks::run_stack(call, table, run, runner);
        if (done == 0) return nb::make_tuple(nb::none(), 0);
        return nb::make_tuple(done % 2 == 1 ? oa : ob, done);
      },
      nb::arg("x"), nb::arg("lengths"), nb::arg("layers"), nb::arg("workspace").none(),
      nb::arg("check_cache"), nb::arg("undo").none());
}

}  // namespace eb::bindings
