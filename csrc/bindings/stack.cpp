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

using blocks::Mamba2Config;
using blocks::StackLayer;
using blocks::TransformerConfig;

// Whether [a, a + na) and [b, b + nb) (bytes) share memory.
bool overlap(const void* a, size_t na, const void* b, size_t nb) {
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return na > 0 && nb > 0 && pa < pb + nb && pb < pa + na;
}

// A Mamba-2 layer of a stack call, a tuple (core, lock, conv_window, h, row_tokens): cast and
// checked as stack_layer below checks a transformer layer (its buffers exactly the shapes the
// core's configuration gives them).
bool stack_mamba2_layer(const nb::tuple& t, int64_t B, int64_t d, StackLayer& out) {
  if (t.size() != 5 || !nb::try_cast(t[0], out.mamba, false) || out.mamba == nullptr) return false;
  if (!nb::try_cast(t[1], out.lock, false) || out.lock == nullptr) return false;
  MArr cw, h;
  IOut rt;
  if (!nb::try_cast(t[2], cw, false) || !nb::try_cast(t[3], h, false) ||
      !nb::try_cast(t[4], rt, false))
    return false;
  const Mamba2Config& c = out.mamba->cfg;
  if (c.d_model != d || static_cast<int64_t>(rt.shape(0)) != B) return false;
  if (cw.ndim() != 3 || static_cast<int64_t>(cw.shape(0)) != B ||
      static_cast<int64_t>(cw.shape(1)) != c.conv_dim ||
      static_cast<int64_t>(cw.shape(2)) != c.conv_kernel)
    return false;
  if (h.ndim() != 4 || static_cast<int64_t>(h.shape(0)) != B ||
      static_cast<int64_t>(h.shape(1)) != c.n_heads ||
      static_cast<int64_t>(h.shape(2)) != c.head_dim ||
      static_cast<int64_t>(h.shape(3)) != c.d_state)
    return false;
  const size_t cw_bytes = cw.size() * sizeof(float), h_bytes = h.size() * sizeof(float),
               rt_bytes = static_cast<size_t>(B) * 8;
  if (reinterpret_cast<uintptr_t>(cw.data()) % alignof(float) != 0 ||
      reinterpret_cast<uintptr_t>(h.data()) % alignof(float) != 0 ||
      reinterpret_cast<uintptr_t>(rt.data()) % alignof(int64_t) != 0 ||
      overlap(cw.data(), cw_bytes, h.data(), h_bytes) ||
      overlap(cw.data(), cw_bytes, rt.data(), rt_bytes) ||
      overlap(h.data(), h_bytes, rt.data(), rt_bytes))
    return false;
  out.k = cw.data();
  out.v = h.data();
  out.row_tokens = rt.data();
  return true;
}

// Casts layer `h` of a stack call, a tuple (core, lock, k_cache, v_cache, row_tokens,
// max_tokens, rope_set, n_kv_heads, capacity, head_dim) of a state the Python side found to
// belong to the core's configuration, and checks what the block's own call checks of its
// buffers (SPEC 2.5: the arrays themselves, never a converted copy, exactly the state's shapes,
// C-contiguous, aligned, writable and sharing no memory): false, with nothing done, when
// anything is off (the block's own call then raises the error).
bool stack_layer(nb::handle h, int64_t B, int64_t d, StackLayer& out) {
  nb::tuple t;
  if (!nb::try_cast(h, t, false)) return false;
  if (t.size() == 5) return stack_mamba2_layer(t, B, d, out);
  if (t.size() != 10) return false;
  if (!nb::try_cast(t[0], out.core, false) || out.core == nullptr) return false;
  if (!nb::try_cast(t[1], out.lock, false) || out.lock == nullptr) return false;
  MArr k, v;
  IOut rt;
  int64_t n_kv = 0, cap = 0, hd = 0;
  if (!nb::try_cast(t[2], k, false) || !nb::try_cast(t[3], v, false) ||
      !nb::try_cast(t[4], rt, false) || !nb::try_cast(t[5], out.max_tokens, false) ||
      !nb::try_cast(t[6], out.rope_set, false) || !nb::try_cast(t[7], n_kv, false) ||
      !nb::try_cast(t[8], cap, false) || !nb::try_cast(t[9], hd, false))
    return false;
  const TransformerConfig& c = out.core->cfg;
  if (c.d_model != d || static_cast<int64_t>(rt.shape(0)) != B) return false;
  if (!(out.rope_set == 0 || (out.rope_set == 1 && c.rope_scaling == ops::kRopeLongrope)))
    return false;
  const int64_t shape[4] = {B, n_kv, cap, hd};
  for (const MArr* a : {&k, &v}) {
    if (a->ndim() != 4) return false;
    for (size_t i = 0; i < 4; ++i)
      if (static_cast<int64_t>(a->shape(i)) != shape[i]) return false;
  }
  const size_t kv_bytes = k.size() * sizeof(float), rt_bytes = static_cast<size_t>(B) * 8;
  if (reinterpret_cast<uintptr_t>(k.data()) % alignof(float) != 0 ||
      reinterpret_cast<uintptr_t>(v.data()) % alignof(float) != 0 ||
      reinterpret_cast<uintptr_t>(rt.data()) % alignof(int64_t) != 0 ||
      overlap(k.data(), kv_bytes, v.data(), kv_bytes) ||
      overlap(k.data(), kv_bytes, rt.data(), rt_bytes) ||
      overlap(v.data(), kv_bytes, rt.data(), rt_bytes))
    return false;
  out.attn = blocks::has_attention(c);
  if (out.attn && (n_kv != c.n_kv_heads || hd != c.head_dim || cap <= 0)) return false;
  out.capacity = cap;
  out.k = k.data();
  out.v = v.data();
  out.row_tokens = rt.data();
  return true;
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
