// Cross-ISA / cross-architecture bit digest, without Python (tests/cross/test_neon_cross.py).
// Builds small eb::blocks::TransformerModel and eb::blocks::Mamba2Model instances with
// deterministic weights (an integer hash of (tensor, index), no RNG), and for every kernel table
// this build has (eb::available_isas()) runs: ragged batched forwards that carry the KV cache / the
// conv and SSM state over three calls (prefill, continuation, decode), the L16 dot/sum kernels,
// packed GEMMs (float32 panels, and compact Q4_1/Q8_0/bfloat16 panels checked against them) and
// elementwise sweeps of exp, log1p, tanh, erf, sin, cos, silu, softplus, gelu, gelu_tanh and the
// vectorised exp, and a model's layers (Transformer and Mamba-2 in turn) through the stack runner
// (blocks/stack.hpp). Everything (outputs and final states) is folded into a 64-bit FNV-1a over
// the raw bytes. The cases live in digest_blocks.cpp, digest_stack.cpp and digest_kernels.cpp.
//
// Output (stdout): one line per ISA, `<isa> <16 hex digits>`; every line must carry the same
// digest on every ISA and every architecture (SPEC 3.1). stderr: one `# <isa> <case> <digest>`
// line per case, to locate a mismatch. Exit status 1 if a self-check fails inside one ISA:
// the vectorised exp differs from exp_f32, compact panels differ from float32 panels, 1 and
// 2 threads give different bits, a block output is non-finite, all zero, or written at a
// padding position, or a kernel differs from its plain twin (ops/ref/ref.hpp: attention decode
// and prefill, softmax, conv1d, the SSM step and multi-token scan, RoPE, the MLP combine), or
// the stack runner differs from the blocks' own calls one after another (or does not stop
// before a layer whose state is in use, or its undo log does not restore every state).
//
// Build (x86-64, see the test for the full command; every kernels_isa.cpp object needs
// -DEB_ISA_<isa>=1 -DEB_ISA_NAME=isa_<isa> and the ISA's flags, the rest -DEB_HAVE_<ISA>=1):
//   g++ -std=c++17 -O2 -pthread -ffp-contract=off -I csrc tests/cpp/digest*.cpp
//       csrc/{base,blocks,ops,dispatch}/**/*.cpp (not kernels_isa.cpp) <isa objects> -o digest
// Run: ./digest [--quick]
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "blocks/mamba2/model.hpp"
#include "blocks/transformer/model.hpp"
#include "digest.hpp"
#include "dispatch/kernel_table.hpp"

namespace digest {

// ---- hashing, weights, failures --------------------------------------------------------------

std::string hex(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, h);
  return buf;
}

uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

float unit(uint64_t tensor, uint64_t i) {
  const int64_t k = static_cast<int64_t>(mix(tensor * 0x100000001ull + i) >> 40);  // 0 .. 2^24-1
  return static_cast<float>(k - (int64_t{1} << 23)) * 0x1p-23f;
}

uint64_t name_id(const std::string& s) {
  Fnv1a f;
  f.bytes(s.data(), s.size());
  return f.h;
}

std::vector<float> tensor(const std::string& name, int64_t n, float scale, float offset) {
  std::vector<float> v(static_cast<size_t>(n));
  const uint64_t id = name_id(name);
  for (int64_t i = 0; i < n; ++i) v[i] = offset + scale * unit(id, static_cast<uint64_t>(i));
  return v;
}

std::unordered_map<std::string, const float*> ptrs(const Weights& w) {
  std::unordered_map<std::string, const float*> out;
  for (const auto& kv : w) out[kv.first] = kv.second.data();
  return out;
}

float inv_sqrt(int64_t n) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))); }

namespace {
bool g_ok = true;
}  // namespace

bool all_ok() { return g_ok; }

void fail(const std::string& isa, const std::string& what) {
  std::fprintf(stderr, "FAIL %s: %s\n", isa.c_str(), what.c_str());
  g_ok = false;
}

