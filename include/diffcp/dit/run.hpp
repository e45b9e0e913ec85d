// A `diffcp dit` run as library calls (the CLI parses and prints; the Python package and the
// benchmarks can call the same): one sampling run with an exchange over the ranks, and the closed
// forms of its bytes and memory per rank.
#pragma once

#include <cstdint>
#include <vector>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/dit/cache_schedule.hpp"
#include "diffcp/dit/config.hpp"
#include "diffcp/dit/exchange.hpp"
#include "diffcp/dit/sampler.hpp"

namespace diffcp {

// One sampling run of `opt.timesteps` Euler steps with `ex` over `world`, from `noise`
// ([b, N_img, C_in], every rank the same). Collective. Classifier-free guidance
// (uses_negative_pass) runs the negative prompt's pass on `negative_ex` (required then: an exchange
// of the same mode over the same ranks; V-Major keeps its own caches there).
struct DitRun {
  std::vector<float> latent;             // [b, N_img, C_in], gathered on every rank
  std::vector<double> step_ms, comm_ms;  // per step: the slowest rank's
  ExchangeStats stats;                   // this rank's counters (both passes)
  std::uint64_t cache_bytes = 0;         // this rank's V-Major caches (both passes)
};
DitRun run_dit_sampling(Communicator& world, const DitWeights& w, const DitShape& shape, AttentionExchange& ex,
                        const DitConditioning& cond, const std::vector<float>& noise, const SampleOptions& opt,
                        AttentionExchange* negative_ex = nullptr);

// The closed forms of a run's bytes across link groups, per rank per step: P ranks, USP degrees
// `deg`, the Ulysses exchange in groups of `group_size` (TAPA's L, at most U), link groups of
// `link_group_size` ranks (Ring's K|V counts across groups for the ranks whose ring successor lies
// in another link group), `steps` steps, payloads in `compute` sent in `wire` (dit/wire.hpp).
struct DitBytesPrediction {
  double inter = 0;       // this run's: CoCoDiff's cache schedule; every other mode moves TAPA's
  double tapa_inter = 0;  // TAPA's, for the same run
  double qkv = 0, tapa_qkv = 0;  // of inter / tapa_inter: the q|k|v phase 2 bytes
  double ring = 0;        // USP: Ring's K|V (every link class)
  double scales = 0;      // fp8 wire: of everything this rank sends (intra + inter + ring), the scale bytes
  double inter_ratio() const { return inter > 0 ? tapa_inter / inter : 1.0; }
  double qkv_ratio() const { return qkv > 0 ? tapa_qkv / qkv : 1.0; }  // TAPA's q|k|v phase 2 over this run's
  DitBytesPrediction& operator+=(const DitBytesPrediction& o);  // two passes of a step (classifier-free guidance)
};
DitBytesPrediction dit_predicted_bytes(const DitConfig& cfg, const DitShape& shape, const DitShard& shard, UspDegrees deg,
                                       int P, ExchangeMode mode, const CacheSchedule& schedule, int steps, int group_size,
                                       int link_group_size, DType compute, Wire wire = Wire::compute);

// Memory per rank: the weights (dit/weights.hpp: matrices in `storage`, replicated or sharded over
// `weight_shards` ranks with two gather windows; vectors in f32; plus, for f32 matrices under bf16
// compute, their bf16 copy) and the model's activation buffers (dit/model.hpp). Ulysses and Ring
// split tokens and heads of the activations, not the weights.
struct DitMemory {
  double weight_bytes = 0, activation_bytes = 0;
};
DitMemory dit_memory_per_rank(const DitConfig& cfg, const DitShape& shape, const DitShard& shard,
                              DType storage = DType::f32, int weight_shards = 1, DType compute = DType::f32);

}  // namespace diffcp
