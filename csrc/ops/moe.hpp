// The mixture-of-experts MLP (SPEC 4.8): a router picks top_k of n_experts SwiGLU-style experts
// per token; the chosen experts run on the tokens that chose them only, grouped per expert for
// the GEMMs; a token's output is the weighted sum of its experts' outputs in a fixed order.
// What lives here: the router row (moe_route_row), the grouped expert runner (moe_mlp) and its
// scratch size. What does not: the packed GEMM (gemm/driver.hpp), the gated combine
// (activations.hpp), the block around it (blocks/transformer/forward.hpp).
// Reference twin of the router row: moe_route_row<VecScalar> (the SIMD type only reaches the L16
// sum, whose lanes every ISA fills alike); tests/oracle/test_moe_hf.py pins it against HF.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "base/parallel.hpp"
#include "base/workspace.hpp"
#include "math/derived.hpp"
#include "math/exp.hpp"
#include "ops/activations.hpp"
#include "ops/gemm/driver.hpp"
#include "ops/reduce.hpp"

namespace eb::ops {

// How the router turns logits into the chosen experts' weights:
//   softmax  p = softmax(l) over all experts, top_k of p (HF Qwen2/3-MoE, OLMoE, Mixtral);
//            with norm_topk_prob, w_r = p_r / SEQ(p_0 .. p_(k-1)) in rank order
enum RouterKind : int { kRouterSoftmax = 0 };

// One token's routing. l (n_experts,) router logits; p (n_experts,) scratch. Out: idx (top_k,)
// the chosen experts in rank order (largest p first; equal p: the lower expert index first),
// w (top_k,) their weights. softmax: m = max l (exact in any order), e_j = exp(l_j - m),
// Z = L16(e), p_j = e_j / Z (the library's exp and order, as the attention softmax). Follows HF
// Qwen3MoeTopKRouter.forward (transformers 5.23): softmax in float32, torch.topk, then
// /= sum when norm_topk_prob. torch.topk's order between exactly equal values is its own
// (on CPU not the lower index): the lower-index rule is ours (SPEC 4.8), tested on tied logits
// against a float64 reference, not against HF.
template <class V>
void moe_route_row(const float* l, int64_t n_experts, int64_t top_k, bool norm_topk, float* p,
                   int64_t* idx, float* w) {
  float m = l[0];
  for (int64_t j = 1; j < n_experts; ++j) m = std::max(m, l[j]);
  for (int64_t j = 0; j < n_experts; ++j) p[j] = math::exp_f32(l[j] - m);
  const float z = sum_l16<V>(p, n_experts);
  for (int64_t j = 0; j < n_experts; ++j) p[j] = p[j] / z;
  // top-k by selection: rank r takes the untaken expert with the largest p, scanning in
  // increasing index and replacing only on a strictly larger value (ties: the lower index).
  for (int64_t r = 0; r < top_k; ++r) {
    int64_t best = -1;
    for (int64_t j = 0; j < n_experts; ++j) {
      bool taken = false;
      for (int64_t q = 0; q < r; ++q) taken = taken || idx[q] == j;
      if (taken) continue;
      if (best < 0 || p[j] > p[best]) best = j;
    }
    idx[r] = best;
    w[r] = p[best];
  }
  if (norm_topk) {
    float s = 0.0f;
    for (int64_t r = 0; r < top_k; ++r) s = s + w[r];  // SEQ in rank order
    for (int64_t r = 0; r < top_k; ++r) w[r] = w[r] / s;
  }
}

// The packed matrices of one MoE MLP (owned by the block's model). Expert e is
// down_e(act(gate_e h) * up_e h): gu[e] = [gate_e; up_e] (2 it, d), down[e] (d, it). The shared
// expert (it_shared > 0, Qwen2-MoE) is a dense gated MLP of width it_shared on every token,
// added as y = fma(sigmoid(g), shared(h), y) with g = shared_gate h (one output).
struct MoeMlp {
  const PackedMatrix* router = nullptr;  // (n_experts, d)
  const PackedMatrix* gu = nullptr;      // n_experts matrices
  const PackedMatrix* down = nullptr;    // n_experts matrices
  int64_t n_experts = 0, top_k = 0, d = 0, it = 0;
  int mlp = kSwiGlu;
  RouterKind router_kind = kRouterSoftmax;
  bool norm_topk = false;
  const PackedMatrix* shared_gu = nullptr;    // (2 it_shared, d)
  const PackedMatrix* shared_down = nullptr;  // (d, it_shared)
  const PackedMatrix* shared_gate = nullptr;  // (1, d)
  int64_t it_shared = 0;
};

// The most rebuild scratch any GEMM of moe_mlp needs per thread, for up to m tokens.
template <class V>
int64_t moe_scratch_floats(const MoeMlp& e, int64_t m) {
  int64_t most = gemm_scratch_floats<V>(*e.router, m);
  for (int64_t x = 0; x < e.n_experts; ++x)
    most =
        std::max({most, gemm_scratch_floats<V>(e.gu[x], m), gemm_scratch_floats<V>(e.down[x], m)});
  if (e.it_shared > 0)
    most = std::max({most, gemm_scratch_floats<V>(*e.shared_gu, m),
                     gemm_scratch_floats<V>(*e.shared_down, m),
                     gemm_scratch_floats<V>(*e.shared_gate, m)});
  return most;
}

// y (m, d) = MoE(h (m, d)), both row-major with stride d; y need not be zeroed. Steps:
// 1. logits = h W_r^T (the packed GEMM, SEQ over d), per token moe_route_row.
// 2. Tokens grouped per expert in increasing token order (a counting sort); each expert with
//    at least one token gathers its tokens' rows and runs gate|up GEMM, combine, down GEMM on
//    them; an expert no token chose is never read. The GEMM's outputs are per-row FMA chains
//    independent of the other rows (driver.hpp), so a token's expert output does not depend
//    on which tokens shared the expert.
// 3. y[t] = SEQ over the token's chosen experts in INCREASING EXPERT INDEX of fma(w, o_e[t], .)
//    from +0.0 (HF's index_add_ order); then the shared expert, y = fma(sigmoid(g), s, y).
// Workspace: float slots fs0 .. fs0 + 10, int slots is0 .. is0 + 4; gemm_scratch as gemm<V>.
template <class V>
void moe_mlp(const MoeMlp& e, const float* h, int64_t m, float* y, int nt, Workspace& ws,
             size_t fs0, size_t is0, float* gemm_scratch) {
  const int64_t n_e = e.n_experts, k = e.top_k, d = e.d, it = e.it;
  const int64_t n_gu = e.gu[0].n_out, mk = m * k;
  const auto sz = [](int64_t a, int64_t b) {
    return static_cast<size_t>(std::max<int64_t>(a * b, 1));
  };
  float* logits = ws.floats(fs0, sz(m, n_e));
  const int n_slots = std::max(nt, 1);
  float* probs = ws.floats(fs0 + 1, sz(n_slots, pad_floats(n_e)));
  float* wts = ws.floats(fs0 + 2, sz(m, k));
  float* xg = ws.floats(fs0 + 3, sz(m, d));  // one expert's gathered rows
  float* gg = ws.floats(fs0 + 4, sz(m, n_gu));
  float* ug = ws.floats(fs0 + 5, sz(m, it));
  float* eo = ws.floats(fs0 + 6, sz(mk, d));  // expert outputs, ordered by (expert, token)
  int64_t* idx = ws.ints(is0, sz(m, k));
  int64_t* off = ws.ints(is0 + 1, sz(n_e + 1, 1));
  int64_t* tok_of = ws.ints(is0 + 2, sz(mk, 1));  // group position -> token
  int64_t* pos_of = ws.ints(is0 + 3, sz(mk, 1));  // (token, rank) -> group position
  int64_t* next = ws.ints(is0 + 4, sz(n_e, 1));
  float* sh_gu = nullptr;
  float* sh_u = nullptr;
  float* sh_o = nullptr;
  float* sh_g = nullptr;
  if (e.it_shared > 0) {
    sh_gu = ws.floats(fs0 + 7, sz(m, e.shared_gu->n_out));
    sh_u = ws.floats(fs0 + 8, sz(m, e.it_shared));
    sh_o = ws.floats(fs0 + 9, sz(m, d));
    sh_g = ws.floats(fs0 + 10, sz(m, 1));
  }

  // 1. router
  gemm<V>(h, m, d, *e.router, logits, n_e, nt, gemm_scratch);
  const int64_t p_stride = pad_floats(n_e);
  parallel_for(m, nt, [&](int64_t b0, int64_t b1, int tid) {
    float* p = probs + tid * p_stride;
    for (int64_t t = b0; t < b1; ++t)
      moe_route_row<V>(&logits[t * n_e], n_e, k, e.norm_topk, p, &idx[t * k], &wts[t * k]);
  });
  // 2. group: off[x] = first position of expert x's tokens (serial, O(m k))
  for (int64_t x = 0; x <= n_e; ++x) off[x] = 0;
  for (int64_t s = 0; s < mk; ++s) ++off[idx[s] + 1];
  for (int64_t x = 0; x < n_e; ++x) off[x + 1] += off[x];
  for (int64_t x = 0; x < n_e; ++x) next[x] = off[x];
  for (int64_t s = 0; s < mk; ++s) {
    const int64_t pos = next[idx[s]]++;
    tok_of[pos] = s / k;
    pos_of[s] = pos;
  }
  for (int64_t x = 0; x < n_e; ++x) {
    const int64_t n = off[x + 1] - off[x];
    if (n == 0) continue;  // never read
    const int64_t* toks = tok_of + off[x];
    parallel_for(n, threads_for_rows(n, nt), [&](int64_t b0, int64_t b1, int) {
      for (int64_t j = b0; j < b1; ++j)
        std::memcpy(&xg[j * d], &h[toks[j] * d], sizeof(float) * static_cast<size_t>(d));
    });
    gemm<V>(xg, n, d, e.gu[x], gg, n_gu, nt, gemm_scratch);
    parallel_for(n, nt, [&](int64_t b0, int64_t b1, int) {
      for (int64_t j = b0; j < b1; ++j) mlp_combine<V>(e.mlp, &gg[j * n_gu], it, &ug[j * it]);
    });
    gemm<V>(ug, n, it, e.down[x], eo + off[x] * d, d, nt, gemm_scratch);
  }
  if (e.it_shared > 0) {
    const int64_t sn = e.shared_gu->n_out;
    gemm<V>(h, m, d, *e.shared_gu, sh_gu, sn, nt, gemm_scratch);
    parallel_for(m, nt, [&](int64_t b0, int64_t b1, int) {
      for (int64_t t = b0; t < b1; ++t)
        mlp_combine<V>(e.mlp, &sh_gu[t * sn], e.it_shared, &sh_u[t * e.it_shared]);
    });
    gemm<V>(sh_u, m, e.it_shared, *e.shared_down, sh_o, d, nt, gemm_scratch);
    gemm<V>(h, m, d, *e.shared_gate, sh_g, 1, nt, gemm_scratch);
  }
  // 3. the fixed-order sum, per token
  parallel_for(m, nt, [&](int64_t b0, int64_t b1, int) {
    for (int64_t t = b0; t < b1; ++t) {
      float* yt = &y[t * d];
      for (int64_t i = 0; i < d; ++i) yt[i] = 0.0f;
      int64_t last = -1;  // experts in increasing index: the next chosen one above `last`
      for (int64_t r = 0; r < k; ++r) {
        int64_t pick = -1;
        for (int64_t q = 0; q < k; ++q) {
          const int64_t x = idx[t * k + q];
          if (x > last && (pick < 0 || x < idx[t * k + pick])) pick = q;
        }
        last = idx[t * k + pick];
        const float wv = wts[t * k + pick];
        const float* o = &eo[pos_of[t * k + pick] * d];
        for (int64_t i = 0; i < d; ++i) yt[i] = std::fma(wv, o[i], yt[i]);
      }
      if (e.it_shared > 0) {
        const float g = sh_g[t];
        const float s = 1.0f / (1.0f + math::exp_f32(-g));  // sigmoid, SPEC 3.4's exp
        const float* o = &sh_o[t * d];
        for (int64_t i = 0; i < d; ++i) yt[i] = std::fma(s, o[i], yt[i]);
      }
    }
  });
}

}  // namespace eb::ops