void check_y(const std::string& what, const std::vector<float>& y, int64_t B, int64_t L, int64_t d,
             const int64_t* lengths) {
  bool any_nonzero = false;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < L; ++t)
      for (int64_t i = 0; i < d; ++i) {
        const float v = y[(b * L + t) * d + i];
        if (t < lengths[b]) {
          if (!std::isfinite(v)) return fail(eb::get_isa(), what + ": non-finite output");
          any_nonzero = any_nonzero || v != 0.0f;
        } else if (v != 0.0f || std::signbit(v)) {
          return fail(eb::get_isa(), what + ": padding position written");
        }
      }
  if (!any_nonzero) fail(eb::get_isa(), what + ": all outputs zero");
}

}  // namespace digest

using namespace digest;  // NOLINT: the test's own names

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]);
      return 2;
    }
  }
  // Models are built once (construction does not depend on the ISA) and shared by all tables.
  const std::vector<TfCase> tcs = transformer_cases();
  const std::vector<MbCase> mcs = mamba2_cases();
  std::vector<Weights> tw, mw;
  std::vector<eb::blocks::TransformerModel> tms;
  std::vector<eb::blocks::Mamba2Model> mms;
  for (const TfCase& tc : tcs) {
    tw.push_back(transformer_weights(tc));
    tms.emplace_back(tc.cfg, ptrs(tw.back()));
  }
  for (const MbCase& mc : mcs) {
    mw.push_back(mamba2_weights(mc));
    mms.emplace_back(mc.cfg, ptrs(mw.back()));
  }
  const std::vector<float> sweep = sweep_inputs(quick);

  for (const std::string& isa : eb::available_isas()) {
    eb::set_isa(isa);
    Fnv1a total;
    auto record = [&](const std::string& what, uint64_t h) {
      std::fprintf(stderr, "# %s %s %s\n", isa.c_str(), what.c_str(), hex(h).c_str());
      total.bytes(&h, sizeof h);
    };
    for (size_t i = 0; i < tcs.size(); ++i) {
      const uint64_t h2 = run_transformer(tcs[i], tms[i], 2);
      const uint64_t h1 = run_transformer(tcs[i], tms[i], 1);
      if (h1 != h2) fail(isa, tcs[i].name + ": 1 and 2 threads differ");
      record(tcs[i].name, h2);
    }
    for (size_t i = 0; i < mcs.size(); ++i) {
      const uint64_t h2 = run_mamba2(mcs[i], mms[i], 2);
      const uint64_t h1 = run_mamba2(mcs[i], mms[i], 1);
      if (h1 != h2) fail(isa, mcs[i].name + ": 1 and 2 threads differ");
      record(mcs[i].name, h2);
      const uint64_t b2 = run_mamba2_backward(mcs[i], mms[i], 2);
      const uint64_t b1 = run_mamba2_backward(mcs[i], mms[i], 1);
      if (b1 != b2) fail(isa, mcs[i].name + ": backward: 1 and 2 threads differ");
      record(mcs[i].name + "_backward", b2);
    }
    record("l16", run_reductions());
    {
      const uint64_t h2 = run_gemm(2), h1 = run_gemm(1);
      if (h1 != h2) fail(isa, "gemm: 1 and 2 threads differ");
      record("gemm_norm", h2);
    }
    {
      const uint64_t h2 = run_gemm_compact(2, isa), h1 = run_gemm_compact(1, isa);
      if (h1 != h2) fail(isa, "gemm_compact: 1 and 2 threads differ");
      record("gemm_compact", h2);
    }
    record("elementwise", run_elementwise(sweep, isa));
    record("twins", run_twins(isa));
    record("stack", run_stack_case(isa));
    std::printf("%s %s\n", isa.c_str(), hex(total.h).c_str());
    std::fflush(stdout);
  }
  return g_ok ? 0 : 1;
}
