// The model's output head (blocks/head): final norm + vocabulary projection, bound as
// _core.HeadConfig and _core.OutputHead. A call runs the kernel table's row norm and then its
// packed GEMM on the normalised rows, then HeadModel::finish_logits (logit scaling, softcap),
// with the GIL released; no arithmetic of its own.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>
#include <vector>

#include "base/cancel.hpp"
#include "base/check.hpp"
#include "base/runtime.hpp"
#include "bindings/common.hpp"
#include "bindings/interrupts.hpp"
#include "blocks/head/model.hpp"
#include "dispatch/kernel_table.hpp"
#include "ops/gemm/format.hpp"

namespace eb::bindings {

void bind_head(nb::module_& m) {
  using blocks::HeadConfig;
  using blocks::HeadModel;
  nb::class_<HeadConfig>(m, "HeadConfig")
      .def(nb::init<>())
      .def_rw("d_model", &HeadConfig::d_model)
      .def_rw("vocab_size", &HeadConfig::vocab_size)
      .def_rw("norm", &HeadConfig::norm)
      .def_rw("norm_eps", &HeadConfig::norm_eps)
      .def_rw("norm_bias", &HeadConfig::norm_bias)
      .def_rw("logits_scaling", &HeadConfig::logits_scaling)
      .def_rw("logit_softcap", &HeadConfig::logit_softcap)
      .def_rw("compact_weights", &HeadConfig::compact_weights);

  nb::class_<HeadModel>(m, "OutputHead")
      // norm_weight (d_model,), norm_bias (d_model,) or None, head_weight (vocab_size, d_model):
      // float32, C-contiguous; copied and packed (shapes are checked here again, cheaply).
      .def(
          "__init__",
          [](HeadModel* self, const HeadConfig& cfg, CArr1 norm_weight, nb::object norm_bias,
             nb::object head_weight) {
            EB_CHECK(static_cast<int64_t>(norm_weight.shape(0)) == cfg.d_model,
                     "OutputHead: norm_weight length != d_model");
            std::vector<nb::object> keep;
            const ops::MatrixSource head = matrix_source(head_weight, keep, cfg.vocab_size,
                                                         cfg.d_model, "OutputHead: head_weight");
            CArr1 bias;
            const float* b = nullptr;
            if (!norm_bias.is_none()) {
              bias = nb::cast<CArr1>(norm_bias, false);
              EB_CHECK(static_cast<int64_t>(bias.shape(0)) == cfg.d_model,
                       "OutputHead: norm_bias length != d_model");
              b = bias.data();
            }
            nb::gil_scoped_release release;
            new (self) HeadModel(cfg, norm_weight.data(), b, head);
          },
          nb::arg("cfg"), nb::arg("norm_weight"), nb::arg("norm_bias").none(),
          nb::arg("head_weight"))
      .def_prop_ro("cfg", [](const HeadModel& h) { return h.cfg; })
      // (format, bytes) of the packed projection (ops/gemm/format.hpp PanelFormat)
      .def_prop_ro("weight_storage",
                   [](const HeadModel& h) {
                     return nb::make_tuple(std::string(h.w_head.format_name()), h.w_head.bytes());
                   })
      // rows [r0, r1) of the packed projection as float32, bit for bit the weights it holds
      .def(
          "unpack",
          [](const HeadModel& h, int64_t r0, int64_t r1) { return unpack_array(h.w_head, r0, r1); },
          nb::arg("r0"), nb::arg("r1"))
      // ids (n,) int64 -> (n, d_model) float32: rows of the packed projection (a tied
      // embedding's lookup), each rebuilt exactly; ids are checked in [0, vocab_size)
      .def(
          "rows",
          [](const HeadModel& h,
             nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> ids) {
            const int64_t n = static_cast<int64_t>(ids.shape(0)), d = h.cfg.d_model;
            for (int64_t i = 0; i < n; ++i)
              EB_CHECK(ids.data()[i] >= 0 && ids.data()[i] < h.cfg.vocab_size,
                       "OutputHead.rows: id out of range");
            OutArr y = new_array({static_cast<size_t>(n), static_cast<size_t>(d)});
            {
              nb::gil_scoped_release release;
              for (int64_t i = 0; i < n; ++i)
                ops::unpack_rows(h.w_head, ids.data()[i], ids.data()[i] + 1, y.data() + i * d);
            }
            return y;
          },
          nb::arg("ids"))
      // x (n_rows, d_model) -> logits (n_rows, vocab_size): row m is N(x[m]) W^T, the final
      // norm in L16 order then one SEQ FMA chain per logit (then the scaling and softcap of
      // finish_logits); rows never interact.
      .def(
          "forward",
          [](const HeadModel& h, CArr2 x) {
            const int64_t rows = static_cast<int64_t>(x.shape(0)), d = h.cfg.d_model;
            EB_CHECK(static_cast<int64_t>(x.shape(1)) == d, "OutputHead: x columns != d_model");
            OutArr y = new_array({static_cast<size_t>(rows), static_cast<size_t>(h.cfg.vocab_size)},
                                 /*zero=*/false);  // the GEMM writes every logit
            if (rows == 0) return y;
            std::vector<float> hn(static_cast<size_t>(rows * d));
            // a long prefill's logits take a while: stopped by a signal handler that raises
            // (interrupts.hpp); the output is fresh, so nothing needs undoing
            SignalPoll poll(2.0 * static_cast<double>(rows) *
                            static_cast<double>(h.w_head.n_out * h.w_head.k_in));
            bool stopped = false;
            {
              nb::gil_scoped_release release;
              const bool timed = poll.flops() >= cancel::kRecordMinFlops;
              const int64_t t0 = timed ? cancel::now_ns() : 0;
              try {
                std::optional<cancel::Watch> watch;
                if (poll.watched()) watch.emplace(poll.poller(), cancel::estimate_ns(poll.flops()));
                const KernelTable& k = kernels();
                k.norm_rows(h.cfg.norm, x.data(), rows, d, h.norm_w.data(),
                            h.norm_b.empty() ? nullptr : h.norm_b.data(), h.norm_eps, hn.data());
                k.gemm(hn.data(), rows, d, h.w_head, y.data(), h.cfg.vocab_size,
                       runtime::num_threads());
                cancel::disarm();
                if (h.has_finish()) h.finish_logits(y.data(), rows * h.cfg.vocab_size);
              } catch (const cancel::Stopped&) {
                stopped = true;
              }
              if (!stopped && timed) cancel::record(poll.flops(), cancel::now_ns() - t0);
            }
            if (stopped) poll.raise();
            return y;
          },
          nb::arg("x"));
}

}  // namespace eb::bindings
