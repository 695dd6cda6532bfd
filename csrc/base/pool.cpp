// The thread pool (pool.hpp), compiled once with the baseline flags.
//
// One word says which region is open: (epoch:32 | n_threads-1:8 | front:12 | back:12), the
// chunks not yet claimed being [front, back). The calling thread claims chunk `front`, a helper
// chunk `back - 1`, each with one compare-and-swap that also checks the epoch, so a helper that
// wakes late cannot claim a chunk of a region that has ended; the region's parameters are read
// only after a successful claim, when the region is certain to stay open until that chunk is
// done. The caller then waits for `done == n_chunks`.
#include "base/pool.hpp"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <exception>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <condition_variable>
#include <mutex>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "base/fpenv.hpp"

namespace eb::pool {
namespace {

constexpr int kChunksPerThread = 8;  // enough for balance, few enough to keep claims cheap
constexpr int kMaxThreads = 256;     // n_threads - 1 fits the word's 8 bits
static_assert(kMaxThreads * kChunksPerThread <= 0xFFF, "chunk indices fit 12 bits");
// A helper waits for the next region spinning kHelperSpinNs, then yielding its core to any
// other runnable thread between looks for kHelperYieldNs more, then asleep on a futex. The
// yielding phase keeps the helper awake across the gaps between a model's calls (sampling, a
// Python loop): waking a sleeping thread took longer than the next region on a virtual
// machine, so the caller did that region mostly alone; a yielding helper gives its core to any
// thread that can run.
constexpr int64_t kHelperSpinNs = 50000;
constexpr int64_t kHelperYieldNs = 2000000;
constexpr int64_t kCallerSpinNs = 20000;  // the caller spins this long for claimed chunks
constexpr int kSpawnBackoff = 64;         // regions between retries after a failed creation
// A stall: the caller, done with its own chunks, waited more than kStallNs and longer than it
// worked for a chunk a helper claimed (the helper was descheduled: the machine is busy). The
// caller then runs regions alone for a while, 4 ms after the first stall, doubling up to
// 256 ms while stalls repeat; a region without stall halves the back-off again.
constexpr int64_t kStallNs = 200000;
constexpr int64_t kSoloMinNs = 4000000, kSoloMaxNs = 256000000;

static_assert(sizeof(std::atomic<uint32_t>) == 4, "futex words are 32-bit");

inline uint32_t epoch_of(uint64_t w) { return static_cast<uint32_t>(w >> 32); }
inline int last_tid_of(uint64_t w) { return static_cast<int>((w >> 24) & 0xFFu); }
// The low 24 bits: the next chunk from the front (12 bits) and one past the last chunk left
// at the back (12 bits). The caller claims from the front, helpers from the back: with two
// threads each runs a contiguous run of chunks, the same run from one call to the next, as a
// static split would, and they meet wherever the slower one got to.
inline uint32_t front_of(uint64_t w) { return static_cast<uint32_t>((w >> 12) & 0xFFFu); }
inline uint32_t back_of(uint64_t w) { return static_cast<uint32_t>(w & 0xFFFu); }
inline uint32_t left_of(uint64_t w) { return back_of(w) - front_of(w); }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Sleep while *a == v (returns at once if it differs; may return spuriously), and wake.
#if defined(__linux__)
void futex_wait(std::atomic<uint32_t>* a, uint32_t v) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(a), FUTEX_WAIT_PRIVATE, v, nullptr, nullptr, 0);
}
void futex_wake(std::atomic<uint32_t>* a) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(a), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr,
          0);
}
#else
std::mutex g_sleep_mutex;
std::condition_variable g_sleep_cv;
void futex_wait(std::atomic<uint32_t>* a, uint32_t v) {
  std::unique_lock<std::mutex> lock(g_sleep_mutex);
  if (a->load() == v) g_sleep_cv.wait_for(lock, std::chrono::milliseconds(1));
}
void futex_wake(std::atomic<uint32_t>*) {
  {
    std::lock_guard<std::mutex> lock(g_sleep_mutex);
  }
  g_sleep_cv.notify_all();
}
#endif

