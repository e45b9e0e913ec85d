#include "diffcp/sim/calibrate.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/mask.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/core/random.hpp"
#include "diffcp/core/tensor.hpp"
#include "diffcp/ops/linear.hpp"
#include "diffcp/workload/batch.hpp"

namespace diffcp {

namespace {

double now_ms() { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

template <typename F>
double median_ms(int reps, F&& f) {
  f();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_ms();
    f();
    t.push_back(now_ms() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The layers' GEMM (ops/linear.hpp): the fixed cost of a tiny call (4 x 32 x 32), the rate of a
// large one (2048 x 1024 x 1024) and the ratio rho of its rate at a narrow output width (N = 256,
// the K/V projections' n_kv d_h) to it, from which the width's n_half (sim/machine.hpp). The
// wide and the narrow GEMM run back to back, 3 x reps pairs: the rate is the median wide one's,
// rho the median pair's ratio (a slow spell, or oversubscribed the scheduler, moves both of a
// pair, not the ratio).
struct GemmRates {
  double kernel_us = 0, tflops = 0, rho = 1;
};
GemmRates measure_gemm(int reps) {
  const std::int64_t K = 1024, N = 1024, M = 2048, narrow = 256;
  const auto x = random_normal(static_cast<std::size_t>(M * K), 1);
  const auto w = random_normal(static_cast<std::size_t>(K * N), 2);
  std::vector<float> y(static_cast<std::size_t>(M * N));
  const double tiny = median_ms(reps * 20, [&] { linear_forward(x.data(), 4, 32, w.data(), 32, y.data()); });
  linear_forward(x.data(), M, K, w.data(), N, y.data());  // warm-up
  std::vector<double> wide, rho;
  for (int i = 0; i < 3 * reps; ++i) {
    double t0 = now_ms();
    linear_forward(x.data(), M, K, w.data(), N, y.data());
    wide.push_back(std::max(now_ms() - t0 - tiny, 1e-6));
    t0 = now_ms();
    linear_forward(x.data(), M, K, w.data(), narrow, y.data());
    const double thin = std::max(now_ms() - t0 - tiny, 1e-6);
    rho.push_back(static_cast<double>(narrow) / static_cast<double>(N) * wide.back() / thin);
  }
  std::sort(wide.begin(), wide.end());
  std::sort(rho.begin(), rho.end());
  return {tiny * 1e3, 2.0 * M * K * N / wide[wide.size() / 2] / 1e9, rho[rho.size() / 2]};
}

// {fwd, bwd} TFLOP/s of the attention kernels on a DFlash mask (FLOPs as FlashAttention counts).
std::pair<double, double> measure_attention(int reps, std::int64_t n_q, std::int64_t n_kv, std::int64_t d_h) {
  const PackedBatch batch = make_random_batch(1, 4096, 64, 16, 0.25, 1);
  const BlockMask mask = full_mask(batch);
  const std::int64_t Q = batch.query_rows(), Lk = mask.key_rows();
  const auto q = random_normal(static_cast<std::size_t>(Q * n_q * d_h), 1);
  const auto k = random_normal(static_cast<std::size_t>(Lk * n_kv * d_h), 2);
  const auto v = random_normal(static_cast<std::size_t>(Lk * n_kv * d_h), 3);
  const auto dout = random_normal(q.size(), 4);
  std::vector<float> o(q.size()), lse(static_cast<std::size_t>(Q * n_q)), delta(lse.size()), dq(q.size()), dk(k.size()),
      dv(v.size());
  const double tf = median_ms(reps, [&] {
    attention_forward(mask, head_rows(q, Q, n_q, d_h), head_rows(k, Lk, n_kv, d_h), head_rows(v, Lk, n_kv, d_h),
                      head_rows(o, Q, n_q, d_h), lse);
  });
  attention_delta(head_rows(dout, Q, n_q, d_h), head_rows(o, Q, n_q, d_h), delta);
  const double tb = median_ms(reps, [&] {
    attention_backward(mask, head_rows(q, Q, n_q, d_h), head_rows(k, Lk, n_kv, d_h), head_rows(v, Lk, n_kv, d_h),
                       head_rows(dout, Q, n_q, d_h), lse, delta, head_rows(dq, Q, n_q, d_h), head_rows(dk, Lk, n_kv, d_h),
                       head_rows(dv, Lk, n_kv, d_h));
  });
  // FLOPs per ms / 1e9 = TFLOP/s
  return {attention_forward_flops(mask, n_q, d_h) / tf / 1e9, attention_backward_flops(mask, n_q, d_h) / tb / 1e9};
}

// GB/s of y = a x + y over 64 MiB (read 2, write 1).
double measure_elementwise(int reps) {
  std::vector<float> x(std::size_t{1} << 24, 1.f), y(x.size(), 2.f);
  const double t = median_ms(reps, [&] {
#pragma omp parallel for simd
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = 0.5f * x[i] + y[i];
  });
  return 3.0 * 4 * static_cast<double>(x.size()) / (t * 1e-3) / 1e9;
}

// sync_loss: every rank runs the same compute segment, then a blocking barrier, in `windows`
// windows of 10.
// Synchronised ranks go at the pace of the slowest in each segment, and on a shared host a rank's
// segment sometimes stretches (preemption, steal, a noisy neighbour). A run is judged by its
// median step, a step spans ~10-20 such segments, so the loss is taken the same way: the mean
// synchronised segment of each window of 10, its median over the windows (a rare long stall,
// which a run's median step also drops, does not count), over the median segment, minus 1 (>= 0).
// This is what synchronising costs on top of the median rates of the profile's compute classes.
// Needs 2 or more ranks (0 with one).
double measure_sync_loss(Communicator& world, int windows) {
  constexpr int kWindow = 10;
  if (world.size() < 2) return 0.0;
  const std::int64_t M = 256, K = 1024, N = 1024;  // 4 GEMMs, ~10 ms here: a layer's span between collectives
  const auto x = random_normal(static_cast<std::size_t>(M * K), 7), w = random_normal(static_cast<std::size_t>(K * N), 8);
  std::vector<float> y(static_cast<std::size_t>(M * N));
  const auto segment = [&] {
    for (int i = 0; i < 4; ++i) linear_forward(x.data(), M, K, w.data(), N, y.data());
  };
  segment();  // warm-up
  world.barrier_async()->wait();
  std::vector<double> own, window;
  for (int b = 0; b < windows; ++b) {
    double wall = 0;
    for (int i = 0; i < kWindow; ++i) {
      const double t0 = now_ms();
      segment();
      const double t1 = now_ms();
      world.barrier_async()->wait();
      own.push_back(t1 - t0);
      wall += (now_ms() - t0) / kWindow;
    }
    window.push_back(wall);
  }
  std::sort(own.begin(), own.end());
  std::sort(window.begin(), window.end());
  // The ranks' median segments and median windows (every rank's windows are the same length).
  std::vector<double> v{own[own.size() / 2], window[window.size() / 2]};
  world.all_reduce(std::span<double>(v), ReduceOp::sum);
  return std::max(0.0, v[1] / v[0] - 1.0);
}

// Rank 0's link peers: the first other rank on its node (intra) and the first on another node
// (inter); -1 where there is none. Nodes: split_node_local (DIFFCP_NODE or shared memory).
struct Peers {
  std::vector<std::int64_t> node_of;  // [P] the smallest world rank of each rank's node
  int intra = -1, inter = -1;
};
Peers find_peers(Communicator& world) {
  const int P = world.size();
  auto node = world.split_node_local("calibrate.node");
  std::vector<std::int64_t> id{-static_cast<std::int64_t>(world.rank())};
  node->all_reduce(std::span<std::int64_t>(id), ReduceOp::max);
  Peers p;
  p.node_of.assign(static_cast<std::size_t>(P), 0);
  world.all_gather(std::span<const std::int64_t>(id), std::span<std::int64_t>(p.node_of));
  for (int r = 1; r < P; ++r) {
    if (p.node_of[static_cast<std::size_t>(r)] == p.node_of[0] && p.intra < 0) p.intra = r;
    if (p.node_of[static_cast<std::size_t>(r)] != p.node_of[0] && p.inter < 0) p.inter = r;
  }
  return p;
}

// A barrier that sleeps while it waits (the measuring ranks are not slowed by spinning ones).
void quiet_barrier(Communicator& world) {
  WorkPtr b = world.barrier_async();
  while (!b->test()) std::this_thread::sleep_for(std::chrono::microseconds(200));
}

// {latency_us, gbit} between rank 0 and `peer` (half round trips); every rank calls it.
std::pair<double, double> measure_link(Communicator& world, int peer, int reps) {
  const int me = world.rank();
  std::vector<std::uint8_t> small(8), big(std::size_t{4} << 20, 1);
  double lat = 0, gbit = 0;
  quiet_barrier(world);
  if (me == 0 || me == peer) {
    const int other = me == 0 ? peer : 0;
    const auto rt = [&](std::vector<std::uint8_t>& msg) {
      if (me == 0) {
        world.send(std::span<const std::uint8_t>(msg), other);
        world.recv(std::span<std::uint8_t>(small), other);
      } else {
        world.recv(std::span<std::uint8_t>(msg), other);
        world.send(std::span<const std::uint8_t>(small), other);
      }
    };
    const double t_small = median_ms(reps * 20, [&] { rt(small); });
    const double t_big = median_ms(reps, [&] { rt(big); });
    lat = t_small / 2 * 1e3;
    gbit = 8.0 * static_cast<double>(big.size()) / std::max(t_big - t_small, 1e-6) / 1e6;
  }
  std::vector<double> v{lat, gbit};
  world.all_reduce(std::span<double>(v), ReduceOp::max);
  return {v[0], v[1]};
}

// comm_overlap: rank 0 computes (GEMMs, ~T_c) while a message of ~T_c on the link arrives from
// `peer`, posted before the compute and waited for after it; overlap = (T_c + T_t - T_both) /
// min(T_c, T_t), clamped to [0, 1]. Every rank calls it.
double measure_comm_overlap(Communicator& world, int peer, double gbit, int reps) {
  const int me = world.rank();
  const std::int64_t M = 256, K = 1024, N = 1024;
  const auto x = random_normal(static_cast<std::size_t>(M * K), 5), w = random_normal(static_cast<std::size_t>(K * N), 6);
  std::vector<float> y(static_cast<std::size_t>(M * N));
  const auto compute = [&] {
    for (int i = 0; i < 20; ++i) linear_forward(x.data(), M, K, w.data(), N, y.data());
  };
  std::vector<double> t{0, 0, 0};  // T_c, T_t, T_both (rank 0's)
  if (me == 0) t[0] = median_ms(reps, compute);
  world.all_reduce(std::span<double>(t), ReduceOp::max);
  const std::size_t bytes = static_cast<std::size_t>(
      std::clamp(t[0] * 1e-3 * gbit * 1e9 / 8, 65536.0, static_cast<double>(std::size_t{64} << 20)));
  std::vector<std::uint8_t> buf(bytes, 1);
  const auto transfer = [&](bool with_compute) {
    quiet_barrier(world);
    if (me != 0 && me != peer) return 0.0;
    const double t0 = now_ms();
    if (me == peer) {
      world.send(std::span<const std::uint8_t>(buf), 0);
    } else {
      WorkPtr r = world.recv_async(buf.data(), buf.size(), DType::u8, peer);
      if (with_compute) compute();
      r->wait();
    }
    return now_ms() - t0;
  };
  std::vector<double> tt, tb;
  for (int i = 0; i < reps; ++i) tt.push_back(transfer(false));
  for (int i = 0; i < reps; ++i) tb.push_back(transfer(true));
  std::sort(tt.begin(), tt.end());
  std::sort(tb.begin(), tb.end());
  if (me == 0) {
    t[1] = tt[tt.size() / 2];
    t[2] = tb[tb.size() / 2];
  } else {
    t = {0, 0, 0};
  }
  world.all_reduce(std::span<double>(t), ReduceOp::max);
  return std::clamp((t[0] + t[1] - t[2]) / std::max(std::min(t[0], t[1]), 1e-9), 0.0, 1.0);
}

// Every rank measures at once, as every rank computes at once in a run (they share the memory
// system, caches and clocks of the host; oversubscribed ranks share cores): the slowest rank's
// rates (and largest per-call cost) are the profile's.
void measure_compute(Communicator& world, const CalibrateOptions& opt, Profile& p) {
  world.barrier_async()->wait();
  const GemmRates gemm = measure_gemm(opt.reps);
  const auto [fwd, bwd] = measure_attention(opt.reps, opt.n_q, opt.n_kv, opt.d_h);
  const double ew = measure_elementwise(opt.reps);
  p.sync_loss = measure_sync_loss(world, 3 * opt.reps);
  // The largest per-call cost, the smallest rates (negated for one max-reduce); the narrow GEMM's
  // rate ratio is a shape property, not a rank's speed: the mean over the ranks.
  std::vector<double> c{gemm.kernel_us, -gemm.tflops, -fwd, -bwd, -ew};
  world.all_reduce(std::span<double>(c), ReduceOp::max);
  std::vector<double> rho{gemm.rho / world.size()};
  world.all_reduce(std::span<double>(rho), ReduceOp::sum);
  p.kernel_us = c[0];
  p.gemm_tflops = -c[1];
  p.rank_tflops = -c[2];
  p.attn_bwd_tflops = -c[3];
  p.elementwise_gbs = -c[4];
  p.gemm_n_half = gemm_n_half_from_ratio(256, rho[0]);
}

// Rank 0's host name, the same on every rank.
std::string host_name(Communicator& world) {
  std::vector<std::uint8_t> buf(256, 0);
  if (world.rank() == 0) {
    char host[256] = "host";
    ::gethostname(host, sizeof host - 1);
    std::memcpy(buf.data(), host, std::strlen(host));
  }
  world.broadcast<std::uint8_t>(std::span<std::uint8_t>(buf), 0);
  return std::string(reinterpret_cast<const char*>(buf.data()));
}

}  // namespace

void CalibrateOptions::validate() const {
  DIFFCP_CHECK(reps >= 1 && reps <= 1000, "`reps` = ", reps, ", expected 1..1000");
  DIFFCP_CHECK(n_q >= 1 && n_kv >= 1 && n_q % n_kv == 0 && n_q <= 256 && d_h >= 2 && d_h % 2 == 0 && d_h <= 512,
               "sim calibrate: `n_q` ", n_q, " `n_kv` ", n_kv, " `d_h` ", d_h,
               ", expected n_kv | n_q <= 256 and an even d_h <= 512");
}

Calibration calibrate_machine(Communicator& world, const CalibrateOptions& opt) {
  opt.validate();
  const int P = world.size();
  const Peers peers = find_peers(world);
  std::pair<double, double> intra{0, 0}, inter{0, 0};  // {latency_us, gbit}
  if (peers.intra >= 0) intra = measure_link(world, peers.intra, opt.reps);
  if (peers.inter >= 0) inter = measure_link(world, peers.inter, opt.reps);
  const int ov_peer = peers.inter >= 0 ? peers.inter : peers.intra;
  const double overlap =
      ov_peer >= 0 ? measure_comm_overlap(world, ov_peer, peers.inter >= 0 ? inter.second : intra.second, opt.reps) : 1.0;

  Calibration cal;
  Profile& p = cal.profile;
  measure_compute(world, opt, p);
  const std::string host = host_name(world);
  p.name = opt.name.empty() ? "calibrated-" + host : opt.name;
  p.description = "this machine, as diffcp sim calibrate measured it";
  p.comm_overlap = overlap;
  p.notes = "measured by diffcp sim calibrate on " + host + " with " + std::to_string(P) +
            " ranks; compute on every rank at once (the slowest's), with its threads (OMP_NUM_THREADS); attention rates at " +
            std::to_string(opt.n_q) + "/" + std::to_string(opt.n_kv) + " heads x " + std::to_string(opt.d_h);
  // What was measured here and what was not: said in the profile (measured) and in warnings.
  const bool any_peer = peers.intra >= 0 || peers.inter >= 0;
  const char* warning = nullptr;
  if (!any_peer) {
    p.notes += "; no second rank: links not measured (set from defaults)";
    warning = ("one rank, so no link was measured: intra and inter links are DEFAULTS (100 Gbit/s, 1 us), "
                           "comm_overlap 1 and sync_loss 0 are not measured either; predictions at P > 1 from this "
                           "profile are not this machine's. Run it as docs/sim.md says: mpirun -np 2 diffcp sim "
                           "calibrate ... (ranks on two nodes to measure the inter link)");
  } else if (peers.intra < 0) {
    p.notes += "; one rank per node: intra link = the inter one";
    warning = ("one rank per node, so the intra-node link was not measured: it is set to the measured "
                           "inter-node one");
  } else if (peers.inter < 0) {
    p.notes += "; one node: inter link = the intra one";
    warning = ("one node, so the inter-node link was not measured: it is set to the measured intra-node "
                           "one (run across nodes, e.g. scripts/emucluster.sh, to measure it)");
  }
  if (warning != nullptr) cal.warnings.emplace_back(warning);
  if (peers.intra < 0) intra = peers.inter >= 0 ? inter : std::pair<double, double>{1.0, 100.0};
  if (peers.inter < 0) inter = intra;
  p.intra_latency_us = intra.first;
  p.intra_gbit = intra.second;
  p.inter_latency_us = inter.first;
  p.inter_gbit = inter.second;
  p.ranks_per_node = static_cast<int>(std::count(peers.node_of.begin(), peers.node_of.end(), peers.node_of[0]));
  p.measured = {{"compute", true}, {"intra_link", peers.intra >= 0}, {"inter_link", peers.inter >= 0},
                {"comm_overlap", any_peer}, {"sync_loss", P > 1}};
  p.attn_n_q = opt.n_q;
  p.attn_n_kv = opt.n_kv;
  p.attn_d_h = opt.d_h;
  return cal;
}

}  // namespace diffcp
