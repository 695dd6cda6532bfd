// The shared pieces of a block call's binding (call.hpp), and the matrix sources and unpacking
// declared in common.hpp.
#include "bindings/call.hpp"

#include <nanobind/stl/string.h>

#include <string>

#include "base/check.hpp"

namespace eb::bindings {

OutArr new_output(int64_t B, int64_t L, int64_t d) {
  try {
    return new_array({static_cast<size_t>(B), static_cast<size_t>(L), static_cast<size_t>(d)});
  } catch (const std::bad_alloc&) {
    throw CallAllocError("cannot allocate the output of shape (" + std::to_string(B) + ", " +
                         std::to_string(L) + ", " + std::to_string(d) + ") float32 (" +
                         std::to_string(B * L * d * 4) + " bytes)");
  }
}

WeightMap weight_map(const nb::dict& weights, const nb::dict& blocks, std::vector<CArr>& keep,
                     std::vector<nb::object>& keep_blocks) {
  WeightMap out;
  for (auto [k, v] : weights) {
    keep.push_back(nb::cast<CArr>(v, false));
    out.f32[nb::cast<std::string>(k)] = keep.back().data();
  }
  for (auto [k, v] : blocks) out.blocks[nb::cast<std::string>(k)] = matrix_source(v, keep_blocks);
  return out;
}

void commit_counters(IOut* row_tokens, const IArr& start, const IArr& lengths, int64_t B) {
  if (row_tokens == nullptr) return;
  for (int64_t b = 0; b < B; ++b) row_tokens->data()[b] = start.data()[b] + lengths.data()[b];
}

int64_t total_tokens(const IArr& lengths) {
  int64_t m = 0;
  for (size_t b = 0; b < lengths.shape(0); ++b) m += lengths.data()[b];
  return m;
}

void check_rows(const IArr& a, int64_t batch, const char* name) {
  EB_CHECK(static_cast<int64_t>(a.shape(0)) == batch,
           std::string(name) + " must have batch entries");
}

nb::list storage_list(
    std::initializer_list<std::pair<const char*, const ops::PackedMatrix*>> items) {
  nb::list out;
  for (const auto& [name, pm] : items) {
    if (pm->parts.empty()) {
      out.append(nb::make_tuple(std::string(name), std::string(pm->format_name()), pm->bytes()));
      continue;
    }
    for (const ops::PackedMatrix& part : pm->parts)  // a mixed stack: one entry per part
      out.append(nb::make_tuple(std::string(name), std::string(part.format_name()), part.bytes()));
  }
  return out;
}

OutArr unpack_array(const ops::PackedMatrix& w, int64_t r0, int64_t r1) {
  EB_CHECK(0 <= r0 && r0 <= r1 && r1 <= w.n_out, "unpack: rows out of range");
  OutArr y = new_array({static_cast<size_t>(r1 - r0), static_cast<size_t>(w.k_in)});
  nb::gil_scoped_release release;
  ops::unpack_rows(w, r0, r1, y.data());
  return y;
}

ops::MatrixSource matrix_source(const nb::handle& value, std::vector<nb::object>& keep) {
  ops::MatrixSource s;
  if (nb::isinstance<nb::tuple>(value)) {
    nb::tuple t = nb::cast<nb::tuple>(value);
    EB_CHECK(t.size() == 2, "GGUF blocks must be given as (ggml type, uint8 array)");
    s.type = nb::cast<int>(t[0]);
    EB_CHECK(ops::ggml_block_size(s.type) > 0, "unsupported GGUF block type");
    keep.push_back(nb::borrow(t[1]));
    s.blocks = nb::cast<U8Arr>(t[1], false).data();
  } else {
    keep.push_back(nb::borrow(value));
    s.f32 = nb::cast<CArr>(value, false).data();
  }
  return s;
}

ops::MatrixSource matrix_source(const nb::handle& value, std::vector<nb::object>& keep,
                                int64_t rows, int64_t k_in, const std::string& what) {
  ops::MatrixSource s = matrix_source(value, keep);
  if (s.f32 != nullptr) {
    const CArr w = nb::cast<CArr>(value, false);
    EB_CHECK(w.ndim() == 2 && static_cast<int64_t>(w.shape(0)) == rows &&
                 static_cast<int64_t>(w.shape(1)) == k_in,
             what + ": float32 weights are not (" + std::to_string(rows) + ", " +
                 std::to_string(k_in) + ")");
  } else {
    const int64_t bs = ops::ggml_block_size(s.type);
    const U8Arr raw = nb::cast<U8Arr>(nb::cast<nb::tuple>(value)[1], false);
    EB_CHECK(
        bs > 0 && k_in % bs == 0 &&
            static_cast<int64_t>(raw.size()) == rows * (k_in / bs) * ops::ggml_type_size(s.type) &&
            (raw.ndim() != 2 || static_cast<int64_t>(raw.shape(0)) == rows),
        what + ": GGUF blocks do not fit (" + std::to_string(rows) + ", " + std::to_string(k_in) +
            ")");
  }
  s.rows = rows;
  return s;
}

}  // namespace eb::bindings
