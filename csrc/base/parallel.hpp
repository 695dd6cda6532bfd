// parallel_for: n independent output items (rows, heads, panels, tokens) computed on up to
// n_threads threads of the core's pool (base/pool.hpp). Items are handed out dynamically, in
// chunks, to whichever thread is free, so which thread computes an item depends on timing.
// That is allowed because every item is computed by exactly one thread with the
// single-thread instruction sequence, and no reduction is ever split (STYLE 5.5): the thread
// count and the assignment change speed, never bits.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

#include "base/fpenv.hpp"
#include "base/pool.hpp"

namespace eb {

// Chunks of a parallel_for hold a multiple of `items` items (the last one excepted): the
// GEMM keeps a panel's row blocks together.
struct Grain {
  int64_t items = 1;
};

// fn(begin, end, tid) is called for non-empty ranges that together cover [0, n) once; tid names
// the calling OS thread for the whole call, tid < n_threads (call sites index per-thread
// scratch with it). With one thread, or n within one grain: fn(0, n, 0) on the calling thread.
template <class Fn>
void parallel_for(int64_t n, int n_threads, Grain grain, Fn&& fn) {
  if (n <= 0) return;
  if (n_threads <= 1 || n <= grain.items) {
    FpEnvGuard guard;
    fn(int64_t{0}, n, 0);
    return;
  }
  using F = std::remove_reference_t<Fn>;
  pool::run(
      n, n_threads, grain.items,
      [](void* ctx, int64_t begin, int64_t end, int tid) {
        (*static_cast<F*>(ctx))(begin, end, tid);
      },
      const_cast<void*>(static_cast<const void*>(std::addressof(fn))));
}

template <class Fn>
void parallel_for(int64_t n, int n_threads, Fn&& fn) {
  parallel_for(n, n_threads, Grain{}, std::forward<Fn>(fn));
}

// Threads for a pass that copies or adds whole token rows (residuals, outputs, the KV-cache
// write): below kShareRows tokens (decode, short chunks) such a pass is shorter than waking the
// other threads, so it runs on the calling thread. Either way every bit is the same.
constexpr int64_t kShareRows = 64;
inline int threads_for_rows(int64_t tokens, int n_threads) {
  return tokens >= kShareRows ? n_threads : 1;
}

}  // namespace eb
