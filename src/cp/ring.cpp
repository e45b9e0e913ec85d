#include "diffcp/cp/ring.hpp"

#include "diffcp/ops/buffer.hpp"

#include <algorithm>
#include <utility>

#include "diffcp/attention/attention.hpp"
#include "diffcp/cp/bytes.hpp"
#include "diffcp/ops/gemm.hpp"

namespace diffcp {

namespace {
constexpr int kTagKV = 0;   // a visiting K/V shard
constexpr int kTagAcc = 1;  // a travelling dk/dv accumulator
}  // namespace

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
  for (auto* v : {&kv_buf_[0], &kv_buf_[1], &dkv_in_, &dkv_out_[0], &dkv_out_[1]}) v->resize(n(2 * L_max * kvw));
  dkv_own_.resize(n(2 * own_.Lp() * kvw));
  for (auto* v : {&o_step_, &o_tmp_, &dq_, &dq_step_}) v->resize(n(Qp * qw));
  for (auto* v : {&lse_step_, &lse_tmp_}) v->resize(n(Qp * cfg_.n_q));
  if (compute_ == DType::bf16) {
    for (auto* v : {&kv16_buf_[0], &kv16_buf_[1], &dkv16_}) v->resize(n(2 * L_max * kvw));
    kv16_own_.resize(n(2 * own_.Lp() * kvw));
    for (auto* v : {&q16_, &dout16_, &o16_, &dq16_}) v->resize(n(Qp * qw));
  }
}

namespace {
void round_into(const float* x, DeviceVector<bf16_t>& out) {
  convert(x, out.data(), static_cast<std::int64_t>(out.size()));
}
}  // namespace

void RingLayer::step_forward(const OwnActivations& own, const void* cur, int s, float* o, DeviceVector<float>& lse) {
  const std::int64_t Qp = own_.Qp(), n_q = cfg_.n_q, d = cfg_.d_h, kvw = cfg_.kv_width();
  const BlockMask& mask = masks_[static_cast<std::size_t>(s)];
  if (compute_ == DType::f32) {
    const auto* kv = static_cast<const float*>(cur);
    attention_forward(mask, own_.q_view(own), k_of(kv, s), v_of(kv, s), head_view(o, Qp, n_q, d), lse);
    return;
  }
  const auto* kv = static_cast<const bf16_t*>(cur);
  const std::int64_t L = key_rows_[static_cast<std::size_t>(s)];
  attention_forward(mask, HeadRows<const bf16_t>{q16_.data(), Qp, n_q, d, n_q * d},
                    HeadRows<const bf16_t>{kv, L, cfg_.n_kv, d, kvw}, HeadRows<const bf16_t>{kv + L * kvw, L, cfg_.n_kv, d, kvw},
                    HeadRows<bf16_t>{o16_.data(), Qp, n_q, d, n_q * d}, lse);
  convert(o16_.data(), o, Qp * n_q * d);
}

void RingLayer::step_backward(const OwnActivations& own, const void* cur, int s, float* dq, float* dkv) {
  const std::int64_t Qp = own_.Qp(), n_q = cfg_.n_q, d = cfg_.d_h, kvw = cfg_.kv_width();
  const std::int64_t L = key_rows_[static_cast<std::size_t>(s)];
  const BlockMask& mask = masks_[static_cast<std::size_t>(s)];
  if (compute_ == DType::f32) {
    const auto* kv = static_cast<const float*>(cur);
    attention_backward(mask, own_.q_view(own), k_of(kv, s), v_of(kv, s), head_view(own_.dout().data(), Qp, n_q, d),
                       own.lse, own_.delta(), head_view(dq, Qp, n_q, d), head_view(dkv, L, cfg_.n_kv, d),
                       head_view(dkv + L * kvw, L, cfg_.n_kv, d));
    return;
  }
  const auto* kv = static_cast<const bf16_t*>(cur);
  attention_backward(mask, HeadRows<const bf16_t>{q16_.data(), Qp, n_q, d, n_q * d},
                     HeadRows<const bf16_t>{kv, L, cfg_.n_kv, d, kvw},
                     HeadRows<const bf16_t>{kv + L * kvw, L, cfg_.n_kv, d, kvw},
                     HeadRows<const bf16_t>{dout16_.data(), Qp, n_q, d, n_q * d}, own.lse, own_.delta(),
                     HeadRows<bf16_t>{dq16_.data(), Qp, n_q, d, n_q * d}, HeadRows<bf16_t>{dkv16_.data(), L, cfg_.n_kv, d, kvw},
                     HeadRows<bf16_t>{dkv16_.data() + L * kvw, L, cfg_.n_kv, d, kvw});
  convert(dq16_.data(), dq, Qp * n_q * d);
  convert(dkv16_.data(), dkv, 2 * L * kvw);
}

