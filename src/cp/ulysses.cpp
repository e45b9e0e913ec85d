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
  do_head_.resize(n(Q_ * hq_ * d));
  dq_head_.resize(do_head_.size());
  delta_head_.resize(n(Q_ * hq_));
  dkv_head_.resize(n(L_ * 2 * hkv_ * d));
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

namespace {
// [rows, heads, d] with row stride ld (the k or v half of a [rows, 2, heads, d] tensor).
template <typename T>
HeadRows<T> strided(T* p, std::int64_t rows, std::int64_t heads, std::int64_t d, std::int64_t ld) {
  return {p, rows, heads, d, ld};
}
std::size_t total(const std::vector<std::size_t>& c) {
  std::size_t n = 0;
  for (std::size_t v : c) n += v;
  return n;
}
}  // namespace

WorkPtr UlyssesLayer::exchange(const float* send, const std::vector<std::size_t>& send_counts, float* recv,
                               bf16_t* recv16, const std::vector<std::size_t>& recv_counts,
                               DeviceVector<bf16_t>& scratch) {
  if (compute_ == DType::f32) return comm_.all_to_all_v_async(send, send_counts, recv, recv_counts, DType::f32);
  const std::size_t n = total(send_counts);
  scratch.resize(n);
  convert(send, scratch.data(), static_cast<std::int64_t>(n));
  return comm_.all_to_all_v_async(scratch.data(), send_counts, recv16, recv_counts, DType::bf16);
}

void UlyssesLayer::forward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                                float* y_p) {
  Saved& st = static_cast<Saved&>(state);  // made by new_state(): CpAttentionLayer checked the owner
  const ScopedF32GemmCompute precision(compute_);
  const bool bf = compute_ == DType::bf16;
  const auto t0 = CpClock::now();
  const std::int64_t d = cfg_.d_h, Lp = own_.Lp();
  const auto n = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  // The saved head-layout tensors (no-ops while shapes repeat), in the compute dtype.
  st.q_head.resize(bf ? 0 : n(Q_ * hq_ * d));
  st.o_head.resize(bf ? 0 : n(Q_ * hq_ * d));
  st.kv_head.resize(bf ? 0 : n(L_ * 2 * hkv_ * d));
  st.q_head16.resize(bf ? n(Q_ * hq_ * d) : 0);
  st.o_head16.resize(bf ? n(Q_ * hq_ * d) : 0);
  st.kv_head16.resize(bf ? n(L_ * 2 * hkv_ * d) : 0);
  st.lse_head.resize(n(Q_ * hq_));

  // 1. Own queries to head layout (launched), own keys/values while it flies, then theirs.
  own_.project_q(w, x_p, st.own);
  const float* q_src[] = {st.own.q.data()};
  pack_head_slices(q_src, own_.Qp(), P_, hq_ * d, q_send_.data());
  WorkPtr a2a_q = exchange(q_send_.data(), q_own_counts_, st.q_head.data(), st.q_head16.data(), q_all_counts_, q_s16_);
  own_.project_kv(w, x_p, ctx_p, st.own, a2a_q.get());
  const float* kv_src[] = {st.own.kv.data(), st.own.kv.data() + Lp * cfg_.kv_width()};
  pack_head_slices(kv_src, Lp, P_, hkv_ * d, kv_send_.data());
  WorkPtr a2a_kv =
      exchange(kv_send_.data(), kv_own_counts_, st.kv_head.data(), st.kv_head16.data(), kv_all_counts_, kv_s16_);
  timings_.fwd_overlap_exposed_ms = timed_wait(*a2a_q);
  timings_.blocking_comm_ms += timed_wait(*a2a_kv);

  // 2. The whole sequence's attention for this rank's heads.
  const std::int64_t kv_stride = 2 * hkv_ * d;
  if (bf) {
    attention_forward(*mask_, head_view(st.q_head16.data(), Q_, hq_, d),
                      strided(st.kv_head16.data(), L_, hkv_, d, kv_stride),
                      strided(st.kv_head16.data() + hkv_ * d, L_, hkv_, d, kv_stride),
                      head_view(st.o_head16.data(), Q_, hq_, d), st.lse_head);
  } else {
    attention_forward(*mask_, head_view(st.q_head.data(), Q_, hq_, d),
                      HeadRows<const float>{st.kv_head.data(), L_, hkv_, d, kv_stride},
                      HeadRows<const float>{st.kv_head.data() + hkv_ * d, L_, hkv_, d, kv_stride},
                      head_view(st.o_head.data(), Q_, hq_, d), st.lse_head);
  }

  // 3. Output rows back to their owners (rank r's rows are contiguous in o_head), projected there.
  auto tw = CpClock::now();
  if (bf) {
    q_r16_.resize(q_recv_.size());
    comm_.all_to_all_v_async(st.o_head16.data(), q_all_counts_, q_r16_.data(), q_own_counts_, DType::bf16)->wait();
    convert(q_r16_.data(), q_recv_.data(), static_cast<std::int64_t>(q_recv_.size()));
  } else {
    comm_.all_to_all_v_async(st.o_head.data(), q_all_counts_, q_recv_.data(), q_own_counts_, DType::f32)->wait();
  }
  timings_.blocking_comm_ms += elapsed_ms(tw);
  float* o_dst[] = {st.own.o.data()};
  unpack_head_slices(q_recv_.data(), own_.Qp(), P_, hq_ * d, o_dst);
  own_.output_forward(w, st.own, y_p);
  timings_.fwd_ms = elapsed_ms(t0);
}

