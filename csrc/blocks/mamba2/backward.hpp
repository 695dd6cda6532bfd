// The Mamba-2 block's backward over a vector type V (SPEC 7.5): the vector-Jacobian product of
// a zero-state prefill, every gradient element a fixed sequence of binary32 operations.
// Recompute, do not store: the forward is run again here with the forward's own kernels
// (RMSNorm, in_proj GEMM, conv, SiLU, dt, the token-sequential scan, gated norm), keeping the
// activations of every real token and the scan state before every kScanChunk-th token; the
// adjoint then runs in reverse: out_proj, gated norm, the reverse-time scan (chunk states
// rebuilt from their checkpoint), dt, SiLU, conv, in_proj, RMSNorm. Weight gradients sum over
// the call's real tokens m = 0..M-1 (row 0's tokens in order, then row 1's, ...) as one FMA or
// add chain per element (ops/grad_gemm.hpp). Parallel over rows, heads, channel blocks and
// output tiles only: no element is split between threads. Follows HF Mamba2Mixer.torch_forward
// (transformers 5.x) differentiated by hand; torch autograd is the oracle in the tests.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>

#include "base/parallel.hpp"
#include "base/workspace.hpp"
#include "blocks/mamba2/backward_call.hpp"
#include "blocks/mamba2/model.hpp"
#include "math/derived.hpp"
#include "math/exp.hpp"
#include "ops/conv1d.hpp"
#include "ops/gemm/driver.hpp"
#include "ops/grad_gemm.hpp"
#include "ops/reduce.hpp"
#include "ops/ref/backward_ref.hpp"
#include "ops/ssm_scan.hpp"
#include "ops/ssm_scan_backward.hpp"

