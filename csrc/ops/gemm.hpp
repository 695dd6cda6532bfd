// Packed GEMM (prefill) and GEMV (decode, M = 1..16) with ONE arithmetic (SPEC 3.3 SEQ,
// STYLE 5.3): c[m][n] = (fma chain over k = 0..K-1 of a[m][k] * w[n][k], from +0.0) + bias[n].
// Weights are packed once into panels of kGemmNR output features, k-major; the microkernel
// vectorises across the panel's outputs and runs k in order, so every output is the same
// in-order FMA chain whatever MR, M, the tile-mates, the ISA or the thread split.
// K is never split across threads. Reference twin: gemm_ref (a triple loop with std::fma).
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/aligned.hpp"
#include "threading/parallel.hpp"

namespace eb::ops {

constexpr int kGemmNR = 48;

// How a packed matrix holds its weights. Every format is lossless: the packer picks a compact
// one only when it rebuilds every weight bit for bit (ops/gemm_pack.cpp), and the kernels
// rebuild each weight with that same exact operation before its FMA, so the GEMM's arithmetic
// (and every output bit) is the same whatever the format. Compact formats cut the bytes a
// decode step streams: weights dequantised from GGUF blocks are exactly such values.
//   kPanelF32: panels (k_in, kGemmNR) of float.
//   kPanelQ8:  per block of kQBlock k's and output n: w = d * q, q int8 (GGUF Q8_0's values;
//              Q4_0's and Q5_0's too); the packer checks that the kernels' float32 product
//              of d and the stored code gives every weight's bits.
//   kPanelQ4:  per block: w = fma(d, q, m), q in 0..15 (GGUF Q4_1's values: d*q + m, where
//              d*q is exact, so fma and mul-then-add agree; the packer checks every weight).
//   kPanelBF16: w's top 16 bits (weights whose low 16 bits are zero: bfloat16 checkpoints).
enum PanelFormat : int { kPanelF32 = 0, kPanelQ8 = 1, kPanelQ4 = 2, kPanelBF16 = 3 };
constexpr int64_t kQBlock = 32;

// W (n_out, k_in) row-major (torch [out, in]) packed into ceil(n_out / kGemmNR) panels of
// kGemmNR output features, zero past n_out. Bias optional (empty when absent).
// F32: data holds each panel as (k_in, kGemmNR) floats. Q8/Q4: per (panel, k block) in panel
// order, data holds d[kGemmNR] (Q4: then m[kGemmNR]) and codes the block's codes, k-major:
// Q8 kQBlock rows of kGemmNR int8; Q4 kQBlock/2 rows of kGemmNR bytes, byte (i, n) = code of
// k = 2i in the low nibble, of k = 2i+1 in the high nibble. BF16: no scales; codes hold
// kQBlock rows of kGemmNR uint16 per block, so a panel's rows are contiguous and k-major.
// Compact formats need k_in % kQBlock == 0.
struct PackedMatrix {
  int64_t n_out = 0, k_in = 0, n_panels = 0;
  int format = kPanelF32;
  AlignedVector<float> data;  // 64-byte aligned: panel rows are 3 whole cache lines
  AlignedVector<uint8_t> codes;
  std::vector<float> bias;
  bool has_bias() const { return !bias.empty(); }
  int64_t k_blocks() const { return k_in / kQBlock; }
  int64_t scale_floats() const { return scale_floats_of(format); }  // per block
  int64_t code_bytes() const { return code_bytes_of(format); }
  static constexpr int64_t scale_floats_of(int f) {
    return f == kPanelQ4 ? 2 * kGemmNR : (f == kPanelQ8 ? kGemmNR : 0);
  }
  static constexpr int64_t code_bytes_of(int f) {
    return f == kPanelQ4 ? kQBlock / 2 * kGemmNR : kQBlock * kGemmNR * code_col_bytes_of(f);
  }
  // Bytes per output column in one code row (the offset of a tile's first column).
  static constexpr int64_t code_col_bytes_of(int f) { return f == kPanelBF16 ? 2 : 1; }
  const char* format_name() const {
    return format == kPanelQ4
               ? "q4_1"
               : (format == kPanelQ8 ? "q8_0" : (format == kPanelBF16 ? "bf16" : "float32"));
  }
  int64_t bytes() const {
    return static_cast<int64_t>(data.size() * sizeof(float) + codes.size() +
                                bias.size() * sizeof(float));
  }
};

// Stack several (n_i, k_in) row-major matrices vertically and pack them: the fused q|k|v and
// gate|up projections. Concatenation changes no output's FMA chain. allow_compact = false
// keeps float32 panels (tests compare the two).
PackedMatrix pack_matrices(const std::vector<const float*>& parts, const std::vector<int64_t>& rows,
                           int64_t k_in, const std::vector<const float*>& biases,
                           bool allow_compact = true);

// Whether pack_matrices may choose a compact format (default on). Off packs float32 panels
// only: the tests build the same block both ways and compare every output bit.
void set_compact_packing(bool on);
bool compact_packing();

// This OS thread's buffer of kGemmKC x kGemmNR floats (64-byte aligned, kept for the thread's
// life) for compact K blocks rebuilt as float32 panel rows. Defined out of line, in the
// baseline object, so no ISA object emits (and shares) its allocator code.
float* gemm_rebuild_buffer();

// Scalar reference: c (m, ldc) = a (m, lda) * W^T + bias.
void gemm_ref(const float* a, int64_t m, int64_t lda, const float* w, int64_t n_out, int64_t k_in,
              const float* bias, float* c, int64_t ldc);

// A tile covers kCols = kNV vectors of a panel's columns and kMR rows: AVX-512 8 x 48
// (24 accumulators), AVX2 4 x 24 (12; two tiles per panel), scalar 2 x 48.
template <class V>
struct GemmTraits {
  static constexpr int kNV = V::kLanes >= 8 ? 3 : 48;
  static constexpr int kCols = kNV * V::kLanes;
  static constexpr int kMR = V::kLanes >= 16 ? 8 : (V::kLanes >= 8 ? 4 : 2);
};

// K is cache-blocked: a kGemmKC x kGemmNR slice of the panel (384 KB) stays in L2 while it
// is used for every row block (measured: smaller blocks that fit L1 were slower here, since
// they reload the partial sums more often). The blocks of one output run in increasing k and
// each continues from the partial sums (stored to c as float and reloaded: exact), so the FMA
// chain is the same single chain over k = 0..K-1 as without blocking.
constexpr int64_t kGemmKC = 2048;
static_assert(kGemmKC % kQBlock == 0, "K blocks hold whole quantisation blocks");

// The accumulators of an MR x kCols tile: start from +0.0 (first) or the partial sums in c;
// finish by storing nr_valid (<= kCols) columns, adding the bias on the last K block.
template <class V, int MR>
inline void tile_begin(V (&acc)[MR][GemmTraits<V>::kNV], bool first, const float* c, int64_t ldc,
                       int nr_valid) {
  constexpr int NV = GemmTraits<V>::kNV;
  constexpr int NC = GemmTraits<V>::kCols;
  if (first) {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = V::zero();
  } else if (nr_valid == NC) {  // full tile: partial sums straight from c
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = V::load(c + r * ldc + j * V::kLanes);
  } else {
    for (int r = 0; r < MR; ++r) {
      float tmp[NC] = {0};
      for (int j = 0; j < nr_valid; ++j) tmp[j] = c[r * ldc + j];
      for (int j = 0; j < NV; ++j) acc[r][j] = V::load(tmp + j * V::kLanes);
    }
  }
}

template <class V, int MR>
inline void tile_end(V (&acc)[MR][GemmTraits<V>::kNV], bool last, const float* bias, float* c,
                     int64_t ldc, int nr_valid) {
  constexpr int NV = GemmTraits<V>::kNV;
  constexpr int NC = GemmTraits<V>::kCols;
  if (nr_valid == NC) {  // full tile: store (with the bias added last) straight to c
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NV; ++j) {
        V out = acc[r][j];
        if (last && bias) out = V::add(out, V::load(bias + j * V::kLanes));
        out.store(c + r * ldc + j * V::kLanes);
      }
    return;
  }
  for (int r = 0; r < MR; ++r) {
    float tmp[NC];
    for (int j = 0; j < NV; ++j) acc[r][j].store(tmp + j * V::kLanes);
    float* c_r = c + r * ldc;
    if (last && bias) {
      for (int j = 0; j < nr_valid; ++j) c_r[j] = tmp[j] + bias[j];
    } else {
      for (int j = 0; j < nr_valid; ++j) c_r[j] = tmp[j];
    }
  }
}

