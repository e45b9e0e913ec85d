// A cluster profile: the rates `diffcp sim` predicts with and the links scripts/emucluster.sh
// emulates, one JSON format for both (profiles/*.json; docs/emucluster.md).
//
// Required: name, rank_tflops, intra_gbit, inter_gbit. Optional: description, source, notes
// (text), ranks_per_node (default 1), intra_latency_us, inter_latency_us (default 0), and the
// compute classes gemm_tflops, attn_bwd_tflops (default: rank_tflops), gemm_n_half (default 0),
// elementwise_gbs (default 0: not timed), kernel_us (default 0; a fixed cost per kernel call: with
// gemm_n_half and the roofline, the size-dependent efficiency of sim/machine.hpp), comm_overlap
// (default 1), sync_loss (default 0), measured and attention_shape (below). `diffcp sim calibrate`
// writes every field, and says in `measured` which it could not measure on its ranks.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace diffcp {

// The width at which calibrate measures gemm_tflops (a 2048 x 1024 x 1024 GEMM).
inline constexpr double kGemmWideWidth = 1024;

// gemm_n_half from the measured rate ratio rho = rate(narrow) / rate(kGemmWideWidth) at a width
// narrow < kGemmWideWidth: solves rho = narrow (W + h) / (W (narrow + h)); 0 when rho >= 1.
double gemm_n_half_from_ratio(double narrow, double rho);

inline constexpr const char* kMeasuredGroups[] = {"compute", "intra_link", "inter_link", "comm_overlap", "sync_loss"};

struct Profile {
  std::string name, description, source, notes;
  int ranks_per_node = 1;
  double rank_tflops = 0;       // attention forward per rank, FLOPs as FlashAttention counts them
  double gemm_tflops = 0;       // dense GEMMs (projections, MLP, LM head), at widths >= kGemmWideWidth
  // Hockney's n_half of the GEMM's narrow width (the smaller of K and N): below kGemmWideWidth the
  // rate falls as n / (n + n_half), normalised to gemm_tflops at kGemmWideWidth (0: no fall).
  double gemm_n_half = 0;
  double attn_bwd_tflops = 0;   // attention backward (10 d_h FLOPs per visible pair per head)
  double elementwise_gbs = 0;   // memory-bound ops (norms, activations, optimizer): bytes / s
  double kernel_us = 0;         // fixed cost per kernel call
  double intra_gbit = 0;        // per rank and direction, between ranks of one node
  double inter_gbit = 0;        // per node uplink and direction, shared by its ranks
  double intra_latency_us = 0, inter_latency_us = 0;
  // Fraction of a transfer that can hide under compute: 1 where DMA engines / NICs move the data
  // (GPUs, RDMA), less where the compute cores themselves run the transport (MPI over TCP or
  // shared memory on a CPU host: calibrate measures it).
  double comm_overlap = 1;
  // How much slower compute runs when P > 1 ranks synchronise between its segments than the
  // compute rates above (medians of one rank's kernels) say: each segment waits for the slowest
  // rank, and on a shared host some segments stretch (system noise). 0 on a quiet machine;
  // calibrate measures it at its P (the loss grows with P, which is not modelled).
  double sync_loss = 0;
  // What `diffcp sim calibrate` measured (true) and what it set from defaults or copied from the
  // other link level (false), by group: compute, intra_link, inter_link, comm_overlap, sync_loss
  // (kMeasuredGroups). Empty for profiles written by hand (published figures).
  std::map<std::string, bool> measured;
  // The attention shape the kernel rates (rank_tflops, attn_bwd_tflops) were measured at:
  // calibrate's --n-q / --n-kv / --d-h (JSON "attention_shape"); 0: not recorded.
  std::int64_t attn_n_q = 0, attn_n_kv = 0, attn_d_h = 0;

  // Throws diffcp::Error naming the source and the field: unknown fields, missing required ones,
  // non-positive rates, negative latencies.
  static Profile from_json(const nlohmann::json& j, const std::string& source);
  nlohmann::json to_json() const;
};

// NAME (profiles/NAME.json: $DIFFCP_PROFILES or the source tree's profiles/) or a file path.
Profile load_profile(const std::string& name_or_file);

}  // namespace diffcp
