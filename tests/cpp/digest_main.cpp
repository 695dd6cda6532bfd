// Cross-ISA / cross-architecture bit digest, without Python (tests/cross/test_neon_cross.py).
// Builds small eb::blocks::TransformerModel and eb::blocks::Mamba2Model instances with
// deterministic weights (an integer hash of (tensor, index), no RNG), and for every kernel table
// this build has (eb::available_isas()) runs: ragged batched forwards that carry the KV cache / the
// conv and SSM state over three calls (prefill, continuation, decode), the L16 dot/sum kernels,
// packed GEMMs (float32 panels, and compact Q4_1/Q8_0/bfloat16 panels checked against them) and
// elementwise sweeps of exp, log1p, tanh, erf, sin, cos, silu, softplus, gelu, gelu_tanh and the
// vectorised exp. Everything (outputs and final states) is folded into a
// 64-bit FNV-1a over the raw bytes.
//
// Output (stdout): one line per ISA, `<isa> <16 hex digits>`; every line must carry the same
// digest on every ISA and every architecture (SPEC 3.1). stderr: one `# <isa> <case> <digest>`
// line per case, to locate a mismatch. Exit status 1 if a self-check fails inside one ISA:
// the vectorised exp differs from exp_f32, compact panels differ from float32 panels, 1 and
// 2 threads give different bits, a block output is non-finite, all zero, or written at a
// padding position, or a kernel differs from its plain twin (ops/ref/ref.hpp: attention decode
// and prefill, softmax, conv1d, the SSM step and multi-token scan, RoPE, the MLP combine).
//
// Build (x86-64, see the test for the full command; every kernels_isa.cpp object needs
// -DEB_ISA_<isa>=1 -DEB_ISA_NAME=isa_<isa> and the ISA's flags, the rest -DEB_HAVE_<ISA>=1):
//   g++ -std=c++17 -O2 -pthread -ffp-contract=off -I csrc tests/cpp/digest_main.cpp
//       csrc/{base,blocks,ops,dispatch}/**/*.cpp (not kernels_isa.cpp) <isa objects> -o digest
// Run: ./digest [--quick]
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <unordered_map>
#include <vector>

#include "blocks/mamba2/backward_call.hpp"
#include "blocks/mamba2/model.hpp"
#include "blocks/transformer/model.hpp"
#include "dispatch/kernel_table.hpp"
#include "ops/activations.hpp"
#include "ops/norm.hpp"
#include "ops/ref/ref.hpp"
#include "ops/ssm_scan.hpp"

namespace {

// ---- hashing ---------------------------------------------------------------------------------

struct Fnv1a {
  uint64_t h = 0xcbf29ce484222325ull;
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) {
      h ^= b[i];
      h *= 0x100000001b3ull;
    }
  }
  void floats(const std::vector<float>& v) { bytes(v.data(), v.size() * sizeof(float)); }
  void f32(float x) { bytes(&x, sizeof x); }
};

std::string hex(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, h);
  return buf;
}

// SplitMix64 finaliser: a fixed integer hash, the same on every machine.
uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform in [-1, 1) with 24 bits, exact in binary32: u = (k - 2^23) / 2^23.
float unit(uint64_t tensor, uint64_t i) {
  const int64_t k = static_cast<int64_t>(mix(tensor * 0x100000001ull + i) >> 40);  // 0 .. 2^24-1
  return static_cast<float>(k - (int64_t{1} << 23)) * 0x1p-23f;
}

uint64_t name_id(const std::string& s) {
  Fnv1a f;
  f.bytes(s.data(), s.size());
  return f.h;
}

// A tensor of n values: offset + scale * unit(name, i) (one rounding per value, no fma).
std::vector<float> tensor(const std::string& name, int64_t n, float scale, float offset = 0.0f) {
  std::vector<float> v(static_cast<size_t>(n));
  const uint64_t id = name_id(name);
  for (int64_t i = 0; i < n; ++i) v[i] = offset + scale * unit(id, static_cast<uint64_t>(i));
  return v;
}

