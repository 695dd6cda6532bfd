// UndoLog (undo.hpp), compiled once with the baseline flags.
#include "base/undo.hpp"

#include <algorithm>
#include <cstring>

namespace eb {

UndoLog::UndoLog() = default;
UndoLog::~UndoLog() = default;

size_t UndoLog::size() const { return entries_.size(); }

// Registration grows the entries and the arena before anything is written; a std::bad_alloc
// leaves the log as it was (the arena keeps its contents when it grows).
size_t UndoLog::take(size_t bytes) {
  const size_t floats = (bytes + sizeof(float) - 1) / sizeof(float);
  entries_.reserve(entries_.size() + 1);
  if (used_ + floats > capacity_) {
    const size_t want = std::max(used_ + floats, 2 * capacity_);
    base_ = arena_.floats(0, want);
    capacity_ = want;
  }
  const size_t off = used_;
  used_ += floats;
  return off;
}

size_t UndoLog::add(float* dst, size_t n) {
  const size_t off = take(n * sizeof(float));
  entries_.push_back(Entry{dst, off, n * sizeof(float), false});
  return entries_.size() - 1;
}

void UndoLog::add_saved(int64_t* dst, size_t n) {
  const size_t off = take(n * sizeof(int64_t));
  entries_.push_back(Entry{dst, off, n * sizeof(int64_t), false});
  save(entries_.size() - 1);
}

void UndoLog::save(size_t i) {
  Entry& e = entries_[i];
  if (e.saved) return;
  if (e.bytes) std::memcpy(base_ + e.off, e.dst, e.bytes);
  e.saved = true;
}

void UndoLog::rollback(size_t mark) {
  for (size_t i = entries_.size(); i > mark; --i) {
    const Entry& e = entries_[i - 1];
    if (e.saved && e.bytes) std::memcpy(e.dst, base_ + e.off, e.bytes);
  }
  if (mark < entries_.size()) {
    used_ = entries_[mark].off;
    entries_.resize(mark);
  }
}

void UndoLog::commit() {
  entries_.clear();
  used_ = 0;
  if (bytes() > kRetainBytes) {
    arena_.release();
    base_ = nullptr;
    capacity_ = 0;
    std::vector<Entry>().swap(entries_);
  }
}

size_t UndoLog::bytes() const { return arena_.bytes() + entries_.capacity() * sizeof(Entry); }

}  // namespace eb
