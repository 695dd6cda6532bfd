// Mamba2BackwardCall: the arrays of one Mamba-2 backward call (SPEC 7.5), the gradients of a
// zero-state prefill. Python validated all; every output is zero-filled by the caller.
#pragma once
#include <cstdint>

namespace eb::blocks {

struct Mamba2BackwardCall {
  const float* x;   // (batch, n_tokens, d_model)
  const float* gy;  // (batch, n_tokens, d_model), the gradient of the block output
  int64_t batch, n_tokens;
  const int64_t* lengths;  // (batch,), real tokens per row, in [0, n_tokens]
  float* dx;               // (batch, n_tokens, d_model)
  // Weight gradients in torch's layouts (conv1d.weight as (conv_dim, conv_kernel)); the
  // biases are null when the block has none.
  float* d_block_norm_w;             // (d_model,)
  float* d_in_w;                     // (d_inner + conv_dim + n_heads, d_model)
  float* d_in_b;                     // (d_inner + conv_dim + n_heads,) or null
  float* d_conv_w;                   // (conv_dim, conv_kernel)
  float* d_conv_b;                   // (conv_dim,) or null
  float *d_dt_bias, *d_a_log, *d_d;  // (n_heads,) each
  float* d_norm_w;                   // (d_inner,), the gated norm
  float* d_out_w;                    // (d_model, d_inner)
  float* d_out_b;                    // (d_model,) or null
  int n_threads;
  // Run the naive twins of the gradient products and of the adjoint scan
  // (ops/ref/backward_ref.hpp) instead of the fast kernels: the same bits (tests).
  bool naive = false;
};

}  // namespace eb::blocks
