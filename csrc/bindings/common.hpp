// Shared pieces of the binding files: the typed ndarray aliases every entry point takes
// (float32, C-contiguous, CPU; STYLE 5.8) and fresh NumPy outputs. Nothing here computes.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <string>
#include <vector>

#include "ops/gemm/format.hpp"

namespace eb::bindings {

namespace nb = nanobind;

using CArr = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;
using CArr1 = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using CArr2 = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using CArr3 = nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu>;
using MArr = nb::ndarray<float, nb::c_contig, nb::device::cpu>;
using IArr = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using OutArr = nb::ndarray<nb::numpy, float>;

// A zero-filled float32 NumPy array of the given shape, owned by Python; zero = false leaves it
// unfilled, for an output whose every element the call writes (a model's logits: hundreds of
// MB, whose filling would run before the call's first cancel point, base/cancel.hpp).
inline OutArr new_array(std::initializer_list<size_t> shape, bool zero = true) {
  size_t n = 1;
  for (size_t s : shape) n *= s;
  float* data = zero ? new float[std::max<size_t>(n, 1)]() : new float[std::max<size_t>(n, 1)];
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  return OutArr(data, shape, owner);
}

// A packed matrix's rows [r0, r1) as a fresh float32 (r1 - r0, k_in) array, rebuilt with the
// kernels' own operations (ops/gemm/unpack.cpp unpack_rows); defined in bindings/call.cpp.
OutArr unpack_array(const ops::PackedMatrix& w, int64_t r0, int64_t r1);

// A matrix given as float32 (a C-contiguous 2-D array) or as GGUF blocks (a tuple (ggml type,
// uint8 array of the blocks)); `keep` holds the arrays while the pointers are used.
ops::MatrixSource matrix_source(const nb::handle& value, std::vector<nb::object>& keep);

// matrix_source of a whole (rows, k_in) matrix, its size checked (float32: the array's shape;
// GGUF blocks: k_in a multiple of the block size, the bytes of rows x k_in weights and, for a
// 2-D array of blocks, one row of blocks per matrix row), the
// error naming `what`; the source's rows set.
ops::MatrixSource matrix_source(const nb::handle& value, std::vector<nb::object>& keep,
                                int64_t rows, int64_t k_in, const std::string& what);

// The module's parts, one per bound object, registered in this order by module.cpp.
void bind_runtime(nb::module_& m);          // module.cpp: threads, ISA, versions
void bind_configs(nb::module_& m);          // configs.cpp: the blocks' typed configs and enums
void bind_gguf(nb::module_& m);             // gguf.cpp: GGUF block layout and dequantisation
void bind_transformer(nb::module_& m);      // transformer.cpp: TransformerCore
void bind_mamba2(nb::module_& m);           // mamba2.cpp: Mamba2Core
void bind_mamba2_backward(nb::module_& m);  // mamba2_backward.cpp: its backward
void bind_stack(nb::module_& m);            // stack.cpp: layer_stack, a model's layers in one call
void bind_state(nb::module_& m);            // state.cpp: StateLock, its claims, UndoLog, resets
void bind_ops(nb::module_& m);              // ops.cpp: single kernels, PackedLinear, sampling
void bind_twins(nb::module_& m);            // twins.cpp: kernels beside their plain twins
void bind_head(nb::module_& m);             // head.cpp: the output head

}  // namespace eb::bindings