struct Pool {
  alignas(64) std::atomic<uint64_t> word{0};
  alignas(64) std::atomic<uint32_t> done{0};  // chunks of the open region completed
  std::atomic<uint32_t> caller_sleeps{0};
  alignas(64) std::atomic<uint32_t> wake_seq{0};  // bumped to wake sleeping helpers
  std::atomic<int> sleepers{0};
  alignas(64) std::atomic<bool> busy{false};  // a caller owns the pool
  std::atomic<int> helpers{0};
  // Owned by the caller that holds `busy`:
  uint32_t epoch = 0;
  int spawn_backoff = 0;
  int64_t solo_until = 0;  // regions before this time run on the calling thread
  int64_t solo_ns = kSoloMinNs;
  // The open region, written before it is published, read by a helper after a claim:
  ChunkFn fn = nullptr;
  void* ctx = nullptr;
  int64_t n = 0, grain = 1, units = 0;
  uint32_t n_chunks = 0;
  std::atomic<bool> failed{false};
  std::exception_ptr error;
};

// Never destroyed: helpers are detached and may still sleep on it at exit, and a forked child
// drops its inherited pool rather than touching threads that do not exist there.
std::atomic<Pool*> g_pool{nullptr};

void on_fork_child() { g_pool.store(nullptr, std::memory_order_relaxed); }

void run_chunk(Pool& p, uint32_t index, int tid) {
  const int64_t u0 = p.units * index / p.n_chunks, u1 = p.units * (index + 1) / p.n_chunks;
  const int64_t begin = u0 * p.grain, end = std::min(p.n, u1 * p.grain);
  if (begin >= end || p.failed.load(std::memory_order_relaxed)) return;
  try {
    p.fn(p.ctx, begin, end, tid);
  } catch (...) {
    if (!p.failed.exchange(true)) p.error = std::current_exception();
  }
}

// Claims and runs chunks of the region whose word is *w until none is left.
void work(Pool& p, uint64_t w, int tid) {
  const uint32_t epoch = epoch_of(w);
  while (front_of(w) < back_of(w)) {
    const uint64_t claimed = tid == 0 ? w + (uint64_t{1} << 12) : w - 1;
    if (!p.word.compare_exchange_weak(w, claimed, std::memory_order_acq_rel,
                                      std::memory_order_relaxed)) {
      if (epoch_of(w) != epoch) return;  // the region ended (a helper then looks afresh)
      continue;
    }
    const uint32_t nc = p.n_chunks;
    run_chunk(p, tid == 0 ? front_of(w) : back_of(w) - 1, tid);
    const uint32_t now_done = p.done.fetch_add(1, std::memory_order_seq_cst) + 1;
    if (tid != 0 && now_done == nc && p.caller_sleeps.load(std::memory_order_seq_cst) != 0)
      futex_wake(&p.done);
    w = claimed;
  }
}

void helper_main(Pool* p, int tid) {
  FpEnvGuard guard;  // for the thread's whole life: it only ever runs the core's regions
  uint32_t seen = 0;
  for (;;) {
    uint64_t w = p->word.load(std::memory_order_acquire);
    if (epoch_of(w) == seen) {
      // Spin, then yield, waiting for the next region; then sleep.
      const int64_t t0 = now_ns();
      for (int i = 1; epoch_of(w) == seen; ++i) {
        cpu_relax();
        if (i % 64 == 0) {
          const int64_t waited = now_ns() - t0;
          if (waited > kHelperSpinNs + kHelperYieldNs) break;
          if (waited > kHelperSpinNs) std::this_thread::yield();
        }
        w = p->word.load(std::memory_order_acquire);
      }
      if (epoch_of(w) == seen) {
        const uint32_t s = p->wake_seq.load(std::memory_order_seq_cst);
        p->sleepers.fetch_add(1, std::memory_order_seq_cst);
        if (epoch_of(p->word.load(std::memory_order_seq_cst)) == seen) futex_wait(&p->wake_seq, s);
        p->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      }
      continue;
    }
    // A region this helper has not looked at: join it if it asked for this tid.
    if (tid <= last_tid_of(w)) work(*p, w, tid);
    seen = epoch_of(w);
  }
}

Pool* get_pool() {
  static const bool registered = (pthread_atfork(nullptr, nullptr, on_fork_child), true);
  (void)registered;
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p != nullptr) return p;
  Pool* fresh = new (std::nothrow) Pool();
  if (fresh == nullptr) return nullptr;
  if (!g_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) {
    delete fresh;
    return p;
  }
  return fresh;
}

