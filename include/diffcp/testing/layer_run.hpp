// The measured run of one CP method of the drafter attention layer (issue #51: run policy in the
// library, called by `diffcp attn`, `diffcp bench cp` and Python's diffcp.run_layer): the context
// laid out by a balancer with the rows moved from the loader's slices, warm-up + timed repetitions
// (slowest rank per repetition, medians), bytes per operation kind summed over ranks, peak memory,
// and the check against the fp64 reference.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "diffcp/balance/balancer.hpp"
#include "diffcp/cp/cp_layer.hpp"
#include "diffcp/testing/layer_problem.hpp"

namespace diffcp {

// The context layout `layout` (a balancer name) of `batch` over P ranks. No communication;
// throws diffcp::Error for an unknown name or a J the context cannot serve.
Plan plan_layout(const PackedBatch& batch, const std::string& layout, int P, int J, KeyWindow window = {});

struct LayerRunSpec {
  std::string method = "splitkv";  // cp/cp_methods.hpp
  std::string layout = "none";     // balancer name
  int J = 16;
  std::int64_t bucket = 4096;
  int warmup = 1, reps = 3;
  const ReferenceLayerResult* reference = nullptr;  // check against it when set
  std::string oproj = "all", collectives = "auto";  // Split-KV only: all | owned | auto; flat | hierarchical | auto
  double link_gbit = 0;                             // oproj auto: one rank's link rate (0: measure it)
  DType dtype = DType::f32;                         // the method's compute dtype: f32 or bf16
};
// The layer check's atol scale (testing/layer_problem.hpp: scaled_to per tensor), as reported.
inline constexpr const char* kLayerAtolScale = "max(1, max|ref|) of each tensor";

// Result of run_layer. Times are medians over the timed repetitions of the slowest rank's time
// (step_ms: of the slowest rank's forward + backward, so it can exceed fwd_ms + bwd_ms).
struct LayerRun {
  std::string method, layout;
  int J = 0;  // chunks per rank the plan used
  double fwd_ms = 0, bwd_ms = 0, step_ms = 0, exposed_comm_ms = 0;
  double fwd_overlap_exposed_ms = 0, bwd_overlap_exposed_ms = 0, blocking_comm_ms = 0;
  nlohmann::json bytes;        // per op kind: {"calls" (per rank), "sent_total", "sent_per_rank"}
  double bytes_per_layer = 0;  // bytes sent by one forward + backward, mean over ranks
  double predicted_bytes_per_layer = 0;
  // Of bytes_per_layer, sent to ranks on other nodes (the world's topology: DIFFCP_NODE or shared
  // memory); predicted by Split-KV's closed form (NaN for the other methods).
  double inter_bytes_per_layer = 0, predicted_inter_bytes_per_layer = 0;
  std::string topology;                   // Topology::describe()
  std::string oproj, collectives;         // what Split-KV ran ("" for the other methods)
  double oproj_gemm_gflops = 0, oproj_link_gbit = 0;  // --oproj auto: the rates it decided on
  double redistribution_bytes = 0;  // the layout's one all-to-all-v, mean over ranks
  double imbalance_pct = 0;         // Split-KV cost model (balance/cost.hpp) of the layout
  // Peak resident memory, max over ranks: peak_bytes = the whole process's (VmHWM, reset at the
  // start of the run when the kernel allows it: peak_reset), which includes the harness's copy
  // of the full problem on every rank; run_peak_bytes = peak minus the resident size at the start
  // of the run = what the run added: its input slices, outputs, the layer's buffers, the
  // communication scratch.
  std::uint64_t peak_bytes = 0, run_peak_bytes = 0;
  bool peak_reset = false;
  // With spec.reference: every output and gradient against the fp64 reference, max over ranks
  // and tensors (testing/compare.hpp): max_rel_err = max |d| / max |ref| of the worst tensor,
  // max_tol_ratio = max |d| / (atol' + rtol |ref|) with atol' = atol max(1, max|ref|) per tensor
  // (<= 1 passes), mismatches = elements with a ratio > 1.
  bool checked = false, check_passed = true;
  Tolerance tolerance{0, 0};
  double max_abs_err = 0, max_rel_err = 0, max_tol_ratio = 0;
  std::int64_t mismatches = 0;
  // This rank's share, for --dump.
  std::vector<std::vector<PosRange>> chunks_of_rank;
  CpShard shard;
  std::vector<float> y_p, dx_p, dctx_p;         // [Q_p, H], [Q_p, H], [C_p, H]
  std::vector<float> lse;                       // Split-KV: the last forward's lse of the owned rows [Q_p, n_q] (else empty)
  std::unique_ptr<AttnLayerParams> grad;        // summed over the ranks
  std::unique_ptr<CpAttentionLayer> layer;
};

// Collective over `world`: every rank calls it with the same problem and spec. Throws before any
// communication when the method cannot serve world.size() ranks or the layout is invalid.
LayerRun run_layer(Communicator& world, const LayerProblem& pb, const LayerRunSpec& spec);

}  // namespace diffcp
