// The interface every context-parallel method of the drafter attention layer implements, so the
// paper's table of methods (SPEC A.4, cp/cp_methods.hpp) is one factory away: same inputs,
// parameters and outputs, forward and backward, exact against the same fp64 reference.
//
// Inputs on rank p (CpShard, cp/attention_layer.hpp): x_p [Q_p, H] = the rows of the blocks it
// owns (contiguous even block ranges, rank order = block order), ctx_p [C_p, H] = the context
// rows of its chunks (chunk order). Outputs: y_p, dx_p [Q_p, H], dctx_p [C_p, H], and this rank's
// share of the parameter gradients (sum over the group with allreduce_grads). Every tensor is a
// contiguous view of the layer's dtype() (f32) in the active backend's memory, checked at the
// boundary: a wrong shape, dtype or device is a diffcp::Error naming the tensor. The layer runs on
// the backend active at its last reshard() (its buffers live there; forward() and backward() check
// it). Its collectives take views; the communicator learns from each buffer where it lives. Inside, a method computes and communicates in its
// compute() dtype: f32, or bf16 (bf16 kernels and payloads, f32 accumulation; each method's header
// says which of its tensors stay f32).
//
// forward() returns what the backward needs (CpSaved, flash-attn's autograd context): the input
// views and the method's saved activations. backward() consumes it:
//   CpSaved s = layer.forward(w, x_p, ctx_p, y_p);      // x_p, ctx_p: kept alive and unchanged
//   layer.backward(std::move(s), w, dy_p, dx_p, dctx_p, grad);  // until this call
// Wrong: backward with a context of another layer, or of a forward before the last reshard()
// (an Error says which); two backwards of one context (the second gets an empty one).
// The activation buffers come from the layer's pool and go back to it in backward() (or
// discard() for a forward whose backward never runs), so steps of repeating shapes allocate
// nothing.
// Call order: every rank calls forward() then backward() (and reshard() between steps).
#pragma once

#include <cmath>
#include <span>

#include <cstdint>
#include <memory>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/core/tensor.hpp"
#include "diffcp/cp/attention_layer.hpp"
#include "diffcp/ops/backend.hpp"

namespace diffcp {

// Wall-clock of the last forward/backward on this rank and the communication time it left
// exposed (waits that include waiting for slower ranks).
struct CpTimings {
  double fwd_ms = 0, bwd_ms = 0;
  double fwd_overlap_exposed_ms = 0;  // waiting for a collective launched to overlap forward compute
  double bwd_overlap_exposed_ms = 0;  // same in the backward
  double blocking_comm_ms = 0;        // collectives with nothing to overlap (host waits: ~0 on NCCL, cp_common.hpp timed_wait)
  double exposed_comm_ms() const { return fwd_overlap_exposed_ms + bwd_overlap_exposed_ms + blocking_comm_ms; }
};

class CpAttentionLayer;

// A method's saved activations (each method derives its own; see e.g. SplitKVLayer).
struct CpSavedState {
  virtual ~CpSavedState() = default;
};

// What one forward() saved for its backward(): move-only, consumed by backward().
class CpSaved {
 public:
  CpSaved() = default;
  CpSaved(CpSaved&&) noexcept = default;
  CpSaved& operator=(CpSaved&&) noexcept = default;
  CpSaved(const CpSaved&) = delete;
  CpSaved& operator=(const CpSaved&) = delete;

  explicit operator bool() const { return state_ != nullptr; }  // false: empty or consumed
  const ConstTensorView& x_p() const { return x_p_; }    // [Q_p, H] the forward's input
  const ConstTensorView& ctx_p() const { return ctx_p_; }  // [C_p, H]
  const CpSavedState* state() const { return state_.get(); }

 private:
  friend class CpAttentionLayer;
  const CpAttentionLayer* layer_ = nullptr;  // the layer whose forward made it (identity only)
  std::uint64_t generation_ = 0;             // that layer's reshard count at the forward
  ConstTensorView x_p_, ctx_p_;
  std::unique_ptr<CpSavedState> state_;
};

class CpAttentionLayer {
 public:
  virtual ~CpAttentionLayer() = default;
  CpAttentionLayer(const CpAttentionLayer&) = delete;
  CpAttentionLayer& operator=(const CpAttentionLayer&) = delete;

