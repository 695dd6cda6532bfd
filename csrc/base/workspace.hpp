// Workspace: scratch buffers of a block call that grow on demand and are kept between calls.
// A decode session owns one, so its steps stop allocating once the buffers have reached their
// size (SPEC 6); a call without a session uses a local one. Buffers are never assumed zeroed:
// the blocks write every element they later read. So new storage is not initialised either:
// zero-filling the hundreds of MB of a long prefill took most of a second before its first
// cancel point (base/cancel.hpp), and its pages are now touched by the work that writes them.
// One call at a time (the state's lock).
#pragma once
#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

#include "base/aligned.hpp"

namespace eb {

// n rounded up to a whole number of 64-byte lines (16 floats): per-thread slices of a
// workspace buffer then keep its alignment. (static: its own copy in every object; see
// math/abi.hpp for why nothing non-template may be shared by the per-ISA objects.)
static inline int64_t pad_floats(int64_t n) { return (n + 15) / 16 * 16; }

// The members are defined out of line in workspace.cpp, compiled once with the baseline flags:
// the per-ISA objects then call them and never instantiate std::vector code of their own
// (which the linker would otherwise merge across ISAs, math/abi.hpp).
// 64-byte aligned storage of n T's that are not initialised when it grows (its old elements
// are kept, as a vector's would be).
template <class T>
class ScratchBuffer {
 public:
  ScratchBuffer() = default;
  ~ScratchBuffer() { ::operator delete(p_, std::align_val_t(64)); }
  ScratchBuffer(ScratchBuffer&& o) noexcept : p_(o.p_), n_(o.n_) {
    o.p_ = nullptr;
    o.n_ = 0;
  }
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(ScratchBuffer&&) = delete;
  T* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  friend class Workspace;
  T* p_ = nullptr;
  size_t n_ = 0;
};

class Workspace {
 public:
  Workspace();
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  float* floats(size_t slot, size_t n);
  int64_t* ints(size_t slot, size_t n);
  // A buffer apart from the numbered slots, for scratch an op slices per thread (the GEMM's
  // rebuilt panels): a block reserves it before its first state write, so no parallel region
  // allocates. Null when n == 0 and nothing was reserved yet.
  float* op_scratch(size_t n);
  size_t bytes() const;
  void release();

 private:
  template <class T>
  static T* grow(ScratchBuffer<T>& b, size_t n);

  std::vector<ScratchBuffer<float>> f_;  // every buffer starts on a 64-byte boundary
  std::vector<ScratchBuffer<int64_t>> i_;
  ScratchBuffer<float> op_;
};

}  // namespace eb
