// Plain references ("naive twins") of the backward kernels (SPEC 7.5): the gradient products
// and the reverse-time adjoint of the Mamba-2 recurrence. Each is a scalar loop over the
// documented op order, written from the contract and not from the fast kernel's structure
// (no chunks: every state of the row is kept), compiled once with the baseline flags. The
// Mamba-2 backward runs them in place of the fast kernels when asked (naive = true), so the
// tests compare the two whole backward passes bit for bit on every ISA.
#pragma once
#include <cstdint>

#include "ops/ssm_scan_backward.hpp"

namespace eb::ops::ref {

// C[r][j] = SEQ_k fma(A[k * sak + r * sar], Bm[k * ldb + j], acc) from +0.0.
// Twin of outer_gemm<V>.
void outer_gemm_ref(const float* A, int64_t sak, int64_t sar, const float* Bm, int64_t ldb,
                    int64_t R, int64_t N, int64_t K, float* C, int64_t ldc);

// out[j] = SEQ_m fma(A[m][j], Bm[m][j], acc) from +0.0, or SEQ_m (acc + A[m][j]) when Bm is
// null. Twin of col_reduce<V>.
void col_reduce_ref(const float* A, int64_t lda, const float* Bm, int64_t ldb, int64_t M, int64_t N,
                    float* out);

// The adjoint of one (row, head) from a zero state (ssm_scan_backward.hpp's formulas), the
// forward states h_0 .. h_(n-1) recomputed from zero and all kept (n * head_dim * d_state
// floats allocated here). Twin of ssm_scan_backward<V>.
void ssm_scan_backward_ref(const ScanBackwardArgs& g);

}  // namespace eb::ops::ref
