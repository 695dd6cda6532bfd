// One kernel table per ISA: this file is compiled once per ISA with that ISA's flags and
// EB_ISA_<name> defined (CMakeLists.txt); everything it instantiates lives in namespace
// eb::isa_<name>, so the per-ISA copies of the templates never collide (ATen rule).
#include "blocks/mamba2/forward.hpp"
#include "blocks/transformer/forward.hpp"
#include "dispatch/kernel_table.hpp"
#include "math/derived.hpp"
#include "ops/finite/bits.hpp"
#include "ops/gemm/driver.hpp"
#include "ops/norm.hpp"
#include "ops/reduce.hpp"

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

}  // namespace

extern const KernelTable kTable;
const KernelTable kTable = {EB_ISA_STR,   transformer_forward, mamba2_forward, elementwise,
                            gemm,         norm_rows,           dot_l16,        sum_l16,
                            reduce16_x16, any_nonfinite};

}  // namespace eb::EB_ISA_NAME
