// Runtime policy of the core (runtime.hpp), compiled once with the baseline flags.
#include "base/runtime.hpp"

#include <atomic>

namespace eb::runtime {
namespace {

std::atomic<int> g_threads{1};

struct ThreadScratch {
  Workspace ws;
  bool held = false;  // a call of this thread is using ws
};

ThreadScratch& thread_scratch() {
  thread_local ThreadScratch tl;
  return tl;
}

}  // namespace

void set_num_threads(int n) { g_threads.store(n < 1 ? 1 : n); }
int num_threads() { return g_threads.load(); }

Workspace* call_workspace(Workspace* given) {
  if (given) return given;
  return &thread_scratch().ws;
}

void trim_workspace(Workspace* given, Workspace* used) {
  if (given == nullptr && used->bytes() > kRetainBytes) used->release();
}

CallScratch::CallScratch(Workspace* given) {
  if (given) {
    ws_ = given;
    return;
  }
  ThreadScratch& t = thread_scratch();
  if (!t.held) {
    t.held = true;
    held_ = &t.held;
    ws_ = &t.ws;
  } else {
    owned_ = new Workspace();
    ws_ = owned_;
  }
}

CallScratch::~CallScratch() {
  if (held_) *held_ = false;
  delete owned_;
}

}  // namespace eb::runtime
