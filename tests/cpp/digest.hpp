// The digest's shared parts (tests/cpp/digest_main.cpp): hashing, the deterministic weights,
// the failure record, and the cases of each file (digest_blocks.cpp: the two blocks;
// digest_stack.cpp: a model's layers through the stack runner; digest_kernels.cpp: kernels,
// GEMMs, elementwise sweeps and the plain twins).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "blocks/mamba2/model.hpp"
#include "blocks/transformer/model.hpp"

namespace digest {

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

std::string hex(uint64_t h);
// SplitMix64 finaliser: a fixed integer hash, the same on every machine.
uint64_t mix(uint64_t z);
// Uniform in [-1, 1) with 24 bits, exact in binary32: u = (k - 2^23) / 2^23.
float unit(uint64_t tensor, uint64_t i);
uint64_t name_id(const std::string& s);
// A tensor of n values: offset + scale * unit(name, i) (one rounding per value, no fma).
std::vector<float> tensor(const std::string& name, int64_t n, float scale, float offset = 0.0f);

using Weights = std::unordered_map<std::string, std::vector<float>>;
std::unordered_map<std::string, const float*> ptrs(const Weights& w);
float inv_sqrt(int64_t n);

// Records a failed self-check (the exit status becomes 1).
void fail(const std::string& isa, const std::string& what);
bool all_ok();
// Sanity of one call's y (batch, L, d): real tokens finite and not all zero, padding exactly +0.
void check_y(const std::string& what, const std::vector<float>& y, int64_t B, int64_t L, int64_t d,
             const int64_t* lengths);

// ---- digest_blocks.cpp
struct TfCase {
  std::string name;
  eb::blocks::TransformerConfig cfg;
  int rope_set = 0;  // longrope: the table of every call
};
std::vector<TfCase> transformer_cases();
Weights transformer_weights(const TfCase& tc);
uint64_t run_transformer(const TfCase& tc, const eb::blocks::TransformerModel& mdl, int n_threads);

struct MbCase {
  std::string name;
  eb::blocks::Mamba2Config cfg;
};
std::vector<MbCase> mamba2_cases();
Weights mamba2_weights(const MbCase& mc);
uint64_t run_mamba2(const MbCase& mc, const eb::blocks::Mamba2Model& mdl, int n_threads);
uint64_t run_mamba2_backward(const MbCase& mc, const eb::blocks::Mamba2Model& mdl, int n_threads);

// ---- digest_stack.cpp
uint64_t run_stack_case(const std::string& isa);

// ---- digest_kernels.cpp
uint64_t run_reductions();
uint64_t run_gemm(int n_threads);
uint64_t run_gemm_compact(int n_threads, const std::string& isa);
std::vector<float> sweep_inputs(bool quick);
uint64_t run_elementwise(const std::vector<float>& x, const std::string& isa);
uint64_t run_twins(const std::string& isa);

}  // namespace digest
