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
  for (auto* v : {&buf_[0], &buf_[1]}) v->resize(compute_, std::max(Q_max * qw, 2 * L_max * kvw));
  o_part_.resize(n(Q_max * qw));
  lse_part_.resize(n(Q_max * cfg_.n_q));
  lse_all_.resize(lse_part_.size());
  dq_.resize(n(own_.Qp() * qw));
  dq_step_.resize(dq_.size());
  dkv_part_.resize(compute_, 2 * L_max * kvw);
  dkv_own_.resize(n(2 * own_.Lp() * kvw));
}

std::vector<std::size_t> RingXLayer::rooted_counts(int root, std::int64_t n) const {
  std::vector<std::size_t> c(static_cast<std::size_t>(shard_.P), 0);
  c[static_cast<std::size_t>(root)] = static_cast<std::size_t>(n);
  return c;
}

WorkPtr RingXLayer::post_broadcast(int t, ConstTensorView own, int slot, std::int64_t n) {
  return comm_.broadcast_async(own, prefix(buf_[slot].view(), n), t);
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
  const int P = shard_.P, p = shard_.p;
  const std::int64_t n_q = cfg_.n_q, n_kv = cfg_.n_kv, d = cfg_.d_h, qw = cfg_.q_width();
  own_.project_q(w, x_p, st.own);
  const ConstTensorView q_own = to_compute(st.own.q.view(), compute_, q_c_);
  WorkPtr bcast[2];
  bcast[0] = post_broadcast(0, q_own, 0, query_rows_[0] * qw);
  own_.project_kv(w, x_p, ctx_p, st.own, bcast[0].get());
  const std::int64_t Lp = own_.Lp(), kvw = cfg_.kv_width();
  const ConstTensorView kv = to_compute(st.own.kv.view(), compute_, kv_c_);

  for (int t = 0; t < P; ++t) {
    const std::size_t ti = static_cast<std::size_t>(t);
    if (t + 1 < P) bcast[(t + 1) % 2] = post_broadcast(t + 1, q_own, (t + 1) % 2, query_rows_[ti + 1] * qw);
    timings_.fwd_overlap_exposed_ms += timed_wait(*bcast[t % 2]);
    const std::int64_t Qt = query_rows_[ti];
    const std::span<float> lse_part(lse_part_.data(), static_cast<std::size_t>(Qt * n_q));
    const std::span<float> lse_t(lse_all_.data(), lse_part.size());
    const ConstTensorView q_t = t == p ? q_own : ConstTensorView(buf_[t % 2].view());
    const TensorView o_f32 = device_view(o_part_.data(), Qt * qw), o_c = compute_out(o_f32, compute_, o_c_);
    attention_forward(fwd_masks_[ti], head_view(q_t, Qt, n_q, d), head_view(kv, Lp, n_kv, d),
                      head_view(kv, Lp, n_kv, d, Lp * kvw), head_view(o_c, Qt, n_q, d), lse_part);
    from_compute(o_c, o_f32);
    device_copy(lse_t.data(), lse_part.data(), Qt * n_q);
    auto tw = CpClock::now();
    all_reduce_lse(comm_, lse_t);
    timings_.blocking_comm_ms += elapsed_ms(tw);
    lse_rescale(head_view(o_part_.data(), Qt, n_q, d), lse_part, lse_t);
    // The rescaled partials are summed on rank t (in the compute dtype).
    const ConstTensorView o_send = to_compute(o_f32, compute_, o_c_);
    const TensorView o_own = t == p ? compute_out(st.own.o.view(), compute_, o_own_c_) : empty_like(o_c);
    tw = CpClock::now();
    comm_.reduce_scatter_v_async(o_send, o_own, rooted_counts(t, Qt * qw), ReduceOp::sum)->wait();
    timings_.blocking_comm_ms += elapsed_ms(tw);
    if (t == p) {
      from_compute(o_own, st.own.o.view());
      device_copy(st.own.lse.data(), lse_t.data(), Qt * n_q);
    }
  }
  own_.output_forward(w, st.own, y_p);
}

void RingXLayer::backward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                               const float* dy_p, float* dx_p, float* dctx_p, AttnLayerParams& grad) {
  Saved& st = static_cast<Saved&>(state);
  const int P = shard_.P, p = shard_.p;
  const std::int64_t Qp = own_.Qp(), n_q = cfg_.n_q, n_kv = cfg_.n_kv, d = cfg_.d_h, kvw = cfg_.kv_width();
  const std::int64_t qw = cfg_.q_width();
  own_.output_backward(w, st.own, dy_p, grad);
  // The saved f32 rows in the compute dtype again (a forward of another step may have run since).
  const ConstTensorView q = to_compute(st.own.q.view(), compute_, q_c_);
  const ConstTensorView kv_own = to_compute(st.own.kv.view(), compute_, kv_c_);
  const ConstTensorView dout = to_compute(own_.dout().view(), compute_, dout_c_);
  WorkPtr bcast[2];
  bcast[0] = post_broadcast(0, kv_own, 0, 2 * key_rows_[0] * kvw);

  for (int t = 0; t < P; ++t) {
    const std::size_t ti = static_cast<std::size_t>(t);
    if (t + 1 < P) bcast[(t + 1) % 2] = post_broadcast(t + 1, kv_own, (t + 1) % 2, 2 * key_rows_[ti + 1] * kvw);
    timings_.bwd_overlap_exposed_ms += timed_wait(*bcast[t % 2]);
    const std::int64_t Lt = key_rows_[ti];
    const ConstTensorView kv_t = t == p ? kv_own : ConstTensorView(buf_[t % 2].view());
    const TensorView dq_f32 = device_view(t == 0 ? dq_.data() : dq_step_.data(), Qp * qw);
    const TensorView dq_c = compute_out(dq_f32, compute_, dq_c_), dkv_c = dkv_part_.view();
    attention_backward(bwd_masks_[ti], head_view(q, Qp, n_q, d), head_view(kv_t, Lt, n_kv, d),
                       head_view(kv_t, Lt, n_kv, d, Lt * kvw), head_view(dout, Qp, n_q, d), st.own.lse, own_.delta(),
                       head_view(dq_c, Qp, n_q, d), head_view(dkv_c, Lt, n_kv, d), head_view(dkv_c, Lt, n_kv, d, Lt * kvw));
    from_compute(dq_c, dq_f32);
    if (t > 0) add_into(dq_.data(), dq_step_.data(), Qp * qw);
    // The dk|dv partials of rank t's rows are summed on rank t (in the compute dtype).
    const TensorView dkv_own = t == p ? compute_out(dkv_own_.view(), compute_, dkv_own_c_) : empty_like(dkv_c);
    const auto tw = CpClock::now();
    comm_.reduce_scatter_v_async(prefix(dkv_c, 2 * Lt * kvw), dkv_own, rooted_counts(t, 2 * Lt * kvw), ReduceOp::sum)
        ->wait();
    timings_.blocking_comm_ms += elapsed_ms(tw);
    if (t == p) from_compute(dkv_own, dkv_own_.view());
  }
  own_.backward_q(w, st.own, x_p, dq_.data(), dx_p, 0.f, grad);
  own_.backward_kv(w, st.own, x_p, ctx_p, dkv_own_.data(), dx_p, 1.f, dctx_p, grad, nullptr);
}

}  // namespace diffcp
