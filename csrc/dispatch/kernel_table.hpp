// Run-time ISA dispatch (ATen pattern): each ISA's kernels are compiled in their own
// translation unit and namespace (csrc/dispatch/kernels_isa.cpp) and exposed as one KernelTable;
// the best table the CPU supports is chosen once at import, EXACTBLOCKS_ISA or set_isa()
// can force another. Every table gives the same bits (SPEC 3.1).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

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
};

// Elementwise op codes for KernelTable::elementwise (tests only).
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
