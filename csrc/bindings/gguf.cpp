// GGUF weight blocks as the packer reads them (ops/gemm/pack_gguf.cpp): their layout, and their
// float32 values with gguf.quants' operations.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>

#include "base/check.hpp"
#include "bindings/call.hpp"
#include "bindings/common.hpp"
#include "ops/gemm/format.hpp"

namespace eb::bindings {

void bind_gguf(nb::module_& m) {
  // GGUF blocks -> float32 with gguf.quants' operations (the values the packer stores)
  m.def(
      "dequantize_gguf",
      [](int type, U8Arr blocks) {
        const int64_t bs = ops::ggml_block_size(type), ts = ops::ggml_type_size(type);
        EB_CHECK(bs > 0 && static_cast<int64_t>(blocks.size()) % ts == 0,
                 "dequantize_gguf: unsupported type, or a partial block");
        const int64_t n = static_cast<int64_t>(blocks.size()) / ts * bs;
        OutArr y = new_array({static_cast<size_t>(n)});
        nb::gil_scoped_release release;
        ops::dequantize_gguf(blocks.data(), type, n, y.data());
        return y;
      },
      nb::arg("type"), nb::arg("blocks"));
  // (weights per block, bytes per block) of a GGUF type the packer reads directly, or (0, 0)
  m.def("gguf_block_layout", [](int type) {
    return nb::make_tuple(ops::ggml_block_size(type), ops::ggml_type_size(type));
  });
}

}  // namespace eb::bindings
