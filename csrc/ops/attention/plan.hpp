// Attention planning for one call of a decoder block (SPEC 4.3 steps 5-6, SPEC 5): which
// keys each query reads (the state's ring slots before the call, the call's fresh K/V after),
// how prefill rows' keys are packed into transposed blocks, how (token, KV head) tasks are
// split over threads, and the SPEC 5 reading-rule check of the cache slots read, fused into
// that reading. The kernels (kernels.hpp) compute; this file decides what they see. Every
// (token, head) output is computed by one thread with the single-thread operations, so task
// order and split never change a bit. What does not live here: the cache write (the block does
// it after the call has succeeded) and anything about norms, RoPE or projections.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "base/parallel.hpp"
#include "base/workspace.hpp"
#include "ops/attention/kernels.hpp"
#include "ops/finite/bits.hpp"

namespace eb::ops {

// One call's attention. Tokens are the call's compact rows m = 0..M-1 (row tok_row[m], index
// tok_t[m] within its row; row b's tokens start at row_off[b]); token m of row b sits at
// absolute position start[b] + tok_t[m].
struct AttentionCall {
  int64_t batch = 0;
  const int64_t* lengths = nullptr;  // (batch,) real tokens per row
  const int64_t* start = nullptr;    // (batch,) position of each row's first token
  const int64_t* row_off = nullptr;  // (batch + 1,)
  const int64_t* tok_row = nullptr;  // (M,)
  const int64_t* tok_t = nullptr;    // (M,)
  int64_t n_heads = 0, n_kv_heads = 0, head_dim = 0;
  int64_t window = 0;              // 0 = causal; W: keys p-W+1 .. p
  float scale = 1.0f;              // score scale (float32)
  float softcap = 0.0f;            // 0 = none
  const float* qkv = nullptr;      // (M, (n_heads + 2 n_kv_heads) head_dim): q | k | v per token,
                                   // after q/k norm and RoPE
  float* out = nullptr;            // (M, n_heads head_dim), heads concatenated head-major
  const float* k_cache = nullptr;  // (batch, n_kv_heads, cap, head_dim); position j in slot
  const float* v_cache = nullptr;  // j % cap (read only: positions before start)
  int64_t cap = 0;
  bool check_cache = false;  // SPEC 5 reading rule: refuse non-finite slots that are read
  int n_threads = 1;
  Workspace* ws = nullptr;  // scratch: float slots ws_float0.., int slots ws_int0..
  size_t ws_float0 = 0, ws_int0 = 0;
};

// Computes a.out for every real token. Returns false, with a.out unspecified, when
// check_cache is set and a slot that a row reads holds a NaN or an infinity.
template <class V>
bool attention(const AttentionCall& a) {
  const int64_t B = a.batch, n_h = a.n_heads, n_kv = a.n_kv_heads, hd = a.head_dim;
  const int64_t qw = n_h * hd, kw = n_kv * hd, n_qkv = qw + 2 * kw, n_rep = n_h / n_kv;
  const int64_t cap = a.cap;
  const int nt = a.n_threads;
  const int64_t* row_off = a.row_off;
  const int64_t* tok_row = a.tok_row;
  const int64_t* tok_t = a.tok_t;
  const float* qkv = a.qkv;
  Workspace& ws = *a.ws;
  int64_t max_keys = 1;
  for (int64_t b = 0; b < B; ++b) max_keys = std::max(max_keys, a.start[b] + a.lengths[b]);
  if (a.window > 0) max_keys = std::min(max_keys, a.window);
  max_keys = pad_floats(max_keys);  // score rows start on 64-byte boundaries
  // Per-thread scratch, allocated up front: nothing allocates inside a parallel region.
  constexpr int kQueryBlock = 8;  // queries of one prefill row that share a pass over the keys
  static_assert(kQueryBlock * 32 <= 256, "qs/os arrays below");
  const int n_slots = std::max(nt, 1);
  const int64_t score_rows = std::max<int64_t>(4, kQueryBlock * n_rep);
  float* score_scratch =
      ws.floats(a.ws_float0, static_cast<size_t>(n_slots * score_rows * max_keys));

  // Attention per (token, query head); keys before the call come from the cache ring,
  // keys of this call from the fresh K/V (never from a slot this call may overwrite).
  // Rows with many tokens in this call (prefill) get their keys in transposed blocks of
  // kLanes positions, shared by all the row's queries (ops::attention_prefill_block: same bits,
  // no per-key horizontal reduction). Positions below the first query's window are zeros
  // (never read by a query); positions past the call are zeros too.
  constexpr int64_t kL = V::kLanes;
  constexpr int64_t kKtMinTokens = 16;
  int64_t* kt_base = ws.ints(a.ws_int0, static_cast<size_t>(B));
  int64_t* kt_off = ws.ints(a.ws_int0 + 1, static_cast<size_t>(B + 1));
  kt_off[0] = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = a.lengths[b], st = a.start[b];
    int64_t blocks = 0;
    kt_base[b] = 0;
    if (len >= kKtMinTokens) {
      const int64_t first_j0 = a.window > 0 ? std::max<int64_t>(0, st - a.window + 1) : 0;
      kt_base[b] = first_j0 / kL * kL;
      blocks = (st + len - kt_base[b] + kL - 1) / kL;
    }
    kt_off[b + 1] = kt_off[b] + blocks * n_kv * hd * kL;
  }
  // SPEC 5 reading rule, checked here instead of in a separate pass over the cache: the slots
  // of positions j0 .. start-1 (j0 of the row's first query) must be finite. Each (row, KV
  // head) is checked by the task that reads it first (the K/V packing of a prefill row, the
  // attention of a row's first token otherwise), so the data is read from memory once.
  std::atomic<int> cache_bad{0};
  const auto readable_bad = [&](int64_t b, int64_t g) -> bool {
    const int64_t st = a.start[b];
    const int64_t j0 = a.window > 0 ? std::max<int64_t>(0, st - a.window + 1) : 0;
    const int64_t count = st - j0;
    if (count <= 0) return false;
    const int64_t s0 = j0 % cap, n1 = std::min(count, cap - s0);
    const float* kc = a.k_cache + (b * n_kv + g) * cap * hd;
    const float* vc = a.v_cache + (b * n_kv + g) * cap * hd;
    if (any_nonfinite<V>(kc + s0 * hd, n1 * hd) || any_nonfinite<V>(vc + s0 * hd, n1 * hd))
      return true;
    return count > n1 &&
           (any_nonfinite<V>(kc, (count - n1) * hd) || any_nonfinite<V>(vc, (count - n1) * hd));
  };
  const bool check_cache = a.check_cache;
  float* kt_all = ws.floats(a.ws_float0 + 1, static_cast<size_t>(std::max<int64_t>(kt_off[B], 1)));
  // ... and their values packed contiguously per (row, KV head): (positions, head_dim)
  float* vp_all = ws.floats(a.ws_float0 + 2, static_cast<size_t>(std::max<int64_t>(kt_off[B], 1)));
  parallel_for(B * n_kv, nt, [&](int64_t b0, int64_t b1, int) {
    for (int64_t task = b0; task < b1; ++task) {
      const int64_t b = task / n_kv, g = task % n_kv;
      const int64_t blocks_hd = (kt_off[b + 1] - kt_off[b]) / n_kv;
      if (blocks_hd == 0) continue;
      if (check_cache && readable_bad(b, g)) {
        cache_bad.store(1, std::memory_order_relaxed);
        continue;
      }
      const int64_t st = a.start[b], len = a.lengths[b], base = kt_base[b];
      const int64_t first_j0 = a.window > 0 ? std::max<int64_t>(0, st - a.window + 1) : 0;
      float* kt = kt_all + kt_off[b] + g * blocks_hd;
      const float* kc = a.k_cache + (b * n_kv + g) * cap * hd;
      const float* vc = a.v_cache + (b * n_kv + g) * cap * hd;
      const float* fresh = &qkv[row_off[b] * n_qkv] + qw + g * hd;
      float* vp = vp_all + kt_off[b] + g * blocks_hd;
      const int64_t n_pos = blocks_hd / hd;
      for (int64_t i = 0; i < n_pos; ++i) {
        const int64_t j = base + i;
        float* dst = kt + (i / kL) * hd * kL + (i % kL);
        const float* src = nullptr;
        const float* vsrc = nullptr;
        if (j >= first_j0 && j < st) {
          src = kc + (j < cap ? j : j % cap) * hd;
          vsrc = vc + (j < cap ? j : j % cap) * hd;
        } else if (j >= st && j < st + len) {
          src = fresh + (j - st) * n_qkv;
          vsrc = src + kw;
        }
        for (int64_t dd = 0; dd < hd; ++dd) dst[dd * kL] = src ? src[dd] : 0.0f;
        if (vsrc)
          std::memcpy(vp + i * hd, vsrc, sizeof(float) * hd);
        else
          std::memset(vp + i * hd, 0, sizeof(float) * hd);
      }
    }
  });

