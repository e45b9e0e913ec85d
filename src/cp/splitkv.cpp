#include "cp/splitkv.hpp"

#include <algorithm>
#include <chrono>

#include "attention/attention.hpp"
#include "attention/merge.hpp"
#include "ops/linear.hpp"
#include "ops/rmsnorm.hpp"

namespace diffcp {

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Open MPI advances a nonblocking collective only inside MPI calls, so the projections that
// should overlap it run in row chunks with a Work::test() between chunks.
constexpr int kPollChunks = 8;

// y[M, N] = x[M, K] W[K, N] (+ beta y), polling `inflight` between row chunks.
void linear_polled(const float* x, std::int64_t M, std::int64_t K, const float* W, std::int64_t N, float* y,
                   Work& inflight) {
  const std::int64_t chunk = std::max<std::int64_t>(1, (M + kPollChunks - 1) / kPollChunks);
  for (std::int64_t r0 = 0; r0 < M; r0 += chunk) {
    linear_forward(x + r0 * K, std::min(chunk, M - r0), K, W, N, y + r0 * N);
    inflight.test();
  }
}

}  // namespace

SplitKVLayer::SplitKVLayer(Communicator& cp, const AttnLayerConfig& cfg, CpShard shard)
    : comm_(cp), cfg_(cfg), shard_(std::move(shard)), mask_(shard_.mask()) {
  cfg_.validate();
  DIFFCP_CHECK(shard_.P == cp.size() && shard_.p == cp.rank(), "split-kv: shard is for rank ", shard_.p, " of ",
               shard_.P, " but the communicator is rank ", cp.rank(), " of ", cp.size());
  Q_ = mask_.query_rows();
  Qp_ = shard_.own_query_rows();
  Cp_ = shard_.context_rows();
  Lk_ = mask_.key_rows();
  query_pos_ = shard_.block_positions();
  key_pos_ = shard_.context_positions();
  key_pos_.insert(key_pos_.end(), query_pos_.begin(), query_pos_.end());
  const auto& len = shard_.batch.lengths;
  rope_ = std::make_unique<RopeTable>(cfg_.d_h, cfg_.rope_theta, *std::max_element(len.begin(), len.end()));
}

std::vector<std::size_t> SplitKVLayer::row_counts(std::int64_t width) const {
  std::vector<std::size_t> c;
  for (std::int64_t rows : shard_.query_rows) c.push_back(static_cast<std::size_t>(rows * width));
  return c;
}

double SplitKVLayer::predicted_bytes_per_layer() const {
  const double P = shard_.P, Q = static_cast<double>(Q_);
  const double elems = (P - 1) / P * 2 * Q * static_cast<double>(cfg_.q_width() + cfg_.hidden) +
                       2 * 2 * (P - 1) / P * Q * static_cast<double>(cfg_.n_q);
  return 4 * elems;
}

