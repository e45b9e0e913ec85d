// The cost model of SPEC A.3, in exact integers: how much attention work each context row carries
// under the DFlash mask, and what that makes each rank's load under a plan.
//
//   c(x)  = B * #{blocks i : s_i <= x < a_i}          work of context key x (pairs per head)
//   c_j   = sum of c(x) over chunk j = B * sum_i (min(a_i, end_j) - max(s_i, begin_j))^+
//   D_p   = (blocks owned by p) * B^2                  the blocks' own keys (bidirectional)
//   W_p   = C_p + D_p,  C_p = sum of p's chunk prices;  rho = max_p W_p / mean_p W_p
// With sliding-window layers (attention/mask.hpp KeyWindow; issue #36) the work is summed over the
// drafter's layers: a full layer adds the B above; a layer of window W adds, per block whose
// context reaches x, only the rows whose windows reach it: clamp(W - (a_i - x), 0, B) (slot r at
// a_i + r sees x iff a_i + r - x < W); D_p counts each layer's visible pairs inside a block.
#pragma once

#include <cstdint>
#include <vector>

#include "diffcp/attention/mask.hpp"
#include "diffcp/workload/batch.hpp"

namespace diffcp {

class CostModel {
 public:
  // SPEC A.3's model: one full layer.
  explicit CostModel(const PackedBatch& batch);
  // The work of a drafter whose layers attend with these windows (one entry per layer; {} = full).
  CostModel(const PackedBatch& batch, const std::vector<KeyWindow>& layers);

  std::int64_t position_cost(std::int64_t x) const;  // c(x), x in [0, S)
  // sum_{t < x} c(t) for x in [0, S]: O(log b + log A) from per-sample prefix sums of anchors.
  std::int64_t prefix(std::int64_t x) const;
  std::int64_t range_cost(std::int64_t begin, std::int64_t end) const { return prefix(end) - prefix(begin); }
  // range_cost of each chunk of contiguous `chunks` in packed order (chunk j ends where j + 1
  // begins): one sweep over boundaries, samples and anchors, O(chunks + b + A), where calling
  // range_cost per chunk pays two binary searches each (with sliding layers it is range_cost per
  // chunk). Throws unless contiguous within [0, S].
  std::vector<std::int64_t> chunk_costs(const std::vector<PosRange>& chunks) const;
  std::int64_t context_rows() const { return S_; }
  std::int64_t block_cost() const { return block_cost_; }  // D per block: visible pairs inside it, summed over layers

 private:
  // A group of layers with the same window W >= 1: per sample, prefix sums of F(a) over its
  // anchors, F(n) = sum_{d=1..n} clamp(W - d, 0, B) (the work of keys up to n rows before an anchor).
  struct WindowTerm {
    std::int64_t window, layers;
    std::vector<std::vector<std::int64_t>> anchor_F_prefix;  // [b][A_u + 1]
    std::vector<std::int64_t> sample_prefix;                 // [b + 1]
  };
  std::int64_t F(const WindowTerm& w, std::int64_t n) const;
  std::int64_t window_prefix(const WindowTerm& w, std::size_t u, std::int64_t t) const;  // keys [0, t) of sample u
  std::int64_t full_layers_ = 1, block_cost_ = 0;
  std::vector<WindowTerm> windows_;
  std::int64_t B_, S_;
  std::vector<std::int64_t> starts_;                       // [b] s_u
  std::vector<std::vector<std::int64_t>> anchors_;         // [b][A_u] in-sample positions, sorted
  std::vector<std::vector<std::int64_t>> anchor_prefix_;   // [b][A_u + 1] prefix sums of anchors_
  std::vector<std::int64_t> sample_prefix_;                // [b + 1] total work of samples before u
};

// A plan: the packed context cut into chunks (in packed order, covering [0, S) once) and the rank
// each chunk goes to.
struct Plan {
  std::string balancer;
  int P = 1, J = 1;
  std::vector<PosRange> chunks;
  std::vector<int> rank;  // [chunks]

  // Throws diffcp::Error unless the chunks partition [0, S) in order and every rank is in [0, P).
  void validate(std::int64_t S) const;
  // Each rank's chunks in packed order, adjacent ones merged (the rows a rank holds, in the
  // order its local context rows are laid out).
  std::vector<std::vector<PosRange>> chunks_of_rank() const;
};

struct PlanLoad {
  std::vector<std::int64_t> context_work;  // C_p
  std::vector<std::int64_t> block_work;    // D_p
  std::vector<std::int64_t> rank_work;     // W_p
  double rho = 1.0;
  double imbalance_pct() const { return 100.0 * (rho - 1.0); }
};

// Loads under `plan`, with blocks owned in even contiguous ranges (as CpShard does).
PlanLoad plan_load(const PackedBatch& batch, const CostModel& cost, const Plan& plan);

}  // namespace diffcp
