// One kernel table per ISA: this file is compiled once per ISA with that ISA's flags and
// EB_ISA_<name> defined (CMakeLists.txt); everything it instantiates lives in namespace
// eb::isa_<name>, so the per-ISA copies of the templates never collide (ATen rule).
#include "blocks/mamba2/backward.hpp"
#include "blocks/mamba2/forward.hpp"
#include "blocks/transformer/forward.hpp"
#include "dispatch/kernel_table.hpp"
#include "math/derived.hpp"
#include "ops/activations.hpp"
#include "ops/attention/kernels.hpp"
#include "ops/conv1d.hpp"
#include "ops/finite/bits.hpp"
#include "ops/gemm/driver.hpp"
#include "ops/norm.hpp"
#include "ops/reduce.hpp"
#include "ops/rope.hpp"
#include "ops/ssm_scan.hpp"

#if defined(EB_ISA_avx512)
#include "simd/vec_avx512.hpp"
#define EB_VEC eb::simd::VecAvx512
#define EB_ISA_STR "avx512"
#elif defined(EB_ISA_avx2)
#include "simd/vec_avx2.hpp"
#define EB_VEC eb::simd::VecAvx2
#define EB_ISA_STR "avx2"
#elif defined(EB_ISA_neon)
#include "simd/vec_neon.hpp"
#define EB_VEC eb::simd::VecNeon
#define EB_ISA_STR "neon"
#else
#include "simd/vec_scalar.hpp"
#define EB_VEC eb::simd::VecScalar
#define EB_ISA_STR "scalar"
#endif

