// The digest's kernel cases (digest.hpp): the L16 reductions, packed GEMMs (float32 and compact
// panels), elementwise sweeps and the kernels against their plain twins (ops/ref/ref.hpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "digest.hpp"
#include "dispatch/kernel_table.hpp"
#include "ops/activations.hpp"
#include "ops/norm.hpp"
#include "ops/ref/ref.hpp"
#include "ops/ssm_scan.hpp"

namespace digest {

// ---- kernels and elementwise sweeps -------------------------------------------------------------

uint64_t run_reductions() {
  const std::vector<float> a = tensor("red.a", 300, 1.0f), b = tensor("red.b", 300, 1.0f);
  Fnv1a f;
  for (int64_t n : {0, 1, 3, 4, 5, 8, 15, 16, 17, 31, 33, 64, 100, 257, 300}) {
    f.f32(eb::kernels().dot_l16(a.data(), b.data(), n));
    f.f32(eb::kernels().sum_l16(a.data(), n));
  }
  return f.h;
}

uint64_t run_gemm(int n_threads) {
  const int64_t m = 5, k = 37, n = 45;
  const std::vector<float> a = tensor("gemm.a", m * k, 1.0f);
  const std::vector<float> w = tensor("gemm.w", n * k, inv_sqrt(k));
  const std::vector<float> bias = tensor("gemm.b", n, 0.1f);
  const eb::ops::PackedMatrix pm = eb::ops::pack_matrices({w.data()}, {n}, k, {bias.data()});
  Fnv1a f;
  for (int64_t rows = 1; rows <= m; ++rows) {
    std::vector<float> c(static_cast<size_t>(rows * n), 0.0f);
    eb::kernels().gemm(a.data(), rows, k, pm, c.data(), n, n_threads);
    f.floats(c);
  }
  std::vector<float> y(static_cast<size_t>(m * k));
  const std::vector<float> nw = tensor("norm.w", k, 0.25f, 1.0f), nb = tensor("norm.b", k, 0.1f);
  for (int kind : {eb::ops::kRmsNorm, eb::ops::kLayerNorm, eb::ops::kRmsNormOffset}) {
    eb::kernels().norm_rows(kind, a.data(), m, k, nw.data(),
                            kind == eb::ops::kLayerNorm ? nb.data() : nullptr, 1e-6f, y.data());
    f.floats(y);
  }
  return f.h;
}

// Compact exact storage (ops/gemm/format.hpp PanelFormat): matrices built as GGUF Q4_1 / Q8_0 /
// Q5_1 / Q6_K values or bfloat16 values (d with 10 fraction bits, like binary16; each block holds
// its extreme codes, as llama.cpp's quantiser makes them) must pack compactly and give the float32
// panels' bits at every row count (1 and 8: rebuilt in registers; 9 and 20: rebuilt K block by K
// block). Then GGUF Q5_K and Q6_K blocks of hashed bytes, packed straight from the blocks
// (pack_sources), against float32 panels of their dequantised values.
uint64_t run_gemm_compact(int n_threads, const std::string& isa) {
  const int64_t k = 2048 + 256, n = 100, m = 20;
  const std::vector<float> a = tensor("gemmq.a", m * k, 1.0f);
  Fnv1a f;
  auto check = [&](const eb::ops::PackedMatrix& pq, const eb::ops::PackedMatrix& pf) {
    for (int64_t rows : {1, 8, 9, 20}) {
      std::vector<float> cq(static_cast<size_t>(rows * n)), cf(cq.size());
      eb::kernels().gemm(a.data(), rows, k, pq, cq.data(), n, n_threads);
      eb::kernels().gemm(a.data(), rows, k, pf, cf.data(), n, n_threads);
      if (std::memcmp(cq.data(), cf.data(), cq.size() * sizeof(float)) != 0)
        fail(isa, std::string("gemm_compact: ") + pq.format_name() + " != float32 panels");
      f.floats(cq);
    }
  };
  for (int format : {eb::ops::kPanelQ4, eb::ops::kPanelQ8, eb::ops::kPanelBF16, eb::ops::kPanelQ5,
                     eb::ops::kPanelQ6}) {
    std::vector<float> w(static_cast<size_t>(n * k));
    if (format == eb::ops::kPanelBF16) {  // bfloat16 values: the top halves of float32 values
      w = tensor("gemmq.bf16", n * k, inv_sqrt(k));
      for (float& x : w) {
        uint32_t u;
        std::memcpy(&u, &x, sizeof u);
        u &= 0xFFFF0000u;
        std::memcpy(&x, &u, sizeof u);
      }
    }
    const char* names[] = {"", "gemmq.q8", "gemmq.q4", "", "gemmq.q6", "gemmq.q5"};
    const uint64_t id = name_id(names[format]);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t b = 0; b < k / 32; ++b) {
        const uint64_t hb = mix(id + static_cast<uint64_t>(r * k + b));
        const float d = std::ldexp(1.0f + static_cast<float>(hb % 1024) / 1024.0f, -8);
        const float mn = -0.25f * static_cast<float>((hb >> 10) % 4096) / 4096.0f;
        for (int i = 0; i < 32; ++i) {
          const uint64_t hq = mix(hb + static_cast<uint64_t>(i));
          float& x = w[static_cast<size_t>(r * k + b * 32 + i)];
          if (format == eb::ops::kPanelBF16) {
            continue;
          } else if (format == eb::ops::kPanelQ4) {
            const int q = i == 0 ? 0 : (i == 1 ? 15 : static_cast<int>(hq % 16));
            x = std::fma(d, static_cast<float>(q), mn);
          } else if (format == eb::ops::kPanelQ5) {
            const int q = i == 0 ? 0 : (i == 1 ? 31 : static_cast<int>(hq % 32));
            x = std::fma(d, static_cast<float>(q), mn);
          } else if (format == eb::ops::kPanelQ6) {  // (d * sc) * (q - 32), sc int8, per 16
            const int sc = static_cast<int>((hb >> (22 + 8 * (i / 16))) % 255) - 127;
            const int q = i % 16 == 0 ? -32 : static_cast<int>(hq % 64) - 32;
            x = (d * static_cast<float>(sc)) * static_cast<float>(q);
          } else {
            const int q = i == 0 ? 127 : static_cast<int>(hq % 255) - 127;
            x = d * static_cast<float>(q);
          }
        }
      }
    const eb::ops::PackedMatrix pq = eb::ops::pack_matrices({w.data()}, {n}, k, {nullptr});
    const eb::ops::PackedMatrix pf = eb::ops::pack_matrices({w.data()}, {n}, k, {nullptr}, false);
    if (pq.format != format || pf.format != eb::ops::kPanelF32)
      fail(isa, std::string("gemm_compact: packed as ") + pq.format_name());
    check(pq, pf);
  }
  for (int type : {eb::ops::kGgmlQ5_K, eb::ops::kGgmlQ6_K}) {
    const int64_t row_bytes = k / 256 * eb::ops::ggml_type_size(type);
    std::vector<uint8_t> blocks(static_cast<size_t>(n * row_bytes));
    const uint64_t id = name_id(type == eb::ops::kGgmlQ5_K ? "gemmq.q5k" : "gemmq.q6k");
    for (size_t i = 0; i < blocks.size(); ++i)
      blocks[i] = static_cast<uint8_t>(mix(id + i) & 0xFFu);
    for (int64_t sb = 0; sb < n * k / 256; ++sb) {  // binary16 scales in [2^-11, 2^-10)
      uint8_t* blk = blocks.data() + sb * eb::ops::ggml_type_size(type);
      for (int s = 0; s < (type == eb::ops::kGgmlQ5_K ? 2 : 1); ++s) {
        uint8_t* h = type == eb::ops::kGgmlQ6_K ? blk + 208 : blk + 2 * s;
        h[1] = 0x10;  // exponent field 4 (2^-11), sign +, hashed low mantissa bits
      }
    }
    std::vector<float> wf(static_cast<size_t>(n * k));
    eb::ops::dequantize_gguf(blocks.data(), type, n * k, wf.data());
    eb::ops::MatrixSource src;
    src.blocks = blocks.data();
    src.type = type;
    src.rows = n;
    const eb::ops::PackedMatrix pq = eb::ops::pack_sources({src}, k, {nullptr});
    const eb::ops::PackedMatrix pf = eb::ops::pack_matrices({wf.data()}, {n}, k, {nullptr}, false);
    const int want = type == eb::ops::kGgmlQ5_K ? eb::ops::kPanelQ5 : eb::ops::kPanelQ6;
    if (pq.format != want) fail(isa, std::string("gemm_compact: blocks as ") + pq.format_name());
    check(pq, pf);
  }
  return f.h;
}

