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

}  // namespace eb::runtime
