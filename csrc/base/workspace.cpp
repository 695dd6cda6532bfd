// Workspace members, out of line (see workspace.hpp).
#include "base/workspace.hpp"

namespace eb {

namespace {
template <class T>
T* grow(std::vector<AlignedVector<T>>& pool, size_t slot, size_t n) {
  if (pool.size() <= slot) pool.resize(slot + 1);
  if (pool[slot].size() < n) pool[slot].resize(n);
  return pool[slot].data();
}
}  // namespace

Workspace::Workspace() = default;
Workspace::~Workspace() = default;

float* Workspace::floats(size_t slot, size_t n) { return grow(f_, slot, n); }
int64_t* Workspace::ints(size_t slot, size_t n) { return grow(i_, slot, n); }

float* Workspace::op_scratch(size_t n) {
  if (op_.size() < n) op_.resize(n);
  return op_.empty() ? nullptr : op_.data();
}

size_t Workspace::bytes() const {
  size_t n = 0;
  for (const auto& v : f_) n += v.capacity() * sizeof(float);
  for (const auto& v : i_) n += v.capacity() * sizeof(int64_t);
  n += op_.capacity() * sizeof(float);
  return n;
}

void Workspace::release() {
  f_.clear();
  f_.shrink_to_fit();
  i_.clear();
  i_.shrink_to_fit();
  op_.clear();
  op_.shrink_to_fit();
}

}  // namespace eb
