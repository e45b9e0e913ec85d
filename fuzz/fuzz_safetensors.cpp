// libFuzzer target: SafeTensors (io/safetensors.hpp), the reader of model weights and data shards.
// A file either throws diffcp::Error or yields tensors whose typed copies hold prod(shape) values.
#include <cstdint>

#include "diffcp/core/error.hpp"
#include "fuzz_common.hpp"
#include "diffcp/io/safetensors.hpp"

namespace {

template <typename T>
void check(const std::vector<T>& v, const diffcp::SafeTensors::Info& info) {
  std::int64_t count = 1;
  for (std::int64_t d : info.shape) count *= d;
  FUZZ_ASSERT(static_cast<std::int64_t>(v.size()) == count);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static diffcp_fuzz::MemFile file;
  try {
    const diffcp::SafeTensors st(file.write(data, size));
    // SafeTensors does not list its names: probe those the seeds (and the project's files) use.
    for (const char* name : {"a", "b", "x", "tokens", "loss_mask", "offsets", "hidden", "embedding", "lm_head"}) {
      if (!st.has(name)) continue;
      const auto& info = st.info(name);
      if (info.dtype == "F32") check(st.f32(name), info);
      if (info.dtype == "I32") check(st.i32(name), info);
      if (info.dtype == "I64") check(st.i64(name), info);
      if (info.dtype == "U8") check(st.u8(name), info);
      try {
        (void)st.f32(name, 1);  // wrong dtype or rank: must throw, not read
      } catch (const diffcp::Error&) {
      }
    }
  } catch (const diffcp::Error&) {
  }
  return 0;
}
