// DFlash drafter training with Split-KV on a data-parallel x context-parallel mesh (SPEC A.1-A.3),
// as a library class: `diffcp train` (src/cli/train.cpp) is one client of it.
//
// Per step and DP rank: `accum` packed micro-batches, each with freshly sampled anchors (seeded
// by seed, step, DP rank and micro-batch, so every CP rank agrees), an LPT plan and one
// redistribution of the context rows; gradients are summed over the whole mesh, divided by the
// global loss weight, clipped, and applied with AdamW on a cosine schedule. Everything is
// deterministic in (seed, step): a run resumed from a checkpoint reproduces the uninterrupted run
// bitwise on the same mesh. Recipe (SPEC A.1, as the reference trainer): a sample longer than
// `context` is right-truncated (its first `context` tokens kept); the packs are visited in a fresh
// seeded order every epoch; samples with fewer candidate anchor positions than `anchors` get all
// of theirs (and are counted); the held-out tau compares the draft with the target's greedy
// tokens when the shards carry them (`target_greedy`), else with the dataset.
//
// The library prints nothing: progress reaches the caller through a TrainLogger. Errors name the
// options as `TrainOptions::<field>` (the CLI shows them as its flags, `--<field>` with '-' for '_').
//
// Call order: the constructor, step(), evaluate(), save(), run() and result() are collective
// over the world communicator: every rank makes the same calls in the same order. Wrong:
//   if (world.rank() == 0) trainer.save(path);   // the other ranks never join: a hang
// Right:
//   trainer.save(path);                           // rank 0 writes, every rank takes part
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "diffcp/comm/communicator.hpp"

