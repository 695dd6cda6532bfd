// The name of the arithmetic compiled into the core (SPEC 1, 3.4): summation orders,
// elementary functions and op orders. Bump it on any change that can move an output bit;
// tests/invariance/test_digest.py pins the bits of each version.
#pragma once

namespace eb {

inline constexpr const char* kArithmeticVersion = "fp32-identical-1";

}  // namespace eb
