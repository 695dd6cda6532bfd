// Packed GEMM (prefill) and GEMV (decode, M = 1..16) with ONE arithmetic (SPEC 3.3 SEQ,
// STYLE 5.3): c[m][n] = (fma chain over k = 0..K-1 of a[m][k] * w[n][k], from +0.0) + bias[n].
// Weights are packed once into panels of kGemmNR output features, k-major; the microkernel
// vectorises across the panel's outputs and runs k in order, so every output is the same
// in-order FMA chain whatever MR, M, the tile-mates, the ISA or the thread split.
// K is never split across threads. Reference twin: gemm_ref (a triple loop with std::fma).
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/aligned.hpp"
#include "threading/parallel.hpp"

namespace eb::ops {

constexpr int kGemmNR = 48;

// W (n_out, k_in) row-major (torch [out, in]) packed into ceil(n_out / kGemmNR) panels, each
// (k_in, kGemmNR) with zero columns past n_out. Bias optional (empty when absent).
struct PackedMatrix {
  int64_t n_out = 0, k_in = 0, n_panels = 0;
  AlignedVector<float> data;  // 64-byte aligned: panel rows are 3 whole cache lines
  std::vector<float> bias;
  bool has_bias() const { return !bias.empty(); }
};

// Stack several (n_i, k_in) row-major matrices vertically and pack them: the fused q|k|v and
// gate|up projections. Concatenation changes no output's FMA chain.
PackedMatrix pack_matrices(const std::vector<const float*>& parts, const std::vector<int64_t>& rows,
                           int64_t k_in, const std::vector<const float*>& biases);

// Scalar reference: c (m, ldc) = a (m, lda) * W^T + bias.
void gemm_ref(const float* a, int64_t m, int64_t lda, const float* w, int64_t n_out, int64_t k_in,
              const float* bias, float* c, int64_t ldc);

// A tile covers kCols = kNV vectors of a panel's columns and kMR rows: AVX-512 8 x 48
// (24 accumulators), AVX2 4 x 24 (12; two tiles per panel), scalar 2 x 48.
template <class V>
struct GemmTraits {
  static constexpr int kNV = V::kLanes >= 8 ? 3 : 48;
  static constexpr int kCols = kNV * V::kLanes;
  static constexpr int kMR = V::kLanes >= 16 ? 8 : (V::kLanes >= 8 ? 4 : 2);
};

// K is cache-blocked: a kGemmKC x kGemmNR slice of the panel (384 KB) stays in L2 while it
// is used for every row block (measured: smaller blocks that fit L1 were slower here, since
// they reload the partial sums more often). The blocks of one output run in increasing k and
// each continues from the partial sums (stored to c as float and reloaded: exact), so the FMA
// chain is the same single chain over k = 0..K-1 as without blocking.
constexpr int64_t kGemmKC = 2048;

// One MR x kCols tile over k in [k0, k1) (panel points at the tile's first column; panel rows
// are kGemmNR floats apart); writes nr_valid (<= kCols) columns of each of the MR rows.
// first: start from +0.0 (else reload the partial sums from c); last: add the bias and finish.
template <class V, int MR>
inline void gemm_tile(const float* a, int64_t lda, const float* panel, int64_t k0, int64_t k1,
                      bool first, bool last, const float* bias, float* c, int64_t ldc,
                      int nr_valid) {
  constexpr int NV = GemmTraits<V>::kNV;
  constexpr int NC = GemmTraits<V>::kCols;
  V acc[MR][NV];
  if (first) {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = V::zero();
  } else if (nr_valid == NC) {  // full tile: partial sums straight from c
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = V::load(c + r * ldc + j * V::kLanes);
  } else {
    for (int r = 0; r < MR; ++r) {
      float tmp[NC] = {0};
      for (int j = 0; j < nr_valid; ++j) tmp[j] = c[r * ldc + j];
      for (int j = 0; j < NV; ++j) acc[r][j] = V::load(tmp + j * V::kLanes);
    }
  }
  for (int64_t k = k0; k < k1; ++k) {
    {  // fetch the panel ahead: decode streams it from memory (harmless when it is cached)
      for (int j = 0; j < NC * 4; j += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(panel + (k + 16) * kGemmNR) + j);
    }
    V b_k[NV];
    for (int j = 0; j < NV; ++j) b_k[j] = V::load(panel + k * kGemmNR + j * V::kLanes);
    for (int r = 0; r < MR; ++r) {
      const V a_rk = V::set1(a[r * lda + k]);
      for (int j = 0; j < NV; ++j) acc[r][j] = V::fma(a_rk, b_k[j], acc[r][j]);
    }
  }
  if (nr_valid == NC) {  // full tile: store (with the bias added last) straight to c
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NV; ++j) {
        V out = acc[r][j];
        if (last && bias) out = V::add(out, V::load(bias + j * V::kLanes));
        out.store(c + r * ldc + j * V::kLanes);
      }
    return;
  }
  for (int r = 0; r < MR; ++r) {
    float tmp[NC];
    for (int j = 0; j < NV; ++j) acc[r][j].store(tmp + j * V::kLanes);
    float* c_r = c + r * ldc;
    if (last && bias) {
      for (int j = 0; j < nr_valid; ++j) c_r[j] = tmp[j] + bias[j];
    } else {
      for (int j = 0; j < nr_valid; ++j) c_r[j] = tmp[j];
    }
  }
}

