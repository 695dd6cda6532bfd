// Cancel points and watches (cancel.hpp), compiled once with the baseline flags.
//
// The watch of a thread is reached through a thread_local pointer. Only a thread that called
// into the core reads it (a pool helper never passes a cancel point: parallel.hpp calls point()
// for tid 0 only, the caller), and g_watches keeps every thread off it while no watch exists.
#include "base/cancel.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>

namespace eb::cancel {

std::atomic<int> g_watches{0};

namespace {

thread_local Watch* tl_watch = nullptr;
// Nanoseconds per floating-point operation of recent calls, as measured (record); starts at
// 4 GFLOP/s, below what one core does on any ISA here, so a first call is not underestimated.
std::atomic<double> g_ns_per_flop{0.25};
std::atomic<int64_t> g_watch_min_ns{kWatchMinNs};
std::atomic<int64_t> g_piece_ns{kPieceNs};
constexpr int64_t kGrowth = 8;  // a piece is at most this many times the previous one

Watch* current() {
  if (g_watches.load(std::memory_order_relaxed) == 0) return nullptr;
  return tl_watch;
}

}  // namespace

const char* Stopped::what() const noexcept { return "exactblocks: call stopped by a poll"; }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Watch::Watch(Poller p, int64_t est) : poller(p), est_ns(std::max<int64_t>(est, 1)) {
  next_poll_ns = now_ns() + kPollNs;
  prev = tl_watch;
  tl_watch = this;
  g_watches.fetch_add(1, std::memory_order_relaxed);
}

Watch::~Watch() {
  tl_watch = prev;
  g_watches.fetch_sub(1, std::memory_order_relaxed);
}

void point_slow() {
  Watch* w = current();
  if (w == nullptr || !w->armed) return;
  if (w->stopped) throw Stopped();
  const int64_t t0 = now_ns();
  if (t0 < w->next_poll_ns) return;
  const bool stop = w->poller.poll(w->poller.ctx);
  // A poll that had to wait (another thread held what the callback needs, e.g. the GIL) makes
  // the next one come later, so polling never takes more than about 5% of the call.
  const int64_t t1 = now_ns();
  w->next_poll_ns = t1 + std::max(kPollNs, 20 * (t1 - t0));
  if (stop) {
    w->stopped = true;
    throw Stopped();
  }
}

void disarm() {
  if (Watch* w = current()) w->armed = false;
}

bool watching_slow() {
  const Watch* w = current();
  return w != nullptr && w->armed;
}

int64_t first_piece(int64_t units) {
  const Watch* w = current();
  if (w == nullptr) return units;
  const double f = static_cast<double>(g_piece_ns.load(std::memory_order_relaxed)) /
                   static_cast<double>(w->est_ns);
  return std::clamp<int64_t>(static_cast<int64_t>(std::ceil(f * static_cast<double>(units))), 1,
                             std::max<int64_t>(units, 1));
}

int64_t next_piece(int64_t last_units, int64_t last_ns) {
  const int64_t most = kGrowth * std::max<int64_t>(last_units, 1);
  if (last_ns <= 0) return most;
  const double want = static_cast<double>(last_units) *
                      static_cast<double>(g_piece_ns.load(std::memory_order_relaxed)) /
                      static_cast<double>(last_ns);
  return std::clamp<int64_t>(static_cast<int64_t>(want), 1, most);
}

int64_t watch_min_ns() { return g_watch_min_ns.load(std::memory_order_relaxed); }

void set_tuning(int64_t watch_min, int64_t piece) {
  g_watch_min_ns.store(std::max<int64_t>(watch_min, 0), std::memory_order_relaxed);
  g_piece_ns.store(std::max<int64_t>(piece, 0), std::memory_order_relaxed);
}

int64_t estimate_ns(double flops) {
  return static_cast<int64_t>(
      std::min(flops * g_ns_per_flop.load(std::memory_order_relaxed), 9.0e18));
}

void record(double flops, int64_t ns) {
  if (flops < kRecordMinFlops || ns <= 0) return;
  // clamped to 200 GFLOP/s .. 0.1 GFLOP/s: one odd call (one that stopped early on a
  // non-finite value) must not make later long calls look short
  const double measured = std::clamp(static_cast<double>(ns) / flops, 0.005, 10.0);
  const double old = g_ns_per_flop.load(std::memory_order_relaxed);
  g_ns_per_flop.store(0.75 * old + 0.25 * measured, std::memory_order_relaxed);
}

}  // namespace eb::cancel