namespace eb::EB_ISA_NAME {
namespace {
using V = EB_VEC;

void transformer_forward(const blocks::TransformerModel& m, const blocks::TransformerCall& c) {
  blocks::transformer_forward<V>(m, c);
}

void mamba2_forward(const blocks::Mamba2Model& m, const blocks::Mamba2Call& c) {
  blocks::mamba2_forward<V>(m, c);
}

float apply(int op, float v) {
  switch (op) {
    case kOpExp: return math::exp_f32(v);
    case kOpLog1p: return math::log1p_f32(v);
    case kOpTanh: return math::tanh_f32(v);
    case kOpErf: return math::erf_f32(v);
    case kOpSin: return math::sin_f32(v);
    case kOpCos: return math::cos_f32(v);
    case kOpSilu: return math::silu_f32(v);
    case kOpSoftplus: return math::softplus_f32(v);
    case kOpGelu: return math::gelu_f32(v);
    default: return math::gelu_tanh_f32(v);
  }
}

void elementwise(int op, const float* x, float* y, int64_t n) {
  FpEnvGuard guard;
  if (op == kOpExpVec) {
    V::exp_array(x, y, n);
    return;
  }
  for (int64_t i = 0; i < n; ++i) y[i] = math::canon_nan(apply(op, x[i]));
}

void gemm(const float* a, int64_t m, int64_t lda, const ops::PackedMatrix& w, float* c, int64_t ldc,
          int n_threads) {
  ops::gemm<V>(a, m, lda, w, c, ldc, n_threads);
}

void norm_rows(int kind, const float* x, int64_t rows, int64_t n, const float* w, const float* b,
               float eps, float* y) {
  FpEnvGuard guard;
  for (int64_t r = 0; r < rows; ++r) ops::norm_row<V>(kind, x + r * n, n, w, b, eps, y + r * n);
}

float dot_l16(const float* a, const float* b, int64_t n) {
  FpEnvGuard guard;
  return ops::dot_l16<V>(a, b, n);
}

float sum_l16(const float* a, int64_t n) {
  FpEnvGuard guard;
  return ops::sum_l16<V>(a, n);
}

void reduce16_x16(const float* acc, float* out) {
  FpEnvGuard guard;
  V::reduce16_x16(acc, out);
}

bool any_nonfinite(const float* p, int64_t n) { return ops::any_nonfinite<V>(p, n); }

// ---- the twins' test entry points (kernel_table.hpp): the templates on contiguous arrays ----

void attention_decode(const float* q, int n_heads, int64_t head_dim, const float* k, const float* v,
                      int64_t j0, int64_t p, float scale, float softcap, float* probs,
                      int64_t stride, float* o) {
  FpEnvGuard guard;
  const float* qs[4];
  float* os[4];
  for (int r = 0; r < n_heads; ++r) {
    qs[r] = q + r * head_dim;
    os[r] = o + r * head_dim;
  }
  const auto key_at = [&](int64_t j) { return k + j * head_dim; };
  const auto val_at = [&](int64_t j) { return v + j * head_dim; };
  switch (n_heads) {
    case 1:
      ops::attention_heads<V, 1>(qs, head_dim, j0, p, key_at, val_at, scale, softcap, probs, stride,
                                 os);
      break;
    case 2:
      ops::attention_heads<V, 2>(qs, head_dim, j0, p, key_at, val_at, scale, softcap, probs, stride,
                                 os);
      break;
    case 3:
      ops::attention_heads<V, 3>(qs, head_dim, j0, p, key_at, val_at, scale, softcap, probs, stride,
                                 os);
      break;
    default:
      ops::attention_heads<V, 4>(qs, head_dim, j0, p, key_at, val_at, scale, softcap, probs, stride,
                                 os);
      break;
  }
}

// Packs the keys and values of positions base .. p0 + n_q - 1 as ops/attention/plan.hpp does:
// kt[blk][d][lane] (zeros past the last position), vp[position][d].
void attention_prefill(const float* q, int n_q, int n_heads, int64_t head_dim, int64_t window,
                       int64_t p0, const float* k, const float* v, int64_t base, float scale,
                       float softcap, float* scratch, float* probs, int64_t stride, float* o) {
  FpEnvGuard guard;
  constexpr int64_t kL = V::kLanes;
  const int64_t n_pos = p0 + n_q - base, blocks = (n_pos + kL - 1) / kL;
  float* kt = scratch;
  float* vp = kt + blocks * kL * head_dim;
  for (int64_t i = 0; i < blocks * kL; ++i)
    for (int64_t d = 0; d < head_dim; ++d)
      kt[(i / kL) * head_dim * kL + d * kL + i % kL] =
          i < n_pos ? k[(base + i) * head_dim + d] : 0.0f;
  for (int64_t i = 0; i < n_pos * head_dim; ++i) vp[i] = v[base * head_dim + i];
  const float* qs[256];
  float* os[256];
  for (int i = 0; i < n_q * n_heads; ++i) {
    qs[i] = q + i * head_dim;
    os[i] = o + i * head_dim;
  }
  ops::attention_prefill_block<V>(qs, n_q, n_heads, head_dim, window, p0, kt, vp, base, scale,
                                  softcap, probs, stride, os);
}

void softmax(float* s, int64_t n, float scale, float softcap) {
  FpEnvGuard guard;
  ops::softmax_scores<V>(s, n, scale, softcap);
}

void conv1d(const float* w, const float* u, int64_t ld, int64_t nc, int64_t k_taps,
            const float* bias, float* out) {
  FpEnvGuard guard;
  ops::conv1d_token<V>(w, ld, nc, k_taps, bias, [&](int64_t t) { return u + t * ld; }, out);
}

void ssm_scan_step(float* h, int64_t head_dim, int64_t d_state, float dt, float a, float d,
                   const float* x, const float* b, const float* c, float* dtb, float* y) {
  FpEnvGuard guard;
  ops::ssm_scan_step<V>(h, head_dim, d_state, dt, a, d, x, b, c, dtb, y);
}

void ssm_scan_tokens(float* h, int64_t head_dim, int64_t d_state, int64_t n_tokens, const float* dt,
                     float a, float d, const float* x, const float* b, const float* c,
                     float* scratch, float* y) {
  FpEnvGuard guard;
  const float* xp[ops::kScanChunk];
  const float* bp[ops::kScanChunk];
  const float* cp[ops::kScanChunk];
  float* yp[ops::kScanChunk];
  for (int64_t t = 0; t < n_tokens; ++t) {
    xp[t] = x + t * head_dim;
    bp[t] = b + t * d_state;
    cp[t] = c + t * d_state;
    yp[t] = y + t * head_dim;
  }
  ops::ssm_scan_tokens<V>(h, head_dim, d_state, n_tokens, dt, a, d, xp, bp, cp, yp, scratch);
}

void rope(float* v, int64_t n_vec, int64_t head_dim, int64_t rope_dim, int64_t pos,
          const float* inv_freq, float* scratch) {
  FpEnvGuard guard;
  const int64_t half = rope_dim / 2;
  ops::rope_cos_sin(inv_freq, half, pos, scratch, scratch + half);
  for (int64_t i = 0; i < n_vec; ++i)
    ops::rope_apply(v + i * head_dim, half, scratch, scratch + half);
}

void mlp_combine(int kind, const float* gu, int64_t it, float* u) {
  FpEnvGuard guard;
  ops::mlp_combine<V>(kind, gu, it, u);
}

void mamba2_backward(const blocks::Mamba2Model& m, const blocks::Mamba2BackwardCall& c) {
  blocks::mamba2_backward<V>(m, c);
}

}  // namespace

extern const KernelTable kTable;
const KernelTable kTable = {EB_ISA_STR,
                            transformer_forward,
                            mamba2_forward,
                            elementwise,
                            gemm,
                            norm_rows,
                            dot_l16,
                            sum_l16,
                            reduce16_x16,
                            any_nonfinite,
                            attention_decode,
                            attention_prefill,
                            softmax,
                            conv1d,
                            ssm_scan_step,
                            ssm_scan_tokens,
                            rope,
                            mlp_combine,
                            mamba2_backward};

}  // namespace eb::EB_ISA_NAME
