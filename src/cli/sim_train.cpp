// `diffcp sim train`: DFlash drafter training's step time and tokens/s predicted for a preset on
// P = DP x CP ranks of a profile's machine (sim/train.hpp), with the options of `diffcp train`
// that shape a step.
#include <cstdio>

#include <nlohmann/json.hpp>

#include "cli/sim.hpp"
#include "diffcp/sim/train.hpp"

namespace diffcp::cli {

namespace {
struct SimTrainCli {
  SimMachineOptions machine;
  std::string preset = "tiny";
  SimTrainOptions opt;
};
SimTrainCli g_train;
}  // namespace

void add_sim_train(CLI::App* sim) {
  SimTrainCli& o = g_train;
  CLI::App* c = sim->add_subcommand("train", "Predict drafter training's step time and tokens/s for a preset on "
                                             "P = DP x CP ranks of a profile");
  add_sim_machine_options(c, o.machine);
  c->add_option("--preset", o.preset, "model shape: tiny | small | qwen3.5-35b-a3b | qwen3.5-27b")->capture_default_str();
  c->add_option("--cp", o.opt.cp, "context-parallel group size (0: P / dp)")->capture_default_str();
  c->add_option("--dp", o.opt.dp, "data-parallel replicas (0: P / cp; both 0: DP = 1)")->capture_default_str();
  c->add_option("--accum", o.opt.accum, "micro-batches per DP replica per step (global batch = dp * accum)")->capture_default_str();
  c->add_option("--global-batch", o.opt.global_batch, "micro-batches per step over all replicas (sets --accum = it / dp)");
  c->add_option("--context", o.opt.context, "tokens per packed micro-batch")->capture_default_str();
  c->add_option("--sample-length", o.opt.sample_length, "tokens per sample (default: 256 for tiny / small, --context for real shapes)");
  c->add_option("--anchors", o.opt.anchors, "anchors per sample (default: 12 for the synthetic shapes, 512 for real ones)");
  c->add_option("--prompt-fraction", o.opt.prompt_fraction, "prompt share of each sample")->capture_default_str();
  c->add_option("--balancer", o.opt.balancer, "context layout: none | zigzag | lpt | partition")->capture_default_str();
  c->add_option("--J", o.opt.J, "LPT chunks per rank")->capture_default_str();
  c->add_option("--collectives", o.opt.collectives, "Split-KV's collectives: flat | hierarchical | auto")->capture_default_str();
  c->add_option("--shard", o.opt.shard, "model state over the mesh, as diffcp train: none | optimizer | full | auto")
      ->capture_default_str();
  c->add_option("--seed", o.opt.seed, "seed of the micro-batch's anchors")->capture_default_str();
}

int run_sim_train() {
  const SimTrainCli& o = g_train;
  const SimMachine m = make_sim_machine(o.machine);
  const DrafterConfig cfg = drafter_preset(o.preset);  // throws naming the presets
  warn_profile_fit(m, cfg.n_q, cfg.n_kv, cfg.d_h);
  const SimTrainResult r = simulate_train(m, o.preset, cfg, o.opt);
  const SimTrainPhases& ph = r.phases;
  const nlohmann::ordered_json phases{{"attention", ph.attention},       {"projections_mlp", ph.projections_mlp},
                                      {"lm_head_loss", ph.lm_head_loss}, {"redistribute", ph.redistribute},
                                      {"grad_allreduce", ph.grad_allreduce}, {"optimizer", ph.optimizer},
                                      {"planner", ph.planner}};
  if (o.machine.json) {
    const nlohmann::ordered_json j{{"preset", r.preset},
                                   {"P", r.P},
                                   {"dp", r.dp},
                                   {"cp", r.cp},
                                   {"profile", m.profile.name},
                                   {"ranks_per_node", m.R},
                                   {"accum", r.accum},
                                   {"tokens_per_micro_batch", r.tokens_per_micro_batch},
                                   {"query_rows", r.query_rows},
                                   {"parameters", r.parameters},
                                   {"shard", r.shard},
                                   {"oproj", r.oproj},
                                   {"imbalance_pct", r.imbalance_pct},
                                   {"step_ms", r.step_ms},
                                   {"tokens_per_s", r.tokens_per_s},
                                   {"phases", phases}};
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("diffcp sim train: preset %s, profile %s, P = %d = DP %d x CP %d (%d per node), accum %lld, "
              "%lld tokens / %lld query rows per micro-batch, %lld parameters, --shard %s, output projection %s\n",
              r.preset.c_str(), m.profile.name.c_str(), r.P, r.dp, r.cp, m.R, static_cast<long long>(r.accum),
              static_cast<long long>(r.tokens_per_micro_batch), static_cast<long long>(r.query_rows),
              static_cast<long long>(r.parameters), r.shard.c_str(), r.oproj.c_str());
  std::printf("  step %.3f ms, %.4g tokens/s (attention imbalance %.2f %%)\n", r.step_ms, r.tokens_per_s, r.imbalance_pct);
  for (const auto& [name, ms] : phases.items())
    std::printf("  %-16s %10.3f ms\n", name.c_str(), ms.get<double>());
  return 0;
}

}  // namespace diffcp::cli