using Weights = std::unordered_map<std::string, std::vector<float>>;

std::unordered_map<std::string, const float*> ptrs(const Weights& w) {
  std::unordered_map<std::string, const float*> out;
  for (const auto& kv : w) out[kv.first] = kv.second.data();
  return out;
}

float inv_sqrt(int64_t n) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))); }

bool g_ok = true;

void fail(const std::string& isa, const std::string& what) {
  std::fprintf(stderr, "FAIL %s: %s\n", isa.c_str(), what.c_str());
  g_ok = false;
}

// Sanity of one call's y (batch, L, d): real tokens finite and not all zero, padding exactly +0.
void check_y(const std::string& what, const std::vector<float>& y, int64_t B, int64_t L, int64_t d,
             const int64_t* lengths) {
  bool any_nonzero = false;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < L; ++t)
      for (int64_t i = 0; i < d; ++i) {
        const float v = y[(b * L + t) * d + i];
        if (t < lengths[b]) {
          if (!std::isfinite(v)) return fail(eb::get_isa(), what + ": non-finite output");
          any_nonzero = any_nonzero || v != 0.0f;
        } else if (v != 0.0f || std::signbit(v)) {
          return fail(eb::get_isa(), what + ": padding position written");
        }
      }
  if (!any_nonzero) fail(eb::get_isa(), what + ": all outputs zero");
}

// ---- Transformer ------------------------------------------------------------------------------

struct TfCase {
  std::string name;
  eb::blocks::TransformerConfig cfg;
  int rope_set = 0;  // longrope: the table of every call
};

