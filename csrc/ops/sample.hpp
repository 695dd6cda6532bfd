// Seeded token sampling from one row of float32 logits: exactblocks.sampling.pick_token's
// Notes, steps 1-6 (temperature, order, top_k, exp, float64 running sums, top_p, the draw), in
// O(vocab) with a radix sort. The uniform draw r in [0, 1) comes from the caller (Python's
// Generator.random()), so this op consumes nothing and owns no random state.
// Not here: greedy decoding and the argument checks (sampling.py). Reference twin:
// sampling._pick_token_reference (NumPy), which tests/unit/test_sampling.py compares bitwise.
// Scalar code compiled once, with the baseline flags, in the binding's translation unit (never
// in an ISA's kernels_isa.cpp: its std::vector members would be emitted by every ISA object
// under one name, tests/cross); the one vectorised step, the exps, comes in as a function of
// the dispatched ISA (KernelTable::elementwise's kOpExpVec, bitwise the scalar exp, SPEC 3.1).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "math/exp.hpp"  // kExpF32Zero only

namespace eb::ops {

// Reusable buffers of sample_token (one per calling thread); grown, never shrunk.
struct SampleScratch {
  std::vector<uint64_t> items, tmp;  // (vocab): key << 32 | id, then sorted
  std::vector<uint32_t> keys, tie;   // top_k only: (vocab) keys; those in the k-th's bucket
  std::vector<float> e;              // (kept): z[order[j]] - z[order[0]], then its exp
  std::vector<double> c;             // (kept): the running float64 sums
  std::vector<int64_t> count;        // the radix sort's and top_k's digit histograms
};

// The sort key of a float32 that orders like the value, descending, as
// sampling._descending_order: -0.0 first becomes +0.0 (the two zeros are equal numbers, so they
// share a key and fall back to id order); a value >= +0 maps to bits ^ 0x7FFFFFFF (larger
// value, smaller key, all below 0x80000000), a negative one keeps its bits (more negative,
// larger key). NaN never reaches here.
inline uint32_t sample_descending_key(float z) {
  uint32_t bits;
  std::memcpy(&bits, &z, sizeof bits);
  if ((bits & 0x7FFFFFFFu) == 0u) bits = 0u;
  return bits ^ (((bits >> 31) - 1u) >> 1);
}

// The value of a key of sample_descending_key (its inverse; zeros come back as +0.0).
inline float sample_key_value(uint32_t key) {
  const uint32_t bits = key < 0x80000000u ? key ^ 0x7FFFFFFFu : key;
  float z;
  std::memcpy(&z, &bits, sizeof z);
  return z;
}

// Stable least-significant-digit radix sort of `items` (n) by their high 32 bits, ascending,
// three passes of 11, 11 and 10 bits; `tmp` (n) is scratch. A pass whose digit is the same for
// every item is skipped (it would not move anything). Stable passes keep equal keys in input
// order, so items built as key << 32 | id in id order come out by key, then id: exactly the
// permutation np.argsort(key, kind="stable") gives, whatever the pass widths.
inline void sample_radix_sort(std::vector<uint64_t>& items, std::vector<uint64_t>& tmp,
                              std::vector<int64_t>& count, int64_t n) {
  static constexpr int kShift[3] = {32, 43, 54};
  static constexpr uint64_t kMask[3] = {0x7FF, 0x7FF, 0x3FF};
  count.assign(3 * 2048, 0);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t v = items[static_cast<size_t>(i)];
    for (int p = 0; p < 3; ++p)
      ++count[static_cast<size_t>(p * 2048) + ((v >> kShift[p]) & kMask[p])];
  }
  uint64_t* src = items.data();
  uint64_t* dst = tmp.data();
  for (int p = 0; p < 3; ++p) {
    int64_t* cnt = count.data() + p * 2048;
    const uint64_t first = (src[0] >> kShift[p]) & kMask[p];
    if (cnt[first] == n) continue;
    int64_t pos = 0;
    for (int d = 0; d < 2048; ++d) {
      const int64_t c = cnt[d];
      cnt[d] = pos;
      pos += c;
    }
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t v = src[i];
      dst[cnt[(v >> kShift[p]) & kMask[p]]++] = v;
    }
    uint64_t* t = src;
    src = dst;
    dst = t;
  }
  if (src != items.data())
    std::memcpy(items.data(), src, static_cast<size_t>(n) * sizeof(uint64_t));
}

// The token pick_token defines, for logits (vocab) (finite, vocab >= 1), temperature t > 0
// (rounded here to binary32 as np.float32(t)), top_k (0 or >= vocab keeps all), top_p (in
// (0, 1]; 1 keeps all) and the draw r in [0, 1). Returns -1, and reads no draw-dependent
// state, when z[order[0]] is not finite (logits / t overflowed). The caller holds FpEnvGuard.
// Steps (pick_token's Notes):
//   1. z = logits / float32(t) in binary32 (z = logits when float32(t) == 1: x / 1 == x).
//   2, 3. top_k: the entries whose key is <= the k-th smallest key (z >= the k-th largest z,
//      ties kept), found without sorting; order: radix sort of key << 32 | id over them.
//   4. e[j] = exp_f32(z[order[j]] - z[order[0]]) via exp_array (the ISA's V::exp_array, the
//      same bits as exp_f32, SPEC 3.1), widened; c[j] = c[j-1] + e[j] in binary64, left to right.
//      The differences fall with j, so once one is below kExpF32Zero every later e is exactly +0
//      and every later c[j] equals the last computed sum: those are not computed (adding +0.0 is
//      exact).
//   5. top_p < 1: n = 1 + #{j < kept - 1 : c[j] < top_p * c[kept - 1]}.
//   6. u = r * c[n - 1]; the token is order[i] for the first i < n with c[i] > u, else n - 1
//      (c never decreases, so a binary search finds it).
using ExpArrayFn = void (*)(const float* x, float* y, int64_t n);

