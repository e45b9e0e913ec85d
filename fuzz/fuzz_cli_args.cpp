// libFuzzer target: the CLI's size and range arguments (parse_count "16k", parse_range "a:b";
// cli/commands.hpp). A value is either refused with diffcp::Error or non-negative, with a range's
// end at or above its start.
#include <cstdint>
#include <string>

#include "cli/commands.hpp"
#include "diffcp/core/error.hpp"
#include "fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    FUZZ_ASSERT(diffcp::cli::parse_count(text, "--fuzz") >= 0);
  } catch (const diffcp::Error&) {
  }
  try {
    const diffcp::cli::CountRange r = diffcp::cli::parse_range(text, "--fuzz");
    FUZZ_ASSERT(r.min >= 0 && (r.max == 0 || r.max >= r.min));
  } catch (const diffcp::Error&) {
  }
  return 0;
}