void UlyssesLayer::backward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                                 const float* dy_p, float* dx_p, float* dctx_p, AttnLayerParams& grad) {
  Saved& st = static_cast<Saved&>(state);
  const ScopedF32GemmCompute precision(compute_);
  const bool bf = compute_ == DType::bf16;
  const auto t0 = CpClock::now();
  const std::int64_t d = cfg_.d_h, Lp = own_.Lp();
  const std::int64_t kv_stride = 2 * hkv_ * d;

  // 1. do of own rows, to head layout; D from the head-layout o kept by the forward.
  own_.output_backward(w, st.own, dy_p, grad, false);
  const float* do_src[] = {own_.dout().data()};
  pack_head_slices(do_src, own_.Qp(), P_, hq_ * d, q_send_.data());
  auto tw = CpClock::now();
  do_head16_.resize(bf ? do_head_.size() : 0);
  exchange(q_send_.data(), q_own_counts_, do_head_.data(), do_head16_.data(), q_all_counts_, q_s16_)->wait();
  timings_.blocking_comm_ms += elapsed_ms(tw);

  // 2. Attention backward for this rank's heads over the whole sequence.
  if (bf) {
    dq_head16_.resize(dq_head_.size());
    dkv_head16_.resize(dkv_head_.size());
    attention_delta(head_view(do_head16_.data(), Q_, hq_, d), head_view(st.o_head16.data(), Q_, hq_, d),
                    delta_head_);
    attention_backward(*mask_, head_view(st.q_head16.data(), Q_, hq_, d),
                       strided(st.kv_head16.data(), L_, hkv_, d, kv_stride),
                       strided(st.kv_head16.data() + hkv_ * d, L_, hkv_, d, kv_stride),
                       head_view(do_head16_.data(), Q_, hq_, d), st.lse_head, delta_head_,
                       head_view(dq_head16_.data(), Q_, hq_, d), strided(dkv_head16_.data(), L_, hkv_, d, kv_stride),
                       strided(dkv_head16_.data() + hkv_ * d, L_, hkv_, d, kv_stride));
  } else {
    attention_delta(head_view(do_head_.data(), Q_, hq_, d), head_view(st.o_head.data(), Q_, hq_, d), delta_head_);
    attention_backward(*mask_, head_view(st.q_head.data(), Q_, hq_, d),
                       HeadRows<const float>{st.kv_head.data(), L_, hkv_, d, kv_stride},
                       HeadRows<const float>{st.kv_head.data() + hkv_ * d, L_, hkv_, d, kv_stride},
                       head_view(do_head_.data(), Q_, hq_, d), st.lse_head, delta_head_,
                       head_view(dq_head_.data(), Q_, hq_, d), HeadRows<float>{dkv_head_.data(), L_, hkv_, d, kv_stride},
                       HeadRows<float>{dkv_head_.data() + hkv_ * d, L_, hkv_, d, kv_stride});
  }

  // 3. Gradients back to the rows' owners; the q-side projection backward overlaps the dk/dv one.
  const DType t = bf ? DType::bf16 : DType::f32;
  kv_r16_.resize(bf ? kv_recv_.size() : 0);
  q_r16_.resize(bf ? q_recv_.size() : 0);
  const void* dkv_send = bf ? static_cast<const void*>(dkv_head16_.data()) : dkv_head_.data();
  const void* dq_send = bf ? static_cast<const void*>(dq_head16_.data()) : dq_head_.data();
  WorkPtr a2a_kv = comm_.all_to_all_v_async(dkv_send, kv_all_counts_,
                                            bf ? static_cast<void*>(kv_r16_.data()) : kv_recv_.data(), kv_own_counts_, t);
  tw = CpClock::now();
  comm_.all_to_all_v_async(dq_send, q_all_counts_, bf ? static_cast<void*>(q_r16_.data()) : q_recv_.data(),
                           q_own_counts_, t)
      ->wait();
  timings_.blocking_comm_ms += elapsed_ms(tw);
  if (bf) convert(q_r16_.data(), q_recv_.data(), static_cast<std::int64_t>(q_recv_.size()));
  float* dq_dst[] = {dq_p_.data()};
  unpack_head_slices(q_recv_.data(), own_.Qp(), P_, hq_ * d, dq_dst);
  a2a_kv->test();
  own_.backward_q(w, st.own, x_p, dq_p_.data(), dx_p, 0.f, grad);
  timings_.bwd_overlap_exposed_ms = timed_wait(*a2a_kv);
  if (bf) convert(kv_r16_.data(), kv_recv_.data(), static_cast<std::int64_t>(kv_recv_.size()));
  float* dkv_dst[] = {dkv_p_.data(), dkv_p_.data() + Lp * cfg_.kv_width()};
  unpack_head_slices(kv_recv_.data(), Lp, P_, hkv_ * d, dkv_dst);
  own_.backward_kv(w, st.own, x_p, ctx_p, dkv_p_.data(), dx_p, 1.f, dctx_p, grad, nullptr);
  timings_.bwd_ms = elapsed_ms(t0);
}

}  // namespace diffcp
