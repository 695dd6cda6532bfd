// StateLock across fork() (csrc/base/state_lock.hpp; tests/robust/test_fork_lock.py builds and
// runs it). Two threads of the parent use one lock without pause, one claiming and freeing it,
// one waiting for it (a snapshot's wait), while the main thread forks, again and again. Each
// child uses the lock at once: it must never block, and it must see what SPEC 2.6 says: a lock
// held by the parent's thread at the fork is free but marked forked (a call's claim refused, a
// snapshot's wait refused, a reset's claim taken, and released with reset_done the mark is
// gone); a lock that was free is simply free. A lock with a mutex held at the fork (a thread
// of the parent inside lock or unlock) blocked such a child forever.
//
// The parent gives each child kChildSeconds and kills it after that: exit status 1 names the
// child that hung or saw a wrong state; 0 when every child passed. stdout: one line
// `forks <n> held <h> free <f>` (h children found the lock held at the fork).
//
// Build: g++ -std=c++17 -O2 -pthread -I csrc tests/cpp/state_lock_check.cpp
//        csrc/base/state_lock.cpp -o state_lock_check
// Run: ./state_lock_check [forks]
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "base/state_lock.hpp"

namespace {

constexpr double kChildSeconds = 10.0;

// Exit codes of a child.
enum ChildExit { kChildHeld = 10, kChildFree = 11, kChildWrong = 12 };

// In the child: the lock's state must follow SPEC 2.6, and no call may block.
int check_child(eb::StateLock& lock) {
  using eb::StateLock;
  if (lock.forked()) {
    if (lock.locked()) return kChildWrong;  // freed when found held by the parent's thread
    if (lock.try_acquire() != StateLock::kForked) return kChildWrong;
    if (lock.wait_until(eb::steady_now_ns() + 1000000) != StateLock::kMarkedForked)
      return kChildWrong;
    if (lock.try_acquire(true) != StateLock::kOk) return kChildWrong;  // a reset's claim
    if (lock.try_acquire(true) != StateLock::kBusy) return kChildWrong;
    lock.release(true);  // every row reset: defined again
    if (lock.forked() || lock.locked()) return kChildWrong;
    if (lock.try_acquire() != StateLock::kOk) return kChildWrong;
    lock.release();
    return kChildHeld;
  }
  if (lock.try_acquire() != StateLock::kOk) return kChildWrong;
  if (lock.wait_until(eb::steady_now_ns() + 1000000) != StateLock::kHeldByThisThread)
    return kChildWrong;
  lock.release();
  if (lock.wait_until(eb::steady_now_ns() + 1000000) != StateLock::kTaken) return kChildWrong;
  lock.release();
  if (lock.locked() || lock.forked()) return kChildWrong;
  return kChildFree;
}

// Waits up to kChildSeconds for child `pid`; its exit code, or -1 (killed) when it hung.
int wait_child(pid_t pid) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(kChildSeconds);
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -2;
    if (std::chrono::steady_clock::now() >= deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int forks = argc > 1 ? std::atoi(argv[1]) : 300;
  eb::StateLock lock;
  std::atomic<bool> stop{false};
  std::thread caller([&] {  // a call: claim, write, free, without pause
    while (!stop.load(std::memory_order_relaxed))
      if (lock.try_acquire() == eb::StateLock::kOk) lock.release();
  });
  std::thread snapshot([&] {  // a snapshot: wait for the lock, bounded
    while (!stop.load(std::memory_order_relaxed))
      if (lock.wait_until(eb::steady_now_ns() + 200000) == eb::StateLock::kTaken) lock.release();
  });
  int held = 0, free = 0, bad = 0;
  for (int i = 0; i < forks && bad == 0; ++i) {
    std::fflush(stdout);
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("fork");
      bad = 1;
      break;
    }
    if (pid == 0) _exit(check_child(lock));
    const int code = wait_child(pid);
    if (code == kChildHeld) {
      ++held;
    } else if (code == kChildFree) {
      ++free;
    } else {
      std::fprintf(stderr, "child %d of %d: %s (exit %d)\n", i, forks,
                   code == -1 ? "hung on the lock, killed" : "saw a wrong lock state", code);
      bad = 1;
    }
  }
  stop.store(true);
  caller.join();
  snapshot.join();
  std::printf("forks %d held %d free %d\n", held + free, held, free);
  return bad;
}
