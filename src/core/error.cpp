#include "diffcp/core/error.hpp"

#include <cstring>

namespace diffcp::detail {

void throw_error(const char* file, int line, const char* func, const std::string& msg) {
  const char* base = std::strrchr(file, '/');
  std::ostringstream os;
  os << msg << " [" << (base ? base + 1 : file) << ':' << line << " in " << func << ']';
  throw Error(os.str());
}

}  // namespace diffcp::detail
