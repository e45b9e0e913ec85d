// What `diffcp attn` and `diffcp bench cp` share: the workload options turned into a validated,
// seeded problem (same generator for both) and into the spec of the measured layer run, which is
// the library's (testing/layer_run.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "diffcp/balance/cost.hpp"
#include "cli/commands.hpp"
#include "diffcp/cp/cp_layer.hpp"
#include "diffcp/testing/layer_run.hpp"

namespace diffcp::cli {

// The workload and layer shape alone (--samples, --context, --queries, --block, --prompt-fraction,
// --hidden, --n-q, --n-kv, --d-h, --rope-theta, --rms-eps, --dtype, --seed, --J): what `diffcp sim
// cp` reads.
void add_workload_options(CLI::App* c, AttnOptions& opt);
// Registers the options every layer command takes: workload (--samples, --context, --queries,
// --block, --prompt-fraction, --seed), layer shape (--hidden, --n-q, --n-kv, --d-h, --rope-theta,
// --rms-eps, --dtype), measurement (--reps, --warmup), --J, --bucket, --check, --json.
void add_layer_options(CLI::App* c, AttnOptions& opt);

// The options checked (throws diffcp::Error naming the bad value; no communication) and the
// seeded packed batch + layer shape they describe.
struct LayerWorkload {
  std::int64_t queries = 0;  // per sample
  PackedBatch batch;
  AttnLayerConfig cfg;
  DType dtype = DType::f32;  // --dtype: f32 | bf16 (Split-KV's compute = bf16)
};
LayerWorkload make_workload(const AttnOptions& opt);

// The spec of `opt` for one method and layout.
LayerRunSpec layer_run_spec(const AttnOptions& opt, const std::string& method, const std::string& layout,
                            const ReferenceLayerResult* reference);

// --methods: "all" (every name of cp_methods()) or a comma list (no empty or repeated names;
// unknown names are refused where they are used, by cp_method).
std::vector<std::string> parse_method_list(const std::string& text);

}  // namespace diffcp::cli
