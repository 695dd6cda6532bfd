// GEMM microkernels: MR x kCols tiles over packed panels (float32, compact q4_1/q5_1/q8_0/q6_k
// rebuilt in registers, bf16), the compact-block unpacker and the row-count dispatcher. Every tile
// runs c[m][n] = SEQ_k fma(a[m][k], w[n][k]) from +0.0 (or the stored partial sums), + bias last,
// so every output is the same in-order FMA chain whatever MR, the tile-mates or the ISA. Reference
// twin: gemm_ref (ref.hpp). The threaded driver is driver.hpp.
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ops/gemm/format.hpp"

namespace eb::ops {

// A tile covers kCols = kNV vectors of a panel's columns and kMR rows: AVX-512 8 x 48
// (24 accumulators), AVX2 4 x 24 (12; two tiles per panel), scalar 2 x 48.
template <class V>
struct GemmTraits {
  static constexpr int kNV = V::kLanes >= 8 ? 3 : 48;
  static constexpr int kCols = kNV * V::kLanes;
  static constexpr int kMR = V::kLanes >= 16 ? 8 : (V::kLanes >= 8 ? 4 : 2);
};

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
  static_assert(FMT == kPanelQ4 || FMT == kPanelQ8 || FMT == kPanelQ6 || FMT == kPanelQ5,
                "bfloat16 panels run gemm_tile_bf16");
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
    } else if constexpr (FMT == kPanelQ5) {
      for (int i = 0; i < kQBlock; ++i) {
        prefetch_row<kRowBytes>(cb + i * kGemmNR + kPfBlocks * kCodes);
        const int8_t* row = reinterpret_cast<const int8_t*>(cb + i * kGemmNR);
        V bk[NV];
        for (int j = 0; j < NV; ++j)
          bk[j] =
              V::fma(V::load(sc + j * L), V::from_i8(row + j * L), V::load(sc + kGemmNR + j * L));
        tile_fma_k<V, MR>(acc, ab, lda, i, bk);
      }
    } else {  // kPanelQ8 (one d per block) and kPanelQ6 (one d per half block): w = d * q
      constexpr int kGroup = FMT == kPanelQ6 ? static_cast<int>(kQHalf) : static_cast<int>(kQBlock);
      for (int i = 0; i < kQBlock; ++i) {
        prefetch_row<kRowBytes>(cb + i * kGemmNR + kPfBlocks * kCodes);
        const int8_t* row = reinterpret_cast<const int8_t*>(cb + i * kGemmNR);
        const float* d = sc + (i / kGroup) * kGemmNR;
        V bk[NV];
        for (int j = 0; j < NV; ++j) bk[j] = V::mul(V::load(d + j * L), V::from_i8(row + j * L));
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
        if constexpr (FMT == kPanelQ4) {
          const V d = V::load(sc + j), m = V::load(sc + kGemmNR + j);
          for (int i = 0; i < kQBlock / 2; ++i) {
            V::fma(d, V::template from_u4<0>(cb + i * kGemmNR + j), m)
                .store(o + 2 * i * kGemmNR + j);
            V::fma(d, V::template from_u4<4>(cb + i * kGemmNR + j), m)
                .store(o + (2 * i + 1) * kGemmNR + j);
          }
        } else if constexpr (FMT == kPanelQ5) {
          const V d = V::load(sc + j), m = V::load(sc + kGemmNR + j);
          for (int i = 0; i < kQBlock; ++i)
            V::fma(d, V::from_i8(reinterpret_cast<const int8_t*>(cb + i * kGemmNR + j)), m)
                .store(o + i * kGemmNR + j);
        } else {  // kPanelQ8, kPanelQ6: w = d * q, d per block or per half block
          constexpr int kGroup =
              FMT == kPanelQ6 ? static_cast<int>(kQHalf) : static_cast<int>(kQBlock);
          for (int i = 0; i < kQBlock; ++i)
            V::mul(V::load(sc + (i / kGroup) * kGemmNR + j),
                   V::from_i8(reinterpret_cast<const int8_t*>(cb + i * kGemmNR + j)))
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

}  // namespace eb::ops
