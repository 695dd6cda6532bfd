// Ctrl-C and signal handlers that raise, during a long call (SPEC 2.5): the Python side of
// base/cancel.hpp. A watched call's cancel points run the interpreter's pending signal handlers
// (PyErr_CheckSignals, what the interpreter itself does between bytecodes), taking the GIL for
// the moment; when one raises, the call stops, rolls back what it wrote, and raises that
// exception.
#pragma once
#include <nanobind/nanobind.h>

#include <optional>

#include "base/cancel.hpp"

namespace eb::bindings {

namespace nb = nanobind;

// One call's signal polling, made with the GIL held before the call releases it. The call is
// watched only on the interpreter's main thread, the one thread that runs signal handlers
// (PyErr_CheckSignals does nothing on another), and only when it is expected to take at least
// cancel::kWatchMinNs; any other call sees a pending handler when it returns, as before.
class SignalPoll {
 public:
  explicit SignalPoll(double flops);
  SignalPoll(const SignalPoll&) = delete;
  SignalPoll& operator=(const SignalPoll&) = delete;

  bool watched() const { return watched_; }
  double flops() const { return flops_; }
  cancel::Poller poller() { return cancel::Poller{&SignalPoll::poll, this}; }
  // With the GIL held, after the call stopped: throws the exception the handler raised.
  [[noreturn]] void raise();

 private:
  static bool poll(void* self) noexcept;
  double flops_;
  bool watched_;
  std::optional<nb::python_error> error_;
};

// Records the interpreter's main thread (and, after a fork, the child's); module init.
void init_interrupts();

}  // namespace eb::bindings
