// The products of a backward pass (SPEC 7.5), as one outer-product kernel and one column
// reduction, each output element a single FMA chain in a fixed order:
//   outer_gemm   C[r][j] = SEQ_k fma(A(k, r), Bm[k][j], acc) from +0.0, k = 0..K-1 ascending
//                with A(k, r) = A[k * sak + r * sar] (strides: both A and its transpose work)
//   col_reduce   out[j] = SEQ_m fma(A[m][j], Bm[m][j], acc) from +0.0 (Bm null: acc + A[m][j])
// Vectorised across j only (each lane is its own output element) and parallel over output
// tiles only (each element is computed whole by one thread), so neither the ISA nor the
// thread count can change a bit. Reference twins: ops/ref/backward_ref.hpp.
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

template <class V>
void outer_gemm(const float* A, int64_t sak, int64_t sar, const float* Bm, int64_t ldb, int64_t R,
                int64_t N, int64_t K, float* C, int64_t ldc, int n_threads) {
  constexpr int64_t cw = kOuterVecs * V::kLanes;
  const int64_t n_ct = (N + cw - 1) / cw, n_rt = (R + kOuterRows - 1) / kOuterRows;
  if (n_ct == 0 || n_rt == 0) return;
  // tasks column tile major: a thread's consecutive tasks reuse one strip of Bm from cache
  parallel_for(n_ct * n_rt, n_threads, [&](int64_t t0, int64_t t1, int) {
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t r0 = (task % n_rt) * kOuterRows, j0 = (task / n_rt) * cw;
      const int64_t rows = std::min<int64_t>(kOuterRows, R - r0), cols = std::min(cw, N - j0);
      if (rows == kOuterRows && cols == cw) {
        detail::outer_tile<V, kOuterRows, kOuterVecs>(A, sak, sar, Bm, ldb, K, r0, j0, C, ldc);
        continue;
      }
      for (int64_t r = r0; r < r0 + rows; ++r) {
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
