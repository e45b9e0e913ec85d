// The interface every context-parallel method of the drafter attention layer implements, so the
// paper's table of methods (SPEC A.4) is one factory away: same inputs, parameters and outputs,
// forward and backward, exact against the same fp64 reference.
//
// Inputs on rank p (CpShard, cp/attention_layer.hpp): x_p [Q_p, H] = the rows of the blocks it
// owns (contiguous even block ranges, rank order = block order), ctx_p [C_p, H] = the context
// rows of its chunks (chunk order). Outputs: y_p, dx_p [Q_p, H], dctx_p [C_p, H], and this rank's
// share of the parameter gradients (sum over the group with allreduce_grads).
// Call order: every rank calls forward() then backward() (and reshard() between steps).
#pragma once

#include "diffcp/cp/attention_layer.hpp"

namespace diffcp {

// Wall-clock of the last forward/backward on this rank and the communication time it left
// exposed (waits that include waiting for slower ranks).
struct CpTimings {
  double fwd_ms = 0, bwd_ms = 0;
  double fwd_overlap_exposed_ms = 0;  // waiting for a collective launched to overlap forward compute
  double bwd_overlap_exposed_ms = 0;  // same in the backward
  double blocking_comm_ms = 0;        // collectives with nothing to overlap
  double exposed_comm_ms() const { return fwd_overlap_exposed_ms + bwd_overlap_exposed_ms + blocking_comm_ms; }
};

class CpAttentionLayer {
 public:
  virtual ~CpAttentionLayer() = default;
  virtual const char* name() const = 0;
  virtual void reshard(CpShard shard) = 0;
  //   x_p: [Q_p, H]   ctx_p: [C_p, H]   y_p: [Q_p, H] out
  virtual void forward(const AttnLayerParams& w, const float* x_p, const float* ctx_p, float* y_p) = 0;
  //   dy_p: [Q_p, H]  dx_p: [Q_p, H] out  dctx_p: [C_p, H] out  grad: this rank's share ADDED
  virtual void backward(const AttnLayerParams& w, const float* dy_p, float* dx_p, float* dctx_p,
                        AttnLayerParams& grad) = 0;
  // Closed-form bytes one layer (forward + backward) sends per rank, mean over ranks, as the
  // communicator counts them.
  virtual double predicted_bytes_per_layer() const = 0;
  const CpTimings& timings() const { return timings_; }

 protected:
  CpTimings timings_;
};

// Sums parameter gradients over a group (CP, DP or both): one all-reduce of the whole buffer.
void allreduce_grads(Communicator& group, AttnLayerParams& grad);

}  // namespace diffcp
