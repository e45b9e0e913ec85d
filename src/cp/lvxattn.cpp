#include "diffcp/cp/lvxattn.hpp"

#include "diffcp/ops/buffer.hpp"

#include <algorithm>
#include <span>

#include "diffcp/attention/attention.hpp"
#include "diffcp/cp/bytes.hpp"
#include "diffcp/ops/gemm.hpp"

namespace diffcp {

namespace {
constexpr int kTagQuery = 0;    // q (forward) or the backward inputs [q | do | lse | D]
constexpr int kTagRunning = 1;  // running [o | lse] (forward) or the dq accumulator (backward)
}  // namespace

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
  if (bf16()) {
    for (auto* v : {&kv16_, &dkv16_}) v->resize(dkv_.size());
    for (auto* v : {&o16_, &dq16_}) v->resize(n(Q_max * qw));
    q16_.resize(n(Qp * qw));
  }
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

// The packed backward inputs of `rows` rows: [q | do] in compute_ (qdo_floats f32 slots), then
// lse and D [rows, n_q] each in f32.
std::int64_t LvXAttnLayer::qdo_floats(std::int64_t rows) const { return (bf16() ? 1 : 2) * rows * cfg_.q_width(); }

void LvXAttnLayer::step_forward(const BlockMask& mask, const void* q, std::int64_t rows, float* o, float* lse) {
  const std::int64_t n_q = cfg_.n_q, n_kv = cfg_.n_kv, d = cfg_.d_h, Lp = own_.Lp(), kvw = cfg_.kv_width();
  const std::span<float> lse_out(lse, static_cast<std::size_t>(rows * n_q));
  if (!bf16()) {
    attention_forward(mask, head_view(static_cast<const float*>(q), rows, n_q, d), head_view(kv_, Lp, n_kv, d),
                      head_view(kv_ + Lp * kvw, Lp, n_kv, d), head_view(o, rows, n_q, d), lse_out);
    return;
  }
  const bf16_t* kv = kv16_.data();
  attention_forward(mask, head_view(static_cast<const bf16_t*>(q), rows, n_q, d), head_view(kv, Lp, n_kv, d),
                    head_view(kv + Lp * kvw, Lp, n_kv, d), head_view(o16_.data(), rows, n_q, d), lse_out);
  convert(o16_.data(), o, rows * cfg_.q_width());
}

void LvXAttnLayer::step_backward(const BlockMask& mask, const float* in, std::int64_t rows, float* dq, float* dkv) {
  const std::int64_t n_q = cfg_.n_q, n_kv = cfg_.n_kv, d = cfg_.d_h, Lp = own_.Lp(), kvw = cfg_.kv_width();
  const std::int64_t qw = cfg_.q_width(), stats = rows * n_q;
  const float* lse = in + qdo_floats(rows);
  const std::span<const float> lse_in(lse, static_cast<std::size_t>(stats)), delta_in(lse + stats, lse_in.size());
  if (!bf16()) {
    attention_backward(mask, head_view(in, rows, n_q, d), head_view(kv_, Lp, n_kv, d), head_view(kv_ + Lp * kvw, Lp, n_kv, d),
                       head_view(in + rows * qw, rows, n_q, d), lse_in, delta_in, head_view(dq, rows, n_q, d),
                       head_view(dkv, Lp, n_kv, d), head_view(dkv + Lp * kvw, Lp, n_kv, d));
    return;
  }
  const auto* q = reinterpret_cast<const bf16_t*>(in);
  const bf16_t* kv = kv16_.data();
  bf16_t* dkv16 = dkv16_.data();
  attention_backward(mask, head_view(q, rows, n_q, d), head_view(kv, Lp, n_kv, d), head_view(kv + Lp * kvw, Lp, n_kv, d),
                     head_view(q + rows * qw, rows, n_q, d), lse_in, delta_in, head_view(dq16_.data(), rows, n_q, d),
                     head_view(dkv16, Lp, n_kv, d), head_view(dkv16 + Lp * kvw, Lp, n_kv, d));
  convert(dq16_.data(), dq, rows * qw);
  convert(dkv16, dkv, 2 * Lp * kvw);
}

void LvXAttnLayer::forward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                                float* y_p) {
  Saved& st = static_cast<Saved&>(state);  // made by new_state(): CpAttentionLayer checked the owner
  const ScopedF32GemmCompute precision(compute_);
  const auto t0 = CpClock::now();
  const int P = shard_.P, p = shard_.p, next = (p + 1) % P, prev = (p + P - 1) % P;
  const std::int64_t Qp = own_.Qp(), n_q = cfg_.n_q, d = cfg_.d_h, qw = cfg_.q_width();
  const DType t_q = compute_;  // the travelling q
  const auto state_count = [&](std::int64_t rows) { return static_cast<std::size_t>(rows * (qw + n_q)); };
  const auto q_count = [&](std::int64_t rows) { return static_cast<std::size_t>(rows * qw); };
  const auto o_of = [&](float* buf, std::int64_t rows) { return head_view(buf, rows, n_q, d); };
  const auto lse_of = [&](float* buf, std::int64_t rows) {
    return std::span<float>(buf + rows * qw, static_cast<std::size_t>(rows * n_q));
  };
  own_.project_q(w, x_p, st.own);
  if (bf16()) convert(st.own.q.data(), q16_.data(), Qp * qw);
  const void* q_own = bf16() ? static_cast<const void*>(q16_.data()) : st.own.q.data();
  WorkPtr q_send[2], q_recv[2], acc_send[2];
  if (P > 1) {  // first hop: own q to next; rank p-1's q arrives for step 1
    q_send[0] = comm_.send_async(q_own, q_count(Qp), t_q, next, kTagQuery);
    q_recv[1] = comm_.recv_async(in_[1].data(), q_count(rows_of(prev)), t_q, prev, kTagQuery);
  }
  own_.project_kv(w, x_p, ctx_p, st.own, q_recv[1].get());
  kv_ = st.own.kv.data();
  if (bf16()) convert(kv_, kv16_.data(), static_cast<std::int64_t>(kv16_.size()));
  step_forward(masks_[static_cast<std::size_t>(p)], q_own, Qp, own_part_.data(), own_part_.data() + Qp * qw);

  for (int t = 1; t < P; ++t) {
    const int s = src_of_step(t);
    const std::int64_t Qs = rows_of(s);
    const float* q_s = in_[t % 2].data();
    timings_.fwd_overlap_exposed_ms += timed_wait(*q_recv[t % 2]);
    if (t + 1 < P) {  // q_s moves on at once; q of the next step's state comes in
      q_send[t % 2] = comm_.send_async(q_s, q_count(Qs), t_q, next, kTagQuery);
      if (q_send[(t + 1) % 2]) timings_.fwd_overlap_exposed_ms += timed_wait(*q_send[(t + 1) % 2]);
      q_recv[(t + 1) % 2] = comm_.recv_async(in_[(t + 1) % 2].data(), q_count(rows_of(src_of_step(t + 1))), t_q, prev,
                                             kTagQuery);
    }
    WorkPtr acc_recv = t >= 2 ? comm_.recv_async(acc_in_.data(), state_count(Qs), DType::f32, prev, kTagRunning) : nullptr;
    if (acc_send[t % 2]) timings_.fwd_overlap_exposed_ms += timed_wait(*acc_send[t % 2]);
    float* out = acc_out_[t % 2].data();
    float* part = t == 1 ? out : part_.data();  // the running state starts here at step 1
    step_forward(masks_[static_cast<std::size_t>(s)], q_s, Qs, part, part + Qs * qw);
    if (acc_recv) {
      timings_.fwd_overlap_exposed_ms += timed_wait(*acc_recv);
      merge_two(o_of(acc_in_.data(), Qs), lse_of(acc_in_.data(), Qs), o_of(part, Qs), lse_of(part, Qs), o_of(out, Qs),
                lse_of(out, Qs));
    }
    acc_send[t % 2] = comm_.send_async(out, state_count(Qs), DType::f32, next, kTagRunning);  // last hop: home
  }
  if (P > 1) {  // this rank's running state comes home and meets its own partial
    WorkPtr home = comm_.recv_async(acc_in_.data(), state_count(Qp), DType::f32, prev, kTagRunning);
    timings_.fwd_overlap_exposed_ms += timed_wait(*home);
    merge_two(o_of(own_part_.data(), Qp), lse_of(own_part_.data(), Qp), o_of(acc_in_.data(), Qp),
              lse_of(acc_in_.data(), Qp), o_of(st.own.o.data(), Qp), st.own.lse);
  } else {
    const auto n_o = static_cast<std::int64_t>(st.own.o.size());
    device_copy(st.own.o.data(), own_part_.data(), n_o);
    device_copy(st.own.lse.data(), own_part_.data() + n_o, static_cast<std::int64_t>(st.own.lse.size()));
  }
  for (WorkPtr* wk : {&q_send[0], &q_send[1], &acc_send[0], &acc_send[1]})
    if (*wk) timings_.fwd_overlap_exposed_ms += timed_wait(**wk);
  own_.output_forward(w, st.own, y_p);
  timings_.fwd_ms = elapsed_ms(t0);
}

