// The message of the diffcp::Error that f() throws, or "" when it throws none: tests assert on
// the wording users see.
#pragma once

#include <string>

#include "diffcp/core/error.hpp"

namespace diffcp {

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace diffcp
