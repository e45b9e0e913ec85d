// libFuzzer target: a diffusers folder's JSON (dit/diffusers.hpp), `diffcp dit --weights DIR`: the
// first byte picks the parser ('s': scheduler/scheduler_config.json, flow_match_scheduler_from_json,
// then every family's pipeline sigmas; otherwise transformer/config.json, dit_config_from_diffusers).
// An accepted model config must be a valid model with a layout; accepted sigmas are numbers in
// [0, 1], non-increasing, ending at 0.
#include <cmath>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "diffcp/core/error.hpp"
#include "diffcp/dit/diffusers.hpp"
#include "fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const nlohmann::json j = nlohmann::json::parse(data + 1, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  try {
    if (data[0] == 's') {
      const diffcp::FlowMatchEulerScheduler s = diffcp::flow_match_scheduler_from_json(j, "fuzz");
      for (const diffcp::DitFamily f :
           {diffcp::DitFamily::flux1, diffcp::DitFamily::qwen_image, diffcp::DitFamily::flux2, diffcp::DitFamily::sd3})
        for (const int steps : {1, 4, 50})
          for (const std::int64_t tokens : {std::int64_t{1}, std::int64_t{4096}, std::int64_t{1} << 20}) {
            try {
              const std::vector<double> sig = s.pipeline_sigmas(steps, tokens, f);
              FUZZ_ASSERT(sig.size() == static_cast<std::size_t>(steps) + 1 && sig.back() == 0);
              for (std::size_t k = 0; k < sig.size(); ++k)
                FUZZ_ASSERT(std::isfinite(sig[k]) && sig[k] >= 0 && sig[k] <= 1 && (k == 0 || sig[k] <= sig[k - 1]));
            } catch (const diffcp::Error&) {
            }
          }
    } else {
      const diffcp::DitConfig c = diffcp::dit_config_from_diffusers(j, "fuzz");
      c.validate();
      const diffcp::DitLayout layout(c);
      FUZZ_ASSERT(layout.parameters > 0 && layout.total >= layout.parameters);
    }
  } catch (const diffcp::Error&) {
  }
  return 0;
}
