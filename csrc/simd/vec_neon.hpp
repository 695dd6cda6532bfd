// AArch64 Advanced SIMD (NEON) vector of 4 float lanes; same API as vec_scalar.hpp. NEON is
// architecturally mandatory on AArch64, so no extra -m flag: compiled into the neon kernel
// translation unit only (CMakeLists.txt, EB_ISA_neon). fma is vfmaq_f32 (FMLA: fused, one
// rounding, = std::fma per lane); the compiler may not contract anything else
// (-ffp-contract=off, which GCC for AArch64 needs: its default is to fuse).
#pragma once
#include <arm_neon.h>
#include "simd/vec_common.hpp"

#include <cstdint>
#include <cstring>

#include "math/exp.hpp"

namespace eb::simd {

struct VecNeon {
  static constexpr int kLanes = 4;
  float32x4_t v;
  static VecNeon zero() { return {vdupq_n_f32(0.0f)}; }
  static VecNeon set1(float a) { return {vdupq_n_f32(a)}; }
  static VecNeon load(const float* p) { return {vld1q_f32(p)}; }
  void store(float* p) const { vst1q_f32(p, v); }
  // a * b + c, one rounding (vfmaq_f32(acc, x, y) = acc + x * y).
  static VecNeon fma(VecNeon a, VecNeon b, VecNeon c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
  static VecNeon add(VecNeon a, VecNeon b) { return {vaddq_f32(a.v, b.v)}; }
  // max(a, b) keeping b when a is NaN (and a when only b is): IEEE maxNum; b is never NaN
  // where the kernels use it, so this equals the x86 and scalar versions.
  static VecNeon max(VecNeon a, VecNeon b) { return {vmaxnmq_f32(a.v, b.v)}; }
  static VecNeon mul(VecNeon a, VecNeon b) { return {vmulq_f32(a.v, b.v)}; }
  // Exact small-integer loads of compact weight codes (ops/gemm/format.hpp): kLanes int8 -> float,
  // and kLanes bytes -> ((byte >> Shift) & 15) -> float.
  static VecNeon from_i8(const int8_t* p) {
    uint32_t t;
    std::memcpy(&t, p, 4);
    const int8x8_t b = vreinterpret_s8_u64(vcreate_u64(t));
    return {vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(b))))};
  }
  template <int Shift>
  static VecNeon from_u4(const uint8_t* p) {
    uint32_t t;
    std::memcpy(&t, p, 4);
    uint32x4_t w = vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(t))));
    if constexpr (Shift != 0) w = vshrq_n_u32(w, Shift);
    return {vcvtq_f32_u32(vandq_u32(w, vdupq_n_u32(15)))};
  }
  // kLanes bfloat16 bit patterns -> the float32 values they are the top halves of (exact).
  static VecNeon from_bf16(const uint16_t* p) {
    return {vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16))};
  }

  // y[i] = exp_f32(x[i]) (math/exp.hpp, detail::exp_dd with lo = 0) in two float64x2 halves,
  // the same operations in the same order as the scalar routine (as vec_avx2.hpp):
  // n = (x*log2e + S) - S, r = fma(-n, ln2_hi, x), r = fma(-n, ln2_lo, r), r = r + 0, Horner
  // fma chain of 1/k!, e = fma(r*r, q, r), y = 1 + e, y * 2^n (exact here: n in [-159, 128]),
  // one rounding to binary32. Special inputs (NaN, overflow, x < -110) are selected afterwards.
  // Tails use the scalar routine. x and y may alias.
  static void exp_array(const float* x, float* y, int64_t n) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      const float32x4_t xf = vld1q_f32(x + i);
      const uint32x4_t over =
          vcgtq_f32(xf, vdupq_n_f32(math::detail::kExpF32Inf));  // false for NaN
      const uint32x4_t under = vcltq_f32(xf, vdupq_n_f32(math::detail::kExpF32Zero));
      const uint32x4_t ordered = vceqq_f32(xf, xf);  // false exactly for NaN
      const float64x2_t lo = exp_core(vcvt_f64_f32(vget_low_f32(xf)));
      const float64x2_t hi = exp_core(vcvt_high_f64_f32(xf));
      float32x4_t out = vcvt_high_f32_f64(vcvt_f32_f64(lo), hi);  // round to nearest, once
      out = vbslq_f32(over, vdupq_n_f32(__builtin_huge_valf()), out);
      out = vbslq_f32(under, vdupq_n_f32(0.0f), out);
      out = vbslq_f32(ordered, out, vreinterpretq_f32_u32(vdupq_n_u32(0x7FC00000u)));
      vst1q_f32(y + i, out);
    }
    for (; i < n; ++i) y[i] = math::exp_f32(x[i]);
  }

  // The L16 tree: acc[0] holds lanes 0..3, acc[1] 4..7, acc[2] 8..11, acc[3] 12..15;
  // s_j += s_(j+w) for w = 8, 4, 2, 1 (ops/reduce.hpp), each step one vector add of the pairs.
  // out[i] = reduce16 of the 16 lanes at acc + 16 * i, for i = 0..15.
  static void reduce16_x16(const float* acc, float* out) {
    reduce16_x16_by_lanes<VecNeon>(acc, out);
  }
  static float reduce16(const VecNeon* acc) {
    const float32x4_t t0 = vaddq_f32(acc[0].v, acc[2].v);                  // w = 8: lanes 0..3
    const float32x4_t t1 = vaddq_f32(acc[1].v, acc[3].v);                  // w = 8: lanes 4..7
    const float32x4_t t4 = vaddq_f32(t0, t1);                              // w = 4: lanes 0..3
    const float32x2_t t2 = vadd_f32(vget_low_f32(t4), vget_high_f32(t4));  // w = 2: lanes 0, 1
    return vget_lane_f32(t2, 0) + vget_lane_f32(t2, 1);                    // w = 1
  }

 private:
  // detail::exp_dd(x, 0) for x already clamped below; NaN lanes give garbage, replaced later.
  static float64x2_t exp_core(float64x2_t xd) {
    xd = vminq_f64(vmaxq_f64(xd, vdupq_n_f64(math::detail::kExpF32Zero)),
                   vdupq_n_f64(math::detail::kExpClampHi));
    const float64x2_t shifter = vdupq_n_f64(0x1.8p52);
    float64x2_t nd = vmulq_f64(xd, vdupq_n_f64(math::detail::kLog2e));
    nd = vsubq_f64(vaddq_f64(nd, shifter), shifter);
    // vfmsq_f64(a, b, c) = a - b * c with one rounding = std::fma(-b, c, a).
    float64x2_t r = vfmsq_f64(xd, nd, vdupq_n_f64(math::detail::kLn2Hi));
    r = vfmsq_f64(r, nd, vdupq_n_f64(math::detail::kLn2Lo));
    r = vaddq_f64(r, vdupq_n_f64(0.0));
    // vfmaq_f64(a, b, c) = a + b * c with one rounding = std::fma(b, c, a).
    const double* taylor = math::detail::kExpTaylor;  // 1/13! .. 1/2!, Horner order
    float64x2_t q = vdupq_n_f64(taylor[0]);
    for (int k = 1; k < 12; ++k) q = vfmaq_f64(vdupq_n_f64(taylor[k]), q, r);
    const float64x2_t e = vfmaq_f64(r, vmulq_f64(r, r), q);
    const float64x2_t yd = vaddq_f64(vdupq_n_f64(1.0), e);
    // 2^n from the exponent field; n is integral and in [-159, 128], so the conversion is exact.
    const int64x2_t ni = vcvtq_s64_f64(nd);
    const float64x2_t p2 = vreinterpretq_f64_s64(vshlq_n_s64(vaddq_s64(ni, vdupq_n_s64(1023)), 52));
    return vmulq_f64(yd, p2);
  }
};

}  // namespace eb::simd
