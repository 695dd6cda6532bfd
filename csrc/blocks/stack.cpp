// The stack runner (stack.hpp).
#include "blocks/stack.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <new>

#include "blocks/transformer/config.hpp"

namespace eb::blocks {
namespace {

double matrix_flops(const ops::PackedMatrix& w, double tokens) {
  return 2.0 * tokens * static_cast<double>(w.n_out) * static_cast<double>(w.k_in);
}

// Whether [a, a + na) and [b, b + nb) (bytes) share memory.
bool overlap(const void* a, size_t na, const void* b, size_t nb) {
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return na > 0 && nb > 0 && pa < pb + nb && pb < pa + na;
}

bool same_shape(const std::vector<int64_t>& got, std::initializer_list<int64_t> want) {
  return got.size() == want.size() && std::equal(got.begin(), got.end(), want.begin());
}

size_t float_bytes(const std::vector<int64_t>& shape) {
  size_t n = sizeof(float);
  for (int64_t s : shape) n *= static_cast<size_t>(s);
  return n;
}

// The buffers aligned and sharing no memory (a, b and row_tokens pairwise).
bool apart(const StackBuffers& buf) {
  const size_t a_bytes = float_bytes(buf.a_shape), b_bytes = float_bytes(buf.b_shape),
               rt_bytes = static_cast<size_t>(buf.n_rows) * sizeof(int64_t);
  return reinterpret_cast<uintptr_t>(buf.a) % alignof(float) == 0 &&
         reinterpret_cast<uintptr_t>(buf.b) % alignof(float) == 0 &&
         reinterpret_cast<uintptr_t>(buf.row_tokens) % alignof(int64_t) == 0 &&
         !overlap(buf.a, a_bytes, buf.b, b_bytes) &&
         !overlap(buf.a, a_bytes, buf.row_tokens, rt_bytes) &&
         !overlap(buf.b, b_bytes, buf.row_tokens, rt_bytes);
}

// Frees a layer's lock when its call leaves, however it leaves.
struct ReleaseOnExit {
  StateLock* lock;
  ~ReleaseOnExit() { lock->release(); }
};

}  // namespace

double transformer_flops(const TransformerModel& m, const int64_t* lengths, const int64_t* start,
                         int64_t batch) {
  const TransformerConfig& c = m.cfg;
  double f = 0.0;
  for (int64_t b = 0; b < batch; ++b) {
    const double len = static_cast<double>(lengths[b]);
    double keys = static_cast<double>(start[b]) + 0.5 * len;  // per query, on average
    if (c.window > 0) keys = std::min(keys, static_cast<double>(c.window));
    f += matrix_flops(m.w_qkv, len) + matrix_flops(m.w_o, len) + matrix_flops(m.w_gu, len) +
         matrix_flops(m.w_down, len);
    if (has_attention(c)) f += 4.0 * len * keys * static_cast<double>(c.n_heads * c.head_dim);
  }
  return f;
}

double mamba2_flops(const Mamba2Model& m, double tokens) {
  const Mamba2Config& c = m.cfg;
  return matrix_flops(m.w_in, tokens) + matrix_flops(m.w_out, tokens) +
         6.0 * tokens * static_cast<double>(c.n_heads * c.head_dim * c.d_state);
}

bool fit_transformer_layer(const TransformerModel& core, StateLock* lock, const StackBuffers& buf,
                           int64_t batch, int64_t d_model, StackLayer& out) {
  const TransformerConfig& c = core.cfg;
  if (lock == nullptr || c.d_model != d_model || buf.n_rows != batch) return false;
  if (!(buf.rope_set == 0 || (buf.rope_set == 1 && c.rope_scaling == ops::kRopeLongrope)))
    return false;
  const std::initializer_list<int64_t> kv = {batch, buf.n_kv_heads, buf.capacity, buf.head_dim};
  if (!same_shape(buf.a_shape, kv) || !same_shape(buf.b_shape, kv) || !apart(buf)) return false;
  const bool attn = has_attention(c);
  if (attn && (buf.n_kv_heads != c.n_kv_heads || buf.head_dim != c.head_dim || buf.capacity <= 0))
    return false;
  out = StackLayer{};
  out.core = &core;
  out.lock = lock;
  out.k = buf.a;
  out.v = buf.b;
  out.capacity = buf.capacity;
  out.row_tokens = buf.row_tokens;
  out.max_tokens = buf.max_tokens;
  out.rope_set = buf.rope_set;
  out.attn = attn;
  return true;
}

bool fit_mamba2_layer(const Mamba2Model& core, StateLock* lock, const StackBuffers& buf,
                      int64_t batch, int64_t d_model, StackLayer& out) {
  const Mamba2Config& c = core.cfg;
  if (lock == nullptr || c.d_model != d_model || buf.n_rows != batch) return false;
  if (!same_shape(buf.a_shape, {batch, c.conv_dim, c.conv_kernel}) ||
      !same_shape(buf.b_shape, {batch, c.n_heads, c.head_dim, c.d_state}) || !apart(buf))
    return false;
  out = StackLayer{};
  out.mamba = &core;
  out.lock = lock;
  out.k = buf.a;
  out.v = buf.b;
  out.row_tokens = buf.row_tokens;
  return true;
}

bool real_rows_finite(const float* x, int64_t batch, int64_t n_tokens, int64_t d,
                      const int64_t* lengths) {
  for (int64_t b = 0; b < batch; ++b) {
    const uint32_t* p = reinterpret_cast<const uint32_t*>(x + b * n_tokens * d);
    const int64_t n = lengths[b] * d;
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; ++i)
      bad |= static_cast<uint32_t>((p[i] & 0x7f800000u) == 0x7f800000u);
    if (bad) return false;
  }
  return true;
}

