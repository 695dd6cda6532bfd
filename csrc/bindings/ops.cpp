// The kernels the tests call one by one (tests/unit): the same kernel table the blocks use (the
// ones with a plain twin are bound in twins.cpp), the finiteness scanner, the construction-time
// binary64 routines and the packed linear layer (the demo's output head). No math here: every
// entry point forwards to an op.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "base/check.hpp"
#include "base/fpenv.hpp"
#include "base/runtime.hpp"
#include "base/workspace.hpp"
#include "bindings/common.hpp"
#include "dispatch/kernel_table.hpp"
#include "math/f64.hpp"
#include "ops/activations.hpp"
#include "ops/finite/scan.hpp"
#include "ops/gemm/format.hpp"
#include "ops/gemm/ref.hpp"
#include "ops/ref/ref.hpp"
#include "ops/rope.hpp"
#include "ops/sample.hpp"
#include "ops/ssm_scan.hpp"

namespace eb::bindings {

namespace {

template <class A>
int64_t dim(const A& a, size_t i) {
  return static_cast<int64_t>(a.shape(i));
}
}  // namespace

void bind_ops(nb::module_& m) {
  m.def("elementwise", [](const std::string& name,
                          nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> x) {
    static const char* names[] = {"exp",  "log1p",    "tanh", "erf",       "sin",    "cos",
                                  "silu", "softplus", "gelu", "gelu_tanh", "exp_vec"};
    int op = -1;
    for (int i = 0; i < 11; ++i)
      if (name == names[i]) op = i;
    EB_CHECK(op >= 0, "unknown elementwise op " + name);
    OutArr y = new_array({x.shape(0)});
    {
      nb::gil_scoped_release release;
      kernels().elementwise(op, x.data(), y.data(), static_cast<int64_t>(x.shape(0)));
    }
    return y;
  });
  // Tests only: turn FTZ/DAZ on or off on the calling thread, as another library built with
  // fast-math might; exactblocks' kernels must give the same bits either way (SPEC 3.2).
  m.def("_set_caller_ftz_daz", [](bool on) {
#if defined(__x86_64__) || defined(_M_X64)
    unsigned csr = _mm_getcsr();
    csr = on ? (csr | (1u << 15) | (1u << 6)) : (csr & ~((1u << 15) | (1u << 6)));
    _mm_setcsr(csr);
    return true;
#else
    (void)on;
    return false;
#endif
  });
  // First non-finite element of cache[b, :, a:e, :] over the row spans (b, a, e) of `spans`
  // (n, 3) (cache (B, KV, cap, hd), C order), as (span index, g, slot, d), or None: the
  // reading-rule check of a Transformer call (SPEC 5) in one pass over every advancing row,
  // without numpy temporaries; reads only, so it runs before any state write. A row's spans
  // (two when its window wraps the ring) must be adjacent and in position order; "first" is
  // in (row, KV head, position) order.
  m.def("first_nonfinite_spans",
        [](nb::ndarray<const float, nb::ndim<4>, nb::c_contig, nb::device::cpu> cache,
           nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> spans)
            -> nb::object {
          const int64_t B = static_cast<int64_t>(cache.shape(0)),
                        kv = static_cast<int64_t>(cache.shape(1));
          const int64_t cap = static_cast<int64_t>(cache.shape(2)),
                        hd = static_cast<int64_t>(cache.shape(3));
          EB_CHECK(spans.shape(1) == 3, "first_nonfinite_spans: spans must be (n, 3)");
          const int64_t n_spans = static_cast<int64_t>(spans.shape(0));
          const int64_t* sp = spans.data();
          thread_local std::vector<ops::FloatRegion> regions;  // reused: no allocation once warm
          thread_local std::vector<std::pair<int64_t, int64_t>> owner;  // region -> (span, g)
          regions.clear();
          owner.clear();
          for (int64_t s0 = 0; s0 < n_spans;) {
            int64_t s1 = s0 + 1;  // spans s0 .. s1-1 belong to row sp[3 * s0]
            while (s1 < n_spans && sp[3 * s1] == sp[3 * s0]) ++s1;
            for (int64_t g = 0; g < kv; ++g)
              for (int64_t s = s0; s < s1; ++s) {
                const int64_t b = sp[3 * s], a = sp[3 * s + 1], e = sp[3 * s + 2];
                EB_CHECK(b >= 0 && b < B && 0 <= a && a <= e && e <= cap,
                         "first_nonfinite_spans: range");
                regions.push_back({cache.data() + ((b * kv + g) * cap + a) * hd, (e - a) * hd});
                owner.push_back({s, g});
              }
            s0 = s1;
          }
          ops::NonfiniteHit hit;
          {
            nb::gil_scoped_release release;
            hit = ops::first_nonfinite(regions, runtime::num_threads(), kernels().any_nonfinite);
          }
          if (hit.region < 0) return nb::none();
          const int64_t s = owner[hit.region].first, g = owner[hit.region].second;
          return nb::make_tuple(s, g, sp[3 * s + 1] + hit.offset / hd, hit.offset % hd);
        });
  // First non-finite element among the rows arr[b] (b in `rows`, in that order) of a
  // C-contiguous float32 array, as (index into rows, flat offset inside arr[b]), or None:
  // one pass over every advancing row of a Mamba-2 state, split over the threads.
  m.def("first_nonfinite_rows",
        [](nb::ndarray<const float, nb::c_contig, nb::device::cpu> arr,
           nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> rows)
            -> nb::object {
          EB_CHECK(arr.ndim() >= 1, "first_nonfinite_rows: arr must have a row axis");
          const int64_t n_rows = static_cast<int64_t>(arr.shape(0));
          const int64_t per_row = n_rows ? static_cast<int64_t>(arr.size()) / n_rows : 0;
          thread_local std::vector<ops::FloatRegion> regions;  // reused: no allocation once warm
          regions.clear();
          for (size_t i = 0; i < rows.shape(0); ++i) {
            const int64_t b = rows.data()[i];
            EB_CHECK(b >= 0 && b < n_rows, "first_nonfinite_rows: row out of range");
            regions.push_back({arr.data() + b * per_row, per_row});
          }
          ops::NonfiniteHit hit;
          {
            nb::gil_scoped_release release;
            hit = ops::first_nonfinite(regions, runtime::num_threads(), kernels().any_nonfinite);
          }
          if (hit.region < 0) return nb::none();
          return nb::make_tuple(hit.region, hit.offset);
        });
  // Flat index of the first non-finite element of a C-contiguous float32 array, or -1 (the
  // Python layer's finiteness checks of x, weights and states; read only, GIL released).
  m.def("first_nonfinite",
        [](nb::ndarray<const float, nb::c_contig, nb::device::cpu> a) -> int64_t {
          ops::NonfiniteHit hit;
          {
            nb::gil_scoped_release release;
            thread_local std::vector<ops::FloatRegion> one(1);  // reused: no allocation once warm
            one[0] = {a.data(), static_cast<int64_t>(a.size())};
            hit = ops::first_nonfinite(one, runtime::num_threads(), kernels().any_nonfinite);
          }
          return hit.offset;
        });
  // The token exactblocks.sampling.pick_token draws (ops/sample.hpp) from logits (vocab) for
  // temperature > 0, top_k (0 = all), top_p (1 = all) and the caller's draw r in [0, 1); the
  // Python layer checks every argument first. Scratch per calling thread; GIL released, so the
  // serving engine's rows sample in parallel.
  m.def(
      "sample_token",
      [](CArr1 logits, double temperature, int64_t top_k, double top_p, double r) -> int64_t {
        const int64_t vocab = dim(logits, 0);
        EB_CHECK(vocab >= 1 && vocab <= 0x7FFFFFFF, "sample_token: vocab size out of range");
        EB_CHECK(
            temperature > 0.0 && top_k >= 0 && top_p > 0.0 && top_p <= 1.0 && r >= 0.0 && r < 1.0,
            "sample_token: arguments out of range");
        thread_local ops::SampleScratch scratch;  // reused: no allocation once warm
        int64_t token;
        {
          nb::gil_scoped_release release;
          FpEnvGuard guard;
          token = ops::sample_token(logits.data(), vocab, temperature, top_k, top_p, r, scratch,
                                    [](const float* x, float* y, int64_t n) {
                                      kernels().elementwise(kOpExpVec, x, y, n);
                                    });
        }
        EB_CHECK(token >= 0, "sample_token: logits / temperature overflows float32");
        return token;
      },
      nb::arg("logits"), nb::arg("temperature"), nb::arg("top_k"), nb::arg("top_p"), nb::arg("r"));
  m.def("exp_f64", [](double x) {
    FpEnvGuard guard;
    return math::exp_f64(x);
  });
  m.def("log_f64", [](double x) {
    FpEnvGuard guard;
    return math::log_f64(x);
  });
  m.def("rope_inv_freq", [](int64_t rope_dim, double theta, int kind, double factor, double low,
                            double high, double original_max) {
    OutArr y = new_array({static_cast<size_t>(rope_dim / 2)});
    FpEnvGuard guard;  // the table must not depend on the caller's rounding mode
    ops::rope_inv_freq(rope_dim, theta, static_cast<ops::RopeScaling>(kind), factor, low, high,
                       original_max, y.data());
    return y;
  });
  // Ops exposed for the unit tests (tests/unit): the same kernels the blocks use.
  m.def(
      "gemm",
      [](nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> a,
         nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> w, nb::object bias,
         bool compact) {
        const int64_t mm = static_cast<int64_t>(a.shape(0)), k = static_cast<int64_t>(a.shape(1));
        const int64_t n = static_cast<int64_t>(w.shape(0));
        EB_CHECK(static_cast<int64_t>(w.shape(1)) == k, "gemm: inner sizes differ");
        const float* b = nullptr;
        CArr barr;
        if (!bias.is_none()) {
          barr = nb::cast<CArr>(bias, false);
          EB_CHECK(static_cast<int64_t>(barr.size()) == n, "gemm: bias size");
          b = barr.data();
        }
        ops::PackedMatrix pm = ops::pack_matrices({w.data()}, {n}, k, {b}, compact);
        OutArr c = new_array({static_cast<size_t>(mm), static_cast<size_t>(n)});
        {
          nb::gil_scoped_release release;
          kernels().gemm(a.data(), mm, k, pm, c.data(), n, runtime::num_threads());
        }
        return nb::make_tuple(c, std::string(pm.format_name()));
      },
      nb::arg("a"), nb::arg("w"), nb::arg("bias").none() = nb::none(), nb::arg("compact") = true);
  m.def(
      "gemm_ref",
      [](nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> a,
         nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> w, nb::object bias) {
        const int64_t mm = static_cast<int64_t>(a.shape(0)), k = static_cast<int64_t>(a.shape(1));
        const int64_t n = static_cast<int64_t>(w.shape(0));
        EB_CHECK(static_cast<int64_t>(w.shape(1)) == k, "gemm_ref: inner sizes differ");
        CArr barr;
        const float* b = nullptr;
        if (!bias.is_none()) {
          barr = nb::cast<CArr>(bias, false);
          b = barr.data();
        }
        OutArr c = new_array({static_cast<size_t>(mm), static_cast<size_t>(n)});
        FpEnvGuard guard;
        ops::gemm_ref(a.data(), mm, k, w.data(), n, k, b, c.data(), n);
        return c;
      },
      nb::arg("a"), nb::arg("w"), nb::arg("bias").none() = nb::none());
  m.def(
      "norm",
      [](int kind, nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> x, CArr w,
         nb::object bias, double eps) {
        const int64_t rows = static_cast<int64_t>(x.shape(0)), n = static_cast<int64_t>(x.shape(1));
        FpEnvGuard guard;
        std::vector<float> wv(w.data(), w.data() + n);
        if (kind == 2)
          for (float& v : wv) v = 1.0f + v;
        CArr barr;
        const float* b = nullptr;
        if (!bias.is_none()) {
          barr = nb::cast<CArr>(bias, false);
          b = barr.data();
        }
        OutArr y = new_array({static_cast<size_t>(rows), static_cast<size_t>(n)});
        kernels().norm_rows(kind, x.data(), rows, n, wv.data(), b, static_cast<float>(eps),
                            y.data());
        return y;
      },
      nb::arg("kind"), nb::arg("x"), nb::arg("w"), nb::arg("bias").none(), nb::arg("eps"));
  m.def("dot_l16", [](CArr a, CArr b) {
    return kernels().dot_l16(a.data(), b.data(), static_cast<int64_t>(a.size()));
  });
  m.def("sum_l16",
        [](CArr a) { return kernels().sum_l16(a.data(), static_cast<int64_t>(a.size())); });
  m.def("reduce16_x16", [](CArr acc) {
    if (acc.size() != 256) throw nb::value_error("reduce16_x16: acc must hold 16 x 16 floats");
    OutArr out = new_array({16});
    kernels().reduce16_x16(acc.data(), out.data());
    return out;
  });

  bind_twins(m);  // twins.cpp

  // A linear layer packed once (the demo's tied output head): y = x W^T (+ b) with the same
  nb::class_<Workspace>(m, "Workspace").def(nb::init<>());

  nb::class_<ops::PackedMatrix>(m, "PackedLinear")
      .def(
          "__init__",
          [](ops::PackedMatrix* self,
             nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> w,
             nb::object bias) {
            const int64_t n = static_cast<int64_t>(w.shape(0)),
                          k = static_cast<int64_t>(w.shape(1));
            CArr barr;
            const float* b = nullptr;
            if (!bias.is_none()) {
              barr = nb::cast<CArr>(bias, false);
              EB_CHECK(static_cast<int64_t>(barr.size()) == n, "PackedLinear: bias size");
              b = barr.data();
            }
            nb::gil_scoped_release release;
            new (self) ops::PackedMatrix(ops::pack_matrices({w.data()}, {n}, k, {b}));
          },
          nb::arg("w"), nb::arg("bias").none() = nb::none())
      // (n_out, k_in) weights given as GGUF blocks, (ggml type, uint8 array), or float32:
      // packed in an exact compact format when one holds every value (as a model's matrices),
      // so a vocabulary matrix only looked up by rows (an untied embedding) keeps its blocks'
      // size instead of a float32 copy.
      .def_static(
          "from_source",
          [](nb::object source, int64_t n_out, int64_t k_in) {
            EB_CHECK(n_out > 0 && k_in > 0, "PackedLinear.from_source: sizes must be positive");
            std::vector<nb::object> keep;
            const ops::MatrixSource src =
                matrix_source(source, keep, n_out, k_in, "PackedLinear.from_source");
            nb::gil_scoped_release release;
            FpEnvGuard guard;  // the dequantisation's float operations (SPEC 3.2)
            return ops::pack_sources({src}, k_in, {nullptr}, true);
          },
          nb::arg("source"), nb::arg("n_out"), nb::arg("k_in"))
      // ids (n,) int64 -> (n, k_in) float32: the packed rows, each rebuilt exactly (the
      // values it was packed from, bit for bit); ids are checked in [0, n_out)
      .def(
          "rows",
          [](const ops::PackedMatrix& p,
             nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> ids) {
            const int64_t n = static_cast<int64_t>(ids.shape(0));
            for (int64_t i = 0; i < n; ++i)
              EB_CHECK(ids.data()[i] >= 0 && ids.data()[i] < p.n_out,
                       "PackedLinear.rows: id out of range");
            OutArr y = new_array({static_cast<size_t>(n), static_cast<size_t>(p.k_in)});
            {
              nb::gil_scoped_release release;
              for (int64_t i = 0; i < n; ++i)
                ops::unpack_rows(p, ids.data()[i], ids.data()[i] + 1, y.data() + i * p.k_in);
            }
            return y;
          },
          nb::arg("ids"))
      // rows [r0, r1) as float32, bit for bit the weights it holds
      .def(
          "unpack",
          [](const ops::PackedMatrix& p, int64_t r0, int64_t r1) {
            return unpack_array(p, r0, r1);
          },
          nb::arg("r0"), nb::arg("r1"))
      .def_prop_ro("n_out", [](const ops::PackedMatrix& p) { return p.n_out; })
      .def_prop_ro("k_in", [](const ops::PackedMatrix& p) { return p.k_in; })
      .def_prop_ro("format",
                   [](const ops::PackedMatrix& p) { return std::string(p.format_name()); })
      .def_prop_ro("nbytes", [](const ops::PackedMatrix& p) { return p.bytes(); })
      .def("forward", [](const ops::PackedMatrix& p,
                         nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> x) {
        const int64_t mm = static_cast<int64_t>(x.shape(0));
        EB_CHECK(static_cast<int64_t>(x.shape(1)) == p.k_in, "PackedLinear: x columns != k_in");
        OutArr y = new_array({static_cast<size_t>(mm), static_cast<size_t>(p.n_out)});
        {
          nb::gil_scoped_release release;
          kernels().gemm(x.data(), mm, p.k_in, p, y.data(), p.n_out, runtime::num_threads());
        }
        return y;
      });
}

}  // namespace eb::bindings