HeadRows<const float> RingLayer::k_of(const float* kv, int r) const {
  return head_view(kv, key_rows_[static_cast<std::size_t>(r)], cfg_.n_kv, cfg_.d_h);
}
HeadRows<const float> RingLayer::v_of(const float* kv, int r) const {
  const std::int64_t L = key_rows_[static_cast<std::size_t>(r)];
  return head_view(kv + L * cfg_.kv_width(), L, cfg_.n_kv, cfg_.d_h);
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
  const ScopedF32GemmCompute precision(compute_);
  const bool bf = compute_ == DType::bf16;
  const DType t_kv = bf ? DType::bf16 : DType::f32;
  const auto t0 = CpClock::now();
  const int P = shard_.P, next = (shard_.p + 1) % P, prev = (shard_.p + P - 1) % P;
  const std::int64_t Qp = own_.Qp(), n_q = cfg_.n_q, d = cfg_.d_h;
  own_.project_q(w, x_p, st.own);
  own_.project_kv(w, x_p, ctx_p, st.own, nullptr);
  if (bf) {
    round_into(st.own.q.data(), q16_);
    round_into(st.own.kv.data(), kv16_own_);
  }
  auto buf = [&](int i) -> void* { return bf ? static_cast<void*>(kv16_buf_[i].data()) : kv_buf_[i].data(); };

  const void* cur = bf ? static_cast<const void*>(kv16_own_.data()) : st.own.kv.data();
  for (int t = 0; t < P; ++t) {
    const int s = src_of_step(t);
    WorkPtr send, recv;
    if (t + 1 < P) {  // the next shard flies while this one is computed
      recv = comm_.recv_async(buf(t % 2), kv_count(src_of_step(t + 1)), t_kv, prev, kTagKV);
      send = comm_.send_async(cur, kv_count(s), t_kv, next, kTagKV);
    }
    if (t == 0) {
      step_forward(st.own, cur, s, st.own.o.data(), st.own.lse);
    } else {
      step_forward(st.own, cur, s, o_step_.data(), lse_step_);
      merge_two(head_view(st.own.o.data(), Qp, n_q, d), st.own.lse, head_view(o_step_.data(), Qp, n_q, d), lse_step_,
                head_view(o_tmp_.data(), Qp, n_q, d), lse_tmp_);
      std::swap(st.own.o, o_tmp_);
      std::swap(st.own.lse, lse_tmp_);
    }
    if (send) {
      timings_.fwd_overlap_exposed_ms += timed_wait(*recv) + timed_wait(*send);
      cur = buf(t % 2);
    }
  }
  own_.output_forward(w, st.own, y_p);
  timings_.fwd_ms = elapsed_ms(t0);
}

void RingLayer::backward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                                 const float* dy_p, float* dx_p, float* dctx_p, AttnLayerParams& grad) {
  Saved& st = static_cast<Saved&>(state);
  const ScopedF32GemmCompute precision(compute_);
  const bool bf = compute_ == DType::bf16;
  const DType t_kv = bf ? DType::bf16 : DType::f32;
  const auto t0 = CpClock::now();
  const int P = shard_.P, p = shard_.p, next = (p + 1) % P, prev = (p + P - 1) % P;
  const std::int64_t Qp = own_.Qp(), kvw = cfg_.kv_width();
  own_.output_backward(w, st.own, dy_p, grad);
  if (bf) {  // the saved f32 rows rounded again (a forward of another step may have run since)
    round_into(st.own.q.data(), q16_);
    round_into(st.own.kv.data(), kv16_own_);
    round_into(own_.dout().data(), dout16_);
  }
  auto buf = [&](int i) -> void* { return bf ? static_cast<void*>(kv16_buf_[i].data()) : kv_buf_[i].data(); };

  const void* cur = bf ? static_cast<const void*>(kv16_own_.data()) : st.own.kv.data();
  WorkPtr acc_send[2];
  for (int t = 0; t < P; ++t) {
    const int s = src_of_step(t);
    const std::int64_t Ls = key_rows_[static_cast<std::size_t>(s)];
    WorkPtr send, recv, acc_recv;
    if (t + 1 < P) {
      recv = comm_.recv_async(buf(t % 2), kv_count(src_of_step(t + 1)), t_kv, prev, kTagKV);
      send = comm_.send_async(cur, kv_count(s), t_kv, next, kTagKV);
    }
    // Rank s's accumulator (f32), started at s+1 (t = 1), arrives from prev for t >= 2.
    if (t >= 2) acc_recv = comm_.recv_async(dkv_in_.data(), kv_count(s), DType::f32, prev, kTagAcc);
    if (t >= 1 && acc_send[t % 2]) timings_.bwd_overlap_exposed_ms += timed_wait(*acc_send[t % 2]);
    float* dkv = t == 0 ? dkv_own_.data() : dkv_out_[t % 2].data();
    float* dq = t == 0 ? dq_.data() : dq_step_.data();
    step_backward(st.own, cur, s, dq, dkv);
    if (t >= 1) {
      add_into(dq_.data(), dq_step_.data(), Qp * cfg_.q_width());
      if (acc_recv) {
        timings_.bwd_overlap_exposed_ms += timed_wait(*acc_recv);
        add_into(dkv, dkv_in_.data(), 2 * Ls * kvw);
      }
      acc_send[t % 2] = comm_.send_async(dkv, kv_count(s), DType::f32, next, kTagAcc);  // the last hop goes home
    }
    if (send) {
      timings_.bwd_overlap_exposed_ms += timed_wait(*recv) + timed_wait(*send);
      cur = buf(t % 2);
    }
  }
  // This rank's accumulator comes home from prev; the q-side backward overlaps it.
  WorkPtr home = P > 1 ? comm_.recv_async(dkv_in_.data(), kv_count(p), DType::f32, prev, kTagAcc) : nullptr;
  own_.backward_q(w, st.own, x_p, dq_.data(), dx_p, 0.f, grad);
  if (home) {
    timings_.bwd_overlap_exposed_ms += timed_wait(*home);
    add_into(dkv_own_.data(), dkv_in_.data(), 2 * own_.Lp() * kvw);
  }
  for (WorkPtr& a : acc_send)
    if (a) timings_.bwd_overlap_exposed_ms += timed_wait(*a);
  own_.backward_kv(w, st.own, x_p, ctx_p, dkv_own_.data(), dx_p, 1.f, dctx_p, grad, nullptr);
  timings_.bwd_ms = elapsed_ms(t0);
}

}  // namespace diffcp
