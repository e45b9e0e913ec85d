// libFuzzer target: read_anchors_file (workload/batch.hpp), `diffcp plan --anchors-file`.
// An accepted batch must be usable: its sizes and block list computed without overflow.
#include <cstdint>

#include "diffcp/core/error.hpp"
#include "fuzz_common.hpp"
#include "diffcp/workload/batch.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static diffcp_fuzz::MemFile file;
  try {
    const diffcp::PackedBatch b = diffcp::read_anchors_file(file.write(data, size));
    FUZZ_ASSERT(b.block >= 1 && b.num_samples() >= 1);
    const std::int64_t S = b.context_rows();
    FUZZ_ASSERT(S >= b.num_samples());
    const std::int64_t Q = b.query_rows();
    FUZZ_ASSERT(Q >= 0);
    const auto blocks = b.blocks();
    FUZZ_ASSERT(static_cast<std::int64_t>(blocks.size()) == b.num_blocks());
    for (const auto& r : blocks) FUZZ_ASSERT(r.anchor >= r.sample_start && r.anchor + b.block <= S);
  } catch (const diffcp::Error&) {
  }
  return 0;
}