// Creates helpers up to `want`; a failure leaves the pool as it is and is retried later.
void grow(Pool& p, int want) {
  int have = p.helpers.load(std::memory_order_relaxed);
  if (have >= want) return;
  if (p.spawn_backoff > 0) {
    --p.spawn_backoff;
    return;
  }
  for (; have < want; ++have) {
    try {
      std::thread(helper_main, &p, have + 1).detach();
    } catch (...) {  // std::system_error (EAGAIN), std::bad_alloc
      p.spawn_backoff = kSpawnBackoff;
      break;
    }
    p.helpers.store(have + 1, std::memory_order_relaxed);
  }
}

void run_inline(int64_t n, ChunkFn fn, void* ctx) {
  FpEnvGuard guard;
  fn(ctx, 0, n, 0);
}

}  // namespace

void run(int64_t n, int n_threads, int64_t grain, ChunkFn fn, void* ctx) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t units = (n + grain - 1) / grain;
  int nt = static_cast<int>(std::min<int64_t>({n_threads, units, kMaxThreads}));
  if (nt <= 1) return run_inline(n, fn, ctx);
  Pool* pp = get_pool();
  // A region that finds the pool owned runs inline: a nested one (its caller, or a helper, is
  // inside a region) or another thread's concurrent call.
  if (pp == nullptr || pp->busy.exchange(true, std::memory_order_acquire))
    return run_inline(n, fn, ctx);
  Pool& p = *pp;
  struct Owner {
    Pool& p;
    ~Owner() { p.busy.store(false, std::memory_order_release); }
  } owner{p};
  const int64_t t_start = now_ns();
  if (t_start < p.solo_until) return run_inline(n, fn, ctx);
  grow(p, nt - 1);
  nt = std::min(nt, 1 + p.helpers.load(std::memory_order_relaxed));
  if (nt <= 1) return run_inline(n, fn, ctx);

  const uint32_t nc =
      static_cast<uint32_t>(std::min<int64_t>(units, int64_t{nt} * kChunksPerThread));
  p.fn = fn;
  p.ctx = ctx;
  p.n = n;
  p.grain = grain;
  p.units = units;
  p.n_chunks = nc;
  p.failed.store(false, std::memory_order_relaxed);
  p.error = nullptr;
  p.done.store(0, std::memory_order_relaxed);
  if (++p.epoch == 0) p.epoch = 1;  // epoch 0 is "never seen" for a new helper
  const uint64_t w =
      (uint64_t{p.epoch} << 32) | (static_cast<uint64_t>(nt - 1) << 24) | uint64_t{nc};
  p.word.store(w, std::memory_order_seq_cst);
  if (p.sleepers.load(std::memory_order_seq_cst) > 0) {
    p.wake_seq.fetch_add(1, std::memory_order_seq_cst);
    futex_wake(&p.wake_seq);
  }

  {
    FpEnvGuard guard;
    work(p, w, 0);
  }
  // Wait for the chunks helpers claimed: spin briefly, then sleep until the last one is done.
  const int64_t t0 = now_ns();
  bool slept = false;
  for (int i = 1; p.done.load(std::memory_order_acquire) != nc; ++i) {
    cpu_relax();
    if (i % 64 == 0 && now_ns() - t0 > kCallerSpinNs) {
      for (;;) {
        p.caller_sleeps.store(1, std::memory_order_seq_cst);
        const uint32_t v = p.done.load(std::memory_order_seq_cst);
        if (v == nc) break;
        futex_wait(&p.done, v);
      }
      p.caller_sleeps.store(0, std::memory_order_relaxed);
      slept = true;
      break;
    }
  }
  if (slept) {
    const int64_t t_end = now_ns();
    if (t_end - t0 > kStallNs && t_end - t0 > t0 - t_start) {
      p.solo_until = t_end + p.solo_ns;
      p.solo_ns = std::min(2 * p.solo_ns, kSoloMaxNs);
    }
  } else if (p.solo_ns > kSoloMinNs) {
    p.solo_ns /= 2;
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  if (p.failed.load(std::memory_order_relaxed)) {
    std::exception_ptr e = p.error;
    p.error = nullptr;
    std::rethrow_exception(e);
  }
}

}  // namespace eb::pool
