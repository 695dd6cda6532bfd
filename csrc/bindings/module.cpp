// exactblocks._core: thin typed entry points (STYLE 5.8). No math and no defaults here; the
// Python layer has validated every argument. Computation runs with the GIL released. This file
// holds the module and the runtime entry points; every other bound object has its own file
// (common.hpp lists them: configs, gguf, transformer, mamba2, stack, state, ops, twins, head).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "base/cancel.hpp"
#include "base/check.hpp"
#include "base/runtime.hpp"
#include "base/version.hpp"
#include "bindings/common.hpp"
#include "bindings/interrupts.hpp"
#include "dispatch/kernel_table.hpp"

#ifndef EB_VERSION
#define EB_VERSION "0.0.0"
#endif

// The thread count under a plain C name: threadpoolctl recognises the extension by this exported
// symbol (exactblocks/runtime.py registers its controller). Reading only; Python sets it.
extern "C" __attribute__((visibility("default"))) int exactblocks_get_num_threads() {
  return eb::runtime::num_threads();
}

namespace eb::bindings {

void bind_runtime(nb::module_& m) {
  m.attr("__version__") = EB_VERSION;
  m.def("arithmetic_version", []() { return std::string(kArithmeticVersion); });
  m.def("numeric_mode", []() { return std::string("identical"); });
  m.def("vendor", []() { return std::string("cpu"); });
  m.def(
      "set_num_threads",
      [](int n) {
        EB_CHECK(n >= 1, "n_threads must be >= 1");
        runtime::set_num_threads(n);
      },
      nb::arg("n"));
  m.def("get_num_threads", []() { return runtime::num_threads(); });
  m.def("available_isas", &available_isas);
  m.def("set_isa", &set_isa, nb::arg("name"));
  m.def("get_isa", &get_isa);
  // Tests: watch every call and cut every region into single grains (0, 0), or put back the
  // defaults; returns the values in force before (base/cancel.hpp).
  m.def(
      "_set_cancel_tuning",
      [](int64_t watch_min_ns, int64_t piece_ns) {
        const int64_t old = cancel::watch_min_ns();
        cancel::set_tuning(watch_min_ns, piece_ns);
        return old;
      },
      nb::arg("watch_min_ns") = cancel::kWatchMinNs, nb::arg("piece_ns") = cancel::kPieceNs);
}

}  // namespace eb::bindings

NB_MODULE(_core, m) {
  // A block call runs with the GIL released, so the interpreter can exit while another thread
  // is still inside one; nanobind would then report the objects that call holds as "leaked".
  nanobind::set_leak_warnings(false);
  eb::bindings::init_interrupts();
  eb::bindings::bind_runtime(m);
  eb::bindings::bind_configs(m);
  eb::bindings::bind_gguf(m);
  eb::bindings::bind_transformer(m);
  eb::bindings::bind_mamba2(m);
  eb::bindings::bind_mamba2_backward(m);
  eb::bindings::bind_stack(m);
  eb::bindings::bind_state(m);
  eb::bindings::bind_ops(m);
  eb::bindings::bind_head(m);
}
