// The products of a backward pass (SPEC 7.5), as one outer-product kernel and one column
// reduction, each output element a single FMA chain in a fixed order:
//   outer_gemm   C[r][j] = SEQ_k fma(A(k, r), Bm[k][j], acc) from +0.0, k = 0..K-1 ascending
//                with A(k, r) = A[k * sak + r * sar] (strides: both A and its transpose work)
//   col_reduce   out[j] = SEQ_m fma(A[m][j], Bm[m][j], acc) from +0.0 (Bm null: acc + A[m][j])
// Vectorised across j only (each lane is its own output element) and parallel over column
// tiles / blocks only (each element is computed whole by one thread), so neither the ISA nor
// the thread count can change a bit. Reference twins: ops/ref/backward_ref.hpp.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "base/parallel.hpp"

namespace eb::ops {

namespace detail {

// Rows r0..r0+R of C over columns j0.. of NV whole vectors: the register tile.
template <class V, int R, int NV>
inline void outer_tile(const float* A, int64_t sak, int64_t sar, const float* Bm, int64_t ldb,
                       int64_t K, int64_t r0, int64_t j0, float* C, int64_t ldc) {
  V acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < NV; ++q) acc[r][q] = V::zero();
  const float* a = A + r0 * sar;
  const float* b = Bm + j0;
  for (int64_t k = 0; k < K; ++k) {
    V bv[NV];
    for (int q = 0; q < NV; ++q) bv[q] = V::load(b + k * ldb + q * V::kLanes);
    for (int r = 0; r < R; ++r) {
      const V av = V::set1(a[k * sak + r * sar]);
      for (int q = 0; q < NV; ++q) acc[r][q] = V::fma(av, bv[q], acc[r][q]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < NV; ++q) acc[r][q].store(C + (r0 + r) * ldc + j0 + q * V::kLanes);
}

}  // namespace detail

constexpr int kOuterRows = 4;  // rows per register tile
constexpr int kOuterVecs = 3;  // vectors per register tile

// Floats of outer_gemm's scratch per thread for a reduction length K: one packed strip of Bm.
template <class V>
int64_t outer_gemm_scratch_floats(int64_t K) {
  return K * kOuterVecs * V::kLanes;
}

// One task per column tile of cw columns: its strip of Bm is packed contiguously (K, cw) into
// the thread's scratch (outer_gemm_scratch_floats<V>(K) floats, the tid-th slice), then every
// row tile runs over it. Packing moves no arithmetic: each element is still its one chain.
template <class V>
void outer_gemm(const float* A, int64_t sak, int64_t sar, const float* Bm, int64_t ldb, int64_t R,
                int64_t N, int64_t K, float* C, int64_t ldc, int n_threads, float* scratch) {
  constexpr int64_t cw = kOuterVecs * V::kLanes;
  const int64_t n_ct = (N + cw - 1) / cw;
  if (n_ct == 0 || R == 0) return;
  const int64_t per_thread = outer_gemm_scratch_floats<V>(K);
  parallel_for(n_ct, n_threads, [&](int64_t t0, int64_t t1, int tid) {
    float* bp = scratch + tid * per_thread;
    for (int64_t ct = t0; ct < t1; ++ct) {
      const int64_t j0 = ct * cw, cols = std::min(cw, N - j0);
      if (cols == cw) {
        for (int64_t k = 0; k < K; ++k)
          for (int64_t j = 0; j < cw; ++j) bp[k * cw + j] = Bm[k * ldb + j0 + j];
      }
      int64_t r0 = 0;
      if (cols == cw)
        for (; r0 + kOuterRows <= R; r0 += kOuterRows)
          detail::outer_tile<V, kOuterRows, kOuterVecs>(A, sak, sar, bp, cw, K, r0, 0, C + j0, ldc);
      for (int64_t r = r0; r < R; ++r) {
        int64_t j = j0;
        for (; j + V::kLanes <= j0 + cols; j += V::kLanes)
          detail::outer_tile<V, 1, 1>(A, sak, sar, Bm, ldb, K, r, j, C, ldc);
        for (; j < j0 + cols; ++j) {
          float acc = 0.0f;
          for (int64_t k = 0; k < K; ++k)
            acc = std::fma(A[k * sak + r * sar], Bm[k * ldb + j], acc);
          C[r * ldc + j] = acc;
        }
      }
    }
  });
}

template <class V>
void col_reduce(const float* A, int64_t lda, const float* Bm, int64_t ldb, int64_t M, int64_t N,
                float* out, int n_threads) {
  constexpr int64_t kBlock = 64;  // columns per task
  const int64_t n_blocks = (N + kBlock - 1) / kBlock;
  parallel_for(n_blocks, n_threads, [&](int64_t b0, int64_t b1, int) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t j0 = blk * kBlock, j1 = std::min(N, j0 + kBlock);
      int64_t j = j0;
      for (; j + V::kLanes <= j1; j += V::kLanes) {
        V acc = V::zero();
        if (Bm) {
          for (int64_t m = 0; m < M; ++m)
            acc = V::fma(V::load(A + m * lda + j), V::load(Bm + m * ldb + j), acc);
        } else {
          for (int64_t m = 0; m < M; ++m) acc = V::add(acc, V::load(A + m * lda + j));
        }
        acc.store(out + j);
      }
      for (; j < j1; ++j) {
        float acc = 0.0f;
        if (Bm) {
          for (int64_t m = 0; m < M; ++m) acc = std::fma(A[m * lda + j], Bm[m * ldb + j], acc);
        } else {
          for (int64_t m = 0; m < M; ++m) acc = acc + A[m * lda + j];
        }
        out[j] = acc;
      }
    }
  });
}

}  // namespace eb::ops
