// Process-wide runtime policy of the core: the thread count calls use, and the scratch
// workspace a call without a decode session reuses (one per OS thread, trimmed after a call
// that grew it past kRetainBytes). Neither ever changes an output bit (SPEC 3.1).
#pragma once
#include <cstddef>

#include "base/workspace.hpp"

namespace eb::runtime {

// Threads of later calls (>= 1; the Python layer validates and caps the value).
void set_num_threads(int n);
int num_threads();

// Scratch kept between calls: the given workspace (a decode session's), else this OS thread's
// own, so repeated prefills do not pay page faults for fresh scratch. A block serves
// concurrent calls: each thread has its own workspace.
Workspace* call_workspace(Workspace* given);

// After a call: this thread's own workspace is released when it holds more than
// kRetainBytes (a session's workspace is never trimmed).
inline constexpr size_t kRetainBytes = size_t{256} << 20;  // a Llama-1B 512-token prefill: ~75 MB
void trim_workspace(Workspace* given, Workspace* used);

// The workspace of one call, held for the call's duration: call_workspace(given), except that
// when this thread's own is already held by a call further up the same thread's stack (a
// signal handler that a poll ran, base/cancel.hpp, called into the core again), the inner call
// gets a workspace of its own instead of growing the outer call's buffers under it.
class CallScratch {
 public:
  explicit CallScratch(Workspace* given);
  ~CallScratch();
  CallScratch(const CallScratch&) = delete;
  CallScratch& operator=(const CallScratch&) = delete;
  Workspace* get() const { return ws_; }

 private:
  Workspace* ws_ = nullptr;
  bool* held_ = nullptr;        // this thread's flag, when ws_ is this thread's own
  Workspace* owned_ = nullptr;  // the inner call's own
};

}  // namespace eb::runtime
