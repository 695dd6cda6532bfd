// Causal / sliding-window attention for one query row and one head (SPEC 4.3 step 6):
//   s_j = L16(q . k_j) * scale  [softcap: s_j = tanh(s_j / cap) * cap]   j = j0 .. p in order
//   m = max_j s_j,  e_j = exp(s_j - m),  Z = L16(e),  p_j = e_j / Z,  o = SEQ_j(p_j * v_j)
// Keys are enumerated in increasing absolute position from j0 = max(0, p - window + 1), so
// prefill, chunks and decode give the same bits; key_at(j)/val_at(j) hide where position j
// lives (the state's ring slot or the current call's fresh K/V). GQA: the caller passes the
// kv head h / n_rep (HF repeat_kv order). scores: scratch of p - j0 + 1 floats.
// Source: HF eager_attention_forward (Llama; Gemma2 softcap). Reference twin: <VecScalar>.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "math/exp.hpp"
#include "math/tanh.hpp"
#include "ops/finite/bits.hpp"
#include "ops/reduce.hpp"

namespace eb::ops {

// In place over n raw scores: s = score * scale [softcap: s = tanh(s / cap) * cap], m = max s,
// e = exp(s - m), Z = L16(e), p = e / Z (SPEC 4.3 step 6). The scaling and the max are
// vectorised; the max is exact in any order (only the sign of a zero maximum may depend on
// the lane count, and exp(s - m) is the same for m = +0 or -0).
template <class V>
inline void softmax_scores(float* sc, int64_t n, float scale, float softcap) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i0 = 0;
  if (softcap <= 0.0f) {
    const V sv = V::set1(scale);
    V mv = V::set1(-std::numeric_limits<float>::infinity());
    for (; i0 + V::kLanes <= n; i0 += V::kLanes) {
      const V s = V::mul(V::load(sc + i0), sv);
      s.store(sc + i0);
      mv = V::max(s, mv);
    }
    float lanes[V::kLanes];
    mv.store(lanes);
    for (int l = 0; l < V::kLanes; ++l) m = lanes[l] > m ? lanes[l] : m;
  }
  for (int64_t i = i0; i < n; ++i) {
    float s = sc[i] * scale;
    if (softcap > 0.0f) s = math::tanh_f32(s / softcap) * softcap;
    sc[i] = s;
    m = s > m ? s : m;
  }
  for (int64_t i = 0; i < n; ++i) sc[i] = sc[i] - m;
  V::exp_array(sc, sc, n);  // = math::exp_f32 per element, vectorised
  const float z = sum_l16<V>(sc, n);
  for (int64_t i = 0; i < n; ++i) sc[i] = sc[i] / z;
}

