// Packed weight storage of the GEMM (SPEC 3.3 SEQ, STYLE 5.3): the panel layout, the exact
// compact formats and the packer's entry point. What lives here: PackedMatrix and its formats.
// What does not: the tiles that compute on them (tiles.hpp), the threaded driver (driver.hpp),
// the packer (pack.cpp; its format fitting pack_fit.cpp, GGUF decoding pack_gguf.cpp,
// unpacking unpack.cpp) and the scalar reference (ref.hpp).
#pragma once
#include <cstdint>
#include <vector>

#include "base/aligned.hpp"

namespace eb::ops {

constexpr int kGemmNR = 48;

// How a packed matrix holds its weights. Every format is lossless: the packer picks a compact
// one only when it rebuilds every weight bit for bit (ops/gemm/pack_fit.cpp), and the kernels
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
//   kPanelQ6:  per half block of 16 k's: w = d * q, q int8 (GGUF Q6_K's values: (d*sc)*(q-32),
//              which is exact: d is binary16 (<= 11 significant bits), sc int8 (|sc| <= 128:
//              <= 7 bits), |q-32| <= 32 (<= 5 bits), so both products have <= 23 significant
//              bits, and |w| lies in [2^-24, 2^28): no rounding, no subnormal; the stored d is
//              the float32 d*sc and the kernels' d * q is that exact product).
//   kPanelQ5:  per block: w = fma(d, q, m), q in 0..31 in whole bytes (GGUF Q5_1's d*q + m and
//              Q5_K's (d*sc)*q - (dmin*mn): d*q has <= 11 + 5 bits, (d*sc)*q <= 11 + 6 + 5 =
//              22 bits, dmin*mn <= 17 bits, all exact and >= 2^-24 in magnitude, so the one
//              rounding is the final add, which fma(d, q, m) with m = -(dmin*mn) makes too:
//              x - y is x + (-y) in IEEE arithmetic, signed zeros included).
// kPanelQ6 and kPanelQ5 keep codes as whole bytes (1.25 bytes per weight): the kernels
// rebuild them with the int8 load kPanelQ8 uses, no bit unpacking in the inner loop.
enum PanelFormat : int {
  kPanelF32 = 0,
  kPanelQ8 = 1,
  kPanelQ4 = 2,
  kPanelBF16 = 3,
  kPanelQ6 = 4,
  kPanelQ5 = 5
};
constexpr int64_t kQBlock = 32;
constexpr int64_t kQHalf = kQBlock / 2;  // kPanelQ6's scale group

// W (n_out, k_in) row-major (torch [out, in]) packed into ceil(n_out / kGemmNR) panels of
// kGemmNR output features, zero past n_out. Bias optional (empty when absent).
// F32: data holds each panel as (k_in, kGemmNR) floats. Q8/Q4/Q6/Q5: per (panel, k block) in
// panel order, data holds d[kGemmNR] (Q4, Q5: then m[kGemmNR]; Q6: d of k 0..15, then d of
// k 16..31) and codes the block's codes, k-major: Q8, Q6 kQBlock rows of kGemmNR int8; Q5
// kQBlock rows of kGemmNR bytes 0..31; Q4 kQBlock/2 rows of kGemmNR bytes, byte (i, n) = code
// of k = 2i in the low nibble, of k = 2i+1 in the high nibble. BF16: no scales; codes hold
// kQBlock rows of kGemmNR uint16 per block, so a panel's rows are contiguous and k-major.
// Compact formats need k_in % kQBlock == 0.
struct PackedMatrix {
  int64_t n_out = 0, k_in = 0, n_panels = 0;
  int format = kPanelF32;
  AlignedVector<float> data;  // 64-byte aligned: panel rows are 3 whole cache lines
  AlignedVector<uint8_t> codes;
  std::vector<float> bias;
  // A stack of GGUF matrices whose types share no compact format (a Q4_K q|k with a Q6_K v):
  // its consecutive runs of one format packed each on its own, rows in order. n_out and k_in
  // are the whole stack's; format, data, codes, bias and n_panels are unused. A GEMM runs the
  // parts one after another into adjacent output columns: every output keeps its own FMA
  // chain, so the bits are those of one packed matrix.
  std::vector<PackedMatrix> parts;
  bool has_bias() const { return !bias.empty(); }
  int64_t k_blocks() const { return k_in / kQBlock; }
  int64_t scale_floats() const { return scale_floats_of(format); }  // per block
  int64_t code_bytes() const { return code_bytes_of(format); }
  static constexpr int64_t scale_floats_of(int f) {
    return f == kPanelQ4 || f == kPanelQ5 || f == kPanelQ6 ? 2 * kGemmNR
                                                           : (f == kPanelQ8 ? kGemmNR : 0);
  }
  static constexpr int64_t code_bytes_of(int f) {
    return f == kPanelQ4 ? kQBlock / 2 * kGemmNR : kQBlock * kGemmNR * code_col_bytes_of(f);
  }
  // Bytes per output column in one code row (the offset of a tile's first column).
  static constexpr int64_t code_col_bytes_of(int f) { return f == kPanelBF16 ? 2 : 1; }
  const char* format_name() const {
    if (!parts.empty()) return "mixed";
    switch (format) {
      case kPanelQ4: return "q4_1";
      case kPanelQ8: return "q8_0";
      case kPanelBF16: return "bf16";
      case kPanelQ6: return "q6_k";
      case kPanelQ5: return "q5_1";
      default: return "float32";
    }
  }
  int64_t bytes() const {
    int64_t b = static_cast<int64_t>(data.size() * sizeof(float) + codes.size() +
                                     bias.size() * sizeof(float));
    for (const PackedMatrix& p : parts) b += p.bytes();
    return b;
  }
};

// Stack several (n_i, k_in) row-major matrices vertically and pack them: the fused q|k|v and
// gate|up projections. Concatenation changes no output's FMA chain. allow_compact = false
// keeps float32 panels (the blocks' config field compact_weights; tests compare the two).
PackedMatrix pack_matrices(const std::vector<const float*>& parts, const std::vector<int64_t>& rows,
                           int64_t k_in, const std::vector<const float*>& biases,
                           bool allow_compact = true);

// GGUF tensor types (ggml_type ids) the packer reads straight from a file's blocks. Each maps
// onto a compact format with the same float32 values gguf's dequantisation gives, bit for bit:
//   Q4_1: d * q + m (d * q exact)      -> kPanelQ4 (d, m)
//   Q4_K: (d*sc) * q - (dmin*m) per 32 -> kPanelQ4 (d*sc, -(dmin*m)): both products exact
//   Q8_0: d * q; Q4_0: d * (q - 8); Q5_0: d * (q - 16) -> kPanelQ8 (d, int8 code)
//   Q5_1: d * q + m; Q5_K: (d*sc) * q - (dmin*m) per 32 -> kPanelQ5 (as Q4_1 and Q4_K)
//   Q6_K: (d*sc) * (q - 32) per 16     -> kPanelQ6 (d*sc, int8 code q - 32): exact product
// Any other type is dequantised by the caller (Python, with gguf) and handed over as float32.
enum GgmlType : int {
  kGgmlF32 = 0,
  kGgmlQ4_0 = 2,
  kGgmlQ4_1 = 3,
  kGgmlQ5_0 = 6,
  kGgmlQ5_1 = 7,
  kGgmlQ8_0 = 8,
  kGgmlQ4_K = 12,
  kGgmlQ5_K = 13,
  kGgmlQ6_K = 14
};
// Weights per block and bytes per block of a GGUF type read here; 0 for any other type.
int64_t ggml_block_size(int type);
int64_t ggml_type_size(int type);

// One part of a stacked matrix: `rows` rows of k_in weights, either float32 (row-major) or
// GGUF blocks (each row k_in / ggml_block_size(type) blocks, rows consecutive).
struct MatrixSource {
  const float* f32 = nullptr;
  const uint8_t* blocks = nullptr;
  int type = kGgmlF32;
  int64_t rows = 0;
};

// pack_matrices over float32 or GGUF parts. When every part is GGUF blocks of types that map
// onto one compact format (and allow_compact), the codes and scales are taken from the blocks
// directly (no float32 copy, no format search); otherwise the GGUF parts are dequantised here
// with gguf's operations and the float32 packer runs. Either way the packed values are those
// of gguf's dequantisation.
PackedMatrix pack_sources(const std::vector<MatrixSource>& parts, int64_t k_in,
                          const std::vector<const float*>& biases, bool allow_compact = true);

// n weights of GGUF blocks of a type read here, dequantised as gguf.quants does (float32).
void dequantize_gguf(const uint8_t* blocks, int type, int64_t n, float* out);

// Rows [r0, r1) of a packed matrix as float32, (r1 - r0, k_in) row-major: each weight rebuilt
// with the kernels' own operation (fma(d, q, m), d * q, bf16 widening, or a float32 copy), so
// packing then unpacking gives back the packed weights bit for bit.
void unpack_rows(const PackedMatrix& w, int64_t r0, int64_t r1, float* out);

// K is cache-blocked: a kGemmKC x kGemmNR slice of the panel (384 KB) stays in L2 while it
// is used for every row block (measured: smaller blocks that fit L1 were slower here, since
// they reload the partial sums more often). The blocks of one output run in increasing k and
// each continues from the partial sums (stored to c as float and reloaded: exact), so the FMA
// chain is the same single chain over k = 0..K-1 as without blocking.
constexpr int64_t kGemmKC = 2048;
static_assert(kGemmKC % kQBlock == 0, "K blocks hold whole quantisation blocks");

}  // namespace eb::ops
