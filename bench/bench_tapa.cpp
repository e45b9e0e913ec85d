// TAPA vs flat all-to-all latency (SPEC B.2; the paper's Fig. 11 sweep): uniform f32 all-to-all
// (the Ulysses pattern) of 3..48 MiB per rank at the P of the mpirun, group size --group-size.
//   OMP_NUM_THREADS=1 mpirun --oversubscribe -np 4 build/release/bench/bench_tapa --group-size 2
// Per size: --warmup untimed rounds, then --reps rounds of (flat, TAPA) alternated; each round is
// timed per rank after a barrier, the slowest rank's time is the round's, the table shows medians.
// TAPA's phase 1 is timed to its wait(), phase 2 from there (both slowest rank, medians apiece).
// Every size also checks that TAPA's output is bitwise the flat one. --csv FILE writes the rows.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "diffcp/comm/mpi_runtime.hpp"
#include "diffcp/comm/tapa.hpp"

namespace {

using diffcp::Communicator;
using diffcp::TapaAllToAll;
using Clock = std::chrono::steady_clock;

constexpr double kMiB = 1024.0 * 1024.0;

struct Row {
  int mib;
  double flat_ms, tapa_ms, phase1_ms, phase2_ms;
  double intra_mib, inter_mib;  // closed form, per rank
  bool bitwise_equal;
};

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Median over rounds of the slowest rank's time; times: [rounds], this rank's.
double slowest_median(Communicator& world, std::vector<double> times) {
  world.all_reduce<double>(times, diffcp::ReduceOp::max);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

Row measure(Communicator& world, TapaAllToAll& tapa, int mib, int warmup, int reps) {
  const int P = world.size();
  // Elements to each destination: the per-rank message of `mib` MiB split over P destinations.
  const std::size_t count = static_cast<std::size_t>(mib * kMiB) / sizeof(float) / static_cast<std::size_t>(P);
  const std::size_t n = count * static_cast<std::size_t>(P);
  std::vector<float> send(n), flat_recv(n), tapa_recv(n);
  for (std::size_t k = 0; k < n; ++k) send[k] = static_cast<float>(world.rank() * 1000003 + static_cast<int>(k % 999983));
  const diffcp::TapaPlan plan = tapa.plan_uniform(count);

  std::vector<double> flat, total, phase1, phase2;
  for (int round = 0; round < warmup + reps; ++round) {
    world.barrier();
    const auto t0 = Clock::now();
    world.all_to_all_async(send.data(), flat_recv.data(), count, diffcp::DType::f32)->wait();
    const double flat_ms = ms_since(t0);

    world.barrier();
    const auto t1 = Clock::now();
    diffcp::TapaPhase1 p1 = tapa.phase1_async(plan, send.data(), diffcp::DType::f32);
    p1.wait();
    const double p1_ms = ms_since(t1);
    const auto t2 = Clock::now();
    tapa.phase2(std::move(p1), tapa_recv.data());
    const double p2_ms = ms_since(t2), total_ms = ms_since(t1);
    if (round >= warmup) {
      flat.push_back(flat_ms);
      total.push_back(total_ms);
      phase1.push_back(p1_ms);
      phase2.push_back(p2_ms);
    }
  }
  // Bitwise agreement on every rank: the max of the per-rank "differs" flags.
  std::vector<int> differs{std::memcmp(flat_recv.data(), tapa_recv.data(), n * sizeof(float)) != 0 ? 1 : 0};
  world.all_reduce<int>(differs, diffcp::ReduceOp::max);
  const diffcp::TapaBytes b =
      diffcp::tapa_uniform_bytes(P, tapa.group_size(), count, sizeof(float), /*count_exchange=*/false);
  return {mib,
          slowest_median(world, flat),
          slowest_median(world, total),
          slowest_median(world, phase1),
          slowest_median(world, phase2),
          static_cast<double>(b.phase1) / kMiB,
          static_cast<double>(b.phase2) / kMiB,
          differs[0] == 0};
}

}  // namespace

int main(int argc, char** argv) {
  int group_size = 2, reps = 7, warmup = 2;
  std::vector<int> sizes = {3, 6, 12, 24, 48};
  std::string csv;
  CLI::App app{"diffcp TAPA vs flat all-to-all latency"};
  app.add_option("--group-size,-L", group_size, "TAPA group size L (must divide P)")->capture_default_str();
  app.add_option("--sizes", sizes, "message sizes in MiB per rank")->delimiter(',')->capture_default_str();
  app.add_option("--reps", reps, "timed rounds per size (median), >= 1")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed rounds per size first")->capture_default_str();
  app.add_option("--csv", csv, "also write the rows to this CSV file (rank 0)");
  CLI11_PARSE(app, argc, argv);

  return diffcp::run_mpi_main(argc, argv, [&](Communicator& world) {
    DIFFCP_CHECK(reps >= 1 && warmup >= 0, "--reps = ", reps, ", --warmup = ", warmup, ": expected >= 1 and >= 0");
    TapaAllToAll tapa(world, group_size);
    const int P = world.size(), L = group_size;
    const bool root = world.rank() == 0;
    const unsigned cores = std::thread::hardware_concurrency();
    if (root) {
      std::printf("# TAPA vs flat all-to-all, f32, uniform counts, P = %d ranks, group size L = %d (G = %d groups)\n",
                  P, L, P / L);
      // Under scripts/emucluster.sh (DIFFCP_NODE set) the groups sit behind shaped links; otherwise
      // everything is shared memory on one machine.
      if (std::getenv("DIFFCP_NODE") != nullptr)
        std::printf("# machine: %u cores%s, emulated cluster (scripts/emucluster.sh): TCP over tc-shaped links\n",
                    cores, P > static_cast<int>(cores) ? " (oversubscribed)" : "");
      else
        std::printf("# machine: %u cores%s, one node, Open MPI shared memory only: there is NO slow link between\n"
                    "# groups here, so the numbers show TAPA's overhead (a local copy of 1/L of the data and\n"
                    "# (L-1)*G+1 operations instead of 1), not the paper's 3.9x at 48 MB (which needs a fast\n"
                    "# intra-group link and slower inter-group links).\n",
                    cores, P > static_cast<int>(cores) ? " (oversubscribed)" : "");
      std::printf("# median of %d rounds after %d warm-up, slowest rank per round; intra/inter = bytes per\n"
                  "# rank inside / across groups (closed form; flat moves (P-1)/P of the message across all)\n",
                  reps, warmup);
      std::printf("%9s %10s %10s %10s %10s %10s %11s %11s %8s\n", "MiB/rank", "flat_ms", "tapa_ms", "phase1_ms",
                  "phase2_ms", "tapa/flat", "intra_MiB", "inter_MiB", "bitwise");
    }
    std::vector<Row> rows;
    for (int mib : sizes) {
      DIFFCP_CHECK(mib >= 1, "--sizes: ", mib, " MiB, expected >= 1");
      const Row r = measure(world, tapa, mib, warmup, reps);
      rows.push_back(r);
      if (root) {
        std::printf("%9d %10.2f %10.2f %10.2f %10.2f %10.2f %11.2f %11.2f %8s\n", r.mib, r.flat_ms, r.tapa_ms,
                    r.phase1_ms, r.phase2_ms, r.tapa_ms / r.flat_ms, r.intra_mib, r.inter_mib,
                    r.bitwise_equal ? "equal" : "DIFFER");
        std::fflush(stdout);
      }
    }
    if (root && !csv.empty()) {
      std::ofstream f(csv);
      DIFFCP_CHECK(f.good(), "--csv '", csv, "': cannot create or write");
      f << "P,L,mib_per_rank,flat_ms,tapa_ms,phase1_ms,phase2_ms,intra_mib,inter_mib,bitwise_equal\n";
      for (const Row& r : rows)
        f << P << ',' << L << ',' << r.mib << ',' << r.flat_ms << ',' << r.tapa_ms << ',' << r.phase1_ms << ','
          << r.phase2_ms << ',' << r.intra_mib << ',' << r.inter_mib << ',' << (r.bitwise_equal ? 1 : 0) << '\n';
    }
    for (const Row& r : rows)
      if (!r.bitwise_equal) return 2;
    return 0;
  });
}