inline int64_t sample_token(const float* logits, int64_t vocab, double temperature, int64_t top_k,
                            double top_p, double r, SampleScratch& s, ExpArrayFn exp_array) {
  const float t32 = static_cast<float>(temperature);
  const size_t nv = static_cast<size_t>(vocab);
  if (s.items.size() < nv) {
    s.items.resize(nv);
    s.tmp.resize(nv);
  }
  uint64_t* items = s.items.data();
  // z itself is not stored: z[i] is recomputed from logits[i] (the same division, same bits).
  const auto z_of = [&](int64_t i) { return t32 == 1.0f ? logits[i] : logits[i] / t32; };
  int64_t kept = vocab;
  if (top_k > 0 && top_k < vocab) {
    // Step 3 before the sort, as the NumPy twin: the k-th smallest key (the k-th largest z)
    // by a histogram of the top 11 key bits, then nth_element inside its bucket only; the
    // kept entries are those with a key <= it (z >= the k-th z, ties kept), in id order.
    if (s.keys.size() < nv) s.keys.resize(nv);
    uint32_t* keys = s.keys.data();
    std::vector<int64_t>& count = s.count;
    count.assign(2048, 0);
    for (int64_t i = 0; i < vocab; ++i) {
      keys[i] = sample_descending_key(z_of(i));
      ++count[keys[i] >> 21];
    }
    uint32_t b = 0;
    int64_t below = 0;  // entries in buckets before b
    while (below + count[b] < top_k) below += count[b++];
    s.tie.clear();
    for (int64_t i = 0; i < vocab; ++i)
      if ((keys[i] >> 21) == b) s.tie.push_back(keys[i]);
    const int64_t rank = top_k - 1 - below;  // the k-th entry's rank inside bucket b
    std::nth_element(s.tie.begin(), s.tie.begin() + rank, s.tie.end());
    const uint32_t kth = s.tie[static_cast<size_t>(rank)];
    kept = 0;
    for (int64_t i = 0; i < vocab; ++i)
      if (keys[i] <= kth)
        items[kept++] = (static_cast<uint64_t>(keys[i]) << 32) | static_cast<uint64_t>(i);
  } else {
    for (int64_t i = 0; i < vocab; ++i)
      items[i] =
          (static_cast<uint64_t>(sample_descending_key(z_of(i))) << 32) | static_cast<uint64_t>(i);
  }
  sample_radix_sort(s.items, s.tmp, s.count, kept);
  const auto id_at = [&](int64_t j) { return static_cast<int64_t>(items[j] & 0xFFFFFFFFu); };
  const float z0 = z_of(id_at(0));
  uint32_t z0_bits;
  std::memcpy(&z0_bits, &z0, sizeof z0_bits);
  if ((z0_bits & 0x7F800000u) == 0x7F800000u) return -1;  // inf or NaN: refused

  // m: the entries whose difference is >= kExpF32Zero (a prefix, since z falls along order).
  const size_t nk = static_cast<size_t>(kept);
  if (s.e.size() < nk) {
    s.e.resize(nk);
    s.c.resize(nk);
  }
  float* e = s.e.data();
  int64_t m = 0;
  // z[order[m]] is read back from the sorted key (sequential, no division): it differs from z
  // only by the sign of a zero, and a difference of zeros is a zero, whose exp is 1 either way;
  // any other difference is the same number.
  for (; m < kept; ++m) {
    const float d = sample_key_value(static_cast<uint32_t>(items[m] >> 32)) - z0;
    if (d < math::detail::kExpF32Zero) break;
    e[m] = d;
  }
  exp_array(e, e, m);
  double* c = s.c.data();
  double sum = 0.0;
  for (int64_t j = 0; j < m; ++j) {
    sum += static_cast<double>(e[j]);
    c[j] = sum;
  }
  const double total = sum;  // c[kept - 1]: every later term is +0
  int64_t n = kept;
  if (top_p < 1.0) {
    const double thr = top_p * total;
    // c[j] for j < kept - 1: the computed ones (j < m), then (kept - 1 - m) copies of total.
    const int64_t lim = m < kept - 1 ? m : kept - 1;
    int64_t below = 0;
    for (int64_t j = 0; j < lim; ++j) below += c[j] < thr ? 1 : 0;
    if (kept - 1 > m && total < thr) below += kept - 1 - m;
    n = 1 + below;
  }
  // c[n - 1]: computed when n - 1 < m, else total.
  const double u = r * (n - 1 < m ? c[n - 1] : total);
  // First i in [0, min(n, m)) with c[i] > u; c[i] for i >= m equals c[m - 1], so if none of the
  // computed ones exceeds u, none does: i = n - 1.
  int64_t lo = 0, hi = n < m ? n : m;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (c[mid] > u)
      hi = mid;
    else
      lo = mid + 1;
  }
  const int64_t lim_i = n < m ? n : m;
  return id_at(lo < lim_i ? lo : n - 1);
}

}  // namespace eb::ops
