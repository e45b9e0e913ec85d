// libFuzzer target: DitWeights::load (dit/model.hpp), `diffcp dit --weights`, on a micro DiT
// config (fuzz_configs.hpp, shared with the seed generator).
#include <cstdint>

#include "diffcp/core/error.hpp"
#include "diffcp/dit/model.hpp"
#include "fuzz_common.hpp"
#include "fuzz_configs.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static diffcp_fuzz::MemFile file;
  static const diffcp::DitConfig cfg = diffcp_fuzz::micro_dit_config();
  try {
    diffcp::DitWeights w(cfg);
    w.load(file.write(data, size));
    FUZZ_ASSERT(w.bytes() == diffcp::dit_weight_bytes(w.layout(), diffcp::DType::f32, 1));
  } catch (const diffcp::Error&) {
  }
  return 0;
}