namespace eb::blocks {

template <class V>
void mamba2_backward(const Mamba2Model& mdl, const Mamba2BackwardCall& call) {
  const Mamba2Config& c = mdl.cfg;
  const int64_t d = c.d_model, di = c.d_inner, nh = c.n_heads, hd = c.head_dim;
  const int64_t ns = c.d_state, ng = c.n_groups, cd = c.conv_dim, K = c.conv_kernel;
  const int64_t n_in = mdl.w_in.n_out, B = call.batch, L = call.n_tokens, hn_sz = hd * ns;
  const int nt = call.n_threads, n_slots = std::max(nt, 1);
  FpEnvGuard guard;

  Workspace ws;
  int64_t* row_off = ws.ints(0, static_cast<size_t>(B + 1));
  int64_t* chunk_off = ws.ints(1, static_cast<size_t>(B + 1));
  row_off[0] = chunk_off[0] = 0;
  for (int64_t b = 0; b < B; ++b) {
    row_off[b + 1] = row_off[b] + call.lengths[b];
    chunk_off[b + 1] = chunk_off[b] + (call.lengths[b] + ops::kScanChunk - 1) / ops::kScanChunk;
  }
  const int64_t M = row_off[B];
  if (M == 0) return;  // every gradient is the caller's +0.0
  int64_t* tok_row = ws.ints(2, static_cast<size_t>(M));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t m = row_off[b]; m < row_off[b + 1]; ++m) tok_row[m] = b;
  const auto x_at = [&](int64_t m) { return (tok_row[m] * L + m - row_off[tok_row[m]]) * d; };
  const auto sz = [](int64_t a, int64_t b) { return static_cast<size_t>(a * b); };
  size_t slot = 0;
  const auto buf = [&](int64_t rows, int64_t cols) { return ws.floats(slot++, sz(rows, cols)); };
  float* xs = buf(M, d);     // x of each real token
  float* xn = buf(M, d);     // x * r1
  float* hnrm = buf(M, d);   // RMSNorm(x)
  float* r1 = buf(M, 1);     // 1 / sqrt(mean(x^2) + eps)
  float* zx = buf(M, n_in);  // z | u | dt_raw (bias included)
  float* cpre = buf(M, cd);  // conv output before SiLU
  float* act = buf(M, cd);   // xs | B | C after SiLU
  float* dts = buf(M, nh);   // dt after softplus and clamp
  float* y = buf(M, di);     // scan output
  float* v = buf(M, di);     // y * silu(z)
  float* vn = buf(M, di);    // v * r2
  float* o = buf(M, di);     // gated norm output
  float* r2 = buf(M, ng);    // per group
  float* ckpt = buf(chunk_off[B] * nh, hn_sz);
  float* g = buf(M, d);  // grad_output of each real token
  float* d_o = buf(M, di);
  float* dy = buf(M, di);
  float* dzx = buf(M, n_in);
  float* dact = buf(M, cd);
  float* dbh = buf(M * nh, ns);  // per head; summed over each group's heads below
  float* dch = buf(M * nh, ns);
  float* ddt = buf(M, nh);
  float* dat = buf(M, nh);
  float* ddd = buf(M, nh);
  float* dhn = buf(M, d);
  float* w_in = buf(n_in, d);  // the packed matrices rebuilt as float32, bit for bit
  float* w_out = buf(d, di);
  const int64_t scan_floats = pad_floats(std::max(ops::ssm_scan_scratch_floats(ns) + hn_sz,
                                                  ops::ssm_scan_backward_scratch_floats(hd, ns)));
  float* scan_scratch = buf(n_slots, scan_floats);
  const int64_t row_floats = pad_floats(2 * std::max({cd, di, d}));
  float* row_scratch = buf(n_slots, row_floats);
  constexpr int64_t kConvBlock = 256;
  const int64_t conv_block = std::min(kConvBlock, cd), n_cb = (cd + kConvBlock - 1) / kConvBlock;
  const int64_t conv_floats = pad_floats((K + 1) * conv_block);
  float* conv_scratch = buf(n_slots, conv_floats);
  // the gradient products: a packed strip of Bm per thread; A transposed where its reduction
  // index would otherwise stride a whole row (the weight gradients)
  const int64_t outer_floats =
      pad_floats(ops::outer_gemm_scratch_floats<V>(std::max({M, n_in, d})));
  float* outer_scratch = buf(n_slots, outer_floats);
  float* a_t = buf(std::max(d, n_in), M);
  float* zeros = buf(1, cd);
  for (int64_t i = 0; i < cd; ++i) zeros[i] = 0.0f;
  float* gemm_scratch = ws.op_scratch(sz(n_slots, ops::gemm_scratch_floats<V>(mdl.w_in, M)));
  ops::unpack_rows(mdl.w_in, 0, n_in, w_in);
  ops::unpack_rows(mdl.w_out, 0, d, w_out);

  const auto outer = [&](const float* A, int64_t sak, int64_t sar, const float* Bm, int64_t ldb,
                         int64_t R, int64_t N, int64_t Kr, float* C, int64_t ldc) {
    if (call.naive)
      ops::ref::outer_gemm_ref(A, sak, sar, Bm, ldb, R, N, Kr, C, ldc);
    else
      ops::outer_gemm<V>(A, sak, sar, Bm, ldb, R, N, Kr, C, ldc, nt, outer_scratch);
  };
  // a_t = A^T, A (M, n) row-major: the same values, so the same bits of every product
  const auto transpose = [&](const float* A, int64_t n) {
    parallel_for(n, nt, [&](int64_t c0, int64_t c1, int) {
      for (int64_t col = c0; col < c1; ++col)
        for (int64_t m = 0; m < M; ++m) a_t[col * M + m] = A[m * n + col];
    });
  };
  const auto colsum = [&](const float* A, int64_t lda, const float* Bm, int64_t ldb, int64_t N,
                          float* out) {
    if (call.naive)
      ops::ref::col_reduce_ref(A, lda, Bm, ldb, M, N, out);
    else
      ops::col_reduce<V>(A, lda, Bm, ldb, M, N, out, nt);
  };