std::vector<TfCase> transformer_cases() {
  std::vector<TfCase> out;
  {  // Llama/Qwen-like: RMSNorm, SwiGLU, GQA, q/k/v bias, partial RoPE with llama3 scaling.
    eb::blocks::TransformerConfig c;
    c.d_model = 40;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 14;
    c.intermediate = 56;
    c.window = 0;
    c.rope_dim = 10;
    c.max_positions = 64;
    c.rope_theta = 10000.0;
    c.rope_scaling = eb::ops::kRopeLlama3;
    c.rope_factor = 8.0;
    c.rope_low_freq_factor = 1.0;
    c.rope_high_freq_factor = 4.0;
    c.rope_original_max = 16.0;
    c.norm_eps = 1e-6;
    c.attn_softcap = 0.0f;
    c.norm = eb::ops::kRmsNorm;
    c.mlp = eb::ops::kSwiGlu;
    c.qkv_bias = true;
    out.push_back({"tf_llama", c});
  }
  {  // Gemma-like: (1 + w) RMSNorm, GeGLU(tanh), q/k norm, softcap, sliding window ring cache.
    eb::blocks::TransformerConfig c;
    c.d_model = 36;
    c.n_heads = 3;
    c.n_kv_heads = 1;
    c.head_dim = 16;
    c.intermediate = 44;
    c.window = 5;
    c.rope_dim = 16;
    c.max_positions = 64;
    c.rope_theta = 500.0;
    c.norm_eps = 1e-6;
    c.attn_softcap = 5.0f;
    c.norm = eb::ops::kRmsNormOffset;
    c.mlp = eb::ops::kGeGluTanh;
    c.qk_norm = true;
    out.push_back({"tf_gemma", c});
  }
  {  // GPT-NeoX/Phi-like: LayerNorm with bias, plain GELU MLP with biases, linear RoPE scaling.
    eb::blocks::TransformerConfig c;
    c.d_model = 33;
    c.n_heads = 3;
    c.n_kv_heads = 3;
    c.head_dim = 11;
    c.intermediate = 50;
    c.window = 0;
    c.rope_dim = 6;
    c.max_positions = 64;
    c.rope_theta = 10000.0;
    c.rope_scaling = eb::ops::kRopeLinear;
    c.rope_factor = 2.0;
    c.norm_eps = 1e-5;
    c.norm = eb::ops::kLayerNorm;
    c.mlp = eb::ops::kGelu;
    c.qkv_bias = true;
    c.o_bias = true;
    c.norm_bias = true;
    c.mlp_bias = true;
    out.push_back({"tf_neox", c});
  }
  {  // Gemma 2/3-like sandwich norms, query_pre_attn_scalar scale, q/k norms over all heads,
     // yarn RoPE with mscale (issue #12 layer shapes).
    eb::blocks::TransformerConfig c;
    c.d_model = 36;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 12;
    c.intermediate = 40;
    c.window = 6;
    c.rope_dim = 12;
    c.max_positions = 64;
    c.rope_theta = 10000.0;
    c.rope_scaling = eb::ops::kRopeYarn;
    c.rope_factor = 4.0;
    c.rope_original_max = 16;
    c.rope_mscale = 0.9;
    c.rope_mscale_all_dim = 0.6;
    c.norm_eps = 1e-6;
    c.attn_softcap = 7.0;
    c.attn_scale = 0.2;
    c.norm = eb::ops::kRmsNormOffset;
    c.norm_placement = eb::blocks::kNormSandwich;
    c.mlp = eb::ops::kGeGluTanh;
    c.qk_norm = true;
    c.qk_norm_scope = eb::blocks::kQkNormAllHeads;
    out.push_back({"tf_sandwich_yarn", c});
  }
  {  // OLMo 2-like post norms; per-head LayerNorm q/k weights (StableLM 2); longrope, long set;
     // Granite residual multiplier.
    eb::blocks::TransformerConfig c;
    c.d_model = 32;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 10;
    c.intermediate = 48;
    c.rope_dim = 6;
    c.max_positions = 64;
    c.rope_theta = 10000.0;
    c.rope_scaling = eb::ops::kRopeLongrope;
    c.rope_factor = 4.0;
    c.rope_original_max = 16;
    c.rope_short_factor = {1.0, 1.25, 1.5};
    c.rope_long_factor = {1.0, 3.0, 7.5};
    c.norm_eps = 1e-5;
    c.norm = eb::ops::kLayerNorm;
    c.norm_placement = eb::blocks::kNormPost;
    c.qk_norm = true;
    c.qk_norm_scope = eb::blocks::kQkNormPerHeadWeights;
    c.residual_multiplier = 0.3;
    out.push_back({"tf_post_longrope", c, 1});
  }
  {  // Nemotron-H / Granite-4.0-H attention-only block: no RoPE, own scale and multiplier.
    eb::blocks::TransformerConfig c;
    c.d_model = 30;
    c.n_heads = 3;
    c.n_kv_heads = 1;
    c.head_dim = 14;
    c.block_parts = eb::blocks::kBlockAttentionOnly;
    c.rope_dim = 0;
    c.max_positions = 64;
    c.attn_scale = 0.15;
    c.residual_multiplier = 0.5;
    out.push_back({"tf_attention_only", c});
  }
  {  // Nemotron-H MLP-only block: squared ReLU, ungated, with biases.
    eb::blocks::TransformerConfig c;
    c.d_model = 30;
    c.intermediate = 52;
    c.block_parts = eb::blocks::kBlockMlpOnly;
    c.mlp = eb::ops::kRelu2;
    c.mlp_bias = true;
    c.max_positions = 64;
    out.push_back({"tf_mlp_only", c});
  }
  return out;
}

