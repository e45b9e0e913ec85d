#include <algorithm>
#include <cctype>
#include <limits>

#include "cli/commands.hpp"
#include "diffcp/core/error.hpp"

namespace diffcp::cli {

std::int64_t parse_count(const std::string& text, const char* flag) {
  std::size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  std::int64_t mult = 1;
  const std::string suffix = text.substr(i);
  if (suffix == "k" || suffix == "K") mult = 1024;
  else if (suffix == "m" || suffix == "M") mult = 1024 * 1024;
  DIFFCP_CHECK(i > 0 && i <= 15 && (suffix.empty() || mult > 1), flag, " = '", text,
               "': expected a non-negative count like 300, 16k or 1m");
  const std::int64_t value = std::stoll(text.substr(0, i));
  DIFFCP_CHECK(value <= std::numeric_limits<std::int64_t>::max() / mult, flag, " = '", text,
               "': too large (the largest count is 2^63 - 1)");
  return value * mult;
}

std::string dtype_cost_note(const std::string& dtype) {
  if (dtype != "bf16" || active_backend().native_arithmetic(DType::bf16)) return "";
  return " (bf16 converted to f32 for every GEMM: no bf16 instructions in use on this CPU, slower than f32 here)";
}

std::string cli_flags(const std::string& message) {
  std::string out;
  for (std::size_t i = 0; i < message.size(); ++i) {
    std::size_t j = i + 1;
    while (message[i] == '`' && j < message.size() &&
           (std::islower(static_cast<unsigned char>(message[j])) || std::isdigit(static_cast<unsigned char>(message[j])) ||
            message[j] == '_'))
      ++j;
    if (message[i] != '`' || j == i + 1 || j >= message.size() || message[j] != '`' ||
        !std::islower(static_cast<unsigned char>(message[i + 1]))) {
      out += message[i];
      continue;
    }
    std::string flag = "--" + message.substr(i + 1, j - i - 1);
    std::replace(flag.begin(), flag.end(), '_', '-');
    out += flag;
    i = j;
  }
  return out;
}

CountRange parse_range(const std::string& text, const char* flag) {
  const auto colon = text.find(':');
  if (colon == std::string::npos) return {parse_count(text, flag), 0};
  const CountRange r{parse_count(text.substr(0, colon), flag), parse_count(text.substr(colon + 1), flag)};
  DIFFCP_CHECK(r.max >= r.min, flag, " = '", text, "': the range's end is below its start");
  return r;
}


}  // namespace diffcp::cli