float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// Inputs: a dense linear sweep over [-120, 120], every 2^15-th (quick: 2^18-th) bit pattern
// (both signs, subnormals, infinities, NaN payloads), hashed bit patterns, and edge values.
std::vector<float> sweep_inputs(bool quick) {
  std::vector<float> x;
  const int64_t n_lin = quick ? 4001 : 40001;
  for (int64_t i = 0; i < n_lin; ++i)
    x.push_back(static_cast<float>(-120.0 + 240.0 * static_cast<double>(i) /
                                                static_cast<double>(n_lin - 1)));
  const uint32_t step = quick ? (1u << 18) : (1u << 15);
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += step)
    x.push_back(from_bits(static_cast<uint32_t>(u) + 12345u));
  for (uint64_t i = 0; i < (quick ? 4000u : 40000u); ++i)
    x.push_back(from_bits(static_cast<uint32_t>(mix(0xE1E7 + i))));
  const float edges[] = {0.0f,
                         -0.0f,
                         1.0f,
                         -1.0f,
                         0x1.62e42ep6f,
                         0x1.62e430p6f,
                         -0x1.9fe36ap6f,
                         -103.97f,
                         -110.0f,
                         -110.00001f,
                         88.0f,
                         89.0f,
                         1e-30f,
                         -1e-30f,
                         0x1p-149f,
                         -0x1p-149f,
                         3.14159274f,
                         1e6f,
                         -1e6f,
                         20.0f,
                         20.000002f,
                         std::numeric_limits<float>::infinity(),
                         -std::numeric_limits<float>::infinity(),
                         std::numeric_limits<float>::quiet_NaN(),
                         from_bits(0xFFC12345u)};
  for (float e : edges) x.push_back(e);
  // Odd total length, so the vector loops of exp_array also end in a scalar tail.
  if (x.size() % 2 == 0) x.push_back(0.5f);
  return x;
}

