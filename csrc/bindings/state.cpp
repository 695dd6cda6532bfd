// _core.StateLock (base/state_lock.hpp) and the context managers that claim it, the undo log of
// a whole-model call (base/undo.hpp), and the resets of a state's rows as one native step.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "base/check.hpp"
#include "base/runtime.hpp"
#include "base/state_lock.hpp"
#include "base/undo.hpp"
#include "bindings/call.hpp"
#include "bindings/common.hpp"

namespace eb::bindings {
namespace {

// "Class.method" of a claim's message "Class.method: ...".
std::string where_of(const std::string& message) { return message.substr(0, message.find(": ")); }

// What a call or a snapshot of a state held at a fork raises in the child.
std::string forked_message(const std::string& message) {
  return where_of(message) +
         ": the state was in use by a call on another thread when the process forked; its "
         "contents are undefined here: reset() it (all rows) or allocate a new one";
}

// Waits (GIL released, in slices of 50 ms so that Ctrl-C is seen) up to `timeout` seconds for
// `lock`. Returns 0 on success, 1 when the holder is this thread (waiting would deadlock), 2 on
// timeout, 3 when the lock is marked forked.
int acquire_for(StateLock& lock, double timeout) {
  constexpr int64_t kSliceNs = 50000000;
  const double seconds = std::min(std::max(timeout, 0.0), 1e9);
  const int64_t deadline = steady_now_ns() + static_cast<int64_t>(seconds * 1e9);
  for (;;) {
    StateLock::Waited r;
    {
      nb::gil_scoped_release release;
      r = lock.wait_until(std::min(deadline, steady_now_ns() + kSliceNs));
    }
    if (r == StateLock::kTaken) return 0;
    if (r == StateLock::kHeldByThisThread) return 1;
    if (r == StateLock::kMarkedForked) return 3;
    if (PyErr_CheckSignals() != 0) throw nb::python_error();
    if (steady_now_ns() >= deadline) return 2;
  }
}

// `with lock.claim(message):` (a call: refuse at once with RuntimeError(message) when busy) or
// `with lock.hold(where, timeout):` (a snapshot: wait, bounded).
// `with lock.transaction(message, undo):` (a whole-model call) is a call's claim whose exit
// also ends the undo log's transaction: an exception leaving the block rolls back every entry
// (every layer the call wrote), otherwise they are committed (forgotten).
// `with lock.reset_claim(message, all_rows):` (a reset) is a call's claim that may also take a
// lock marked forked when every row is reset; leaving it without an exception clears the mark.
struct StateClaim {
  nb::object owner;  // keeps the StateLock alive
  StateLock* lock = nullptr;
  std::string message;
  double timeout = -1.0;  // < 0: do not wait
  bool held = false;
  bool reset_all = false;  // a reset of every row: may take (and clears) a forked lock
  nb::object undo_owner;   // keeps the UndoLog alive
  UndoLog* undo = nullptr;

