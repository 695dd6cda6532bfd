// The two blocks and their typed configs (blocks/*/config.hpp). Python fills a config in one
// place (exactblocks/{transformer,mamba2}/config.py) and builds a core from it and the
// canonical weights; each call checks cheap invariants, builds the call struct and runs the
// kernel table's forward with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/cancel.hpp"
#include "base/check.hpp"
#include "base/fpenv.hpp"
#include "base/runtime.hpp"
#include "base/undo.hpp"
#include "base/workspace.hpp"
#include "bindings/common.hpp"
#include "bindings/interrupts.hpp"
#include "blocks/mamba2/model.hpp"
#include "blocks/transformer/model.hpp"
#include "dispatch/kernel_table.hpp"

namespace eb::bindings {
namespace {

using blocks::Mamba2Call;
using blocks::Mamba2Config;
using blocks::Mamba2Model;
using blocks::TransformerCall;
using blocks::TransformerConfig;
using blocks::TransformerModel;

using U8Arr = nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>;

// weights: name -> float32 array; blocks: name -> (ggml type, uint8 array of GGUF blocks) for
// projection matrices read straight from a GGUF file (their sizes were checked by Python).
WeightMap weight_map(const nb::dict& weights, const nb::dict& blocks, std::vector<CArr>& keep,
                     std::vector<nb::object>& keep_blocks) {
  WeightMap out;
  for (auto [k, v] : weights) {
    keep.push_back(nb::cast<CArr>(v, false));
    out.f32[nb::cast<std::string>(k)] = keep.back().data();
  }
  for (auto [k, v] : blocks) out.blocks[nb::cast<std::string>(k)] = matrix_source(v, keep_blocks);
  return out;
}

// The packed matrix a core stores under `name` (the names of weight_storage).
template <class Model>
const ops::PackedMatrix& packed_by_name(const Model& t, const std::string& name);

template <>
const ops::PackedMatrix& packed_by_name(const TransformerModel& t, const std::string& name) {
  if (name == "qkv_proj") return t.w_qkv;
  if (name == "o_proj") return t.w_o;
  if (name == "gate_up_proj" || name == "up_proj") return t.w_gu;
  if (name == "down_proj") return t.w_down;
  throw nb::value_error(("no packed matrix " + name).c_str());
}

template <>
const ops::PackedMatrix& packed_by_name(const Mamba2Model& t, const std::string& name) {
  if (name == "in_proj") return t.w_in;
  if (name == "out_proj") return t.w_out;
  throw nb::value_error(("no packed matrix " + name).c_str());
}

using IOut = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// The process's fork generation: bumped in the child of every fork (pthread_atfork). A state
// lock taken in an older generation was held by a thread of the parent, which does not exist in
// the child: no call runs there, but the state's contents are whatever that call had written
// when the process forked (SPEC 2.6).
std::atomic<uint64_t> g_fork_generation{0};

void on_fork_child_bump_generation() { g_fork_generation.fetch_add(1, std::memory_order_relaxed); }

uint64_t fork_generation() {
  // Registered by the first lock made: every lock that can be held at a fork is made after it.
  static const bool registered =
      (pthread_atfork(nullptr, nullptr, on_fork_child_bump_generation), true);
  (void)registered;
  return g_fork_generation.load(std::memory_order_relaxed);
}

// "Class.method" of a claim's message "Class.method: ...".
std::string where_of(const std::string& message) { return message.substr(0, message.find(": ")); }

// What a call or a snapshot of a state held at a fork raises in the child.
std::string forked_message(const std::string& message) {
  return where_of(message) +
         ": the state was in use by a call on another thread when the process forked; its "
         "contents are undefined here: reset() it (all rows) or allocate a new one";
}

// A state's lock (SPEC 2.6). Claimed through a context manager whose __enter__ and __exit__ are
// native, so no Python-level exception (KeyboardInterrupt, a signal handler that raises) can
// fall between taking the lock and entering the protected region, or between leaving it and
// releasing the lock: the interpreter calls __exit__ whenever __enter__ returned.
// A lock found held in a forked child by a thread of the parent (taken in an older fork
// generation) is released and marked forked: calls and snapshots refuse the state until a reset
// of all its rows (a reset claim) clears the mark.
class StateLock {
 public:
  enum Acquired { kOk = 0, kBusy = 1, kForked = 2 };
  StateLock() { (void)fork_generation(); }
  // take_forked: a reset's claim, which may take a lock marked forked.
  Acquired try_acquire(bool take_forked = false) {
    std::lock_guard<std::mutex> g(m_);
    check_fork();
    if (busy_) return kBusy;
    if (forked_ && !take_forked) return kForked;
    take();
    return kOk;
  }
  // Waits (GIL released, in slices so that Ctrl-C is seen) up to `timeout` seconds. Returns 0
  // on success, 1 when the holder is this thread (waiting would deadlock), 2 on timeout, 3 when
  // the lock is marked forked.
  int acquire_for(double timeout) {
    using Clock = std::chrono::steady_clock;
    const Clock::time_point deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(std::min(std::max(timeout, 0.0), 1e9)));
    for (;;) {
      {
        std::lock_guard<std::mutex> g(m_);
        check_fork();
        if (forked_ && !busy_) return 3;
        if (busy_ && owner_ == std::this_thread::get_id()) return 1;
      }
      bool got = false;
      {
        nb::gil_scoped_release release;
        std::unique_lock<std::mutex> lk(m_);
        const Clock::time_point slice =
            std::min(deadline, Clock::now() + Clock::duration(std::chrono::milliseconds(50)));
        got = cv_.wait_until(lk, slice, [&] { return !busy_; });
        if (got && !forked_) take();
      }
      if (got && !forked_) return 0;
      if (got) return 3;
      if (PyErr_CheckSignals() != 0) throw nb::python_error();
      if (Clock::now() >= deadline) return 2;
    }
  }
  // reset_done: a reset of every row ran under this claim, so the state is defined again.
  void release(bool reset_done = false) {
    {
      std::lock_guard<std::mutex> g(m_);
      busy_ = false;
      owner_ = std::thread::id();
      if (reset_done) forked_ = false;
    }
    cv_.notify_all();
  }
  bool locked() {
    std::lock_guard<std::mutex> g(m_);
    check_fork();
    return busy_;
  }
  bool forked() {
    std::lock_guard<std::mutex> g(m_);
    check_fork();
    return forked_;
  }