void SplitKVLayer::forward(const AttnLayerParams& w, const float* x_p, const float* ctx_p, float* y_p) {
  using P = AttnLayerParams;
  const auto t0 = Clock::now();
  const std::int64_t H = cfg_.hidden, qw = cfg_.q_width(), kvw = cfg_.kv_width(), d = cfg_.d_h;
  const float eps = static_cast<float>(cfg_.rms_eps);
  timings_ = {};
  x_p_ = x_p;
  ctx_p_ = ctx_p;

  // 1. Local queries, normed and rotated, then launch their all-gather.
  q_lin_.resize(static_cast<std::size_t>(Qp_ * qw));
  q_rstd_.resize(static_cast<std::size_t>(Qp_ * cfg_.n_q));
  std::vector<float> q_p(q_lin_.size());
  linear_forward(x_p, Qp_, H, w[P::wq], qw, q_lin_.data());
  rmsnorm_forward(q_lin_.data(), Qp_, cfg_.n_q, d, w[P::q_norm], eps, q_p.data(), q_rstd_.data());
  rope_apply(q_p.data(), Qp_, cfg_.n_q, query_pos_, *rope_, false);
  q_all_.resize(static_cast<std::size_t>(Q_ * qw));
  WorkPtr ag = comm_.all_gather_v_async(q_p.data(), q_all_.data(), row_counts(qw), DType::f32);

  // 2. Local keys/values of [ctx_p; X_p] while the all-gather flies.
  k_lin_.resize(static_cast<std::size_t>(Lk_ * kvw));
  v_.resize(k_lin_.size());
  k_.resize(k_lin_.size());
  k_rstd_.resize(static_cast<std::size_t>(Lk_ * cfg_.n_kv));
  linear_polled(ctx_p, Cp_, H, w[P::wk], kvw, k_lin_.data(), *ag);
  linear_polled(x_p, Qp_, H, w[P::wk], kvw, k_lin_.data() + Cp_ * kvw, *ag);
  linear_polled(ctx_p, Cp_, H, w[P::wv], kvw, v_.data(), *ag);
  linear_polled(x_p, Qp_, H, w[P::wv], kvw, v_.data() + Cp_ * kvw, *ag);
  rmsnorm_forward(k_lin_.data(), Lk_, cfg_.n_kv, d, w[P::k_norm], eps, k_.data(), k_rstd_.data());
  ag->test();
  rope_apply(k_.data(), Lk_, cfg_.n_kv, key_pos_, *rope_, false);
  auto tw = Clock::now();
  ag->wait();
  timings_.fwd_ag_exposed_ms = ms_since(tw);

  // 3. Attention over local keys, then the global log-sum-exp and the rescaled local output.
  obar_.resize(q_all_.size());
  std::vector<float> lse_p(static_cast<std::size_t>(Q_ * cfg_.n_q));
  attention_forward(mask_, head_rows(q_all_, Q_, cfg_.n_q, d), head_rows(k_, Lk_, cfg_.n_kv, d),
                    head_rows(v_, Lk_, cfg_.n_kv, d), head_rows(obar_, Q_, cfg_.n_q, d), lse_p);
  lse_ = lse_p;
  tw = Clock::now();
  comm_.all_reduce<float>(lse_, ReduceOp::logsumexp);
  timings_.blocking_comm_ms += ms_since(tw);
  lse_rescale(head_rows(obar_, Q_, cfg_.n_q, d), lse_p, lse_);

  // 4. Output projection of all Q rows' partial output, reduce-scatter to the owners, bias once.
  std::vector<float> ybar(static_cast<std::size_t>(Q_ * H));
  linear_forward(obar_.data(), Q_, qw, w[P::wo], H, ybar.data());
  tw = Clock::now();
  comm_.reduce_scatter_v_async(ybar.data(), y_p, row_counts(H), DType::f32, ReduceOp::sum)->wait();
  timings_.blocking_comm_ms += ms_since(tw);
  for (std::int64_t r = 0; r < Qp_; ++r)
    for (std::int64_t c = 0; c < H; ++c) y_p[r * H + c] += w[P::bo][c];
  timings_.fwd_ms = ms_since(t0);
}