// The MLP half's weights (absent from an attention-only block).
void add_mlp_weights(const eb::blocks::TransformerConfig& c, const std::string& p, Weights& w) {
  const int64_t d = c.d_model, it = c.intermediate;
  if (eb::ops::mlp_is_gated(c.mlp)) {
    w["gate_proj.weight"] = tensor(p + "g", it * d, inv_sqrt(d));
    if (c.mlp_bias) w["gate_proj.bias"] = tensor(p + "gb", it, 0.1f);
  }
  w["up_proj.weight"] = tensor(p + "u", it * d, inv_sqrt(d));
  w["down_proj.weight"] = tensor(p + "dn", d * it, inv_sqrt(it));
  if (c.mlp_bias) {
    w["up_proj.bias"] = tensor(p + "ub", it, 0.1f);
    w["down_proj.bias"] = tensor(p + "db", d, 0.1f);
  }
}

Weights transformer_weights(const TfCase& tc) {
  const eb::blocks::TransformerConfig& c = tc.cfg;
  const int64_t d = c.d_model, qw = c.n_heads * c.head_dim, kw = c.n_kv_heads * c.head_dim;
  const int64_t it = c.intermediate;
  const std::string p = tc.name + ".";
  Weights w;
  const bool offset = c.norm == eb::ops::kRmsNormOffset;  // weights stored as w, used as 1 + w
  w["input_layernorm.weight"] = tensor(p + "ln1", d, 0.25f, offset ? 0.0f : 1.0f);
  w["post_attention_layernorm.weight"] = tensor(p + "ln2", d, 0.25f, offset ? 0.0f : 1.0f);
  // read only under the sandwich / post placements (the model takes the names it needs)
  w["pre_feedforward_layernorm.weight"] = tensor(p + "ln3", d, 0.25f, offset ? 0.0f : 1.0f);
  w["post_feedforward_layernorm.weight"] = tensor(p + "ln4", d, 0.25f, offset ? 0.0f : 1.0f);
  if (c.norm_bias) {
    w["input_layernorm.bias"] = tensor(p + "ln1b", d, 0.1f);
    w["post_attention_layernorm.bias"] = tensor(p + "ln2b", d, 0.1f);
    w["pre_feedforward_layernorm.bias"] = tensor(p + "ln3b", d, 0.1f);
    w["post_feedforward_layernorm.bias"] = tensor(p + "ln4b", d, 0.1f);
  }
  if (c.qk_norm) {
    const bool one_row = c.qk_norm_scope == eb::blocks::kQkNormHead;
    w["q_norm.weight"] = tensor(p + "qn", one_row ? c.head_dim : qw, 0.25f, offset ? 0.0f : 1.0f);
    w["k_norm.weight"] = tensor(p + "kn", one_row ? c.head_dim : kw, 0.25f, offset ? 0.0f : 1.0f);
  }
  if (it > 0) add_mlp_weights(c, p, w);
  if (qw == 0) return w;  // an MLP-only block
  w["q_proj.weight"] = tensor(p + "q", qw * d, inv_sqrt(d));
  w["k_proj.weight"] = tensor(p + "k", kw * d, inv_sqrt(d));
  w["v_proj.weight"] = tensor(p + "v", kw * d, inv_sqrt(d));
  if (c.qkv_bias) {
    w["q_proj.bias"] = tensor(p + "qb", qw, 0.1f);
    w["k_proj.bias"] = tensor(p + "kb", kw, 0.1f);
    w["v_proj.bias"] = tensor(p + "vb", kw, 0.1f);
  }
  w["o_proj.weight"] = tensor(p + "o", d * qw, inv_sqrt(qw));
  if (c.o_bias) w["o_proj.bias"] = tensor(p + "ob", d, 0.1f);
  return w;
}