  if (cache_bad.load()) return false;
  // Causal cost grows with the position, so tasks are visited from both ends in turn
  // (v -> 0, last, 1, last-1, ...): contiguous thread ranges then carry similar work. The
  // order of tasks never changes a bit: each (token, head) output is computed by one thread.
  // A task is one (token, KV head): its n_rep query heads run together, up to 4 at a time.
  // Tasks: (first token, count, KV head, first query head, query heads). Prefill rows (with
  // transposed keys) go in blocks of kQueryBlock consecutive tokens, other rows token by token.
  // When the (token, KV head) pairs of other rows are too few to keep every thread busy (a
  // decode step of a row with 3 KV heads on 2 threads, one KV head on any), each one's query
  // heads are split into `parts` tasks: attention_heads gives every head the same bits
  // whatever heads run beside it.
  int64_t n_att = 0, n_single = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (kt_off[b + 1] > kt_off[b])
      n_att += (a.lengths[b] + kQueryBlock - 1) / kQueryBlock * n_kv;
    else
      n_single += a.lengths[b] * n_kv;
  }
  const int64_t parts = n_single > 0 && n_single < 2 * nt  // at most n_rep: every part has a head
                            ? std::min<int64_t>(n_rep, (2 * nt + n_single - 1) / n_single)
                            : 1;
  n_att += n_single * parts;
  constexpr int kTaskInts = 5;
  int64_t* att_tasks =
      ws.ints(a.ws_int0 + 2, static_cast<size_t>(kTaskInts * std::max<int64_t>(n_att, 1)));
  {
    int64_t k = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t len = a.lengths[b];
      const bool blocked = kt_off[b + 1] > kt_off[b];
      const int64_t step_t = blocked ? kQueryBlock : 1, n_parts = blocked ? 1 : parts;
      for (int64_t t0 = 0; t0 < len; t0 += step_t)
        for (int64_t g = 0; g < n_kv; ++g)
          for (int64_t pt = 0; pt < n_parts; ++pt, ++k) {
            int64_t* tk = &att_tasks[kTaskInts * k];
            tk[0] = row_off[b] + t0;
            tk[1] = std::min(step_t, len - t0);
            tk[2] = g;
            tk[3] = g * n_rep + pt * n_rep / n_parts;
            tk[4] = g * n_rep + (pt + 1) * n_rep / n_parts - tk[3];
          }
    }
  }
  parallel_for(n_att, nt, [&](int64_t b0, int64_t b1, int tid) {
    float* scores =
        &score_scratch[static_cast<size_t>(tid) * static_cast<size_t>(score_rows * max_keys)];
    for (int64_t v = b0; v < b1; ++v) {
      const int64_t task = (v % 2 == 0) ? v / 2 : n_att - 1 - v / 2;
      const int64_t* tk = &att_tasks[kTaskInts * task];
      const int64_t m = tk[0], nq = tk[1], g = tk[2], h_lo = tk[3], h_hi = tk[3] + tk[4];
      const int64_t b = tok_row[m], start = a.start[b];
      const int64_t p = start + tok_t[m];
      const int64_t kt_len = (kt_off[b + 1] - kt_off[b]) / n_kv;
      if (kt_len) {  // a block of prefill queries: every head of this KV head together
        const float* kt = kt_all + kt_off[b] + g * kt_len;
        const float* vp = vp_all + kt_off[b] + g * kt_len;
        const float* qs[256];  // kQueryBlock queries x up to 32 heads
        float* os[256];
        for (int64_t h0 = g * n_rep; h0 < (g + 1) * n_rep; h0 += 32) {
          const int r_n = static_cast<int>(std::min<int64_t>(32, (g + 1) * n_rep - h0));
          for (int qi = 0; qi < nq; ++qi)
            for (int r = 0; r < r_n; ++r) {
              qs[qi * r_n + r] = &qkv[(m + qi) * n_qkv + (h0 + r) * hd];
              os[qi * r_n + r] = &a.out[(m + qi) * qw + (h0 + r) * hd];
            }
          attention_prefill_block<V>(qs, static_cast<int>(nq), r_n, hd, a.window, p, kt, vp,
                                     kt_base[b], a.scale, a.softcap, scores, max_keys, os);
        }
        continue;
      }
      // SPEC 5 reading rule for a row's first token, fused into its attention: a non-finite
      // key makes a raw score of the first head non-finite, a non-finite value makes that
      // head's output non-finite (a NaN or infinity stays in the fma chain: 0 * inf is NaN).
      // Either sign is then confirmed (or cleared: an overflow) by the exact check.
      const bool check_row = check_cache && tok_t[m] == 0 && h_lo == g * n_rep;
      bool raw_bad = false;
      const int64_t j0 = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
      const float* kc = a.k_cache + (b * n_kv + g) * cap * hd;
      const float* vc = a.v_cache + (b * n_kv + g) * cap * hd;
      const float* fresh = &qkv[row_off[b] * n_qkv];
      // slot = j % cap; without a window j < cap always, so the division is skipped
      auto key_at = [&](int64_t j) -> const float* {
        return j < start ? kc + (j < cap ? j : j % cap) * hd
                         : fresh + (j - start) * n_qkv + qw + g * hd;
      };
      auto val_at = [&](int64_t j) -> const float* {
        return j < start ? vc + (j < cap ? j : j % cap) * hd
                         : fresh + (j - start) * n_qkv + qw + kw + g * hd;
      };
      for (int64_t h0 = h_lo; h0 < h_hi; h0 += 4) {
        const int r_n = static_cast<int>(std::min<int64_t>(4, h_hi - h0));
        const float* qs[4];
        float* os[4];
        for (int r = 0; r < r_n; ++r) {
          qs[r] = &qkv[m * n_qkv + (h0 + r) * hd];
          os[r] = &a.out[m * qw + (h0 + r) * hd];
        }
        bool* raw = check_row && h0 == g * n_rep ? &raw_bad : nullptr;
        switch (r_n) {
          case 1:
            attention_heads<V, 1>(qs, hd, j0, p, key_at, val_at, a.scale, a.softcap, scores,
                                  max_keys, os, raw);
            break;
          case 2:
            attention_heads<V, 2>(qs, hd, j0, p, key_at, val_at, a.scale, a.softcap, scores,
                                  max_keys, os, raw);
            break;
          case 3:
            attention_heads<V, 3>(qs, hd, j0, p, key_at, val_at, a.scale, a.softcap, scores,
                                  max_keys, os, raw);
            break;
          default:
            attention_heads<V, 4>(qs, hd, j0, p, key_at, val_at, a.scale, a.softcap, scores,
                                  max_keys, os, raw);
            break;
        }
      }
      if (check_row && (raw_bad || any_nonfinite<V>(&a.out[m * qw + g * n_rep * hd], hd)) &&
          readable_bad(b, g))
        cache_bad.store(1, std::memory_order_relaxed);
    }
  });
  return !cache_bad.load();  // false: nothing of the caller's has been read as valid
}

}  // namespace eb::ops
