// `diffcp train`: train the DFlash drafter with Split-KV (the project's main job). The library's
// Trainer (drafter/trainer.hpp) trains; this file owns the flags, the progress bar, the JSONL
// metrics file and the summary lines (bench/bench_train.sh and bench/bench_shard.sh grep them).
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include "cli/commands.hpp"
#include "diffcp/core/error.hpp"

namespace diffcp::cli {

namespace {

using Clock = std::chrono::steady_clock;

std::string fmt_eta(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%02d:%02d", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
  return buf;
}

// The library names its options `TrainOptions::<field>`; the flag of each is --<field> with '-'
// for '_' (TrainOptions::save_every -> --save-every).
std::string flag_names(const std::string& msg) {
  static const std::string prefix = "TrainOptions::";
  std::string out;
  std::size_t at = 0;
  for (std::size_t hit = msg.find(prefix); hit != std::string::npos; hit = msg.find(prefix, at)) {
    out.append(msg, at, hit - at);
    out += "--";
    at = hit + prefix.size();
    for (; at < msg.size() && (std::isalnum(static_cast<unsigned char>(msg[at])) || msg[at] == '_'); ++at)
      out += msg[at] == '_' ? '-' : msg[at];
  }
  out.append(msg, at);
  return out;
}

}  // namespace

void add_train_command(CLI::App& app, TrainCommand& cmd) {
  TrainOptions& opt = cmd.train;
  CLI::App* c = app.add_subcommand("train", "Train a DFlash drafter with Split-KV context parallelism over the mpirun ranks");
  c->add_option("--preset", opt.preset, "model shape: tiny (default) | small | qwen3.5-35b-a3b | qwen3.5-27b | "
                                        "qwen3.8-27b-dflash2");
  c->add_option("--arch", opt.arch, "dflash | dflash2 (the preset's DFlash2 variant: grouped dynamic convolutions and "
                                    "the candidate selector); default: the preset's or --init's own");
  c->add_option("--selector-weight", opt.selector_weight, "DFlash2: the candidate selector's loss weight lambda")
      ->capture_default_str();
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
  c->add_option("--log", cmd.log, "JSONL metrics, one object per step");
  c->add_option("--eval-every", opt.eval_every, "held-out acceptance length every N steps")->capture_default_str();
  c->add_option("--balancer", opt.balancer, "context layout per step: none | zigzag | lpt | partition")->capture_default_str();
  c->add_option("--J", opt.J, "LPT chunks per rank")->capture_default_str();
  c->add_option("--bucket", opt.bucket, "static-shape bucket of the local K/V length")->capture_default_str();
  c->add_option("--collectives", opt.collectives, "Split-KV's collectives: flat | hierarchical (two-level over nodes) | "
                                                  "auto (hierarchical; flat on one node)")->capture_default_str();
  c->add_option("--stop-at", opt.stop_at, "stop after this step as if killed (for resume tests)");
  c->add_option("--shard", opt.shard, "model state over the mesh: none | optimizer | full | auto (= full for the real "
                 "shapes on more than one rank, optimizer for the synthetic ones, none on one rank); full also splits the "
                 "frozen LM head over the CP group")->capture_default_str();
  c->add_option("--oproj", opt.oproj, "Split-KV's output projection: all | owned | auto (= owned when n_q d_h <= hidden)")
      ->capture_default_str();
  c->add_option("--recompute", opt.recompute, "activation recomputation: on | off | auto (= on with --shard full)")
      ->capture_default_str();
  c->add_option("--dtype", opt.dtype, "compute precision: f32 | bf16 (mixed precision: bf16 attention, payloads and GEMMs; "
                                      "f32 master weights, optimizer, loss, gradient reduction)")
      ->capture_default_str();
  c->add_flag("!--no-progress", cmd.progress, "no progress bar");
}

int run_train(Communicator& world, TrainCommand cmd) {
  TrainOptions& opt = cmd.train;
  opt.keep_params = false;  // the checkpoint has them; no rank needs the whole vector
  const bool root = world.rank() == 0, tty = isatty(2);
  std::ofstream log;
  std::int64_t start = 0;
  Clock::time_point t_start;
  // Rank 0: one JSONL object per step; the bar redraws every step on a terminal and, in a log,
  // prints one line per 5 % of the run (and at every evaluation and the end).
  auto on_event = [&](const TrainEvent& ev) {
    if (!root || ev.kind != TrainEvent::Kind::step) return;
    const StepStats& st = *ev.stats;
    nlohmann::json line{{"step", st.step}, {"loss", st.loss}, {"lr", st.lr}, {"grad_norm", st.grad_norm},
                        {"tokens_per_s", st.tokens_per_s}, {"step_ms", st.ms}};
    line["slot_accuracy"] = st.slot_accuracy;
    if (st.candidate_recall) {  // DFlash2
      line["candidate_recall"] = *st.candidate_recall;
      line["selector_accuracy"] = *st.selector_accuracy;
      line["selector_loss"] = *st.selector_loss;
    }
    if (st.tau) line["tau"] = *st.tau;
    if (log.is_open()) log << line.dump() << "\n" << std::flush;
    const std::int64_t every = tty ? 1 : std::max<std::int64_t>(1, opt.steps / 20);
    if (cmd.progress && (st.step % every == 0 || st.tau || st.step == opt.steps)) {
      const double elapsed = std::chrono::duration<double>(Clock::now() - t_start).count();
      const double eta = elapsed / static_cast<double>(st.step - start) * static_cast<double>(opt.steps - st.step);
      const int width = 24, done = static_cast<int>(width * st.step / opt.steps);
      std::fprintf(stderr, "%s[%s%s] step %lld/%lld | loss %.4f | lr %.2e | %.0f tok/s | ETA %s%s", tty ? "\r" : "",
                   std::string(static_cast<std::size_t>(done), '#').c_str(),
                   std::string(static_cast<std::size_t>(width - done), '.').c_str(), static_cast<long long>(st.step),
                   static_cast<long long>(opt.steps), st.loss, st.lr, st.tokens_per_s, fmt_eta(eta).c_str(),
                   st.tau ? (" | tau " + std::to_string(*st.tau).substr(0, 5)).c_str() : "");
      if (!tty || st.step == opt.steps) std::fprintf(stderr, "\n");
    }
  };
  TrainResult r;
  if (const std::string note = dtype_cost_note(opt.dtype); root && !note.empty())
    std::fprintf(stderr, "diffcp train: --dtype bf16%s\n", note.c_str());
  try {
    Trainer trainer(world, opt, on_event);
    const TrainResult& s = trainer.summary();
    if (root && (s.truncated > 0 || s.few_anchors > 0))
      std::fprintf(stderr, "diffcp train: of %lld training samples, %lld are longer than --context %lld (right-truncated to it) "
                   "and %lld have fewer than %lld candidate anchor positions (they get all of theirs)\n",
                   static_cast<long long>(s.train_samples), static_cast<long long>(s.truncated),
                   static_cast<long long>(opt.context), static_cast<long long>(s.few_anchors), static_cast<long long>(s.anchors));
    if (root && !cmd.log.empty()) {
      log.open(cmd.log, opt.resume ? std::ios::app : std::ios::trunc);
      DIFFCP_CHECK(log.good(), "--log '", cmd.log, "': cannot write");
    }
    start = trainer.step_index();
    t_start = Clock::now();
    r = trainer.run();
  } catch (const Error& e) {
    throw Error(flag_names(e.what()));
  }
  if (root) {
    std::printf("diffcp train: %lld steps on %d ranks (cp x dp), median step %.1f ms, %.0f tokens/s, peak RSS %.0f MiB/rank\n",
                static_cast<long long>(opt.steps), world.size(), r.step_ms, r.tokens_per_s, r.peak_rss_mb);
    std::printf("diffcp train: final loss %.4f (uniform prediction: %.4f), held-out acceptance length tau %.3f "
                "(against the %s)\n", r.loss, r.uniform_loss, r.tau, r.tau_reference.c_str());
    std::printf("diffcp train: checkpoint %s\n", r.checkpoint.empty() ? "not written (no --out)" : r.checkpoint.c_str());
    std::printf("diffcp train: CP group on %s, Split-KV with %s collectives and output projection %s, %s compute%s\n",
                r.topology.c_str(), r.collectives.c_str(), r.oproj.c_str(), r.dtype == "bf16" ? "bf16 mixed-precision" : "f32",
                dtype_cost_note(r.dtype).c_str());
    std::printf("diffcp train: --shard %s%s: model state %.0f MiB/rank, LM head %.0f MiB/rank; ms per step:", r.shard.c_str(),
                r.recompute ? ", activations recomputed" : "", r.state_mb, r.lm_head_mb);
    for (const auto& [name, ms] : r.phases) std::printf(" %s %.0f", name.c_str(), ms);
    std::printf("\n");
    print_host_syncs("train", opt.steps);
  }
  return 0;
}

}  // namespace diffcp::cli