  virtual const char* name() const = 0;
  // A new micro-batch (or plan) for the next step; contexts saved before it are refused by
  // backward(). shard.P, shard.p must match the communicator. Collective for the methods whose
  // reshard exchanges chunk lists (ulysses, ring, ringx).
  void reshard(CpShard shard);

  //   x_p: [Q_p, H]   ctx_p: [C_p, H]   y_p: [Q_p, H] out
  CpSaved forward(const AttnLayerParams& w, ConstTensorView x_p, ConstTensorView ctx_p, TensorView y_p);
  //   saved: what this layer's last-reshard forward returned (consumed)
  //   dy_p: [Q_p, H]  dx_p: [Q_p, H] out  dctx_p: [C_p, H] out  grad: this rank's share ADDED
  void backward(CpSaved&& saved, const AttnLayerParams& w, ConstTensorView dy_p, TensorView dx_p, TensorView dctx_p,
                AttnLayerParams& grad);
  // Hands the buffers of a context whose backward will not run (evaluation, recompute) back to
  // the pool. Any generation; a context of another layer is an Error.
  void discard(CpSaved&& saved);

  // Closed-form bytes one layer (forward + backward) sends per rank, mean over ranks, as the
  // communicator counts them (cp/bytes.hpp; payloads in compute(), lse and D in f32).
  virtual double predicted_bytes_per_layer() const = 0;
  // Of those, the bytes to ranks on other nodes, for a method with a closed form of them
  // (Split-KV); NaN for the others.
  virtual double predicted_inter_bytes_per_layer() const { return std::nan(""); }
  // The log-sum-exp of this rank's owned query rows, [Q_p, n_q], from a forward's saved context,
  // for a method that keeps the global lse (Split-KV); empty for those that keep per-step partials.
  virtual std::span<const float> saved_lse(const CpSaved& saved) const { return {}; }
  DType dtype() const { return DType::f32; }  // of x, ctx, y and their gradients
  DType compute() const { return compute_; }  // of the kernels and payloads inside: f32 or bf16
  const AttnLayerConfig& config() const { return cfg_; }
  const CpShard& shard() const { return shard_; }
  // This rank's timings: forward() resets them, backward() adds its part, so after a backward
  // they cover that forward and backward (the drafter's attention_comm phase relies on it).
  const CpTimings& timings() const { return timings_; }

 protected:
  // Validates cfg and compute (f32 or bf16; `method` names it in the error), before any
  // communication. The derived constructor calls reshard(shard) once it can.
  CpAttentionLayer(Communicator& cp, const AttnLayerConfig& cfg, const char* method, DType compute);

  // The method's part of reshard(), after shard_ is set.
  virtual void on_reshard() = 0;
  // An empty saved state of the method's type (the pool's first fill).
  virtual std::unique_ptr<CpSavedState> new_state() const = 0;
  // The method's forward and backward on checked contiguous f32 buffers (shapes as above). `st`
  // is a state made by new_state(), reused across steps: the method sizes its buffers. The caller
  // runs them with the GEMMs in compute() precision (ScopedF32GemmCompute) and times them
  // (timings().fwd_ms, bwd_ms).
  virtual void forward_impl(CpSavedState& st, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                            float* y_p) = 0;
  virtual void backward_impl(CpSavedState& st, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                             const float* dy_p, float* dx_p, float* dctx_p, AttnLayerParams& grad) = 0;

  Communicator& comm_;
  AttnLayerConfig cfg_;
  CpShard shard_;
  CpTimings timings_;
  const DType compute_;

 private:
  std::unique_ptr<CpSavedState> take_state(CpSaved& saved, const char* what, bool any_generation) const;
  // The active backend is the one of the last reshard().
  void check_memory() const;
  std::uint64_t generation_ = 0;
  const Backend* backend_ = nullptr;  // active at the last reshard(): the buffers live in its memory
  std::unique_ptr<CpSavedState> spare_;  // the pool: one state, in use between forward and backward
};

// Sums parameter gradients over a group (CP, DP or both): one all-reduce of the whole buffer.
void allreduce_grads(Communicator& group, AttnLayerParams& grad);

}  // namespace diffcp