// Three calls on a batch of 3 rows: a ragged prefill (one row empty), a ragged continuation,
// a one-token decode step. Returns the digest of all outputs and the final caches.
uint64_t run_transformer(const TfCase& tc, const eb::blocks::TransformerModel& mdl, int n_threads) {
  const eb::blocks::TransformerConfig& c = tc.cfg;
  const int64_t B = 3, d = c.d_model;
  const int64_t cap = c.window > 0 ? c.window : c.max_positions;
  std::vector<float> kc(static_cast<size_t>(B * c.n_kv_heads * cap * c.head_dim), 0.0f);
  std::vector<float> vc(kc.size(), 0.0f);
  const int64_t calls_L[3] = {7, 3, 1};
  const int64_t calls_len[3][3] = {{7, 4, 0}, {2, 3, 1}, {1, 1, 1}};
  int64_t start[3] = {0, 0, 0};
  Fnv1a f;
  for (int k = 0; k < 3; ++k) {
    const int64_t L = calls_L[k];
    const std::vector<float> x = tensor(tc.name + ".x" + std::to_string(k), B * L * d, 1.0f);
    std::vector<float> y(x.size(), 0.0f);
    eb::blocks::TransformerCall call{};
    call.x = x.data();
    call.y = y.data();
    call.batch = B;
    call.n_tokens = L;
    call.lengths = calls_len[k];
    call.start = start;
    call.k_cache = kc.data();
    call.v_cache = vc.data();
    call.capacity = cap;
    call.n_threads = n_threads;
    call.rope_set = tc.rope_set;
    eb::kernels().transformer_forward(mdl, call);
    check_y(tc.name, y, B, L, d, calls_len[k]);
    f.floats(y);
    for (int b = 0; b < B; ++b) start[b] += calls_len[k][b];
  }
  f.floats(kc);
  f.floats(vc);
  return f.h;
}

// ---- Mamba-2 ----------------------------------------------------------------------------------

struct MbCase {
  std::string name;
  eb::blocks::Mamba2Config cfg;
};

std::vector<MbCase> mamba2_cases() {
  std::vector<MbCase> out;
  {  // d_state 12: not a multiple of 8 or 16, so the vector part and the tail both run.
    eb::blocks::Mamba2Config c;
    c.d_model = 24;
    c.d_inner = 32;
    c.n_heads = 4;
    c.head_dim = 8;
    c.d_state = 12;
    c.n_groups = 2;
    c.conv_dim = c.d_inner + 2 * c.n_groups * c.d_state;
    c.conv_kernel = 4;
    c.norm_eps = 1e-5;
    c.dt_min = 0.0f;
    c.dt_max = std::numeric_limits<float>::infinity();
    c.conv_bias = true;
    c.proj_bias = false;
    out.push_back({"mb_a", c});
  }
  {
    eb::blocks::Mamba2Config c;
    c.d_model = 20;
    c.d_inner = 40;
    c.n_heads = 5;
    c.head_dim = 8;
    c.d_state = 16;
    c.n_groups = 1;
    c.conv_dim = c.d_inner + 2 * c.n_groups * c.d_state;
    c.conv_kernel = 3;
    c.norm_eps = 1e-6;
    c.dt_min = 0.001f;
    c.dt_max = 0.1f;
    c.conv_bias = false;
    c.proj_bias = true;
    out.push_back({"mb_b", c});
  }
  return out;
}

Weights mamba2_weights(const MbCase& mc) {
  const eb::blocks::Mamba2Config& c = mc.cfg;
  const int64_t d = c.d_model, di = c.d_inner, nh = c.n_heads;
  const int64_t n_in = di + c.conv_dim + nh;
  const std::string p = mc.name + ".";
  Weights w;
  w["block_norm.weight"] = tensor(p + "bn", d, 0.25f, 1.0f);
  w["in_proj.weight"] = tensor(p + "in", n_in * d, inv_sqrt(d));
  if (c.proj_bias) w["in_proj.bias"] = tensor(p + "inb", n_in, 0.1f);
  w["conv1d.weight"] = tensor(p + "cw", c.conv_dim * c.conv_kernel, inv_sqrt(c.conv_kernel));
  if (c.conv_bias) w["conv1d.bias"] = tensor(p + "cb", c.conv_dim, 0.1f);
  w["dt_bias"] = tensor(p + "dtb", nh, 1.0f, -2.0f);  // softplus(dt_bias) ~ 0.05 .. 0.3
  w["D"] = tensor(p + "D", nh, 0.5f, 1.0f);
  w["A_log"] = tensor(p + "alog", nh, 1.0f, 1.0f);  // A = -exp(0 .. 2)
  w["norm.weight"] = tensor(p + "gn", di, 0.25f, 1.0f);
  w["out_proj.weight"] = tensor(p + "out", d * di, inv_sqrt(di));
  if (c.proj_bias) w["out_proj.bias"] = tensor(p + "outb", d, 0.1f);
  return w;
}

