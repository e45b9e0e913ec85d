// A `diffcp dit` run as library calls (the CLI parses and prints; the Python package and the
// benchmarks can call the same): one sampling run with an exchange over the ranks, and the closed
// forms of its bytes and memory per rank.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/dit/cache_schedule.hpp"
#include "diffcp/dit/config.hpp"
#include "diffcp/dit/exchange.hpp"
#include "diffcp/dit/sampler.hpp"

namespace diffcp {

// The run's precision rules (dit/session.hpp DitRunConfig); `what` names the option in the errors.
//   compute_dtype (core/dtype.hpp): "f32" | "bf16" -> the compute dtype (GEMMs, attention, exchanges)
//   weights_dtype:  "f32" | "bf16" | "auto" (= bf16 when the file's Linear weights are bf16,
//                   `file_is_bf16`) -> the Linear weights' dtype in memory
//   check_shard_weights: sharded weights computed in bf16 need them stored in bf16 (a block's
//                   gathered slice is the GEMM's operand; f32 shards would be gathered to be rounded)
DType weights_dtype(const std::string& name, bool file_is_bf16, const char* what);
void check_shard_weights(bool shard, DType storage, DType compute, const char* shard_what, const char* weights_what);

// CFG-parallel: the P ranks of a world as two halves, each running one pass of classifier-free
// guidance with its own exchange over `group` (ranks [0, P/2): the prompt's pass, [P/2, P): the
// negative prompt's). Rank q of one half and rank q of the other hold the same image rows and trade
// their velocities over `pair` (one all-gather of b I_p C_in floats a step: cfg_pair_bytes), so both
// combine them alike and every rank continues with the same latent. The halves are consecutive
// ranks, so each pass's all-to-alls stay inside its half (a node, when a node holds P/2 ranks) and
// only the latent-sized velocities cross.
struct CfgGroups {
  std::unique_ptr<Communicator> group;  // this rank's half: P/2 ranks
  std::unique_ptr<Communicator> pair;   // {q, P/2 + q}: pair rank = the pass (0 prompt, 1 negative)
  int pass() const { return pair->rank(); }
};
// Collective over world. Throws on every rank alike, before any communication, for an odd P
// (two equal halves; P = 3 is refused, not split 2 + 1).
CfgGroups make_cfg_groups(Communicator& world);
// Bytes one rank sends over its pair per step: b I_p C_in f32 (I_p of the half's shard).
std::uint64_t cfg_pair_bytes(const DitConfig& cfg, const DitShape& shape, const DitShard& half_shard);

// One sampling run of `opt.timesteps` steps (Euler, or UniPC: opt.unipc) with `ex` over `world`, from `noise`
// ([b, N_img, C_in], every rank the same). Collective. Classifier-free guidance
// (uses_negative_pass) runs the negative prompt's pass on `negative_ex` (required then: an exchange
// of the same mode over the same ranks; V-Major keeps its own caches there), or, with `cfg_groups`
// (CFG-parallel), on the other half: `ex` is then over cfg_groups->group and negative_ex null.
// opt.step_cache: each pass's model decides over the ranks that run it.
struct DitRun {
  std::vector<float> latent;             // [b, N_img, C_in], gathered on every rank
  std::vector<double> step_ms, comm_ms;  // per step: the slowest rank's
  ExchangeStats stats;                   // this rank's counters (both passes; CFG-parallel: its pass)
  std::uint64_t cache_bytes = 0;         // this rank's V-Major caches (both passes; CFG-parallel: its pass)
  std::uint64_t cfg_pair_bytes = 0;      // CFG-parallel: bytes this rank sent to its pair (the pair's counters)
  // Step caching per pass (0: the prompt's, 1: the negative's; the same on every rank):
  // steps fully computed and cached (0, 0 without a cache or a pass), and this rank's pass's
  // rel_l1 per step (dit/step_cache.hpp).
  int steps_computed[2] = {0, 0}, steps_cached[2] = {0, 0};
  std::vector<double> rel_l1;
  int group_size = 1, link_group_size = 1;  // the exchange's (dit/exchange.hpp)
};
DitRun run_dit_sampling(Communicator& world, const DitWeights& w, const DitShape& shape, AttentionExchange& ex,
                        const DitConditioning& cond, const std::vector<float>& noise, const SampleOptions& opt,
                        AttentionExchange* negative_ex = nullptr, const CfgGroups* cfg_groups = nullptr);

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
  DitBytesPrediction& operator*=(double f);                     // every count scaled (CFG-parallel: the mean of the passes)
};
DitBytesPrediction dit_predicted_bytes(const DitConfig& cfg, const DitShape& shape, const DitShard& shard, UspDegrees deg,
                                       int P, ExchangeMode mode, const CacheSchedule& schedule, int steps, int group_size,
                                       int link_group_size, DType compute, Wire wire = Wire::compute);

// Memory per rank: the weights (dit/weights.hpp: matrices in `storage`, replicated or sharded over
// `weight_shards` ranks with two gather windows; vectors in f32; plus, for f32 matrices under bf16
// compute, their bf16 copy; plus, where the GEMMs read bf16 weights, the packed copies
// DitWeights::packed makes when the backend packs (the CPU with a native bf16 matmul: 2 bytes per
// matrix element; sharded, of units[0] and at most the largest Linear of a block; the layout's
// padding not counted)) and
// the model's activation buffers (dit/model.hpp). Ulysses and Ring split tokens and heads of the
// activations, not the weights.
struct DitMemory {
  double weight_bytes = 0, activation_bytes = 0;
};
DitMemory dit_memory_per_rank(const DitConfig& cfg, const DitShape& shape, const DitShard& shard,
                              DType storage = DType::f32, int weight_shards = 1, DType compute = DType::f32,
                              bool packed_weights = true);

}  // namespace diffcp
