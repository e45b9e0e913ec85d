// `diffcp bench p2p` and `diffcp bench coll`: what the links and the collectives deliver.
//
// p2p: point-to-point latency and bandwidth from rank 0 to every other rank,
// through the communicator (so through whatever transport mpirun chose: shared memory here, TCP
// over the shaped links of scripts/emucluster.sh). Used to check that an emulated cluster delivers
// what it was configured for, and to calibrate link models.
//
// Per peer k (one pair at a time, the other ranks wait in a barrier):
//   latency:   ping-pong of an 8-byte message; latency_us = median round trip / 2
//   bandwidth: rank 0 sends --bytes to k, k answers with 8 bytes; gbit_s = bytes*8 / median time
//              of one transfer (the answer's latency is included: it is small next to the payload)
// same_node tells whether k shares rank 0's node (Communicator::split_node_local).
//
// coll: each collective of the communicator on the whole world, --bytes per rank (all_gather:
// each rank's block; reduce_scatter: each rank's result block; all_reduce, all_to_all: the whole
// buffer), async + wait as the CP methods call them: median time of the slowest rank and the
// "bus" bandwidth = bytes this rank sent by the accounting of comm/communicator.hpp / time.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.hpp"

namespace diffcp::cli {

void add_bench_p2p_command(CLI::App& bench, BenchP2pOptions& opt) {
  CLI::App* c = bench.add_subcommand("p2p", "Point-to-point latency and bandwidth from rank 0 to every other rank");
  c->add_option("--bytes", opt.bytes, "payload of a bandwidth transfer (k/m suffixes)")->capture_default_str();
  c->add_option("--reps", opt.reps, "timed bandwidth transfers per peer (median reported)")
      ->capture_default_str()->check(CLI::Range(1, 1000));
  c->add_option("--latency-reps", opt.latency_reps, "timed ping-pongs per peer (median reported)")
      ->capture_default_str()->check(CLI::Range(1, 100000));
  c->add_flag("--json", opt.json, "print one JSON object");
}

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int run_bench_p2p(Communicator& world, const BenchP2pOptions& opt) {
  const std::int64_t bytes = parse_count(opt.bytes, "--bytes");
  DIFFCP_CHECK(bytes >= 8, "--bytes = '", opt.bytes, "': at least 8 bytes");
  const int P = world.size(), me = world.rank();
  DIFFCP_CHECK(P >= 2, "diffcp bench p2p needs at least 2 ranks (mpirun -np 2 or more), got ", P);

  // Node id = the smallest world rank of my node.
  auto node = world.split_node_local("p2p.node");
  std::vector<std::int64_t> node_id{-static_cast<std::int64_t>(me)};
  node->all_reduce(std::span<std::int64_t>(node_id), ReduceOp::max);
  std::vector<std::int64_t> nodes(static_cast<std::size_t>(P));
  world.all_gather(std::span<const std::int64_t>(node_id), std::span<std::int64_t>(nodes));

  std::vector<std::uint8_t> payload(static_cast<std::size_t>(bytes), 1);
  std::vector<std::uint8_t> small(8, 0);
  const std::span<std::uint8_t> ps(payload), ss(small);
  nlohmann::json pairs = nlohmann::json::array();
  // Ranks outside the measured pair wait without spinning, so they do not steal the pair's cores
  // when ranks outnumber cores (emulated clusters).
  auto polite_barrier = [&] {
    WorkPtr w = world.barrier_async();
    while (!w->test()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  };
  for (int k = 1; k < P; ++k) {
    polite_barrier();
    if (me != 0 && me != k) continue;
    const int peer = me == 0 ? k : 0;
    // Rank 0 sends msg and waits for an 8-byte answer; returns the time rank 0 saw. A ping is a
    // round trip of the 8-byte message itself.
    auto round_trip = [&](std::span<std::uint8_t> msg) {
      const double t0 = now_s();
      if (me == 0) {
        world.send(std::span<const std::uint8_t>(msg), peer);
        world.recv(ss, peer);
      } else {
        world.recv(msg, peer);
        world.send(std::span<const std::uint8_t>(ss), peer);
      }
      return now_s() - t0;
    };
    auto ping = [&] { return round_trip(ss); };
    auto transfer = [&] { return round_trip(ps); };
    for (int w = 0; w < 10; ++w) ping();  // connection set-up, first-touch
    transfer();
    std::vector<double> rtt, tt;
    for (int r = 0; r < opt.latency_reps; ++r) rtt.push_back(ping());
    for (int r = 0; r < opt.reps; ++r) tt.push_back(transfer());
    if (me == 0) {
      const double t = median(tt);
      pairs.push_back({{"src", 0},
                       {"dst", k},
                       {"same_node", nodes[0] == nodes[static_cast<std::size_t>(k)]},
                       {"latency_us", median(rtt) / 2 * 1e6},
                       {"transfer_ms", t * 1e3},
                       {"gbit_s", static_cast<double>(bytes) * 8 / t / 1e9}});
    }
  }
  polite_barrier();
  if (me != 0) return 0;
  if (opt.json) {
    std::cout << nlohmann::json{{"P", P}, {"bytes", bytes}, {"reps", opt.reps}, {"latency_reps", opt.latency_reps},
                                {"pairs", pairs}}.dump()
              << std::endl;
    return 0;
  }
  std::printf("diffcp bench p2p: P=%d, %lld-byte transfers (median of %d), 8-byte ping-pong (median of %d)\n", P,
              static_cast<long long>(bytes), opt.reps, opt.latency_reps);
  std::printf("  %4s %4s %-9s %12s %12s\n", "src", "dst", "same node", "latency us", "Gbit/s");
  for (const auto& p : pairs)
    std::printf("  %4d %4d %-9s %12.1f %12.3f\n", p["src"].get<int>(), p["dst"].get<int>(),
                p["same_node"].get<bool>() ? "yes" : "no", p["latency_us"].get<double>(), p["gbit_s"].get<double>());
  return 0;
}

void add_bench_coll_command(CLI::App& bench, BenchCollOptions& opt) {
  CLI::App* c = bench.add_subcommand("coll", "Time of each collective (all_gather, reduce_scatter, all_reduce, all_to_all)");
  c->add_option("--bytes", opt.bytes, "bytes per rank (k/m suffixes)")->capture_default_str();
  c->add_option("--reps", opt.reps, "timed repetitions per collective (median reported)")
      ->capture_default_str()->check(CLI::Range(1, 1000));
  c->add_flag("--json", opt.json, "print one JSON object");
}

int run_bench_coll(Communicator& world, const BenchCollOptions& opt) {
  const std::int64_t bytes = parse_count(opt.bytes, "--bytes");
  const int P = world.size();
  const auto n = static_cast<std::size_t>(bytes / 4);
  DIFFCP_CHECK(n >= static_cast<std::size_t>(P), "--bytes = '", opt.bytes, "': at least 4 bytes (one f32) per destination rank, i.e. 4 * P = ", 4 * P);
  std::vector<float> a(n * static_cast<std::size_t>(P), 1.f), b(n * static_cast<std::size_t>(P));
  struct Coll {
    const char* name;
    CommOp op;
    std::function<void()> run;
  };
  const std::size_t blk = n / static_cast<std::size_t>(P);
  const std::vector<Coll> colls{
      {"all_gather", CommOp::all_gather, [&] { world.all_gather_async(a.data(), b.data(), n, DType::f32)->wait(); }},
      {"reduce_scatter", CommOp::reduce_scatter,
       [&] { world.reduce_scatter_async(a.data(), b.data(), n, DType::f32, ReduceOp::sum)->wait(); }},
      {"all_reduce", CommOp::all_reduce, [&] { world.all_reduce_async(a.data(), b.data(), n, DType::f32, ReduceOp::sum)->wait(); }},
      {"all_to_all", CommOp::all_to_all, [&] { world.all_to_all_async(a.data(), b.data(), blk, DType::f32)->wait(); }},
  };
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& c : colls) {
    c.run();  // warm-up
    world.stats().reset();
    std::vector<double> t(1);
    std::vector<double> times;
    for (int r = 0; r < opt.reps; ++r) {
      world.barrier();
      const double t0 = now_s();
      c.run();
      t[0] = now_s() - t0;
      world.all_reduce(std::span<double>(t), ReduceOp::max);
      times.push_back(t[0]);
    }
    const double sent = static_cast<double>(world.stats()[c.op].bytes_sent) / opt.reps;
    const double med = median(times);
    rows.push_back({{"collective", c.name}, {"ms", med * 1e3}, {"bytes_sent_per_rank", sent},
                    {"bus_gbit_s", sent * 8 / med / 1e9}});
  }
  if (world.rank() != 0) return 0;
  if (opt.json) {
    std::cout << nlohmann::json{{"P", P}, {"bytes", bytes}, {"reps", opt.reps}, {"collectives", rows}}.dump() << std::endl;
    return 0;
  }
  std::printf("diffcp bench coll: P=%d, %lld bytes per rank, median of %d (slowest rank)\n", P,
              static_cast<long long>(bytes), opt.reps);
  std::printf("  %-15s %10s %16s %12s\n", "collective", "ms", "sent B/rank", "bus Gbit/s");
  for (const auto& r : rows)
    std::printf("  %-15s %10.2f %16.0f %12.3f\n", r["collective"].get<std::string>().c_str(), r["ms"].get<double>(),
                r["bytes_sent_per_rank"].get<double>(), r["bus_gbit_s"].get<double>());
  return 0;
}

}  // namespace diffcp::cli