// acc[r] += a[r][k] * b (all columns of the tile), one FMA per lane, for one k.
template <class V, int MR>
inline void tile_fma_k(V (&acc)[MR][GemmTraits<V>::kNV], const float* a, int64_t lda, int64_t k,
                       const V* b_k) {
  constexpr int NV = GemmTraits<V>::kNV;
  for (int r = 0; r < MR; ++r) {
    const V a_rk = V::set1(a[r * lda + k]);
    for (int j = 0; j < NV; ++j) acc[r][j] = V::fma(a_rk, b_k[j], acc[r][j]);
  }
}

// One MR x kCols tile over kn = k1 - k0 values of k (a and panel point at k0; panel rows are
// kGemmNR floats apart, panel at the tile's first column).
template <class V, int MR>
inline void gemm_tile(const float* a, int64_t lda, const float* panel, int64_t kn, bool first,
                      bool last, const float* bias, float* c, int64_t ldc, int nr_valid) {
  constexpr int NV = GemmTraits<V>::kNV;
  constexpr int NC = GemmTraits<V>::kCols;
  V acc[MR][NV];
  tile_begin<V, MR>(acc, first, c, ldc, nr_valid);
  for (int64_t k = 0; k < kn; ++k) {
    {  // fetch the panel ahead: decode streams it from memory (harmless when it is cached)
      for (int j = 0; j < NC * 4; j += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(panel + (k + 16) * kGemmNR) + j);
    }
    V b_k[NV];
    for (int j = 0; j < NV; ++j) b_k[j] = V::load(panel + k * kGemmNR + j * V::kLanes);
    tile_fma_k<V, MR>(acc, a, lda, k, b_k);
  }
  tile_end<V, MR>(acc, last, bias, c, ldc, nr_valid);
}

