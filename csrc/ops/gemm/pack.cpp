// Packing of weight matrices into the GEMM's panel layout (format.hpp), with exact format
// detection: float32 rows through the fitting of pack_fit.cpp, GGUF blocks of a compact type
// straight into that format (pack_gguf.cpp decodes them), and a stack whose parts share no one
// format as consecutive runs of one format each (PackedMatrix::parts). Packing moves bytes only;
// it cannot change a bit of any weight: a compact format is chosen only when every weight
// rebuilt from it (with the kernels' own operation) has the original's bits, and otherwise the
// matrix keeps float32 panels.
#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "base/check.hpp"
#include "base/fpenv.hpp"
#include "ops/gemm/format.hpp"
#include "ops/gemm/pack_detail.hpp"

namespace eb::ops {
namespace {

using detail::direct_format;
using detail::gguf_block;
using detail::pack_compact;
using detail::Rows;

// A mixed stack (PackedMatrix::parts) of n parts with k_in inputs: each run of consecutive
// parts of one format_of(i) packed together by pack(i, j) (parts [i, j)).
template <class FormatOf, class Pack>
PackedMatrix pack_runs(size_t n, int64_t k_in, FormatOf format_of, Pack pack) {
  PackedMatrix pm;
  pm.k_in = k_in;
  for (size_t i = 0; i < n;) {
    size_t j = i + 1;
    while (j < n && format_of(j) == format_of(i)) ++j;
    pm.parts.push_back(pack(i, j));
    pm.n_out += pm.parts.back().n_out;
    i = j;
  }
  return pm;
}

// Elements [i, j) of v.
template <class T>
std::vector<T> slice(const std::vector<T>& v, size_t i, size_t j) {
  return std::vector<T>(v.begin() + static_cast<std::ptrdiff_t>(i),
                        v.begin() + static_cast<std::ptrdiff_t>(j));
}

}  // namespace

PackedMatrix pack_sources(const std::vector<MatrixSource>& parts, int64_t k_in,
                          const std::vector<const float*>& biases, bool allow_compact) {
  int fmt = -1;
  bool any_blocks = false;
  for (const MatrixSource& s : parts) {
    const int f = s.blocks ? direct_format(s.type) : kPanelF32;
    if (s.blocks) {
      any_blocks = true;
      EB_CHECK(f != kPanelF32 && k_in % ggml_block_size(s.type) == 0,
               "pack_sources: unsupported GGUF type or row length");
    }
    fmt = fmt == -1 || fmt == f ? f : kPanelF32;
  }
  const bool direct =
      any_blocks && allow_compact && fmt != kPanelF32 && k_in > 0 && k_in % kQBlock == 0;
  // Every part GGUF blocks of a compact type, but not all of one format (a Q4_K q|k with a
  // Q6_K v): each run of one format packed on its own, instead of a float32 copy of them all.
  bool mixed = !direct && allow_compact && parts.size() > 1 && k_in > 0 && k_in % kQBlock == 0;
  for (const MatrixSource& s : parts)
    mixed = mixed && s.blocks != nullptr && direct_format(s.type) != kPanelF32;
  if (mixed)
    return pack_runs(
        parts.size(), k_in, [&](size_t i) { return direct_format(parts[i].type); },
        [&](size_t i, size_t j) {
          return pack_sources(slice(parts, i, j), k_in, slice(biases, i, j), true);
        });
  if (!direct) {  // float32 (dequantised here where needed) through the detecting packer
    std::vector<std::vector<float>> owned;
    std::vector<const float*> ptrs;
    std::vector<int64_t> rows;
    for (const MatrixSource& s : parts) {
      rows.push_back(s.rows);
      if (s.blocks) {
        owned.emplace_back(static_cast<size_t>(s.rows * k_in));
        dequantize_gguf(s.blocks, s.type, s.rows * k_in, owned.back().data());
        ptrs.push_back(owned.back().data());
      } else {
        ptrs.push_back(s.f32);
      }
    }
    return pack_matrices(ptrs, rows, k_in, biases, allow_compact);
  }
  FpEnvGuard guard;
  PackedMatrix pm;
  pm.k_in = k_in;
  pm.format = fmt;
  for (const MatrixSource& s : parts) pm.n_out += s.rows;
  pm.n_panels = (pm.n_out + kGemmNR - 1) / kGemmNR;
  bool any_bias = false;
  for (const float* b : biases) any_bias = any_bias || b != nullptr;
  if (any_bias) {
    pm.bias.assign(static_cast<size_t>(pm.n_out), 0.0f);
    int64_t n = 0;
    for (size_t part = 0; part < parts.size(); ++part)
      for (int64_t r = 0; r < parts[part].rows; ++r, ++n)
        if (biases[part]) pm.bias[static_cast<size_t>(n)] = biases[part][r];
  }
  const int64_t nkb = pm.k_blocks();
  pm.data.assign(static_cast<size_t>(pm.n_panels * nkb * pm.scale_floats()), 0.0f);
  pm.codes.assign(static_cast<size_t>(pm.n_panels * nkb * pm.code_bytes()), 0);
  int64_t n = 0;
  int q[kQBlock];
  for (const MatrixSource& s : parts) {
    const int64_t row_bytes = k_in / ggml_block_size(s.type) * ggml_type_size(s.type);
    for (int64_t r = 0; r < s.rows; ++r, ++n) {
      const uint8_t* row = s.blocks + r * row_bytes;
      const int64_t p = n / kGemmNR, col = n % kGemmNR;
      for (int64_t b = 0; b < nkb; ++b) {
        float* sc = pm.data.data() + (p * nkb + b) * pm.scale_floats();
        uint8_t* cb = pm.codes.data() + (p * nkb + b) * pm.code_bytes();
        float d[2], m = 0.0f;
        gguf_block(row, s.type, b, d, &m, q);
        sc[col] = d[0];
        if (fmt == kPanelQ4) {
          sc[kGemmNR + col] = m;
          for (int i = 0; i < kQBlock / 2; ++i)
            cb[i * kGemmNR + col] = static_cast<uint8_t>(q[2 * i] | (q[2 * i + 1] << 4));
        } else if (fmt == kPanelQ5) {
          sc[kGemmNR + col] = m;
          for (int i = 0; i < kQBlock; ++i) cb[i * kGemmNR + col] = static_cast<uint8_t>(q[i]);
        } else {
          if (fmt == kPanelQ6) sc[kGemmNR + col] = d[1];
          for (int i = 0; i < kQBlock; ++i)
            cb[i * kGemmNR + col] = static_cast<uint8_t>(static_cast<int8_t>(q[i]));
        }
      }
    }
  }
  return pm;
}

PackedMatrix pack_matrices(const std::vector<const float*>& parts, const std::vector<int64_t>& rows,
                           int64_t k_in, const std::vector<const float*>& biases,
                           bool allow_compact) {
  FpEnvGuard guard;  // the format checks must see the kernels' FP mode, not the caller's
  PackedMatrix pm;
  pm.k_in = k_in;
  Rows all;
  for (size_t part = 0; part < parts.size(); ++part)
    for (int64_t r = 0; r < rows[part]; ++r) all.ptr.push_back(parts[part] + r * k_in);
  pm.n_out = static_cast<int64_t>(all.ptr.size());
  pm.n_panels = (pm.n_out + kGemmNR - 1) / kGemmNR;
  bool any_bias = false;
  for (const float* b : biases) any_bias = any_bias || b != nullptr;
  if (any_bias) {
    pm.bias.assign(static_cast<size_t>(pm.n_out), 0.0f);
    int64_t n = 0;
    for (size_t part = 0; part < parts.size(); ++part)
      for (int64_t r = 0; r < rows[part]; ++r, ++n)
        if (biases[part]) pm.bias[static_cast<size_t>(n)] = biases[part][r];
  }
  if (allow_compact && k_in > 0 && k_in % kQBlock == 0 && pm.n_out > 0) {
    // smallest first: 0.75, 1.125, 1.25, 1.25 and 2 bytes per weight
    for (int format : {kPanelQ4, kPanelQ8, kPanelQ5, kPanelQ6, kPanelBF16})
      if (pack_compact(pm, all, format)) return pm;
    pm.codes = AlignedVector<uint8_t>();
    // No one format holds the whole stack (a q|k|v rebuilt from GGUF types that share none,
    // by a pickle or set_params): each part searched on its own and consecutive parts of one
    // format packed together, as pack_sources keeps such blocks, when any part is compact.
    if (parts.size() > 1) {
      std::vector<PackedMatrix> each;
      bool any_compact = false;
      for (size_t i = 0; i < parts.size(); ++i) {
        each.push_back(pack_matrices({parts[i]}, {rows[i]}, k_in, {biases[i]}, true));
        any_compact = any_compact || each.back().format != kPanelF32;
      }
      if (any_compact)
        return pack_runs(
            parts.size(), k_in, [&](size_t i) { return each[i].format; },
            [&](size_t i, size_t j) {
              return j == i + 1 ? std::move(each[i])
                                : pack_matrices(slice(parts, i, j), slice(rows, i, j), k_in,
                                                slice(biases, i, j), true);
            });
    }
  }
  pm.format = kPanelF32;
  pm.data.assign(static_cast<size_t>(pm.n_panels * k_in * kGemmNR), 0.0f);
  for (int64_t n = 0; n < pm.n_out; ++n) {
    const float* src = all.row(n);
    float* dst = pm.data.data() + (n / kGemmNR) * k_in * kGemmNR + (n % kGemmNR);
    for (int64_t k = 0; k < k_in; ++k) dst[k * kGemmNR] = src[k];
  }
  return pm;
}

}  // namespace eb::ops