  // ---- forward, recomputed (the forward's operations, SPEC 7.3) ----
  const float df = static_cast<float>(d);
  parallel_for(M, nt, [&](int64_t b0, int64_t b1, int) {
    for (int64_t m = b0; m < b1; ++m) {
      float* xr = &xs[m * d];
      std::memcpy(xr, call.x + x_at(m), sizeof(float) * d);
      const float r = 1.0f / std::sqrt(ops::dot_l16<V>(xr, xr, d) / df + mdl.norm_eps);
      r1[m] = r;
      for (int64_t i = 0; i < d; ++i) {
        xn[m * d + i] = xr[i] * r;
        hnrm[m * d + i] = mdl.block_norm_w[i] * xn[m * d + i];
      }
    }
  });
  ops::gemm<V>(hnrm, M, d, mdl.w_in, zx, n_in, nt, gemm_scratch);

  const float* conv_b = mdl.conv_b.empty() ? nullptr : mdl.conv_b.data();
  const float* wt = mdl.conv_w_t.data();  // (K, conv_dim)
  parallel_for(B * n_cb, nt, [&](int64_t b0, int64_t b1, int) {
    for (int64_t task = b0; task < b1; ++task) {
      const int64_t b = task / n_cb, c0 = (task % n_cb) * kConvBlock, n = call.lengths[b];
      const int64_t nc = std::min(kConvBlock, cd - c0);
      const auto input = [&](int64_t idx) -> const float* {
        return idx < 0 ? zeros + c0 : &zx[(row_off[b] + idx) * n_in + di + c0];
      };
      for (int64_t t = 0; t < n; ++t)
        ops::conv1d_token<V>(
            wt + c0, cd, nc, K, conv_b ? conv_b + c0 : nullptr,
            [&](int64_t k) { return input(t - K + 1 + k); }, &cpre[(row_off[b] + t) * cd + c0]);
    }
  });
  parallel_for(M, nt, [&](int64_t b0, int64_t b1, int tid) {
    float* e = &row_scratch[tid * row_floats];
    for (int64_t m = b0; m < b1; ++m) {
      const float* cr = &cpre[m * cd];
      for (int64_t i = 0; i < cd; ++i) e[i] = -cr[i];
      V::exp_array(e, e, cd);
      for (int64_t i = 0; i < cd; ++i) act[m * cd + i] = cr[i] / (1.0f + e[i]);
      for (int64_t hh = 0; hh < nh; ++hh) {
        const float sp = math::softplus_f32(zx[m * n_in + di + cd + hh] + mdl.dt_bias[hh]);
        dts[m * nh + hh] = std::min(std::max(sp, mdl.dt_min), mdl.dt_max);
      }
    }
  });

  // the state before each chunk of kScanChunk tokens, per (row, head) in chunk order
  const auto n_chunks = [&](int64_t b) { return chunk_off[b + 1] - chunk_off[b]; };
  const int64_t heads_per_group = nh / ng;
  parallel_for(B * nh, nt, [&](int64_t b0, int64_t b1, int tid) {
    float* hs = &scan_scratch[tid * scan_floats];
    float* scratch = hs + hn_sz;
    float dtc[ops::kScanChunk];
    const float* xp[ops::kScanChunk];
    const float* bp[ops::kScanChunk];
    const float* cp[ops::kScanChunk];
    float* yp[ops::kScanChunk];
    for (int64_t task = b0; task < b1; ++task) {
      const int64_t b = task / nh, hh = task % nh, gg = hh / heads_per_group;
      for (int64_t i = 0; i < hn_sz; ++i) hs[i] = 0.0f;
      for (int64_t t0 = 0, ci = 0; t0 < call.lengths[b]; t0 += ops::kScanChunk, ++ci) {
        std::memcpy(&ckpt[(chunk_off[b] * nh + hh * n_chunks(b) + ci) * hn_sz], hs,
                    sizeof(float) * static_cast<size_t>(hn_sz));
        const int64_t n = std::min(ops::kScanChunk, call.lengths[b] - t0);
        for (int64_t t = 0; t < n; ++t) {
          const int64_t m = row_off[b] + t0 + t;
          const float* a_row = &act[m * cd];
          dtc[t] = dts[m * nh + hh];
          xp[t] = a_row + hh * hd;
          bp[t] = a_row + di + gg * ns;
          cp[t] = a_row + di + ng * ns + gg * ns;
          yp[t] = &y[m * di + hh * hd];
        }
        ops::ssm_scan_tokens<V>(hs, hd, ns, n, dtc, mdl.a[hh], mdl.d[hh], xp, bp, cp, yp, scratch);
      }
    }
  });

