// parallel_for: a static split of n independent output items (rows, heads, panels) into
// contiguous ranges, one per thread, that depends only on n and n_threads (STYLE 5.5).
// Every item is computed by exactly one thread with the single-thread instruction sequence,
// so the thread count changes speed, never bits. No reductions are ever split.
#pragma once
#include <omp.h>
#include <algorithm>
#include <cstdint>

#include "base/fpenv.hpp"

namespace eb {

// fn(begin, end, thread_index) is called once per thread with a non-empty range.
template <class Fn>
void parallel_for(int64_t n, int n_threads, Fn&& fn) {
  if (n <= 0) return;
  const int nt = static_cast<int>(std::min<int64_t>(std::max(n_threads, 1), n));
  if (nt == 1) {
    FpEnvGuard guard;
    fn(int64_t{0}, n, 0);
    return;
  }
#pragma omp parallel num_threads(nt)
  {
    FpEnvGuard guard;
    const int tid = omp_get_thread_num();
    const int t_all = omp_get_num_threads();
    const int64_t begin = n * tid / t_all;
    const int64_t end = n * (tid + 1) / t_all;
    if (begin < end) fn(begin, end, tid);
  }
}

// Threads for a pass that copies or adds whole token rows (residuals, outputs, the KV-cache
// write): below kShareRows tokens (decode, short chunks) such a pass is shorter than waking the
// other threads, so it runs on the calling thread. Either way every bit is the same.
constexpr int64_t kShareRows = 64;
inline int threads_for_rows(int64_t tokens, int n_threads) {
  return tokens >= kShareRows ? n_threads : 1;
}

}  // namespace eb
