// DiT inference as a library session (issue #68): the run policy that `diffcp dit`, the Python
// package (diffcp.diffusers) and the image server share, written once.
//
//   DitRunOptions  what a user asks for, as given: the CLI's flags and Python's keywords fill it.
//   DitRunConfig   those options resolved and checked against the model and P: identical on every
//                  rank, before any communication (its constructor).
//   DitGeneration  one generation's shape, conditioning and sampling options, with the family's
//                  defaults derived (plan_generation).
//   DitSession     the weights, the CFG groups, one exchange and model per pass (rebuilt when the
//                  pass's shape changes), the step cache; a whole sampling run (sample) or one
//                  velocity at a time (velocity / velocity_pair, what a diffusers pipeline calls).
//   DitReport      a run's figures reduced over the ranks (DitSession::report, collective).
//
// Errors name the options' fields in backticks (`cache_ratio`, `cfg_parallel`): Python's keywords
// have these names, and the CLI prints each as its flag (--cache-ratio, cli/commands.hpp cli_flags).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/dit/cache_schedule.hpp"
#include "diffcp/dit/config.hpp"
#include "diffcp/dit/exchange.hpp"
#include "diffcp/dit/model.hpp"
#include "diffcp/dit/run.hpp"
#include "diffcp/dit/sampler.hpp"
#include "diffcp/dit/step_cache.hpp"
#include "diffcp/dit/usp.hpp"
#include "diffcp/dit/weights.hpp"
#include "diffcp/dit/wire.hpp"
#include "diffcp/io/safetensors.hpp"

namespace diffcp {

struct DitRunOptions {
  // The session's: the exchange, precision and weights.
  std::string mode = "flat";            // flat | tapa | vfirst | cocodiff (dit/exchange.hpp)
  std::string dtype = "f32";            // compute: f32 | bf16 (GEMMs, attention, exchanges)
  std::string wire = "auto";            // the exchanges' payload: auto (= dtype) | fp8 (dit/wire.hpp)
  std::string weights_dtype = "auto";   // f32 | bf16 | auto (bf16 when the file's Linear weights are)
  bool shard_weights = false;           // 1/P of every block's weights per rank (dit/weights.hpp)
  bool pack_weights = true;             // bf16 GEMMs: a packed copy of the weights
  bool cfg_parallel = false;            // the two CFG passes on two halves of the ranks (dit/run.hpp)
  std::string step_cache = "none";      // none | fbcache:THRESHOLD (dit/step_cache.hpp)
  std::string cache_schedule = "linear";  // cocodiff: linear | fixed (dit/cache_schedule.hpp)
  double cache_ratio = 1.0;
  int warmup = 5, sync_every = 10;
  int group_size = 0;                   // TAPA's link group L (0: the ranks of a node)
  std::optional<int> ulysses_degree, ring_degree;  // USP (dit/usp.hpp); nullopt: derived
  // A generation's (plan_generation).
  int steps = 50;
  std::string schedule = "auto";        // linear | flux | auto (the pipeline's scheduler, else the family's)
  std::optional<double> guidance;       // nullopt: the family's pipeline default
  double true_cfg_scale = 1.0;          // FLUX.1's true classifier-free guidance
  bool profile = false;                 // per op family timers (needs steps >= 2)
};

struct DitRunConfig {
  // Resolves and checks `o` for `model` on rank `rank` of `P`; `ck` (may be null): the checkpoint
  // the weights will come from, checked against the model (every tensor named, shaped) and read
  // for weights_dtype auto (bf16 when it stores every Linear weight in BF16). Local: no
  // communication, so every rank throws alike.
  DitRunConfig(const DitRunOptions& o, const DitConfig& model, int P, int rank, const SafeTensorsSet* ck = nullptr,
               DitFileFormat format = DitFileFormat::bfl);