namespace detail {

// o_r[d] (d < hd_vec) = SEQ_{j = lo..hi} fma(sc_r[j], v_j[d], o_r[d]) for RG heads at once,
// starting from +0.0 (first) or the stored partial sums: one value load serves RG heads and
// RG * NV independent chains hide the FMA latency. Each element's operations and their order
// are those of the one-head loop. Key j: score sc_r[j - j0], value val_at(j).
template <class V, int RG, int NV, class ValAt>
inline void pv_chunk(const float* const* sc, float* const* oo, ValAt val_at, int64_t j0, int64_t d0,
                     int64_t lo, int64_t hi, bool first) {
  constexpr int kL = V::kLanes;
  V acc[RG][NV];
  for (int r = 0; r < RG; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = first ? V::zero() : V::load(oo[r] + d0 + j * kL);
  for (int64_t jj = lo; jj <= hi; ++jj) {
    const float* v = val_at(jj) + d0;
    V pj[RG];
    for (int r = 0; r < RG; ++r) pj[r] = V::set1(sc[r][jj - j0]);
    for (int j = 0; j < NV; ++j) {
      const V vv = V::load(v + j * kL);
      for (int r = 0; r < RG; ++r) acc[r][j] = V::fma(pj[r], vv, acc[r][j]);
    }
  }
  for (int r = 0; r < RG; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j].store(oo[r] + d0 + j * kL);
}

template <class V, int RG, class ValAt>
inline void pv_heads_rg(const float* const* sc, float* const* oo, ValAt val_at, int64_t j0,
                        int64_t hd_vec, int64_t lo, int64_t hi, bool first) {
  constexpr int kMaxNV = RG <= 2 ? 8 : 16 / RG;  // at most 16 accumulators
  constexpr int kL = V::kLanes;
  for (int64_t d0 = 0; d0 < hd_vec;) {
    const int64_t left = (hd_vec - d0) / kL;
    if (left >= kMaxNV) {
      pv_chunk<V, RG, kMaxNV>(sc, oo, val_at, j0, d0, lo, hi, first);
      d0 += kMaxNV * kL;
      continue;
    }
    switch (left) {  // the last piece, with a compile-time vector count
      case 1: pv_chunk<V, RG, 1>(sc, oo, val_at, j0, d0, lo, hi, first); break;
      case 2: pv_chunk<V, RG, 2>(sc, oo, val_at, j0, d0, lo, hi, first); break;
      case 3: pv_chunk<V, RG, 3>(sc, oo, val_at, j0, d0, lo, hi, first); break;
      case 4: pv_chunk<V, RG, 4>(sc, oo, val_at, j0, d0, lo, hi, first); break;
      case 5: pv_chunk<V, RG, 5>(sc, oo, val_at, j0, d0, lo, hi, first); break;
      case 6: pv_chunk<V, RG, 6>(sc, oo, val_at, j0, d0, lo, hi, first); break;
      default: pv_chunk<V, RG, 7>(sc, oo, val_at, j0, d0, lo, hi, first); break;
    }
    d0 += left * kL;
  }
}

// o_r[d] for rg <= 4 heads and every d < head_dim: whole vectors by pv_chunk (in pieces of
// at most 16 accumulators), the last head_dim % kLanes columns by the same scalar fma chain.
template <class V, class ValAt>
inline void pv_heads(int rg, const float* const* sc, float* const* oo, ValAt val_at, int64_t j0,
                     int64_t head_dim, int64_t lo, int64_t hi, bool first) {
  const int64_t hd_vec = head_dim - head_dim % V::kLanes;
  switch (rg) {
    case 1: pv_heads_rg<V, 1>(sc, oo, val_at, j0, hd_vec, lo, hi, first); break;
    case 2: pv_heads_rg<V, 2>(sc, oo, val_at, j0, hd_vec, lo, hi, first); break;
    case 3: pv_heads_rg<V, 3>(sc, oo, val_at, j0, hd_vec, lo, hi, first); break;
    default: pv_heads_rg<V, 4>(sc, oo, val_at, j0, hd_vec, lo, hi, first); break;
  }
  for (int r = 0; r < rg; ++r)
    for (int64_t d = hd_vec; d < head_dim; ++d) {
      float s = first ? 0.0f : oo[r][d];
      for (int64_t jj = lo; jj <= hi; ++jj) s = std::fma(sc[r][jj - j0], val_at(jj)[d], s);
      oo[r][d] = s;
    }
}

}  // namespace detail

// R query heads that share one KV head (GQA, R <= 4) run together: every key and value vector
// is loaded once for the R heads, and the R independent chains hide the FMA latency. Each
// head's arithmetic is exactly the order above, whatever R is (so any grouping, any ISA and
// any thread split give the same bits; the twin is <VecScalar, 1>). The lane sums of 16
// consecutive keys are reduced together (V::reduce16_x16: reduce16's adds, fewer shuffles).
// q[r], o[r]: the heads' query and output (head_dim); scores: R rows of `stride` floats.
// raw_nonfinite (may be null): set to whether a raw score q[0] . k_j is not finite, which every
// non-finite key element makes it (an infinite or NaN product poisons the L16 sum); the caller
// uses it, with the outputs, to find a non-finite cache slot without a separate pass.
template <class V, int R, class KeyAt, class ValAt>
inline void attention_heads(const float* const* q, int64_t head_dim, int64_t j0, int64_t p,
                            KeyAt key_at, ValAt val_at, float scale, float softcap, float* scores,
                            int64_t stride, float* const* o, bool* raw_nonfinite = nullptr) {
  constexpr int NV = kReduceLanes / V::kLanes;
  const int64_t n = p - j0 + 1;
  const int64_t full = head_dim - head_dim % kReduceLanes;
  float qt[R][kReduceLanes];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < kReduceLanes; ++j) qt[r][j] = 0.0f;
    if (full < head_dim)
      std::memcpy(qt[r], q[r] + full, sizeof(float) * static_cast<size_t>(head_dim - full));
  }
  alignas(64) float lanes[R][kReduceLanes][kReduceLanes];  // the last 16 keys' lane sums
  constexpr int64_t kAhead = 8;  // keys prefetched ahead (the cache rows arrive from L3/DRAM)
  for (int64_t i = 0; i < n; ++i) {
    const float* k = key_at(j0 + i);
    if (i + kAhead < n) {
      const char* kp = reinterpret_cast<const char*>(key_at(j0 + i + kAhead));
      for (int64_t off = 0; off < head_dim * 4; off += 64) __builtin_prefetch(kp + off);
    }
    V acc[R][NV];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = V::zero();
    for (int64_t c = 0; c < full; c += kReduceLanes)
      for (int j = 0; j < NV; ++j) {
        const V kv = V::load(k + c + j * V::kLanes);
        for (int r = 0; r < R; ++r)
          acc[r][j] = V::fma(V::load(q[r] + c + j * V::kLanes), kv, acc[r][j]);
      }
    if (full < head_dim) {
      float kt[kReduceLanes] = {0};
      std::memcpy(kt, k + full, sizeof(float) * static_cast<size_t>(head_dim - full));
      for (int j = 0; j < NV; ++j) {
        const V kv = V::load(kt + j * V::kLanes);
        for (int r = 0; r < R; ++r)
          acc[r][j] = V::fma(V::load(qt[r] + j * V::kLanes), kv, acc[r][j]);
      }
    }
    const int64_t slot = i % kReduceLanes;
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j].store(&lanes[r][slot][j * V::kLanes]);
    if (slot == kReduceLanes - 1)
      for (int r = 0; r < R; ++r) V::reduce16_x16(&lanes[r][0][0], scores + r * stride + i - slot);
  }
  for (int64_t i = n - n % kReduceLanes; i < n; ++i)  // the last n % 16 keys one by one
    for (int r = 0; r < R; ++r) {
      V acc[NV];
      for (int j = 0; j < NV; ++j) acc[j] = V::load(&lanes[r][i % kReduceLanes][j * V::kLanes]);
      scores[r * stride + i] = V::reduce16(acc);
    }
  if (raw_nonfinite) *raw_nonfinite = any_nonfinite<V>(scores, n);
  for (int r = 0; r < R; ++r) softmax_scores<V>(scores + r * stride, n, scale, softcap);
  const float* sc[R];
  for (int r = 0; r < R; ++r) sc[r] = scores + r * stride;
  detail::pv_heads<V>(R, sc, o, val_at, j0, head_dim, j0, p, true);
}

