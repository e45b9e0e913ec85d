#include "diffcp/cp/ulysses.hpp"

#include "diffcp/ops/buffer.hpp"

#include "diffcp/attention/attention.hpp"
#include "diffcp/cp/bytes.hpp"
#include "diffcp/ops/gemm.hpp"

namespace diffcp {

UlyssesLayer::UlyssesLayer(Communicator& cp, const AttnLayerConfig& cfg, CpShard shard, DType compute)
    : CpAttentionLayer(cp, cfg, "ulysses", compute) {
  const std::string why = unsupported_reason(cfg_, cp.size());
  DIFFCP_CHECK(why.empty(), why);
  reshard(std::move(shard));
}

std::string UlyssesLayer::unsupported_reason(const AttnLayerConfig& cfg, int P) {
  if (P >= 1 && cfg.n_kv % P == 0) return "";
  return detail::concat("ulysses: P = ", P, " ranks do not divide n_kv = ", cfg.n_kv,
                        " kv heads (head sharding needs P | n_kv)");
}

void UlyssesLayer::on_reshard() {
  own_.reshard(cfg_, shard_);
  const std::vector<KeyRows> keys = gather_key_rows(comm_, shard_);
  const std::int64_t B = shard_.batch.block, d = cfg_.d_h;
  P_ = shard_.P;
  hq_ = cfg_.n_q / P_;
  hkv_ = cfg_.n_kv / P_;
  Q_ = shard_.batch.query_rows();
  L_ = shard_.batch.context_rows() + Q_;
  mask_.emplace(cross_mask(shard_.batch, {0, shard_.batch.num_blocks()}, keys, shard_.window));
  q_own_counts_.assign(static_cast<std::size_t>(P_), static_cast<std::size_t>(own_.Qp() * hq_ * d));
  kv_own_counts_.assign(static_cast<std::size_t>(P_), static_cast<std::size_t>(own_.Lp() * 2 * hkv_ * d));
  q_all_counts_.clear();
  kv_all_counts_.clear();
  for (std::size_t r = 0; r < keys.size(); ++r) {
    q_all_counts_.push_back(static_cast<std::size_t>(shard_.query_rows[r] * hq_ * d));
    kv_all_counts_.push_back(static_cast<std::size_t>(keys[r].rows(B) * 2 * hkv_ * d));
  }
  const auto n = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  q_send_.resize(n(own_.Qp() * cfg_.q_width()));
  q_recv_.resize(q_send_.size());
  kv_send_.resize(n(own_.Lp() * 2 * cfg_.kv_width()));
  kv_recv_.resize(kv_send_.size());
  do_head_.resize(compute_, Q_ * hq_ * d);
  dq_head_.resize(compute_, Q_ * hq_ * d);
  delta_head_.resize(n(Q_ * hq_));
  dkv_head_.resize(compute_, L_ * 2 * hkv_ * d);
  dq_p_.resize(q_send_.size());
  dkv_p_.resize(kv_send_.size());
}

// Per rank p, in elements of compute(): it sends (P-1)/P of each all-to-all's local tensor, whose head
// slice is 1/P of the row: q and o, do and dq move Q_p n_q d_h (P-1)/P each (o and dq: rows of
// the other ranks, Q - Q_p, instead), k, v, dk, dv move L_p n_kv d_h (P-1)/P each. Summed over
// ranks and divided by P:
//   bytes = e * (P-1)/P^2 * 4 * (Q n_q d_h + (S+Q) n_kv d_h),  e = dtype_size(compute()).
// Paper, Table 1 (MHA n_q d_h = n_kv d_h = H, even sharding): (P-1)/P * 4H(S + 2Q)/P elements.
double UlyssesLayer::predicted_bytes_per_layer() const { return ulysses_bytes_per_layer(cfg_, compute_, Q_, L_, P_); }

WorkPtr UlyssesLayer::exchange(const DeviceVector<float>& send, const std::vector<std::size_t>& send_counts,
                               TensorView recv, const std::vector<std::size_t>& recv_counts, Workspace& send_c) {
  return comm_.all_to_all_v_async(to_compute(send.view(), compute_, send_c), send_counts, recv, recv_counts);
}

void UlyssesLayer::forward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                                float* y_p) {
  Saved& st = static_cast<Saved&>(state);  // made by new_state(): CpAttentionLayer checked the owner
  const std::int64_t d = cfg_.d_h, Lp = own_.Lp(), kv_stride = 2 * hkv_ * d;
  // The saved head-layout tensors (no-ops while shapes repeat), in the compute dtype.
  st.q_head.resize(compute_, Q_ * hq_ * d);
  st.o_head.resize(compute_, Q_ * hq_ * d);
  st.kv_head.resize(compute_, L_ * kv_stride);
  st.lse_head.resize(static_cast<std::size_t>(Q_ * hq_));

  // 1. Own queries to head layout (launched), own keys/values while it flies, then theirs.
  own_.project_q(w, x_p, st.own);
  const float* q_src[] = {st.own.q.data()};
  pack_head_slices(q_src, own_.Qp(), P_, hq_ * d, q_send_.data());
  WorkPtr a2a_q = exchange(q_send_, q_own_counts_, st.q_head.view(), q_all_counts_, q_send_c_);
  own_.project_kv(w, x_p, ctx_p, st.own, a2a_q.get());
  const float* kv_src[] = {st.own.kv.data(), st.own.kv.data() + Lp * cfg_.kv_width()};
  pack_head_slices(kv_src, Lp, P_, hkv_ * d, kv_send_.data());
  WorkPtr a2a_kv = exchange(kv_send_, kv_own_counts_, st.kv_head.view(), kv_all_counts_, kv_send_c_);
  timings_.fwd_overlap_exposed_ms = timed_wait(*a2a_q);
  timings_.blocking_comm_ms += timed_wait(*a2a_kv);

  // 2. The whole sequence's attention for this rank's heads.
  const TensorView kv = st.kv_head.view();
  attention_forward(*mask_, head_view(st.q_head.view(), Q_, hq_, d), head_view(kv, L_, hkv_, d, 0, kv_stride),
                    head_view(kv, L_, hkv_, d, hkv_ * d, kv_stride), head_view(st.o_head.view(), Q_, hq_, d),
                    st.lse_head);

  // 3. Output rows back to their owners (rank r's rows are contiguous in o_head), projected there.
  const TensorView o_recv = compute_out(q_recv_.view(), compute_, recv_c_);
  auto tw = CpClock::now();
  comm_.all_to_all_v_async(st.o_head.view(), q_all_counts_, o_recv, q_own_counts_)->wait();
  timings_.blocking_comm_ms += elapsed_ms(tw);
  from_compute(o_recv, q_recv_.view());
  float* o_dst[] = {st.own.o.data()};
  unpack_head_slices(q_recv_.data(), own_.Qp(), P_, hq_ * d, o_dst);
  own_.output_forward(w, st.own, y_p);
}