// Fetch code bytes [p, p + Bytes) ahead of use, one code row per row used, kPfBlocks blocks
// ahead (decode streams them from memory; a burst of a whole block at once was slower).
constexpr int64_t kPfBlocks = 2;
template <int64_t Bytes>
inline void prefetch_row(const uint8_t* p) {
  static_assert(Bytes <= 128, "a code row spans at most 2 lines");
  __builtin_prefetch(p);  // straight-line: a prefetch loop here made GCC keep the
  if constexpr (Bytes > 64) __builtin_prefetch(p + 64);  // accumulators on the stack
}

// The same tile on compact weights, rebuilding each weight just before its FMAs (decode: the
// codes are streamed once and never written out). a points at k0; scales and codes at the
// first of nb = (k1 - k0) / kQBlock blocks, at the tile's first column.
template <class V, int MR, int FMT>
inline void gemm_tile_q(const float* a, int64_t lda, const float* scales, const uint8_t* codes,
                        int64_t nb, bool first, bool last, const float* bias, float* c, int64_t ldc,
                        int nr_valid) {
  constexpr int NV = GemmTraits<V>::kNV;
  constexpr int L = V::kLanes;
  constexpr int64_t kScale = PackedMatrix::scale_floats_of(FMT);
  constexpr int64_t kCodes = PackedMatrix::code_bytes_of(FMT);
  constexpr int64_t kRowBytes = kGemmNR;  // one code row
  static_assert(FMT == kPanelQ4 || FMT == kPanelQ8, "bfloat16 panels run gemm_tile_bf16");
  V acc[MR][NV];
  tile_begin<V, MR>(acc, first, c, ldc, nr_valid);
  for (int64_t b = 0; b < nb; ++b) {
    const float* sc = scales + b * kScale;
    const uint8_t* cb = codes + b * kCodes;
    for (int64_t j = 0; j < kScale * 4; j += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(sc + kPfBlocks * kScale) + j);
    const float* ab = a + b * kQBlock;
    // Each branch keeps only the accumulators and one k-row of weights live; d and m are read
    // from L1 at each use (register copies of them made the compiler spill the accumulators).
    if constexpr (FMT == kPanelQ4) {
      for (int i = 0; i < kQBlock / 2; ++i) {
        const uint8_t* row = cb + i * kGemmNR;
        prefetch_row<kRowBytes>(row + kPfBlocks * kCodes);
        V bk[NV];
        for (int j = 0; j < NV; ++j)
          bk[j] = V::fma(V::load(sc + j * L), V::template from_u4<0>(row + j * L),
                         V::load(sc + kGemmNR + j * L));
        tile_fma_k<V, MR>(acc, ab, lda, 2 * i, bk);
        for (int j = 0; j < NV; ++j)
          bk[j] = V::fma(V::load(sc + j * L), V::template from_u4<4>(row + j * L),
                         V::load(sc + kGemmNR + j * L));
        tile_fma_k<V, MR>(acc, ab, lda, 2 * i + 1, bk);
      }
    } else {
      for (int i = 0; i < kQBlock; ++i) {
        prefetch_row<kRowBytes>(cb + i * kGemmNR + kPfBlocks * kCodes);
        const int8_t* row = reinterpret_cast<const int8_t*>(cb + i * kGemmNR);
        V bk[NV];
        for (int j = 0; j < NV; ++j) bk[j] = V::mul(V::load(sc + j * L), V::from_i8(row + j * L));
        tile_fma_k<V, MR>(acc, ab, lda, i, bk);
      }
    }
  }
  tile_end<V, MR>(acc, last, bias, c, ldc, nr_valid);
}

