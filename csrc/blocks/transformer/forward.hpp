// The Transformer block's forward, written once over a vector type V and compiled per ISA
// (csrc/dispatch/kernels_isa.cpp). Composes ops only; the op order is SPEC 4.3 (HF
// LlamaDecoderLayer), with the norm placements and half blocks of config.hpp: the attention
// half is [N_attn_in] qkv, q/k norm, RoPE, attention, o, [N_attn_out], x1 = x + m*branch; the
// MLP half is [N_mlp_in] gate|up, combine, down, [N_mlp_out], y = x1 + m*branch (a norm in
// brackets runs when the placement has it; m = residual_multiplier, skipped when 1). Under the
// parallel placement the MLP reads N_attn_in(x) instead of x1. Real tokens of
// all rows are gathered into M compact rows; every step is either per token or per (token, head),
// so a row's bits never depend on the other rows, on how its tokens were split into calls, or on
// the thread count.
#pragma once
#include <algorithm>
#include <cstring>
#include <vector>

#include "base/cancel.hpp"
#include "base/parallel.hpp"
#include "base/workspace.hpp"
#include "blocks/transformer/model.hpp"
#include "math/derived.hpp"
#include "ops/activations.hpp"
#include "ops/attention/plan.hpp"
#include "ops/gemm/driver.hpp"
#include "ops/moe.hpp"
#include "ops/norm.hpp"
#include "ops/rope.hpp"

