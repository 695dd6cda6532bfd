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

#include "threading/parallel.hpp"

namespace eb::ops {

constexpr int kGemmNR = 32;

// W (n_out, k_in) row-major (torch [out, in]) packed into ceil(n_out / kGemmNR) panels, each
// (k_in, kGemmNR) with zero columns past n_out. Bias optional (empty when absent).
struct PackedMatrix {
  int64_t n_out = 0, k_in = 0, n_panels = 0;
  std::vector<float> data;
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

template <class V>
struct GemmTraits {
  static constexpr int kMR = V::kLanes >= 16 ? 6 : (V::kLanes >= 8 ? 3 : 2);
};

// One MR x kGemmNR tile; writes nr_valid columns of each of the MR rows.
template <class V, int MR>
inline void gemm_tile(const float* a, int64_t lda, const float* panel, int64_t k_in,
                      const float* bias, float* c, int64_t ldc, int nr_valid) {
  constexpr int NV = kGemmNR / V::kLanes;
  V acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = V::zero();
  for (int64_t k = 0; k < k_in; ++k) {
    V b_k[NV];
    for (int j = 0; j < NV; ++j) b_k[j] = V::load(panel + k * kGemmNR + j * V::kLanes);
    for (int r = 0; r < MR; ++r) {
      const V a_rk = V::set1(a[r * lda + k]);
      for (int j = 0; j < NV; ++j) acc[r][j] = V::fma(a_rk, b_k[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    float tmp[kGemmNR];
    for (int j = 0; j < NV; ++j) acc[r][j].store(tmp + j * V::kLanes);
    float* c_r = c + r * ldc;
    if (bias) {
      for (int j = 0; j < nr_valid; ++j) c_r[j] = tmp[j] + bias[j];
    } else {
      for (int j = 0; j < nr_valid; ++j) c_r[j] = tmp[j];
    }
  }
}

template <class V, int MR>
inline void gemm_rows(int rows, const float* a, int64_t lda, const float* panel, int64_t k_in,
                      const float* bias, float* c, int64_t ldc, int nr_valid) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      gemm_tile<V, MR>(a, lda, panel, k_in, bias, c, ldc, nr_valid);
    } else {
      gemm_rows<V, MR - 1>(rows, a, lda, panel, k_in, bias, c, ldc, nr_valid);
    }
  }
}

// c (m, ldc) = a (m, lda) * W^T (+ bias); tasks (panel, row block) split over threads.
template <class V>
void gemm(const float* a, int64_t m, int64_t lda, const PackedMatrix& w, float* c, int64_t ldc,
          int n_threads) {
  constexpr int MR = GemmTraits<V>::kMR;
  const int64_t n_mb = (m + MR - 1) / MR;
  const int64_t tasks = w.n_panels * n_mb;
  parallel_for(tasks, n_threads, [&](int64_t begin, int64_t end, int) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = t / n_mb, mb = t % n_mb;
      const int64_t r0 = mb * MR;
      const int rows = static_cast<int>(std::min<int64_t>(MR, m - r0));
      const int64_t n0 = p * kGemmNR;
      const int nr_valid = static_cast<int>(std::min<int64_t>(kGemmNR, w.n_out - n0));
      gemm_rows<V, MR>(rows, a + r0 * lda, lda, w.data.data() + p * w.k_in * kGemmNR, w.k_in,
                       w.has_bias() ? w.bias.data() + n0 : nullptr, c + r0 * ldc + n0, ldc,
                       nr_valid);
    }
  });
}

}  // namespace eb::ops

namespace eb::ops {
// MLP kinds 0..2 (swiglu, geglu, geglu_tanh) are gated: see ops/activations.hpp.
inline bool mlp_is_gated_kind(int kind) { return kind <= 2; }
}  // namespace eb::ops