uint64_t run_elementwise(const std::vector<float>& x, const std::string& isa) {
  static const char* names[] = {"exp",  "log1p",    "tanh", "erf",       "sin",    "cos",
                                "silu", "softplus", "gelu", "gelu_tanh", "exp_vec"};
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<float> y(x.size()), y_exp(x.size());
  Fnv1a all;
  for (int op = eb::kOpExp; op <= eb::kOpExpVec; ++op) {
    eb::kernels().elementwise(op, x.data(), y.data(), n);
    Fnv1a f;
    f.floats(y);
    std::fprintf(stderr, "# %s ew_%s %s\n", isa.c_str(), names[op], hex(f.h).c_str());
    all.floats(y);
    if (op == eb::kOpExp) y_exp = y;
    if (op == eb::kOpExpVec) {
      for (int64_t i = 0; i < n; ++i) {
        uint32_t a, b;
        std::memcpy(&a, &y[i], 4);
        std::memcpy(&b, &y_exp[i], 4);
        if (a != b) {
          char msg[160];
          uint32_t xb;
          std::memcpy(&xb, &x[i], 4);
          std::snprintf(msg, sizeof msg, "exp_vec(0x%08x) = 0x%08x but exp = 0x%08x", xb, a, b);
          fail(isa, msg);
          break;
        }
      }
    }
  }
  return all.h;
}

