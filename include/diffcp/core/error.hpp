// diffcp's one error policy.
//
// Validate at the boundary (CLI, file readers, config constructors, public kernel entry points)
// and throw diffcp::Error whose message names the bad value and what was expected. The library
// names an option by its field in backticks (`cache_ratio`: Python's keyword), never by a CLI
// flag; the CLI prints each as its flag (--cache-ratio, src/cli/options.cpp cli_flags). In MPI
// programs, diffcp::run_mpi_main (comm/mpi_runtime.hpp) turns an exception on any rank into
// MPI_Abort of the whole job with that message: no rank is left waiting in a collective.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace diffcp {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
[[noreturn]] void throw_error(const char* file, int line, const char* func, const std::string& msg);

inline void format_into(std::ostringstream&) {}
template <typename T, typename... Rest>
void format_into(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  format_into(os, rest...);
}
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  format_into(os, args...);
  return os.str();
}
}  // namespace detail

}  // namespace diffcp

// DIFFCP_CHECK(cond, msg parts...): throws diffcp::Error("file:line (func): msg") when cond is
// false. The message parts are streamed, e.g. DIFFCP_CHECK(n_q % n_kv == 0, "n_q=", n_q, ...).
#define DIFFCP_CHECK(cond, ...)                                                            \
  do {                                                                                     \
    if (!(cond)) [[unlikely]]                                                              \
      ::diffcp::detail::throw_error(__FILE__, __LINE__, __func__,                          \
                                    ::diffcp::detail::concat(__VA_ARGS__));                \
  } while (0)

#define DIFFCP_FAIL(...) \
  ::diffcp::detail::throw_error(__FILE__, __LINE__, __func__, ::diffcp::detail::concat(__VA_ARGS__))
