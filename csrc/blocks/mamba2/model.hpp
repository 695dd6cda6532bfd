// Mamba2Model: one Mamba-2 block's resolved sizes and packed weights; Mamba2Call: the arrays
// of one forward call (HF Mamba2Block, recurrent form; SPEC 7.3). Python validated all.
#pragma once
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/undo.hpp"
#include "base/workspace.hpp"
#include "blocks/mamba2/config.hpp"
#include "blocks/weight_map.hpp"
#include "ops/gemm/format.hpp"

namespace eb::blocks {

struct Mamba2Model {
  Mamba2Config cfg;
  float norm_eps = 0.0f, dt_min = 0.0f, dt_max = 0.0f;  // cfg's, rounded to float32 once
  std::vector<float> block_norm_w;                      // (d_model,)
  ops::PackedMatrix w_in;             // in_proj (d_inner + conv_dim + n_heads, d_model)
  std::vector<float> conv_w, conv_b;  // (conv_dim, conv_kernel), (conv_dim,) or empty
  std::vector<float> conv_w_t;        // (conv_kernel, conv_dim): conv_w transposed for the kernel
  std::vector<float> dt_bias, a, d;   // (n_heads,) each; a = -exp(A_log) with the own exp
  std::vector<float> gated_norm_w;    // (d_inner,)
  ops::PackedMatrix w_out;            // out_proj (d_model, d_inner)

  Mamba2Model(const Mamba2Config& c, const WeightMap& weights);
};

struct Mamba2Call {
  const float* x;  // (batch, n_tokens, d_model)
  float* y;        // (batch, n_tokens, d_model), zero-filled by the caller
  int64_t batch, n_tokens;
  const int64_t* lengths;  // (batch,)
  float* conv_window;      // (batch, conv_dim, conv_kernel), updated in place for rows advanced
  float* h;                // (batch, n_heads, head_dim, d_state), updated in place
  int n_threads;
  Workspace* ws;  // scratch kept between calls, or nullptr
  // SPEC 2.4 / 8: what the call reads of each advancing row (conv_window[b, :, 1:], h[b]) must
  // be finite. When it is not, the call sets *state_nonfinite = 1 and returns before writing
  // anything (y is then garbage; the caller names the element). nullptr: not checked.
  int* state_nonfinite = nullptr;
  // Undo log (base/undo.hpp): conv_window and h rows are saved into it by the task that
  // overwrites them, just before, so that a call stopped midway (or a whole-model call failing
  // in a later layer) restores them. nullptr: nothing is saved, and the call is not stopped
  // once it starts writing the state.
  UndoLog* undo = nullptr;
};

}  // namespace eb::blocks
