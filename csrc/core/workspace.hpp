// Workspace: scratch buffers of a block call that grow on demand and are kept between calls.
// A decode session owns one, so its steps stop allocating once the buffers have reached their
// size (SPEC 6); a call without a session uses a local one. Buffers are never assumed zeroed:
// the blocks write every element they later read. One call at a time (the state's lock).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/aligned.hpp"

namespace eb {

// n rounded up to a whole number of 64-byte lines (16 floats): per-thread slices of a
// workspace buffer then keep its alignment.
inline int64_t pad_floats(int64_t n) { return (n + 15) / 16 * 16; }

class Workspace {
 public:
  float* floats(size_t slot, size_t n) { return grow(f_, slot, n); }
  int64_t* ints(size_t slot, size_t n) { return grow(i_, slot, n); }

  size_t bytes() const {
    size_t n = 0;
    for (const auto& v : f_) n += v.capacity() * sizeof(float);
    for (const auto& v : i_) n += v.capacity() * sizeof(int64_t);
    return n;
  }
  void release() {
    f_.clear();
    f_.shrink_to_fit();
    i_.clear();
    i_.shrink_to_fit();
  }

 private:
  template <class T>
  static T* grow(std::vector<AlignedVector<T>>& pool, size_t slot, size_t n) {
    if (pool.size() <= slot) pool.resize(slot + 1);
    if (pool[slot].size() < n) pool[slot].resize(n);
    return pool[slot].data();
  }
  std::vector<AlignedVector<float>> f_;  // every buffer starts on a 64-byte boundary
  std::vector<AlignedVector<int64_t>> i_;
};

}  // namespace eb
