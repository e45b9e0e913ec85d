// What the CP baselines of SPEC A.4 (ulysses, ring, ringx, lvxattn) share: where every rank's rows
// are, the block-sparse mask of one "some query blocks x some ranks' key rows" attention call, the
// rank-local ends of the layer (projections of the rows a rank owns, output projection of its own
// query rows), and small helpers for the merge and the head-sharded all-to-all layout.
//
// Legend (as in cp/attention_layer.hpp): P ranks, rank p owns blocks [blocks_p) = Q_p query rows
// and holds C_p context rows; L_p = C_p + Q_p key rows, in local order: its context chunks (chunk
// order), then the B rows of each owned block (block order). qw = n_q*d_h, kvw = n_kv*d_h.
// Unlike Split-KV, every baseline ends its forward with the merged attention output o_p [Q_p, qw]
// of its OWN query rows, so the output projection is local (no reduce-scatter of Y).
// The baselines use a rank's real rows only: CpShard::bucket (static-shape padding of the local
// K/V length) is a Split-KV buffer-reuse option and is ignored here; results do not depend on it.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include "diffcp/attention/mask.hpp"
#include "diffcp/comm/communicator.hpp"
#include "diffcp/core/tensor.hpp"
#include "diffcp/cp/attention_layer.hpp"
#include "diffcp/cp/cp_layer.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/ops/elementwise.hpp"
#include "diffcp/ops/rope.hpp"

namespace diffcp {

// The key/value rows one rank projects, in its local row order: `chunks`' context rows, then the
// B rows of each block in `blocks`.
struct KeyRows {
  std::vector<PosRange> chunks;
  Shard blocks{0, 0};
  std::int64_t rows(std::int64_t B) const;  // L_r
};

// Block range of every rank [P], from shard.query_rows (contiguous ranges in rank order).
std::vector<Shard> block_ranges(const CpShard& s);
// KeyRows of this rank (no communication).
KeyRows own_key_rows(const CpShard& s);
// KeyRows of every rank [P]. A rank knows only its own chunk list, so this is collective over `cp`
// (two all-gathers of a few integers per chunk); methods call it in reshard(), once per step,
// outside the per-layer traffic that predicted_bytes_per_layer() counts.
std::vector<KeyRows> gather_key_rows(Communicator& cp, const CpShard& s);

// Mask of one attention call whose query rows are the blocks [queries.begin, queries.end) (query
// row j*B + r is row r of block queries.begin + j) and whose key rows are the concatenation of
// `keys` (each rank's rows in its local order). A query block sees its own B rows only if one of
// `keys` holds them; key rows of blocks outside `queries` are held but seen by no query. `window`:
// the layer's KeyWindow (attention/mask.hpp).
BlockMask cross_mask(const PackedBatch& batch, Shard queries, std::span<const KeyRows> keys, KeyWindow window);

using CpClock = std::chrono::steady_clock;
inline double elapsed_ms(CpClock::time_point t0) {
  return std::chrono::duration<double, std::milli>(CpClock::now() - t0).count();
}
// Waits for `w`; returns the milliseconds spent waiting (exposed communication). On a host
// communicator (MPI) that is the host's wait; on a stream one (NCCL) wait() only orders the compute
// stream, so this reads ~0 and the exposure shows in the step's time (taken after a synchronize):
// per-wait device timings need CUDA events, not yet measured.
inline double timed_wait(Work& w) {
  const auto t0 = CpClock::now();
  w.wait();
  return elapsed_ms(t0);
}

// A contiguous [rows, heads, dim] view of `data` (T: float or bf16_t, const or not).
template <typename T>
HeadRows<T> head_view(T* data, std::int64_t rows, std::int64_t heads, std::int64_t dim) {
  return {data, rows, heads, dim, heads * dim};
}

// Merges the partial (o_b, lse_b) into the running (o_a, lse_a) by log-sum-exp; writes the result
// to (o_out, lse_out), which must not alias the inputs.
//   o_*: [rows, n_q, d_h]   lse_*: [rows, n_q]
void merge_two(HeadRows<const float> o_a, std::span<const float> lse_a, HeadRows<const float> o_b,
               std::span<const float> lse_b, HeadRows<float> o_out, std::span<float> lse_out);

// add_into (y += x): ops/elementwise.hpp, a backend op.

// Head-sharded all-to-all layout (Ulysses). The tensors src[j]: [rows, P*hd] are cut into P
// slices of hd columns; dst: [P][rows][n][hd] with n = src.size(), i.e. for destination rank r,
// row i: slice r of src[0], slice r of src[1], ...
void pack_head_slices(std::span<const float* const> src, std::int64_t rows, std::int64_t P, std::int64_t hd,
                      float* dst);
// The inverse: src: [P][rows][n][hd] -> dst[j]: [rows, P*hd].
void unpack_head_slices(const float* src, std::int64_t rows, std::int64_t P, std::int64_t hd,
                        std::span<float* const> dst);

// What the rank-local ends save for the backward: part of every method's saved state
// (cp_layer.hpp CpSaved), sized by OwnRows::project_q. L_k >= L_p: see OwnRows::reshard.
// In the active backend's memory.
struct OwnActivations {
  DeviceVector<float> q_lin, q_rstd, q;   // [Q_p, qw] pre-norm, [Q_p, n_q], normed and rotated
  DeviceVector<float> k_lin, k_rstd, kv;  // [L_k, kvw] pre-norm, [L_k, n_kv], [2, L_k, kvw]: k (normed, rotated) rows, then v rows
  DeviceVector<float> o, lse;             // [Q_p, qw] merged attention output, [Q_p, n_q] global lse of own rows: set by the method
};

// The saved state of the methods that keep nothing but the owned rows' activations (Ring, RingX,
// LV-XAttn).
struct OwnSaved : CpSavedState {
  OwnActivations own;  // q_p, [k_p; v_p], o_p, lse_p of the owned rows
};

// The rank-local ends of the layer for the rows this rank owns, shared by every method (the
// projection math exists once). Forward: q_p = RoPE(RMSNorm_q(x_p W_q)), [k_p; v_p] =
// (RoPE(RMSNorm_k(U_p W_k)), U_p W_v) with U_p = [ctx_p; x_p], normed and rotated here before any
// exchange; after the method has filled o (and lse), y_p = o_p W_o + b_o. Backward: do_p = dy_p
// W_o^T (+ dW_o, db_o shares), D_p = rowsum(do_p * o_p); after the method has produced dq_p and
// dk_p, dv_p (gradients w.r.t. the normed, rotated q and k), the projection backward gives dx_p,
// dctx_p and the dW_q, dW_k, dW_v, q_norm, k_norm shares. The activations live in the caller's
// OwnActivations (the method's saved state); OwnRows keeps the shard's positions and scratch.
class OwnRows {
 public:
  // padded_key_rows: L_k, the rows of k and v (Split-KV's bucket padding: rows [L_p, L_k) are
  // zero and masked); 0 = L_p.
  void reshard(const AttnLayerConfig& cfg, const CpShard& s, std::int64_t padded_key_rows = 0);
  std::int64_t Qp() const { return Qp_; }  // Q_p
  std::int64_t Cp() const { return Cp_; }  // C_p
  std::int64_t Lp() const { return Cp_ + Qp_; }  // L_p
  std::int64_t Lk() const { return Lk_; }  // L_k

