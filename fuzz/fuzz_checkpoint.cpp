// libFuzzer target: load_checkpoint (drafter/checkpoint.hpp), `diffcp train --resume`.
// The first input byte is a mode: odd = "rewrite the trailing FNV-1a checksum to match" so that
// the fuzzer gets past the checksum into the header and size checks; even = the bytes as they are.
#include <cstdint>
#include <cstring>
#include <vector>

#include "diffcp/core/error.hpp"
#include "diffcp/drafter/checkpoint.hpp"
#include "fuzz_common.hpp"

namespace {
// The checkpoint's checksum (drafter/checkpoint.cpp): FNV-1a 64 of everything before the last 8 bytes.
std::uint64_t fnv1a(const std::uint8_t* p, std::size_t n) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static diffcp_fuzz::MemFile file;
  if (size == 0) return 0;
  std::vector<std::uint8_t> bytes(data + 1, data + size);
  if ((data[0] & 1) && bytes.size() >= 8) {
    const std::uint64_t h = fnv1a(bytes.data(), bytes.size() - 8);
    std::memcpy(bytes.data() + bytes.size() - 8, &h, 8);
  }
  try {
    const diffcp::Checkpoint ck = diffcp::load_checkpoint(file.write(bytes.data(), bytes.size()));
    FUZZ_ASSERT(ck.m.size() == ck.params.size() && ck.v.size() == ck.params.size());
    FUZZ_ASSERT(ck.params.size() * 3 * sizeof(float) < bytes.size());
  } catch (const diffcp::Error&) {
  }
  return 0;
}
