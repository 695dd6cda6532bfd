// Plain references ("naive twins") of the fast kernels: attention, softmax, conv1d, the SSM
// scan, RoPE and the MLP combine. Each is a simple scalar loop over the documented op order
// (SPEC 3.3, 3.4, 4.3, 4.4, 7.3), written from the contract and not from the fast kernel's
// structure, and compiled once with the baseline flags (not per ISA). tests/unit/test_twins.py
// and tests/cpp/digest_main.cpp compare every ISA's kernel with them bit for bit. Not used by
// the blocks. The GEMM's twin is ops/gemm/ref.hpp.
#pragma once
#include <cstdint>

namespace eb::ops::ref {

// L16 (SPEC 3.3): 16 lanes s_0..s_15 = +0.0, s_(i mod 16) = fma(a_i, b_i, s_(i mod 16)) for
// i = 0..n-1 in order, then s_j = s_j + s_(j+w) for w = 8, 4, 2, 1; the result is s_0.
// No padding: lane j takes only its own terms. Twins of dot_l16<V> / sum_l16<V>.
float dot_l16_ref(const float* a, const float* b, int64_t n);
float sum_l16_ref(const float* a, int64_t n);  // s_(i mod 16) = s_(i mod 16) + a_i

// Softmax of n raw scores, in place (SPEC 4.3 step 6): s_j = raw_j * scale [softcap > 0:
// s_j = tanh(s_j / cap) * cap], m = max_j s_j, e_j = exp(s_j - m), Z = L16(e), p_j = e_j / Z.
// Twin of softmax_scores<V>.
void softmax_ref(float* s, int64_t n, float scale, float softcap);

// One query head at position p over keys j = j0..p (SPEC 4.3 step 6, 3.3):
//   raw_j = L16_d(q[d] * k_j[d]), softmax_ref, o[d] = SEQ_j fma(p_j, v_j[d], o[d]) from +0.0.
// k, v: key / value of position j at k + j * ld, v + j * ld (head_dim floats each).
// probs: p - j0 + 1 floats (the probabilities p_j), o: head_dim floats.
// Twin of attention_heads<V, R> (every R) and attention_prefill_block<V> (each query, head).
void attention_ref(const float* q, const float* k, const float* v, int64_t ld, int64_t head_dim,
                   int64_t j0, int64_t p, float scale, float softcap, float* probs, float* o);

// Depthwise causal conv, one token, nc channels (SPEC 7.3 step 3):
//   out[ch] = SEQ_k=0..K-1 fma(w[k][ch], u_k[ch]) from +0.0, then + bias[ch] (bias may be null).
// w: (K, ld) tap-major; u: (K, ld), u_0 the oldest input, u_(K-1) the current token.
// Twin of conv1d_token<V>.
void conv1d_ref(const float* w, const float* u, int64_t ld, int64_t nc, int64_t k_taps,
                const float* bias, float* out);

// One token of the Mamba-2 recurrence for one head (SPEC 7.3 step 6):
//   dA = exp(dt * a); h[p][n] = fma(h[p][n], dA, (dt * b[n]) * x[p]);
//   y[p] = L16_n(h[p][n] * c[n]) + x[p] * d.
// h: (head_dim, d_state) row-major, updated in place; x, y: head_dim; b, c: d_state.
// Twin of ssm_scan_step<V>; T calls are the twin of ssm_scan_tokens<V>.
void ssm_scan_step_ref(float* h, int64_t head_dim, int64_t d_state, float dt, float a, float d,
                       const float* x, const float* b, const float* c, float* y);

// RoPE, rotate_half layout, in place on the first rope_dim floats of v (SPEC 4.4):
//   angle_i = float32(pos) * inv_freq[i], c = cos(angle_i), s = sin(angle_i);
//   v[i], v[i + half] = a * c - b * s, b * c + a * s   (a = v[i], b = v[i + half], unfused).
// Twin of rope_cos_sin + rope_apply.
void rope_ref(float* v, int64_t rope_dim, int64_t pos, const float* inv_freq);

// MLP combine (SPEC 4.3 step 9, 3.4), kind an ops::MlpKind:
//   gated (swiglu, geglu, geglu_tanh)  u[i] = act(gu[i]) * gu[it + i]   gu: 2 * it floats
//   ungated (gelu, gelu_tanh)          u[i] = act(gu[i])                 gu: it floats
// act = silu, gelu (erf) or gelu_tanh of math/derived.hpp. Twin of mlp_combine<V>.
void mlp_combine_ref(int kind, const float* gu, int64_t it, float* u);

}  // namespace eb::ops::ref