bool stack_counters(StackLayer& ly, int64_t batch, int64_t n_tokens, const int64_t* lengths) {
  ly.start.assign(ly.row_tokens, ly.row_tokens + batch);
  if (ly.mamba != nullptr) {  // a Mamba-2 layer: counters >= 0, room in int64
    for (int64_t b = 0; b < batch; ++b)
      if (ly.start[b] < 0 || lengths[b] < 0 || lengths[b] > n_tokens ||
          (lengths[b] > 0 && ly.start[b] > std::numeric_limits<int64_t>::max() - lengths[b]))
        return false;
    return true;
  }
  const int64_t limit =
      ly.attn ? std::min<int64_t>(ly.max_tokens, ly.core->cfg.max_positions) : ly.max_tokens;
  for (int64_t b = 0; b < batch; ++b)
    if (ly.start[b] < 0 || ly.start[b] > ly.max_tokens || lengths[b] < 0 || lengths[b] > n_tokens ||
        ly.start[b] + lengths[b] > limit)
      return false;
  return true;
}

bool run_stack_layer(const StackCall& call, const StackKernels& kernels, StackLayer& ly,
                     const float* in, float* out, UndoLog* saving) {
  const int64_t B = call.batch, L = call.n_tokens, d = call.d_model;
  const int64_t* lens = call.lengths;
  if (!real_rows_finite(in, B, L, d, lens)) return false;
  if (ly.lock->try_acquire() != StateLock::kOk) return false;
  const ReleaseOnExit release{ly.lock};
  if (!stack_counters(ly, B, L, lens)) return false;
  std::memset(out, 0, static_cast<size_t>(B * L * d) * sizeof(float));
  int bad = 0;
  int* check = call.check_cache ? &bad : nullptr;
  const size_t mark = saving != nullptr ? saving->size() : 0;
  try {
    if (call.undo != nullptr) call.undo->add_saved(ly.row_tokens, static_cast<size_t>(B));
    if (ly.mamba != nullptr) {  // as the Mamba-2 block's forward
      const Mamba2Call mc{in, out, B, L, lens, ly.k, ly.v, call.n_threads, call.ws, check, saving};
      kernels.mamba2_forward(*ly.mamba, mc);
    } else {
      const TransformerCall tc{in,
                               out,
                               B,
                               L,
                               lens,
                               ly.start.data(),
                               ly.k,
                               ly.v,
                               ly.attn ? ly.capacity : 0,
                               call.n_threads,
                               call.ws,
                               ly.attn ? check : nullptr,
                               ly.rope_set,
                               call.undo};
      kernels.transformer_forward(*ly.core, tc);
    }
  } catch (const std::bad_alloc&) {
    if (saving != nullptr) saving->rollback(mark);
    return false;  // the block's own call retries it (and names the memory if it fails)
  }
  if (bad) return false;  // nothing written: the block's call names the value
  for (int64_t b = 0; b < B; ++b) ly.row_tokens[b] = ly.start[b] + lens[b];
  return true;
}

size_t run_stack(const StackCall& call, const StackKernels& kernels,
                 std::vector<StackLayer>& layers, const LayerRunner& runner) {
  size_t done = 0;
  const float* in = call.x;
  for (size_t i = 0; i < layers.size(); ++i) {
    StackLayer& ly = layers[i];
    float* out = (i % 2 == 0) ? call.y_a : call.y_b;
    const bool ran = runner(
        ly, [&](UndoLog* saving) { return run_stack_layer(call, kernels, ly, in, out, saving); });
    if (!ran) break;
    in = out;
    ++done;
  }
  return done;
}

}  // namespace eb::blocks