// Q consecutive queries (positions p0 .. p0+Q-1) of one row and the R query heads of one KV
// head, keys in transposed blocks (kt) and values packed per position (vp), both starting at
// position `base` (prefill). kt[blk][d][lane] = k_(base + blk*kLanes + lane)[d]: the L16
// lane structure is kept per key (acc[i mod 16] is a vector over kLanes keys taking the terms
// i = j, j+16, ... in increasing i, then the same w = 8, 4, 2, 1 tree), so each score has
// exactly dot_l16's bits without a horizontal reduction per key. Each (query, head) gets exactly
// attention_heads' operations in the same order; only the loop nest differs: a key block or value
// chunk is reused from L1 by all Q*R pairs instead of being streamed from L2 once per pair. Outputs
// accumulate over value chunks through o (float store and reload: exact), as the GEMM's K blocks
// do. q[i], o[i] for i = qi*R + r; scores: Q*R rows of `stride` floats.
template <class V>
inline void attention_prefill_block(const float* const* q, int Q, int R, int64_t head_dim,
                                    int64_t window, int64_t p0, const float* kt, const float* vp,
                                    int64_t base, float scale, float softcap, float* scores,
                                    int64_t stride, float* const* o) {
  constexpr int kL = V::kLanes;
  const auto j0_of = [&](int qi) -> int64_t {
    return window > 0 ? std::max<int64_t>(0, p0 + qi - window + 1) : 0;
  };
  const int64_t p_last = p0 + Q - 1;
  // 1. raw scores, key block by key block
  for (int64_t jb = base + (j0_of(0) - base) / kL * kL; jb <= p_last; jb += kL) {
    const float* blk = kt + (jb - base) / kL * head_dim * kL;
    for (int qi = 0; qi < Q; ++qi) {
      const int64_t j0 = j0_of(qi), p = p0 + qi;
      if (jb + kL - 1 < j0 || jb > p) continue;
      const int64_t lo = std::max(jb, j0), hi = std::min(jb + kL - 1, p);
      for (int r = 0; r < R; ++r) {
        const float* qq = q[qi * R + r];
        V acc[kReduceLanes];
        for (int j = 0; j < kReduceLanes; ++j) acc[j] = V::zero();
        int64_t d = 0;
        for (; d + kReduceLanes <= head_dim; d += kReduceLanes)
          for (int j = 0; j < kReduceLanes; ++j)
            acc[j] = V::fma(V::set1(qq[d + j]), V::load(blk + (d + j) * kL), acc[j]);
        for (int j = 0; d + j < head_dim; ++j)
          acc[j] = V::fma(V::set1(qq[d + j]), V::load(blk + (d + j) * kL), acc[j]);
        for (int w = kReduceLanes / 2; w >= 1; w /= 2)
          for (int j = 0; j < w; ++j) acc[j] = V::add(acc[j], acc[j + w]);
        float tmp[kL];
        acc[0].store(tmp);
        float* sc = scores + (qi * R + r) * stride;
        for (int64_t j = lo; j <= hi; ++j) sc[j - j0] = tmp[j - jb];
      }
    }
  }
  // 2. softmax of every (query, head) row
  for (int qi = 0; qi < Q; ++qi)
    for (int r = 0; r < R; ++r)
      softmax_scores<V>(scores + (qi * R + r) * stride, p0 + qi - j0_of(qi) + 1, scale, softcap);
  // 3. o = SEQ over keys, value chunk by value chunk (kVChunk positions stay in L1)
  constexpr int64_t kVChunk = 64;
  for (int64_t c0 = j0_of(0); c0 <= p_last; c0 += kVChunk) {
    const int64_t c1 = std::min(c0 + kVChunk - 1, p_last);
    for (int qi = 0; qi < Q; ++qi) {
      const int64_t j0 = j0_of(qi), p = p0 + qi;
      const int64_t lo = std::max(c0, j0), hi = std::min(c1, p);
      if (lo > hi) continue;
      const bool first = lo == j0;
      for (int r0 = 0; r0 < R; r0 += 4) {
        const int rg = std::min(R - r0, 4);
        const float* sc[4];
        float* oo[4];
        for (int r = 0; r < rg; ++r) {
          sc[r] = scores + (qi * R + r0 + r) * stride;
          oo[r] = o[qi * R + r0 + r];
        }
        detail::pv_heads<V>(
            rg, sc, oo, [&](int64_t j) { return vp + (j - base) * head_dim; }, j0, head_dim, lo, hi,
            first);
      }
    }
  }
}

}  // namespace eb::ops
