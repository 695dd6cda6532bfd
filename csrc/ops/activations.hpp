// MLP activations and GLU combinations (SPEC 3.4 op orders, math/derived.hpp):
//   gated   u = act(g) * up     act in {silu, gelu (erf), gelu_tanh}   HF LlamaMLP / GemmaMLP
//   ungated u = act(up)                                               HF Starcoder2MLP
//   relu2   u = r * r, r = relu(up) (r = 0 for up < 0)                HF NemotronHMLP
//           (mlp_hidden_act 'relu2': ReLUSquaredActivation, relu then square)
// Elementwise, so any vectorisation or split gives the same bits. Reference twin: itself.
#pragma once
#include <cstdint>

#include "math/derived.hpp"

namespace eb::ops {

enum MlpKind : int {
  kSwiGlu = 0,
  kGeGlu = 1,
  kGeGluTanh = 2,
  kGelu = 3,
  kGeluTanh = 4,
  kRelu2 = 5
};

inline bool mlp_is_gated(int kind) { return kind <= kGeGluTanh; }

inline float mlp_act(int kind, float v) {
  switch (kind) {
    case kSwiGlu: return math::silu_f32(v);
    case kGeGlu:
    case kGelu: return math::gelu_f32(v);
    case kRelu2: {
      const float r = v < 0.0f ? 0.0f : v;
      return r * r;
    }
    default: return math::gelu_tanh_f32(v);
  }
}

// gated: gu rows hold [g (it) | up (it)]; ungated: [up (it)]. u (it) = the MLP hidden.
// SwiGLU runs silu(g) = g / (1 + exp(-g)) with the vectorised exp (same bits as exp_f32).
template <class V>
inline void mlp_combine(int kind, const float* gu, int64_t it, float* u) {
  if (kind == kSwiGlu) {
    for (int64_t i = 0; i < it; ++i) u[i] = -gu[i];
    V::exp_array(u, u, it);
    for (int64_t i = 0; i < it; ++i) u[i] = (gu[i] / (1.0f + u[i])) * gu[it + i];
  } else if (mlp_is_gated(kind)) {
    for (int64_t i = 0; i < it; ++i) u[i] = mlp_act(kind, gu[i]) * gu[it + i];
  } else {
    for (int64_t i = 0; i < it; ++i) u[i] = mlp_act(kind, gu[i]);
  }
}

}  // namespace eb::ops
