#include "diffcp/cp/ring.hpp"

#include "diffcp/ops/buffer.hpp"

#include <algorithm>
#include <utility>
#include <vector>

#include "diffcp/attention/attention.hpp"
#include "diffcp/cp/bytes.hpp"
#include "diffcp/ops/gemm.hpp"

namespace diffcp {

RingLayer::RingLayer(Communicator& cp, const AttnLayerConfig& cfg, CpShard shard, DType compute)
    : CpAttentionLayer(cp, cfg, "ring", compute) {
  reshard(std::move(shard));
}

void RingLayer::on_reshard() {
  own_.reshard(cfg_, shard_);
  const std::vector<KeyRows> keys = gather_key_rows(comm_, shard_);
  masks_.clear();
  key_rows_.clear();
  for (const KeyRows& k : keys) {
    masks_.push_back(cross_mask(shard_.batch, shard_.blocks, {&k, 1}, shard_.window));
    key_rows_.push_back(k.rows(shard_.batch.block));
  }
  const auto n = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  const std::int64_t L_max = *std::max_element(key_rows_.begin(), key_rows_.end());
  const std::int64_t Qp = own_.Qp(), qw = cfg_.q_width(), kvw = cfg_.kv_width();
  for (auto* v : {&kv_buf_[0], &kv_buf_[1]}) v->resize(compute_, 2 * L_max * kvw);
  for (auto* v : {&dkv_in_, &dkv_out_[0], &dkv_out_[1]}) v->resize(n(2 * L_max * kvw));
  dkv_own_.resize(n(2 * own_.Lp() * kvw));
  for (auto* v : {&o_step_, &o_tmp_, &dq_, &dq_step_}) v->resize(n(Qp * qw));
  for (auto* v : {&lse_step_, &lse_tmp_}) v->resize(n(Qp * cfg_.n_q));
}

void RingLayer::step_forward(ConstTensorView q, ConstTensorView kv, int s, float* o, DeviceVector<float>& lse) {
  const std::int64_t Qp = own_.Qp(), n_q = cfg_.n_q, d = cfg_.d_h, kvw = cfg_.kv_width();
  const std::int64_t L = key_rows_[static_cast<std::size_t>(s)];
  const TensorView o_f32 = device_view(o, Qp * n_q * d), o_c = compute_out(o_f32, compute_, o_c_);
  attention_forward(masks_[static_cast<std::size_t>(s)], head_view(q, Qp, n_q, d), head_view(kv, L, cfg_.n_kv, d),
                    head_view(kv, L, cfg_.n_kv, d, L * kvw), head_view(o_c, Qp, n_q, d), lse);
  from_compute(o_c, o_f32);
}

void RingLayer::step_backward(const OwnActivations& own, ConstTensorView q, ConstTensorView kv, ConstTensorView dout,
                              int s, float* dq, float* dkv) {
  const std::int64_t Qp = own_.Qp(), n_q = cfg_.n_q, d = cfg_.d_h, kvw = cfg_.kv_width();
  const std::int64_t L = key_rows_[static_cast<std::size_t>(s)];
  const TensorView dq_f32 = device_view(dq, Qp * n_q * d), dq_c = compute_out(dq_f32, compute_, dq_c_);
  const TensorView dkv_f32 = device_view(dkv, 2 * L * kvw), dkv_c = compute_out(dkv_f32, compute_, dkv_c_);
  attention_backward(masks_[static_cast<std::size_t>(s)], head_view(q, Qp, n_q, d), head_view(kv, L, cfg_.n_kv, d),
                     head_view(kv, L, cfg_.n_kv, d, L * kvw), head_view(dout, Qp, n_q, d), own.lse, own_.delta(),
                     head_view(dq_c, Qp, n_q, d), head_view(dkv_c, L, cfg_.n_kv, d),
                     head_view(dkv_c, L, cfg_.n_kv, d, L * kvw));
  from_compute(dq_c, dq_f32);
  from_compute(dkv_c, dkv_f32);
}

// Per layer: every K/V shard [2, L_r, n_kv d_h] makes P-1 hops in the forward and P-1 in the
// backward (elements of compute()), and every dk/dv accumulator (same size, f32) P-1 hops. Summed
// over ranks (sum_r L_r = S + Q) and divided by P:
//   bytes = (2 e + 4) (P-1)/P * 2 (S+Q) n_kv d_h,  e = dtype_size(compute()).
// Paper, Table 1 (MHA n_kv d_h = H, even sharding): (P-1)/P * 6H(S + Q) elements.
double RingLayer::predicted_bytes_per_layer() const {
  return ring_bytes_per_layer(cfg_, compute_, shard_.batch.context_rows() + shard_.batch.query_rows(), shard_.P);
}

void RingLayer::forward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                             float* y_p) {
  Saved& st = static_cast<Saved&>(state);  // made by new_state(): CpAttentionLayer checked the owner
  const int P = shard_.P, next = (shard_.p + 1) % P, prev = (shard_.p + P - 1) % P;
  const std::int64_t Qp = own_.Qp(), n_q = cfg_.n_q, d = cfg_.d_h;
  own_.project_q(w, x_p, st.own);
  own_.project_kv(w, x_p, ctx_p, st.own, nullptr);
  const ConstTensorView q = to_compute(st.own.q.view(), compute_, q_c_);
  ConstTensorView cur = to_compute(st.own.kv.view(), compute_, kv_own_c_);  // the shard this step computes on
  for (int t = 0; t < P; ++t) {
    const int s = src_of_step(t);
    WorkPtr hop;
    if (t + 1 < P) {  // the next shard flies while this one is computed
      const Communicator::P2pOp ops[] = {
          Communicator::P2pOp::send(prefix(cur, kv_count(s)), next),
          Communicator::P2pOp::recv(prefix(kv_buf_[t % 2].view(), kv_count(src_of_step(t + 1))), prev)};
      hop = comm_.exchange_async(ops);
    }
    if (t == 0) {
      step_forward(q, cur, s, st.own.o.data(), st.own.lse);
    } else {
      step_forward(q, cur, s, o_step_.data(), lse_step_);
      merge_two(head_view(st.own.o.data(), Qp, n_q, d), st.own.lse, head_view(o_step_.data(), Qp, n_q, d), lse_step_,
                head_view(o_tmp_.data(), Qp, n_q, d), lse_tmp_);
      std::swap(st.own.o, o_tmp_);
      std::swap(st.own.lse, lse_tmp_);
    }
    if (hop) {
      timings_.fwd_overlap_exposed_ms += timed_wait(*hop);
      cur = kv_buf_[t % 2].view();
    }
  }
  own_.output_forward(w, st.own, y_p);
}