 private:
  void take() {
    busy_ = true;
    owner_ = std::this_thread::get_id();
    generation_ = fork_generation();
  }
  // m_ held. A holder of an older fork generation is a thread of the parent process.
  void check_fork() {
    if (busy_ && generation_ != fork_generation()) {
      busy_ = false;
      owner_ = std::thread::id();
      forked_ = true;
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  bool busy_ = false;
  bool forked_ = false;
  uint64_t generation_ = 0;
  std::thread::id owner_;
};

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
      const int r = lock->acquire_for(timeout);
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

// Scratch or output memory that could not be allocated: a MemoryError whose message the Python
// layer prefixes with `Class.method: ` (SPEC 2.7).
struct CallAllocError : std::bad_alloc {
  std::string msg;
  explicit CallAllocError(std::string m) : msg(std::move(m)) {}
  const char* what() const noexcept override { return msg.c_str(); }
};

OutArr new_output(int64_t B, int64_t L, int64_t d) {
  try {
    return new_array({static_cast<size_t>(B), static_cast<size_t>(L), static_cast<size_t>(d)});
  } catch (const std::bad_alloc&) {
    throw CallAllocError("cannot allocate the output of shape (" + std::to_string(B) + ", " +
                         std::to_string(L) + ", " + std::to_string(d) + ") float32 (" +
                         std::to_string(B * L * d * 4) + " bytes)");
  }
}

// Runs a block kernel with the GIL released; its cancel points poll for signal handlers when
// `poll` is watched (interrupts.hpp). A failed call leaves nothing of its own behind: a stop
// (a handler raised: that exception is raised here) or any other exception rolls back the
// entries `undo` got during this call (older ones are the caller's: a whole-model call's
// earlier layers), and scratch that could not be allocated releases the workspace the call
// used (so a failed call keeps no scratch alive) and becomes a MemoryError naming the memory.
template <class Fn>
void run_kernel(Workspace* given, Workspace* used, int64_t tokens, SignalPoll& poll, UndoLog* undo,
                Fn&& fn) {
  size_t held = 0;
  bool failed = false, stopped = false;
  const size_t mark = undo != nullptr ? undo->size() : 0;
  {
    nb::gil_scoped_release release;
    const bool timed = poll.flops() >= cancel::kRecordMinFlops;
    const int64_t t0 = timed ? cancel::now_ns() : 0;
    try {
      {
        std::optional<cancel::Watch> watch;
        if (poll.watched()) watch.emplace(poll.poller(), cancel::estimate_ns(poll.flops()));
        fn();
      }
      if (timed) cancel::record(poll.flops(), cancel::now_ns() - t0);
      runtime::trim_workspace(given, used);
    } catch (const cancel::Stopped&) {
      if (undo != nullptr) undo->rollback(mark);
      stopped = true;
    } catch (const std::bad_alloc&) {
      if (undo != nullptr) undo->rollback(mark);
      held = used->bytes();
      used->release();
      failed = true;
    } catch (...) {
      if (undo != nullptr) undo->rollback(mark);
      used->release();
      throw;
    }
  }
  if (stopped) poll.raise();
  if (failed)
    throw CallAllocError("cannot allocate scratch memory for " + std::to_string(tokens) +
                         " tokens (an allocation failed after " + std::to_string(held) +
                         " bytes of scratch; they have been released)");
}

// Floating-point operations of a call, roughly: 2 per weight per token, the attention's score
// and value passes, the Mamba-2 scan. Only for deciding whether to watch it (cancel.hpp).
double matrix_flops(const ops::PackedMatrix& w, double tokens) {
  return 2.0 * tokens * static_cast<double>(w.n_out) * static_cast<double>(w.k_in);
}

double transformer_flops(const TransformerModel& m, const int64_t* lengths, const int64_t* start,
                         int64_t batch) {
  const TransformerConfig& c = m.cfg;
  double f = 0.0;
  for (int64_t b = 0; b < batch; ++b) {
    const double len = static_cast<double>(lengths[b]);
    double keys = static_cast<double>(start[b]) + 0.5 * len;  // per query, on average
    if (c.window > 0) keys = std::min(keys, static_cast<double>(c.window));
    f += matrix_flops(m.w_qkv, len) + matrix_flops(m.w_o, len) + matrix_flops(m.w_gu, len) +
         matrix_flops(m.w_down, len);
    if (blocks::has_attention(c))
      f += 4.0 * len * keys * static_cast<double>(c.n_heads * c.head_dim);
  }
  return f;
}

double mamba2_flops(const Mamba2Model& m, double tokens) {
  const Mamba2Config& c = m.cfg;
  return matrix_flops(m.w_in, tokens) + matrix_flops(m.w_out, tokens) +
         6.0 * tokens * static_cast<double>(c.n_heads * c.head_dim * c.d_state);
}

// A Mamba-2 block call saves the state rows it writes (so that it can be stopped in the middle
// of writing them) when it has at least this many tokens per advancing row: the copy of h is
// then small next to the work. A decode step is not stopped once it writes (it is short).
constexpr int64_t kSaveMinTokensPerRow = 16;

// row_tokens[b] = start[b] + lengths[b]: the counters of a completed call, written in the same
// native step as the buffers (no Python code runs in between).
void commit_counters(IOut* row_tokens, const IArr& start, const IArr& lengths, int64_t B) {
  if (row_tokens == nullptr) return;
  for (int64_t b = 0; b < B; ++b) row_tokens->data()[b] = start.data()[b] + lengths.data()[b];
}

int64_t total_tokens(const IArr& lengths) {
  int64_t m = 0;
  for (size_t b = 0; b < lengths.shape(0); ++b) m += lengths.data()[b];
  return m;
}

void check_rows(const IArr& a, int64_t batch, const char* name) {
  EB_CHECK(static_cast<int64_t>(a.shape(0)) == batch,
           std::string(name) + " must have batch entries");
}

nb::list storage_list(
    std::initializer_list<std::pair<const char*, const ops::PackedMatrix*>> items) {
  nb::list out;
  for (const auto& [name, pm] : items) {
    if (pm->parts.empty()) {
      out.append(nb::make_tuple(std::string(name), std::string(pm->format_name()), pm->bytes()));
      continue;
    }
    for (const ops::PackedMatrix& part : pm->parts)  // a mixed stack: one entry per part
      out.append(nb::make_tuple(std::string(name), std::string(part.format_name()), part.bytes()));
  }
  return out;
}

// One layer of a whole-model stack call (layer_stack below): its core, its state's lock,
// buffers and counters, where each row starts and how many positions it may hold.
struct StackLayer {
  const TransformerModel* core = nullptr;  // a transformer layer's, or
  const Mamba2Model* mamba = nullptr;      // a Mamba-2 layer's
  StateLock* lock = nullptr;
  float* k = nullptr;  // KV cache, or a Mamba-2 layer's conv_window
  float* v = nullptr;  // KV cache, or a Mamba-2 layer's h
  int64_t capacity = 0;
  int64_t* row_tokens = nullptr;
  int64_t max_tokens = 0;
  std::vector<int64_t> start;  // the state's counters, read under its lock
  int rope_set = 0;
  bool attn = false;
};

// Whether every real position (t < lengths[b]) of x (B, L, d) is finite: the input check of a
// block call (check_finite in Python), as one pass over the exponent bits.
bool real_rows_finite(const float* x, int64_t B, int64_t L, int64_t d, const int64_t* lengths) {
  for (int64_t b = 0; b < B; ++b) {
    const uint32_t* p = reinterpret_cast<const uint32_t*>(x + b * L * d);
    const int64_t n = lengths[b] * d;
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; ++i)
      bad |= static_cast<uint32_t>((p[i] & 0x7f800000u) == 0x7f800000u);
    if (bad) return false;
  }
  return true;
}

// Whether [a, a + na) and [b, b + nb) (bytes) share memory.
bool overlap(const void* a, size_t na, const void* b, size_t nb) {
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return na > 0 && nb > 0 && pa < pb + nb && pb < pa + na;
}

// A Mamba-2 layer of a stack call, a tuple (core, lock, conv_window, h, row_tokens): cast and
// checked as stack_layer below checks a transformer layer (its buffers exactly the shapes the
// core's configuration gives them).
bool stack_mamba2_layer(const nb::tuple& t, int64_t B, int64_t d, StackLayer& out) {
  if (t.size() != 5 || !nb::try_cast(t[0], out.mamba, false) || out.mamba == nullptr) return false;
  if (!nb::try_cast(t[1], out.lock, false) || out.lock == nullptr) return false;
  MArr cw, h;
  IOut rt;
  if (!nb::try_cast(t[2], cw, false) || !nb::try_cast(t[3], h, false) ||
      !nb::try_cast(t[4], rt, false))
    return false;
  const Mamba2Config& c = out.mamba->cfg;
  if (c.d_model != d || static_cast<int64_t>(rt.shape(0)) != B) return false;
  if (cw.ndim() != 3 || static_cast<int64_t>(cw.shape(0)) != B ||
      static_cast<int64_t>(cw.shape(1)) != c.conv_dim ||
      static_cast<int64_t>(cw.shape(2)) != c.conv_kernel)
    return false;
  if (h.ndim() != 4 || static_cast<int64_t>(h.shape(0)) != B ||
      static_cast<int64_t>(h.shape(1)) != c.n_heads ||
      static_cast<int64_t>(h.shape(2)) != c.head_dim ||
      static_cast<int64_t>(h.shape(3)) != c.d_state)
    return false;
  const size_t cw_bytes = cw.size() * sizeof(float), h_bytes = h.size() * sizeof(float),
               rt_bytes = static_cast<size_t>(B) * 8;
  if (reinterpret_cast<uintptr_t>(cw.data()) % alignof(float) != 0 ||
      reinterpret_cast<uintptr_t>(h.data()) % alignof(float) != 0 ||
      reinterpret_cast<uintptr_t>(rt.data()) % alignof(int64_t) != 0 ||
      overlap(cw.data(), cw_bytes, h.data(), h_bytes) ||
      overlap(cw.data(), cw_bytes, rt.data(), rt_bytes) ||
      overlap(h.data(), h_bytes, rt.data(), rt_bytes))
    return false;
  out.k = cw.data();
  out.v = h.data();
  out.row_tokens = rt.data();
  return true;
}

// Casts layer `h` of a stack call, a tuple (core, lock, k_cache, v_cache, row_tokens,
// max_tokens, rope_set, n_kv_heads, capacity, head_dim) of a state the Python side found to
// belong to the core's configuration, and checks what the block's own call checks of its
// buffers (SPEC 2.5: the arrays themselves, never a converted copy, exactly the state's shapes,
// C-contiguous, aligned, writable and sharing no memory): false, with nothing done, when
// anything is off (the block's own call then raises the error).
bool stack_layer(nb::handle h, int64_t B, int64_t d, StackLayer& out) {
  nb::tuple t;
  if (!nb::try_cast(h, t, false)) return false;
  if (t.size() == 5) return stack_mamba2_layer(t, B, d, out);
  if (t.size() != 10) return false;
  if (!nb::try_cast(t[0], out.core, false) || out.core == nullptr) return false;
  if (!nb::try_cast(t[1], out.lock, false) || out.lock == nullptr) return false;
  MArr k, v;
  IOut rt;
  int64_t n_kv = 0, cap = 0, hd = 0;
  if (!nb::try_cast(t[2], k, false) || !nb::try_cast(t[3], v, false) ||
      !nb::try_cast(t[4], rt, false) || !nb::try_cast(t[5], out.max_tokens, false) ||
      !nb::try_cast(t[6], out.rope_set, false) || !nb::try_cast(t[7], n_kv, false) ||
      !nb::try_cast(t[8], cap, false) || !nb::try_cast(t[9], hd, false))
    return false;
  const TransformerConfig& c = out.core->cfg;
  if (c.d_model != d || static_cast<int64_t>(rt.shape(0)) != B) return false;
  if (!(out.rope_set == 0 || (out.rope_set == 1 && c.rope_scaling == ops::kRopeLongrope)))
    return false;
  const int64_t shape[4] = {B, n_kv, cap, hd};
  for (const MArr* a : {&k, &v}) {
    if (a->ndim() != 4) return false;
    for (size_t i = 0; i < 4; ++i)
      if (static_cast<int64_t>(a->shape(i)) != shape[i]) return false;
  }
  const size_t kv_bytes = k.size() * sizeof(float), rt_bytes = static_cast<size_t>(B) * 8;
  if (reinterpret_cast<uintptr_t>(k.data()) % alignof(float) != 0 ||
      reinterpret_cast<uintptr_t>(v.data()) % alignof(float) != 0 ||
      reinterpret_cast<uintptr_t>(rt.data()) % alignof(int64_t) != 0 ||
      overlap(k.data(), kv_bytes, v.data(), kv_bytes) ||
      overlap(k.data(), kv_bytes, rt.data(), rt_bytes) ||
      overlap(v.data(), kv_bytes, rt.data(), rt_bytes))
    return false;
  out.attn = blocks::has_attention(c);
  if (out.attn && (n_kv != c.n_kv_heads || hd != c.head_dim || cap <= 0)) return false;
  out.capacity = cap;
  out.k = k.data();
  out.v = v.data();
  out.row_tokens = rt.data();
  return true;
}

// The counters of layer `ly` (under its lock): each row's start, in [0, max_tokens] with room
// for its tokens (and within max_positions for an attention layer), as the block checks them.
bool stack_counters(StackLayer& ly, int64_t B, int64_t L, const int64_t* lengths) {
  ly.start.assign(ly.row_tokens, ly.row_tokens + B);
  if (ly.mamba != nullptr) {  // a Mamba-2 layer: counters >= 0, room in int64
    for (int64_t b = 0; b < B; ++b)
      if (ly.start[b] < 0 || lengths[b] < 0 || lengths[b] > L ||
          (lengths[b] > 0 && ly.start[b] > INT64_MAX - lengths[b]))
        return false;
    return true;
  }
  const int64_t limit =
      ly.attn ? std::min<int64_t>(ly.max_tokens, ly.core->cfg.max_positions) : ly.max_tokens;
  for (int64_t b = 0; b < B; ++b)
    if (ly.start[b] < 0 || ly.start[b] > ly.max_tokens || lengths[b] < 0 || lengths[b] > L ||
        ly.start[b] + lengths[b] > limit)
      return false;
  return true;
}

void bind_kinds(nb::module_& m) {
  nb::enum_<ops::NormKind>(m, "NormKind")
      .value("rmsnorm", ops::kRmsNorm)
      .value("layernorm", ops::kLayerNorm)
      .value("rmsnorm_offset", ops::kRmsNormOffset);
  nb::enum_<ops::MlpKind>(m, "MlpKind")
      .value("swiglu", ops::kSwiGlu)
      .value("geglu", ops::kGeGlu)
      .value("geglu_tanh", ops::kGeGluTanh)
      .value("gelu", ops::kGelu)
      .value("gelu_tanh", ops::kGeluTanh)
      .value("relu2", ops::kRelu2);
  nb::enum_<ops::RopeScaling>(m, "RopeScaling")
      .value("default", ops::kRopeDefault)
      .value("linear", ops::kRopeLinear)
      .value("llama3", ops::kRopeLlama3)
      .value("yarn", ops::kRopeYarn)
      .value("longrope", ops::kRopeLongrope);
  nb::enum_<blocks::NormPlacement>(m, "NormPlacement")
      .value("pre", blocks::kNormPre)
      .value("sandwich", blocks::kNormSandwich)
      .value("post", blocks::kNormPost)
      .value("parallel", blocks::kNormParallel);
  nb::enum_<blocks::BlockParts>(m, "BlockParts")
      .value("full", blocks::kBlockFull)
      .value("attention_only", blocks::kBlockAttentionOnly)
      .value("mlp_only", blocks::kBlockMlpOnly);
  nb::enum_<blocks::QkNormScope>(m, "QkNormScope")
      .value("head", blocks::kQkNormHead)
      .value("all_heads", blocks::kQkNormAllHeads)
      .value("per_head_weights", blocks::kQkNormPerHeadWeights);
}

// Every field under its C++ name; Python reads and writes them as attributes.
void bind_configs(nb::module_& m) {
  nb::class_<TransformerConfig>(m, "TransformerConfig")
      .def(nb::init<>())
      .def_rw("d_model", &TransformerConfig::d_model)
      .def_rw("n_heads", &TransformerConfig::n_heads)
      .def_rw("n_kv_heads", &TransformerConfig::n_kv_heads)
      .def_rw("head_dim", &TransformerConfig::head_dim)
      .def_rw("intermediate", &TransformerConfig::intermediate)
      .def_rw("block_parts", &TransformerConfig::block_parts)
      .def_rw("norm_placement", &TransformerConfig::norm_placement)
      .def_rw("window", &TransformerConfig::window)
      .def_rw("attn_softcap", &TransformerConfig::attn_softcap)
      .def_rw("attn_scale", &TransformerConfig::attn_scale)
      .def_rw("residual_multiplier", &TransformerConfig::residual_multiplier)
      .def_rw("rope_dim", &TransformerConfig::rope_dim)
      .def_rw("rope_theta", &TransformerConfig::rope_theta)
      .def_rw("rope_scaling", &TransformerConfig::rope_scaling)
      .def_rw("rope_factor", &TransformerConfig::rope_factor)
      .def_rw("rope_low_freq_factor", &TransformerConfig::rope_low_freq_factor)
      .def_rw("rope_high_freq_factor", &TransformerConfig::rope_high_freq_factor)
      .def_rw("rope_original_max", &TransformerConfig::rope_original_max)
      .def_rw("rope_beta_fast", &TransformerConfig::rope_beta_fast)
      .def_rw("rope_beta_slow", &TransformerConfig::rope_beta_slow)
      .def_rw("rope_truncate", &TransformerConfig::rope_truncate)
      .def_rw("rope_mscale", &TransformerConfig::rope_mscale)
      .def_rw("rope_mscale_all_dim", &TransformerConfig::rope_mscale_all_dim)
      .def_rw("rope_attention_factor", &TransformerConfig::rope_attention_factor)
      .def_rw("rope_short_factor", &TransformerConfig::rope_short_factor)
      .def_rw("rope_long_factor", &TransformerConfig::rope_long_factor)
      .def_rw("max_positions", &TransformerConfig::max_positions)
      .def_rw("norm", &TransformerConfig::norm)
      .def_rw("norm_eps", &TransformerConfig::norm_eps)
      .def_rw("norm_bias", &TransformerConfig::norm_bias)
      .def_rw("qk_norm", &TransformerConfig::qk_norm)
      .def_rw("qk_norm_scope", &TransformerConfig::qk_norm_scope)
      .def_rw("qkv_bias", &TransformerConfig::qkv_bias)
      .def_rw("o_bias", &TransformerConfig::o_bias)
      .def_rw("mlp", &TransformerConfig::mlp)
      .def_rw("mlp_bias", &TransformerConfig::mlp_bias)
      .def_rw("compact_weights", &TransformerConfig::compact_weights);
  nb::class_<Mamba2Config>(m, "Mamba2Config")
      .def(nb::init<>())
      .def_rw("d_model", &Mamba2Config::d_model)
      .def_rw("d_inner", &Mamba2Config::d_inner)
      .def_rw("n_heads", &Mamba2Config::n_heads)
      .def_rw("head_dim", &Mamba2Config::head_dim)
      .def_rw("d_state", &Mamba2Config::d_state)
      .def_rw("n_groups", &Mamba2Config::n_groups)
      .def_rw("conv_dim", &Mamba2Config::conv_dim)
      .def_rw("conv_kernel", &Mamba2Config::conv_kernel)
      .def_rw("norm_eps", &Mamba2Config::norm_eps)
      .def_rw("dt_min", &Mamba2Config::dt_min)
      .def_rw("dt_max", &Mamba2Config::dt_max)
      .def_rw("conv_bias", &Mamba2Config::conv_bias)
      .def_rw("proj_bias", &Mamba2Config::proj_bias)
      .def_rw("compact_weights", &Mamba2Config::compact_weights);
}

}  // namespace

OutArr unpack_array(const ops::PackedMatrix& w, int64_t r0, int64_t r1) {
  EB_CHECK(0 <= r0 && r0 <= r1 && r1 <= w.n_out, "unpack: rows out of range");
  OutArr y = new_array({static_cast<size_t>(r1 - r0), static_cast<size_t>(w.k_in)});
  nb::gil_scoped_release release;
  ops::unpack_rows(w, r0, r1, y.data());
  return y;
}

ops::MatrixSource matrix_source(const nb::handle& value, std::vector<nb::object>& keep) {
  ops::MatrixSource s;
  if (nb::isinstance<nb::tuple>(value)) {
    nb::tuple t = nb::cast<nb::tuple>(value);
    EB_CHECK(t.size() == 2, "GGUF blocks must be given as (ggml type, uint8 array)");
    s.type = nb::cast<int>(t[0]);
    EB_CHECK(ops::ggml_block_size(s.type) > 0, "unsupported GGUF block type");
    keep.push_back(nb::borrow(t[1]));
    s.blocks = nb::cast<U8Arr>(t[1], false).data();
  } else {
    keep.push_back(nb::borrow(value));
    s.f32 = nb::cast<CArr>(value, false).data();
  }
  return s;
}

ops::MatrixSource matrix_source(const nb::handle& value, std::vector<nb::object>& keep,
                                int64_t rows, int64_t k_in, const std::string& what) {
  ops::MatrixSource s = matrix_source(value, keep);
  if (s.f32 != nullptr) {
    const CArr w = nb::cast<CArr>(value, false);
    EB_CHECK(w.ndim() == 2 && static_cast<int64_t>(w.shape(0)) == rows &&
                 static_cast<int64_t>(w.shape(1)) == k_in,
             what + ": float32 weights are not (" + std::to_string(rows) + ", " +
                 std::to_string(k_in) + ")");
  } else {
    const int64_t bs = ops::ggml_block_size(s.type);
    const U8Arr raw = nb::cast<U8Arr>(nb::cast<nb::tuple>(value)[1], false);
    EB_CHECK(
        bs > 0 && k_in % bs == 0 &&
            static_cast<int64_t>(raw.size()) == rows * (k_in / bs) * ops::ggml_type_size(s.type) &&
            (raw.ndim() != 2 || static_cast<int64_t>(raw.shape(0)) == rows),
        what + ": GGUF blocks do not fit (" + std::to_string(rows) + ", " + std::to_string(k_in) +
            ")");
  }
  s.rows = rows;
  return s;
}

void bind_blocks(nb::module_& m) {
  bind_kinds(m);
  bind_configs(m);
  // GGUF blocks -> float32 with gguf.quants' operations (the values the packer stores)
  m.def(
      "dequantize_gguf",
      [](int type, U8Arr blocks) {
        const int64_t bs = ops::ggml_block_size(type), ts = ops::ggml_type_size(type);
        EB_CHECK(bs > 0 && static_cast<int64_t>(blocks.size()) % ts == 0,
                 "dequantize_gguf: unsupported type, or a partial block");
        const int64_t n = static_cast<int64_t>(blocks.size()) / ts * bs;
        OutArr y = new_array({static_cast<size_t>(n)});
        nb::gil_scoped_release release;
        ops::dequantize_gguf(blocks.data(), type, n, y.data());
        return y;
      },
      nb::arg("type"), nb::arg("blocks"));
  // (weights per block, bytes per block) of a GGUF type the packer reads directly, or (0, 0)
  m.def("gguf_block_layout", [](int type) {
    return nb::make_tuple(ops::ggml_block_size(type), ops::ggml_type_size(type));
  });
  nb::class_<TransformerModel>(m, "TransformerCore")
      // [(matrix, format, bytes)] of the packed projections (ops/gemm/format.hpp PanelFormat)
      // [(matrix, format, bytes)] of the packed projections (ops/gemm/format.hpp PanelFormat);
      // a half block lists its own half's only.
      .def_prop_ro("weight_storage",
                   [](const TransformerModel& t) {
                     const char* gu = ops::mlp_is_gated(t.cfg.mlp) ? "gate_up_proj" : "up_proj";
                     if (!blocks::has_mlp(t.cfg))
                       return storage_list({{"qkv_proj", &t.w_qkv}, {"o_proj", &t.w_o}});
                     if (!blocks::has_attention(t.cfg))
                       return storage_list({{gu, &t.w_gu}, {"down_proj", &t.w_down}});
                     return storage_list({{"qkv_proj", &t.w_qkv},
                                          {"o_proj", &t.w_o},
                                          {gu, &t.w_gu},
                                          {"down_proj", &t.w_down}});
                   })
      // The float32 RoPE tables the block rotates with: (inv_freq per set, attention factor).
      // longrope: [short, long]; otherwise one set; no rotation: [[]].
      .def_prop_ro("rope_tables",
                   [](const TransformerModel& t) {
                     const int64_t half = blocks::has_attention(t.cfg) ? t.cfg.rope_dim / 2 : 0;
                     nb::list sets;
                     const auto add = [&](const std::vector<float>& v) {
                       sets.append(std::vector<float>(v.begin(), v.begin() + half));
                     };
                     add(t.inv_freq);
                     if (!t.inv_freq_long.empty()) add(t.inv_freq_long);
                     return nb::make_tuple(sets, t.rope_factor);
                   })
      // cfg: the typed config (copied); weights: canonical short names -> float32 arrays,
      // exactly the set the config needs. Real options become float32 in the constructor,
      // under the FP-environment guard.
      .def(
          "__init__",
          [](TransformerModel* self, const TransformerConfig& cfg, nb::dict weights,
             nb::dict blocks) {
            std::vector<CArr> keep;
            std::vector<nb::object> keep_blocks;
            const WeightMap w = weight_map(weights, blocks, keep, keep_blocks);
            nb::gil_scoped_release release;
            new (self) TransformerModel(cfg, w);
          },
          nb::arg("cfg"), nb::arg("weights"), nb::arg("blocks") = nb::dict())
      // rows [r0, r1) of a packed matrix (a weight_storage name) as float32, rebuilt with the
      // kernels' own operations: the weights it was built from, bit for bit
      .def(
          "unpack",
          [](const TransformerModel& t, const std::string& name, int64_t r0, int64_t r1) {
            return unpack_array(packed_by_name(t, name), r0, r1);
          },
          nb::arg("matrix"), nb::arg("r0"), nb::arg("r1"))
      .def_prop_ro("cfg", [](const TransformerModel& t) { return t.cfg; })
      // check_cache: check the slots each row reads (SPEC 5) while reading them; returns None,
      // with the cache untouched, when one is not finite (Python then names the element).
      // rope_set: longrope's table for this call, 0 = short, 1 = long (TransformerCall). An
      // mlp_only block ignores the caches (any float32 arrays, e.g. empty) and the positions.
      // row_tokens: the state's counters, set to start + lengths after the cache, in the same
      // native step (an interrupt cannot separate them); None for a state-less call.
      .def(
          "forward",
          [](const TransformerModel& mdl,
             nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu> x, IArr lengths,
             IArr start, MArr k_cache, MArr v_cache, Workspace* ws, bool check_cache, int rope_set,
             std::optional<IOut> row_tokens, UndoLog* undo) -> nb::object {
            const int64_t B = static_cast<int64_t>(x.shape(0)),
                          L = static_cast<int64_t>(x.shape(1));
            const TransformerConfig& c = mdl.cfg;
            EB_CHECK(static_cast<int64_t>(x.shape(2)) == c.d_model, "x last dim != d_model");
            check_rows(lengths, B, "lengths");
            check_rows(start, B, "start");
            EB_CHECK(rope_set == 0 || (rope_set == 1 && c.rope_scaling == ops::kRopeLongrope),
                     "rope_set must be 0, or 0 or 1 with longrope");
            if (row_tokens)
              EB_CHECK(static_cast<int64_t>(row_tokens->shape(0)) == B,
                       "row_tokens must have batch entries");
            const bool attn = blocks::has_attention(c);
            int64_t cap = 0;
            if (attn) {  // an MLP-only block reads no cache and no positions (caches ignored)
              EB_CHECK(k_cache.ndim() == 4 && v_cache.ndim() == 4, "cache rank");
              cap = static_cast<int64_t>(k_cache.shape(2));
              EB_CHECK(static_cast<int64_t>(k_cache.shape(0)) == B &&
                           static_cast<int64_t>(k_cache.shape(1)) == c.n_kv_heads &&
                           static_cast<int64_t>(k_cache.shape(3)) == c.head_dim && cap >= 0,
                       "k_cache shape");
              for (size_t i = 0; i < 4; ++i)
                EB_CHECK(k_cache.shape(i) == v_cache.shape(i), "v_cache shape");
              // capacity 0: a state-less call (nothing cached before, nothing kept after)
              for (int64_t b = 0; b < B && cap == 0; ++b)
                EB_CHECK(start.data()[b] == 0, "a call without a cache must start at position 0");
            }
            for (int64_t b = 0; b < B; ++b)
              EB_CHECK(lengths.data()[b] >= 0 && lengths.data()[b] <= L && start.data()[b] >= 0 &&
                           (!attn || start.data()[b] + lengths.data()[b] <= c.max_positions),
                       "lengths/start out of range");
            OutArr y = new_output(B, L, c.d_model);
            nb::object out = nb::cast(y);  // before the call: nothing can fail after the commit
            int cache_bad = 0;
            runtime::CallScratch scratch(ws);
            SignalPoll poll(transformer_flops(mdl, lengths.data(), start.data(),
                                              static_cast<int64_t>(lengths.shape(0))));
            TransformerCall call{x.data(),
                                 y.data(),
                                 B,
                                 L,
                                 lengths.data(),
                                 start.data(),
                                 k_cache.data(),
                                 v_cache.data(),
                                 cap,
                                 runtime::num_threads(),
                                 scratch.get(),
                                 check_cache && attn ? &cache_bad : nullptr,
                                 rope_set,
                                 undo};
            IOut* rt = row_tokens ? &*row_tokens : nullptr;
            run_kernel(ws, call.ws, total_tokens(lengths), poll, undo, [&] {
              if (undo != nullptr && rt != nullptr)
                undo->add_saved(rt->data(), static_cast<size_t>(B));
              kernels().transformer_forward(mdl, call);
              if (!cache_bad) commit_counters(rt, start, lengths, B);
            });
            if (cache_bad) return nb::none();  // a read slot is not finite; the cache is untouched
            return out;
          },
          nb::arg("x"), nb::arg("lengths"), nb::arg("start"), nb::arg("k_cache"),
          nb::arg("v_cache"), nb::arg("workspace").none() = nb::none(),
          nb::arg("check_cache") = false, nb::arg("rope_set") = 0,
          nb::arg("row_tokens").none() = nb::none(), nb::arg("undo").none() = nb::none());

  nb::class_<Mamba2Model>(m, "Mamba2Core")
      .def_prop_ro("weight_storage",
                   [](const Mamba2Model& t) {
                     return storage_list({{"in_proj", &t.w_in}, {"out_proj", &t.w_out}});
                   })
      // cfg: the typed config (copied); weights: canonical short names -> float32 arrays,
      // exactly the set the config needs. Real options become float32 in the constructor,
      // under the FP-environment guard.
      .def(
          "__init__",
          [](Mamba2Model* self, const Mamba2Config& cfg, nb::dict weights, nb::dict blocks) {
            std::vector<CArr> keep;
            std::vector<nb::object> keep_blocks;
            const WeightMap w = weight_map(weights, blocks, keep, keep_blocks);
            nb::gil_scoped_release release;
            new (self) Mamba2Model(cfg, w);
          },
          nb::arg("cfg"), nb::arg("weights"), nb::arg("blocks") = nb::dict())
      // rows [r0, r1) of a packed matrix (a weight_storage name) as float32, rebuilt with the
      // kernels' own operations: the weights it was built from, bit for bit
      .def(
          "unpack",
          [](const Mamba2Model& t, const std::string& name, int64_t r0, int64_t r1) {
            return unpack_array(packed_by_name(t, name), r0, r1);
          },
          nb::arg("matrix"), nb::arg("r0"), nb::arg("r1"))
      .def_prop_ro("cfg", [](const Mamba2Model& t) { return t.cfg; })
      // check_state: check what the call reads of each advancing row (SPEC 8) before writing;
      // returns None, with the state untouched, when a value is not finite.
      // start, row_tokens: the state's counters before the call and the array they live in,
      // set to start + lengths after conv_window and h in the same native step; None for a
      // state-less call.
      .def(
          "forward",
          [](const Mamba2Model& mdl,
             nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu> x, IArr lengths,
             MArr conv_window, MArr h, Workspace* ws, bool check_state, std::optional<IArr> start,
             std::optional<IOut> row_tokens, UndoLog* undo) -> nb::object {
            const int64_t B = static_cast<int64_t>(x.shape(0)),
                          L = static_cast<int64_t>(x.shape(1));
            const Mamba2Config& c = mdl.cfg;
            EB_CHECK(static_cast<int64_t>(x.shape(2)) == c.d_model, "x last dim != d_model");
            check_rows(lengths, B, "lengths");
            EB_CHECK(start.has_value() == row_tokens.has_value(),
                     "start and row_tokens go together");
            if (row_tokens) {
              check_rows(*start, B, "start");
              EB_CHECK(static_cast<int64_t>(row_tokens->shape(0)) == B,
                       "row_tokens must have batch entries");
            }
            EB_CHECK(conv_window.ndim() == 3 && static_cast<int64_t>(conv_window.shape(0)) == B &&
                         static_cast<int64_t>(conv_window.shape(1)) == c.conv_dim &&
                         static_cast<int64_t>(conv_window.shape(2)) == c.conv_kernel,
                     "conv_window shape");
            EB_CHECK(h.ndim() == 4 && static_cast<int64_t>(h.shape(0)) == B &&
                         static_cast<int64_t>(h.shape(1)) == c.n_heads &&
                         static_cast<int64_t>(h.shape(2)) == c.head_dim &&
                         static_cast<int64_t>(h.shape(3)) == c.d_state,
                     "h shape");
            for (int64_t b = 0; b < B; ++b)
              EB_CHECK(lengths.data()[b] >= 0 && lengths.data()[b] <= L, "lengths out of range");
            OutArr y = new_output(B, L, c.d_model);
            nb::object out = nb::cast(y);  // before the call: nothing can fail after the commit
            int state_bad = 0;
            const int64_t tokens = total_tokens(lengths);
            int64_t advancing = 0;
            for (int64_t b = 0; b < B; ++b) advancing += lengths.data()[b] > 0;
            runtime::CallScratch scratch(ws);
            SignalPoll poll(mamba2_flops(mdl, static_cast<double>(tokens)));
            // A long call that may be stopped saves what it overwrites in an undo log of its
            // own, unless it writes into the caller's (a whole-model call).
            UndoLog own_undo;
            UndoLog* saving = undo;
            if (saving == nullptr && poll.watched() && tokens >= kSaveMinTokensPerRow * advancing)
              saving = &own_undo;
            Mamba2Call call{x.data(),
                            y.data(),
                            B,
                            L,
                            lengths.data(),
                            conv_window.data(),
                            h.data(),
                            runtime::num_threads(),
                            scratch.get(),
                            check_state ? &state_bad : nullptr,
                            saving};
            IOut* rt = row_tokens ? &*row_tokens : nullptr;
            run_kernel(ws, call.ws, tokens, poll, saving, [&] {
              if (undo != nullptr && rt != nullptr)
                undo->add_saved(rt->data(), static_cast<size_t>(B));
              kernels().mamba2_forward(mdl, call);
              if (!state_bad && rt) commit_counters(rt, *start, lengths, B);
            });
            if (state_bad) return nb::none();  // a read state value is not finite; untouched
            return out;
          },
          nb::arg("x"), nb::arg("lengths"), nb::arg("conv_window"), nb::arg("h"),
          nb::arg("workspace").none() = nb::none(), nb::arg("check_state") = false,
          nb::arg("start").none() = nb::none(), nb::arg("row_tokens").none() = nb::none(),
          nb::arg("undo").none() = nb::none());

  // The layers of one model call in one native call (Model's layers, SPEC 2.5: transformer
  // and Mamba-2 layers, in any order): layer i's output is layer i+1's input, each layer
  // exactly the block's own forward
  // (same kernels, same bits; its state claimed, its slots saved into `undo`, its counters
  // committed right after its kernel). It stops before the first layer it cannot run as the
  // block's call would (a layer that does not cast or fit, a busy state, a non-finite input or
  // cache slot, scratch that cannot be allocated), having changed nothing of that layer, and
  // returns (output of the last layer run or None, layers run): the caller runs that layer
  // through the block's own call, which raises the error the block names.
  m.def(
      "layer_stack",
      [](nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu> x, IArr lengths,
         nb::list layers, Workspace* ws, bool check_cache, UndoLog* undo) -> nb::tuple {
        const int64_t B = static_cast<int64_t>(x.shape(0)), L = static_cast<int64_t>(x.shape(1)),
                      d = static_cast<int64_t>(x.shape(2));
        check_rows(lengths, B, "lengths");
        const int64_t* lens = lengths.data();
        std::vector<StackLayer> run(layers.size());
        size_t n = 0;
        while (n < run.size() && stack_layer(layers[n], B, d, run[n])) ++n;
        if (n == 0) return nb::make_tuple(nb::none(), 0);
        OutArr ya = new_output(B, L, d), yb = new_output(B, L, d);
        nb::object oa = nb::cast(ya), ob = nb::cast(yb);
        const size_t bytes = static_cast<size_t>(B * L * d) * sizeof(float);
        size_t done = 0;
        const float* in = x.data();
        runtime::CallScratch scratch(ws);
        // Layer by layer, each as the block's own call: its own signal watch (a layer disarms
        // its watch for its last, short cache copy), its lock, then its counters read and
        // checked under the lock.
        const int64_t tokens = total_tokens(lengths);
        int64_t advancing = 0;
        for (int64_t b = 0; b < B; ++b) advancing += lens[b] > 0;
        // One layer inside its watch, as its block's binding runs it: the input check, the
        // layer's lock, its counters under the lock, then kernel(out, bad) (bad: the state
        // check's flag, or null), undo entries rolled back on a failed allocation, counters
        // committed. False, with nothing of the layer changed, when it did not run.
        const auto run_layer = [&](StackLayer& ly, float* out, SignalPoll& poll, UndoLog* saving,
                                   auto&& kernel) {
          bool ran = false;
          run_kernel(ws, scratch.get(), tokens, poll, saving, [&] {
            if (!real_rows_finite(in, B, L, d, lens)) return;
            if (ly.lock->try_acquire() != StateLock::kOk) return;
            struct Release {
              StateLock* l;
              ~Release() { l->release(); }
            } release{ly.lock};
            if (!stack_counters(ly, B, L, lens)) return;
            std::memset(out, 0, bytes);
            int bad = 0;
            const size_t mark = saving != nullptr ? saving->size() : 0;
            try {
              if (undo != nullptr) undo->add_saved(ly.row_tokens, static_cast<size_t>(B));
              kernel(out, check_cache ? &bad : nullptr);
            } catch (const std::bad_alloc&) {
              if (saving != nullptr) saving->rollback(mark);
              return;  // the block's own call retries it (and names the memory if it fails)
            }
            if (bad) return;  // nothing written: the block's call names the value
            for (int64_t b = 0; b < B; ++b) ly.row_tokens[b] = ly.start[b] + lens[b];
            ran = true;
          });
          return ran;
        };
        for (size_t i = 0; i < n; ++i) {
          StackLayer& ly = run[i];
          float* out = (i % 2 == 0) ? ya.data() : yb.data();
          bool ran = false;
          if (ly.mamba != nullptr) {  // as the Mamba-2 block's forward binding above
            SignalPoll poll(mamba2_flops(*ly.mamba, static_cast<double>(tokens)));
            UndoLog own_undo;  // a long, watched call outside a model transaction saves here
            UndoLog* saving = undo;
            if (saving == nullptr && poll.watched() && tokens >= kSaveMinTokensPerRow * advancing)
              saving = &own_undo;
            ran = run_layer(ly, out, poll, saving, [&](float* y, int* bad) {
              const Mamba2Call call{
                  in,  y,     B, L, lens, ly.k, ly.v, runtime::num_threads(), scratch.get(),
                  bad, saving};
              kernels().mamba2_forward(*ly.mamba, call);
            });
          } else {
            // the counters seen now (read again under the lock): only an estimate
            SignalPoll poll(transformer_flops(*ly.core, lens, ly.row_tokens, B));
            ran = run_layer(ly, out, poll, undo, [&](float* y, int* bad) {
              const TransformerCall call{in,
                                         y,
                                         B,
                                         L,
                                         lens,
                                         ly.start.data(),
                                         ly.k,
                                         ly.v,
                                         ly.attn ? ly.capacity : 0,
                                         runtime::num_threads(),
                                         scratch.get(),
                                         ly.attn ? bad : nullptr,
                                         ly.rope_set,
                                         undo};
              kernels().transformer_forward(*ly.core, call);
            });
          }
          if (!ran) break;
          in = out;
          ++done;
        }
        if (done == 0) return nb::make_tuple(nb::none(), 0);
        return nb::make_tuple(done % 2 == 1 ? oa : ob, done);
      },
      nb::arg("x"), nb::arg("lengths"), nb::arg("layers"), nb::arg("workspace").none(),
      nb::arg("check_cache"), nb::arg("undo").none());

  // The state lock (StateLock above) and its two context managers.
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
