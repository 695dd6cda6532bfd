// The digest's block cases (digest.hpp): Transformer and Mamba-2 blocks of several configs,
// each over three calls that carry their state (a ragged prefill, a continuation, a decode).
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "blocks/mamba2/backward_call.hpp"
#include "blocks/mamba2/model.hpp"
#include "blocks/transformer/model.hpp"
#include "digest.hpp"
#include "dispatch/kernel_table.hpp"
#include "ops/activations.hpp"
#include "ops/norm.hpp"

namespace digest {

// ---- Transformer ------------------------------------------------------------------------------

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
  const auto n = [](int64_t v) { return static_cast<size_t>(v); };
  Fnv1a f;
  std::vector<float> first;
  for (int naive = 0; naive < 2; ++naive) {
    std::vector<float> dx(x.size(), 0.0f), bn(n(d)), wi(n(n_in * d)), bi(n(n_in)),
        cw(n(c.conv_dim * c.conv_kernel)), cb(n(c.conv_dim)), dtb(n(c.n_heads)), al(n(c.n_heads)),
        dd(n(c.n_heads)), gn(n(c.d_inner)), wo(n(d * c.d_inner)), bo(n(d));
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
    } else if (first != all) {
      fail(eb::get_isa(), mc.name + ": backward differs from its naive twin");
    }
  }
  return f.h;
}

}  // namespace digest
