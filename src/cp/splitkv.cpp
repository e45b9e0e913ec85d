#include "diffcp/cp/splitkv.hpp"

#include <algorithm>
#include <chrono>

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/merge.hpp"
#include "diffcp/cp/bytes.hpp"
#include "diffcp/cp/lse_reduce.hpp"
#include "diffcp/ops/linear.hpp"
#include "diffcp/ops/rmsnorm.hpp"

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

OProj parse_oproj(const std::string& name) {
  if (name == "all") return OProj::all;
  if (name == "owned") return OProj::owned;
  DIFFCP_FAIL("--oproj = '", name, "': expected all, owned or auto");
}

const char* oproj_name(OProj o) { return o == OProj::all ? "all" : "owned"; }

OProj choose_oproj(const AttnLayerConfig& cfg, std::int64_t Q, int P, double gemm_gflops, double link_gbit) {
  DIFFCP_CHECK(gemm_gflops > 0 && link_gbit > 0, "choose_oproj: gemm_gflops = ", gemm_gflops, ", link_gbit = ",
               link_gbit, "; expected > 0");
  const double f = static_cast<double>(P - 1) / P, q = static_cast<double>(Q);
  const double qw = static_cast<double>(cfg.q_width()), H = static_cast<double>(cfg.hidden);
  const double saved_s = 6 * q * f * qw * H / (gemm_gflops * 1e9);
  const double extra_s = 2 * f * q * (qw - H) * 4 * 8 / (link_gbit * 1e9);
  return saved_s > extra_s ? OProj::owned : OProj::all;
}

SplitKVLayer::SplitKVLayer(Communicator& cp, const AttnLayerConfig& cfg, CpShard shard, SplitKVOptions opt)
    : comm_(cp), cfg_(cfg), opt_(opt), shard_(std::move(shard)), mask_(shard_.mask()) {
  cfg_.validate();
  DIFFCP_CHECK(opt_.collectives == CollAlgo::flat || cp.has_topology(),
               "split-kv: hierarchical collectives need the communicator's topology (set_topology / discover_topology)");
  hier_ = opt_.collectives == CollAlgo::hierarchical && cp.hierarchy_useful();
  reshard(shard_);
}

void SplitKVLayer::reshard(CpShard shard) {
  DIFFCP_CHECK(shard.P == comm_.size() && shard.p == comm_.rank(), "split-kv: shard is for rank ", shard.p, " of ",
               shard.P, " but the communicator is rank ", comm_.rank(), " of ", comm_.size());
  shard_ = std::move(shard);
  mask_ = shard_.mask();
  Q_ = mask_.query_rows();
  Qp_ = shard_.own_query_rows();
  Cp_ = shard_.context_rows();
  Lr_ = shard_.key_rows();
  Lk_ = mask_.key_rows();
  query_pos_ = shard_.block_positions();
  key_pos_ = shard_.context_positions();
  key_pos_.insert(key_pos_.end(), query_pos_.begin(), query_pos_.end());
  const auto& len = shard_.batch.lengths;
  const std::int64_t max_len = *std::max_element(len.begin(), len.end());
  if (!rope_ || rope_->max_pos() < max_len)
    rope_ = std::make_unique<RopeTable>(cfg_.d_h, cfg_.rope_theta, max_len);
  x_p_ = ctx_p_ = nullptr;
}

float* SplitKVLayer::buffer(std::vector<float>& v, std::int64_t n) {
  if (static_cast<std::size_t>(n) > v.capacity()) ++allocations_;
  v.resize(static_cast<std::size_t>(n));
  return v.data();
}

std::vector<std::size_t> SplitKVLayer::row_counts(std::int64_t width) const {
  std::vector<std::size_t> c;
  for (std::int64_t rows : shard_.query_rows) c.push_back(static_cast<std::size_t>(rows * width));
  return c;
}

double SplitKVLayer::predicted_bytes_per_layer() const {
  return splitkv_bytes_per_layer(cfg_, Q_, shard_.P, opt_.oproj == OProj::owned, hier_ ? comm_.topology().nodes() : 0);
}

