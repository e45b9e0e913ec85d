// `diffcp train`: train the DFlash drafter with Split-KV (the project's main job).
#include <cstdio>

#include "cli/commands.hpp"

namespace diffcp::cli {

void add_train_command(CLI::App& app, TrainOptions& opt) {
  CLI::App* c = app.add_subcommand("train", "Train a DFlash drafter with Split-KV context parallelism over the mpirun ranks");
  c->add_option("--preset", opt.preset, "model shape: tiny (default) | small | qwen3.5-35b-a3b | qwen3.5-27b");
  c->add_option("--init", opt.init, "start from a DFlash drafter directory (config.json + model.safetensors, "
                                    "e.g. from diffcp export or a released drafter); its config.json is the shape");
  c->add_option("--steps", opt.steps, "optimizer steps in total")->capture_default_str();
  c->add_option("--cp", opt.cp, "context-parallel group size (0 = ranks / dp)")->capture_default_str();
  c->add_option("--dp", opt.dp, "data-parallel replicas")->capture_default_str();
  c->add_option("--accum", opt.accum, "micro-batches per DP replica per step (global batch = dp * accum)")->capture_default_str();
  c->add_option("--context", opt.context, "tokens per packed micro-batch")->capture_default_str();
  c->add_option("--anchors", opt.anchors, "anchors per sample (default: 12 for the synthetic shapes, 512 for real ones)");
  c->add_option("--lr", opt.lr, "peak learning rate, cosine with 4 % warm-up (default: 5e-3 synthetic, 6e-4 real shapes)");
  c->add_option("--weight-decay", opt.weight_decay, "AdamW weight decay (matrices only)")->capture_default_str();
  c->add_option("--clip", opt.clip, "gradient clipping (global L2 norm)")->capture_default_str();
  c->add_option("--seed", opt.seed, "seeds init, data order, anchors (and the synthetic corpus)")->capture_default_str();
  c->add_option("--data", opt.data, "shard directory (model.safetensors + shard_*.safetensors); default: synthetic");
  c->add_option("--heldout", opt.heldout, "held-out samples when reading shards")->capture_default_str();
  c->add_option("--out", opt.out, "checkpoint directory");
  c->add_option("--save-every", opt.save_every, "checkpoint every N steps (0: only at the end)")->capture_default_str();
  c->add_flag("--resume", opt.resume, "continue from DIR/checkpoint.bin");
  c->add_option("--log", opt.log, "JSONL metrics, one object per step");
  c->add_option("--eval-every", opt.eval_every, "held-out acceptance length every N steps")->capture_default_str();
  c->add_option("--balancer", opt.balancer, "context layout per step: none | zigzag | lpt | partition")->capture_default_str();
  c->add_option("--J", opt.J, "LPT chunks per rank")->capture_default_str();
  c->add_option("--bucket", opt.bucket, "static-shape bucket of the local K/V length")->capture_default_str();
  c->add_option("--collectives", opt.collectives, "Split-KV's collectives: flat | hierarchical (two-level over nodes) | "
                                                  "auto (hierarchical; flat on one node)")->capture_default_str();
  c->add_option("--stop-at", opt.stop_at, "stop after this step as if killed (for resume tests)");
  c->add_option("--shard", opt.shard, "model state over the mesh: none | optimizer | full | auto (= full for the real "
                 "shapes on more than one rank, else none); optimizer and full also split the LM head over the CP group")->capture_default_str();
  c->add_option("--recompute", opt.recompute, "activation recomputation: on | off | auto (= on with --shard full)")
      ->capture_default_str();
  c->add_flag("!--no-progress", opt.progress, "no progress bar");
}

int run_train(Communicator& world, TrainOptions opt) {
  opt.keep_params = false;  // the checkpoint has them; no rank needs the whole vector
  const TrainResult r = train(world, opt);
  if (world.rank() == 0) {
    std::printf("diffcp train: %lld steps on %d ranks (cp x dp), median step %.1f ms, %.0f tokens/s, peak RSS %.0f MiB/rank\n",
                static_cast<long long>(opt.steps), world.size(), r.step_ms, r.tokens_per_s, r.peak_rss_mb);
    std::printf("diffcp train: final loss %.4f (uniform prediction: %.4f), held-out acceptance length tau %.3f "
                "(against the %s)\n", r.loss, r.uniform_loss, r.tau, r.tau_reference.c_str());
    std::printf("diffcp train: checkpoint %s\n", r.checkpoint.empty() ? "not written (no --out)" : r.checkpoint.c_str());
    std::printf("diffcp train: CP group on %s, Split-KV with %s collectives\n", r.topology.c_str(), r.collectives.c_str());
    std::printf("diffcp train: --shard %s%s: model state %.0f MiB/rank, LM head %.0f MiB/rank; ms per step:", r.shard.c_str(),
                r.recompute ? ", activations recomputed" : "", r.state_mb, r.lm_head_mb);
    for (const auto& [name, ms] : r.phases) std::printf(" %s %.0f", name.c_str(), ms);
    std::printf("\n");
  }
  return 0;
}

}  // namespace diffcp::cli