  const int64_t gs = di / ng;
  const float gsf = static_cast<float>(gs);
  parallel_for(M, nt, [&](int64_t b0, int64_t b1, int tid) {
    float* e = &row_scratch[tid * row_floats];
    for (int64_t m = b0; m < b1; ++m) {
      const float* z = &zx[m * n_in];
      for (int64_t i = 0; i < di; ++i) e[i] = -z[i];
      V::exp_array(e, e, di);
      for (int64_t i = 0; i < di; ++i) v[m * di + i] = y[m * di + i] * (z[i] / (1.0f + e[i]));
      for (int64_t gg = 0; gg < ng; ++gg) {
        const float* vg = &v[m * di + gg * gs];
        const float r = 1.0f / std::sqrt(ops::dot_l16<V>(vg, vg, gs) / gsf + mdl.norm_eps);
        r2[m * ng + gg] = r;
        for (int64_t i = gg * gs; i < (gg + 1) * gs; ++i) {
          vn[m * di + i] = v[m * di + i] * r;
          o[m * di + i] = vn[m * di + i] * mdl.gated_norm_w[i];
        }
      }
    }
  });

  // ---- backward ----
  // out = x + W_out o + b_out
  for (int64_t m = 0; m < M; ++m) std::memcpy(&g[m * d], call.gy + x_at(m), sizeof(float) * d);
  outer(g, 1, d, w_out, di, M, di, d, d_o, di);  // d_o[m][j] = SEQ_i fma(g[m][i], W[i][j])
  transpose(g, d);
  outer(a_t, 1, M, o, di, d, di, M, call.d_out_w, di);  // A(k = m, r = i) = g[m][i]
  if (call.d_out_b) colsum(g, d, nullptr, 0, d, call.d_out_b);
  colsum(d_o, di, vn, di, di, call.d_norm_w);

  // gated norm per group, then v = y * silu(z)
  parallel_for(M, nt, [&](int64_t b0, int64_t b1, int tid) {
    float* gw = &row_scratch[tid * row_floats];
    float* e = gw + di;
    for (int64_t m = b0; m < b1; ++m) {
      const float* z = &zx[m * n_in];
      for (int64_t i = 0; i < di; ++i) gw[i] = d_o[m * di + i] * mdl.gated_norm_w[i];
      for (int64_t gg = 0; gg < ng; ++gg) {
        const float r = r2[m * ng + gg];
        const float* vg = &v[m * di + gg * gs];
        const float s = ops::dot_l16<V>(gw + gg * gs, vg, gs);
        const float coef = (((r * r) * r) * s) / gsf;
        for (int64_t i = 0; i < gs; ++i) gw[gg * gs + i] = gw[gg * gs + i] * r - vg[i] * coef;
      }
      for (int64_t i = 0; i < di; ++i) e[i] = -z[i];
      V::exp_array(e, e, di);
      for (int64_t i = 0; i < di; ++i) {
        const float sg = 1.0f / (1.0f + e[i]), silu = z[i] / (1.0f + e[i]);
        dy[m * di + i] = gw[i] * silu;
        dzx[m * n_in + i] = (gw[i] * y[m * di + i]) * (sg * (1.0f + z[i] * (1.0f - sg)));
      }
    }
  });

