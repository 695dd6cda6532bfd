// EB_CHECK: cheap invariant re-checks at the binding boundary. Throws std::invalid_argument
// (ValueError under nanobind); never abort/exit on user input (STYLE 4).
#pragma once
#include <stdexcept>
#include <string>

#define EB_CHECK(cond, msg)                                                               \
  do {                                                                                    \
    if (!(cond)) throw std::invalid_argument(std::string("exactblocks._core: ") + (msg)); \
  } while (0)
