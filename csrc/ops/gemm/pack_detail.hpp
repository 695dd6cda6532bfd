// The packer's internal parts, shared by its files (ops/gemm/pack*.cpp, unpack.cpp): the exact
// format fitting of float32 rows (pack_fit.cpp) and the GGUF block decoding (pack_gguf.cpp).
// Not for the kernels: compiled once, with the baseline flags.
#pragma once
#include <cstdint>
#include <vector>

#include "ops/gemm/format.hpp"

namespace eb::ops::detail {

// Rows of the stacked matrix, in order: row n of part i.
struct Rows {
  std::vector<const float*> ptr;
  const float* row(int64_t n) const { return ptr[static_cast<size_t>(n)]; }
};

// Packs the rows into compact `format` (format.hpp PanelFormat other than kPanelF32): false,
// with pm's storage half written, when one block of weights has no exact fit in that format.
// pm's n_out, k_in and n_panels are set by the caller.
bool pack_compact(PackedMatrix& pm, const Rows& rows, int format);

// The compact format a GGUF type maps onto (kPanelF32 = none).
int direct_format(int type);

// Block b (kQBlock weights) of one row of GGUF blocks as the compact format's scales and
// codes, exactly gguf's values: d[0] and m (affine formats: w = fma(d[0], q, m), q 0..15 or
// 0..31), or d[0] for k 0..15 and d[1] for k 16..31 (w = d[h] * q, q int8; d[1] = d[0] for
// every type but Q6_K). Layouts and operations: llama.cpp ggml-quants.c dequantize_row_*,
// gguf-py gguf/quants.py (the same values).
void gguf_block(const uint8_t* row, int type, int64_t b, float* d, float* m, int* q);

}  // namespace eb::ops::detail
