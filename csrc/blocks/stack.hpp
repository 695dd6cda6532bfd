// The layers of one model call in one native call (SPEC 2.5: transformer and Mamba-2 layers, in
// any order): layer i's output is layer i+1's input, each layer exactly its block's own forward
// (the same kernels, the same bits; its state claimed, its slots saved into the call's undo
// log, its counters committed right after its kernel). The run stops before the first layer
// it cannot run as the block's own call would (a non-finite input, a busy state, counters out
// of range, a non-finite cache slot, scratch that cannot be allocated), having changed nothing
// of that layer; the caller then runs that layer through the block's own call, which raises
// the error the block names.
//
// Nothing here knows about Python: the bindings (bindings/stack.cpp) cast a model's layers
// into StackLayer and wrap each layer's call in their signal watch (LayerRunner).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "base/state_lock.hpp"
#include "base/undo.hpp"
#include "base/workspace.hpp"
#include "blocks/mamba2/model.hpp"
#include "blocks/transformer/model.hpp"

namespace eb::blocks {

// One layer of a stack call: its core, its state's lock, buffers and counters, where each row
// starts and how many positions it may hold.
struct StackLayer {
  const TransformerModel* core = nullptr;  // a transformer layer's, or
  const Mamba2Model* mamba = nullptr;      // a Mamba-2 layer's
  StateLock* lock = nullptr;
  float* k = nullptr;  // KV cache (batch, n_kv_heads, capacity, head_dim), or a Mamba-2 layer's
                       // conv_window (batch, conv_dim, conv_kernel)
  float* v = nullptr;  // KV cache, or a Mamba-2 layer's h (batch, n_heads, head_dim, d_state)
  int64_t capacity = 0;
  int64_t* row_tokens = nullptr;  // (batch,) the state's counters
  int64_t max_tokens = 0;
  std::vector<int64_t> start;  // the state's counters, read under its lock
  int rope_set = 0;
  bool attn = false;  // a transformer layer with an attention half
};

// A layer's state buffers as the caller found them (the bindings: the arrays themselves, never
// a converted copy; C-contiguous and writable), checked by fit_*_layer below. a: the KV cache's
// keys or a Mamba-2 layer's conv_window; b: its values or h.
struct StackBuffers {
  float* a = nullptr;
  std::vector<int64_t> a_shape;
  float* b = nullptr;
  std::vector<int64_t> b_shape;
  int64_t* row_tokens = nullptr;
  int64_t n_rows = 0;  // entries of row_tokens
  // A transformer layer's state, as its Python side describes it.
  int64_t max_tokens = 0, n_kv_heads = 0, capacity = 0, head_dim = 0;
  int rope_set = 0;
};

// Whether the buffers are what the block's own call accepts for `core` on x (batch, ., d_model)
// (SPEC 2.5: exactly the state's shapes, aligned, sharing no memory; a transformer layer's
// rope_set valid and, with attention, its cache of the core's KV heads and head_dim): then
// `out` is that layer of a stack call, its lock `lock`. False otherwise (the block's own call
// then raises the error).
bool fit_transformer_layer(const TransformerModel& core, StateLock* lock, const StackBuffers& buf,
                           int64_t batch, int64_t d_model, StackLayer& out);
bool fit_mamba2_layer(const Mamba2Model& core, StateLock* lock, const StackBuffers& buf,
                      int64_t batch, int64_t d_model, StackLayer& out);

// The block forwards a stack runs (the kernel table's, dispatch/kernel_table.hpp).
struct StackKernels {
  void (*transformer_forward)(const TransformerModel&, const TransformerCall&) = nullptr;
  void (*mamba2_forward)(const Mamba2Model&, const Mamba2Call&) = nullptr;
};

// The arrays of one stack call. y_a and y_b: (batch, n_tokens, d_model) each, the outputs of
// the even and the odd layers (layer i reads the other one).
struct StackCall {
  const float* x = nullptr;  // (batch, n_tokens, d_model)
  int64_t batch = 0, n_tokens = 0, d_model = 0;
  const int64_t* lengths = nullptr;  // (batch,) real tokens per row
  float* y_a = nullptr;
  float* y_b = nullptr;
  int n_threads = 1;
  Workspace* ws = nullptr;   // scratch of the call
  bool check_cache = false;  // check the cache slots / state values each layer reads
  UndoLog* undo = nullptr;   // a whole-model call's undo log, or nullptr
};

// One layer's call as the runner makes it: runs the layer, its writes saved into `saving` (the
// call's undo log, a log of the wrapper's own, or nullptr); true when it ran.
using StackLayerBody = std::function<bool(UndoLog* saving)>;
// How the caller wraps one layer's call (the bindings: the signal watch, the GIL release and
// the stop that rolls back): must run `body` once, or throw.
using LayerRunner = std::function<bool(const StackLayer& layer, const StackLayerBody& body)>;

// Whether every real position (t < lengths[b]) of x (batch, n_tokens, d) is finite: the input
// check of a block call, as one pass over the exponent bits.
bool real_rows_finite(const float* x, int64_t batch, int64_t n_tokens, int64_t d,
                      const int64_t* lengths);

// Reads layer `ly`'s counters (under its lock) into ly.start and checks them as the block's call
// does: each row's start in [0, max_tokens] with room for its tokens (and within max_positions
// for an attention layer); a Mamba-2 layer's >= 0 with room in int64.
bool stack_counters(StackLayer& ly, int64_t batch, int64_t n_tokens, const int64_t* lengths);

// Runs layer `ly` on `in` into `out` as its block's call would: the input check, the layer's
// lock, its counters under the lock, the kernel, the counters committed. False, with nothing of
// the layer changed, when it did not run (`saving`'s entries of this layer rolled back).
bool run_stack_layer(const StackCall& call, const StackKernels& kernels, StackLayer& ly,
                     const float* in, float* out, UndoLog* saving);

// Runs the layers in order, each through `runner`, until one does not run. Returns the number
// of layers run; the last one's output is y_a when that number is odd, y_b when it is even.
size_t run_stack(const StackCall& call, const StackKernels& kernels,
                 std::vector<StackLayer>& layers, const LayerRunner& runner);

// Floating-point operations of a call, roughly: 2 per weight per token, the attention's score
// and value passes, the Mamba-2 scan. Only for deciding whether to watch it (base/cancel.hpp).
double transformer_flops(const TransformerModel& m, const int64_t* lengths, const int64_t* start,
                         int64_t batch);
double mamba2_flops(const Mamba2Model& m, double tokens);

}  // namespace eb::blocks
