// Workspace members, out of line (see workspace.hpp).
#include "base/workspace.hpp"

#include <cstring>

namespace eb {

template <class T>
T* Workspace::grow(ScratchBuffer<T>& b, size_t n) {
  if (b.n_ < n) {
    T* p = static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
    if (b.n_) std::memcpy(p, b.p_, b.n_ * sizeof(T));
    ::operator delete(b.p_, std::align_val_t(64));
    b.p_ = p;
    b.n_ = n;
  }
  return b.p_;
}

Workspace::Workspace() = default;
Workspace::~Workspace() = default;

float* Workspace::floats(size_t slot, size_t n) {
  if (f_.size() <= slot) f_.resize(slot + 1);
  return grow(f_[slot], n);
}

int64_t* Workspace::ints(size_t slot, size_t n) {
  if (i_.size() <= slot) i_.resize(slot + 1);
  return grow(i_[slot], n);
}

float* Workspace::op_scratch(size_t n) { return grow(op_, n); }

size_t Workspace::bytes() const {
  size_t n = 0;
  for (const auto& v : f_) n += v.size() * sizeof(float);
  for (const auto& v : i_) n += v.size() * sizeof(int64_t);
  n += op_.size() * sizeof(float);
  return n;
}

void Workspace::release() {
  f_.clear();
  f_.shrink_to_fit();
  i_.clear();
  i_.shrink_to_fit();
  ::operator delete(op_.p_, std::align_val_t(64));
  op_.p_ = nullptr;
  op_.n_ = 0;
}

}  // namespace eb