// ---- kernels against their plain twins (ops/ref/ref.hpp) ---------------------------------------

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Small sweeps with tails of each kernel that has a twin; a difference is a failure (so the
// NEON path is checked against the twins too, under qemu). Returns the digest of the outputs.
uint64_t run_twins(const std::string& isa) {
  const eb::KernelTable& kt = eb::kernels();
  Fnv1a f;
  const auto check = [&](const std::string& what, const std::vector<float>& got,
                         const std::vector<float>& want) {
    if (!same_bits(got, want)) fail(isa, "twin " + what + " differs");
    f.floats(got);
  };
  // attention, decode (R heads of one KV head) and prefill (Q queries x R heads)
  for (int64_t hd : {5, 16, 20}) {
    const std::vector<float> k = tensor("tw.k" + std::to_string(hd), 80 * hd, 1.0f);
    const std::vector<float> v = tensor("tw.v" + std::to_string(hd), 80 * hd, 1.0f);
    const std::vector<float> q = tensor("tw.q" + std::to_string(hd), 8 * 5 * hd, 1.0f);
    const float scale = inv_sqrt(hd);
    for (float softcap : {0.0f, 2.0f})
      for (int R = 1; R <= 4; ++R)
        for (int64_t n : {1, 17, 40}) {
          const int64_t j0 = 3, p = j0 + n - 1;
          std::vector<float> o(static_cast<size_t>(R * hd)), pr(static_cast<size_t>(R * n));
          std::vector<float> o_ref(o.size()), pr_ref(pr.size());
          kt.attention_decode(q.data(), R, hd, k.data(), v.data(), j0, p, scale, softcap, pr.data(),
                              n, o.data());
          for (int r = 0; r < R; ++r)
            eb::ops::ref::attention_ref(q.data() + r * hd, k.data(), v.data(), hd, hd, j0, p, scale,
                                        softcap, pr_ref.data() + r * n, o_ref.data() + r * hd);
          const std::string what = "attention_decode hd=" + std::to_string(hd) +
                                   " R=" + std::to_string(R) + " n=" + std::to_string(n);
          check(what + " probs", pr, pr_ref);
          check(what + " o", o, o_ref);
        }
    for (int Q : {3, 8})
      for (int R : {1, 5})
        for (int64_t p0 : {0, 20, 70})
          for (int64_t window : {0, 9}) {
            const float softcap = window ? 2.0f : 0.0f;
            const int64_t j00 = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0;
            const int64_t stride = p0 + Q;
            std::vector<float> scratch(static_cast<size_t>(2 * (p0 + Q + 16) * hd));
            std::vector<float> o(static_cast<size_t>(Q * R * hd)), o_ref(o.size());
            std::vector<float> pr(static_cast<size_t>(Q * R * stride), 0.0f), pr_ref(pr.size());
            for (int qi = 0; qi < Q; ++qi) {
              const int64_t p = p0 + qi, j0 = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
              for (int r = 0; r < R; ++r)
                eb::ops::ref::attention_ref(
                    q.data() + (qi * R + r) * hd, k.data(), v.data(), hd, hd, j0, p, scale, softcap,
                    pr_ref.data() + (qi * R + r) * stride, o_ref.data() + (qi * R + r) * hd);
            }
            for (int64_t base : {int64_t{0}, j00}) {
              std::fill(pr.begin(), pr.end(), 0.0f);
              kt.attention_prefill(q.data(), Q, R, hd, window, p0, k.data(), v.data(), base, scale,
                                   softcap, scratch.data(), pr.data(), stride, o.data());
              const std::string what =
                  "attention_prefill hd=" + std::to_string(hd) + " Q=" + std::to_string(Q) +
                  " R=" + std::to_string(R) + " p0=" + std::to_string(p0) +
                  " window=" + std::to_string(window) + " base=" + std::to_string(base);
              check(what + " probs", pr, pr_ref);
              check(what + " o", o, o_ref);
            }
          }
  }
  for (int64_t n : {1, 17, 100})
    for (float softcap : {0.0f, 5.0f}) {
      std::vector<float> s = tensor("tw.s" + std::to_string(n), n, 8.0f), s_ref = s;
      kt.softmax(s.data(), n, 0.25f, softcap);
      eb::ops::ref::softmax_ref(s_ref.data(), n, 0.25f, softcap);
      check("softmax n=" + std::to_string(n), s, s_ref);
    }
  for (int64_t K : {1, 4, 17})
    for (int64_t C : {5, 37}) {
      const std::vector<float> w = tensor("tw.cw", K * C, 0.5f), u = tensor("tw.cu", K * C, 1.0f);
      const std::vector<float> b = tensor("tw.cb", C, 0.1f);
      for (const float* bias : {static_cast<const float*>(nullptr), b.data()}) {
        std::vector<float> out(static_cast<size_t>(C)), out_ref(out.size());
        kt.conv1d(w.data(), u.data(), C, C, K, bias, out.data());
        eb::ops::ref::conv1d_ref(w.data(), u.data(), C, C, K, bias, out_ref.data());
        check("conv1d K=" + std::to_string(K) + " C=" + std::to_string(C), out, out_ref);
      }
    }
  // SSM: one step, and T tokens against T twin steps (d_state 16, 48, 128: register path)
  for (int64_t hd : {3, 16})
    for (int64_t ns : {12, 16, 33, 48, 128})
      for (int64_t T : {1, 7, 32}) {
        const std::string tag = std::to_string(hd) + "." + std::to_string(ns);
        const std::vector<float> h0 = tensor("tw.h" + tag, hd * ns, 1.0f);
        const std::vector<float> x = tensor("tw.x" + tag, T * hd, 1.0f);
        const std::vector<float> b = tensor("tw.b" + tag, T * ns, 1.0f);
        const std::vector<float> c = tensor("tw.c" + tag, T * ns, 1.0f);
        const std::vector<float> dt = tensor("tw.dt" + tag, T, 0.1f, 0.15f);
        const float a = -1.5f, d = 0.75f;
        std::vector<float> h = h0, h_ref = h0, y(static_cast<size_t>(T * hd)), y_ref(y.size());
        std::vector<float> scratch(static_cast<size_t>(eb::ops::ssm_scan_scratch_floats(ns)));
        kt.ssm_scan_tokens(h.data(), hd, ns, T, dt.data(), a, d, x.data(), b.data(), c.data(),
                           scratch.data(), y.data());
        for (int64_t t = 0; t < T; ++t)
          eb::ops::ref::ssm_scan_step_ref(h_ref.data(), hd, ns, dt[t], a, d, x.data() + t * hd,
                                          b.data() + t * ns, c.data() + t * ns,
                                          y_ref.data() + t * hd);
        const std::string what = "ssm_scan_tokens hd=" + std::to_string(hd) +
                                 " ns=" + std::to_string(ns) + " T=" + std::to_string(T);
        check(what + " y", y, y_ref);
        check(what + " h", h, h_ref);
        h = h0;
        h_ref = h0;
        std::vector<float> y1(static_cast<size_t>(hd)), y1_ref(y1.size());
        kt.ssm_scan_step(h.data(), hd, ns, dt[0], a, d, x.data(), b.data(), c.data(),
                         scratch.data(), y1.data());
        eb::ops::ref::ssm_scan_step_ref(h_ref.data(), hd, ns, dt[0], a, d, x.data(), b.data(),
                                        c.data(), y1_ref.data());
        check("ssm_scan_step hd=" + std::to_string(hd) + " ns=" + std::to_string(ns) + " y", y1,
              y1_ref);
        check("ssm_scan_step hd=" + std::to_string(hd) + " ns=" + std::to_string(ns) + " h", h,
              h_ref);
      }
  for (int64_t rope_dim : {6, 16})
    for (int64_t pos : {0, 37, 100000, (1 << 24) - 1}) {
      const int64_t hd = rope_dim + 3, half = rope_dim / 2;
      std::vector<float> inv(static_cast<size_t>(half));
      eb::ops::rope_inv_freq(rope_dim, 10000.0, eb::ops::kRopeDefault, 1.0, 1.0, 4.0, 8192.0,
                             inv.data());
      std::vector<float> v = tensor("tw.rope", 3 * hd, 1.0f), v_ref = v;
      std::vector<float> scratch(static_cast<size_t>(rope_dim));
      kt.rope(v.data(), 3, hd, rope_dim, pos, inv.data(), scratch.data());
      for (int64_t i = 0; i < 3; ++i)
        eb::ops::ref::rope_ref(v_ref.data() + i * hd, rope_dim, pos, inv.data());
      check("rope rope_dim=" + std::to_string(rope_dim) + " pos=" + std::to_string(pos), v, v_ref);
    }
  for (int kind = eb::ops::kSwiGlu; kind <= eb::ops::kGeluTanh; ++kind)
    for (int64_t it : {1, 9, 37}) {
      const std::vector<float> gu = tensor("tw.gu", 2 * it, 4.0f);
      std::vector<float> u(static_cast<size_t>(it)), u_ref(u.size());
      kt.mlp_combine(kind, gu.data(), it, u.data());
      eb::ops::ref::mlp_combine_ref(kind, gu.data(), it, u_ref.data());
      check("mlp_combine kind=" + std::to_string(kind) + " it=" + std::to_string(it), u, u_ref);
    }
  return f.h;
}

}  // namespace digest
