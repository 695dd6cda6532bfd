// UndoLog: copies of caller-owned memory (state buffers, counters) taken just before a call
// overwrites it, so that a call stopped midway (cancel.hpp), or a whole-model call that fails
// after some of its layers have written their states, can put every byte back (SPEC 2.5).
//
// A call registers the regions it may write (add; this allocates, so it happens before the
// first write and a MemoryError then changes nothing), and the task that writes a region saves
// it first (save; any thread, distinct entries, no allocation). rollback(mark) restores the
// saved entries registered since `mark`, newest first; commit() forgets them. Compiled once,
// with the baseline flags (the per-ISA objects call these members, as Workspace's).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "base/workspace.hpp"

namespace eb {

class UndoLog {
 public:
  UndoLog();
  ~UndoLog();
  UndoLog(const UndoLog&) = delete;
  UndoLog& operator=(const UndoLog&) = delete;

  // Entries registered so far: a mark for rollback. (Members are out of line: the per-ISA
  // objects call them, and an inline one left out of line would be shared, math/abi.hpp.)
  size_t size() const;
  // Registers n floats at dst (n may be 0); returns the entry. May throw std::bad_alloc.
  size_t add(float* dst, size_t n);
  // Registers n int64 at dst and saves them at once. May throw std::bad_alloc.
  void add_saved(int64_t* dst, size_t n);
  // Copies entry i's memory into the log (before its first write). Entries saved by different
  // threads at once must differ; a second save of an entry is ignored.
  void save(size_t i);
  // Writes back every saved entry registered at or after `mark`, newest first, and drops them.
  void rollback(size_t mark);
  // Forgets every entry; the storage is kept for the next call unless it exceeds kRetainBytes.
  void commit();
  size_t bytes() const;

  static constexpr size_t kRetainBytes = size_t{256} << 20;

 private:
  struct Entry {
    void* dst;
    size_t off;    // into the arena, in floats
    size_t bytes;  // of dst
    bool saved;
  };
  size_t take(size_t bytes);  // arena floats for `bytes`; may throw std::bad_alloc

  std::vector<Entry> entries_;
  Workspace arena_;                 // slot 0: the copies (uninitialised storage, grown by doubling)
  float* base_ = nullptr;           // the arena's storage
  size_t capacity_ = 0, used_ = 0;  // floats of the arena: reserved, given to entries
};

}  // namespace eb
