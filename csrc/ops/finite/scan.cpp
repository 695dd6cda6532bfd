// The non-finite scanner (scan.hpp), compiled once with the baseline flags.
#include "ops/finite/scan.hpp"

#include <algorithm>

#include "base/parallel.hpp"

namespace eb::ops {

NonfiniteHit first_nonfinite(const std::vector<FloatRegion>& regions, int n_threads,
                             AnyNonfiniteFn any_nonfinite) {
  constexpr int64_t kPiece = 16384;          // floats per task (64 KiB)
  constexpr int64_t kParallelFrom = 131072;  // below this, one thread (no fork cost)
  struct Piece {
    int64_t region, off, len;
  };
  // Reused per calling thread: once warm, a check allocates nothing (decode steps, SPEC 6).
  // Plain references, so the worker threads below see the caller's vectors, not their own.
  thread_local std::vector<Piece> pieces_tl;
  thread_local std::vector<unsigned char> bad_tl;
  std::vector<Piece>& pieces = pieces_tl;
  std::vector<unsigned char>& bad = bad_tl;
  pieces.clear();
  int64_t total = 0;
  for (int64_t r = 0; r < static_cast<int64_t>(regions.size()); ++r) {
    for (int64_t off = 0; off < regions[r].n; off += kPiece)
      pieces.push_back({r, off, std::min(kPiece, regions[r].n - off)});
    total += regions[r].n;
  }
  bad.assign(pieces.size(), 0);
  const int nt = total >= kParallelFrom ? n_threads : 1;
  parallel_for(static_cast<int64_t>(pieces.size()), nt, [&](int64_t b0, int64_t b1, int) {
    for (int64_t i = b0; i < b1; ++i)
      bad[i] = any_nonfinite(regions[pieces[i].region].p + pieces[i].off, pieces[i].len);
  });
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (!bad[i]) continue;
    const float* p = regions[pieces[i].region].p + pieces[i].off;
    for (int64_t j = 0; j < pieces[i].len; ++j)
      if (any_nonfinite(p + j, 1)) return {pieces[i].region, pieces[i].off + j};
  }
  return {};
}

}  // namespace eb::ops