double SplitKVLayer::predicted_inter_bytes_per_layer() const {
  const Topology& t = comm_.topology();
  const int P = shard_.P;
  const double Q = static_cast<double>(Q_), qw = static_cast<double>(cfg_.q_width());
  const double w = static_cast<double>(opt_.oproj == OProj::owned ? cfg_.q_width() : cfg_.hidden);
  const std::int64_t n = Q_ * cfg_.n_q;
  if (hier_) {
    const double N = t.nodes();
    return 4 * ((N - 1) * (2 * Q * qw + 2 * Q * w) + 2 * 2 * static_cast<double>(n) * (N - 1)) / P;
  }
  double rows = 0, reduce = 0;
  auto share = [&](int r) { return static_cast<double>(n / P + (r < n % P ? 1 : 0)); };
  for (int r = 0; r < P; ++r) {
    const double off_node = P - t.node_size(t.node_of[static_cast<std::size_t>(r)]);
    rows += static_cast<double>(shard_.query_rows[static_cast<std::size_t>(r)]) * (2 * qw + 2 * w) * off_node;
    for (int o = 0; o < P; ++o)
      if (!t.same_node(r, o)) reduce += share(o) + share(r);
  }
  return 4 * (rows + 2 * reduce) / P;
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
  float* q_lin = buffer(q_lin_, Qp_ * qw);
  float* q_p = buffer(q_p_, Qp_ * qw);
  linear_forward(x_p, Qp_, H, w[P::wq], qw, q_lin);
  rmsnorm_forward(q_lin, Qp_, cfg_.n_q, d, w[P::q_norm], eps, q_p, buffer(q_rstd_, Qp_ * cfg_.n_q));
  rope_apply(q_p, Qp_, cfg_.n_q, query_pos_, *rope_, false);
  float* q_all = buffer(q_all_, Q_ * qw);
  WorkPtr ag = comm_.all_gather_v_async(q_p, q_all, row_counts(qw), DType::f32, opt_.collectives);

  // 2. Local keys/values of [ctx_p; X_p] while the all-gather flies. Rows past L_r (bucket
  // padding) are zero and masked.
  float* k_lin = buffer(k_lin_, Lk_ * kvw);
  float* k = buffer(k_, Lk_ * kvw);
  float* v = buffer(v_, Lk_ * kvw);
  linear_polled(ctx_p, Cp_, H, w[P::wk], kvw, k_lin, *ag);
  linear_polled(x_p, Qp_, H, w[P::wk], kvw, k_lin + Cp_ * kvw, *ag);
  linear_polled(ctx_p, Cp_, H, w[P::wv], kvw, v, *ag);
  linear_polled(x_p, Qp_, H, w[P::wv], kvw, v + Cp_ * kvw, *ag);
  std::fill(k + Lr_ * kvw, k + Lk_ * kvw, 0.f);
  std::fill(v + Lr_ * kvw, v + Lk_ * kvw, 0.f);
  rmsnorm_forward(k_lin, Lr_, cfg_.n_kv, d, w[P::k_norm], eps, k, buffer(k_rstd_, Lk_ * cfg_.n_kv));
  ag->test();
  rope_apply(k, Lr_, cfg_.n_kv, key_pos_, *rope_, false);
  auto tw = Clock::now();
  ag->wait();
  timings_.fwd_overlap_exposed_ms = ms_since(tw);

  // 3. Attention over local keys, then the global log-sum-exp and the rescaled local output.
  float* obar = buffer(obar_, Q_ * qw);
  buffer(lse_p_, Q_ * cfg_.n_q);
  attention_forward(mask_, HeadRows<const float>{q_all, Q_, cfg_.n_q, d, qw}, HeadRows<const float>{k, Lk_, cfg_.n_kv, d, kvw},
                    HeadRows<const float>{v, Lk_, cfg_.n_kv, d, kvw}, HeadRows<float>{obar, Q_, cfg_.n_q, d, qw}, lse_p_);
  lse_ = lse_p_;
  tw = Clock::now();
  all_reduce_lse(comm_, lse_, opt_.collectives);
  timings_.blocking_comm_ms += ms_since(tw);
  lse_rescale(HeadRows<float>{obar, Q_, cfg_.n_q, d, qw}, lse_p_, lse_);

  // 4. oproj all: output projection of all Q rows' partial output, reduce-scatter to the owners.
  //    oproj owned: reduce-scatter the partial output, project the owned rows. Bias once.
  if (opt_.oproj == OProj::all) {
    float* ybar = buffer(ybar_, Q_ * H);
    linear_forward(obar, Q_, qw, w[P::wo], H, ybar);
    tw = Clock::now();
    comm_.reduce_scatter_v_async(ybar, y_p, row_counts(H), DType::f32, ReduceOp::sum, opt_.collectives)->wait();
    timings_.blocking_comm_ms += ms_since(tw);
  } else {
    float* o_p = buffer(o_p_, Qp_ * qw);
    tw = Clock::now();
    comm_.reduce_scatter_v_async(obar, o_p, row_counts(qw), DType::f32, ReduceOp::sum, opt_.collectives)->wait();
    timings_.blocking_comm_ms += ms_since(tw);
    linear_forward(o_p, Qp_, qw, w[P::wo], H, y_p);
  }
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

  // 1. oproj all: gather dY; do = g W_o^T and this rank's share of dW_o = obar_p^T g (sums to o^T g).
  //    oproj owned: do_p = dY_p W_o^T and dW_o share o_p^T dY_p locally, then gather do.
  bias_backward(dy_p, Qp_, H, grad[P::bo]);
  float* dout = buffer(dout_, Q_ * qw);
  auto tw = Clock::now();
  if (opt_.oproj == OProj::all) {
    float* g = buffer(g_, Q_ * H);
    comm_.all_gather_v_async(dy_p, g, row_counts(H), DType::f32, opt_.collectives)->wait();
    timings_.blocking_comm_ms += ms_since(tw);
    linear_backward_input(g, Q_, H, w[P::wo], qw, dout);
    linear_backward_weight(obar_.data(), Q_, qw, g, H, grad[P::wo]);
  } else {
    float* dout_p = buffer(g_, Qp_ * qw);
    linear_backward_input(dy_p, Qp_, H, w[P::wo], qw, dout_p);
    linear_backward_weight(o_p_.data(), Qp_, qw, dy_p, H, grad[P::wo]);
    tw = Clock::now();
    comm_.all_gather_v_async(dout_p, dout, row_counts(qw), DType::f32, opt_.collectives)->wait();
    timings_.blocking_comm_ms += ms_since(tw);
  }

  // 2. D = rowsum(do * o) needs the global output: sum the per-rank partials.
  buffer(delta_, Q_ * cfg_.n_q);
  attention_delta(HeadRows<const float>{dout, Q_, cfg_.n_q, d, qw}, HeadRows<const float>{obar_.data(), Q_, cfg_.n_q, d, qw},
                  delta_);
  tw = Clock::now();
  comm_.all_reduce<float>(delta_, ReduceOp::sum, opt_.collectives);
  timings_.blocking_comm_ms += ms_since(tw);

  // 3. Local attention backward with the global lse and D; launch the dq reduce-scatter.
  float* dq_all = buffer(dq_all_, Q_ * qw);
  float* dk = buffer(dk_, Lk_ * kvw);
  float* dv = buffer(dv_, Lk_ * kvw);
  float* dq_p = buffer(dq_p_, Qp_ * qw);
  attention_backward(mask_, HeadRows<const float>{q_all_.data(), Q_, cfg_.n_q, d, qw},
                     HeadRows<const float>{k_.data(), Lk_, cfg_.n_kv, d, kvw}, HeadRows<const float>{v_.data(), Lk_, cfg_.n_kv, d, kvw},
                     HeadRows<const float>{dout, Q_, cfg_.n_q, d, qw}, lse_, delta_, HeadRows<float>{dq_all, Q_, cfg_.n_q, d, qw},
                     HeadRows<float>{dk, Lk_, cfg_.n_kv, d, kvw}, HeadRows<float>{dv, Lk_, cfg_.n_kv, d, kvw});
  WorkPtr rs = comm_.reduce_scatter_v_async(dq_all, dq_p, row_counts(qw), DType::f32, ReduceOp::sum, opt_.collectives);

  // 4. K/V projection backward (real rows only) while dq travels; dk, dv stay on this rank.
  rope_apply(dk, Lr_, cfg_.n_kv, key_pos_, *rope_, true);
  rmsnorm_backward(dk, k_lin_.data(), k_rstd_.data(), Lr_, cfg_.n_kv, d, w[P::k_norm], dk, grad[P::k_norm]);
  rs->test();
  linear_backward_weight(ctx_p_, Cp_, H, dk, kvw, grad[P::wk]);
  linear_backward_weight(x_p_, Qp_, H, dk + Cp_ * kvw, kvw, grad[P::wk]);
  rs->test();
  linear_backward_weight(ctx_p_, Cp_, H, dv, kvw, grad[P::wv]);
  linear_backward_weight(x_p_, Qp_, H, dv + Cp_ * kvw, kvw, grad[P::wv]);
  rs->test();
  linear_backward_input(dk, Cp_, kvw, w[P::wk], H, dctx_p);
  linear_backward_input(dv, Cp_, kvw, w[P::wv], H, dctx_p, 1.f);
  rs->test();
  linear_backward_input(dk + Cp_ * kvw, Qp_, kvw, w[P::wk], H, dx_p);
  linear_backward_input(dv + Cp_ * kvw, Qp_, kvw, w[P::wv], H, dx_p, 1.f);
  tw = Clock::now();
  rs->wait();
  timings_.bwd_overlap_exposed_ms = ms_since(tw);

  // 5. Query projection backward: RoPE^-1, RMSNorm_q backward, then dX_p += dq_lin W_q^T.
  rope_apply(dq_p, Qp_, cfg_.n_q, query_pos_, *rope_, true);
  rmsnorm_backward(dq_p, q_lin_.data(), q_rstd_.data(), Qp_, cfg_.n_q, d, w[P::q_norm], dq_p, grad[P::q_norm]);
  linear_backward_weight(x_p_, Qp_, H, dq_p, qw, grad[P::wq]);
  linear_backward_input(dq_p, Qp_, qw, w[P::wq], H, dx_p, 1.f);
  timings_.bwd_ms = ms_since(t0);
}

}  // namespace diffcp
