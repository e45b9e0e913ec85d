// libFuzzer target: read_npy_f32 (io/npy.hpp), the reader of --reference latents and dumps.
#include <cstdint>

#include "diffcp/core/error.hpp"
#include "fuzz_common.hpp"
#include "diffcp/io/npy.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static diffcp_fuzz::MemFile file;
  try {
    std::vector<std::int64_t> shape;
    const std::vector<float> v = diffcp::read_npy_f32(file.write(data, size), shape);
    std::int64_t count = 1;
    for (std::int64_t d : shape) {
      FUZZ_ASSERT(d >= 0);
      count *= d;
    }
    FUZZ_ASSERT(static_cast<std::int64_t>(v.size()) == count);
  } catch (const diffcp::Error&) {
  }
  return 0;
}
