// exactblocks._core: thin typed entry points (STYLE 5.8). No math and no defaults here; the
// Python layer has validated every argument. Computation runs with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>

#include "core/check.hpp"
#include "core/mamba2_block.hpp"
#include "core/transformer_block.hpp"
#include "core/workspace.hpp"
#include "math/f64.hpp"
#include "ops/finite.hpp"
#include "ops/gemm.hpp"
#include "ops/rope.hpp"
#include "simd/dispatch.hpp"
#include "threading/fpenv.hpp"

namespace nb = nanobind;
using namespace eb;

#ifndef EB_VERSION
#define EB_VERSION "0.0.0"
#endif

// Bump on any change that can move an output bit (SPEC 1, 3.4): orders, routines, op order.
static const char* kArithmeticVersion = "fp32-identical-1";

using CArr = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;
using MArr = nb::ndarray<float, nb::c_contig, nb::device::cpu>;
using IArr = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using OutArr = nb::ndarray<nb::numpy, float>;

static int g_threads = 1;

// Calls without a session's workspace reuse one per OS thread, so repeated prefills do not
// pay page faults for fresh scratch; more than kRetainBytes is given back after the call.
// (A block serves concurrent calls: each thread has its own workspace.)
static constexpr size_t kRetainBytes = size_t{256}
                                       << 20;  // a Llama-1B prefill of 512 tokens needs ~75 MB

static Workspace* call_workspace(Workspace* ws) {
  if (ws) return ws;
  thread_local Workspace tl_ws;
  return &tl_ws;
}

static void trim_workspace(Workspace* given, Workspace* used) {
  if (given == nullptr && used->bytes() > kRetainBytes) used->release();
}

static OutArr new_array(std::initializer_list<size_t> shape) {
  size_t n = 1;
  for (size_t s : shape) n *= s;
  float* data = new float[std::max<size_t>(n, 1)]();
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  return OutArr(data, shape, owner);
}

static std::unordered_map<std::string, const float*> weight_ptrs(const nb::dict& weights,
                                                                 std::vector<CArr>& keep) {
  std::unordered_map<std::string, const float*> out;
  for (auto [k, v] : weights) {
    keep.push_back(nb::cast<CArr>(v, false));
    out[nb::cast<std::string>(k)] = keep.back().data();
  }
  return out;
}

template <class T>
static T get(const nb::dict& d, const char* key) {
  EB_CHECK(d.contains(key), std::string("config key missing: ") + key);
  return nb::cast<T>(d[key]);
}

static TransformerConfig transformer_config(const nb::dict& d) {
  TransformerConfig c;
  c.d_model = get<int64_t>(d, "d_model");
  c.n_heads = get<int64_t>(d, "n_heads");
  c.n_kv_heads = get<int64_t>(d, "n_kv_heads");
  c.head_dim = get<int64_t>(d, "head_dim");
  c.intermediate = get<int64_t>(d, "intermediate");
  c.window = get<int64_t>(d, "window");
  c.rope_dim = get<int64_t>(d, "rope_dim");
  c.max_positions = get<int64_t>(d, "max_positions");
  c.rope_theta = get<double>(d, "rope_theta");
  c.norm_eps = static_cast<float>(get<double>(d, "norm_eps"));
  c.attn_softcap = static_cast<float>(get<double>(d, "attn_softcap"));
  c.rope_scaling_kind = get<int>(d, "rope_scaling_kind");
  c.rope_factor = get<double>(d, "rope_factor");
  c.rope_low_freq_factor = get<double>(d, "rope_low_freq_factor");
  c.rope_high_freq_factor = get<double>(d, "rope_high_freq_factor");
  c.rope_original_max = get<double>(d, "rope_original_max");
  c.norm = get<int>(d, "norm");
  c.mlp = get<int>(d, "mlp");
  c.qkv_bias = get<bool>(d, "qkv_bias");
  c.o_bias = get<bool>(d, "o_bias");
  c.norm_bias = get<bool>(d, "norm_bias");
  c.mlp_bias = get<bool>(d, "mlp_bias");
  c.qk_norm = get<bool>(d, "qk_norm");
  return c;
}

static Mamba2Config mamba2_config(const nb::dict& d) {
  Mamba2Config c;
  c.d_model = get<int64_t>(d, "d_model");
  c.d_inner = get<int64_t>(d, "d_inner");
  c.n_heads = get<int64_t>(d, "n_heads");
  c.head_dim = get<int64_t>(d, "head_dim");
  c.d_state = get<int64_t>(d, "d_state");
  c.n_groups = get<int64_t>(d, "n_groups");
  c.conv_dim = get<int64_t>(d, "conv_dim");
  c.conv_kernel = get<int64_t>(d, "conv_kernel");
  c.norm_eps = static_cast<float>(get<double>(d, "norm_eps"));
  c.dt_min = static_cast<float>(get<double>(d, "dt_min"));
  c.dt_max = static_cast<float>(get<double>(d, "dt_max"));
  c.conv_bias = get<bool>(d, "conv_bias");
  c.proj_bias = get<bool>(d, "proj_bias");
  return c;
}

