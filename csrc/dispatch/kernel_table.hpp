// Run-time ISA dispatch (ATen pattern): each ISA's kernels are compiled in their own
// translation unit and namespace (csrc/dispatch/kernels_isa.cpp) and exposed as one KernelTable;
// the best table the CPU supports is chosen once at import, EXACTBLOCKS_ISA or set_isa()
// can force another. Every table gives the same bits (SPEC 3.1).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "blocks/mamba2/backward_call.hpp"
#include "blocks/mamba2/model.hpp"
#include "blocks/transformer/model.hpp"
#include "ops/gemm/format.hpp"

namespace eb {

struct KernelTable {
  const char* name;
  void (*transformer_forward)(const blocks::TransformerModel&, const blocks::TransformerCall&);
  void (*mamba2_forward)(const blocks::Mamba2Model&, const blocks::Mamba2Call&);
  void (*elementwise)(int op, const float* x, float* y, int64_t n);
  void (*gemm)(const float* a, int64_t m, int64_t lda, const ops::PackedMatrix& w, float* c,
               int64_t ldc, int n_threads);
  void (*norm_rows)(int kind, const float* x, int64_t rows, int64_t n, const float* w,
                    const float* b, float eps, float* y);
  float (*dot_l16)(const float* a, const float* b, int64_t n);
  float (*sum_l16)(const float* a, int64_t n);
  // out[i] = the L16 tree over acc[16 i .. 16 i + 15], i = 0..15 (V::reduce16_x16; tests only).
  void (*reduce16_x16)(const float* acc, float* out);
  // True when p[0..n) holds a NaN or an infinity (reads only; the state and x checks).
  bool (*any_nonfinite)(const float* p, int64_t n);

  // Tests only: the kernels that have a plain twin in ops/ref/ref.hpp, run by this ISA on
  // contiguous arrays (tests/unit/test_twins.py, tests/cpp/digest_main.cpp). Keys and values of
  // position j sit at k + j * head_dim, v + j * head_dim.
  // attention_heads<V, R>, R = n_heads in 1..4: q (R, head_dim) over keys j0..p; probs
  // (R, stride) receive p_j (p - j0 + 1 per head), o (R, head_dim).
  void (*attention_decode)(const float* q, int n_heads, int64_t head_dim, const float* k,
                           const float* v, int64_t j0, int64_t p, float scale, float softcap,
                           float* probs, int64_t stride, float* o);
  // attention_prefill_block<V>: n_q queries at positions p0.. with n_heads heads each, q
  // (n_q, n_heads, head_dim); keys from position base <= the first query's j0 are packed into
  // kt / vp in scratch (2 * (p0 + n_q - base + 16) * head_dim floats); probs (n_q, n_heads,
  // stride), o (n_q, n_heads, head_dim).
  void (*attention_prefill)(const float* q, int n_q, int n_heads, int64_t head_dim, int64_t window,
                            int64_t p0, const float* k, const float* v, int64_t base, float scale,
                            float softcap, float* scratch, float* probs, int64_t stride, float* o);
  // softmax_scores<V> on s (n), in place.
  void (*softmax)(float* s, int64_t n, float scale, float softcap);
  // conv1d_token<V>: w and u (k_taps, ld), nc <= ld channels, bias (nc) or null, out (nc).
  void (*conv1d)(const float* w, const float* u, int64_t ld, int64_t nc, int64_t k_taps,
                 const float* bias, float* out);
  // ssm_scan_step<V>: h (head_dim, d_state) in place, x and y (head_dim), b, c and the scratch
  // dtb (d_state).
  void (*ssm_scan_step)(float* h, int64_t head_dim, int64_t d_state, float dt, float a, float d,
                        const float* x, const float* b, const float* c, float* dtb, float* y);
  // ssm_scan_tokens<V>: n_tokens <= ops::kScanChunk tokens, dt (n_tokens), x and y (n_tokens,
  // head_dim), b and c (n_tokens, d_state); scratch of ops::ssm_scan_scratch_floats(d_state).
  void (*ssm_scan_tokens)(float* h, int64_t head_dim, int64_t d_state, int64_t n_tokens,
                          const float* dt, float a, float d, const float* x, const float* b,
                          const float* c, float* scratch, float* y);
  // rope_cos_sin + rope_apply at position pos on n_vec vectors v (n_vec, head_dim), in place;
  // inv_freq (rope_dim / 2), scratch (rope_dim).
  void (*rope)(float* v, int64_t n_vec, int64_t head_dim, int64_t rope_dim, int64_t pos,
               const float* inv_freq, float* scratch);
  // mlp_combine<V>: gu (2 * it gated, it ungated), u (it).
  void (*mlp_combine)(int kind, const float* gu, int64_t it, float* u);
  // The Mamba-2 block's backward (blocks/mamba2/backward.hpp).
  void (*mamba2_backward)(const blocks::Mamba2Model&, const blocks::Mamba2BackwardCall&);
};

// Elementwise op codes for KernelTable::elementwise (tests, and kOpExpVec for ops/sample.hpp's
// exps, passed in by the binding).
enum ElementwiseOp : int {
  kOpExp = 0,
  kOpLog1p,
  kOpTanh,
  kOpErf,
  kOpSin,
  kOpCos,
  kOpSilu,
  kOpSoftplus,
  kOpGelu,
  kOpGeluTanh,
  kOpExpVec  // the vectorised exp of the ISA (V::exp_array), must equal kOpExp bitwise
};

const KernelTable& kernels();
std::vector<std::string> available_isas();
void set_isa(const std::string& name);  // throws std::invalid_argument if unavailable
std::string get_isa();

}  // namespace eb
