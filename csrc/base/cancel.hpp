// Stopping a long call midway (SPEC 2.5): the thread that called into the core (the caller) can
// carry a Watch, whose poll callback it runs at cancel points about every kPollNs. When the
// callback asks to stop, the cancel point throws cancel::Stopped; the region's other threads
// finish the chunks they hold and claim no more (an exception thrown in a chunk ends the region,
// pool.hpp), and the exception unwinds to whoever installed the Watch, which restores what the
// call had written (undo.hpp) and reports the stop.
//
// Cancel points: between the pieces parallel_for cuts a region into while a watch is armed
// (parallel.hpp: pieces of about kPieceNs), at every chunk the caller claims in a pool region,
// and inside the few loops one item of which can run long (the GEMM's row blocks, the Mamba-2
// scan's token runs). They are no-ops on a thread without a watch (pool helpers, calls not
// expected to be long) and once the call has disarmed its watch (before a state write it cannot
// undo). A stop never changes a bit of a call that completes: pieces and chunks split only
// independent output items (parallel.hpp).
//
// Nothing here knows about Python: the callback is a plain function pointer (the bindings' one
// runs the interpreter's pending signal handlers). Compiled once, with the baseline flags.
#pragma once
#include <atomic>
#include <cstdint>
#include <exception>

namespace eb::cancel {

// Thrown by a cancel point when the poll asked the call to stop.
class Stopped : public std::exception {
 public:
  const char* what() const noexcept override;  // out of line: one vtable, in cancel.cpp
};

struct Poller {
  bool (*poll)(void* ctx) = nullptr;  // true: stop the call; must not throw
  void* ctx = nullptr;
};

inline constexpr int64_t kPollNs = 20000000;      // a poll is due this long after the previous one
inline constexpr int64_t kPieceNs = 10000000;     // the length parallel_for aims its pieces at
inline constexpr int64_t kWatchMinNs = 20000000;  // calls expected shorter are not watched

// Arms a watch on the calling thread for one call: cancel points of this thread poll `p`.
// est_ns, the call's expected length (estimate_ns), sizes the first piece of each region.
// Watches nest (a signal handler run by a poll may itself call into the core): the destructor
// puts the previous one back. Construct and destroy on the same thread.
class Watch {
 public:
  Watch(Poller p, int64_t est_ns);
  ~Watch();
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

  Poller poller;
  int64_t est_ns;
  int64_t next_poll_ns;
  bool armed = true;
  bool stopped = false;
  Watch* prev;
};

// Watches alive in the process. Read inline on the hot path: with none (the common case: no
// long call on the main thread), cancel points and watching() are one relaxed load. (static
// inline: every object keeps its own copy, math/abi.hpp.)
extern std::atomic<int> g_watches;
static inline bool any_watch() { return g_watches.load(std::memory_order_relaxed) != 0; }

// A cancel point: polls when the calling thread's watch is armed and a poll is due; throws
// Stopped when the poll asks to stop (and at once at every later point of a stopped call).
void point_slow();
static inline void point() {
  if (any_watch()) point_slow();
}

// From here on, the calling thread's call is not stopped: no more polls, regions run whole.
// A block calls it before it writes caller-owned memory that it has not saved (undo.hpp).
void disarm();

// Whether the calling thread's call can be stopped (parallel_for then runs regions in pieces).
bool watching_slow();
static inline bool watching() { return any_watch() && watching_slow(); }

// Piece sizes, in units of a region's grain: the first from the watch's estimate (about
// kPieceNs if the region were the whole call), then from the time the last piece took.
int64_t first_piece(int64_t units);
int64_t next_piece(int64_t last_units, int64_t last_ns);

int64_t now_ns();  // steady clock

// The watch threshold and the piece length in force (kWatchMinNs, kPieceNs unless a test set
// others: 0 and 0 watch every call and cut every region into single grains, to check that
// pieces never move a bit).
int64_t watch_min_ns();
void set_tuning(int64_t watch_min_ns, int64_t piece_ns);

// Expected nanoseconds of a call of `flops` floating-point operations at the rate measured over
// recent calls (record), for deciding whether a call is worth watching. Scheduling only: never
// a bit of any output.
int64_t estimate_ns(double flops);
void record(double flops, int64_t ns);
inline constexpr double kRecordMinFlops = 1e7;  // shorter calls time mostly their overheads

}  // namespace eb::cancel