namespace diffcp {

struct TrainOptions {
  std::string preset;              // tiny | small | qwen3.5-35b-a3b | qwen3.5-27b | qwen3.8-27b-dflash2; empty = tiny (or init's)
  // dflash | dflash2 (the preset's DFlash2 variant: drafter/config.hpp as_dflash2); empty = the
  // preset's or init's own
  std::string arch;
  double selector_weight = 1.0;    // DFlash2: lambda, the candidate selector's loss weight
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
  std::string out;                 // checkpoint directory (empty = no checkpoints); out/checkpoint.bin
  std::int64_t save_every = 0;     // run(): checkpoint every N steps; 0 = only at the end
  bool resume = false;             // the constructor loads out/checkpoint.bin and continues from its step
  std::int64_t eval_every = 100;   // step(): held-out evaluation every N steps (and after the last); 0 = last only
  std::string balancer = "lpt";
  int J = 4;
  std::int64_t bucket = 512;
  std::string collectives = "auto";  // Split-KV's: flat | hierarchical | auto (= hierarchical; flat on one node)
  std::int64_t stop_at = 0;        // run(): stop after this step as if killed (tests resume); 0 = off
  // Model state over the mesh (drafter/sharded_state.hpp): none | optimizer | full | auto (= full
  // for the real shapes (vocabulary > 4096) on more than one rank: the only mode whose memory per
  // rank falls as 1/P for every part of the state; optimizer (ZeRO-1) for the synthetic shapes on
  // more than one rank: the replicated AdamW step would not scale, the parameters fit; none on one
  // rank). With full the frozen LM head is vocabulary-parallel over the CP group too
  // (drafter/lm_head.hpp); optimizer (ZeRO-1) shards the optimizer state only and keeps it whole:
  // a split head computes the logits of every row of the group, so it saves memory, not time.
  std::string shard = "auto";
  // Split-KV's output projection (cp/splitkv.hpp): all | owned | auto (= owned when n_q d_h <= H:
  // its reduce-scatter moves no more bytes than all's and the projection's FLOPs divide by P; all
  // otherwise, e.g. qwen3.5-35b-a3b's n_q d_h = 2 H, where all moves fewer bytes; qwen3.5-27b's
  // n_q d_h = 0.8 H gets owned).
  std::string oproj = "auto";
  // Activation recomputation (Drafter::set_recompute): on | off | auto (= on with shard full,
  // where memory is what the run is short of).
  std::string recompute = "auto";
  // Compute precision: f32, or bf16 mixed precision — the attention (Split-KV compute = bf16, its
  // row payloads bf16) and every GEMM in bf16 with f32 accumulation (ScopedF32GemmCompute);
  // master weights, AdamW state, activations between ops, the loss and the gradient reduction f32.
  std::string dtype = "f32";
  bool keep_params = true;         // result() gathers the trained parameters into TrainResult::params
};

// What the run is and did. summary() holds the part known on this rank without communication
// (the setup, the last loss and tau); result() adds the measured and mesh-wide parts.
struct TrainResult {
  double loss = 0, tau = 0, uniform_loss = 0;  // last step's loss, last held-out tau, log(V)
  std::string checkpoint;     // out/checkpoint.bin, or empty without TrainOptions::out
  std::vector<float> params;  // the trained parameters (result() with TrainOptions::keep_params)
  double tokens_per_s = 0;    // mean over the steps of this run
  double step_ms = 0;         // median step time of this run
  double peak_rss_mb = 0;     // max over ranks of the process' peak resident memory
  std::string topology;       // of the CP group (Topology::describe)
  std::string collectives;    // what Split-KV ran: flat | hierarchical
  std::string tau_reference;  // what tau compares the drafts with: "target greedy tokens" | "dataset tokens"
  std::int64_t train_samples = 0;  // training samples of the data source
  std::int64_t truncated = 0;      // training samples longer than context, right-truncated to it
  std::int64_t few_anchors = 0;    // training samples with fewer candidate anchor positions than anchors
  double lr = 0;                   // the peak learning rate used
  std::int64_t anchors = 0;        // the anchors per sample used
  std::string shard;               // the shard mode used: none | optimizer | full
  std::string oproj;               // Split-KV's output projection used: all | owned
  bool recompute = false;          // whether activations are recomputed
  std::string dtype;               // the compute precision used: f32 | bf16
  // Per-phase wall time, mean ms per step over this run (rank 0): target_features (building
  // the micro-batches: synthetic target or shard reads, anchors, plan), redistribution (the
  // all-to-all of the context features to their planned ranks), fusion, attention (Split-KV with
  // its projections and collectives) and attention_comm (the part of attention in its exposed
  // collectives: transfers and waits for the other ranks; not added again in a sum), mlp,
  // lm_head (+ loss), gather_wait (parameter all-gathers not hidden by prefetch), reduce
  // (gradient reduction + norm), optimizer. The model's phases include the evaluations' forwards.
  std::vector<std::pair<std::string, double>> phases;
  double state_mb = 0;             // max over ranks of the model state's bytes (sharded_state.hpp)
  double lm_head_mb = 0;           // max over ranks of the LM head slice held (this rank's in summary())
};

// One optimizer step. loss, lr, grad_norm, tokens, slot_accuracy and tau are mesh-wide (the same
// on every rank); the times are this rank's.
struct StepStats {
  std::int64_t step = 0;           // steps done, this one included (1-based)
  double loss = 0;                 // global batch: loss sum / loss weight
  double lr = 0;                   // the learning rate applied (cosine schedule)
  double grad_norm = 0;            // global L2 norm of the gradient, before clipping
  double tokens = 0;               // tokens of the global batch
  double ms = 0;                   // wall time of the step (without the evaluation)
  double tokens_per_s = 0;         // tokens / time
  std::vector<double> slot_accuracy;  // [block - 1]: share of argmax == target at block slot k = 1..block-1
                                      // (DFlash2: the selector's choice == target)
  // DFlash2: the share of loss rows whose target is among the selector's candidates, and of those
  // rows the selector chose right (teacher forcing); the selector's part of loss
  std::optional<double> candidate_recall, selector_accuracy, selector_loss;
  std::optional<double> tau;       // held-out acceptance length, when step() evaluated after this step
  std::vector<std::pair<std::string, double>> phases;  // this step's ms per phase (TrainResult::phases' names)
};

// What the trainer reports while it runs, on every rank (a printer typically acts on rank 0).
struct TrainEvent {
  enum class Kind { step, checkpoint };
  Kind kind = Kind::step;
  std::int64_t step = 0;              // steps done when it happened
  const StepStats* stats = nullptr;   // Kind::step: the step just taken (valid during the call)
  std::string checkpoint;             // Kind::checkpoint: the file just written
};
using TrainLogger = std::function<void(const TrainEvent&)>;

class Trainer {
 public:
  // Validates the options, splits the world into the DP x CP mesh (CP groups are consecutive
  // ranks), builds the data source, the model and its (sharded) state, and with
  // TrainOptions::resume loads out/checkpoint.bin (any mesh may have written it).
  Trainer(Communicator& world, TrainOptions opt, TrainLogger log = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // One optimizer step (step_index() + 1 of TrainOptions::steps), then the held-out evaluation
  // when TrainOptions::eval_every says so or it was the last step; reports a Kind::step event.
  StepStats step();
  // Greedy acceptance length tau on the held-out micro-batches (per block 1 + the matching prefix
  // of the draft's argmax and the reference tokens; mean per response, then over responses);
  // 0 without held-out samples. Changes no model state; summary().tau becomes the result.
  double evaluate();
  // Writes a checkpoint of the current step to `path` (rank 0 writes; full vectors whatever the
  // mesh, so another mesh can resume it); reports a Kind::checkpoint event.
  void save(const std::string& path);
  // Steps until TrainOptions::steps (or stop_at), checkpointing to checkpoint_path() every
  // save_every steps and at the end (not after a stop_at), and returns result().
  TrainResult run();
  // Collective: summary() plus median step time, throughput, phases, memory (max over ranks) and,
  // with TrainOptions::keep_params, the gathered parameters.
  TrainResult result();

  std::int64_t step_index() const;  // steps done (a resumed run starts at the checkpoint's)
  const TrainOptions& options() const;
  const TrainResult& summary() const;
  const std::string& checkpoint_path() const;  // out/checkpoint.bin, or empty without TrainOptions::out

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Trainer(world, opt, log).run(): the whole run.
TrainResult train(Communicator& world, const TrainOptions& opt, TrainLogger log = {});

}  // namespace diffcp