  //   x_p: [Q_p, H]. Sizes every buffer of `a` for this shard, then computes a.q (and a.q_lin, a.q_rstd).
  void project_q(const AttnLayerParams& w, const float* x_p, OwnActivations& a);
  //   x_p: [Q_p, H], ctx_p: [C_p, H] -> a.kv (a.k_lin, a.k_rstd). Polls `inflight` (may be null)
  //   between row chunks: Open MPI progresses a nonblocking operation only inside MPI calls.
  void project_kv(const AttnLayerParams& w, const float* x_p, const float* ctx_p, OwnActivations& a, Work* inflight);
  //   y_p: [Q_p, H] out, from a.o
  void output_forward(const AttnLayerParams& w, const OwnActivations& a, float* y_p) const;
  //   dy_p: [Q_p, H] -> dout() and, if with_delta, delta(); adds the dW_o, db_o shares to grad
  void output_backward(const AttnLayerParams& w, const OwnActivations& a, const float* dy_p, AttnLayerParams& grad,
                       bool with_delta = true);
  //   x_p: [Q_p, H] the forward's input; dq_p: [Q_p, qw] (destroyed); dx_p: [Q_p, H] = beta*dx_p +
  //   dq_p-part; adds dW_q, q_norm shares
  void backward_q(const AttnLayerParams& w, const OwnActivations& a, const float* x_p, float* dq_p, float* dx_p,
                  float beta, AttnLayerParams& grad);
  //   x_p, ctx_p: the forward's inputs; dkv_p: [2, L_k, kvw] = dk rows then dv rows (destroyed;
  //   padding rows ignored); dx_p: [Q_p, H] = beta*dx_p + block-row part; dctx_p: [C_p, H] out;
  //   adds dW_k, dW_v, k_norm shares; polls `inflight` (may be null)
  void backward_kv(const AttnLayerParams& w, const OwnActivations& a, const float* x_p, const float* ctx_p,
                   float* dkv_p, float* dx_p, float beta, float* dctx_p, AttnLayerParams& grad, Work* inflight);

  DeviceVector<float>& dout() { return dout_; }    // [Q_p, qw] after output_backward
  DeviceVector<float>& delta() { return delta_; }  // [Q_p, n_q] after output_backward
  // How many times a buffer (activations or scratch) had to grow: 0 per step while shapes repeat.
  std::int64_t allocations() const { return allocations_; }

 private:
  float* grow(DeviceVector<float>& v, std::int64_t n);  // v resized to n, counting growth

  AttnLayerConfig cfg_;
  std::int64_t Qp_ = 0, Cp_ = 0, Lk_ = 0;
  std::vector<std::int64_t> key_pos_, query_pos_;  // RoPE positions [L_p], [Q_p]
  DeviceVector<float> dout_, delta_;
  std::int64_t allocations_ = 0;
  RopeTable rope_{2, 1.0, 0};
};

}  // namespace diffcp
