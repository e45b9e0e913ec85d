#include "diffcp/cp/lvxattn.hpp"

#include <algorithm>
#include <span>

#include "diffcp/attention/attention.hpp"
#include "diffcp/cp/bytes.hpp"

namespace diffcp {

namespace {
constexpr int kTagQuery = 0;    // q (forward) or the backward inputs [q | do | lse | D]
constexpr int kTagRunning = 1;  // running [o | lse] (forward) or the dq accumulator (backward)
}  // namespace

LvXAttnLayer::LvXAttnLayer(Communicator& cp, const AttnLayerConfig& cfg, CpShard shard) : CpAttentionLayer(cp, cfg) {
  reshard(std::move(shard));
}

void LvXAttnLayer::on_reshard() {
  own_.reshard(cfg_, shard_);
  const KeyRows mine = own_key_rows(shard_);
  masks_.clear();
  for (const Shard& b : block_ranges(shard_)) masks_.push_back(cross_mask(shard_.batch, b, {&mine, 1}));
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

// Per layer, in f32 elements, for the state of rank s (Q_s rows), each over P-1 hops: forward q
// (n_q d_h) and running [o | lse] (n_q d_h + n_q); backward inputs [q | do | lse | D]
// (2 n_q d_h + 2 n_q) and the dq accumulator (n_q d_h). Summed over s (sum Q_s = Q), / P:
//   bytes = (P-1)/P * Q (5 n_q d_h e + 3 n_q 4),  e = dtype_size(dtype()), lse and D f32.
// Paper, Table 1 (MHA n_q d_h = H): (P-1)/P * 5QH elements plus the lower-order 3(P-1)/P Q n_q.
double LvXAttnLayer::predicted_bytes_per_layer() const {
  return lvxattn_bytes_per_layer(cfg_, dtype(), shard_.batch.query_rows(), shard_.P);
}

void LvXAttnLayer::forward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                                float* y_p) {
  Saved& st = static_cast<Saved&>(state);  // made by new_state(): CpAttentionLayer checked the owner
  const auto t0 = CpClock::now();
  const int P = shard_.P, p = shard_.p, next = (p + 1) % P, prev = (p + P - 1) % P;
  const std::int64_t Qp = own_.Qp(), n_q = cfg_.n_q, d = cfg_.d_h, qw = cfg_.q_width();
  const auto state_count = [&](std::int64_t rows) { return static_cast<std::size_t>(rows * (qw + n_q)); };
  const auto o_of = [&](float* buf, std::int64_t rows) { return head_view(buf, rows, n_q, d); };
  const auto lse_of = [&](float* buf, std::int64_t rows) {
    return std::span<float>(buf + rows * qw, static_cast<std::size_t>(rows * n_q));
  };
  timings_ = {};
  own_.project_q(w, x_p, st.own);
  WorkPtr q_send[2], q_recv[2], acc_send[2];
  if (P > 1) {  // first hop: own q to next; rank p-1's q arrives for step 1
    q_send[0] = comm_.send_async(st.own.q.data(), static_cast<std::size_t>(Qp * qw), DType::f32, next, kTagQuery);
    q_recv[1] = comm_.recv_async(in_[1].data(), static_cast<std::size_t>(rows_of(prev) * qw), DType::f32, prev, kTagQuery);
  }
  own_.project_kv(w, x_p, ctx_p, st.own, q_recv[1].get());
  attention_forward(masks_[static_cast<std::size_t>(p)], own_.q_view(st.own), own_.k_view(st.own), own_.v_view(st.own),
                    o_of(own_part_.data(), Qp), lse_of(own_part_.data(), Qp));

  for (int t = 1; t < P; ++t) {
    const int s = src_of_step(t);
    const std::int64_t Qs = rows_of(s);
    float* q_s = in_[t % 2].data();
    timings_.fwd_overlap_exposed_ms += timed_wait(*q_recv[t % 2]);
    if (t + 1 < P) {  // q_s moves on at once; q of the next step's state comes in
      q_send[t % 2] = comm_.send_async(q_s, static_cast<std::size_t>(Qs * qw), DType::f32, next, kTagQuery);
      if (q_send[(t + 1) % 2]) timings_.fwd_overlap_exposed_ms += timed_wait(*q_send[(t + 1) % 2]);
      q_recv[(t + 1) % 2] = comm_.recv_async(in_[(t + 1) % 2].data(), static_cast<std::size_t>(rows_of(src_of_step(t + 1)) * qw),
                                             DType::f32, prev, kTagQuery);
    }
    WorkPtr acc_recv = t >= 2 ? comm_.recv_async(acc_in_.data(), state_count(Qs), DType::f32, prev, kTagRunning) : nullptr;
    if (acc_send[t % 2]) timings_.fwd_overlap_exposed_ms += timed_wait(*acc_send[t % 2]);
    float* out = acc_out_[t % 2].data();
    float* part = t == 1 ? out : part_.data();  // the running state starts here at step 1
    attention_forward(masks_[static_cast<std::size_t>(s)], head_view(q_s, Qs, n_q, d), own_.k_view(st.own), own_.v_view(st.own),
                      o_of(part, Qs), lse_of(part, Qs));
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
    std::copy_n(own_part_.begin(), st.own.o.size(), st.own.o.begin());
    std::copy_n(own_part_.begin() + static_cast<std::ptrdiff_t>(st.own.o.size()), st.own.lse.size(), st.own.lse.begin());
  }
  for (WorkPtr* wk : {&q_send[0], &q_send[1], &acc_send[0], &acc_send[1]})
    if (*wk) timings_.fwd_overlap_exposed_ms += timed_wait(**wk);
  own_.output_forward(w, st.own, y_p);
  timings_.fwd_ms = elapsed_ms(t0);
}

void LvXAttnLayer::backward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                                 const float* dy_p, float* dx_p, float* dctx_p, AttnLayerParams& grad) {
  Saved& st = static_cast<Saved&>(state);
  const auto t0 = CpClock::now();
  const int P = shard_.P, p = shard_.p, next = (p + 1) % P, prev = (p + P - 1) % P;
  const std::int64_t Qp = own_.Qp(), n_q = cfg_.n_q, n_kv = cfg_.n_kv, d = cfg_.d_h, qw = cfg_.q_width();
  const std::int64_t Lp = own_.Lp(), kvw = cfg_.kv_width();
  const auto in_count = [&](std::int64_t rows) { return static_cast<std::size_t>(rows * 2 * (qw + n_q)); };
  // Views of the inputs [q | do | lse | D] of `rows` query rows in `buf`.
  const auto q_of = [&](const float* buf, std::int64_t rows) { return head_view(buf, rows, n_q, d); };
  const auto do_of = [&](const float* buf, std::int64_t rows) { return head_view(buf + rows * qw, rows, n_q, d); };
  const auto lse_of = [&](const float* buf, std::int64_t rows) {
    return std::span<const float>(buf + 2 * rows * qw, static_cast<std::size_t>(rows * n_q));
  };
  const auto delta_of = [&](const float* buf, std::int64_t rows) {
    return std::span<const float>(buf + rows * (2 * qw + n_q), static_cast<std::size_t>(rows * n_q));
  };
  const auto dk_of = [&](float* dkv) { return head_view(dkv, Lp, n_kv, d); };
  const auto dv_of = [&](float* dkv) { return head_view(dkv + Lp * kvw, Lp, n_kv, d); };

  own_.output_backward(w, st.own, dy_p, grad);
  WorkPtr in_send[2], in_recv[2], acc_send[2];
  if (P > 1) {  // first hop: own inputs, packed
    float* mine = own_part_.data();
    std::copy(st.own.q.begin(), st.own.q.end(), mine);
    std::copy(own_.dout().begin(), own_.dout().end(), mine + Qp * qw);
    std::copy(st.own.lse.begin(), st.own.lse.end(), mine + 2 * Qp * qw);
    std::copy(own_.delta().begin(), own_.delta().end(), mine + Qp * (2 * qw + n_q));
    in_send[0] = comm_.send_async(mine, in_count(Qp), DType::f32, next, kTagQuery);
    in_recv[1] = comm_.recv_async(in_[1].data(), in_count(rows_of(prev)), DType::f32, prev, kTagQuery);
  }
  attention_backward(masks_[static_cast<std::size_t>(p)], own_.q_view(st.own), own_.k_view(st.own), own_.v_view(st.own),
                     head_view(own_.dout().data(), Qp, n_q, d), st.own.lse, own_.delta(),
                     head_view(dq_own_.data(), Qp, n_q, d), dk_of(dkv_.data()), dv_of(dkv_.data()));

  for (int t = 1; t < P; ++t) {
    const int s = src_of_step(t);
    const std::int64_t Qs = rows_of(s);
    const float* in = in_[t % 2].data();
    timings_.bwd_overlap_exposed_ms += timed_wait(*in_recv[t % 2]);
    if (t + 1 < P) {
      in_send[t % 2] = comm_.send_async(in, in_count(Qs), DType::f32, next, kTagQuery);
      if (in_send[(t + 1) % 2]) timings_.bwd_overlap_exposed_ms += timed_wait(*in_send[(t + 1) % 2]);
      in_recv[(t + 1) % 2] = comm_.recv_async(in_[(t + 1) % 2].data(), in_count(rows_of(src_of_step(t + 1))), DType::f32,
                                              prev, kTagQuery);
    }
    const std::size_t dq_count = static_cast<std::size_t>(Qs * qw);
    WorkPtr acc_recv = t >= 2 ? comm_.recv_async(acc_in_.data(), dq_count, DType::f32, prev, kTagRunning) : nullptr;
    if (acc_send[t % 2]) timings_.bwd_overlap_exposed_ms += timed_wait(*acc_send[t % 2]);
    float* dq = acc_out_[t % 2].data();
    attention_backward(masks_[static_cast<std::size_t>(s)], q_of(in, Qs), own_.k_view(st.own), own_.v_view(st.own), do_of(in, Qs),
                       lse_of(in, Qs), delta_of(in, Qs), head_view(dq, Qs, n_q, d), dk_of(dkv_step_.data()),
                       dv_of(dkv_step_.data()));
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
