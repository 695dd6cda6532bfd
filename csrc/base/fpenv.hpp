// FpEnvGuard: every computing thread runs with round-to-nearest and subnormals kept
// (x86 MXCSR FTZ/DAZ cleared; AArch64 FPCR FZ, FZ16, AH cleared), and restores the caller's
// settings on exit (SPEC 3.2). Another library in the process that turned FTZ on (e.g. one
// built with fast-math, llvm-project#57589) therefore cannot change exactblocks' bits.
#pragma once
#include <cstdint>
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace eb {

class FpEnvGuard {
 public:
  FpEnvGuard() {
#if defined(__x86_64__) || defined(_M_X64)
    saved_ = _mm_getcsr();
    // bits 13-14 rounding (00 = nearest), bit 15 FTZ, bit 6 DAZ; keep exception masks.
    _mm_setcsr((saved_ & ~((3u << 13) | (1u << 15) | (1u << 6))) | 0x1F80u);
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    // RMode bits 22-23 = 00 (nearest), FZ bit 24, FZ16 bit 19, AH bit 1.
    fpcr &= ~((3ull << 22) | (1ull << 24) | (1ull << 19) | (1ull << 1));
    __asm__ volatile("msr fpcr, %0" : : "r"(fpcr));
#endif
  }
  ~FpEnvGuard() {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_setcsr(static_cast<unsigned>(saved_));
#elif defined(__aarch64__)
    __asm__ volatile("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  FpEnvGuard(const FpEnvGuard&) = delete;
  FpEnvGuard& operator=(const FpEnvGuard&) = delete;

 private:
  uint64_t saved_ = 0;
};

}  // namespace eb
