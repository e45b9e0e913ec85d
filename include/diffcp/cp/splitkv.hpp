// Split-KV: exact context parallelism for the drafter attention layer (SPEC A.2, Algorithm 1 of
// seed 000). On rank p of a CP group of P:
//   forward:  q_p = RoPE(RMSNorm_q(X_p W_q)); LAUNCH q = AllGather(q_p);
//             k_p, v_p = KVProj([ctx_p; X_p]) while the all-gather flies; wait;
//             (o_p, lse_p) = Attn(q, k_p, v_p) over LOCAL keys; lse = AllReduce_logsumexp(lse_p);
//             obar_p = exp(lse_p - lse) o_p; ybar_p = obar_p W_o; Y_p = ReduceScatter_sum(ybar_p) + b_o
//   backward: g = AllGather(dY_p); do = g W_o^T; D = AllReduce_sum(rowsum(do * obar_p));
//             (dq, dk_p, dv_p) = AttnBwd(q, k_p, v_p, do; lse, D); LAUNCH dq_p = ReduceScatter_sum(dq);
//             dU_p = KVProjBwd(dk_p, dv_p) while it flies (dk_p, dv_p never leave the rank); wait;
//             dX_p = QProjBwd(dq_p) + dU_p[block rows]; dctx_p = dU_p[context rows].
// Communication per layer: AG [Q, n_q d_h] + RS [Q, H] forward, AG [Q, H] + RS [Q, n_q d_h]
// backward, and two [Q, n_q] all-reduces: independent of the context length S.
// Parameter gradients are local shares; sum them over the CP (and DP) group with allreduce_grads.
//
// Options (SplitKVOptions):
//   oproj = owned: apply W_o (forward and backward) to the owned rows only: y_p = o_p W_o + b_o,
//     backward do_p = dY_p W_o^T, do = AllGather(do_p). The forward then moves the partial output
//     [Q, n_q d_h] instead of ybar_p [Q, H], and so does the backward's all-gather (the drafter
//     shapes have n_q d_h = 2H: twice the bytes), and the W_o GEMMs shrink from Q to Q_p rows.
//     With flat collectives it runs as an OWNER MERGE, one blocking exchange per pass instead of
//     two: forward (o_p^r, lse_p^r) = AllToAll(o_p, lse_p) (the P partials of the owned rows, o in
//     the compute dtype, lse f32), merged at the owner in rank order (attention/merge.hpp) to o_p,
//     lse; backward D_p = rowsum(do_p * o_p) locally, then do = AllGather(do_p) together with
//     [lse | D] = AllGather([lse_p | D_p]) (f32): no all-reduce, 3 (P-1)/P n f32 statistics
//     instead of 2 (P-1)/P n per all-reduce. With hierarchical collectives: lse all-reduce,
//     o_p = ReduceScatter_sum(obar_p), D all-reduce, as oproj all.
//   collectives = hierarchical: every collective runs two-level over the communicator's topology
//     (comm/communicator.hpp): each node's rows cross each other node once.
//   compute = bf16 (issue #14): the attention kernels run on bf16 q, k, v, do (f32 accumulation,
//     f32 lse and D), the projections' GEMMs on bf16-rounded operands (ScopedF32GemmCompute,
//     f32 accumulation), and the four row collectives carry bf16 (the q and dY / do all-gathers,
//     the Y / o reduce-scatter or the owner merge's o all-to-all, the dq reduce-scatter; sums in
//     f32, rounded at each step): half the bytes. The layer's inputs, outputs, norms, RoPE, the lse
//     and D statistics (all-reduced, or exchanged by the owner merge) stay f32 (autocast-style
//     mixed precision: f32 at the layer boundary, bf16 where the time and the bytes are).
//
// The projections of the rows a rank owns are the shared ones (cp_common.hpp OwnRows), run so that
// the q all-gather flies under the K/V projection and the dq reduce-scatter under its backward.
// Call order: every rank of the group calls forward(), then backward(), with its own shard.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "diffcp/attention/mask.hpp"
#include "diffcp/comm/communicator.hpp"
#include "diffcp/cp/cp_common.hpp"
#include "diffcp/cp/cp_layer.hpp"

namespace diffcp {

enum class OProj : std::uint8_t { all, owned };
// "all" | "owned" (anything else throws; "auto" is resolved by the caller with choose_oproj).
OProj parse_oproj(const std::string& name);
const char* oproj_name(OProj o);

struct SplitKVOptions {
  OProj oproj = OProj::all;
  CollAlgo collectives = CollAlgo::flat;  // hierarchical needs cp.has_topology()
  DType compute = DType::f32;             // f32 | bf16: attention and row payloads
};

// The cost model of --oproj auto: owned when the output-projection time it saves is larger than
// the time of the extra bytes it sends (per rank, forward + backward):
//   saved = 3 GEMMs of (Q - Q/P) x n_q d_h x H = 6 Q (P-1)/P n_q d_h H flop at gemm_gflops,
//   extra = 2 (P-1)/P Q (n_q d_h - H) elements of dtype_size(dtype) bytes at link_gbit.
// Q: query rows of the micro-batch; link_gbit: what one rank's collective traffic gets.
OProj choose_oproj(const AttnLayerConfig& cfg, std::int64_t Q, int P, double gemm_gflops, double link_gbit,
                   DType dtype = DType::f32);
// The same decision without rates (the trainer's --oproj auto): owned when n_q d_h <= H, where
// owned's extra bytes are <= 0 and it always wins; all otherwise.
OProj choose_oproj_by_shape(const AttnLayerConfig& cfg);

// Timings: fwd_overlap_exposed_ms = waiting for the q all-gather after the K/V projection;
// bwd_overlap_exposed_ms = waiting for the dq reduce-scatter after the K/V projection backward;
// blocking_comm_ms = RS of Y (or o), AG of dY (or do) and the all-reduces; with the owner merge its
// all-to-all and the do + [lse | D] all-gather.
class SplitKVLayer final : public CpAttentionLayer {
 public:
  // Collective-free. The communicator is the CP group; shard.P and shard.p must match it.
  SplitKVLayer(Communicator& cp, const AttnLayerConfig& cfg, CpShard shard, SplitKVOptions opt = {});
  const char* name() const override { return "splitkv"; }
  // reshard() (cp_layer.hpp): buffers are kept; with a bucketed shard whose padded K/V length and
  // Q do not change, a step (forward + backward) allocates nothing (see allocations()).

