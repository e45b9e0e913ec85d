// The frozen LM head and the cross-entropy, vocabulary-parallel over a group (the CP group):
// rank r holds columns [v0_r, v1_r) of lm_head [H, V] (an even split), never the whole head, and
// the logits are never materialised whole: they are computed in row chunks of at most ~32 M
// values. With a group of G > 1 ranks:
//   1. all_gather_v the rows' hf [Q_r, H], targets and weights      (Q = sum of Q_r)
//   2. per chunk: local logits [R, V/G] -> per row (max, sum exp, argmax, target logit)
//   3. all_gather the per-row stats [Q, 4] and combine them in rank order (every rank the same):
//      lse = M + log sum_r s_r exp(m_r - M); argmax = the first (lowest id) maximum
//   4. backward: recompute each chunk's logits, dlogits = w (softmax - onehot) on the slice,
//      dhf_all [Q, H] += dlogits lm_head_slice^T, then reduce_scatter_v to the rows' owners.
// The extra cost of G > 1 is one more GEMM of the slice (step 4 recomputes instead of storing
// [Q, V/G]); bytes per rank: Q H (gather) + Q H (scatter) + 4 Q G doubles, all O(Q), none O(V).
// Without a group (or G = 1) the head is whole and one pass does everything.
// Memory: the head slice, hf, the logit chunks and dhf live in the active backend's memory; the
// targets, weights and the per-row results (stats, ce, argmax: O(rows)) are host data.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/ops/buffer.hpp"

namespace diffcp {

// Columns [v0, v1) of a V-wide head split evenly over G ranks, for rank r.
std::pair<std::int64_t, std::int64_t> vocab_slice(std::int64_t V, int G, int r);

class LmHead {
 public:
  // w: [H, v1 - v0] (host) columns [v0, v1) of the head, copied to the active backend's memory;
  // group: the ranks holding the other columns (nullptr: w is the whole head). All ranks of the
  // group call run() together.
  LmHead(Communicator* group, std::int64_t H, std::int64_t V, std::span<const float> w, std::int64_t v0);
  // The same, columns [v0, v1) written by columns(c0, c1, out [H, c1 - c0] host) in slices of
  // ~1 M values: the slice is never whole on the host (a data source's LM head).
  using Columns = std::function<void(std::int64_t c0, std::int64_t c1, float* out)>;
  LmHead(Communicator* group, std::int64_t H, std::int64_t V, std::int64_t v0, std::int64_t v1, const Columns& columns);
  std::int64_t columns() const { return v1_ - v0_; }

  //   hf:     [Q_p, H] (device) final hidden states of this rank's rows
  //   target: [Q_p] target token ids;  weight: [Q_p] loss weights (w = 0: the row has no loss)
  //   ce:     [Q_p] out, lse - logit[target]   argmax: [Q_p] out, first maximum over V (host)
  //   dhf:    [Q_p, H] (device) out with `backward`, d(sum_rows w CE)/dhf (every rank of the group
  //           passes the same `backward`, also one with Q_p = 0)
  void run(const float* hf, std::int64_t Qp, const std::int32_t* target, const double* weight, double* ce,
           std::int32_t* argmax, bool backward, float* dhf);

 private:
  Communicator* group_;
  std::int64_t H_, V_, v0_, v1_;
  DeviceVector<float> w_;  // [H, v1 - v0]
};

}  // namespace diffcp
