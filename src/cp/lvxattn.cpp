#include "diffcp/cp/lvxattn.hpp"

#include "diffcp/ops/buffer.hpp"

#include <algorithm>
#include <span>
#include <vector>

#include "diffcp/attention/attention.hpp"
#include "diffcp/cp/bytes.hpp"
#include "diffcp/ops/gemm.hpp"

namespace diffcp {

LvXAttnLayer::LvXAttnLayer(Communicator& cp, const AttnLayerConfig& cfg, CpShard shard, DType compute)
    : CpAttentionLayer(cp, cfg, "lvxattn", compute) {
  reshard(std::move(shard));
}

void LvXAttnLayer::on_reshard() {
  own_.reshard(cfg_, shard_);
  const KeyRows mine = own_key_rows(shard_);
  masks_.clear();
  for (const Shard& b : block_ranges(shard_)) masks_.push_back(cross_mask(shard_.batch, b, {&mine, 1}, shard_.window));
  const auto n = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  const std::int64_t Q_max = *std::max_element(shard_.query_rows.begin(), shard_.query_rows.end());
  const std::int64_t qw = cfg_.q_width(), n_q = cfg_.n_q, kvw = cfg_.kv_width(), Qp = own_.Qp();
  for (auto* v : {&in_[0], &in_[1]}) v->resize(n(Q_max * 2 * (qw + n_q)));
  for (auto* v : {&part_, &acc_in_, &acc_out_[0], &acc_out_[1]}) v->resize(n(Q_max * (qw + n_q)));
  own_part_.resize(n(Qp * 2 * (qw + n_q)));
  dq_own_.resize(n(Qp * qw));
  dkv_.resize(n(2 * own_.Lp() * kvw));
  dkv_step_.resize(dkv_.size());
}

// Per layer, for the state of rank s (Q_s rows), each over P-1 hops: forward q (n_q d_h, dtype)
// and running [o | lse] (n_q d_h + n_q, f32); backward inputs [q | do | lse | D] (2 n_q d_h dtype
// + 2 n_q f32) and the dq accumulator (n_q d_h, f32). Summed over s (sum Q_s = Q), / P:
//   bytes = (P-1)/P * Q ((3 e + 2 * 4) n_q d_h + 3 n_q 4),  e = dtype_size(compute);
// f32: (P-1)/P * Q (5 n_q d_h + 3 n_q) elements. Paper, Table 1 (MHA n_q d_h = H): (P-1)/P * 5QH
// elements plus the lower-order 3(P-1)/P Q n_q.
double LvXAttnLayer::predicted_bytes_per_layer() const {
  return lvxattn_bytes_per_layer(cfg_, compute_, shard_.batch.query_rows(), shard_.P);
}

// n elements of dtype t at byte offset `at` of the f32 slots `buf`: the parts of a packed message of
// mixed dtypes (the backward inputs [q | do] in the compute dtype, then lse and D in f32).
TensorView LvXAttnLayer::part(const DeviceVector<float>& buf, std::int64_t at, DType t, std::int64_t n) const {
  const std::int64_t bytes = static_cast<std::int64_t>(buf.size() * sizeof(float));
  DIFFCP_CHECK(at >= 0 && at % static_cast<std::int64_t>(dtype_size(t)) == 0 &&
                   at + n * static_cast<std::int64_t>(dtype_size(t)) <= bytes,
               "lvxattn: ", n, " ", dtype_name(t), " at byte ", at, " of a ", bytes, "-byte buffer");
  return TensorView::contiguous(reinterpret_cast<char*>(buf.data()) + at, t, {n}, active_device());
}

// The packed backward inputs of `rows` rows: [q | do] in compute_, then lse and D [rows, n_q] f32.
std::int64_t LvXAttnLayer::qdo_bytes(std::int64_t rows) const {
  return 2 * rows * cfg_.q_width() * static_cast<std::int64_t>(dtype_size(compute_));
}
std::int64_t LvXAttnLayer::in_bytes(std::int64_t rows) const {
  return qdo_bytes(rows) + 2 * rows * cfg_.n_q * static_cast<std::int64_t>(sizeof(float));
}

void LvXAttnLayer::step_forward(const BlockMask& mask, ConstTensorView q, std::int64_t rows, float* o, float* lse) {
  const std::int64_t n_q = cfg_.n_q, n_kv = cfg_.n_kv, d = cfg_.d_h, Lp = own_.Lp(), kvw = cfg_.kv_width();
  const TensorView o_f32 = device_view(o, rows * cfg_.q_width()), o_c = compute_out(o_f32, compute_, o_c_);
  attention_forward(mask, head_view(q, rows, n_q, d), head_view(kv_, Lp, n_kv, d), head_view(kv_, Lp, n_kv, d, Lp * kvw),
                    head_view(o_c, rows, n_q, d), std::span<float>(lse, static_cast<std::size_t>(rows * n_q)));
  from_compute(o_c, o_f32);
}

void LvXAttnLayer::step_backward(const BlockMask& mask, const DeviceVector<float>& in, std::int64_t rows, float* dq,
                                 float* dkv) {
  const std::int64_t n_q = cfg_.n_q, n_kv = cfg_.n_kv, d = cfg_.d_h, Lp = own_.Lp(), kvw = cfg_.kv_width();
  const std::int64_t qw = cfg_.q_width(), stats = rows * n_q, e = static_cast<std::int64_t>(dtype_size(compute_));
  const ConstTensorView q = part(in, 0, compute_, rows * qw), dout = part(in, rows * qw * e, compute_, rows * qw);
  const float* lse = part(in, qdo_bytes(rows), DType::f32, 2 * stats).ptr<float>();
  const std::span<const float> lse_in(lse, static_cast<std::size_t>(stats)), delta_in(lse + stats, lse_in.size());
  const TensorView dq_f32 = device_view(dq, rows * qw), dq_c = compute_out(dq_f32, compute_, dq_c_);
  const TensorView dkv_f32 = device_view(dkv, 2 * Lp * kvw), dkv_c = compute_out(dkv_f32, compute_, dkv_c_);
  attention_backward(mask, head_view(q, rows, n_q, d), head_view(kv_, Lp, n_kv, d), head_view(kv_, Lp, n_kv, d, Lp * kvw),
                     head_view(dout, rows, n_q, d), lse_in, delta_in, head_view(dq_c, rows, n_q, d),
                     head_view(dkv_c, Lp, n_kv, d), head_view(dkv_c, Lp, n_kv, d, Lp * kvw));
  from_compute(dq_c, dq_f32);
  from_compute(dkv_c, dkv_f32);
}

void LvXAttnLayer::forward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                                float* y_p) {
  Saved& st = static_cast<Saved&>(state);  // made by new_state(): CpAttentionLayer checked the owner
  const int P = shard_.P, p = shard_.p, next = (p + 1) % P, prev = (p + P - 1) % P;
  const std::int64_t Qp = own_.Qp(), n_q = cfg_.n_q, d = cfg_.d_h, qw = cfg_.q_width();
  const auto state_count = [&](std::int64_t rows) { return rows * (qw + n_q); };
  const auto q_in = [&](int slot, std::int64_t rows) { return part(in_[slot], 0, compute_, rows * qw); };  // travelling q
  const auto o_of = [&](float* buf, std::int64_t rows) { return head_view(buf, rows, n_q, d); };
  const auto lse_of = [&](float* buf, std::int64_t rows) {
    return std::span<float>(buf + rows * qw, static_cast<std::size_t>(rows * n_q));
  };
  own_.project_q(w, x_p, st.own);
  const ConstTensorView q_own = to_compute(st.own.q.view(), compute_, q_c_);
  // Hop t runs during step t and carries, to next and from prev, the running state of step t - 1
  // (t >= 2: prev's arrives for this step's queries) and the queries of step t + 1; hop 0 the own
  // queries, the last hop step P - 1's state home. A message and its receive fall in the same hop on
  // both ranks (no group waits on a peer's later one: NCCL, comm/rendezvous_communicator.hpp), and a
  // hop lists its transfers to a peer in one order: running state, then queries (no tags).
  using Op = Communicator::P2pOp;
  const auto acc_of = [&](int t) { return device_view(acc_out_[t % 2].data(), state_count(rows_of(src_of_step(t)))); };
  WorkPtr hop;
  if (P > 1) {  // hop 0: own q to next; rank p-1's q arrives for step 1
    const Op ops[] = {Op::send(q_own, next), Op::recv(q_in(1, rows_of(prev)), prev)};
    hop = comm_.exchange_async(ops);
  }
  own_.project_kv(w, x_p, ctx_p, st.own, hop.get());
  kv_ = to_compute(st.own.kv.view(), compute_, kv_c_);
  step_forward(masks_[static_cast<std::size_t>(p)], q_own, Qp, own_part_.data(), own_part_.data() + Qp * qw);

  for (int t = 1; t < P; ++t) {
    const int s = src_of_step(t);
    const std::int64_t Qs = rows_of(s);
    const TensorView q_s = q_in(t % 2, Qs);
    if (hop) timings_.fwd_overlap_exposed_ms += timed_wait(*hop);  // hop t - 1: q_s is here
    std::vector<Op> ops;
    if (t >= 2) {
      ops.push_back(Op::send(acc_of(t - 1), next));
      ops.push_back(Op::recv(prefix(acc_in_.view(), state_count(Qs)), prev));
    }
    if (t + 1 < P) {  // q_s moves on; q of the next step comes in
      ops.push_back(Op::send(q_s, next));
      ops.push_back(Op::recv(q_in((t + 1) % 2, rows_of(src_of_step(t + 1))), prev));
    }
    hop = ops.empty() ? nullptr : comm_.exchange_async(ops);
    float* out = acc_out_[t % 2].data();
    float* part = t == 1 ? out : part_.data();  // the running state starts here at step 1
    step_forward(masks_[static_cast<std::size_t>(s)], q_s, Qs, part, part + Qs * qw);
    if (t >= 2) {
      timings_.fwd_overlap_exposed_ms += timed_wait(*hop);
      merge_two(o_of(acc_in_.data(), Qs), lse_of(acc_in_.data(), Qs), o_of(part, Qs), lse_of(part, Qs), o_of(out, Qs),
                lse_of(out, Qs));
    }
  }
  if (P > 1) {  // step P - 1's state goes on to its owner; this rank's comes home and meets its own partial
    if (hop) timings_.fwd_overlap_exposed_ms += timed_wait(*hop);
    const Op ops[] = {Op::send(acc_of(P - 1), next), Op::recv(prefix(acc_in_.view(), state_count(Qp)), prev)};
    timings_.fwd_overlap_exposed_ms += timed_wait(*comm_.exchange_async(ops));
    merge_two(o_of(own_part_.data(), Qp), lse_of(own_part_.data(), Qp), o_of(acc_in_.data(), Qp),
              lse_of(acc_in_.data(), Qp), o_of(st.own.o.data(), Qp), st.own.lse);
  } else {
    const auto n_o = static_cast<std::int64_t>(st.own.o.size());
    device_copy(st.own.o.data(), own_part_.data(), n_o);
    device_copy(st.own.lse.data(), own_part_.data() + n_o, static_cast<std::int64_t>(st.own.lse.size()));
  }
  own_.output_forward(w, st.own, y_p);
}

