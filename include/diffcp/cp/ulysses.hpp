// Ulysses (DeepSpeed-Ulysses) context parallelism for the drafter attention layer (SPEC A.4): swap
// sequence shards for head shards with all-to-alls, run the whole sequence's attention for P-th of
// the heads, swap back. On rank p of a CP group of P (hq = n_q/P, hkv = n_kv/P):
//   forward:  q_p, [k_p; v_p] = projections of its own rows (normed and rotated here);
//             q  = AllToAll(q_p):  [Q, hq, d_h]      all query rows, query heads [p*hq, (p+1)*hq)
//             kv = AllToAll(kv_p): [S+Q, 2, hkv, d_h] all key rows, kv heads [p*hkv, (p+1)*hkv)
//             (o, lse) = Attn(q, k, v) for those heads (GQA: query head j uses kv head j/(n_q/n_kv),
//             which stays on the same rank because hq/hkv = n_q/n_kv);
//             o_p = AllToAll(o): [Q_p, n_q d_h] its own rows, all heads; y_p = o_p W_o + b_o locally.
//   backward: do_p = dy_p W_o^T; do = AllToAll(do_p); D = rowsum(do * o) in head layout;
//             (dq, dk, dv) = AttnBwd(...; lse, D); dq_p = AllToAll(dq), [dk_p; dv_p] = AllToAll(dkv);
//             projection backward of its own rows.
// The key rows arrive in rank order (rank r's context chunks, then its blocks' rows); the mask
// describes that order (cp_common cross_mask), so they are never permuted into full_mask's order.
// Requires P | n_kv (the paper's N/A cells). Communication grows with S (k, v, dk, dv).
// compute = bf16 (issue #14): every all-to-all carries bf16 (half the bytes), the head-layout
// attention runs the bf16 kernel on them (f32 accumulation, f32 lse and D), the projections'
// GEMMs run on bf16-rounded operands; the layer's inputs, outputs, norms and RoPE stay f32.
//
// Call order: collective. Every rank of the group constructs the layer, calls reshard(), forward(),
// backward() together (reshard all-gathers the ranks' chunk lists).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "diffcp/cp/cp_common.hpp"
#include "diffcp/cp/cp_layer.hpp"

namespace diffcp {

// Timings: fwd_overlap_exposed_ms = waiting for the q all-to-all after the K/V projection;
// blocking_comm_ms = the other all-to-alls (kv, o forward; do, dq, dkv backward).
class UlyssesLayer final : public CpAttentionLayer {
 public:
  // Throws diffcp::Error, before any communication, when unsupported_reason(cfg, P) is not empty
  // or the shard does not match the communicator. Then all-gathers the chunk lists (reshard).
  UlyssesLayer(Communicator& cp, const AttnLayerConfig& cfg, CpShard shard, DType compute = DType::f32);
  const char* name() const override { return "ulysses"; }
  // "" when Ulysses can run on P ranks, else why not (P must divide n_kv).
  static std::string unsupported_reason(const AttnLayerConfig& cfg, int P);

  // (P-1)/P^2 * 4 (Q n_q d_h + (S+Q) n_kv d_h) elements of the compute dtype, mean over ranks.
  double predicted_bytes_per_layer() const override;

 private:
  // What forward saves for backward (besides the input views).
  struct Saved : CpSavedState {
    OwnActivations own;            // q_p, [k_p; v_p], o_p, lse_p of the owned rows
    Workspace q_head, o_head;      // [Q, hq, d_h] x2 (compute dtype)
    Workspace kv_head;             // [S+Q, 2, hkv, d_h]: k | v per row (compute dtype)
    DeviceVector<float> lse_head;  // [Q, hq]
  };
  // One all-to-all-v of the packed f32 rows `send`, travelling in the compute dtype (rounded into
  // send_c, which must stay untouched until the exchange completes), into `recv`.
  WorkPtr exchange(const DeviceVector<float>& send, const std::vector<std::size_t>& send_counts, TensorView recv,
                   const std::vector<std::size_t>& recv_counts, Workspace& send_c);
  void on_reshard() override;
  std::unique_ptr<CpSavedState> new_state() const override { return std::make_unique<Saved>(); }
  void forward_impl(CpSavedState& st, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                    float* y_p) override;
  void backward_impl(CpSavedState& st, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                     const float* dy_p, float* dx_p, float* dctx_p, AttnLayerParams& grad) override;
  OwnRows own_;
  std::optional<BlockMask> mask_;  // all N query blocks x all ranks' key rows in rank order
  std::int64_t P_ = 1, hq_ = 0, hkv_ = 0, Q_ = 0, L_ = 0;  // L_ = S + Q
  // all-to-all element counts per peer: query side [Q_r hq d_h], key side [L_r 2 hkv d_h]
  std::vector<std::size_t> q_own_counts_, q_all_counts_, kv_own_counts_, kv_all_counts_;
  DeviceVector<float> q_send_, q_recv_, kv_send_, kv_recv_;  // [P][rows, slice] packing scratch (f32)
  Workspace do_head_, dq_head_, dkv_head_;                 // as their forward tensors (compute dtype)
  DeviceVector<float> delta_head_;                          // [Q, hq]
  DeviceVector<float> dq_p_, dkv_p_;                        // [Q_p, n_q d_h], [2, L_p, n_kv d_h]
  // The f32 rows that travel, in the compute dtype (one per exchange in flight at once).
  Workspace q_send_c_, kv_send_c_, recv_c_, kv_recv_c_;
};

}  // namespace diffcp
