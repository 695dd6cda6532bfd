// Per-translation-unit linkage for the header-only math (docs/architecture.md, "One binary,
// several ISAs"). Every ISA's kernels_isa.cpp is compiled with its own -m flags and defines
// EB_ISA_NAME (isa_scalar, isa_avx2, ...). An inline function that the compiler leaves out of
// line is emitted in each of those objects under one mangled name, and the linker keeps ONE
// copy for all callers: the AVX-512 copy could then run on the scalar path of a CPU without
// AVX-512 (SIGILL), or the baseline copy slow down the AVX-512 path (a libm call per fma).
// Wrapping the math in an inline namespace named after the ISA gives each object its own copy;
// callers still write eb::math::exp_f32. tests/cross checks the objects for shared symbols.
#pragma once

#if defined(EB_ISA_NAME)
#define EB_MATH_ABI_BEGIN inline namespace EB_ISA_NAME {
#else
#define EB_MATH_ABI_BEGIN inline namespace generic {
#endif
#define EB_MATH_ABI_END }
