// Balance study (SPEC A.5, the paper's two sweeps): imbalance 100*(rho-1) % (mean and std over
// seeds) and median planning time of every balancer, plus a J sweep for LPT's default.
//   sweep "context": queries/sample 8k (512 anchors), b = 4, context/sample 16k..256k, P = 8
//   sweep "P":       queries/sample 8k, b = 4, context/sample 256k, P = 8..64
//   sweep "J":       as sweep "P" at P = 64, J in {4, 8, 16, 32} (LPT only)
//   sweep "lpt-P":   as sweep "P" for LPT alone, P = 64..1024: planning time at scale
// Prints a table; --csv FILE writes the rows for bench/plot_balance.py.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>

#include <CLI/CLI.hpp>

#include "diffcp/balance/balancer.hpp"

namespace {

struct Row {
  std::string sweep, balancer;
  int P, J;
  std::int64_t context;
  double mean_pct, std_pct, plan_ms;
};

Row measure(const std::string& sweep, const std::string& name, int P, int J, std::int64_t context, int seeds, int reps) {
  std::vector<double> imb, ms;
  const auto balancer = diffcp::make_balancer(name);
  for (int seed = 1; seed <= seeds; ++seed) {
    const diffcp::PackedBatch batch = diffcp::make_random_batch(4, context, 512, 16, 0.25, static_cast<std::uint64_t>(seed));
    const diffcp::CostModel cost(batch);
    diffcp::Plan plan;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      plan = balancer->plan(batch, cost, P, J);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    imb.push_back(diffcp::plan_load(batch, cost, plan).imbalance_pct());
  }
  double mean = 0, var = 0;
  for (double x : imb) mean += x / static_cast<double>(imb.size());
  for (double x : imb) var += (x - mean) * (x - mean) / static_cast<double>(imb.size());
  std::sort(ms.begin(), ms.end());
  return {sweep, name, P, J, context, mean, std::sqrt(var), ms[ms.size() / 2]};
}

}  // namespace

int main(int argc, char** argv) {
  int seeds = 10, reps = 5, J = 16;
  std::string csv;
  CLI::App app{"diffcp balance study"};
  app.add_option("--seeds", seeds, "workload seeds per point")->capture_default_str();
  app.add_option("--reps", reps, "planning repetitions per seed (median over all)")->capture_default_str();
  app.add_option("--J", J, "chunks per rank for lpt / partition")->capture_default_str();
  app.add_option("--csv", csv, "write the rows to this CSV file");
  CLI11_PARSE(app, argc, argv);
  try {
    std::vector<Row> rows;
    for (std::int64_t ctx : {16384, 32768, 65536, 131072, 262144})
      for (const auto& b : diffcp::balancer_names()) rows.push_back(measure("context", b, 8, J, ctx, seeds, reps));
    for (int P : {8, 16, 32, 64})
      for (const auto& b : diffcp::balancer_names()) rows.push_back(measure("P", b, P, J, 262144, seeds, reps));
    for (int j : {4, 8, 16, 32}) rows.push_back(measure("J", "lpt", 64, j, 262144, seeds, reps));
    for (int P : {64, 128, 256, 512, 1024}) rows.push_back(measure("lpt-P", "lpt", P, J, 262144, seeds, reps));
    std::printf("%-8s %-10s %4s %4s %8s %12s %10s %12s\n", "sweep", "balancer", "P", "J", "context", "imbalance%",
                "std%", "plan_ms");
    for (const Row& r : rows)
      std::printf("%-8s %-10s %4d %4d %8lld %12.3f %10.3f %12.4f\n", r.sweep.c_str(), r.balancer.c_str(), r.P, r.J,
                  static_cast<long long>(r.context), r.mean_pct, r.std_pct, r.plan_ms);
    if (!csv.empty()) {
      std::ofstream f(csv);
      f << "sweep,balancer,P,J,context,imbalance_pct_mean,imbalance_pct_std,plan_ms_median\n";
      for (const Row& r : rows)
        f << r.sweep << ',' << r.balancer << ',' << r.P << ',' << r.J << ',' << r.context << ',' << r.mean_pct << ','
          << r.std_pct << ',' << r.plan_ms << '\n';
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_balance: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