static void check_rows(const IArr& a, int64_t batch, const char* name) {
  EB_CHECK(static_cast<int64_t>(a.shape(0)) == batch,
           std::string(name) + " must have batch entries");
}

static nb::list storage_list(
    std::initializer_list<std::pair<const char*, const ops::PackedMatrix*>> items) {
  nb::list out;
  for (const auto& [name, pm] : items)
    out.append(nb::make_tuple(std::string(name), std::string(pm->format_name()), pm->bytes()));
  return out;
}

NB_MODULE(_core, m) {
  m.attr("__version__") = EB_VERSION;
  m.def("arithmetic_version", []() { return std::string(kArithmeticVersion); });
  m.def("numeric_mode", []() { return std::string("identical"); });
  m.def("vendor", []() { return std::string("cpu"); });
  m.def("set_num_threads", [](int n) {
    EB_CHECK(n >= 1, "n_threads must be >= 1");
    g_threads = n;
  });
  m.def("get_num_threads", []() { return g_threads; });
  m.def("available_isas", &available_isas);
  m.def("set_isa", &set_isa);
  m.def("get_isa", &get_isa);

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
            hit = ops::first_nonfinite(regions, g_threads);
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
            hit = ops::first_nonfinite(regions, g_threads);
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
            hit = ops::first_nonfinite(one, g_threads);
          }
          return hit.offset;
        });
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
    ops::rope_inv_freq(rope_dim, theta, kind, factor, low, high, original_max, y.data());
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
          kernels().gemm(a.data(), mm, k, pm, c.data(), n, g_threads);
        }
        return nb::make_tuple(c, std::string(pm.format_name()));
      },
      nb::arg("a"), nb::arg("w"), nb::arg("bias").none() = nb::none(), nb::arg("compact") = true);
  // Tests only: whether blocks built from now on may store weights in a compact exact format.
  m.def("_set_compact_packing", &ops::set_compact_packing);
  m.def("_compact_packing", &ops::compact_packing);
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

  // A linear layer packed once (the demo's tied output head): y = x W^T (+ b) with the same
  // GEMM/GEMV arithmetic as the blocks' projections.
  // Scratch kept between calls: a decode session owns one so its steps do not allocate.
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
          kernels().gemm(x.data(), mm, p.k_in, p, y.data(), p.n_out, g_threads);
        }
        return y;
      });

  nb::class_<TransformerModel>(m, "TransformerCore")
      // [(matrix, format, bytes)] of the packed projections (ops/gemm.hpp PanelFormat)
      .def_prop_ro("weight_storage",
                   [](const TransformerModel& t) {
                     return storage_list({{"qkv_proj", &t.w_qkv},
                                          {"o_proj", &t.w_o},
                                          {t.cfg.mlp <= 2 ? "gate_up_proj" : "up_proj", &t.w_gu},
                                          {"down_proj", &t.w_down}});
                   })
      .def("__init__",
           [](TransformerModel* self, nb::dict cfg, nb::dict weights) {
             std::vector<CArr> keep;
             auto ptrs = weight_ptrs(weights, keep);
             FpEnvGuard
                 guard;  // double -> float option casts round to nearest, whatever the caller set
             TransformerConfig c = transformer_config(cfg);
             nb::gil_scoped_release release;
             new (self) TransformerModel(c, ptrs);
           })
      // check_cache: check the slots each row reads (SPEC 5) while reading them; returns None,
      // with the cache untouched, when one is not finite (Python then names the element).
      .def(
          "forward",
          [](const TransformerModel& mdl,
             nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu> x, IArr lengths,
             IArr start, MArr k_cache, MArr v_cache, Workspace* ws,
             bool check_cache) -> nb::object {
            const int64_t B = static_cast<int64_t>(x.shape(0)),
                          L = static_cast<int64_t>(x.shape(1));
            const TransformerConfig& c = mdl.cfg;
            EB_CHECK(static_cast<int64_t>(x.shape(2)) == c.d_model, "x last dim != d_model");
            check_rows(lengths, B, "lengths");
            check_rows(start, B, "start");
            EB_CHECK(k_cache.ndim() == 4 && v_cache.ndim() == 4, "cache rank");
            const int64_t cap = static_cast<int64_t>(k_cache.shape(2));
            EB_CHECK(static_cast<int64_t>(k_cache.shape(0)) == B &&
                         static_cast<int64_t>(k_cache.shape(1)) == c.n_kv_heads &&
                         static_cast<int64_t>(k_cache.shape(3)) == c.head_dim && cap >= 0,
                     "k_cache shape");
            for (size_t i = 0; i < 4; ++i)
              EB_CHECK(k_cache.shape(i) == v_cache.shape(i), "v_cache shape");
            // capacity 0: a state-less call (nothing cached before, nothing kept after)
            for (int64_t b = 0; b < B && cap == 0; ++b)
              EB_CHECK(start.data()[b] == 0, "a call without a cache must start at position 0");
            for (int64_t b = 0; b < B; ++b)
              EB_CHECK(lengths.data()[b] >= 0 && lengths.data()[b] <= L && start.data()[b] >= 0 &&
                           start.data()[b] + lengths.data()[b] <= c.max_positions,
                       "lengths/start out of range");
            OutArr y = new_array(
                {static_cast<size_t>(B), static_cast<size_t>(L), static_cast<size_t>(c.d_model)});
            int cache_bad = 0;
            TransformerCall call{x.data(),
                                 y.data(),
                                 B,
                                 L,
                                 lengths.data(),
                                 start.data(),
                                 k_cache.data(),
                                 v_cache.data(),
                                 cap,
                                 g_threads,
                                 call_workspace(ws),
                                 check_cache ? &cache_bad : nullptr};
            {
              nb::gil_scoped_release release;
              kernels().transformer_forward(mdl, call);
              trim_workspace(ws, call.ws);
            }
            if (cache_bad) return nb::none();  // a read slot is not finite; the cache is untouched
            return nb::cast(y);
          },
          nb::arg("x"), nb::arg("lengths"), nb::arg("start"), nb::arg("k_cache"),
          nb::arg("v_cache"), nb::arg("workspace").none() = nb::none(),
          nb::arg("check_cache") = false);

  nb::class_<Mamba2Model>(m, "Mamba2Core")
      .def_prop_ro("weight_storage",
                   [](const Mamba2Model& t) {
                     return storage_list({{"in_proj", &t.w_in}, {"out_proj", &t.w_out}});
                   })
      .def("__init__",
           [](Mamba2Model* self, nb::dict cfg, nb::dict weights) {
             std::vector<CArr> keep;
             auto ptrs = weight_ptrs(weights, keep);
             FpEnvGuard
                 guard;  // double -> float option casts round to nearest, whatever the caller set
             Mamba2Config c = mamba2_config(cfg);
             nb::gil_scoped_release release;
             new (self) Mamba2Model(c, ptrs);
           })
      .def(
          "forward",
          [](const Mamba2Model& mdl,
             nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu> x, IArr lengths,
             MArr conv_window, MArr h, Workspace* ws) {
            const int64_t B = static_cast<int64_t>(x.shape(0)),
                          L = static_cast<int64_t>(x.shape(1));
            const Mamba2Config& c = mdl.cfg;
            EB_CHECK(static_cast<int64_t>(x.shape(2)) == c.d_model, "x last dim != d_model");
            check_rows(lengths, B, "lengths");
            EB_CHECK(conv_window.ndim() == 3 && static_cast<int64_t>(conv_window.shape(0)) == B &&
                         static_cast<int64_t>(conv_window.shape(1)) == c.conv_dim &&
                         static_cast<int64_t>(conv_window.shape(2)) == c.conv_kernel,
                     "conv_window shape");
            EB_CHECK(h.ndim() == 4 && static_cast<int64_t>(h.shape(0)) == B &&
                         static_cast<int64_t>(h.shape(1)) == c.n_heads &&
                         static_cast<int64_t>(h.shape(2)) == c.head_dim &&
                         static_cast<int64_t>(h.shape(3)) == c.d_state,
                     "h shape");
            for (int64_t b = 0; b < B; ++b)
              EB_CHECK(lengths.data()[b] >= 0 && lengths.data()[b] <= L, "lengths out of range");
            OutArr y = new_array(
                {static_cast<size_t>(B), static_cast<size_t>(L), static_cast<size_t>(c.d_model)});
            Mamba2Call call{x.data(), y.data(),       B,
                            L,        lengths.data(), conv_window.data(),
                            h.data(), g_threads,      call_workspace(ws)};
            {
              nb::gil_scoped_release release;
              kernels().mamba2_forward(mdl, call);
              trim_workspace(ws, call.ws);
            }
            return y;
          },
          nb::arg("x"), nb::arg("lengths"), nb::arg("conv_window"), nb::arg("h"),
          nb::arg("workspace").none() = nb::none());
}