  void enter() {
    if (held) throw std::runtime_error("state claim entered twice");
    if (timeout < 0.0) {
      const StateLock::Acquired r = lock->try_acquire(reset_all);
      if (r == StateLock::kBusy) throw std::runtime_error(message);
      if (r == StateLock::kForked) throw std::runtime_error(forked_message(message));
    } else {
      const int r = acquire_for(*lock, timeout);
      if (r == 1)
        throw std::runtime_error(message +
                                 ": the state is in use by a call of this same thread (from a "
                                 "signal handler?); take the snapshot after the call returns");
      if (r == 2)
        throw std::runtime_error(message +
                                 ": the state is in use by another call that did not "
                                 "finish within " +
                                 std::to_string(timeout) + " s");
      if (r == 3) throw std::runtime_error(forked_message(message));
    }
    held = true;
    if (undo != nullptr) undo->commit();  // an empty log: this transaction's entries only
  }
  // failed: an exception is leaving the with block
  void exit(bool failed) {
    if (!held) return;
    if (undo != nullptr) {
      if (failed) {
        undo->rollback(0);
      }
      undo->commit();
    }
    held = false;
    lock->release(reset_all && !failed);
  }
};

}  // namespace

void bind_state(nb::module_& m) {
  // The state lock (base/state_lock.hpp) and its two context managers.
  nb::class_<StateClaim>(m, "StateClaim")
      .def("__enter__", [](StateClaim& c) { c.enter(); })
      .def("__exit__", [](StateClaim& c, nb::args args) {
        c.exit(args.size() > 0 && !args[0].is_none());
        return false;
      });
  // The undo log of a whole-model call (base/undo.hpp): block calls given it save what they
  // overwrite; StateLock.transaction rolls it back or commits it.
  nb::class_<UndoLog>(m, "UndoLog")
      .def(nb::init<>())
      .def("__len__", &UndoLog::size)
      .def_prop_ro("nbytes", &UndoLog::bytes);
  nb::class_<StateLock>(m, "StateLock")
      .def(nb::init<>())
      // `with lock.claim(message):` a call's claim: RuntimeError(message) at once when busy
      .def(
          "claim",
          [](nb::handle self, std::string message) {
            StateClaim c;
            c.owner = nb::borrow(self);
            c.lock = nb::cast<StateLock*>(self);
            c.message = std::move(message);
            return c;
          },
          nb::arg("message"))
      // `with lock.hold(where, timeout):` a snapshot's claim: waits up to timeout seconds (GIL
      // released; Ctrl-C is seen), RuntimeError naming `where` on timeout or when this very
      // thread holds the lock
      .def(
          "hold",
          [](nb::handle self, std::string where, double timeout) {
            StateClaim c;
            c.owner = nb::borrow(self);
            c.lock = nb::cast<StateLock*>(self);
            c.message = std::move(where);
            c.timeout = timeout;
            return c;
          },
          nb::arg("where"), nb::arg("timeout"))
      // `with lock.transaction(message, undo):` a whole-model call's claim (StateClaim above)
      .def(
          "transaction",
          [](nb::handle self, std::string message, nb::handle undo) {
            StateClaim c;
            c.owner = nb::borrow(self);
            c.lock = nb::cast<StateLock*>(self);
            c.message = std::move(message);
            c.undo_owner = nb::borrow(undo);
            c.undo = nb::cast<UndoLog*>(undo);
            return c;
          },
          nb::arg("message"), nb::arg("undo"))
      // `with lock.reset_claim(message, all_rows):` a reset's claim (StateClaim above)
      .def(
          "reset_claim",
          [](nb::handle self, std::string message, bool all_rows) {
            StateClaim c;
            c.owner = nb::borrow(self);
            c.lock = nb::cast<StateLock*>(self);
            c.message = std::move(message);
            c.reset_all = all_rows;
            return c;
          },
          nb::arg("message"), nb::arg("all_rows"))
      .def("locked", &StateLock::locked)
      // whether the lock was found held by a thread of the parent after a fork (and no reset of
      // every row has run since)
      .def("forked", &StateLock::forked);

  // reset(rows) of either state as one native step: zero rows of both float buffers, then
  // their counters. Everything is checked before the first write.
  m.def(
      "reset_rows",
      [](MArr a, MArr b, IOut row_tokens, IArr rows) {
        const int64_t B = static_cast<int64_t>(row_tokens.shape(0));
        EB_CHECK(a.ndim() >= 1 && b.ndim() >= 1 && static_cast<int64_t>(a.shape(0)) == B &&
                     static_cast<int64_t>(b.shape(0)) == B,
                 "buffers must have batch rows");
        for (size_t i = 0; i < rows.shape(0); ++i)
          EB_CHECK(rows.data()[i] >= 0 && rows.data()[i] < B, "row out of range");
        const size_t ra = B ? a.size() / static_cast<size_t>(B) : 0;
        const size_t rb = B ? b.size() / static_cast<size_t>(B) : 0;
        nb::gil_scoped_release release;
        for (size_t i = 0; i < rows.shape(0); ++i) {
          const auto r = static_cast<size_t>(rows.data()[i]);
          std::fill_n(a.data() + r * ra, ra, 0.0f);
          std::fill_n(b.data() + r * rb, rb, 0.0f);
          row_tokens.data()[r] = 0;
        }
      },
      nb::arg("a"), nb::arg("b"), nb::arg("row_tokens"), nb::arg("rows"));
  // ModelState.reset: reset_rows of every layer (layers: a list of (lock, a, b, row_tokens)) as
  // one native step, so that no exception can leave some layers reset and others not. Every
  // layer's lock is taken first, all of them or none (RuntimeError(message) when one is in
  // use), and everything is checked before the first write.
  m.def(
      "reset_layers",
      [](nb::list layers, IArr rows, const std::string& message) {
        struct Layer {
          StateLock* lock;
          MArr a, b;
          IOut rt;
        };
        std::vector<Layer> ls;
        for (nb::handle item : layers) {
          nb::tuple t = nb::cast<nb::tuple>(item);
          EB_CHECK(t.size() == 4, "reset_layers: each layer is (lock, a, b, row_tokens)");
          ls.push_back(Layer{nb::cast<StateLock*>(t[0]), nb::cast<MArr>(t[1], false),
                             nb::cast<MArr>(t[2], false), nb::cast<IOut>(t[3], false)});
        }
        for (const Layer& l : ls) {
          const int64_t B = static_cast<int64_t>(l.rt.shape(0));
          EB_CHECK(l.a.ndim() >= 1 && l.b.ndim() >= 1 && static_cast<int64_t>(l.a.shape(0)) == B &&
                       static_cast<int64_t>(l.b.shape(0)) == B,
                   "buffers must have batch rows");
          for (size_t i = 0; i < rows.shape(0); ++i)
            EB_CHECK(rows.data()[i] >= 0 && rows.data()[i] < B, "row out of range");
        }
        // every row of every layer: a layer lock held by a thread of the parent at a fork may
        // be taken (and its mark cleared, StateLock); a reset of some rows cannot define it
        bool all_rows = true;
        for (const Layer& l : ls) {
          std::vector<char> seen(l.rt.shape(0), 0);
          for (size_t i = 0; i < rows.shape(0); ++i) seen[static_cast<size_t>(rows.data()[i])] = 1;
          all_rows = all_rows && std::all_of(seen.begin(), seen.end(), [](char c) { return c; });
        }
        size_t taken = 0;
        StateLock::Acquired why = StateLock::kOk;
        for (; taken < ls.size(); ++taken) {
          why = ls[taken].lock->try_acquire(all_rows);
          if (why != StateLock::kOk) break;
        }
        if (taken < ls.size()) {
          for (size_t i = 0; i < taken; ++i) ls[i].lock->release();
          throw std::runtime_error(why == StateLock::kForked ? forked_message(message) : message);
        }
        {
          nb::gil_scoped_release release;
          for (Layer& l : ls) {
            const auto B = static_cast<size_t>(l.rt.shape(0));
            const size_t ra = B ? l.a.size() / B : 0, rb = B ? l.b.size() / B : 0;
            for (size_t i = 0; i < rows.shape(0); ++i) {
              const auto r = static_cast<size_t>(rows.data()[i]);
              std::fill_n(l.a.data() + r * ra, ra, 0.0f);
              std::fill_n(l.b.data() + r * rb, rb, 0.0f);
              l.rt.data()[r] = 0;
            }
          }
        }
        for (Layer& l : ls) l.lock->release(all_rows);
      },
      nb::arg("layers"), nb::arg("rows"), nb::arg("message"));
  // Bytes held by this OS thread's own scratch workspace (tests: a failed call keeps none).
  m.def("_thread_workspace_bytes", []() { return runtime::call_workspace(nullptr)->bytes(); });
}

}  // namespace eb::bindings