  // The lse [Q_p, n_q] of the query rows this rank owns, as a forward of this layer saved it (for
  // dumps and tests).
  std::span<const float> lse(const CpSaved& saved) const;
  std::span<const float> saved_lse(const CpSaved& saved) const override { return lse(saved); }
  // How many times a buffer (saved activations or step scratch) had to grow (0 per step while
  // shapes repeat and every forward's context goes back through backward() or discard()).
  std::int64_t allocations() const { return allocations_ + own_.allocations(); }
  // The mean over ranks of the bytes each rank sends per layer (forward + backward), as the
  // communicator counts them (w = H for oproj all, n_q d_h for owned; n = Q n_q; N nodes; the flat
  // path when there is one node or one rank per node), elements of options().compute for the rows and f32 for
  // the lse / D statistics: with the owner merge (owned, flat) the lse partials' all-to-all and the
  // [lse | D] all-gather, 3 (P-1)/P n; otherwise a = 1 + lse_all_reduces(comm) (cp/lse_reduce.hpp)
  // all-reduces:
  //   flat:         (P-1)/P * [2Q n_q d_h + 2Q w] + a * 2(P-1)/P * n   (owner merge: 3(P-1)/P n instead)
  //   hierarchical: (P-1)/P * [2Q n_q d_h + 2Q w] + a * [2n(N-1) + 3n(P-N)] / P
  double predicted_bytes_per_layer() const override;
  // Of those, the mean sent to other nodes (needs cp.has_topology()):
  //   flat:         1/P * [sum_r Q_r (2 n_q d_h + 2w) (P - L_node(r)) + a sum_p sum_{r off p's node} (s_r + s_p)]
  //                 with s_r = n/P (+1 for r < n mod P) the all-reduce shares; the owner merge's
  //                 statistics instead: sum_r 3 Q_r n_q (P - L_node(r))
  //   hierarchical: 1/P * [(N-1) (2Q n_q d_h + 2Q w) + a * 2n(N-1)]
  double predicted_inter_bytes_per_layer() const override;
  const SplitKVOptions& options() const { return opt_; }

 private:
  // What forward saves for backward (besides the input views).
  struct Saved : CpSavedState {
    OwnActivations own;  // q_p, k_p, v_p (L_k padded rows); own.o = o_p with oproj owned
    Workspace q_all;     // [Q, n_q d_h] gathered, normed and rotated (compute dtype)
    Workspace kv_c;      // [2, L_k, kvw] own.kv rounded (compute = bf16; f32 reads own.kv)
    ConstTensorView kv;  // [2, L_k, kvw] k rows, then v rows, in the compute dtype: own.kv or kv_c
    DeviceVector<float> obar;  // [Q, n_q d_h] rescaled local output (empty with the owner merge)
    DeviceVector<float> lse;   // [Q, n_q] global lse; owner merge: [Q_p, n_q] the owned rows'
  };
  void on_reshard() override;
  std::unique_ptr<CpSavedState> new_state() const override { return std::make_unique<Saved>(); }
  void forward_impl(CpSavedState& st, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                    float* y_p) override;
  void backward_impl(CpSavedState& st, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                     const float* dy_p, float* dx_p, float* dctx_p, AttnLayerParams& grad) override;
  std::vector<std::size_t> row_counts(std::int64_t width) const;  // per-rank element counts of [Q_r, width]
  template <typename T>
  T* buffer(DeviceVector<T>& v, std::int64_t n);  // v resized to n, counting growth
  TensorView buffer(Workspace& v, std::int64_t n);  // the same in the compute dtype
  // A collective of f32 rows that travel in the compute dtype.
  void gather_rows(const float* mine, std::int64_t width, float* all);
  void reduce_scatter_rows(const float* all, std::int64_t width, float* mine);

  SplitKVOptions opt_;
  bool hier_ = false;   // the hierarchical path really runs (topology with 1 < N < P)
  bool merge_ = false;  // the owner merge runs: oproj owned with flat collectives
  std::optional<BlockMask> mask_;
  std::int64_t Q_ = 0;
  OwnRows own_;  // the projections of the rows this rank owns (cp_common.hpp), K/V padded to the bucket
  // Step scratch in the backend's memory, kept so that steps of equal shape reuse it.
  DeviceVector<float> lse_p_;                        // [Q, n_q] local lse
  DeviceVector<float> ybar_, g_, dout_, delta_, dkv_, dq_p_;
  DeviceVector<float> parts_, lse_parts_, stats_p_, stats_all_, lse_all_;  // the owner merge
  // In the compute dtype: q_p, the partial output, the rows collectives send and receive, do, dq,
  // dk|dv, dq_p.
  Workspace q_p_, obar_c_, send_c_, recv_c_, dout_c_, dq_c_, dkv_c_, dq_p_c_;
  std::int64_t allocations_ = 0;
};

}  // namespace diffcp
