// RingX (RingX1, the bidirectional cross-attention variant) for the drafter attention layer
// (SPEC A.4): broadcast the queries in the forward, broadcast K/V and reduce dK/dV in the backward;
// nothing travels around a ring, every step is a collective rooted at one rank. On rank p of P:
//   forward:  for t = 0..P-1: rank t broadcasts q_t [Q_t, n_q d_h] (the next broadcast is posted
//             before this step's attention); every rank computes the partial (o, lse) of q_t
//             against ITS local keys; lse_t = AllReduce_logsumexp(lse) [Q_t, n_q]; each rank
//             rescales o *= exp(lse - lse_t) and the rescaled partials are summed AT RANK t (a
//             reduce, expressed as reduce_scatter_v with all counts zero except rank t's).
//             Rank t keeps (o_t, lse_t); y_t = o_t W_o + b_o locally.
//   backward: do_p, D_p local; for t: rank t broadcasts its [k_t; v_t] [2, L_t, n_kv d_h] (next
//             one posted ahead); every rank computes the backward of its LOCAL queries against
//             them with the global lse and D: dq accumulates locally, the partial [dk_t; dv_t] is
//             summed at rank t (reduce as above).
// Communication per rank and layer: (P-1)/P * (2Q n_q d_h + 2Q n_q + 4(S+Q) n_kv d_h) elements.
//
// Call order: collective. Every rank constructs the layer, calls reshard(), forward(), backward()
// together (reshard all-gathers the ranks' chunk lists).
#pragma once

#include <string>
#include <vector>

#include "diffcp/cp/cp_common.hpp"
#include "diffcp/cp/cp_layer.hpp"

namespace diffcp {

// Timings: fwd_overlap_exposed_ms / bwd_overlap_exposed_ms = waiting for the broadcast posted one
// step ahead; blocking_comm_ms = the lse all-reduces and the reductions of o and dk/dv.
class RingXLayer final : public CpAttentionLayer {
 public:
  // compute = bf16 (issue #14): q and k|v broadcast in bf16, the o and dk|dv partials reduced in bf16
  // (f32 add, rounded per step), the attention kernels in bf16, the projections autocast; lse, the
  // rescale and dq's accumulation in f32.
  RingXLayer(Communicator& cp, const AttnLayerConfig& cfg, CpShard shard, DType compute = DType::f32);  // collective
  const char* name() const override { return "ringx"; }

  // (P-1)/P * (e (2Q n_q d_h + 4(S+Q) n_kv d_h) + 4 * 2Q n_q) bytes, mean over ranks (see ringx.cpp).
  double predicted_bytes_per_layer() const override;

 private:
  using Saved = OwnSaved;  // what forward saves for backward (besides the input views)
  void on_reshard() override;
  std::unique_ptr<CpSavedState> new_state() const override { return std::make_unique<Saved>(); }
  void forward_impl(CpSavedState& st, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                    float* y_p) override;
  void backward_impl(CpSavedState& st, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                     const float* dy_p, float* dx_p, float* dctx_p, AttnLayerParams& grad) override;
  // Counts of a reduce to `root` of `n` elements: zero except at root.
  std::vector<std::size_t> rooted_counts(int root, std::int64_t n) const;
  // Posts the broadcast of step t's payload: root t's `own` [n], received into buf_[slot] elsewhere.
  WorkPtr post_broadcast(int t, ConstTensorView own, int slot, std::int64_t n);

  OwnRows own_;
  std::vector<BlockMask> fwd_masks_;      // [P]: rank t's query blocks x local key rows
  std::vector<BlockMask> bwd_masks_;      // [P]: local query blocks x rank t's key rows
  std::vector<std::int64_t> query_rows_, key_rows_;  // [P] Q_t, L_t
  Workspace buf_[2];                       // broadcast payloads (compute dtype), double-buffered: q_t or [2, L_t, kvw]
  // lse, the rescale and dq's accumulation stay f32 whatever the compute dtype:
  DeviceVector<float> o_part_, lse_part_, lse_all_;  // [Q_max, n_q d_h], [Q_max, n_q] x2
  DeviceVector<float> dq_, dq_step_;       // [Q_p, n_q d_h]
  DeviceVector<float> dkv_own_;            // [2, L_p, kvw]
  Workspace dkv_part_;                     // [2, L_max, kvw] a step's dk|dv partial (compute dtype)
  // The kernels' operands and the reduced rows in the compute dtype (f32: the f32 tensors themselves).
  Workspace q_c_, kv_c_, dout_c_, o_c_, o_own_c_, dq_c_, dkv_own_c_;
};

}  // namespace diffcp
