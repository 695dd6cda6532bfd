// The one non-finite scanner (SPEC 2.4, 2.5): the first NaN or infinity among caller-owned
// regions (x, weights, the state a call reads), found before any state write. Both blocks flag
// a non-finite state inside their native call with any_nonfinite (bits.hpp) and return before
// writing; the bindings then name the first bad element with this scan. Reads only. The regions
// are cut into pieces that the threads test with the ISA's vectorised any_nonfinite; the first
// non-finite element is then located in the first flagged piece, so the answer does not depend
// on the thread count.
#pragma once
#include <cstdint>
#include <vector>

namespace eb::ops {

struct FloatRegion {
  const float* p;
  int64_t n;
};

struct NonfiniteHit {
  int64_t region = -1;  // index into the regions, or -1 when every element is finite
  int64_t offset = -1;  // element index inside that region
};

// any_nonfinite(p, n): the ISA's kernel (KernelTable::any_nonfinite), passed in so that this
// scanner, compiled once, depends on no ISA object.
using AnyNonfiniteFn = bool (*)(const float* p, int64_t n);

NonfiniteHit first_nonfinite(const std::vector<FloatRegion>& regions, int n_threads,
                             AnyNonfiniteFn any_nonfinite);

}  // namespace eb::ops
