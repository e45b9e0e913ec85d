// LV-XAttn for the drafter attention layer (SPEC A.4): K/V never move; the query-side state of
// every rank's blocks hops around a point-to-point ring, one hop per step, and each rank applies
// its local K/V to whichever state it holds. Context shards keep whatever layout the caller gives
// (LV-XAttn itself has no balancing; contiguous is its usual one). On rank p of P, next = p+1,
// prev = p-1 (mod P); at step t = 1..P-1 rank p holds the state of rank s = p - t:
//   forward:  the state is q_s [Q_s, n_q d_h] and the running (o_s, lse_s). p merges its partial
//             Attn(q_s, local K/V) into the running pair and passes it on; q_s is forwarded as
//             soon as it arrives (before the attention), the running pair after it - the
//             sequential dependency of LV-XAttn. The owner computes its own partial at step 0 and
//             keeps it; the travelling pair starts at s+1 and returns home after step P-1, where
//             the owner merges the two: q makes P-1 hops (s -> ... -> s-1), (o, lse) P-1 hops
//             (s+1 -> ... -> s). y_p = o_p W_o + b_o locally.
//   backward: the state is the inputs (q_s, do_s, lse_s, D_s) and the travelling dq accumulator;
//             each rank adds AttnBwd(state, local K/V)'s dk, dv into its LOCAL dk_p, dv_p. Same
//             schedule: inputs go first (P-1 hops), the dq accumulator follows (P-1 hops).
// Communication per rank and layer: (P-1)/P * Q (5 n_q d_h + 3 n_q) elements: independent of S.
// compute = bf16 (issue #14): q and do travel (and the attention runs) in bf16; the running o and
// the dq accumulator, summed over P-1 hops, stay f32 (as Ring's dk/dv accumulators), lse and D too:
// (P-1)/P * Q (3 n_q d_h 2 + 2 n_q d_h 4 + 3 n_q 4) bytes. The backward inputs then travel as one
// packed byte message [q | do (bf16) | lse | D (f32)].
//
// Call order: every rank calls forward() then backward() (collective-free constructor/reshard).
#pragma once

#include <string>
#include <vector>

#include "diffcp/cp/cp_common.hpp"
#include "diffcp/cp/cp_layer.hpp"

namespace diffcp {

// Timings: fwd_overlap_exposed_ms / bwd_overlap_exposed_ms = waiting for the ring messages (query
// state, running output or dq accumulator) posted before the step's attention; blocking_comm_ms = 0.
class LvXAttnLayer final : public CpAttentionLayer {
 public:
  LvXAttnLayer(Communicator& cp, const AttnLayerConfig& cfg, CpShard shard,
               DType compute = DType::f32);  // collective-free
  const char* name() const override { return "lvxattn"; }

  // (P-1)/P * Q (5 n_q d_h + 3 n_q) f32 elements, mean over ranks (cp/bytes.hpp, lvxattn.cpp).
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
  // Bytes that [q | do] of `rows` rows take in the packed backward inputs, and the whole message
  // [q | do | lse | D].
  std::int64_t qdo_bytes(std::int64_t rows) const;
  std::int64_t in_bytes(std::int64_t rows) const;
  TensorView part(const DeviceVector<float>& buf, std::int64_t at, DType t, std::int64_t n) const;
  // One attention call of the query state q [rows, qw] (compute dtype) on the local K/V: o, lse out (f32).
  void step_forward(const BlockMask& mask, ConstTensorView q, std::int64_t rows, float* o, float* lse);
  // Its backward from the packed inputs `in` [q | do | lse | D]: dq [rows, qw], dkv [2, L_p, kvw]
  // out (f32).
  void step_backward(const BlockMask& mask, const DeviceVector<float>& in, std::int64_t rows, float* dq, float* dkv);
  std::int64_t rows_of(int r) const { return shard_.query_rows[static_cast<std::size_t>(r)]; }

  OwnRows own_;
  std::vector<BlockMask> masks_;  // [P]: rank s's query blocks x local key rows
  // Rows of rank s's query state, Q_s each: forward q [Q_s, qw], running [o | lse] =
  // [Q_s, qw] then [Q_s, n_q]; backward inputs [q | do | lse | D] = [Q_s, qw] x2 then [Q_s, n_q] x2.
  DeviceVector<float> in_[2];               // arriving query state (q or backward inputs), double-buffered
  DeviceVector<float> part_, acc_in_;       // this step's partial; the arriving running state
  DeviceVector<float> acc_out_[2];          // outgoing running state, double-buffered
  DeviceVector<float> own_part_;            // forward: own [o | lse]; backward: own inputs [q|do|lse|D]
  DeviceVector<float> dq_own_, dkv_, dkv_step_;  // [Q_p, qw], [2, L_p, kvw] x2
  ConstTensorView kv_;                    // the saved [2, L_p, kvw] k|v rows of this pass, in the compute dtype
  // The kernels' operands and outputs in the compute dtype (f32: the f32 tensors themselves).
  Workspace kv_c_, q_c_, o_c_, dq_c_, dkv_c_;
};

}  // namespace diffcp
