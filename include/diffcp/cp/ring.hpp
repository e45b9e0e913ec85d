// Ring attention (ring-flash-attention style) for the drafter attention layer (SPEC A.4): queries
// stay on their owner, the K/V shards circulate around the ring. The context layout is the
// caller's: zigzag (balance/zigzag) is ring attention's usual one, any CpShard works.
// On rank p of a CP group of P, with next = p+1, prev = p-1 (mod P):
//   forward:  q_p, kv_p = projections of its own rows; for t = 0..P-1 it holds the K/V of rank
//             s = p - t: post send(kv_s -> next) and recv(kv_{s-1} <- prev), compute the partial
//             (o, lse) of its own queries against kv_s, LSE-merge into the running (o_p, lse_p),
//             wait; y_p = o_p W_o + b_o locally.
//   backward: do_p, D_p local; K/V circulate again. At step t it computes dq (accumulated locally)
//             and the contribution to rank s's dk, dv. Rank s's contributions travel in one
//             accumulator that starts at s+1 (step 1) and hops next until it reaches s after the
//             last step, where s adds its own step-0 contribution: P-1 hops, not P.
// Each (query blocks, visiting rank) pair has its own BlockMask (cp_common cross_mask); a query
// block sees its own B rows only at step 0.
// Communication: 3 (P-1)/P * 2(S+Q) n_kv d_h elements per rank and layer: grows with S.
//
// Call order: collective. Every rank constructs the layer, calls reshard(), forward(), backward()
// together (reshard all-gathers the ranks' chunk lists).
#pragma once

#include <string>
#include <vector>

#include "diffcp/cp/cp_common.hpp"
#include "diffcp/cp/cp_layer.hpp"

namespace diffcp {

// Timings: fwd_overlap_exposed_ms / bwd_overlap_exposed_ms = waiting for the ring transfers
// (posted before the step's attention) after it; blocking_comm_ms = 0.
class RingLayer final : public CpAttentionLayer {
 public:
  // compute = bf16 (issue #14): the visiting K/V shards in bf16, the attention kernels in bf16 (q,
  // do rounded), the projections autocast; partial outputs merged and dk/dv accumulated (and sent)
  // in f32.
  RingLayer(Communicator& cp, const AttnLayerConfig& cfg, CpShard shard, DType compute = DType::f32);  // collective
  const char* name() const override { return "ring"; }

  // (P-1)/P * 2 (S+Q) n_kv d_h (2 e + 4) bytes, mean over ranks (cp/bytes.hpp, ring.cpp).
  double predicted_bytes_per_layer() const override;

 private:
  using Saved = OwnSaved;  // what forward saves for backward (besides the input views)
  void on_reshard() override;
  std::unique_ptr<CpSavedState> new_state() const override { return std::make_unique<Saved>(); }
  void forward_impl(CpSavedState& st, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                    float* y_p) override;
  void backward_impl(CpSavedState& st, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                     const float* dy_p, float* dx_p, float* dctx_p, AttnLayerParams& grad) override;
  int src_of_step(int t) const { return (shard_.p - t + 2 * shard_.P) % shard_.P; }
  std::size_t kv_count(int r) const { return static_cast<std::size_t>(key_rows_[static_cast<std::size_t>(r)] * 2 * cfg_.kv_width()); }

  OwnRows own_;
  std::vector<BlockMask> masks_;         // [P]: own query blocks x rank r's key rows
  std::vector<std::int64_t> key_rows_;   // [P] L_r
  Workspace kv_buf_[2];                   // [2, L_max, kvw] visiting K/V (compute dtype), double-buffered
  DeviceVector<float> o_step_, lse_step_, o_tmp_, lse_tmp_;  // [Q_p, n_q d_h], [Q_p, n_q]
  DeviceVector<float> dq_, dq_step_;      // [Q_p, n_q d_h]
  // The dk/dv accumulators travel and add in f32 whatever the compute dtype:
  DeviceVector<float> dkv_own_, dkv_in_;  // [2, L_p, kvw] own contribution; [2, L_max, kvw] arriving accumulator
  DeviceVector<float> dkv_out_[2];        // [2, L_max, kvw] outgoing accumulators, double-buffered
  // The kernels' operands and outputs in the compute dtype (compute = f32: the f32 tensors themselves).
  Workspace q_c_, dout_c_, kv_own_c_, o_c_, dq_c_, dkv_c_;
  // One step's attention of q [Q_p, n_q, d_h] on rank s's shard kv [2, L_s, kvw] (compute dtype):
  // o [Q_p, qw], lse [Q_p, n_q] out (f32).
  void step_forward(ConstTensorView q, ConstTensorView kv, int s, float* o, DeviceVector<float>& lse);
  // Its backward (dout: [Q_p, qw] compute dtype): dq [Q_p, qw] and dkv [2, L_s, kvw] out (f32).
  void step_backward(const OwnActivations& own, ConstTensorView q, ConstTensorView kv, ConstTensorView dout, int s,
                     float* dq, float* dkv);
};

}  // namespace diffcp
