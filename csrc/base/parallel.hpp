// parallel_for: n independent output items (rows, heads, panels, tokens) computed on up to
// n_threads threads of the core's pool (base/pool.hpp). Items are handed out dynamically, in
// chunks, to whichever thread is free, so which thread computes an item depends on timing.
// That is allowed because every item is computed by exactly one thread with the
// single-thread instruction sequence, and no reduction is ever split (STYLE 5.5): the thread
// count and the assignment change speed, never bits. For the same reason a region may be run in
// consecutive pieces (while a call can be stopped, base/cancel.hpp): same bits.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

#include "base/cancel.hpp"
#include "base/fpenv.hpp"
#include "base/pool.hpp"

namespace eb {

// Chunks of a parallel_for hold a multiple of `items` items (the last one excepted): the
// GEMM keeps a panel's row blocks together.
struct Grain {
  int64_t items = 1;
};

namespace detail {

// fn over [begin, end) (begin a multiple of the grain) on up to n_threads threads. In a pool
// region the caller (tid 0, never a helper: regions do not nest) passes a cancel point before
// each chunk it claims.
template <class F>
void parallel_range(int64_t begin, int64_t end, int n_threads, Grain grain, F& fn) {
  const int64_t n = end - begin;
  if (n_threads <= 1 || n <= grain.items) {
    FpEnvGuard guard;
    fn(begin, end, 0);
    return;
  }
  struct Ctx {
    F* fn;
    int64_t off;
  } ctx{std::addressof(fn), begin};
  pool::run(
      n, n_threads, grain.items,
      [](void* c, int64_t b, int64_t e, int tid) {
        const Ctx& x = *static_cast<const Ctx*>(c);
        if (tid == 0) cancel::point();
        (*x.fn)(b + x.off, e + x.off, tid);
      },
      &ctx);
}

// While the caller's call can be stopped (base/cancel.hpp): the region in consecutive pieces of
// whole grains, each aimed at about cancel::kPieceNs, with a cancel point between pieces.
template <class F>
void parallel_pieces(int64_t n, int n_threads, Grain grain, F& fn) {
  const int64_t g = std::max<int64_t>(grain.items, 1), units = (n + g - 1) / g;
  int64_t done = 0, piece = cancel::first_piece(units);
  while (done < units) {
    const int64_t take = std::min(piece, units - done);
    const int64_t t0 = cancel::now_ns();
    parallel_range(done * g, std::min(n, (done + take) * g), n_threads, grain, fn);
    done += take;
    if (done < units) {
      piece = cancel::next_piece(take, cancel::now_ns() - t0);
      cancel::point();
    }
  }
}

}  // namespace detail

// fn(begin, end, tid) is called for non-empty ranges that together cover [0, n) once; tid names
// the calling OS thread for the whole call, tid < n_threads (call sites index per-thread
// scratch with it). With one thread, or n within one grain: fn(0, n, 0) on the calling thread,
// unless the call can be stopped (then in pieces, see detail::parallel_pieces). fn must not
// start a parallel_for of its own.
template <class Fn>
void parallel_for(int64_t n, int n_threads, Grain grain, Fn&& fn) {
  if (n <= 0) return;
  using F = std::remove_reference_t<Fn>;
  if (cancel::watching()) {
    detail::parallel_pieces<F>(n, n_threads, grain, fn);
    return;
  }
  detail::parallel_range<F>(0, n, n_threads, grain, fn);
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