// Rebuild blocks [b0, b1) of panel p of a compact matrix as float32 panel rows (out: (k, kGemmNR)),
// with the kernels' own operations: prefill rebuilds a K block once and reuses it for every row
// block, then runs the float32 tiles on it (the same weight values, so the same bits).
template <class V, int FMT>
inline void unpack_blocks(const PackedMatrix& w, int64_t p, int64_t b0, int64_t b1, float* out) {
  constexpr int L = V::kLanes;
  const int64_t nkb = w.k_blocks();
  const uint8_t* codes = w.codes.data() + (p * nkb + b0) * w.code_bytes();
  if constexpr (FMT == kPanelBF16) {  // contiguous rows: one flat pass
    const uint16_t* cw = reinterpret_cast<const uint16_t*>(codes);
    for (int64_t i = 0; i < (b1 - b0) * kQBlock * kGemmNR; i += L)
      V::from_bf16(cw + i).store(out + i);
  } else {
    for (int64_t b = b0; b < b1; ++b) {
      const float* sc = w.data.data() + (p * nkb + b) * w.scale_floats();
      const uint8_t* cb = codes + (b - b0) * w.code_bytes();
      float* o = out + (b - b0) * kQBlock * kGemmNR;
      for (int j = 0; j < kGemmNR; j += L) {
        const V d = V::load(sc + j);
        if constexpr (FMT == kPanelQ4) {
          const V m = V::load(sc + kGemmNR + j);
          for (int i = 0; i < kQBlock / 2; ++i) {
            V::fma(d, V::template from_u4<0>(cb + i * kGemmNR + j), m)
                .store(o + 2 * i * kGemmNR + j);
            V::fma(d, V::template from_u4<4>(cb + i * kGemmNR + j), m)
                .store(o + (2 * i + 1) * kGemmNR + j);
          }
        } else {
          for (int i = 0; i < kQBlock; ++i)
            V::mul(d, V::from_i8(reinterpret_cast<const int8_t*>(cb + i * kGemmNR + j)))
                .store(o + i * kGemmNR + j);
        }
      }
    }
  }
}

// f(std::integral_constant<int, rows>{}) for 1 <= rows <= MR: a tile with a compile-time row
// count for the last, short row block.
template <int MR, class F>
inline void with_rows(int rows, F&& f) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      f(std::integral_constant<int, MR>{});
    } else {
      with_rows<MR - 1>(rows, f);
    }
  }
}

// bfloat16 panels are k-major rows of kGemmNR codes, contiguous across blocks: one flat k loop,
// as gemm_tile (nested block loops made GCC store every accumulator to the stack each k).
template <class V, int MR>
inline void gemm_tile_bf16(const float* a, int64_t lda, const uint16_t* codes, int64_t kn,
                           bool first, bool last, const float* bias, float* c, int64_t ldc,
                           int nr_valid) {
  constexpr int NV = GemmTraits<V>::kNV;
  constexpr int L = V::kLanes;
  constexpr int64_t kAhead = kPfBlocks * kQBlock * kGemmNR;  // codes, as the other formats
  V acc[MR][NV];
  tile_begin<V, MR>(acc, first, c, ldc, nr_valid);
  for (int64_t k = 0; k < kn; ++k) {
    prefetch_row<2 * kGemmNR>(reinterpret_cast<const uint8_t*>(codes + k * kGemmNR + kAhead));
    V bk[NV];
    for (int j = 0; j < NV; ++j) bk[j] = V::from_bf16(codes + k * kGemmNR + j * L);
    tile_fma_k<V, MR>(acc, a, lda, k, bk);
  }
  tile_end<V, MR>(acc, last, bias, c, ldc, nr_valid);
}

