// StateLock: the lock of one caller-owned state (SPEC 2.6), and the process's fork generation.
//
// A state is used by one call at a time: a call claims the lock without waiting (busy: the call
// is refused), a snapshot waits for it, bounded (wait_until). A lock found held in a forked
// child by a thread of the parent (taken in an older fork generation) is freed and marked
// forked: the parent's call was writing the state when the process forked, so its contents are
// undefined; calls and snapshots refuse the state until a reset of all its rows (a claim with
// take_forked, released with reset_done) clears the mark.
//
// No mutex and no condition variable: the lock is one atomic word (and the holder's thread
// number), so a fork() at any instant leaves the child a lock it can read and take. A mutex
// held, or a condition variable waited on, by a thread of the parent at the fork would block
// the child on its first use, forever (that thread does not exist in the child). A waiter polls
// with short sleeps (kWaitMaxSleepNs at most), which only snapshots do. Nothing here knows about
// Python: the bindings (bindings/state.cpp) add the GIL release and Ctrl-C between the slices
// of a wait. Compiled once, with the baseline flags.
#pragma once
#include <atomic>
#include <cstdint>

namespace eb {

// The process's fork generation: 0 in the process that loaded the core, plus one in the child
// of every fork (a pthread_atfork child handler, registered when the core is loaded).
uint64_t fork_generation();

class StateLock {
 public:
  enum Acquired { kOk = 0, kBusy = 1, kForked = 2 };
  // The outcome of wait_until.
  enum Waited { kTaken = 0, kHeldByThisThread = 1, kTimedOut = 2, kMarkedForked = 3 };

  StateLock() = default;
  StateLock(const StateLock&) = delete;
  StateLock& operator=(const StateLock&) = delete;

  // Takes the lock if it is free and not marked forked (take_forked: a reset's claim, which may
  // take a lock marked forked). Never waits.
  Acquired try_acquire(bool take_forked = false);
  // Waits for the lock until the steady clock reaches deadline_ns (steady_now_ns) and takes it:
  // kTaken; kHeldByThisThread when the holder is the calling thread (waiting would deadlock),
  // kMarkedForked when the lock is free but marked forked, kTimedOut at the deadline.
  Waited wait_until(int64_t deadline_ns);
  // Frees the lock (the holder only). reset_done: a reset of every row ran under this claim,
  // so the state is defined again and the forked mark is cleared.
  void release(bool reset_done = false);
  bool locked();
  // Whether the lock was found held by a thread of the parent after a fork (and no reset of
  // every row has run since).
  bool forked();

  static constexpr int64_t kWaitMaxSleepNs = 1000000;

 private:
  // word_: bit 0 busy, bit 1 forked, bits 2..63 the fork generation the holder took it in.
  static constexpr uint64_t kBusyBit = 1, kForkedBit = 2;
  // word_ after freeing a holder of an older fork generation (a thread of the parent process).
  uint64_t observe();

  std::atomic<uint64_t> word_{0};
  std::atomic<uint64_t> owner_{0};  // the holder's thread number (this_thread_number), 0: none
};

// A number for the calling thread, unique in the process's lifetime and never 0.
uint64_t this_thread_number();

// The steady clock in nanoseconds (the deadlines of wait_until).
int64_t steady_now_ns();

}  // namespace eb
