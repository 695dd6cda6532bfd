// What the block bindings (transformer.cpp, mamba2.cpp, stack.cpp) share to make one call: the
// output array, the GIL release with the signal watch around the kernel (run_kernel), the
// state counters, and the weights given by Python. Nothing here computes.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/cancel.hpp"
#include "base/runtime.hpp"
#include "base/undo.hpp"
#include "base/workspace.hpp"
#include "bindings/common.hpp"
#include "bindings/interrupts.hpp"
#include "blocks/weight_map.hpp"
#include "ops/gemm/format.hpp"

namespace eb::bindings {

using U8Arr = nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>;
using IOut = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// A Mamba-2 block call saves the state rows it writes (so that it can be stopped in the middle
// of writing them) when it has at least this many tokens per advancing row: the copy of h is
// then small next to the work. A decode step is not stopped once it writes (it is short).
constexpr int64_t kSaveMinTokensPerRow = 16;

// Scratch or output memory that could not be allocated: a MemoryError whose message the Python
// layer prefixes with `Class.method: ` (SPEC 2.7).
struct CallAllocError : std::bad_alloc {
  std::string msg;
  explicit CallAllocError(std::string m) : msg(std::move(m)) {}
  const char* what() const noexcept override { return msg.c_str(); }
};

// A zero-filled (B, L, d) float32 output; CallAllocError naming its size when it cannot be had.
OutArr new_output(int64_t B, int64_t L, int64_t d);

// weights: name -> float32 array; blocks: name -> (ggml type, uint8 array of GGUF blocks) for
// projection matrices read straight from a GGUF file (their sizes were checked by Python).
WeightMap weight_map(const nb::dict& weights, const nb::dict& blocks, std::vector<CArr>& keep,
                     std::vector<nb::object>& keep_blocks);

// [(matrix, format, bytes)] of packed matrices by name; a mixed stack lists one entry per part.
nb::list storage_list(
    std::initializer_list<std::pair<const char*, const ops::PackedMatrix*>> items);

// row_tokens[b] = start[b] + lengths[b]: the counters of a completed call, written in the same
// native step as the buffers (no Python code runs in between). Nothing when row_tokens is null.
void commit_counters(IOut* row_tokens, const IArr& start, const IArr& lengths, int64_t B);
int64_t total_tokens(const IArr& lengths);
// EB_CHECK that `a` has `batch` entries, naming it.
void check_rows(const IArr& a, int64_t batch, const char* name);

// Runs a block kernel with the GIL released; its cancel points poll for signal handlers when
// `poll` is watched (interrupts.hpp). A failed call leaves nothing of its own behind: a stop
// (a handler raised: that exception is raised here) or any other exception rolls back the
// entries `undo` got during this call (older ones are the caller's: a whole-model call's
// earlier layers), and scratch that could not be allocated releases the workspace the call
// used (so a failed call keeps no scratch alive) and becomes a MemoryError naming the memory.
template <class Fn>
void run_kernel(Workspace* given, Workspace* used, int64_t tokens, SignalPoll& poll, UndoLog* undo,
                Fn&& fn) {
  size_t held = 0;
  bool failed = false, stopped = false;
  const size_t mark = undo != nullptr ? undo->size() : 0;
  {
    nb::gil_scoped_release release;
    const bool timed = poll.flops() >= cancel::kRecordMinFlops;
    const int64_t t0 = timed ? cancel::now_ns() : 0;
    try {
      {
        std::optional<cancel::Watch> watch;
        if (poll.watched()) watch.emplace(poll.poller(), cancel::estimate_ns(poll.flops()));
        fn();
      }
      if (timed) cancel::record(poll.flops(), cancel::now_ns() - t0);
      runtime::trim_workspace(given, used);
    } catch (const cancel::Stopped&) {
      if (undo != nullptr) undo->rollback(mark);
      stopped = true;
    } catch (const std::bad_alloc&) {
      if (undo != nullptr) undo->rollback(mark);
      held = used->bytes();
      used->release();
      failed = true;
    } catch (...) {
      if (undo != nullptr) undo->rollback(mark);
      used->release();
      throw;
    }
  }
  if (stopped) poll.raise();
  if (failed)
    throw CallAllocError("cannot allocate scratch memory for " + std::to_string(tokens) +
                         " tokens (an allocation failed after " + std::to_string(held) +
                         " bytes of scratch; they have been released)");
}

}  // namespace eb::bindings
