// The machine `diffcp sim` predicts on: a profile's rates and P ranks placed R to a node in rank
// order (ranks p with equal p / R share a node, as mpirun --map-by core fills nodes).
//
// Compute, per kernel call: t = kernel_us + flops / rate (rate per op class). A GEMM given by its
// shape is a roofline: t = kernel_us + max(2 M K N / (gemm rate x eff), 4 (M K + K N + M N) /
// memory rate) with the elementwise rate as the memory rate and eff the width efficiency
// n (W + n_half) / (W (n + n_half)) of its narrow width n = min(K, N) < W = 1024 (1 at W and
// above): the size-dependent efficiency (a GEMM with few rows streams its weights and runs far
// below the peak; a narrow one, e.g. the K/V projection at n_kv d_h = 256, runs 10-16 % below
// it here). `share` scales every compute rate (0.5: two ranks on one core, the oversubscribed
// validation runs here); with P > 1 the rates are also divided by 1 + the profile's sync_loss
// (ranks that synchronise wait for the slowest).
//
// Communication, alpha-beta per link level. A uniform collective (all-gather, reduce-scatter,
// all-to-all; flat, pairwise or ring algorithms: P - 1 rounds) in which a rank sends `bytes`
// spread evenly over the other ranks moves (R-1)/(P-1) of them inside its node and (P-R)/(P-1)
// across; the R ranks of a node share its uplink, and the two levels run concurrently:
//   t = (P - 1) lat + max(intra bytes / intra_bw, R x inter bytes / inter_bw)
// with lat the inter-node latency when P > R. A ring hop (rank p to p+1, all ranks at once)
// crosses a node boundary for one rank per node when P > R: that rank alone uses the uplink.
// Small all-reduces (lse, D) take 2 log2(P) latencies (a tree) plus their bytes.
#pragma once

#include <string>
#include <vector>

#include "diffcp/sim/profile.hpp"

namespace diffcp {

struct SimMachine {
  Profile profile;
  int P = 1, R = 1;      // ranks, ranks per node
  double share = 1.0;    // fraction of the calibrated compute rates each rank gets
  int cores = 0;         // cores the P ranks run on (0: P, one each; fewer: oversubscribed)

  // Throws diffcp::Error naming the value: P < 1, R < 1, share outside (0, 1], cores outside [0, P].
  void validate() const;
  int nodes() const { return (P + R - 1) / R; }
  bool multi_node() const { return P > R; }
  // Two-level collectives differ from flat ones (1 < N < P), as Communicator::hierarchy_useful().
  bool hierarchy_useful() const { return multi_node() && R > 1; }

  // share / (1 + profile.sync_loss) when P > 1 (synchronised ranks), else share: what every
  // compute rate is scaled by.
  double rate_share() const;
  double gemm_ms(double flops, int calls = 1) const;
  double gemm_ms(double M, double K, double N) const;  // y[M, N] = x[M, K] W[K, N], f32
  double gemm_efficiency(double K, double N) const;     // the width efficiency eff above, in (0, 1]
  double attn_fwd_ms(double flops, int calls = 1) const;
  double attn_bwd_ms(double flops, int calls = 1) const;
  double elementwise_ms(double bytes) const;  // 0 when the profile has no elementwise rate

  // The work that sets the length of a step in which rank p does w[p] (the rates being per rank
  // with every rank busy): the slowest rank's, max_p w_p, when each rank has a core; on fewer
  // cores C (oversubscribed) a rank that finishes early yields its core to the others, so the
  // step lasts max(C / P x max_p w_p, mean_p w_p).
  double step_work(const std::vector<double>& w) const;

  double uniform_ms(double bytes_per_rank) const;        // all-gather / reduce-scatter / all-to-all
  // The two-level (hierarchical) form of a uniform collective with the same flat volume: across
  // nodes each node's data once ((N-1)/(P-1) of the flat volume per rank, the uplink shared by R),
  // then inside the node; the phases run one after the other.
  double hierarchical_ms(double bytes_per_rank) const;
  double allreduce_small_ms(double bytes_per_rank) const;
  double hop_ms(double bytes) const;                     // one ring hop, every rank at once
  // Compute and a transfer launched to overlap it: max(x, c) when comm_overlap = 1, x + c when 0:
  // x + c - comm_overlap min(x, c).
  double overlapped(double compute_ms, double comm_ms) const;
  // Of a uniform collective's bytes, the fraction that crosses nodes: (P - R) / (P - 1).
  double inter_fraction() const;

  // What a prediction on this machine should be told about its profile (empty: nothing): a link
  // level it uses (inside a node when R > 1, across nodes when P > R; none at P = 1) that the
  // profile says calibrate did not measure, and an attention shape (n_q, n_kv, d_h) other than the
  // one the profile's kernel rates were measured at. Hand-written profiles say neither.
  std::vector<std::string> fit_warnings(std::int64_t n_q, std::int64_t n_kv, std::int64_t d_h) const;
};

}  // namespace diffcp
