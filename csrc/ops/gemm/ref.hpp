// Scalar reference of the GEMM (the naive twin of tiles.hpp/driver.hpp): a triple loop with
// std::fma in the SEQ order, then + bias (SPEC 3.3). Tests compare every ISA's GEMM with it.
#pragma once
#include <cstdint>

namespace eb::ops {

// Scalar reference: c (m, ldc) = a (m, lda) * W^T + bias.
void gemm_ref(const float* a, int64_t m, int64_t lda, const float* w, int64_t n_out, int64_t k_in,
              const float* bias, float* c, int64_t ldc);

}  // namespace eb::ops