void SplitKVLayer::backward(const AttnLayerParams& w, const float* dy_p, float* dx_p, float* dctx_p,
                            AttnLayerParams& grad) {
  using P = AttnLayerParams;
  DIFFCP_CHECK(x_p_ != nullptr || Qp_ == 0, "split-kv: backward() called before forward()");
  const auto t0 = Clock::now();
  const std::int64_t H = cfg_.hidden, qw = cfg_.q_width(), kvw = cfg_.kv_width(), d = cfg_.d_h;

  // 1. Gather dY; do = g W_o^T and this rank's share of dW_o = obar_p^T g (sums to o^T g).
  std::vector<float> g(static_cast<std::size_t>(Q_ * H));
  auto tw = Clock::now();
  comm_.all_gather_v_async(dy_p, g.data(), row_counts(H), DType::f32)->wait();
  timings_.blocking_comm_ms += ms_since(tw);
  bias_backward(dy_p, Qp_, H, grad[P::bo]);
  std::vector<float> dout(static_cast<std::size_t>(Q_ * qw));
  linear_backward_input(g.data(), Q_, H, w[P::wo], qw, dout.data());
  linear_backward_weight(obar_.data(), Q_, qw, g.data(), H, grad[P::wo]);

  // 2. D = rowsum(do * o) needs the global output: sum the per-rank partials.
  std::vector<float> delta(static_cast<std::size_t>(Q_ * cfg_.n_q));
  attention_delta(head_rows(dout, Q_, cfg_.n_q, d), head_rows(obar_, Q_, cfg_.n_q, d), delta);
  tw = Clock::now();
  comm_.all_reduce<float>(delta, ReduceOp::sum);
  timings_.blocking_comm_ms += ms_since(tw);

  // 3. Local attention backward with the global lse and D; launch the dq reduce-scatter.
  std::vector<float> dq_all(q_all_.size()), dk(k_.size()), dv(v_.size()), dq_p(static_cast<std::size_t>(Qp_ * qw));
  attention_backward(mask_, head_rows(q_all_, Q_, cfg_.n_q, d), head_rows(k_, Lk_, cfg_.n_kv, d),
                     head_rows(v_, Lk_, cfg_.n_kv, d), head_rows(dout, Q_, cfg_.n_q, d), lse_, delta,
                     head_rows(dq_all, Q_, cfg_.n_q, d), head_rows(dk, Lk_, cfg_.n_kv, d), head_rows(dv, Lk_, cfg_.n_kv, d));
  WorkPtr rs = comm_.reduce_scatter_v_async(dq_all.data(), dq_p.data(), row_counts(qw), DType::f32, ReduceOp::sum);

  // 4. K/V projection backward while dq travels; dk, dv stay on this rank.
  rope_apply(dk.data(), Lk_, cfg_.n_kv, key_pos_, *rope_, true);
  rmsnorm_backward(dk.data(), k_lin_.data(), k_rstd_.data(), Lk_, cfg_.n_kv, d, w[P::k_norm], dk.data(), grad[P::k_norm]);
  rs->test();
  linear_backward_weight(ctx_p_, Cp_, H, dk.data(), kvw, grad[P::wk]);
  linear_backward_weight(x_p_, Qp_, H, dk.data() + Cp_ * kvw, kvw, grad[P::wk]);
  rs->test();
  linear_backward_weight(ctx_p_, Cp_, H, dv.data(), kvw, grad[P::wv]);
  linear_backward_weight(x_p_, Qp_, H, dv.data() + Cp_ * kvw, kvw, grad[P::wv]);
  rs->test();
  linear_backward_input(dk.data(), Cp_, kvw, w[P::wk], H, dctx_p);
  linear_backward_input(dv.data(), Cp_, kvw, w[P::wv], H, dctx_p, 1.f);
  rs->test();
  linear_backward_input(dk.data() + Cp_ * kvw, Qp_, kvw, w[P::wk], H, dx_p);
  linear_backward_input(dv.data() + Cp_ * kvw, Qp_, kvw, w[P::wv], H, dx_p, 1.f);
  tw = Clock::now();
  rs->wait();
  timings_.bwd_rs_exposed_ms = ms_since(tw);

  // 5. Query projection backward: RoPE^-1, RMSNorm_q backward, then dX_p += dq_lin W_q^T.
  rope_apply(dq_p.data(), Qp_, cfg_.n_q, query_pos_, *rope_, true);
  rmsnorm_backward(dq_p.data(), q_lin_.data(), q_rstd_.data(), Qp_, cfg_.n_q, d, w[P::q_norm], dq_p.data(), grad[P::q_norm]);
  linear_backward_weight(x_p_, Qp_, H, dq_p.data(), qw, grad[P::wq]);
  linear_backward_input(dq_p.data(), Qp_, qw, w[P::wq], H, dx_p, 1.f);
  timings_.bwd_ms = ms_since(t0);
}

void allreduce_grads(Communicator& group, AttnLayerParams& grad) { group.all_reduce<float>(grad.all()); }

}  // namespace diffcp
