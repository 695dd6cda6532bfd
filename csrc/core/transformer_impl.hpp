// The Transformer block's forward, written once over a vector type V and compiled per ISA
// (csrc/isa/kernels_isa.cpp). Composes ops only; the op order is SPEC 4.3 (HF
// LlamaDecoderLayer). Real tokens of all rows are gathered into M compact rows; every step is
// either per token or per (token, head), so a row's bits never depend on the other rows,
// on how its tokens were split into calls, or on the thread count.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "core/transformer_block.hpp"
#include "core/workspace.hpp"
#include "math/derived.hpp"
#include "ops/activations.hpp"
#include "ops/attention.hpp"
#include "ops/finite_bits.hpp"
#include "ops/gemm.hpp"
#include "ops/norm.hpp"
#include "ops/rope.hpp"
#include "threading/parallel.hpp"

namespace eb::core {

template <class V>
void transformer_forward(const TransformerModel& mdl, const TransformerCall& call) {
  const TransformerConfig& c = mdl.cfg;
  const int64_t d = c.d_model, n_h = c.n_heads, n_kv = c.n_kv_heads, hd = c.head_dim;
  const int64_t qw = n_h * hd, kw = n_kv * hd, it = c.intermediate, n_qkv = qw + 2 * kw;
  const int64_t n_gu = mdl.w_gu.n_out, half = c.rope_dim / 2, n_rep = n_h / n_kv;
  const int64_t B = call.batch, L = call.n_tokens, cap = call.capacity;
  const int nt = call.n_threads;
  FpEnvGuard guard;  // the calling thread too runs the serial parts (residuals, scatter)

  // Compact the real tokens: token m is (row tok_row[m], index tok_t[m] within the call).
  Workspace local;
  Workspace& ws = call.ws ? *call.ws : local;
  int64_t* row_off = ws.ints(0, static_cast<size_t>(B + 1));
  row_off[0] = 0;
  for (int64_t b = 0; b < B; ++b) row_off[b + 1] = row_off[b] + call.lengths[b];
  const int64_t M = row_off[B];
  if (M == 0) return;
  int64_t* tok_row = ws.ints(1, static_cast<size_t>(M));
  int64_t* tok_t = ws.ints(2, static_cast<size_t>(M));
  int64_t max_keys = 1;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < call.lengths[b]; ++t) {
      tok_row[row_off[b] + t] = b;
      tok_t[row_off[b] + t] = t;
    }
    max_keys = std::max(max_keys, call.start[b] + call.lengths[b]);
  }
  if (c.window > 0) max_keys = std::min(max_keys, c.window);
  max_keys = pad_floats(max_keys);  // score rows start on 64-byte boundaries

  const auto sz = [](int64_t a, int64_t b) { return static_cast<size_t>(a * b); };
  float* xs = ws.floats(0, sz(M, d));
  float* hn = ws.floats(1, sz(M, d));
  float* qkv = ws.floats(2, sz(M, n_qkv));
  float* att = ws.floats(3, sz(M, qw));
  float* x1 = ws.floats(4, sz(M, d));
  float* gu = ws.floats(5, sz(M, n_gu));
  float* u = ws.floats(6, sz(M, it));
  float* y = ws.floats(7, sz(M, d));
  // Per-thread scratch, allocated up front: nothing allocates inside a parallel region.
  const int n_slots = std::max(nt, 1);
  const int64_t rope_floats = pad_floats(2 * (half + 1));
  float* rope_scratch = ws.floats(8, sz(n_slots, rope_floats));
  constexpr int kQBlock = 8;  // queries of one prefill row that share a pass over the keys
  static_assert(kQBlock * 32 <= 256, "qs/os arrays below");
  const int64_t score_rows = std::max<int64_t>(4, kQBlock * n_rep);
  float* score_scratch = ws.floats(9, sz(n_slots, score_rows * max_keys));
  const float* nb_in = mdl.norm_in_b.empty() ? nullptr : mdl.norm_in_b.data();
  const float* nb_post = mdl.norm_post_b.empty() ? nullptr : mdl.norm_post_b.data();

  // 1. h = N_in(x), each real token's row first copied to xs (the residual)
  parallel_for(M, nt, [&](int64_t b0, int64_t b1, int) {
    for (int64_t m = b0; m < b1; ++m) {
      std::memcpy(&xs[m * d], call.x + (tok_row[m] * L + tok_t[m]) * d, sizeof(float) * d);
      ops::norm_row<V>(c.norm, &xs[m * d], d, mdl.norm_in_w.data(), nb_in, c.norm_eps, &hn[m * d]);
    }
  });
  // 2. q | k | v = h [Wq; Wk; Wv]^T (+ b)
  ops::gemm<V>(hn, M, d, mdl.w_qkv, qkv, n_qkv, nt);
  // 3-4. q/k norm, then RoPE at each token's absolute position.
  parallel_for(M, nt, [&](int64_t b0, int64_t b1, int tid) {
    float* cs = &rope_scratch[static_cast<size_t>(tid * rope_floats)];
    float* sn = cs + half + 1;
    for (int64_t m = b0; m < b1; ++m) {
      float* row = &qkv[m * n_qkv];
      if (c.qk_norm) {
        for (int64_t h = 0; h < n_h; ++h)
          ops::norm_row<V>(c.norm, row + h * hd, hd, mdl.q_norm_w.data(), nullptr, c.norm_eps,
                           row + h * hd);
        for (int64_t g = 0; g < n_kv; ++g)
          ops::norm_row<V>(c.norm, row + qw + g * hd, hd, mdl.k_norm_w.data(), nullptr, c.norm_eps,
                           row + qw + g * hd);
      }
      if (half > 0) {
        ops::rope_cos_sin(mdl.inv_freq.data(), half, call.start[tok_row[m]] + tok_t[m], cs, sn);
        for (int64_t h = 0; h < n_h + n_kv; ++h) ops::rope_apply(row + h * hd, half, cs, sn);
      }
    }
  });
  // 5-6. attention per (token, query head); keys before the call come from the cache ring,
  // keys of this call from the fresh K/V (never from a slot this call may overwrite).
  // Rows with many tokens in this call (prefill) get their keys in transposed blocks of
  // kLanes positions, shared by all the row's queries (ops::attention_prefill_block: same bits,
  // no per-key horizontal reduction). Positions below the first query's window are zeros
  // (never read by a query); positions past the call are zeros too.
  constexpr int64_t kL = V::kLanes;
  constexpr int64_t kKtMinTokens = 16;
  int64_t* kt_base = ws.ints(3, static_cast<size_t>(B));
  int64_t* kt_off = ws.ints(4, static_cast<size_t>(B + 1));
  kt_off[0] = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = call.lengths[b], st = call.start[b];
    int64_t blocks = 0;
    kt_base[b] = 0;
    if (len >= kKtMinTokens) {
      const int64_t first_j0 = c.window > 0 ? std::max<int64_t>(0, st - c.window + 1) : 0;
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
    const int64_t st = call.start[b];
    const int64_t j0 = c.window > 0 ? std::max<int64_t>(0, st - c.window + 1) : 0;
    const int64_t count = st - j0;
    if (count <= 0) return false;
    const int64_t s0 = j0 % cap, n1 = std::min(count, cap - s0);
    const float* kc = call.k_cache + (b * n_kv + g) * cap * hd;
    const float* vc = call.v_cache + (b * n_kv + g) * cap * hd;
    if (ops::any_nonfinite<V>(kc + s0 * hd, n1 * hd) ||
        ops::any_nonfinite<V>(vc + s0 * hd, n1 * hd))
      return true;
    return count > n1 && (ops::any_nonfinite<V>(kc, (count - n1) * hd) ||
                          ops::any_nonfinite<V>(vc, (count - n1) * hd));
  };
  const bool check_cache = call.cache_nonfinite != nullptr;
  float* kt_all = ws.floats(10, static_cast<size_t>(std::max<int64_t>(kt_off[B], 1)));
  // ... and their values packed contiguously per (row, KV head): (positions, head_dim)
  float* vp_all = ws.floats(11, static_cast<size_t>(std::max<int64_t>(kt_off[B], 1)));
  parallel_for(B * n_kv, nt, [&](int64_t b0, int64_t b1, int) {
    for (int64_t task = b0; task < b1; ++task) {
      const int64_t b = task / n_kv, g = task % n_kv;
      const int64_t blocks_hd = (kt_off[b + 1] - kt_off[b]) / n_kv;
      if (blocks_hd == 0) continue;
      if (check_cache && readable_bad(b, g)) {
        cache_bad.store(1, std::memory_order_relaxed);
        continue;
      }
      const int64_t st = call.start[b], len = call.lengths[b], base = kt_base[b];
      const int64_t first_j0 = c.window > 0 ? std::max<int64_t>(0, st - c.window + 1) : 0;
      float* kt = kt_all + kt_off[b] + g * blocks_hd;
      const float* kc = call.k_cache + (b * n_kv + g) * cap * hd;
      const float* vc = call.v_cache + (b * n_kv + g) * cap * hd;
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

  if (cache_bad.load()) {
    *call.cache_nonfinite = 1;
    return;
  }
  // Causal cost grows with the position, so tasks are visited from both ends in turn
  // (v -> 0, last, 1, last-1, ...): contiguous thread ranges then carry similar work. The
  // order of tasks never changes a bit: each (token, head) output is computed by one thread.
  // A task is one (token, KV head): its n_rep query heads run together, up to 4 at a time.
  // Tasks: (first token, count, KV head, first query head, query heads). Prefill rows (with
  // transposed keys) go in blocks of kQBlock consecutive tokens, other rows token by token.
  // When the (token, KV head) pairs of other rows are too few to keep every thread busy (a
  // decode step of a row with 3 KV heads on 2 threads, one KV head on any), each one's query
  // heads are split into `parts` tasks: attention_heads gives every head the same bits
  // whatever heads run beside it.
  int64_t n_att = 0, n_single = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (kt_off[b + 1] > kt_off[b])
      n_att += (call.lengths[b] + kQBlock - 1) / kQBlock * n_kv;
    else
      n_single += call.lengths[b] * n_kv;
  }
  const int64_t parts = n_single > 0 && n_single < 2 * nt  // at most n_rep: every part has a head
                            ? std::min<int64_t>(n_rep, (2 * nt + n_single - 1) / n_single)
                            : 1;
  n_att += n_single * parts;
  constexpr int kTaskInts = 5;
  int64_t* att_tasks = ws.ints(5, static_cast<size_t>(kTaskInts * std::max<int64_t>(n_att, 1)));
  {
    int64_t k = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t len = call.lengths[b];
      const bool blocked = kt_off[b + 1] > kt_off[b];
      const int64_t step_t = blocked ? kQBlock : 1, n_parts = blocked ? 1 : parts;
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
      const int64_t b = tok_row[m], start = call.start[b];
      const int64_t p = start + tok_t[m];
      const int64_t kt_len = (kt_off[b + 1] - kt_off[b]) / n_kv;
      if (kt_len) {  // a block of prefill queries: every head of this KV head together
        const float* kt = kt_all + kt_off[b] + g * kt_len;
        const float* vp = vp_all + kt_off[b] + g * kt_len;
        const float* qs[256];  // kQBlock queries x up to 32 heads
        float* os[256];
        for (int64_t h0 = g * n_rep; h0 < (g + 1) * n_rep; h0 += 32) {
          const int r_n = static_cast<int>(std::min<int64_t>(32, (g + 1) * n_rep - h0));
          for (int qi = 0; qi < nq; ++qi)
            for (int r = 0; r < r_n; ++r) {
              qs[qi * r_n + r] = &qkv[(m + qi) * n_qkv + (h0 + r) * hd];
              os[qi * r_n + r] = &att[(m + qi) * qw + (h0 + r) * hd];
            }
          ops::attention_prefill_block<V>(qs, static_cast<int>(nq), r_n, hd, c.window, p, kt, vp,
                                          kt_base[b], mdl.attn_scale, c.attn_softcap, scores,
                                          max_keys, os);
        }
        continue;
      }
      // SPEC 5 reading rule for a row's first token, fused into its attention: a non-finite
      // key makes a raw score of the first head non-finite, a non-finite value makes that
      // head's output non-finite (a NaN or infinity stays in the fma chain: 0 * inf is NaN).
      // Either sign is then confirmed (or cleared: an overflow) by the exact check.
      const bool check_row = check_cache && tok_t[m] == 0 && h_lo == g * n_rep;
      bool raw_bad = false;
      const int64_t j0 = c.window > 0 ? std::max<int64_t>(0, p - c.window + 1) : 0;
      const float* kc = call.k_cache + (b * n_kv + g) * cap * hd;
      const float* vc = call.v_cache + (b * n_kv + g) * cap * hd;
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
          os[r] = &att[m * qw + (h0 + r) * hd];
        }
        bool* raw = check_row && h0 == g * n_rep ? &raw_bad : nullptr;
        switch (r_n) {
          case 1:
            ops::attention_heads<V, 1>(qs, hd, j0, p, key_at, val_at, mdl.attn_scale,
                                       c.attn_softcap, scores, max_keys, os, raw);
            break;
          case 2:
            ops::attention_heads<V, 2>(qs, hd, j0, p, key_at, val_at, mdl.attn_scale,
                                       c.attn_softcap, scores, max_keys, os, raw);
            break;
          case 3:
            ops::attention_heads<V, 3>(qs, hd, j0, p, key_at, val_at, mdl.attn_scale,
                                       c.attn_softcap, scores, max_keys, os, raw);
            break;
          default:
            ops::attention_heads<V, 4>(qs, hd, j0, p, key_at, val_at, mdl.attn_scale,
                                       c.attn_softcap, scores, max_keys, os, raw);
            break;
        }
      }
      if (check_row && (raw_bad || ops::any_nonfinite<V>(&att[m * qw + g * n_rep * hd], hd)) &&
          readable_bad(b, g))
        cache_bad.store(1, std::memory_order_relaxed);
    }
  });
  if (cache_bad.load()) {  // nothing of the caller's has been written yet
    *call.cache_nonfinite = 1;
    return;
  }
  // 7. x1 = x + (Wo o (+ bo))
  ops::gemm<V>(att, M, qw, mdl.w_o, x1, d, nt);
  // 8-9. h2 = N_post(x1); u = act(g) * up (or act(up)); y = x1 + (Wd u (+ bd))
  parallel_for(M, nt, [&](int64_t b0, int64_t b1, int) {
    for (int64_t m = b0; m < b1; ++m) {
      float* row = &x1[m * d];
      for (int64_t i = 0; i < d; ++i) row[i] = xs[m * d + i] + row[i];
      ops::norm_row<V>(c.norm, row, d, mdl.norm_post_w.data(), nb_post, c.norm_eps, &hn[m * d]);
    }
  });
  ops::gemm<V>(hn, M, d, mdl.w_gu, gu, n_gu, nt);
  parallel_for(M, nt, [&](int64_t b0, int64_t b1, int) {
    for (int64_t m = b0; m < b1; ++m) ops::mlp_combine<V>(c.mlp, &gu[m * n_gu], it, &u[m * it]);
  });
  ops::gemm<V>(u, M, it, mdl.w_down, y, d, nt);
  const int nt_copy = threads_for_rows(M, nt);
  parallel_for(M, nt_copy, [&](int64_t b0, int64_t b1, int) {
    for (int64_t m = b0; m < b1; ++m) {
      float* dst = call.y + (tok_row[m] * L + tok_t[m]) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = math::canon_nan(x1[m * d + i] + y[m * d + i]);
    }
  });
  // Cache: the row's new positions p go to slot p % cap; only the last `cap` survive.
  parallel_for(B * n_kv, nt_copy, [&](int64_t b0, int64_t b1, int) {
    for (int64_t task = b0; task < b1; ++task) {
      const int64_t b = task / n_kv, g = task % n_kv, len = call.lengths[b];
      for (int64_t t = std::max<int64_t>(0, len - cap); t < len; ++t) {
        const int64_t slot = (call.start[b] + t) % cap;
        const float* src = &qkv[(row_off[b] + t) * n_qkv];
        float* kd = call.k_cache + ((b * n_kv + g) * cap + slot) * hd;
        float* vd = call.v_cache + ((b * n_kv + g) * cap + slot) * hd;
        for (int64_t i = 0; i < hd; ++i) {
          kd[i] = math::canon_nan(src[qw + g * hd + i]);
          vd[i] = math::canon_nan(src[qw + kw + g * hd + i]);
        }
      }
    }
  });
}

}  // namespace eb::core