  DitRunOptions options;
  DitConfig model;
  ExchangeMode mode = ExchangeMode::flat;
  DType compute = DType::f32, storage = DType::f32;
  Wire wire = Wire::compute;
  CacheSchedule schedule;
  StepCacheSpec step_cache;
  int P = 1, rank = 0;
  int pass_P = 1, pass_rank = 0;  // the ranks of this rank's pass (cfg_parallel: its half)
  int weight_shards = 1;          // shard_weights: pass_P
  UspDegrees deg;                 // over pass_P
};

// Whether the checkpoint stores every Linear weight of `cfg` in BF16.
bool linear_weights_in_bf16(const DitConfig& cfg, const SafeTensorsSet& ck, DitFileFormat format);

struct DitGeneration {
  DitShape shape;
  DitConditioning cond;     // the negative prompt's dropped where no negative pass runs
  SampleOptions opt;        // timesteps, guidance, compute, step cache, true_cfg_scale
  std::string schedule_name;  // linear | flux | flux2 | scheduler_config (UniPC: "scheduler_config (UniPC, order p)")
  DitShard shard;           // this rank's of its pass
  bool negative_pass = false;  // uses_negative_pass: the negative prompt's pass runs too
};

// One generation under `run`: the family's defaults (guidance: FluxPipeline 3.5, Flux2Pipeline 4,
// QwenImagePipeline 4, StableDiffusion3Pipeline 7; the schedule: `scheduler_config` (a diffusers
// pipeline's scheduler/scheduler_config.json, "" when none), else FLUX.2's dynamic shift, else
// flux for guidance-distilled models and linear otherwise) and the checks (guidance on a model
// without one, a negative pass without negative conditioning, cfg_parallel without a negative
// pass, the shards of both passes). `cond` may carry a negative prompt: kept only when its scale is
// above 1. Local: no communication.
DitGeneration plan_generation(const DitRunConfig& run, const DitShape& shape, DitConditioning cond,
                              const std::string& scheduler_config = "");

// A run's figures, reduced over the ranks: per rank per denoising step, averaged over ranks, unless
// said. The closed forms beside the measured counts.
struct DitReport {
  int P = 1, steps = 1, group_size = 1, cfg_passes = 1;  // group_size: the link group L
  double step_ms = 0, exposed_comm_ms = 0;  // medians over steps of the slowest rank's
  double mean_exposed_comm_ms = 0, total_ms = 0;
  double bytes_intra = 0, bytes_inter = 0, messages = 0, ring_bytes = 0, scale_bytes = 0;
  double weight_gather_bytes = 0, weight_gather_wait_ms = 0;
  double cache_bytes = 0, weights_bytes = 0, peak_rss_bytes = 0;  // the largest over ranks
  double v_wait_ms = 0, v_phase1_hidden = 0;  // V-First: blocked on V; fraction of V phase 1s done before the wait
  double cfg_pair_bytes = 0, predicted_cfg_pair_bytes = 0;
  double predicted_weights_bytes = 0, predicted_weight_gather_bytes = 0;
  DitBytesPrediction predicted;
  std::vector<int> steps_computed, steps_cached;  // per pass (step cache)
  std::vector<double> rel_l1;                     // the prompt's pass, rank 0's (NaN: no comparison)
  // With g.opt.profile: per DitPhase (dit/profile.hpp), the slowest rank's ms per step after the first.
  std::vector<double> profile_ms;
};

class DitSession {
 public:
  // Collective over `world` (which must outlive the session): the CFG groups (cfg_parallel; both
  // halves agree that their exchange can be made before any pair traffic), then the weights: `ck`
  // loaded in `format`, or a seeded random init (`weight_seed`) when null.
  DitSession(Communicator& world, DitRunConfig run, const SafeTensorsSet* ck, DitFileFormat format,
             std::uint64_t weight_seed = 1);
  ~DitSession();
  DitSession(const DitSession&) = delete;
  DitSession& operator=(const DitSession&) = delete;

  const DitRunConfig& run() const { return run_; }
  const DitConfig& model() const { return run_.model; }
  const DitWeights& weights() const { return *w_; }
  Communicator& world() { return world_; }
  Communicator& pass_comm() { return groups_ ? *groups_->group : world_; }  // this rank's pass's ranks
  const CfgGroups* cfg_groups() const { return groups_.get(); }