  // the scan's adjoint per (row, head)
  parallel_for(B * nh, nt, [&](int64_t b0, int64_t b1, int tid) {
    float* scratch = &scan_scratch[tid * scan_floats];
    for (int64_t task = b0; task < b1; ++task) {
      const int64_t b = task / nh, hh = task % nh, gg = hh / heads_per_group, m0 = row_off[b];
      ops::ScanBackwardArgs a;
      a.n = call.lengths[b];
      if (a.n == 0) continue;
      a.head_dim = hd;
      a.d_state = ns;
      a.a = mdl.a[hh];
      a.d = mdl.d[hh];
      a.x = &act[m0 * cd + hh * hd];
      a.b = &act[m0 * cd + di + gg * ns];
      a.c = &act[m0 * cd + di + ng * ns + gg * ns];
      a.s_act = cd;
      a.dy = &dy[m0 * di + hh * hd];
      a.s_dy = di;
      a.dt = &dts[m0 * nh + hh];
      a.s_dt = nh;
      a.dx = &dact[m0 * cd + hh * hd];
      a.s_dx = cd;
      a.db = &dbh[(m0 * nh + hh) * ns];
      a.dc = &dch[(m0 * nh + hh) * ns];
      a.s_bc = nh * ns;
      a.ddt = &ddt[m0 * nh + hh];
      a.da_t = &dat[m0 * nh + hh];
      a.dd_t = &ddd[m0 * nh + hh];
      a.s_sc = nh;
      if (call.naive)
        ops::ref::ssm_scan_backward_ref(a);
      else
        ops::ssm_scan_backward<V>(a, &ckpt[(chunk_off[b] * nh + hh * n_chunks(b)) * hn_sz],
                                  scratch);
    }
  });

  // dB, dC: each group's heads summed in head order from +0.0; dt_raw; SiLU of the conv
  parallel_for(M, nt, [&](int64_t b0, int64_t b1, int tid) {
    float* e = &row_scratch[tid * row_floats];
    for (int64_t m = b0; m < b1; ++m) {
      for (int64_t gg = 0; gg < ng; ++gg)
        for (int64_t n = 0; n < ns; ++n) {
          float sb = 0.0f, sc = 0.0f;
          for (int64_t hh = gg * heads_per_group; hh < (gg + 1) * heads_per_group; ++hh) {
            sb = sb + dbh[(m * nh + hh) * ns + n];
            sc = sc + dch[(m * nh + hh) * ns + n];
          }
          dact[m * cd + di + gg * ns + n] = sb;
          dact[m * cd + di + ng * ns + gg * ns + n] = sc;
        }
      for (int64_t hh = 0; hh < nh; ++hh) {
        const float pre = zx[m * n_in + di + cd + hh] + mdl.dt_bias[hh];
        const float sp = math::softplus_f32(pre);
        const float gd = sp >= mdl.dt_min && sp <= mdl.dt_max ? ddt[m * nh + hh] : 0.0f;
        float dpre = gd;
        if (!(pre > 20.0f)) {  // torch softplus backward, threshold 20: g * e / (e + 1)
          const float ex = math::exp_f32(pre);
          dpre = (gd * ex) / (ex + 1.0f);
        }
        dzx[m * n_in + di + cd + hh] = dpre;
      }
      const float* cr = &cpre[m * cd];
      for (int64_t i = 0; i < cd; ++i) e[i] = -cr[i];
      V::exp_array(e, e, cd);
      for (int64_t i = 0; i < cd; ++i) {
        const float sg = 1.0f / (1.0f + e[i]);
        dact[m * cd + i] = dact[m * cd + i] * (sg * (1.0f + cr[i] * (1.0f - sg)));
      }
    }
  });
  colsum(dzx + di + cd, n_in, nullptr, 0, nh, call.d_dt_bias);
  colsum(dat, nh, nullptr, 0, nh, call.d_a_log);
  for (int64_t hh = 0; hh < nh; ++hh) call.d_a_log[hh] = call.d_a_log[hh] * mdl.a[hh];
  colsum(ddd, nh, nullptr, 0, nh, call.d_d);

