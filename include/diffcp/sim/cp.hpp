// `diffcp sim cp`: the predicted forward, backward and step time of one drafter attention layer
// for every CP method on P ranks of a profile's machine (sim/machine.hpp), from
//   - the work each rank really gets: the real planner (the method's usual layout, Split-KV's
//     --balancer) runs on the real workload, and a work matrix M[q][c] (visible pairs per head
//     between the queries of rank q and the context rows rank c holds; blocks owned in even
//     contiguous ranges, as CpShard) gives each step's per-rank load: Split-KV rank p does
//     sum_q M[q][p] + D_p (the planner's W_p), Ulysses 1/P of all pairs, Ring rank p at step t
//     the shard of p - t, RingX at step t the queries of rank t, LV-XAttn at step t the queries
//     of p - t; a step lasts as long as its slowest rank
//     (SimMachine::step_work: on fewer cores than ranks, the mean rank's when that is longer);
//   - FLOPs: attention 4 d_h (forward) / 10 d_h (backward) per pair per query head, projections
//     2 m k n (backward 2x);
//   - bytes: the closed forms of cp/bytes.hpp (the ones the tests assert), split into the
//     collectives each method issues, each timed by the machine's alpha-beta model;
//   - the overlap each method has: Split-KV's q all-gather under the K/V projection and dq
//     reduce-scatter under the K/V backward; Ulysses' q all-to-all under the K/V projection;
//     Ring's next hop under the current step's attention; LV-XAttn's next query hop and, from
//     step 2, the previous step's accumulator under the current step (the layer merges it after
//     the attention), the last accumulator hop home exposed (forward) or under the K/V backward;
//     RingX's next broadcast under the current step; all scaled by the profile's comm_overlap
//     (how much a transfer really hides).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "diffcp/balance/cost.hpp"
#include "diffcp/cp/attention_layer.hpp"
#include "diffcp/sim/machine.hpp"
#include "diffcp/workload/batch.hpp"

namespace diffcp {

struct SimCpOptions {
  std::vector<std::string> methods;  // cp/cp_methods.hpp names
  std::string balancer = "lpt";      // Split-KV's layout; the others use their usual one
  int J = 16;                        // chunks per rank
  std::string oproj = "auto";        // Split-KV: all | owned | auto (choose_oproj on the profile's rates)
  std::string collectives = "auto";  // Split-KV: flat | hierarchical | auto (hierarchical across nodes)
  int elem = 4;                      // bytes per element (4: f32)
};

struct SimCpResult {
  std::string method, layout, reason;  // reason: why the method cannot serve (empty: supported)
  int P = 1;
  double fwd_ms = 0, bwd_ms = 0, step_ms = 0;
  double compute_ms = 0, comm_ms = 0, exposed_comm_ms = 0;  // per layer step, slowest rank
  double bytes_per_layer = 0, inter_node_bytes_per_layer = 0;
  double imbalance_pct = 0;  // max over ranks of the attention work / mean - 1
  double peak_bytes = 0;     // the layer's buffers on the busiest rank (model estimate)
  double plan_ms = 0;        // the planner's own wall time here (once per training step)
  std::string oproj, collectives;  // Split-KV's
  bool supported() const { return reason.empty(); }
};

std::vector<SimCpResult> simulate_cp(const SimMachine& m, const PackedBatch& batch, const AttnLayerConfig& cfg,
                                     const SimCpOptions& opt);

// Attention pairs per head: M[q * P + c] between rank q's queries and rank c's context rows, and
// D[q] = the owned blocks' own pairs. Exposed for the tests (sum_q M[q][p] + D[p] = the
// planner's W_p).
struct WorkMatrix {
  int P = 1;
  std::vector<double> M, D;
  double at(int q, int c) const { return M[static_cast<std::size_t>(q) * static_cast<std::size_t>(P) + static_cast<std::size_t>(c)]; }
};
WorkMatrix work_matrix(const PackedBatch& batch, const Plan& plan);

}  // namespace diffcp
