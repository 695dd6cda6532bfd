// The kernels the tests call one by one (tests/unit): the same kernel table the blocks use,
// the finiteness scanner, the construction-time binary64 routines and the packed linear layer
// (the demo's output head). No math here: every entry point forwards to an op.
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
size_t uz(int64_t n) { return static_cast<size_t>(n); }

// The fast kernels that have a plain twin (ops/ref/ref.hpp), each as `<op>` (the current ISA's
// kernel table) beside `<op>_ref` (the twin, compiled once), for tests/unit/test_twins.py.
// Inputs are read only; every result is a fresh array. Shapes in C order:
//   dot_l16_ref(a (n), b (n)), sum_l16_ref(a (n)): twins of dot_l16 / sum_l16 (bound above)
//   attention_decode(q (R, hd), k (P, hd), v (P, hd), j0, p, scale, softcap) -> (o (R, hd),
//     probs (R, p - j0 + 1)): R = 1..4 query heads on keys j0..p (attention_heads<V, R>)
//   attention_prefill(q (Q, R, hd), k, v, window, p0, base, scale, softcap) -> (o (Q, R, hd),
//     probs (Q, R, p0 + Q)): queries at p0..p0+Q-1 (attention_prefill_block<V>), keys packed
//     from position base; row (qi, r) holds p0 + qi - j0 + 1 probabilities, then zeros
//   attention_ref(q (R, hd), k, v, j0, p, scale, softcap): the twin of both, head by head
//   softmax(s (n), scale, softcap) -> p (n)                        softmax_scores<V>
//   conv1d(w (K, C), u (K, C), bias (C) or None, c0, nc) -> (nc)   channels c0..c0+nc-1
//   ssm_scan_step(h (hd, ns), dt, a, d, x (hd), b (ns), c (ns)) -> (h', y (hd))
//   ssm_scan_tokens(h (hd, ns), dt (T), a, d, x (T, hd), b (T, ns), c (T, ns)) -> (h', y (T, hd))
//     (T <= 32; its twin is T calls of ssm_scan_step_ref)
//   rope(v (n, hd), rope_dim, pos, inv_freq (rope_dim / 2)) -> v'
//   mlp_combine(kind, gu (rows, 2 it) gated / (rows, it) ungated) -> u (rows, it)
void bind_twins(nb::module_& m) {
  m.def("dot_l16_ref", [](CArr a, CArr b) {
    EB_CHECK(a.size() == b.size(), "dot_l16_ref: sizes differ");
    FpEnvGuard guard;
    return ops::ref::dot_l16_ref(a.data(), b.data(), static_cast<int64_t>(a.size()));
  });
  m.def("sum_l16_ref", [](CArr a) {
    FpEnvGuard guard;
    return ops::ref::sum_l16_ref(a.data(), static_cast<int64_t>(a.size()));
  });
  m.def("attention_decode",
        [](CArr2 q, CArr2 k, CArr2 v, int64_t j0, int64_t p, float scale, float softcap) {
          const int64_t R = dim(q, 0), hd = dim(q, 1), n = p - j0 + 1;
          EB_CHECK(R >= 1 && R <= 4, "attention_decode: 1 to 4 heads");
          EB_CHECK(dim(k, 1) == hd && dim(v, 1) == hd && dim(k, 0) > p && dim(v, 0) > p &&
                       0 <= j0 && j0 <= p,
                   "attention_decode: shapes");
          OutArr o = new_array({uz(R), uz(hd)}), probs = new_array({uz(R), uz(n)});
          kernels().attention_decode(q.data(), static_cast<int>(R), hd, k.data(), v.data(), j0, p,
                                     scale, softcap, probs.data(), n, o.data());
          return nb::make_tuple(o, probs);
        });
  m.def("attention_prefill", [](CArr3 q, CArr2 k, CArr2 v, int64_t window, int64_t p0, int64_t base,
                                float scale, float softcap) {
    const int64_t Q = dim(q, 0), R = dim(q, 1), hd = dim(q, 2), stride = p0 + Q;
    const int64_t j0 = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0;
    EB_CHECK(Q >= 1 && R >= 1 && Q * R <= 256, "attention_prefill: 1 <= Q * R <= 256");
    EB_CHECK(dim(k, 1) == hd && dim(v, 1) == hd && dim(k, 0) >= p0 + Q && dim(v, 0) >= p0 + Q &&
                 0 <= base && base <= j0,
             "attention_prefill: shapes");
    std::vector<float> scratch(uz(2 * (p0 + Q - base + 16) * hd));
    OutArr o = new_array({uz(Q), uz(R), uz(hd)}), probs = new_array({uz(Q), uz(R), uz(stride)});
    kernels().attention_prefill(q.data(), static_cast<int>(Q), static_cast<int>(R), hd, window, p0,
                                k.data(), v.data(), base, scale, softcap, scratch.data(),
                                probs.data(), stride, o.data());
    return nb::make_tuple(o, probs);
  });
  m.def("attention_ref",
        [](CArr2 q, CArr2 k, CArr2 v, int64_t j0, int64_t p, float scale, float softcap) {
          const int64_t R = dim(q, 0), hd = dim(q, 1), n = p - j0 + 1;
          EB_CHECK(dim(k, 1) == hd && dim(v, 1) == hd && dim(k, 0) > p && dim(v, 0) > p &&
                       0 <= j0 && j0 <= p,
                   "attention_ref: shapes");
          OutArr o = new_array({uz(R), uz(hd)}), probs = new_array({uz(R), uz(n)});
          FpEnvGuard guard;
          for (int64_t r = 0; r < R; ++r)
            ops::ref::attention_ref(q.data() + r * hd, k.data(), v.data(), hd, hd, j0, p, scale,
                                    softcap, probs.data() + r * n, o.data() + r * hd);
          return nb::make_tuple(o, probs);
        });
  m.def("softmax", [](CArr1 s, float scale, float softcap) {
    OutArr y = new_array({s.shape(0)});
    std::copy(s.data(), s.data() + s.shape(0), y.data());
    kernels().softmax(y.data(), dim(s, 0), scale, softcap);
    return y;
  });
  m.def("softmax_ref", [](CArr1 s, float scale, float softcap) {
    OutArr y = new_array({s.shape(0)});
    std::copy(s.data(), s.data() + s.shape(0), y.data());
    FpEnvGuard guard;
    ops::ref::softmax_ref(y.data(), dim(s, 0), scale, softcap);
    return y;
  });
  const auto conv1d = [](bool ref, CArr2 w, CArr2 u, nb::object bias, int64_t c0, int64_t nc) {
    const int64_t K = dim(w, 0), C = dim(w, 1);
    EB_CHECK(dim(u, 0) == K && dim(u, 1) == C && c0 >= 0 && nc >= 0 && c0 + nc <= C,
             "conv1d: shapes");
    CArr barr;
    const float* b = nullptr;
    if (!bias.is_none()) {
      barr = nb::cast<CArr>(bias, false);
      EB_CHECK(static_cast<int64_t>(barr.size()) == C, "conv1d: bias size");
      b = barr.data() + c0;
    }
    OutArr out = new_array({uz(nc)});
    if (ref) {
      FpEnvGuard guard;
      ops::ref::conv1d_ref(w.data() + c0, u.data() + c0, C, nc, K, b, out.data());
    } else {
      kernels().conv1d(w.data() + c0, u.data() + c0, C, nc, K, b, out.data());
    }
    return out;
  };
  m.def(
      "conv1d",
      [conv1d](CArr2 w, CArr2 u, nb::object bias, int64_t c0, int64_t nc) {
        return conv1d(false, w, u, bias, c0, nc);
      },
      nb::arg("w"), nb::arg("u"), nb::arg("bias").none(), nb::arg("c0"), nb::arg("nc"));
  m.def(
      "conv1d_ref",
      [conv1d](CArr2 w, CArr2 u, nb::object bias, int64_t c0, int64_t nc) {
        return conv1d(true, w, u, bias, c0, nc);
      },
      nb::arg("w"), nb::arg("u"), nb::arg("bias").none(), nb::arg("c0"), nb::arg("nc"));
  const auto ssm_step = [](bool ref, CArr2 h, float dt, float a, float d, CArr1 x, CArr1 b,
                           CArr1 c) {
    const int64_t hd = dim(h, 0), ns = dim(h, 1);
    EB_CHECK(dim(x, 0) == hd && dim(b, 0) == ns && dim(c, 0) == ns, "ssm_scan_step: shapes");
    OutArr h2 = new_array({uz(hd), uz(ns)}), y = new_array({uz(hd)});
    std::copy(h.data(), h.data() + hd * ns, h2.data());
    if (ref) {
      FpEnvGuard guard;
      ops::ref::ssm_scan_step_ref(h2.data(), hd, ns, dt, a, d, x.data(), b.data(), c.data(),
                                  y.data());
    } else {
      std::vector<float> dtb(uz(ns));
      kernels().ssm_scan_step(h2.data(), hd, ns, dt, a, d, x.data(), b.data(), c.data(), dtb.data(),
                              y.data());
    }
    return nb::make_tuple(h2, y);
  };
  m.def("ssm_scan_step", [ssm_step](CArr2 h, float dt, float a, float d, CArr1 x, CArr1 b,
                                    CArr1 c) { return ssm_step(false, h, dt, a, d, x, b, c); });
  m.def("ssm_scan_step_ref", [ssm_step](CArr2 h, float dt, float a, float d, CArr1 x, CArr1 b,
                                        CArr1 c) { return ssm_step(true, h, dt, a, d, x, b, c); });
  m.def("ssm_scan_tokens", [](CArr2 h, CArr1 dt, float a, float d, CArr2 x, CArr2 b, CArr2 c) {
    const int64_t hd = dim(h, 0), ns = dim(h, 1), T = dim(dt, 0);
    EB_CHECK(T >= 1 && T <= ops::kScanChunk, "ssm_scan_tokens: 1 to 32 tokens");
    EB_CHECK(dim(x, 0) == T && dim(x, 1) == hd && dim(b, 0) == T && dim(b, 1) == ns &&
                 dim(c, 0) == T && dim(c, 1) == ns,
             "ssm_scan_tokens: shapes");
    OutArr h2 = new_array({uz(hd), uz(ns)}), y = new_array({uz(T), uz(hd)});
    std::copy(h.data(), h.data() + hd * ns, h2.data());
    std::vector<float> scratch(uz(ops::ssm_scan_scratch_floats(ns)));
    kernels().ssm_scan_tokens(h2.data(), hd, ns, T, dt.data(), a, d, x.data(), b.data(), c.data(),
                              scratch.data(), y.data());
    return nb::make_tuple(h2, y);
  });
  const auto rope = [](bool ref, CArr2 v, int64_t rope_dim, int64_t pos, CArr1 inv_freq) {
    const int64_t n = dim(v, 0), hd = dim(v, 1);
    EB_CHECK(rope_dim >= 0 && rope_dim % 2 == 0 && rope_dim <= hd &&
                 dim(inv_freq, 0) == rope_dim / 2 && pos >= 0 && pos < (int64_t{1} << 24),
             "rope: shapes");
    OutArr y = new_array({uz(n), uz(hd)});
    std::copy(v.data(), v.data() + n * hd, y.data());
    if (ref) {
      FpEnvGuard guard;
      for (int64_t i = 0; i < n; ++i)
        ops::ref::rope_ref(y.data() + i * hd, rope_dim, pos, inv_freq.data());
    } else {
      std::vector<float> scratch(uz(rope_dim + 2));
      kernels().rope(y.data(), n, hd, rope_dim, pos, inv_freq.data(), scratch.data());
    }
    return y;
  };
  m.def("rope", [rope](CArr2 v, int64_t rope_dim, int64_t pos, CArr1 inv_freq) {
    return rope(false, v, rope_dim, pos, inv_freq);
  });
  m.def("rope_ref", [rope](CArr2 v, int64_t rope_dim, int64_t pos, CArr1 inv_freq) {
    return rope(true, v, rope_dim, pos, inv_freq);
  });
  const auto mlp = [](bool ref, int kind, CArr2 gu) {
    EB_CHECK(kind >= ops::kSwiGlu && kind <= ops::kGeluTanh, "mlp_combine: kind");
    const int64_t rows = dim(gu, 0), w = dim(gu, 1);
    const int64_t it = ops::mlp_is_gated(kind) ? w / 2 : w;
    EB_CHECK(!ops::mlp_is_gated(kind) || w % 2 == 0, "mlp_combine: gated rows hold 2 * it");
    OutArr u = new_array({uz(rows), uz(it)});
    FpEnvGuard guard;
    for (int64_t r = 0; r < rows; ++r) {
      if (ref)
        ops::ref::mlp_combine_ref(kind, gu.data() + r * w, it, u.data() + r * it);
      else
        kernels().mlp_combine(kind, gu.data() + r * w, it, u.data() + r * it);
    }
    return u;
  };
  m.def("mlp_combine", [mlp](int kind, CArr2 gu) { return mlp(false, kind, gu); });
  m.def("mlp_combine_ref", [mlp](int kind, CArr2 gu) { return mlp(true, kind, gu); });
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

  bind_twins(m);

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