void UlyssesLayer::backward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                                 const float* dy_p, float* dx_p, float* dctx_p, AttnLayerParams& grad) {
  Saved& st = static_cast<Saved&>(state);
  const std::int64_t d = cfg_.d_h, Lp = own_.Lp(), kv_stride = 2 * hkv_ * d;

  // 1. do of own rows, to head layout; D from the head-layout o kept by the forward.
  own_.output_backward(w, st.own, dy_p, grad, false);
  const float* do_src[] = {own_.dout().data()};
  pack_head_slices(do_src, own_.Qp(), P_, hq_ * d, q_send_.data());
  auto tw = CpClock::now();
  exchange(q_send_, q_own_counts_, do_head_.view(), q_all_counts_, q_send_c_)->wait();
  timings_.blocking_comm_ms += elapsed_ms(tw);

  // 2. Attention backward for this rank's heads over the whole sequence.
  const TensorView kv = st.kv_head.view(), dkv = dkv_head_.view();
  attention_delta(head_view(do_head_.view(), Q_, hq_, d), head_view(st.o_head.view(), Q_, hq_, d), delta_head_);
  attention_backward(*mask_, head_view(st.q_head.view(), Q_, hq_, d), head_view(kv, L_, hkv_, d, 0, kv_stride),
                     head_view(kv, L_, hkv_, d, hkv_ * d, kv_stride), head_view(do_head_.view(), Q_, hq_, d),
                     st.lse_head, delta_head_, head_view(dq_head_.view(), Q_, hq_, d),
                     head_view(dkv, L_, hkv_, d, 0, kv_stride), head_view(dkv, L_, hkv_, d, hkv_ * d, kv_stride));

  // 3. Gradients back to the rows' owners; the q-side projection backward overlaps the dk/dv one.
  const TensorView dkv_recv = compute_out(kv_recv_.view(), compute_, kv_recv_c_);
  const TensorView dq_recv = compute_out(q_recv_.view(), compute_, recv_c_);
  WorkPtr a2a_kv = comm_.all_to_all_v_async(dkv, kv_all_counts_, dkv_recv, kv_own_counts_);
  tw = CpClock::now();
  comm_.all_to_all_v_async(dq_head_.view(), q_all_counts_, dq_recv, q_own_counts_)->wait();
  timings_.blocking_comm_ms += elapsed_ms(tw);
  from_compute(dq_recv, q_recv_.view());
  float* dq_dst[] = {dq_p_.data()};
  unpack_head_slices(q_recv_.data(), own_.Qp(), P_, hq_ * d, dq_dst);
  a2a_kv->test();
  own_.backward_q(w, st.own, x_p, dq_p_.data(), dx_p, 0.f, grad);
  timings_.bwd_overlap_exposed_ms = timed_wait(*a2a_kv);
  from_compute(dkv_recv, kv_recv_.view());
  float* dkv_dst[] = {dkv_p_.data(), dkv_p_.data() + Lp * cfg_.kv_width()};
  unpack_head_slices(kv_recv_.data(), Lp, P_, hkv_ * d, dkv_dst);
  own_.backward_kv(w, st.own, x_p, ctx_p, dkv_p_.data(), dx_p, 1.f, dctx_p, grad, nullptr);
}

}  // namespace diffcp
