// The core's own thread pool (pool.cpp), behind parallel_for (parallel.hpp). Threads split
// OUTPUT items only, so which thread computes which item never changes a bit; the pool is
// therefore free to hand items out dynamically, in chunks, to whichever thread is running.
//
// - Helpers are std::threads created lazily, the first time a region asks for them; a failed
//   creation (EAGAIN under RLIMIT_NPROC / RLIMIT_AS, std::bad_alloc) leaves fewer helpers and
//   the region runs with the threads there are, never an abort.
// - A region's items are cut into chunks (about kChunksPerThread per thread) claimed one at a
//   time from an atomic counter. The calling thread claims chunks too, so a region never waits
//   for a helper that has not started yet: it waits only for chunks a helper actually claimed.
// - A helper that finished a region spins for 50 us, then yields its core between looks for
//   2 ms (catching the next region of the same call or of the next call), then sleeps on a
//   futex, so idle helpers never hold a core another thread could use.
// - A region that finds the pool owned runs inline on the calling thread (tid 0): a nested
//   region, or another thread's concurrent call. Helpers touch no thread_local (its lazy
//   allocation could abort under a memory limit).
// - fork(): a pthread_atfork child handler drops the parent's pool (its helpers do not exist in
//   the child); the child's first parallel region builds a pool of its own.
// - Every helper runs with round-to-nearest and FTZ/DAZ off (FpEnvGuard for its whole life);
//   the calling thread holds a guard while it works.
#pragma once
#include <cstdint>

namespace eb::pool {

// fn(ctx, begin, end, tid) computes items [begin, end) on the thread with index tid.
using ChunkFn = void (*)(void* ctx, int64_t begin, int64_t end, int tid);

// Runs fn over the items [0, n) on up to n_threads threads (the caller is tid 0, helpers
// 1..n_threads-1) and returns when every item has run. Chunks hold a multiple of `grain`
// items (the last one excepted). Every tid passed to fn is < n_threads and names one thread for
// the whole region. An exception thrown by fn is rethrown here, after the region has ended.
void run(int64_t n, int n_threads, int64_t grain, ChunkFn fn, void* ctx);

}  // namespace eb::pool
