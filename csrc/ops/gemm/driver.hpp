// Packed GEMM (prefill) and GEMV (decode, M = 1..16) with ONE arithmetic (SPEC 3.3 SEQ,
// STYLE 5.3): c[m][n] = (fma chain over k = 0..K-1 of a[m][k] * w[n][k], from +0.0) + bias[n].
// Weights are packed once into panels of kGemmNR output features, k-major; the microkernel
// vectorises across the panel's outputs and runs k in order, so every output is the same
// in-order FMA chain whatever MR, M, the tile-mates, the ISA or the thread split.
// K is never split across threads. Reference twin: gemm_ref (ref.hpp).
// What lives here: the threaded driver over (panel, row block) tasks. The tiles are in
// tiles.hpp, the storage in format.hpp.
#pragma once
#include <algorithm>
#include <cstdint>

#include "base/cancel.hpp"
#include "base/parallel.hpp"
#include "base/workspace.hpp"
#include "ops/gemm/format.hpp"
#include "ops/gemm/tiles.hpp"

namespace eb::ops {

// Floats of rebuild scratch gemm<V> needs PER THREAD for w and m rows: a compact matrix is
// rebuilt into float32 panel rows only when a chunk holds several row blocks of a panel.
template <class V>
int64_t gemm_scratch_floats(const PackedMatrix& w, int64_t m) {
  if (!w.parts.empty()) {  // the parts run one after another: the most any of them needs
    int64_t most = 0;
    for (const PackedMatrix& p : w.parts) most = std::max(most, gemm_scratch_floats<V>(p, m));
    return most;
  }
  if (w.format == kPanelF32 || m <= GemmTraits<V>::kMR) return 0;
  return pad_floats(std::min(w.k_in, kGemmKC) * kGemmNR);
}

// c (m, ldc) = a (m, lda) * W^T (+ bias). Tasks (panel, row block) are handed out in chunks
// (of whole panels when there are enough of them); a thread walks its chunk panel by panel, K
// block by K block. A compact matrix is rebuilt K block by K block into a float32 buffer when
// the chunk has several row blocks of the panel (prefill), and rebuilt in registers inside the
// tile when it has one (decode): the weight values, and so the bits, are the same either way.
// `scratch` holds gemm_scratch_floats<V>(w, m) floats per thread (the tid-th slice); when null
// and needed, it is allocated here, on the calling thread, before the parallel region.
template <class V, int FMT>
void gemm_fmt(const float* a, int64_t m, int64_t lda, const PackedMatrix& w, float* c, int64_t ldc,
              int n_threads, float* scratch) {
  constexpr int MR = GemmTraits<V>::kMR;
  constexpr int NC = GemmTraits<V>::kCols;
  const int64_t n_mb = (m + MR - 1) / MR;
  const int64_t tasks = w.n_panels * n_mb;
  const int64_t kk = w.k_in;
  const int64_t per_thread = gemm_scratch_floats<V>(w, m);
  Workspace local;
  if (per_thread > 0 && scratch == nullptr)
    scratch = local.floats(0, static_cast<size_t>(std::max(n_threads, 1) * per_thread));
  const Grain grain{w.n_panels >= 4 * int64_t{std::max(n_threads, 1)} ? n_mb : 1};
  parallel_for(tasks, n_threads, grain, [&](int64_t begin, int64_t end, int tid) {
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
          float* rebuilt = scratch + tid * per_thread;
          unpack_blocks<V, FMT>(w, p, k0 / kQBlock, k1 / kQBlock, rebuilt);
          panel = rebuilt;
        }
        for (int64_t t = t0; t < t1; ++t) {
          // a cancel point every 64 row blocks: one panel of a long prefill can take a while
          if (tid == 0 && (t - t0) % 64 == 63) cancel::point();
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
          int n_threads, float* scratch = nullptr) {
  if (!w.parts.empty()) {  // a mixed stack: each part into its own output columns
    int64_t col = 0;
    for (const PackedMatrix& p : w.parts) {
      gemm<V>(a, m, lda, p, c + col, ldc, n_threads, scratch);
      col += p.n_out;
    }
    return;
  }
  if (w.format == kPanelQ4) {
    gemm_fmt<V, kPanelQ4>(a, m, lda, w, c, ldc, n_threads, scratch);
  } else if (w.format == kPanelQ8) {
    gemm_fmt<V, kPanelQ8>(a, m, lda, w, c, ldc, n_threads, scratch);
  } else if (w.format == kPanelQ5) {
    gemm_fmt<V, kPanelQ5>(a, m, lda, w, c, ldc, n_threads, scratch);
  } else if (w.format == kPanelQ6) {
    gemm_fmt<V, kPanelQ6>(a, m, lda, w, c, ldc, n_threads, scratch);
  } else if (w.format == kPanelBF16) {
    gemm_fmt<V, kPanelBF16>(a, m, lda, w, c, ldc, n_threads, scratch);
  } else {
    gemm_fmt<V, kPanelF32>(a, m, lda, w, c, ldc, n_threads, scratch);
  }
}

}  // namespace eb::ops