uint64_t run_mamba2(const MbCase& mc, const eb::blocks::Mamba2Model& mdl, int n_threads) {
  const eb::blocks::Mamba2Config& c = mc.cfg;
  const int64_t B = 3, d = c.d_model;
  std::vector<float> conv(static_cast<size_t>(B * c.conv_dim * c.conv_kernel), 0.0f);
  std::vector<float> h(static_cast<size_t>(B * c.n_heads * c.head_dim * c.d_state), 0.0f);
  const int64_t calls_L[3] = {6, 3, 1};
  const int64_t calls_len[3][3] = {{6, 2, 0}, {3, 0, 2}, {1, 1, 1}};
  Fnv1a f;
  for (int k = 0; k < 3; ++k) {
    const int64_t L = calls_L[k];
    const std::vector<float> x = tensor(mc.name + ".x" + std::to_string(k), B * L * d, 1.0f);
    std::vector<float> y(x.size(), 0.0f);
    eb::blocks::Mamba2Call call{};
    call.x = x.data();
    call.y = y.data();
    call.batch = B;
    call.n_tokens = L;
    call.lengths = calls_len[k];
    call.conv_window = conv.data();
    call.h = h.data();
    call.n_threads = n_threads;
    eb::kernels().mamba2_forward(mdl, call);
    check_y(mc.name, y, B, L, d, calls_len[k]);
    f.floats(y);
  }
  f.floats(conv);
  f.floats(h);
  return f.h;
}