void LvXAttnLayer::backward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                                 const float* dy_p, float* dx_p, float* dctx_p, AttnLayerParams& grad) {
  Saved& st = static_cast<Saved&>(state);
  const ScopedF32GemmCompute precision(compute_);
  const auto t0 = CpClock::now();
  const int P = shard_.P, p = shard_.p, next = (p + 1) % P, prev = (p + P - 1) % P;
  const std::int64_t Qp = own_.Qp(), n_q = cfg_.n_q, qw = cfg_.q_width(), Lp = own_.Lp(), kvw = cfg_.kv_width();
  // The packed inputs travel as f32 elements, or (bf16) as the bytes of their mixed dtypes.
  const DType t_in = bf16() ? DType::u8 : DType::f32;
  const auto in_count = [&](std::int64_t rows) {
    const auto floats = static_cast<std::size_t>(qdo_floats(rows) + 2 * rows * n_q);
    return bf16() ? floats * sizeof(float) : floats;
  };

  own_.output_backward(w, st.own, dy_p, grad);
  kv_ = st.own.kv.data();
  if (bf16()) convert(kv_, kv16_.data(), static_cast<std::int64_t>(kv16_.size()));  // (another forward may have run)
  float* mine = own_part_.data();  // own inputs, packed: the first hop's message and step 0's operands
  if (bf16()) {
    auto* qdo = reinterpret_cast<bf16_t*>(mine);
    convert(st.own.q.data(), qdo, Qp * qw);
    convert(own_.dout().data(), qdo + Qp * qw, Qp * qw);
  } else {
    device_copy(mine, st.own.q.data(), Qp * qw);
    device_copy(mine + Qp * qw, own_.dout().data(), Qp * qw);
  }
  device_copy(mine + qdo_floats(Qp), st.own.lse.data(), Qp * n_q);
  device_copy(mine + qdo_floats(Qp) + Qp * n_q, own_.delta().data(), Qp * n_q);
  WorkPtr in_send[2], in_recv[2], acc_send[2];
  if (P > 1) {  // first hop: own inputs
    in_send[0] = comm_.send_async(mine, in_count(Qp), t_in, next, kTagQuery);
    in_recv[1] = comm_.recv_async(in_[1].data(), in_count(rows_of(prev)), t_in, prev, kTagQuery);
  }
  step_backward(masks_[static_cast<std::size_t>(p)], mine, Qp, dq_own_.data(), dkv_.data());

  for (int t = 1; t < P; ++t) {
    const int s = src_of_step(t);
    const std::int64_t Qs = rows_of(s);
    const float* in = in_[t % 2].data();
    timings_.bwd_overlap_exposed_ms += timed_wait(*in_recv[t % 2]);
    if (t + 1 < P) {
      in_send[t % 2] = comm_.send_async(in, in_count(Qs), t_in, next, kTagQuery);
      if (in_send[(t + 1) % 2]) timings_.bwd_overlap_exposed_ms += timed_wait(*in_send[(t + 1) % 2]);
      in_recv[(t + 1) % 2] = comm_.recv_async(in_[(t + 1) % 2].data(), in_count(rows_of(src_of_step(t + 1))), t_in,
                                              prev, kTagQuery);
    }
    const std::size_t dq_count = static_cast<std::size_t>(Qs * qw);
    WorkPtr acc_recv = t >= 2 ? comm_.recv_async(acc_in_.data(), dq_count, DType::f32, prev, kTagRunning) : nullptr;
    if (acc_send[t % 2]) timings_.bwd_overlap_exposed_ms += timed_wait(*acc_send[t % 2]);
    float* dq = acc_out_[t % 2].data();
    step_backward(masks_[static_cast<std::size_t>(s)], in, Qs, dq, dkv_step_.data());
    add_into(dkv_.data(), dkv_step_.data(), 2 * Lp * kvw);
    if (acc_recv) {
      timings_.bwd_overlap_exposed_ms += timed_wait(*acc_recv);
      add_into(dq, acc_in_.data(), Qs * qw);
    }
    acc_send[t % 2] = comm_.send_async(dq, dq_count, DType::f32, next, kTagRunning);  // last hop: home
  }
  // dk, dv are complete: their projection backward overlaps this rank's dq coming home.
  WorkPtr home = P > 1 ? comm_.recv_async(acc_in_.data(), static_cast<std::size_t>(Qp * qw), DType::f32, prev, kTagRunning)
                       : nullptr;
  own_.backward_kv(w, st.own, x_p, ctx_p, dkv_.data(), dx_p, 0.f, dctx_p, grad, home.get());
  if (home) {
    timings_.bwd_overlap_exposed_ms += timed_wait(*home);
    add_into(dq_own_.data(), acc_in_.data(), Qp * qw);
  }
  for (WorkPtr* wk : {&in_send[0], &in_send[1], &acc_send[0], &acc_send[1]})
    if (*wk) timings_.bwd_overlap_exposed_ms += timed_wait(**wk);
  own_.backward_q(w, st.own, x_p, dq_own_.data(), dx_p, 1.f, grad);
  timings_.bwd_ms = elapsed_ms(t0);
}

}  // namespace diffcp