  // conv, per block of channels, all rows (the weight sums run over rows, then tokens):
  //   du_s = SEQ_(t = s .. min(s + K - 1, n - 1)) fma(w[s - t + K - 1], dc_t, acc)
  //   dw[k] = SEQ_m fma(dc_t, u_(t - K + 1 + k), acc) over tokens with t - K + 1 + k >= 0
  //   dbias = SEQ_m (acc + dc_t)
  parallel_for(n_cb, nt, [&](int64_t b0, int64_t b1, int tid) {
    float* acc_w = &conv_scratch[tid * conv_floats];  // (K, conv_block)
    float* acc_b = acc_w + K * conv_block;
    for (int64_t cb = b0; cb < b1; ++cb) {
      const int64_t c0 = cb * kConvBlock, nc = std::min(kConvBlock, cd - c0);
      const int64_t nc_vec = nc - nc % V::kLanes;
      for (int64_t i = 0; i < (K + 1) * conv_block; ++i) acc_w[i] = 0.0f;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t n = call.lengths[b], mb = row_off[b];
        for (int64_t s = 0; s < n; ++s) {
          const int64_t t_end = std::min(s + K, n);
          float* du = &dzx[(mb + s) * n_in + di + c0];
          int64_t ch = 0;
          for (; ch < nc_vec; ch += V::kLanes) {
            V acc = V::zero();
            for (int64_t t = s; t < t_end; ++t)
              acc = V::fma(V::load(wt + (s - t + K - 1) * cd + c0 + ch),
                           V::load(&dact[(mb + t) * cd + c0 + ch]), acc);
            acc.store(du + ch);
          }
          for (; ch < nc; ++ch) {
            float acc = 0.0f;
            for (int64_t t = s; t < t_end; ++t)
              acc =
                  std::fma(wt[(s - t + K - 1) * cd + c0 + ch], dact[(mb + t) * cd + c0 + ch], acc);
            du[ch] = acc;
          }
        }
        for (int64_t t = 0; t < n; ++t) {
          const float* dc = &dact[(mb + t) * cd + c0];
          for (int64_t k = std::max<int64_t>(0, K - 1 - t); k < K; ++k) {
            const float* u = &zx[(mb + t - K + 1 + k) * n_in + di + c0];
            float* aw = acc_w + k * conv_block;
            int64_t ch = 0;
            for (; ch < nc_vec; ch += V::kLanes)
              V::fma(V::load(dc + ch), V::load(u + ch), V::load(aw + ch)).store(aw + ch);
            for (; ch < nc; ++ch) aw[ch] = std::fma(dc[ch], u[ch], aw[ch]);
          }
          int64_t ch = 0;
          for (; ch < nc_vec; ch += V::kLanes)
            V::add(V::load(acc_b + ch), V::load(dc + ch)).store(acc_b + ch);
          for (; ch < nc; ++ch) acc_b[ch] = acc_b[ch] + dc[ch];
        }
      }
      for (int64_t ch = 0; ch < nc; ++ch) {
        for (int64_t k = 0; k < K; ++k)
          call.d_conv_w[(c0 + ch) * K + k] = acc_w[k * conv_block + ch];
        if (call.d_conv_b) call.d_conv_b[c0 + ch] = acc_b[ch];
      }
    }
  });

  // zx = W_in hn + b_in
  outer(dzx, 1, n_in, w_in, d, M, d, n_in, dhn, d);  // dhn[m][j] = SEQ_o fma(dzx[m][o], W[o][j])
  transpose(dzx, n_in);
  outer(a_t, 1, M, hnrm, d, n_in, d, M, call.d_in_w, d);  // A(k = m, r = o) = dzx[m][o]
  if (call.d_in_b) colsum(dzx, n_in, nullptr, 0, n_in, call.d_in_b);
  colsum(dhn, d, xn, d, d, call.d_block_norm_w);

  // hn = w * (x * r1); dx = grad_output + the norm's gradient
  parallel_for(M, nt, [&](int64_t b0, int64_t b1, int tid) {
    float* gw = &row_scratch[tid * row_floats];
    for (int64_t m = b0; m < b1; ++m) {
      const float* xr = &xs[m * d];
      const float r = r1[m];
      for (int64_t i = 0; i < d; ++i) gw[i] = dhn[m * d + i] * mdl.block_norm_w[i];
      const float s = ops::dot_l16<V>(gw, xr, d);
      const float coef = (((r * r) * r) * s) / df;
      float* dst = call.dx + x_at(m);
      for (int64_t i = 0; i < d; ++i) dst[i] = g[m * d + i] + (gw[i] * r - xr[i] * coef);
    }
  });
}

}  // namespace eb::blocks
