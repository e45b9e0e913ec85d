#include "diffcp/cp/ringx.hpp"

#include "diffcp/ops/buffer.hpp"

#include <algorithm>
#include <span>

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/merge.hpp"
#include "diffcp/cp/bytes.hpp"
#include "diffcp/cp/lse_reduce.hpp"
#include "diffcp/ops/gemm.hpp"

namespace diffcp {

RingXLayer::RingXLayer(Communicator& cp, const AttnLayerConfig& cfg, CpShard shard, DType compute)
    : CpAttentionLayer(cp, cfg, "ringx", compute) {
  reshard(std::move(shard));
}

void RingXLayer::on_reshard() {
  own_.reshard(cfg_, shard_);
  const std::vector<KeyRows> keys = gather_key_rows(comm_, shard_);
  const KeyRows& mine = keys[static_cast<std::size_t>(shard_.p)];
  fwd_masks_.clear();
  bwd_masks_.clear();
  query_rows_ = shard_.query_rows;
  key_rows_.clear();
  for (const KeyRows& k : keys) {
    fwd_masks_.push_back(cross_mask(shard_.batch, k.blocks, {&mine, 1}, shard_.window));
    bwd_masks_.push_back(cross_mask(shard_.batch, shard_.blocks, {&k, 1}, shard_.window));
    key_rows_.push_back(k.rows(shard_.batch.block));
  }
  const auto n = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  const std::int64_t Q_max = *std::max_element(query_rows_.begin(), query_rows_.end());
  const std::int64_t L_max = *std::max_element(key_rows_.begin(), key_rows_.end());
  const std::int64_t qw = cfg_.q_width(), kvw = cfg_.kv_width();
  for (auto* v : {&buf_[0], &buf_[1]}) v->resize(n(std::max(Q_max * qw, 2 * L_max * kvw)));
  o_part_.resize(n(Q_max * qw));
  lse_part_.resize(n(Q_max * cfg_.n_q));
  lse_all_.resize(lse_part_.size());
  dq_.resize(n(own_.Qp() * qw));
  dq_step_.resize(dq_.size());
  dkv_part_.resize(n(2 * L_max * kvw));
  dkv_own_.resize(n(2 * own_.Lp() * kvw));
  if (compute_ == DType::bf16) {
    for (auto* v : {&buf16_[0], &buf16_[1]}) v->resize(buf_[0].size());
    for (auto* v : {&q16_, &o16_own_, &dout16_, &dq16_}) v->resize(n(own_.Qp() * qw));
    o16_part_.resize(o_part_.size());
    for (auto* v : {&kv16_, &dkv16_own_}) v->resize(dkv_own_.size());
    dkv16_part_.resize(dkv_part_.size());
  }
}

std::vector<std::size_t> RingXLayer::rooted_counts(int root, std::int64_t n) const {
  std::vector<std::size_t> c(static_cast<std::size_t>(shard_.P), 0);
  c[static_cast<std::size_t>(root)] = static_cast<std::size_t>(n);
  return c;
}

WorkPtr RingXLayer::post_broadcast(int t, void* own, void* buf, std::int64_t n) {
  return comm_.broadcast_async(t == shard_.p ? own : buf, static_cast<std::size_t>(n), compute_, t);
}

// Per layer, in elements of compute() (lse f32), summed over ranks: the broadcasts send (P-1) Q_t n_q d_h (forward)
// and (P-1) 2 L_t n_kv d_h (backward) from each root t; the reductions to t receive the same from
// the P-1 other ranks; each [Q_t, n_q] f32 logsumexp all-reduce (a = lse_all_reduces of them)
// sends 2(P-1) Q_t n_q in all (bandwidth-optimal rule of comm/communicator.hpp). With
// sum_t Q_t = Q, sum_t L_t = S + Q, / P, e = dtype_size(compute()):
//   bytes = (P-1)/P * (e (2 Q n_q d_h + 4 (S+Q) n_kv d_h) + 4 a 2 Q n_q).
// Paper, Table 1 (MHA n_q d_h = n_kv d_h = H, even sharding): (P-1)/P * (2QH + 4(S+Q)H) elements
// plus the lower-order lse term 2(P-1)/P Q n_q.
double RingXLayer::predicted_bytes_per_layer() const {
  const std::int64_t Q = shard_.batch.query_rows();
  return ringx_bytes_per_layer(cfg_, compute_, Q, shard_.batch.context_rows() + Q, shard_.P, lse_all_reduces(comm_));
}

void RingXLayer::forward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                                float* y_p) {
  Saved& st = static_cast<Saved&>(state);  // made by new_state(): CpAttentionLayer checked the owner
  const ScopedF32GemmCompute precision(compute_);
  const bool bf = compute_ == DType::bf16;
  const auto t0 = CpClock::now();
  const int P = shard_.P, p = shard_.p;
  const std::int64_t n_q = cfg_.n_q, d = cfg_.d_h, qw = cfg_.q_width(), Qp = own_.Qp();
  own_.project_q(w, x_p, st.own);
  if (bf) convert(st.own.q.data(), q16_.data(), Qp * qw);
  void* q_own = bf ? static_cast<void*>(q16_.data()) : st.own.q.data();
  auto buf = [&](int i) -> void* { return bf ? static_cast<void*>(buf16_[i].data()) : buf_[i].data(); };
  WorkPtr bcast[2];
  bcast[0] = post_broadcast(0, q_own, buf(0), query_rows_[0] * qw);
  own_.project_kv(w, x_p, ctx_p, st.own, bcast[0].get());
  const std::int64_t Lp = own_.Lp(), kvw = cfg_.kv_width();
  if (bf) convert(st.own.kv.data(), kv16_.data(), 2 * Lp * kvw);

  for (int t = 0; t < P; ++t) {
    const std::size_t ti = static_cast<std::size_t>(t);
    if (t + 1 < P) bcast[(t + 1) % 2] = post_broadcast(t + 1, q_own, buf((t + 1) % 2), query_rows_[ti + 1] * qw);
    timings_.fwd_overlap_exposed_ms += timed_wait(*bcast[t % 2]);
    const std::int64_t Qt = query_rows_[ti];
    const std::span<float> lse_part(lse_part_.data(), static_cast<std::size_t>(Qt * n_q));
    const std::span<float> lse_t(lse_all_.data(), lse_part.size());
    const HeadRows<float> o_part = head_view(o_part_.data(), Qt, n_q, d);
    if (bf) {
      const bf16_t* q_t = t == p ? q16_.data() : buf16_[t % 2].data();
      attention_forward(fwd_masks_[ti], head_view(q_t, Qt, n_q, d), HeadRows<const bf16_t>{kv16_.data(), Lp, cfg_.n_kv, d, kvw},
                        HeadRows<const bf16_t>{kv16_.data() + Lp * kvw, Lp, cfg_.n_kv, d, kvw},
                        head_view(o16_part_.data(), Qt, n_q, d), lse_part);
      convert(o16_part_.data(), o_part_.data(), Qt * qw);
    } else {
      const float* q_t = t == p ? st.own.q.data() : buf_[t % 2].data();
      attention_forward(fwd_masks_[ti], head_view(q_t, Qt, n_q, d), own_.k_view(st.own), own_.v_view(st.own), o_part,
                        lse_part);
    }
    device_copy(lse_t.data(), lse_part.data(), Qt * n_q);
    auto tw = CpClock::now();
    all_reduce_lse(comm_, lse_t);
    timings_.blocking_comm_ms += elapsed_ms(tw);
    lse_rescale(o_part, lse_part, lse_t);
    tw = CpClock::now();
    if (bf) {
      convert(o_part_.data(), o16_part_.data(), Qt * qw);
      comm_.reduce_scatter_v_async(o16_part_.data(), t == p ? o16_own_.data() : nullptr, rooted_counts(t, Qt * qw),
                                   DType::bf16, ReduceOp::sum)->wait();
      if (t == p) convert(o16_own_.data(), st.own.o.data(), Qp * qw);
    } else {
      comm_.reduce_scatter_v_async(o_part_.data(), t == p ? st.own.o.data() : nullptr, rooted_counts(t, Qt * qw),
                                   DType::f32, ReduceOp::sum)->wait();
    }
    timings_.blocking_comm_ms += elapsed_ms(tw);
    if (t == p) device_copy(st.own.lse.data(), lse_t.data(), Qt * n_q);
  }
  own_.output_forward(w, st.own, y_p);
  timings_.fwd_ms = elapsed_ms(t0);
}

