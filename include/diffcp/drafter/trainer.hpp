// `diffcp train`: DFlash drafter training with Split-KV on a data-parallel x context-parallel
// mesh (SPEC A.1-A.3). Per step and DP rank: `accum` packed micro-batches, each with freshly
// sampled anchors (seeded by seed, step, DP rank and micro-batch, so every CP rank agrees), an LPT
// plan and one redistribution of the context rows; gradients are summed over the whole mesh,
// divided by the global loss weight, clipped, and applied with AdamW on a cosine schedule.
// Everything is deterministic in (seed, step): a run resumed from a checkpoint reproduces the
// uninterrupted run bitwise on the same mesh. Recipe (SPEC A.1, as the reference trainer): a
// sample longer than --context is right-truncated (its first `context` tokens kept); the packs
// are visited in a fresh seeded order every epoch; samples with fewer candidate anchor positions
// than --anchors get all of theirs (and are counted); the held-out tau compares the draft with
// the target's greedy tokens when the shards carry them (`target_greedy`), else with the dataset.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "diffcp/comm/communicator.hpp"

namespace diffcp {

struct TrainOptions {
  std::string preset;              // tiny | small | qwen3.5-35b-a3b | qwen3.5-27b; empty = tiny (or --init's)
  std::string init;                // start from a DFlash drafter directory (its config.json gives the shape)
  std::int64_t steps = 400;
  int cp = 0, dp = 1;              // cp = 0: world size / dp
  std::int64_t accum = 2;          // micro-batches per DP rank per step (global batch = dp * accum)
  std::int64_t context = 1024;     // tokens per packed micro-batch
  std::int64_t anchors = 0;        // anchors per sample; 0 = the preset's (tiny, small: 12; real shapes: 512, SPEC A.1)
  double lr = 0;                   // peak learning rate; 0 = the preset's (tiny, small: 5e-3; real shapes: 6e-4)
  double weight_decay = 0.1, clip = 1.0, warmup = 0.04;
  std::uint64_t seed = 1;
  std::string data;                // shard directory; empty = the synthetic default
  std::int64_t heldout = 16;       // held-out samples when reading shards
  std::string out;                 // checkpoint directory (empty = no checkpoints)
  std::int64_t save_every = 0;     // 0 = only at the end
  bool resume = false;
  std::string log;                 // JSONL metrics file
  std::int64_t eval_every = 100;
  std::string balancer = "lpt";
  int J = 4;
  std::int64_t bucket = 512;
  std::string collectives = "auto";  // Split-KV's: flat | hierarchical | auto (= hierarchical; flat on one node)
  std::int64_t stop_at = 0;        // stop after this step as if killed (tests resume); 0 = off
  bool progress = true;
  // Model state over the mesh (drafter/sharded_state.hpp): none | optimizer | full | auto (= full
  // for the real shapes (vocabulary > 4096) on more than one rank: the only mode whose memory per
  // rank falls as 1/P for every part of the state; none for the synthetic shapes, whose state
  // fits, and on one rank). With optimizer or full the LM head is vocabulary-parallel over the CP
  // group (drafter/lm_head.hpp).
  std::string shard = "auto";
  // Activation recomputation (Drafter::set_recompute): on | off | auto (= on with --shard full,
  // where memory is what the run is short of).
  std::string recompute = "auto";
  bool keep_params = true;         // gather the trained parameters into TrainResult::params
};

struct TrainResult {
  double loss = 0, tau = 0, uniform_loss = 0;  // last step's loss, last held-out tau, log(V)
  std::string checkpoint;
  std::vector<float> params;  // the trained parameters
  double tokens_per_s = 0;    // mean over the steps of this run
  double step_ms = 0;         // median step time of this run
  double peak_rss_mb = 0;     // max over ranks of the process' peak resident memory
  std::string topology;       // of the CP group (Topology::describe)
  std::string collectives;    // what Split-KV ran: flat | hierarchical
  std::string tau_reference;  // what tau compares the drafts with: "target greedy tokens" | "dataset tokens"
  std::int64_t truncated = 0;      // training samples longer than --context, right-truncated to it
  std::int64_t few_anchors = 0;    // training samples with fewer candidate anchor positions than --anchors
  double lr = 0;                   // the peak learning rate used
  std::int64_t anchors = 0;        // the anchors per sample used
  std::string shard;               // the --shard mode used
  bool recompute = false;          // whether activations were recomputed
  // Per-phase wall time, mean ms per step over this run (rank 0): target features (building
  // the micro-batches: synthetic target or shard reads, plan, redistribution), fusion, attention,
  // mlp, lm_head (+ loss), gather_wait (parameter all-gathers not hidden by prefetch),
  // reduce (gradient reduction + norm), optimizer.
  std::vector<std::pair<std::string, double>> phases;
  double state_mb = 0;             // max over ranks of the model state's bytes (sharded_state.hpp)
  double lm_head_mb = 0;           // max over ranks of the LM head slice held
};

TrainResult train(Communicator& world, const TrainOptions& opt);

}  // namespace diffcp
