// Runtime policy of the core (runtime.hpp), compiled once with the baseline flags.
#include "base/runtime.hpp"

#include <atomic>

namespace eb::runtime {
namespace {
std::atomic<int> g_threads{1};
}  // namespace

void set_num_threads(int n) { g_threads.store(n < 1 ? 1 : n); }
int num_threads() { return g_threads.load(); }

Workspace* call_workspace(Workspace* given) {
  if (given) return given;
  thread_local Workspace tl_ws;
  return &tl_ws;
}

void trim_workspace(Workspace* given, Workspace* used) {
  if (given == nullptr && used->bytes() > kRetainBytes) used->release();
}

}  // namespace eb::runtime