namespace eb::blocks {

template <class V>
void transformer_forward(const TransformerModel& mdl, const TransformerCall& call) {
  const TransformerConfig& c = mdl.cfg;
  const int64_t d = c.d_model, n_h = c.n_heads, n_kv = c.n_kv_heads, hd = c.head_dim;
  const int64_t qw = n_h * hd, kw = n_kv * hd, it = c.intermediate, n_qkv = qw + 2 * kw;
  const int64_t n_gu = mdl.w_gu.n_out, half = has_attention(c) ? c.rope_dim / 2 : 0;
  const bool attn = has_attention(c), mlp = has_mlp(c);
  const float rm = mdl.residual_mult;
  const bool scaled_residual = rm != 1.0f;
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
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < call.lengths[b]; ++t) {
      tok_row[row_off[b] + t] = b;
      tok_t[row_off[b] + t] = t;
    }
  }

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
  // The GEMMs' per-thread rebuild scratch, reserved before any state write (nothing allocates
  // inside a parallel region).
  const ops::MoeMlp moe = mdl.moe_mlp();
  const int64_t gemm_floats = std::max(
      {ops::gemm_scratch_floats<V>(mdl.w_qkv, M), ops::gemm_scratch_floats<V>(mdl.w_o, M),
       ops::gemm_scratch_floats<V>(mdl.w_gu, M), ops::gemm_scratch_floats<V>(mdl.w_down, M),
       mdl.moe() ? ops::moe_scratch_floats<V>(moe, M) : int64_t{0}});
  float* gemm_scratch = ws.op_scratch(sz(n_slots, gemm_floats));
  // A whole-model call (call.undo set) saves the cache slots it overwrites, each (row, KV head)
  // task its own, just before writing them: registered here, before the first write, since
  // registering allocates. Entries undo0 + 4 task + {k first span, k wrapped, v first, v
  // wrapped}: the slots of positions start + max(0, len - cap) .. start + len - 1, a ring span.
  const bool saving = call.undo != nullptr && attn && cap > 0;
  const size_t undo0 = saving ? call.undo->size() : 0;
  if (saving) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t len = call.lengths[b], first = std::max<int64_t>(0, len - cap);
      const int64_t s0 = (call.start[b] + first) % cap, n1 = std::min(len - first, cap - s0);
      const int64_t n2 = len - first - n1;
      for (int64_t g = 0; g < n_kv; ++g) {
        float* k_row = call.k_cache + (b * n_kv + g) * cap * hd;
        float* v_row = call.v_cache + (b * n_kv + g) * cap * hd;
        call.undo->add(k_row + s0 * hd, static_cast<size_t>(n1 * hd));
        call.undo->add(k_row, static_cast<size_t>(n2 * hd));
        call.undo->add(v_row + s0 * hd, static_cast<size_t>(n1 * hd));
        call.undo->add(v_row, static_cast<size_t>(n2 * hd));
      }
    }
  }
  const BlockNorm &n_ai = mdl.n_attn_in, &n_ao = mdl.n_attn_out;
  const BlockNorm &n_mi = mdl.n_mlp_in, &n_mo = mdl.n_mlp_out;
  const auto norm = [&](const BlockNorm& n, const float* src, float* dst) {
    ops::norm_row<V>(c.norm, src, d, n.w.data(), n.bias(), mdl.norm_eps, dst);
  };
  // x1 = x + branch (* m), in place over the branch
  const auto residual = [&](const float* x, float* branch) {
    if (scaled_residual) {
      for (int64_t i = 0; i < d; ++i) branch[i] = x[i] + branch[i] * rm;
    } else {
      for (int64_t i = 0; i < d; ++i) branch[i] = x[i] + branch[i];
    }
  };
  const auto x_row = [&](int64_t m) { return call.x + (tok_row[m] * L + tok_t[m]) * d; };

  if (attn) {
    // 1. h = N_attn_in(x), each real token's row first copied to xs (the residual)
    parallel_for(M, nt, [&](int64_t b0, int64_t b1, int) {
      for (int64_t m = b0; m < b1; ++m) {
        std::memcpy(&xs[m * d], x_row(m), sizeof(float) * d);
        if (n_ai.on()) norm(n_ai, &xs[m * d], &hn[m * d]);
      }
    });
    // 2. q | k | v = h [Wq; Wk; Wv]^T (+ b)   (post placement: h = x)
    ops::gemm<V>(n_ai.on() ? hn : xs, M, d, mdl.w_qkv, qkv, n_qkv, nt, gemm_scratch);
    // 3-4. q/k norm, then RoPE at each token's absolute position.
    const float* inv_freq = call.rope_set == 1 && !mdl.inv_freq_long.empty()
                                ? mdl.inv_freq_long.data()
                                : mdl.inv_freq.data();
    const float rope_factor = mdl.rope_factor;
    parallel_for(M, nt, [&](int64_t b0, int64_t b1, int tid) {
      float* cs = &rope_scratch[static_cast<size_t>(tid * rope_floats)];
      float* sn = cs + half + 1;
      for (int64_t m = b0; m < b1; ++m) {
        float* row = &qkv[m * n_qkv];
        if (c.qk_norm) {
          const float *qn = mdl.q_norm_w.data(), *kn = mdl.k_norm_w.data();
          if (c.qk_norm_scope == kQkNormAllHeads) {
            ops::norm_row<V>(c.norm, row, qw, qn, nullptr, mdl.norm_eps, row);
            ops::norm_row<V>(c.norm, row + qw, kw, kn, nullptr, mdl.norm_eps, row + qw);
          } else {
            const bool own = c.qk_norm_scope == kQkNormPerHeadWeights;
            for (int64_t h = 0; h < n_h; ++h)
              ops::norm_row<V>(c.norm, row + h * hd, hd, own ? qn + h * hd : qn, nullptr,
                               mdl.norm_eps, row + h * hd);
            for (int64_t g = 0; g < n_kv; ++g)
              ops::norm_row<V>(c.norm, row + qw + g * hd, hd, own ? kn + g * hd : kn, nullptr,
                               mdl.norm_eps, row + qw + g * hd);
          }
        }
        if (half > 0) {
          const int64_t pos = call.start[tok_row[m]] + tok_t[m];
          if (rope_factor != 1.0f) {
            ops::rope_cos_sin_scaled(inv_freq, half, pos, rope_factor, cs, sn);
          } else {
            ops::rope_cos_sin(inv_freq, half, pos, cs, sn);
          }
          for (int64_t h = 0; h < n_h + n_kv; ++h) ops::rope_apply(row + h * hd, half, cs, sn);
        }
      }
    });
    // 5-6. attention per (token, query head) (ops/attention/plan.hpp); nothing of the caller's
    // is written before it has checked the cache slots it reads.
    ops::AttentionCall ac;
    ac.batch = B;
    ac.lengths = call.lengths;
    ac.start = call.start;
    ac.row_off = row_off;
    ac.tok_row = tok_row;
    ac.tok_t = tok_t;
    ac.n_heads = n_h;
    ac.n_kv_heads = n_kv;
    ac.head_dim = hd;
    ac.window = c.window;
    ac.scale = mdl.attn_scale;
    ac.softcap = mdl.attn_softcap;
    ac.qkv = qkv;
    ac.out = att;
    ac.k_cache = call.k_cache;
    ac.v_cache = call.v_cache;
    ac.cap = cap;
    ac.check_cache = call.cache_nonfinite != nullptr;
    ac.n_threads = nt;
    ac.ws = &ws;
    ac.ws_float0 = 9;
    ac.ws_int0 = 3;
    if (!ops::attention<V>(ac)) {  // nothing of the caller's has been written yet
      *call.cache_nonfinite = 1;
      return;
    }
    // 7. x1 = x + m * [N_attn_out](Wo o (+ bo)); then the MLP input norm of the row
    ops::gemm<V>(att, M, qw, mdl.w_o, x1, d, nt, gemm_scratch);
    parallel_for(M, nt, [&](int64_t b0, int64_t b1, int) {
      for (int64_t m = b0; m < b1; ++m) {
        float* row = &x1[m * d];
        if (n_ao.on()) norm(n_ao, row, row);
        residual(&xs[m * d], row);
        if (n_mi.on()) norm(n_mi, row, &hn[m * d]);
      }
    });
  } else {
    // MLP only: x1 = x, and its MLP input norm
    parallel_for(M, nt, [&](int64_t b0, int64_t b1, int) {
      for (int64_t m = b0; m < b1; ++m) {
        std::memcpy(&x1[m * d], x_row(m), sizeof(float) * d);
        if (n_mi.on()) norm(n_mi, &x1[m * d], &hn[m * d]);
      }
    });
  }
  const int nt_copy = threads_for_rows(M, nt);
  if (mlp) {
    // 8-9. u = act(g) * up (or act(up)) of h2 = [N_mlp_in](x1); y = x1 + m * [N_mlp_out](Wd u)
    // parallel placement: hn still holds N_attn_in(x), the MLP's input too
    const bool mlp_reads_hn = n_mi.on() || c.norm_placement == kNormParallel;
    if (mdl.moe()) {  // the MoE MLP (ops/moe.hpp): float slots 16.., int slots 8..
      ops::moe_mlp<V>(moe, mlp_reads_hn ? hn : x1, M, y, nt, ws, 16, 8, gemm_scratch);
    } else {
      ops::gemm<V>(mlp_reads_hn ? hn : x1, M, d, mdl.w_gu, gu, n_gu, nt, gemm_scratch);
      parallel_for(M, nt, [&](int64_t b0, int64_t b1, int) {
        for (int64_t m = b0; m < b1; ++m) ops::mlp_combine<V>(c.mlp, &gu[m * n_gu], it, &u[m * it]);
      });
      ops::gemm<V>(u, M, it, mdl.w_down, y, d, nt, gemm_scratch);
    }
    if (n_mo.on() || scaled_residual) {
      parallel_for(M, nt, [&](int64_t b0, int64_t b1, int) {
        for (int64_t m = b0; m < b1; ++m) {
          if (n_mo.on()) norm(n_mo, &y[m * d], &y[m * d]);
          residual(&x1[m * d], &y[m * d]);
        }
      });
      parallel_for(M, nt_copy, [&](int64_t b0, int64_t b1, int) {
        for (int64_t m = b0; m < b1; ++m) {
          float* dst = call.y + (tok_row[m] * L + tok_t[m]) * d;
          for (int64_t i = 0; i < d; ++i) dst[i] = math::canon_nan(y[m * d + i]);
        }
      });
    } else {
      parallel_for(M, nt_copy, [&](int64_t b0, int64_t b1, int) {
        for (int64_t m = b0; m < b1; ++m) {
          float* dst = call.y + (tok_row[m] * L + tok_t[m]) * d;
          for (int64_t i = 0; i < d; ++i) dst[i] = math::canon_nan(x1[m * d + i] + y[m * d + i]);
        }
      });
    }
  } else {
    parallel_for(M, nt_copy, [&](int64_t b0, int64_t b1, int) {
      for (int64_t m = b0; m < b1; ++m) {
        float* dst = call.y + (tok_row[m] * L + tok_t[m]) * d;
        for (int64_t i = 0; i < d; ++i) dst[i] = math::canon_nan(x1[m * d + i]);
      }
    });
  }
  if (!attn) return;  // an MLP-only block has no cache
  // Cache: the row's new positions p go to slot p % cap; only the last `cap` survive. Past this
  // point the call is not stopped (base/cancel.hpp): this short copy then always completes.
  cancel::disarm();
  parallel_for(B * n_kv, nt_copy, [&](int64_t b0, int64_t b1, int) {
    for (int64_t task = b0; task < b1; ++task) {
      const int64_t b = task / n_kv, g = task % n_kv, len = call.lengths[b];
      if (saving)
        for (size_t j = 0; j < 4; ++j) call.undo->save(undo0 + 4 * static_cast<size_t>(task) + j);
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

}  // namespace eb::blocks
