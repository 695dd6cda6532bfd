// The Mamba-2 block's forward over a vector type V, compiled per ISA (kernels_isa.cpp).
// Prefill IS repeated steps (STYLE 5.7): the conv window rolls and the SSM recurrence runs
// token after token in every call shape, so no chunk split or batch can move a bit.
// Chunked SSD exists only as a float64 test reference. Follows HF Mamba2Mixer.torch_forward
// (transformers 5.x, per-group gated norm) and SSD arXiv:2405.21060.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "base/cancel.hpp"
#include "base/parallel.hpp"
#include "base/workspace.hpp"
#include "blocks/mamba2/model.hpp"
#include "math/derived.hpp"
#include "ops/conv1d.hpp"
#include "ops/finite/bits.hpp"
#include "ops/gemm/driver.hpp"
#include "ops/norm.hpp"
#include "ops/ssm_scan.hpp"

namespace eb::blocks {

template <class V>
void mamba2_forward(const Mamba2Model& mdl, const Mamba2Call& call) {
  const Mamba2Config& c = mdl.cfg;
  const int64_t d = c.d_model, di = c.d_inner, nh = c.n_heads, hd = c.head_dim;
  const int64_t ns = c.d_state, ng = c.n_groups, cd = c.conv_dim, K = c.conv_kernel;
  const int64_t n_in = mdl.w_in.n_out, B = call.batch, L = call.n_tokens;
  const int nt = call.n_threads;
  FpEnvGuard guard;  // the calling thread too runs the serial parts (residual, scatter)

  Workspace local;
  Workspace& ws = call.ws ? *call.ws : local;
  int64_t* row_off = ws.ints(0, static_cast<size_t>(B + 1));
  row_off[0] = 0;
  for (int64_t b = 0; b < B; ++b) row_off[b + 1] = row_off[b] + call.lengths[b];
  const int64_t M = row_off[B];
  if (M == 0) return;
  const auto sz = [](int64_t a, int64_t b) { return static_cast<size_t>(a * b); };
  float* xs = ws.floats(0, sz(M, d));
  float* hn = ws.floats(1, sz(M, d));
  float* zx = ws.floats(2, sz(M, n_in));
  float* act = ws.floats(3, sz(M, cd));
  float* o = ws.floats(4, sz(M, di));
  float* y = ws.floats(5, sz(M, d));
  // Per-thread scratch, allocated before the first state write (SPEC 2.5).
  const int n_slots = std::max(nt, 1);
  // conv: two (K, block) windows per thread, a block being min(kConvBlock, conv_dim) channels
  constexpr int64_t kConvBlock = 256;
  const int64_t conv_block = std::min(kConvBlock, cd);
  const int64_t conv_floats = pad_floats(2 * K * conv_block);
  float* seq_scratch = ws.floats(6, sz(n_slots, conv_floats));
  float* dtb_scratch = ws.floats(7, sz(n_slots, pad_floats(ops::ssm_scan_scratch_floats(ns))));
  const int64_t gate_floats = pad_floats(di);
  float* gate_scratch = ws.floats(8, sz(n_slots, gate_floats));
  const int64_t gemm_floats =
      std::max(ops::gemm_scratch_floats<V>(mdl.w_in, M), ops::gemm_scratch_floats<V>(mdl.w_out, M));
  float* gemm_scratch = ws.op_scratch(sz(n_slots, gemm_floats));
  int64_t* tok_row = ws.ints(1, static_cast<size_t>(M));  // real token m is row tok_row[m]
  for (int64_t b = 0; b < B; ++b)
    for (int64_t m = row_off[b]; m < row_off[b + 1]; ++m) tok_row[m] = b;
  // x of real token m (row b, index m - row_off[b]) in the call's (B, L, d) layout
  const auto x_at = [&](int64_t m) { return (tok_row[m] * L + m - row_off[tok_row[m]]) * d; };

  // SPEC 2.4 / 8: what this call reads of every row it advances must be finite, checked before
  // anything is written: conv_window[b, :, 1:] (column 0, the oldest input, leaves the window
  // unread) and h[b]. One task per (row, head) of h; the head-0 task also checks the row's
  // conv window.
  if (call.state_nonfinite != nullptr) {
    std::atomic<int> bad{0};
    parallel_for(B * nh, nt, [&](int64_t b0, int64_t b1, int) {
      for (int64_t task = b0; task < b1; ++task) {
        const int64_t b = task / nh, hh = task % nh;
        if (call.lengths[b] == 0) continue;
        bool row_bad = ops::any_nonfinite<V>(call.h + (b * nh + hh) * hd * ns, hd * ns);
        if (hh == 0 && K > 1)
          for (int64_t ch = 0; ch < cd && !row_bad; ++ch)
            row_bad = ops::any_nonfinite<V>(call.conv_window + (b * cd + ch) * K + 1, K - 1);
        if (row_bad) bad.store(1, std::memory_order_relaxed);
      }
    });
    if (bad.load()) {
      *call.state_nonfinite = 1;
      return;
    }
  }

  // 1-2. hn = RMSNorm(x) (each row first copied to xs, the residual);
  // z | xBC | dt_raw = W_in hn (+ b_in)
  parallel_for(M, nt, [&](int64_t b0, int64_t b1, int) {
    for (int64_t m = b0; m < b1; ++m) {
      std::memcpy(&xs[m * d], call.x + x_at(m), sizeof(float) * d);
      ops::norm_row<V>(ops::kRmsNorm, &xs[m * d], d, mdl.block_norm_w.data(), nullptr, mdl.norm_eps,
                       &hn[m * d]);
    }
  });
  ops::gemm<V>(hn, M, d, mdl.w_in, zx, n_in, nt, gemm_scratch);

  // State writes start here (conv_window below, h in the scan). With an undo log, each task
  // saves the part it writes just before writing it (entries registered now: registering
  // allocates), and the call can still be stopped and rolled back; without one, the call is
  // not stopped from here on (base/cancel.hpp). Entries: undo0 + (row, channel block) for the
  // conv windows, then + B n_cb + (row, head) for h; empty for rows that do not advance.
  const int64_t n_cb = (cd + kConvBlock - 1) / kConvBlock;
  const size_t undo0 = call.undo != nullptr ? call.undo->size() : 0;
  const size_t undo_h0 = undo0 + static_cast<size_t>(B * n_cb);
  if (call.undo != nullptr) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t cb = 0; cb < n_cb; ++cb) {
        const int64_t c0 = cb * kConvBlock, nc = std::min(kConvBlock, cd - c0);
        call.undo->add(call.conv_window + (b * cd + c0) * K,
                       static_cast<size_t>(call.lengths[b] > 0 ? nc * K : 0));
      }
    for (int64_t b = 0; b < B; ++b)
      for (int64_t hh = 0; hh < nh; ++hh)
        call.undo->add(call.h + (b * nh + hh) * hd * ns,
                       static_cast<size_t>(call.lengths[b] > 0 ? hd * ns : 0));
  } else {
    cancel::disarm();
  }

  // 3. causal depthwise conv, per (row, block of kConvBlock channels), token after token and
  // vectorised across channels: c[ch] = SEQ_k fma(w[ch,k], u_(t-K+1+k)[ch]) (+ bias), the
  // order of ops::conv1d_token. u before the call comes from the row's conv window
  // (column K + idx holds u_idx for idx < 0), which is then rolled to the last K inputs.
  const float* conv_b = mdl.conv_b.empty() ? nullptr : mdl.conv_b.data();
  const float* wt = mdl.conv_w_t.data();  // (K, conv_dim)
  parallel_for(B * n_cb, nt, [&](int64_t b0, int64_t b1, int tid) {
    float* tw = &seq_scratch[static_cast<size_t>(tid * conv_floats)];  // (K, conv_block)
    float* tw_new = tw + K * conv_block;
    for (int64_t task = b0; task < b1; ++task) {
      const int64_t b = task / n_cb, c0 = (task % n_cb) * kConvBlock, n = call.lengths[b];
      const int64_t nc = std::min(kConvBlock, cd - c0);
      if (n == 0) continue;
      float* win = call.conv_window + (b * cd + c0) * K;  // (nc, K) of this block
      if (call.undo != nullptr) call.undo->save(undo0 + static_cast<size_t>(task));
      for (int64_t ch = 0; ch < nc; ++ch)
        for (int64_t j = 0; j < K; ++j) tw[j * conv_block + ch] = win[ch * K + j];
      const auto input = [&](int64_t idx) -> const float* {  // u_idx of this block's channels
        return idx < 0 ? tw + (K + idx) * conv_block : &zx[(row_off[b] + idx) * n_in + di + c0];
      };
      for (int64_t t = 0; t < n; ++t)
        ops::conv1d_token<V>(
            wt + c0, cd, nc, K, conv_b ? conv_b + c0 : nullptr,
            [&](int64_t k) { return input(t - K + 1 + k); }, &act[(row_off[b] + t) * cd + c0]);
      // new window column j = u_(n-K+j)
      for (int64_t j = 0; j < K; ++j) {
        const float* src = input(n - K + j);
        for (int64_t ch = 0; ch < nc; ++ch) tw_new[j * conv_block + ch] = src[ch];
      }
      for (int64_t ch = 0; ch < nc; ++ch)
        for (int64_t j = 0; j < K; ++j)
          win[ch * K + j] = math::canon_nan(tw_new[j * conv_block + ch]);
    }
  });

  // a = silu(c) = c / (1 + exp(-c)), the same ops as math::silu_f32 with the vectorised exp.
  parallel_for(M, nt, [&](int64_t b0, int64_t b1, int tid) {
    float* e = &gate_scratch[static_cast<size_t>(tid * gate_floats)];
    for (int64_t m = b0; m < b1; ++m) {
      float* a_row = &act[m * cd];
      for (int64_t c0 = 0; c0 < cd; c0 += di) {  // in pieces of the scratch's size
        const int64_t len = std::min(di, cd - c0);
        for (int64_t i = 0; i < len; ++i) e[i] = -a_row[c0 + i];
        V::exp_array(e, e, len);
        for (int64_t i = 0; i < len; ++i) a_row[c0 + i] = a_row[c0 + i] / (1.0f + e[i]);
      }
    }
  });

  // 4-6. dt, then the SSM recurrence per (row, head), token after token, in runs of
  // kScanChunk tokens that keep h in registers (ops::ssm_scan_tokens, same bits as one
  // ssm_scan_step per token).
  const int64_t heads_per_group = nh / ng;
  const int64_t scan_floats = pad_floats(ops::ssm_scan_scratch_floats(ns));
  parallel_for(B * nh, nt, [&](int64_t b0, int64_t b1, int tid) {
    float* scratch = &dtb_scratch[static_cast<size_t>(tid * scan_floats)];
    float dts[ops::kScanChunk];
    const float* xp[ops::kScanChunk];
    const float* bp[ops::kScanChunk];
    const float* cp[ops::kScanChunk];
    float* yp[ops::kScanChunk];
    for (int64_t task = b0; task < b1; ++task) {
      const int64_t b = task / nh, hh = task % nh, g = hh / heads_per_group;
      float* hs = call.h + (b * nh + hh) * hd * ns;
      if (call.undo != nullptr && call.lengths[b] > 0)
        call.undo->save(undo_h0 + static_cast<size_t>(task));
      for (int64_t t0 = 0; t0 < call.lengths[b]; t0 += ops::kScanChunk) {
        if (tid == 0 && t0 > 0) cancel::point();  // one (row, head) of a long prefill is long
        const int64_t n = std::min(ops::kScanChunk, call.lengths[b] - t0);
        for (int64_t t = 0; t < n; ++t) {
          const int64_t m = row_off[b] + t0 + t;
          const float* a_row = &act[m * cd];
          float dt = math::softplus_f32(zx[m * n_in + di + cd + hh] + mdl.dt_bias[hh]);
          dts[t] = std::min(std::max(dt, mdl.dt_min), mdl.dt_max);
          xp[t] = a_row + hh * hd;
          bp[t] = a_row + di + g * ns;
          cp[t] = a_row + di + ng * ns + g * ns;
          yp[t] = &o[m * di + hh * hd];
        }
        ops::ssm_scan_tokens<V>(hs, hd, ns, n, dts, mdl.a[hh], mdl.d[hh], xp, bp, cp, yp, scratch);
      }
      if (call.lengths[b] > 0)  // SPEC 3.5: NaN written into a state is the canonical quiet NaN
        for (int64_t i = 0; i < hd * ns; ++i) hs[i] = math::canon_nan(hs[i]);
    }
  });

  // 7. v = y * silu(z); gated RMSNorm per group; 8. out = x + (W_out o (+ b_out))
  const int64_t gs = di / ng;
  parallel_for(M, nt, [&](int64_t b0, int64_t b1, int tid) {
    float* e = &gate_scratch[static_cast<size_t>(tid * gate_floats)];
    for (int64_t m = b0; m < b1; ++m) {
      float* v = &o[m * di];
      const float* z = &zx[m * n_in];
      // v * silu(z), silu(z) = z / (1 + exp(-z)) with the vectorised exp (= math::silu_f32)
      for (int64_t i = 0; i < di; ++i) e[i] = -z[i];
      V::exp_array(e, e, di);
      for (int64_t i = 0; i < di; ++i) v[i] = v[i] * (z[i] / (1.0f + e[i]));
      for (int64_t g = 0; g < ng; ++g)
        // (v * r) * w: rmsnorm_offset's op order, with the plain weight (HF MambaRMSNormGated)
        ops::norm_row<V>(ops::kRmsNormOffset, v + g * gs, gs, mdl.gated_norm_w.data() + g * gs,
                         nullptr, mdl.norm_eps, v + g * gs);
    }
  });
  ops::gemm<V>(o, M, di, mdl.w_out, y, d, nt, gemm_scratch);
  parallel_for(M, threads_for_rows(M, nt), [&](int64_t b0, int64_t b1, int) {
    for (int64_t m = b0; m < b1; ++m) {
      float* dst = call.y + x_at(m);
      for (int64_t i = 0; i < d; ++i) dst[i] = math::canon_nan(xs[m * d + i] + y[m * d + i]);
    }
  });
}

}  // namespace eb::blocks
