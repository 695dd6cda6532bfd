// StateLock and the fork generation (state_lock.hpp).
#include "base/state_lock.hpp"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <thread>

namespace eb {
namespace {

std::atomic<uint64_t> g_fork_generation{0};
std::atomic<uint64_t> g_thread_numbers{0};

void on_fork_child_bump_generation() { g_fork_generation.fetch_add(1, std::memory_order_relaxed); }

// Registered when the core is loaded, before any lock can be taken (no lazy initialisation,
// whose guard a fork could catch).
const bool g_fork_handler_registered =
    (pthread_atfork(nullptr, nullptr, on_fork_child_bump_generation), true);

}  // namespace

uint64_t fork_generation() {
  (void)g_fork_handler_registered;
  return g_fork_generation.load(std::memory_order_relaxed);
}

uint64_t this_thread_number() {
  thread_local const uint64_t number = g_thread_numbers.fetch_add(1, std::memory_order_relaxed) + 1;
  return number;
}

int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

uint64_t StateLock::observe() {
  uint64_t w = word_.load(std::memory_order_acquire);
  const uint64_t generation = fork_generation();
  while ((w & kBusyBit) != 0 && (w >> 2) != generation) {
    // Held by a thread of the parent: no call runs here, but the state is whatever that call
    // had written when the process forked.
    if (word_.compare_exchange_weak(w, kForkedBit, std::memory_order_acq_rel,
                                    std::memory_order_acquire)) {
      owner_.store(0, std::memory_order_relaxed);
      return kForkedBit;
    }
  }
  return w;
}

StateLock::Acquired StateLock::try_acquire(bool take_forked) {
  for (;;) {
    uint64_t w = observe();
    if ((w & kBusyBit) != 0) return kBusy;
    if ((w & kForkedBit) != 0 && !take_forked) return kForked;
    const uint64_t taken = kBusyBit | (w & kForkedBit) | (fork_generation() << 2);
    if (word_.compare_exchange_weak(w, taken, std::memory_order_acq_rel,
                                    std::memory_order_relaxed)) {
      owner_.store(this_thread_number(), std::memory_order_relaxed);
      return kOk;
    }
  }
}

StateLock::Waited StateLock::wait_until(int64_t deadline_ns) {
  const uint64_t me = this_thread_number();
  int64_t sleep_ns = 1000;
  for (;;) {
    const uint64_t w = observe();
    if ((w & kBusyBit) != 0) {
      if (owner_.load(std::memory_order_relaxed) == me) return kHeldByThisThread;
    } else if ((w & kForkedBit) != 0) {
      return kMarkedForked;
    } else if (try_acquire() == kOk) {
      return kTaken;
    }
    const int64_t now = steady_now_ns();
    if (now >= deadline_ns) return kTimedOut;
    std::this_thread::sleep_for(std::chrono::nanoseconds(std::min(sleep_ns, deadline_ns - now)));
    sleep_ns = std::min(sleep_ns * 2, kWaitMaxSleepNs);
  }
}

void StateLock::release(bool reset_done) {
  owner_.store(0, std::memory_order_relaxed);
  const uint64_t w = word_.load(std::memory_order_relaxed);
  word_.store((w & kForkedBit) != 0 && !reset_done ? kForkedBit : 0, std::memory_order_release);
}

bool StateLock::locked() { return (observe() & kBusyBit) != 0; }

bool StateLock::forked() { return (observe() & kForkedBit) != 0; }

}  // namespace eb
