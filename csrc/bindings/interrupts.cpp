// SignalPoll (interrupts.hpp).
#include "bindings/interrupts.hpp"

#include <pthread.h>

#include <atomic>
#include <utility>

namespace eb::bindings {
namespace {

// The thread that runs Python's signal handlers: threading.main_thread() at import, and in a
// forked child the thread that forked (the interpreter makes it the child's main thread).
std::atomic<unsigned long> g_main_thread{0};

void on_fork_child() { g_main_thread.store(PyThread_get_thread_ident()); }

}  // namespace

void init_interrupts() {
  nb::object main = nb::module_::import_("threading").attr("main_thread")();
  g_main_thread.store(nb::cast<unsigned long>(main.attr("ident")));
  pthread_atfork(nullptr, nullptr, on_fork_child);
}

SignalPoll::SignalPoll(double flops)
    : flops_(flops),
      watched_(PyThread_get_thread_ident() == g_main_thread.load() &&
               cancel::estimate_ns(flops) >= cancel::watch_min_ns()) {}

bool SignalPoll::poll(void* self) noexcept {
  auto* p = static_cast<SignalPoll*>(self);
  nb::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  p->error_.emplace();  // takes the exception a handler raised (KeyboardInterrupt, ...)
  return true;
}

void SignalPoll::raise() {
  nb::python_error e = std::move(*error_);
  error_.reset();
  throw e;
}

}  // namespace eb::bindings