template <class V, int MR>
inline void gemm_rows(int rows, const float* a, int64_t lda, const float* panel, int64_t k0,
                      int64_t k1, bool first, bool last, const float* bias, float* c,
                      int64_t ldc, int nr_valid) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      gemm_tile<V, MR>(a, lda, panel, k0, k1, first, last, bias, c, ldc, nr_valid);
    } else {
      gemm_rows<V, MR - 1>(rows, a, lda, panel, k0, k1, first, last, bias, c, ldc, nr_valid);
    }
  }
}

// c (m, ldc) = a (m, lda) * W^T (+ bias). Tasks (panel, row block) are split over threads in
// contiguous ranges; a thread walks its tasks panel by panel, K block by K block.
template <class V>
void gemm(const float* a, int64_t m, int64_t lda, const PackedMatrix& w, float* c, int64_t ldc,
          int n_threads) {
  constexpr int MR = GemmTraits<V>::kMR;
  constexpr int NC = GemmTraits<V>::kCols;
  const int64_t n_mb = (m + MR - 1) / MR;
  const int64_t tasks = w.n_panels * n_mb;
  const int64_t kk = w.k_in;
  parallel_for(tasks, n_threads, [&](int64_t begin, int64_t end, int) {
    for (int64_t t0 = begin; t0 < end;) {
      const int64_t p = t0 / n_mb;
      const int64_t t1 = std::min(end, (p + 1) * n_mb);  // this thread's tasks of panel p
      const int64_t n0 = p * kGemmNR;
      const int nr_valid = static_cast<int>(std::min<int64_t>(kGemmNR, w.n_out - n0));
      const float* panel = w.data.data() + p * kk * kGemmNR;
      const float* bias = w.has_bias() ? w.bias.data() + n0 : nullptr;
      for (int64_t k0 = 0; k0 < kk || k0 == 0; k0 += kGemmKC) {
        const int64_t k1 = std::min(kk, k0 + kGemmKC);
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t r0 = (t % n_mb) * MR;
          const int rows = static_cast<int>(std::min<int64_t>(MR, m - r0));
          for (int c0 = 0; c0 < nr_valid; c0 += NC)
            gemm_rows<V, MR>(rows, a + r0 * lda, lda, panel + c0, k0, k1, k0 == 0, k1 == kk,
                             bias ? bias + c0 : nullptr, c + r0 * ldc + n0 + c0, ldc,
                             std::min(NC, nr_valid - c0));
        }
        if (k1 == kk) break;
      }
      t0 = t1;
    }
  });
}

}  // namespace eb::ops

namespace eb::ops {
// MLP kinds 0..2 (swiglu, geglu, geglu_tanh) are gated: see ops/activations.hpp.
inline bool mlp_is_gated_kind(int kind) { return kind <= 2; }
}  // namespace eb::ops
