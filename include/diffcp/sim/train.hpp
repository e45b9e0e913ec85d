// `diffcp sim train`: the predicted optimizer-step time and throughput of DFlash drafter training
// (drafter/trainer.hpp) on P = DP x CP ranks of a profile's machine (sim/machine.hpp).
//
// Legend: P ranks, CP group size C (consecutive ranks: a CP group fills a node first, as the
//         trainer's world.split), DP = P / C replicas, A micro-batches per replica per step
//         (global batch DP x A), S context rows (packed tokens) and Q = N B query rows of one
//         micro-batch, C_p = S / C context rows and Q_p = ceil(N / C) B query rows of the busiest
//         CP rank, H hidden, F SwiGLU width, V vocab, n_t target layers, L drafter layers,
//         W trainable parameters (DrafterLayout::total).
//
// The micro-batch: make_random_batch (SPEC A.5's generator) of S / sample_length samples of
// sample_length tokens with min(anchors, candidates) anchors each (the trainer likewise gives a
// sample with too few candidate positions all of its own).
//
// Per step (the trainer's loop: the A micro-batches one after another, then one all-reduce of
// the gradients over the whole mesh, the normalisation, clipping and AdamW; nothing overlaps):
//   attention        A x L x the Split-KV layer's fwd + bwd on the CP group (simulate_cp: its
//                    real LPT plan of the micro-batch, the q / k|v / o projections, the kernels,
//                    the collectives and their overlap; the output projection as the
//                    trainer's --oproj auto, choose_oproj_by_shape); with --shard full (whose
//                    --recompute auto is on) each layer's forward once more in the backward
//   projections_mlp  A x [context fusion c = RMSNorm(hidden_p fc): [C_p, n_t H] x [n_t H, H]
//                    forward + the weight gradient (hidden_p needs none); per layer SwiGLU
//                    [Q_p, H] x [H, F] x 2 and [Q_p, F] x [F, H], forward + 2x backward (dX, dW);
//                    the RMSNorms, residual adds, SiLU products and the embedding lookup as
//                    elementwise bytes]
//   lm_head_loss     A x [logits [Q_p, H] x [H, V] forward, dX backward only (the head is frozen),
//                    the softmax cross-entropy over [Q_p, V] (read logits, write dlogits)]
//   redistribute     A x the all-to-all-v of the context rows' target hidden states from the
//                    loader slices to their plan owners ((C - 1)/C of C_p rows x n_t H floats)
//   grad_allreduce   the model state's collectives over all P ranks as the trainer's --shard (auto:
//                    none on one rank, full for the real shapes, optimizer = ZeRO-1 for the
//                    synthetic ones): machine.uniform_ms of shard_bytes_per_step (all-reduce;
//                    reduce-scatter + all-gather; A x (2 all-gathers + reduce-scatter)), plus the
//                    small all-reduce of the loss statistics
//   optimizer        elementwise over 52 B per parameter this rank updates (W, or W / P sharded):
//                    zero the gradients (4), normalise by the loss weight (8), clipping's norm (4)
//                    and scale (8), AdamW (read p, g, m, v; write p, m, v: 28)
//   planner          A x the balancer's wall time on this machine (simulate_cp's plan_ms: the
//                    trainer plans every micro-batch)
// tokens_per_s = DP x A x S / step time (the trainer's tokens: packed context rows).
#pragma once

#include <cstdint>
#include <string>

#include "diffcp/drafter/config.hpp"
#include "diffcp/sim/machine.hpp"

namespace diffcp {

struct SimTrainOptions {
  int cp = 0;                        // C; 0: P / dp
  int dp = 0;                        // DP; 0: P / cp (both 0: DP = 1, C = P)
  std::int64_t accum = 2;            // A: micro-batches per DP replica per step
  std::int64_t global_batch = 0;     // micro-batches per step over all replicas; > 0 sets A = it / DP
  std::int64_t context = 1024;       // tokens per packed micro-batch
  std::int64_t sample_length = 0;    // tokens per sample; 0: 256 (tiny, small: the synthetic source's longest), else --context
  std::int64_t anchors = 0;          // per sample; 0: the trainer's default (12 synthetic shapes, 512 real ones)
  double prompt_fraction = 0.25;     // prompt share of a sample (no anchors there)
  std::string balancer = "lpt";
  int J = 4;                         // chunks per rank (the trainer's default)
  std::string collectives = "auto";  // Split-KV's: flat | hierarchical | auto
  std::string shard = "auto";        // model state: none | optimizer | full | auto (the trainer's rule)
  std::uint64_t seed = 1;
};

struct SimTrainPhases {
  double attention = 0, projections_mlp = 0, lm_head_loss = 0, redistribute = 0, grad_allreduce = 0, optimizer = 0,
         planner = 0;  // ms per step
  double sum() const { return attention + projections_mlp + lm_head_loss + redistribute + grad_allreduce + optimizer + planner; }
};

struct SimTrainResult {
  std::string preset;
  int P = 1, dp = 1, cp = 1;
  std::int64_t accum = 1;
  std::int64_t tokens_per_micro_batch = 0;  // S
  std::int64_t query_rows = 0;              // Q of a micro-batch
  std::int64_t parameters = 0;              // W
  std::string shard, oproj;                 // the modes predicted (auto resolved as the trainer does)
  double step_ms = 0, tokens_per_s = 0;
  double imbalance_pct = 0;                 // the attention work's, of the CP group's plan
  SimTrainPhases phases;
};

// Throws diffcp::Error naming the bad value: cp or dp < 0, C x DP != P, C not tiling the nodes
// (neither C nor the ranks per node divides the other), global_batch not a multiple of DP,
// accum / context / sample_length < 1, an unknown balancer, collectives or shard mode.
SimTrainResult simulate_train(const SimMachine& m, const std::string& preset, const DrafterConfig& cfg,
                              const SimTrainOptions& opt);

}  // namespace diffcp