void RingLayer::backward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                              const float* dy_p, float* dx_p, float* dctx_p, AttnLayerParams& grad) {
  Saved& st = static_cast<Saved&>(state);
  const int P = shard_.P, p = shard_.p, next = (p + 1) % P, prev = (p + P - 1) % P;
  const std::int64_t Qp = own_.Qp(), kvw = cfg_.kv_width();
  own_.output_backward(w, st.own, dy_p, grad);
  // The saved f32 rows in the compute dtype again (a forward of another step may have run since).
  const ConstTensorView q = to_compute(st.own.q.view(), compute_, q_c_);
  const ConstTensorView dout = to_compute(own_.dout().view(), compute_, dout_c_);
  ConstTensorView cur = to_compute(st.own.kv.view(), compute_, kv_own_c_);
  // Hop t (t >= 1) runs during step t and carries, to next and from prev, the accumulator of step
  // t - 1 (t >= 2: prev's arrives for this step's shard) and the K/V shard of step t + 1; the last
  // hop takes step P - 1's accumulator home. A message and its receive fall in the same hop on both
  // ranks, so no group waits on a peer's later one (NCCL, comm/rendezvous_communicator.hpp), and
  // each hop lists its transfers to a peer in one order: accumulator, then K/V (no tags).
  const auto acc_of = [&](int t) { return device_view(dkv_out_[t % 2].data(), kv_count(src_of_step(t))); };
  for (int t = 0; t < P; ++t) {
    const int s = src_of_step(t);
    const std::int64_t Ls = key_rows_[static_cast<std::size_t>(s)];
    std::vector<Communicator::P2pOp> ops;
    if (t >= 2) {
      ops.push_back(Communicator::P2pOp::send(acc_of(t - 1), next));
      ops.push_back(Communicator::P2pOp::recv(prefix(dkv_in_.view(), kv_count(s)), prev));
    }
    if (t + 1 < P) {
      ops.push_back(Communicator::P2pOp::send(prefix(cur, kv_count(s)), next));
      ops.push_back(Communicator::P2pOp::recv(prefix(kv_buf_[t % 2].view(), kv_count(src_of_step(t + 1))), prev));
    }
    WorkPtr hop = ops.empty() ? nullptr : comm_.exchange_async(ops);
    float* dkv = t == 0 ? dkv_own_.data() : dkv_out_[t % 2].data();
    float* dq = t == 0 ? dq_.data() : dq_step_.data();
    step_backward(st.own, q, cur, dout, s, dq, dkv);
    if (hop) timings_.bwd_overlap_exposed_ms += timed_wait(*hop);
    if (t >= 1) add_into(dq_.data(), dq_step_.data(), Qp * cfg_.q_width());
    if (t >= 2) add_into(dkv, dkv_in_.data(), 2 * Ls * kvw);
    if (t + 1 < P) cur = kv_buf_[t % 2].view();
  }
  // Step P - 1's accumulator goes on to its owner and this rank's comes home from prev; the q-side
  // backward overlaps them.
  WorkPtr home;
  if (P > 1) {
    const Communicator::P2pOp ops[] = {Communicator::P2pOp::send(acc_of(P - 1), next),
                                       Communicator::P2pOp::recv(prefix(dkv_in_.view(), kv_count(p)), prev)};
    home = comm_.exchange_async(ops);
  }
  own_.backward_q(w, st.own, x_p, dq_.data(), dx_p, 0.f, grad);
  if (home) {
    timings_.bwd_overlap_exposed_ms += timed_wait(*home);
    add_into(dkv_own_.data(), dkv_in_.data(), 2 * own_.Lp() * kvw);
  }
  own_.backward_kv(w, st.own, x_p, ctx_p, dkv_own_.data(), dx_p, 1.f, dctx_p, grad, nullptr);
}

}  // namespace diffcp
