// Lookup of the canonical weight pointers handed over by the binding (names checked by Python;
// a missing required tensor here is an internal error, reported as ValueError).
#pragma once
#include <string>
#include <unordered_map>

#include "base/check.hpp"

namespace eb {

using WeightMap = std::unordered_map<std::string, const float*>;

inline const float* need_weight(const WeightMap& w, const std::string& k) {
  auto it = w.find(k);
  EB_CHECK(it != w.end(), "missing weight " + k);
  return it->second;
}

inline const float* maybe_weight(const WeightMap& w, const std::string& k) {
  auto it = w.find(k);
  return it == w.end() ? nullptr : it->second;
}

}  // namespace eb
