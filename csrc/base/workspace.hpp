// Workspace: scratch buffers of a block call that grow on demand and are kept between calls.
// A decode session owns one, so its steps stop allocating once the buffers have reached their
// size (SPEC 6); a call without a session uses a local one. Buffers are never assumed zeroed:
// the blocks write every element they later read. One call at a time (the state's lock).
#pragma once
#include <cstddef>
#include <cstdint>
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
  std::vector<AlignedVector<float>> f_;  // every buffer starts on a 64-byte boundary
  std::vector<AlignedVector<int64_t>> i_;
  AlignedVector<float> op_;
};

}  // namespace eb