  // One whole sampling run of `g` (Euler, dit/sampler.hpp) from `noise` ([b, N_img, C_in], the same
  // on every rank), on fresh exchanges (its own V-Major caches). Collective.
  DitRun sample(const DitGeneration& g, const std::vector<float>& noise);
  // An exact Flat run of `g` (--compare's reference, testing/dit_compare.hpp flat_reference_for):
  // over the same ranks with Ulysses degree `ulysses`, or, `single_rank`, every rank sampling alone;
  // without the step cache or callbacks. Collective.
  DitRun sample_reference(const DitGeneration& g, const std::vector<float>& noise, bool single_rank, int ulysses);
  // The run's report (the figures above); `g` and `run` as sample's. Collective.
  DitReport report(const DitGeneration& g, const DitRun& run);

  // One pass's velocity, what a diffusers pipeline's transformer call asks for. Collective over the
  // world (every rank calls it with the same shapes in the same order). Pass `pass` keeps its own
  // exchange and model (V-Major's caches, the step cache restarted at step 0), rebuilt when its
  // shape changes.
  //   x: [b, N_img, C_in] the latent tokens (every rank the same; a video's frame-major, N_img = F g_h g_w)
  //   txt: [T, text_dim] shared by the b images, or [b, T, text_dim] each image's own (a batch of prompts)
  //   pooled: [pooled_dim], or [b, pooled_dim] with per-image text (empty in families without one)
  //   token_t: Wan's per-token timesteps in [0, 1] [N_img] (TI2V's image conditioning: the first frame's at 0),
  //            shared by the images; empty: every token at t (t stays the step's, for the schedules)
  //   -> [b, N_img, C_in] the velocity, on every rank
  std::vector<float> velocity(int pass, const DitShape& shape, const std::vector<float>& x, const std::vector<float>& txt,
                              const std::vector<float>& pooled, double t, double guidance, int step, int steps,
                              const std::vector<double>& token_t = {});
  // cfg_parallel: a pair of passes q = 0, 1 at once, pass q on half q (the same b and image size);
  // each pair index of a step keeps its own exchanges. -> {v_0, v_1} on every rank. Collective.
  std::array<std::vector<float>, 2> velocity_pair(int pair, const DitShape& s0, const DitShape& s1,
                                                  const std::array<const std::vector<float>*, 3>& in0,
                                                  const std::array<const std::vector<float>*, 3>& in1, double t,
                                                  double guidance, int step, int steps,
                                                  const std::vector<double>& token_t = {});
  // Per pass that ran ("0", "1", ...; cfg_parallel pairs "pair<i>.<q>": this rank's half q): the
  // step cache's decisions since its step 0.
  std::map<std::string, StepCacheStats> step_cache_stats() const;
  // This rank's exchange counters over every velocity call so far (every pass, rebuilt ones too).
  ExchangeStats exchange_stats() const;

  // Checks a velocity call's shapes: x [b, N_img, C_in] of `frames` latent frames (1: an image) of
  // height x width pixels, txt [T, text_dim] or [b, T, text_dim], pooled [pooled_dim] (with per-image
  // text: [b, pooled_dim]) -> the shape. Local.
  DitShape velocity_shape(const std::vector<std::int64_t>& x, std::int64_t height, std::int64_t width,
                          const std::vector<std::int64_t>& txt, const std::vector<std::int64_t>& pooled,
                          std::int64_t frames = 1) const;

 private:
  struct Pass;
  Pass& pass_run(int key, const DitShape& shape, Communicator& comm);
  std::vector<float> pass_velocity(Pass& r, const std::vector<float>& x, const std::vector<float>& txt,
                                   const std::vector<float>& pooled, double t, double guidance, int step, int steps,
                                   const std::vector<double>& token_t);

  Communicator& world_;
  DitRunConfig run_;
  std::unique_ptr<CfgGroups> groups_;
  std::unique_ptr<DitWeights> w_;
  std::map<int, std::unique_ptr<Pass>> passes_;  // by pass (cfg_parallel pairs: kPairKey + 2 pair + q)
  ExchangeStats retired_;                        // the counters of exchanges rebuilt for another shape
};

}  // namespace diffcp
