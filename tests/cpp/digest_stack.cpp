// The digest's stack case (digest.hpp): a model's layers, Transformer, Mamba-2 and Transformer,
// through the stack runner (blocks/stack.hpp) over three calls that carry the states (a ragged
// prefill, a continuation, a decode), checked against the blocks' own calls one after another:
// the same output bits, the same states and counters. Then a fourth call with an undo log:
// with the middle layer's lock held it stops after the first layer, and rolling the log back
// restores every state; without, it runs every layer, and the rollback again restores them.
// Buffers of the wrong shapes, or sharing memory, do not fit a stack layer.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "base/state_lock.hpp"
#include "base/undo.hpp"
#include "blocks/mamba2/model.hpp"
#include "blocks/stack.hpp"
#include "blocks/transformer/model.hpp"
#include "digest.hpp"
#include "dispatch/kernel_table.hpp"

namespace digest {
namespace {

using eb::blocks::Mamba2Model;
using eb::blocks::StackLayer;
using eb::blocks::TransformerModel;

constexpr int64_t kB = 3;

// One layer's state: KV caches (a, b) or conv_window (a) and h (b), its counters and its lock.
struct LayerState {
  std::vector<float> a, b;
  std::vector<int64_t> row_tokens = std::vector<int64_t>(kB, 0);
  eb::StateLock lock;
  bool same(const LayerState& o) const {
    return a.size() == o.a.size() && b.size() == o.b.size() &&
           std::memcmp(a.data(), o.a.data(), a.size() * sizeof(float)) == 0 &&
           std::memcmp(b.data(), o.b.data(), b.size() * sizeof(float)) == 0 &&
           row_tokens == o.row_tokens;
  }
};

struct Model {
  std::vector<Weights> weights;
  std::vector<std::unique_ptr<TransformerModel>> tf;  // layers 0 and 2
  std::unique_ptr<Mamba2Model> mb;                    // layer 1
  int64_t cap = 0;
};

std::vector<std::unique_ptr<LayerState>> new_states(const Model& m) {
  std::vector<std::unique_ptr<LayerState>> s;
  for (int i = 0; i < 3; ++i) s.push_back(std::make_unique<LayerState>());
  for (int i : {0, 2}) {
    const eb::blocks::TransformerConfig& c = m.tf[i / 2]->cfg;
    const auto n = static_cast<size_t>(kB * c.n_kv_heads * m.cap * c.head_dim);
    s[static_cast<size_t>(i)]->a.assign(n, 0.0f);
    s[static_cast<size_t>(i)]->b.assign(n, 0.0f);
  }
  const eb::blocks::Mamba2Config& c = m.mb->cfg;
  s[1]->a.assign(static_cast<size_t>(kB * c.conv_dim * c.conv_kernel), 0.0f);
  s[1]->b.assign(static_cast<size_t>(kB * c.n_heads * c.head_dim * c.d_state), 0.0f);
  return s;
}

// The blocks' own calls one after another; returns the last layer's output.
std::vector<float> run_by_layer(const Model& m, std::vector<std::unique_ptr<LayerState>>& st,
                                const std::vector<float>& x, int64_t L, const int64_t* lens) {
  std::vector<float> in = x;
  for (int i = 0; i < 3; ++i) {
    LayerState& s = *st[static_cast<size_t>(i)];
    std::vector<float> y(x.size(), 0.0f);
    if (i == 1) {
      eb::blocks::Mamba2Call call{};
      call.x = in.data();
      call.y = y.data();
      call.batch = kB;
      call.n_tokens = L;
      call.lengths = lens;
      call.conv_window = s.a.data();
      call.h = s.b.data();
      call.n_threads = 2;
      eb::kernels().mamba2_forward(*m.mb, call);
    } else {
      eb::blocks::TransformerCall call{};
      call.x = in.data();
      call.y = y.data();
      call.batch = kB;
      call.n_tokens = L;
      call.lengths = lens;
      call.start = s.row_tokens.data();
      call.k_cache = s.a.data();
      call.v_cache = s.b.data();
      call.capacity = m.cap;
      call.n_threads = 2;
      eb::kernels().transformer_forward(*m.tf[static_cast<size_t>(i / 2)], call);
    }
    for (int64_t b = 0; b < kB; ++b) s.row_tokens[static_cast<size_t>(b)] += lens[b];
    in = y;
  }
  return in;
}

// Layer i's state as the bindings hand it to the runner.
eb::blocks::StackBuffers buffers(const Model& m, LayerState& s, int i) {
  eb::blocks::StackBuffers buf;
  buf.a = s.a.data();
  buf.b = s.b.data();
  buf.row_tokens = s.row_tokens.data();
  buf.n_rows = kB;
  if (i == 1) {
    const eb::blocks::Mamba2Config& c = m.mb->cfg;
    buf.a_shape = {kB, c.conv_dim, c.conv_kernel};
    buf.b_shape = {kB, c.n_heads, c.head_dim, c.d_state};
  } else {
    const eb::blocks::TransformerConfig& c = m.tf[static_cast<size_t>(i / 2)]->cfg;
    buf.a_shape = buf.b_shape = {kB, c.n_kv_heads, m.cap, c.head_dim};
    buf.n_kv_heads = c.n_kv_heads;
    buf.capacity = buf.max_tokens = m.cap;
    buf.head_dim = c.head_dim;
  }
  return buf;
}

// Buffers the block's own call refuses do not fit a stack layer either.
bool refuses_misfits(const Model& m, std::vector<std::unique_ptr<LayerState>>& st) {
  StackLayer ly;
  eb::blocks::StackBuffers tf = buffers(m, *st[0], 0), mb = buffers(m, *st[1], 1);
  const int64_t d = m.mb->cfg.d_model;
  if (!eb::blocks::fit_transformer_layer(*m.tf[0], &st[0]->lock, tf, kB, d, ly) ||
      !eb::blocks::fit_mamba2_layer(*m.mb, &st[1]->lock, mb, kB, d, ly))
    return false;
  eb::blocks::StackBuffers bad = tf;
  bad.b = bad.a;  // keys and values in one buffer
  if (eb::blocks::fit_transformer_layer(*m.tf[0], &st[0]->lock, bad, kB, d, ly)) return false;
  bad = tf;
  bad.b_shape[2] -= 1;  // values of another capacity
  if (eb::blocks::fit_transformer_layer(*m.tf[0], &st[0]->lock, bad, kB, d, ly)) return false;
  bad = tf;
  bad.rope_set = 1;  // a long RoPE table without longrope
  if (eb::blocks::fit_transformer_layer(*m.tf[0], &st[0]->lock, bad, kB, d, ly)) return false;
  if (eb::blocks::fit_transformer_layer(*m.tf[0], &st[0]->lock, tf, kB, d + 1, ly)) return false;
  bad = mb;
  bad.n_rows = kB - 1;  // counters of another batch
  if (eb::blocks::fit_mamba2_layer(*m.mb, &st[1]->lock, bad, kB, d, ly)) return false;
  bad = mb;
  bad.a_shape[2] += 1;  // a conv window of another width
  if (eb::blocks::fit_mamba2_layer(*m.mb, &st[1]->lock, bad, kB, d, ly)) return false;
  return !eb::blocks::fit_mamba2_layer(*m.mb, nullptr, mb, kB, d, ly);
}

// The stack runner on the same layers; returns (layers run, the last run layer's output).
size_t run_by_stack(const Model& m, std::vector<std::unique_ptr<LayerState>>& st,
                    const std::vector<float>& x, int64_t L, const int64_t* lens, eb::UndoLog* undo,
                    std::vector<float>& out) {
  std::vector<StackLayer> layers(3);
  for (int i = 0; i < 3; ++i) {
    const eb::blocks::StackBuffers buf = buffers(m, *st[static_cast<size_t>(i)], i);
    const bool fits = i == 1 ? eb::blocks::fit_mamba2_layer(*m.mb, &st[1]->lock, buf, kB,
                                                            m.mb->cfg.d_model, layers[1])
                             : eb::blocks::fit_transformer_layer(*m.tf[static_cast<size_t>(i / 2)],
                                                                 &st[static_cast<size_t>(i)]->lock,
                                                                 buf, kB, m.mb->cfg.d_model,
                                                                 layers[static_cast<size_t>(i)]);
    if (!fits) return 0;
  }
  std::vector<float> ya(x.size()), yb(x.size());
  eb::blocks::StackCall call;
  call.x = x.data();
  call.batch = kB;
  call.n_tokens = L;
  call.d_model = m.mb->cfg.d_model;
  call.lengths = lens;
  call.y_a = ya.data();
  call.y_b = yb.data();
  call.n_threads = 2;
  call.check_cache = true;
  call.undo = undo;
  const eb::blocks::StackKernels table{eb::kernels().transformer_forward,
                                       eb::kernels().mamba2_forward};
  const size_t done = eb::blocks::run_stack(
      call, table, layers,
      [&](const StackLayer&, const eb::blocks::StackLayerBody& body) { return body(undo); });
  out = done % 2 == 1 ? ya : yb;
  return done;
}

Model build_model() {
  Model m;
  const MbCase mc = mamba2_cases()[0];  // d_model 24
  TfCase tc = transformer_cases()[0];   // Llama-like, d_model set to the Mamba-2 layer's
  tc.cfg.d_model = mc.cfg.d_model;
  m.cap = tc.cfg.max_positions;
  for (const char* name : {"stack_tf0", "stack_tf1"}) {
    tc.name = name;
    m.weights.push_back(transformer_weights(tc));
    m.tf.push_back(std::make_unique<TransformerModel>(tc.cfg, ptrs(m.weights.back())));
  }
  MbCase mb = mc;
  mb.name = "stack_mb";
  m.weights.push_back(mamba2_weights(mb));
  m.mb = std::make_unique<Mamba2Model>(mb.cfg, ptrs(m.weights.back()));
  return m;
}

bool same_states(const std::vector<std::unique_ptr<LayerState>>& a,
                 const std::vector<std::unique_ptr<LayerState>>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (!a[i]->same(*b[i])) return false;
  return true;
}

void copy_states(const std::vector<std::unique_ptr<LayerState>>& from,
                 std::vector<std::unique_ptr<LayerState>>& to) {
  for (size_t i = 0; i < from.size(); ++i) {
    to[i]->a = from[i]->a;
    to[i]->b = from[i]->b;
    to[i]->row_tokens = from[i]->row_tokens;
  }
}

}  // namespace

uint64_t run_stack_case(const std::string& isa) {
  static const Model m = build_model();  // construction does not depend on the ISA
  const int64_t d = m.mb->cfg.d_model;
  auto ref = new_states(m), st = new_states(m), saved = new_states(m);
  const int64_t calls_L[4] = {6, 3, 1, 1};
  const int64_t calls_len[4][3] = {{6, 2, 0}, {3, 0, 2}, {1, 1, 1}, {1, 0, 1}};
  if (!refuses_misfits(m, st)) fail(isa, "stack: buffers the blocks refuse fit a stack layer");
  Fnv1a f;
  for (int k = 0; k < 3; ++k) {
    const int64_t L = calls_L[k];
    const std::vector<float> x = tensor("stack.x" + std::to_string(k), kB * L * d, 1.0f);
    const std::vector<float> want = run_by_layer(m, ref, x, L, calls_len[k]);
    std::vector<float> got;
    if (run_by_stack(m, st, x, L, calls_len[k], nullptr, got) != 3) {
      fail(isa, "stack: a layer did not run");
      return 0;
    }
    check_y("stack", got, kB, L, d, calls_len[k]);
    if (std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) != 0)
      fail(isa, "stack: output differs from the blocks' calls one after another");
    if (!same_states(st, ref)) fail(isa, "stack: states differ from the blocks' calls");
    f.floats(got);
  }
  for (const auto& s : st) {
    f.floats(s->a);
    f.floats(s->b);
  }
  const std::vector<float> x = tensor("stack.x3", kB * calls_L[3] * d, 1.0f);
  std::vector<float> got;
  copy_states(st, saved);
  eb::UndoLog undo;
  if (st[1]->lock.try_acquire() != eb::StateLock::kOk) fail(isa, "stack: lock not free");
  if (run_by_stack(m, st, x, calls_L[3], calls_len[3], &undo, got) != 1)
    fail(isa, "stack: did not stop before the layer whose state is in use");
  st[1]->lock.release();
  undo.rollback(0);
  if (!same_states(st, saved)) fail(isa, "stack: the undo log did not restore a stopped call");
  if (run_by_stack(m, st, x, calls_L[3], calls_len[3], &undo, got) != 3)
    fail(isa, "stack: a layer did not run");
  if (same_states(st, saved)) fail(isa, "stack: the fourth call wrote nothing");
  undo.rollback(0);
  if (!same_states(st, saved)) fail(isa, "stack: the undo log did not restore a whole call");
  return f.h;
}

}  // namespace digest
