// Lookup of the canonical weights handed over by the binding (names checked by Python; a
// missing required tensor here is an internal error, reported as ValueError). A weight is
// float32 data, or, for a projection matrix, GGUF blocks read straight from a file.
#pragma once
#include <string>
#include <unordered_map>
#include <utility>

#include "base/check.hpp"
#include "ops/gemm/format.hpp"

namespace eb {

struct WeightMap {
  WeightMap() = default;
  // float32 weights only (the C++ tests' and the pre-GGUF callers' form)
  WeightMap(std::unordered_map<std::string, const float*> weights)  // NOLINT: implicit on purpose
      : f32(std::move(weights)) {}
  std::unordered_map<std::string, const float*> f32;
  std::unordered_map<std::string, ops::MatrixSource> blocks;  // rows filled by need_matrix
};

inline const float* need_weight(const WeightMap& w, const std::string& k) {
  auto it = w.f32.find(k);
  EB_CHECK(it != w.f32.end(), "missing weight " + k);
  return it->second;
}

inline const float* maybe_weight(const WeightMap& w, const std::string& k) {
  auto it = w.f32.find(k);
  return it == w.f32.end() ? nullptr : it->second;
}

// A projection matrix of `rows` rows: its GGUF blocks when given so, else its float32 data.
inline ops::MatrixSource need_matrix(const WeightMap& w, const std::string& k, int64_t rows) {
  auto it = w.blocks.find(k);
  if (it != w.blocks.end()) {
    ops::MatrixSource s = it->second;
    s.rows = rows;
    return s;
  }
  ops::MatrixSource s;
  s.f32 = need_weight(w, k);
  s.rows = rows;
  return s;
}

}  // namespace eb
