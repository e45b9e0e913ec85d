// `diffcp plan`: generate (or read) a workload, run balancers, print per-rank loads, imbalance
// and planning time. Needs no MPI.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "diffcp/balance/balancer.hpp"
#include "cli/commands.hpp"
#include "diffcp/core/error.hpp"

namespace diffcp::cli {

void add_plan_command(CLI::App& app, PlanOptions& opt) {
  CLI::App* c = app.add_subcommand("plan", "Load-balance a packed micro-batch over P ranks (no MPI needed)");
  c->add_option("--balancer", opt.balancer, "none | zigzag | lpt | partition | all")->capture_default_str();
  c->add_option("--P", opt.P, "context-parallel ranks")->capture_default_str();
  c->add_option("--J", opt.J, "chunks per rank (lpt, partition)")->capture_default_str();
  c->add_option("--samples", opt.samples, "samples per micro-batch")->capture_default_str();
  c->add_option("--context", opt.context, "context per sample, or a range a:b to draw lengths from")->capture_default_str();
  c->add_option("--queries", opt.queries, "query rows per sample; anchors = queries / block")->capture_default_str();
  c->add_option("--block", opt.block, "block size B")->capture_default_str();
  c->add_option("--prompt-fraction", opt.prompt_fraction, "prompt share of a sample")->capture_default_str();
  c->add_option("--seed", opt.seed, "workload seed")->capture_default_str();
  c->add_option("--anchors-file", opt.anchors_file, "explicit workload: JSON {block, samples: [{length, anchors}]}");
  c->add_option("--reps", opt.reps, "planning repetitions (median time reported)")->capture_default_str();
  c->add_flag("--json", opt.json, "JSON: one object per balancer (an array for several)");
  c->add_option("--windows", opt.windows,
                "the drafter's layers, comma-separated: each one's sliding window (0 = full attention), e.g. "
                "2048,0,2048,0; plans with the windows' real work and also reports the plan made with "
                "full-attention costs, evaluated under the windows");
}

int run_plan(const PlanOptions& opt) {
  DIFFCP_CHECK(opt.reps >= 1, "--reps = ", opt.reps, ", expected >= 1");
  PackedBatch batch;
  if (!opt.anchors_file.empty()) {
    batch = read_anchors_file(opt.anchors_file);
  } else {
    const CountRange ctx = parse_range(opt.context, "--context");
    const std::int64_t queries = parse_count(opt.queries, "--queries");
    DIFFCP_CHECK(opt.block >= 1, "--block = ", opt.block, ", expected >= 1");
    DIFFCP_CHECK(queries % opt.block == 0, "--queries = ", queries, " per sample is not a multiple of --block = ", opt.block);
    batch = make_random_batch(opt.samples, ctx.min, queries / opt.block, opt.block, opt.prompt_fraction, opt.seed, ctx.max);
  }
  std::vector<std::string> names;
  if (opt.balancer == "all")
    names = balancer_names();
  else
    names.push_back(opt.balancer);

  std::vector<KeyWindow> layers;
  std::stringstream list(opt.windows);
  for (std::string item; std::getline(list, item, ',');) {
    const std::int64_t w = parse_count(item, "--windows");
    DIFFCP_CHECK(w <= kMaxKeyWindow, "--windows: a window of ", w, " positions, expected at most 2^40 (0 = full attention)");
    layers.push_back(KeyWindow::sliding(w));
  }
  const CostModel cost = layers.empty() ? CostModel(batch) : CostModel(batch, layers);
  const CostModel full_cost = layers.empty() ? CostModel(batch) : CostModel(batch, std::vector<KeyWindow>(layers.size()));
  nlohmann::json all = nlohmann::json::array();
  for (const std::string& name : names) {
    const auto balancer = make_balancer(name);
    Plan plan;
    std::vector<double> ms;
    for (int r = 0; r < opt.reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      plan = balancer->plan(batch, cost, opt.P, opt.J);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    const PlanLoad load = plan_load(batch, cost, plan);
    nlohmann::json chunks = nlohmann::json::array();
    for (std::size_t j = 0; j < plan.chunks.size(); ++j)
      chunks.push_back({{"start", plan.chunks[j].begin}, {"end", plan.chunks[j].end}, {"rank", plan.rank[j]}});
    all.push_back({{"balancer", name}, {"P", opt.P}, {"J", plan.J}, {"rank_context_work", load.context_work},
                   {"block_work", load.block_work}, {"rank_work", load.rank_work}, {"imbalance_pct", load.imbalance_pct()},
                   {"plan_ms", ms[ms.size() / 2]}, {"chunks", chunks}});
    // With windows: the same balancer fed full-attention costs, its plan loaded with the real ones.
    const double full_cost_pct =
        layers.empty() ? load.imbalance_pct() : plan_load(batch, cost, balancer->plan(batch, full_cost, opt.P, opt.J)).imbalance_pct();
    if (!layers.empty()) all.back()["imbalance_pct_full_cost_plan"] = full_cost_pct;
    if (!opt.json) {
      std::printf("%-9s P=%d J=%d  imbalance %.3f %%  plan %.4f ms (median of %d)\n", name.c_str(), opt.P, plan.J,
                  load.imbalance_pct(), ms[ms.size() / 2], opt.reps);
      if (!layers.empty())
        std::printf("          planned with full-attention costs instead: imbalance %.3f %% under the windows\n",
                    full_cost_pct);
      for (int p = 0; p < opt.P; ++p)
        std::printf("  rank %3d  C_p %14lld  D_p %10lld  W_p %14lld\n", p,
                    static_cast<long long>(load.context_work[static_cast<std::size_t>(p)]),
                    static_cast<long long>(load.block_work[static_cast<std::size_t>(p)]),
                    static_cast<long long>(load.rank_work[static_cast<std::size_t>(p)]));
    }
  }
  if (opt.json) std::cout << (all.size() == 1 ? all[0] : all).dump() << std::endl;
  return 0;
}

}  // namespace diffcp::cli