// c (m, ldc) = a (m, lda) * W^T (+ bias). Tasks (panel, row block) are split over threads in
// contiguous ranges; a thread walks its tasks panel by panel, K block by K block. A compact
// matrix is rebuilt K block by K block into a float32 buffer when the thread has several row
// blocks of the panel (prefill), and rebuilt in registers inside the tile when it has one
// (decode): the weight values, and so the bits, are the same either way.
template <class V, int FMT>
void gemm_fmt(const float* a, int64_t m, int64_t lda, const PackedMatrix& w, float* c, int64_t ldc,
              int n_threads) {
  constexpr int MR = GemmTraits<V>::kMR;
  constexpr int NC = GemmTraits<V>::kCols;
  const int64_t n_mb = (m + MR - 1) / MR;
  const int64_t tasks = w.n_panels * n_mb;
  const int64_t kk = w.k_in;
  parallel_for(tasks, n_threads, [&](int64_t begin, int64_t end, int) {
    for (int64_t t0 = begin; t0 < end;) {
      const int64_t p = t0 / n_mb;
      const int64_t t1 = std::min(end, (p + 1) * n_mb);  // this thread's tasks of panel p
      const int64_t n0 = p * kGemmNR;
      const int nr_valid = static_cast<int>(std::min<int64_t>(kGemmNR, w.n_out - n0));
      const float* bias = w.has_bias() ? w.bias.data() + n0 : nullptr;
      for (int64_t k0 = 0; k0 < kk || k0 == 0; k0 += kGemmKC) {
        const int64_t k1 = std::min(kk, k0 + kGemmKC);
        const float* panel = nullptr;
        if constexpr (FMT == kPanelF32) {
          panel = w.data.data() + p * kk * kGemmNR + k0 * kGemmNR;
        } else if (t1 - t0 > 1) {
          float* rebuilt = gemm_rebuild_buffer();
          unpack_blocks<V, FMT>(w, p, k0 / kQBlock, k1 / kQBlock, rebuilt);
          panel = rebuilt;
        }
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t r0 = (t % n_mb) * MR;
          const int rows = static_cast<int>(std::min<int64_t>(MR, m - r0));
          for (int c0 = 0; c0 < nr_valid; c0 += NC) {
            const float* bias_c = bias ? bias + c0 : nullptr;
            float* c_t = c + r0 * ldc + n0 + c0;
            const int nv = std::min(NC, nr_valid - c0);
            const float* a_t = a + r0 * lda + k0;
            const bool first = k0 == 0, last = k1 == kk;
            if (panel != nullptr) {
              with_rows<MR>(rows, [&](auto r) {
                gemm_tile<V, decltype(r)::value>(a_t, lda, panel + c0, k1 - k0, first, last, bias_c,
                                                 c_t, ldc, nv);
              });
            } else if constexpr (FMT != kPanelF32) {  // float32 always has a panel
              const int64_t blk = p * w.k_blocks() + k0 / kQBlock;
              const uint8_t* codes =
                  w.codes.data() + blk * w.code_bytes() + c0 * PackedMatrix::code_col_bytes_of(FMT);
              with_rows<MR>(rows, [&](auto r) {
                constexpr int R = decltype(r)::value;
                if constexpr (FMT == kPanelBF16) {
                  gemm_tile_bf16<V, R>(a_t, lda, reinterpret_cast<const uint16_t*>(codes), k1 - k0,
                                       first, last, bias_c, c_t, ldc, nv);
                } else {
                  const float* sc = w.data.data() + blk * w.scale_floats() + c0;
                  gemm_tile_q<V, R, FMT>(a_t, lda, sc, codes, (k1 - k0) / kQBlock, first, last,
                                         bias_c, c_t, ldc, nv);
                }
              });
            }
          }
        }
        if (k1 == kk) break;
      }
      t0 = t1;
    }
  });
}

template <class V>
void gemm(const float* a, int64_t m, int64_t lda, const PackedMatrix& w, float* c, int64_t ldc,
          int n_threads) {
  if (w.format == kPanelQ4) {
    gemm_fmt<V, kPanelQ4>(a, m, lda, w, c, ldc, n_threads);
  } else if (w.format == kPanelQ8) {
    gemm_fmt<V, kPanelQ8>(a, m, lda, w, c, ldc, n_threads);
  } else if (w.format == kPanelBF16) {
    gemm_fmt<V, kPanelBF16>(a, m, lda, w, c, ldc, n_threads);
  } else {
    gemm_fmt<V, kPanelF32>(a, m, lda, w, c, ldc, n_threads);
  }
}

}  // namespace eb::ops

namespace eb::ops {
// MLP kinds 0..2 (swiglu, geglu, geglu_tanh) are gated: see ops/activations.hpp.
inline bool mlp_is_gated_kind(int kind) { return kind <= 2; }
}  // namespace eb::ops
