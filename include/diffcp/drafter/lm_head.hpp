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
// DFlash2 (set_logit_map / forward's top-K): each chunk's logits go through the LogitMap
// (multiplier, soft cap) before the statistics; forward() also returns each row's K largest mapped
// logits (every rank its slice's min(K, columns) per row, all-gathered as [Q, K] values and ids, padded, and merged in
// rank order: value descending, then id ascending), and backward() adds the candidate selector's
// gradient on those logits (the rows' owners' [Q_p, K], all-gathered) before the map's derivative.
// Bytes added per rank: 8 Q K G (the candidates) + 12 Q K (the selector's gradient), all O(Q).
// Memory: the head slice, hf, the logit chunks and dhf live in the active backend's memory; the
// targets, weights and the per-row results (stats, ce, argmax: O(rows)) are host data.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/ops/backend.hpp"
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
  // DFlash2's output_multiplier and final_logit_softcapping (ops/loss.hpp logit_map).
  void set_logit_map(LogitMap map) { map_ = map; }

  //   hf:     [Q_p, H] (device) final hidden states of this rank's rows
  //   target: [Q_p] target token ids;  weight: [Q_p] loss weights (w = 0: the row has no loss)
  //   ce:     [Q_p] out, lse - logit[target]   argmax: [Q_p] out, first maximum over V (host)
  //   dhf:    [Q_p, H] (device) out with `backward`, d(sum_rows w CE)/dhf (every rank of the group
  //           passes the same `backward`, also one with Q_p = 0)
  void run(const float* hf, std::int64_t Qp, const std::int32_t* target, const double* weight, double* ce,
           std::int32_t* argmax, bool backward, float* dhf);

  // run() in two calls, with DFlash2's candidates between them (every rank of the group calls both):
  //   K: the candidates per row (0: none; K <= V; the same on every rank)
  //   top_values, top_ids: [Q_p, K] out (host), each row's K largest mapped logits, best first
  void forward(const float* hf, std::int64_t Qp, const std::int32_t* target, const double* weight, double* ce,
               std::int32_t* argmax, std::int64_t K = 0, std::span<float> top_values = {},
               std::span<std::int32_t> top_ids = {});
  //   dhf:   [Q_p, H] (device) out: d(sum_rows w CE + the extra's terms)/dhf
  //   extra: [Q_p, K] the gradient on the rows' candidates (global ids): given when forward's K > 0
  void backward(float* dhf, SparseLogitGrad extra = {});
  // A forward without its backward: frees what forward kept.
  void release();

 private:
  void logits(const float* hf, std::int64_t rows);  // the mapped logits of hf [rows, H] into lg_
  std::int64_t rows_per_chunk() const;
  Communicator* group_;
  std::int64_t H_, V_, v0_, v1_;
  LogitMap map_;
  DeviceVector<float> w_;  // [H, v1 - v0]
  // Between forward() and backward() (freed by backward):
  DeviceVector<float> lg_, hf_all_;       // [R, n] a chunk of logits; [Q, H] the group's rows
  const float* hf_ = nullptr;             // forward's hf (the rows themselves without a group)
  std::int64_t Q_ = 0, Qp_ = 0, off_ = 0, K_ = 0;  // the group's rows, this rank's, its first; K
  std::vector<std::int32_t> t_all_;       // [Q]
  std::vector<double> w_all_, lse_;       // [Q]
  std::vector<std::size_t> rows_of_;      // [G] rows per rank
};

}  // namespace diffcp