// The backward (SPEC 7.6) of a ragged batch whose rows cross a scan chunk (32 tokens): dx and
// every weight gradient; the naive twins must give the same bits.
uint64_t run_mamba2_backward(const MbCase& mc, const eb::blocks::Mamba2Model& mdl, int n_threads) {
  const eb::blocks::Mamba2Config& c = mc.cfg;
  const int64_t B = 3, L = 40, d = c.d_model, n_in = c.d_inner + c.conv_dim + c.n_heads;
  const int64_t lengths[3] = {40, 33, 1};
  const std::vector<float> x = tensor(mc.name + ".bx", B * L * d, 1.0f);
  const std::vector<float> gy = tensor(mc.name + ".bg", B * L * d, 1.0f);
  Fnv1a f;
  std::vector<float> first;
  for (int naive = 0; naive < 2; ++naive) {
    std::vector<float> dx(x.size(), 0.0f), bn(d), wi(n_in * d), bi(n_in),
        cw(c.conv_dim * c.conv_kernel), cb(c.conv_dim), dtb(c.n_heads), al(c.n_heads),
        dd(c.n_heads), gn(c.d_inner), wo(d * c.d_inner), bo(d);
    eb::blocks::Mamba2BackwardCall call{};
    call.x = x.data();
    call.gy = gy.data();
    call.batch = B;
    call.n_tokens = L;
    call.lengths = lengths;
    call.dx = dx.data();
    call.d_block_norm_w = bn.data();
    call.d_in_w = wi.data();
    call.d_in_b = c.proj_bias ? bi.data() : nullptr;
    call.d_conv_w = cw.data();
    call.d_conv_b = c.conv_bias ? cb.data() : nullptr;
    call.d_dt_bias = dtb.data();
    call.d_a_log = al.data();
    call.d_d = dd.data();
    call.d_norm_w = gn.data();
    call.d_out_w = wo.data();
    call.d_out_b = c.proj_bias ? bo.data() : nullptr;
    call.n_threads = n_threads;
    call.naive = naive == 1;
    eb::kernels().mamba2_backward(mdl, call);
    std::vector<float> all;
    for (const std::vector<float>* v :
         {&dx, &bn, &wi, &bi, &cw, &cb, &dtb, &al, &dd, &gn, &wo, &bo})
      all.insert(all.end(), v->begin(), v->end());
    if (naive == 0) {
      first = all;
      f.floats(all);
    } else if (std::memcmp(first.data(), all.data(), sizeof(float) * all.size()) != 0) {
      fail(eb::kernels().name, mc.name + ": backward differs from its naive twin");
    }
  }
  return f.h;
}

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

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]);
      return 2;
    }
  }
  // Models are built once (construction does not depend on the ISA) and shared by all tables.
  const std::vector<TfCase> tcs = transformer_cases();
  const std::vector<MbCase> mcs = mamba2_cases();
  std::vector<Weights> tw, mw;
  std::vector<eb::blocks::TransformerModel> tms;
  std::vector<eb::blocks::Mamba2Model> mms;
  for (const TfCase& tc : tcs) {
    tw.push_back(transformer_weights(tc));
    tms.emplace_back(tc.cfg, ptrs(tw.back()));
  }
  for (const MbCase& mc : mcs) {
    mw.push_back(mamba2_weights(mc));
    mms.emplace_back(mc.cfg, ptrs(mw.back()));
  }
  const std::vector<float> sweep = sweep_inputs(quick);

  for (const std::string& isa : eb::available_isas()) {
    eb::set_isa(isa);
    Fnv1a total;
    auto record = [&](const std::string& what, uint64_t h) {
      std::fprintf(stderr, "# %s %s %s\n", isa.c_str(), what.c_str(), hex(h).c_str());
      total.bytes(&h, sizeof h);
    };
    for (size_t i = 0; i < tcs.size(); ++i) {
      const uint64_t h2 = run_transformer(tcs[i], tms[i], 2);
      const uint64_t h1 = run_transformer(tcs[i], tms[i], 1);
      if (h1 != h2) fail(isa, tcs[i].name + ": 1 and 2 threads differ");
      record(tcs[i].name, h2);
    }
    for (size_t i = 0; i < mcs.size(); ++i) {
      const uint64_t h2 = run_mamba2(mcs[i], mms[i], 2);
      const uint64_t h1 = run_mamba2(mcs[i], mms[i], 1);
      if (h1 != h2) fail(isa, mcs[i].name + ": 1 and 2 threads differ");
      record(mcs[i].name, h2);
      const uint64_t b2 = run_mamba2_backward(mcs[i], mms[i], 2);
      const uint64_t b1 = run_mamba2_backward(mcs[i], mms[i], 1);
      if (b1 != b2) fail(isa, mcs[i].name + ": backward: 1 and 2 threads differ");
      record(mcs[i].name + "_backward", b2);
    }
    record("l16", run_reductions());
    {
      const uint64_t h2 = run_gemm(2), h1 = run_gemm(1);
      if (h1 != h2) fail(isa, "gemm: 1 and 2 threads differ");
      record("gemm_norm", h2);
    }
    {
      const uint64_t h2 = run_gemm_compact(2, isa), h1 = run_gemm_compact(1, isa);
      if (h1 != h2) fail(isa, "gemm_compact: 1 and 2 threads differ");
      record("gemm_compact", h2);
    }
    record("elementwise", run_elementwise(sweep, isa));
    record("twins", run_twins(isa));
    std::printf("%s %s\n", isa.c_str(), hex(total.h).c_str());
    std::fflush(stdout);
  }
  return g_ok ? 0 : 1;
}
