// The fast kernels that have a plain twin, bound beside it (tests/unit/test_twins.py). No math
// here: every entry point forwards to the kernel table or to the twin.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "base/check.hpp"
#include "base/fpenv.hpp"
#include "bindings/common.hpp"
#include "dispatch/kernel_table.hpp"
#include "ops/activations.hpp"
#include "ops/ref/ref.hpp"
#include "ops/ssm_scan.hpp"

namespace eb::bindings {
namespace {

template <class A>
int64_t dim(const A& a, size_t i) {
  return static_cast<int64_t>(a.shape(i));
}
size_t uz(int64_t n) { return static_cast<size_t>(n); }

}  // namespace

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

}  // namespace eb::bindings