void RingXLayer::backward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                                 const float* dy_p, float* dx_p, float* dctx_p, AttnLayerParams& grad) {
  Saved& st = static_cast<Saved&>(state);
  const ScopedF32GemmCompute precision(compute_);
  const bool bf = compute_ == DType::bf16;
  const auto t0 = CpClock::now();
  const int P = shard_.P, p = shard_.p;
  const std::int64_t Qp = own_.Qp(), n_q = cfg_.n_q, n_kv = cfg_.n_kv, d = cfg_.d_h, kvw = cfg_.kv_width();
  const std::int64_t Lp = own_.Lp(), qw = cfg_.q_width();
  own_.output_backward(w, st.own, dy_p, grad);
  if (bf) {  // the saved f32 rows rounded again (a forward of another step may have run since)
    convert(st.own.q.data(), q16_.data(), Qp * qw);
    convert(st.own.kv.data(), kv16_.data(), 2 * Lp * kvw);
    convert(own_.dout().data(), dout16_.data(), Qp * qw);
  }
  void* kv_own = bf ? static_cast<void*>(kv16_.data()) : st.own.kv.data();
  auto buf = [&](int i) -> void* { return bf ? static_cast<void*>(buf16_[i].data()) : buf_[i].data(); };
  WorkPtr bcast[2];
  bcast[0] = post_broadcast(0, kv_own, buf(0), 2 * key_rows_[0] * kvw);

  for (int t = 0; t < P; ++t) {
    const std::size_t ti = static_cast<std::size_t>(t);
    if (t + 1 < P) bcast[(t + 1) % 2] = post_broadcast(t + 1, kv_own, buf((t + 1) % 2), 2 * key_rows_[ti + 1] * kvw);
    timings_.bwd_overlap_exposed_ms += timed_wait(*bcast[t % 2]);
    const std::int64_t Lt = key_rows_[ti];
    float* dq = t == 0 ? dq_.data() : dq_step_.data();
    if (bf) {
      const bf16_t* kv_t = t == p ? kv16_.data() : buf16_[t % 2].data();
      attention_backward(bwd_masks_[ti], head_view(q16_.data(), Qp, n_q, d), head_view(kv_t, Lt, n_kv, d),
                         head_view(kv_t + Lt * kvw, Lt, n_kv, d), head_view(dout16_.data(), Qp, n_q, d), st.own.lse,
                         own_.delta(), head_view(dq16_.data(), Qp, n_q, d), head_view(dkv16_part_.data(), Lt, n_kv, d),
                         head_view(dkv16_part_.data() + Lt * kvw, Lt, n_kv, d));
      convert(dq16_.data(), dq, Qp * qw);
    } else {
      const float* kv_t = t == p ? st.own.kv.data() : buf_[t % 2].data();
      attention_backward(bwd_masks_[ti], own_.q_view(st.own), head_view(kv_t, Lt, n_kv, d),
                         head_view(kv_t + Lt * kvw, Lt, n_kv, d), head_view(own_.dout().data(), Qp, n_q, d), st.own.lse,
                         own_.delta(), head_view(dq, Qp, n_q, d), head_view(dkv_part_.data(), Lt, n_kv, d),
                         head_view(dkv_part_.data() + Lt * kvw, Lt, n_kv, d));
    }
    if (t > 0) add_into(dq_.data(), dq_step_.data(), Qp * qw);
    const auto tw = CpClock::now();
    if (bf) {
      comm_.reduce_scatter_v_async(dkv16_part_.data(), t == p ? dkv16_own_.data() : nullptr,
                                   rooted_counts(t, 2 * Lt * kvw), DType::bf16, ReduceOp::sum)->wait();
      if (t == p) convert(dkv16_own_.data(), dkv_own_.data(), 2 * Lp * kvw);
    } else {
      comm_.reduce_scatter_v_async(dkv_part_.data(), t == p ? dkv_own_.data() : nullptr, rooted_counts(t, 2 * Lt * kvw),
                                   DType::f32, ReduceOp::sum)->wait();
    }
    timings_.blocking_comm_ms += elapsed_ms(tw);
  }
  own_.backward_q(w, st.own, x_p, dq_.data(), dx_p, 0.f, grad);
  own_.backward_kv(w, st.own, x_p, ctx_p, dkv_own_.data(), dx_p, 1.f, dctx_p, grad, nullptr);
  timings_.bwd_ms = elapsed_ms(t0);
}

}  // namespace diffcp