void LvXAttnLayer::backward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                                 const float* dy_p, float* dx_p, float* dctx_p, AttnLayerParams& grad) {
  Saved& st = static_cast<Saved&>(state);
  const int P = shard_.P, p = shard_.p, next = (p + 1) % P, prev = (p + P - 1) % P;
  const std::int64_t Qp = own_.Qp(), n_q = cfg_.n_q, qw = cfg_.q_width(), Lp = own_.Lp(), kvw = cfg_.kv_width();
  const std::int64_t e = static_cast<std::int64_t>(dtype_size(compute_)), f = sizeof(float);
  // The packed inputs [q | do | lse | D] travel as the bytes of their mixed dtypes.
  const auto message = [&](const DeviceVector<float>& buf, std::int64_t rows) {
    return part(buf, 0, DType::u8, in_bytes(rows));
  };

  own_.output_backward(w, st.own, dy_p, grad);
  kv_ = to_compute(st.own.kv.view(), compute_, kv_c_);  // (another forward may have run since)
  // Own inputs, packed: the first hop's message and step 0's operands.
  convert(st.own.q.view(), part(own_part_, 0, compute_, Qp * qw));
  convert(own_.dout().view(), part(own_part_, Qp * qw * e, compute_, Qp * qw));
  convert(st.own.lse.view(), part(own_part_, qdo_bytes(Qp), DType::f32, Qp * n_q));
  convert(own_.delta().view(), part(own_part_, qdo_bytes(Qp) + Qp * n_q * f, DType::f32, Qp * n_q));
  // The hops of the forward, with the inputs for the queries and the dq accumulator for the state.
  using Op = Communicator::P2pOp;
  const auto acc_of = [&](int t) { return device_view(acc_out_[t % 2].data(), rows_of(src_of_step(t)) * qw); };
  WorkPtr hop;
  if (P > 1) {  // hop 0: own inputs
    const Op ops[] = {Op::send(message(own_part_, Qp), next), Op::recv(message(in_[1], rows_of(prev)), prev)};
    hop = comm_.exchange_async(ops);
  }
  step_backward(masks_[static_cast<std::size_t>(p)], own_part_, Qp, dq_own_.data(), dkv_.data());

  for (int t = 1; t < P; ++t) {
    const int s = src_of_step(t);
    const std::int64_t Qs = rows_of(s);
    const DeviceVector<float>& in = in_[t % 2];
    if (hop) timings_.bwd_overlap_exposed_ms += timed_wait(*hop);  // hop t - 1: the inputs are here
    std::vector<Op> ops;
    if (t >= 2) {
      ops.push_back(Op::send(acc_of(t - 1), next));
      ops.push_back(Op::recv(prefix(acc_in_.view(), Qs * qw), prev));
    }
    if (t + 1 < P) {
      ops.push_back(Op::send(message(in, Qs), next));
      ops.push_back(Op::recv(message(in_[(t + 1) % 2], rows_of(src_of_step(t + 1))), prev));
    }
    hop = ops.empty() ? nullptr : comm_.exchange_async(ops);
    float* dq = acc_out_[t % 2].data();
    step_backward(masks_[static_cast<std::size_t>(s)], in, Qs, dq, dkv_step_.data());
    add_into(dkv_.data(), dkv_step_.data(), 2 * Lp * kvw);
    if (t >= 2) {
      timings_.bwd_overlap_exposed_ms += timed_wait(*hop);
      add_into(dq, acc_in_.data(), Qs * qw);
    }
  }
  // dk, dv are complete: their projection backward overlaps this rank's dq coming home.
  if (hop) timings_.bwd_overlap_exposed_ms += timed_wait(*hop);
  WorkPtr home;
  if (P > 1) {
    const Op ops[] = {Op::send(acc_of(P - 1), next), Op::recv(prefix(acc_in_.view(), Qp * qw), prev)};
    home = comm_.exchange_async(ops);
  }
  own_.backward_kv(w, st.own, x_p, ctx_p, dkv_.data(), dx_p, 0.f, dctx_p, grad, home.get());
  if (home) {
    timings_.bwd_overlap_exposed_ms += timed_wait(*home);
    add_into(dq_own_.data(), acc_in_.data(), Qp * qw);
  }
  own_.backward_q(w, st.own, x_p, dq_own_.data(), dx_p, 1.f, grad);
}

}  // namespace diffcp
