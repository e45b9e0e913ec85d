#include "diffcp/cp/splitkv.hpp"

#include <algorithm>

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/merge.hpp"
#include "diffcp/cp/bytes.hpp"
#include "diffcp/cp/lse_reduce.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/ops/gemm.hpp"
#include "diffcp/ops/linear.hpp"

namespace diffcp {

OProj parse_oproj(const std::string& name) {
  if (name == "all") return OProj::all;
  if (name == "owned") return OProj::owned;
  DIFFCP_FAIL("`oproj` = '", name, "': expected all, owned or auto");
}

const char* oproj_name(OProj o) { return o == OProj::all ? "all" : "owned"; }

OProj choose_oproj(const AttnLayerConfig& cfg, std::int64_t Q, int P, double gemm_gflops, double link_gbit, DType dtype) {
  DIFFCP_CHECK(gemm_gflops > 0 && link_gbit > 0, "choose_oproj: gemm_gflops = ", gemm_gflops, ", link_gbit = ",
               link_gbit, "; expected > 0");
  const double f = static_cast<double>(P - 1) / P, q = static_cast<double>(Q);
  const double qw = static_cast<double>(cfg.q_width()), H = static_cast<double>(cfg.hidden);
  const double saved_s = 6 * q * f * qw * H / (gemm_gflops * 1e9);
  const double extra_s = 2 * f * q * (qw - H) * static_cast<double>(dtype_size(dtype)) * 8 / (link_gbit * 1e9);
  return saved_s > extra_s ? OProj::owned : OProj::all;
}

OProj choose_oproj_by_shape(const AttnLayerConfig& cfg) {
  return cfg.q_width() <= cfg.hidden ? OProj::owned : OProj::all;
}

SplitKVLayer::SplitKVLayer(Communicator& cp, const AttnLayerConfig& cfg, CpShard shard, SplitKVOptions opt)
    : CpAttentionLayer(cp, cfg, "split-kv", opt.compute), opt_(opt) {
  DIFFCP_CHECK(opt_.collectives == CollAlgo::flat || cp.has_topology(),
               "split-kv: hierarchical collectives need the communicator's topology (set_topology / discover_topology)");
  hier_ = opt_.collectives == CollAlgo::hierarchical && cp.hierarchy_useful();
  merge_ = opt_.oproj == OProj::owned && !hier_;
  reshard(std::move(shard));
}

void SplitKVLayer::on_reshard() {
  mask_.emplace(shard_.mask());
  Q_ = mask_->query_rows();
  own_.reshard(cfg_, shard_, mask_->key_rows());  // K/V padded to the bucket: rows past L_p are zero and masked
}

std::span<const float> SplitKVLayer::lse(const CpSaved& saved) const {
  const auto* st = dynamic_cast<const Saved*>(saved.state());
  DIFFCP_CHECK(st != nullptr, "split-kv: lse() of a saved context that is empty or not Split-KV's");
  if (merge_) return st->lse;  // the owner merge keeps the owned rows only
  const std::int64_t first = shard_.blocks.begin * shard_.batch.block;  // the owned rows in [Q, n_q]
  return std::span<const float>(st->lse).subspan(static_cast<std::size_t>(first * cfg_.n_q),
                                                 static_cast<std::size_t>(own_.Qp() * cfg_.n_q));
}

template <typename T>
T* SplitKVLayer::buffer(DeviceVector<T>& v, std::int64_t n) {
  if (v.resize(n)) ++allocations_;
  return v.data();
}

TensorView SplitKVLayer::buffer(Workspace& v, std::int64_t n) {
  if (v.resize(opt_.compute, n)) ++allocations_;
  return v.view();
}

void SplitKVLayer::gather_rows(const float* mine, std::int64_t width, float* all) {
  const TensorView all_f32 = device_view(all, Q_ * width);
  const TensorView all_c = compute_out(all_f32, opt_.compute, recv_c_);
  comm_.all_gather_v_async(to_compute(device_view(mine, own_.Qp() * width), opt_.compute, send_c_), all_c,
                           row_counts(width), opt_.collectives)->wait();
  from_compute(all_c, all_f32);
}

void SplitKVLayer::reduce_scatter_rows(const float* all, std::int64_t width, float* mine) {
  const TensorView mine_f32 = device_view(mine, own_.Qp() * width);
  const TensorView mine_c = compute_out(mine_f32, opt_.compute, recv_c_);
  comm_.reduce_scatter_v_async(to_compute(device_view(all, Q_ * width), opt_.compute, send_c_), mine_c,
                               row_counts(width), ReduceOp::sum, opt_.collectives)->wait();
  from_compute(mine_c, mine_f32);
}

std::vector<std::size_t> SplitKVLayer::row_counts(std::int64_t width) const {
  std::vector<std::size_t> c;
  for (std::int64_t rows : shard_.query_rows) c.push_back(static_cast<std::size_t>(rows * width));
  return c;
}

double SplitKVLayer::predicted_bytes_per_layer() const {
  return splitkv_bytes_per_layer(cfg_, opt_.compute, Q_, shard_.P, opt_.oproj == OProj::owned, lse_all_reduces(comm_),
                                 hier_ ? comm_.topology().nodes() : 0);
}

double SplitKVLayer::predicted_inter_bytes_per_layer() const {
  const Topology& t = comm_.topology();
  const int P = shard_.P;
  const double Q = static_cast<double>(Q_), qw = static_cast<double>(cfg_.q_width());
  const double w = static_cast<double>(opt_.oproj == OProj::owned ? cfg_.q_width() : cfg_.hidden);
  const std::int64_t n = Q_ * cfg_.n_q;
  const double e = static_cast<double>(dtype_size(opt_.compute)), stat = 4;  // rows: compute dtype; lse, D: f32
  const double reduces = lse_all_reduces(comm_) + 1;                   // lse all-reduce(s), then D
  if (hier_) {
    const double N = t.nodes();
    return (e * (N - 1) * (2 * Q * qw + 2 * Q * w) + stat * reduces * 2 * static_cast<double>(n) * (N - 1)) / P;
  }
  double rows = 0, reduce = 0, merge = 0;
  auto share = [&](int r) { return static_cast<double>(n / P + (r < n % P ? 1 : 0)); };
  for (int r = 0; r < P; ++r) {
    const double off_node = P - t.node_size(t.node_of[static_cast<std::size_t>(r)]);
    const double Qr = static_cast<double>(shard_.query_rows[static_cast<std::size_t>(r)]);
    rows += Qr * (2 * qw + 2 * w) * off_node;
    merge += Qr * 3 * static_cast<double>(cfg_.n_q) * off_node;  // owner merge: lse to r, r's [lse | D] to all
    for (int o = 0; o < P; ++o)
      if (!t.same_node(r, o)) reduce += share(o) + share(r);
  }
  return (e * rows + stat * (merge_ ? merge : reduces * reduce)) / P;
}

void SplitKVLayer::forward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                                float* y_p) {
  using Params = AttnLayerParams;
  Saved& st = static_cast<Saved&>(state);  // made by new_state(): CpAttentionLayer checked the owner
  const DType c = opt_.compute;
  const std::int64_t H = cfg_.hidden, qw = cfg_.q_width(), d = cfg_.d_h, Qp = own_.Qp();

  // 1. Local queries, normed and rotated, then launch their all-gather (rows of the compute dtype).
  own_.project_q(w, x_p, st.own);
  const TensorView q_all = buffer(st.q_all, Q_ * qw);
  WorkPtr ag = comm_.all_gather_v_async(to_compute(st.own.q.view(), c, q_p_), q_all, row_counts(qw), opt_.collectives);

  // 2. Local keys/values of [ctx_p; X_p] while the all-gather flies (polled between row chunks).
  own_.project_kv(w, x_p, ctx_p, st.own, ag.get());
  auto tw = CpClock::now();
  ag->wait();
  timings_.fwd_overlap_exposed_ms = elapsed_ms(tw);

  // 3. Attention over local keys: this rank's partial (o, lse) of every query row.
  const std::int64_t Lk = own_.Lk(), kvw = cfg_.kv_width(), n_q = cfg_.n_q, n_kv = cfg_.n_kv;
  float* lse_p = buffer(lse_p_, Q_ * n_q);
  st.kv = to_compute(st.own.kv.view(), c, st.kv_c);  // [2, L_k, kvw]: k rows, then v rows
  // [Q, n_q d_h] partial output: straight to the owner merge's all-to-all, or saved (f32) for the
  // backward's D.
  const TensorView obar_c = merge_ ? buffer(obar_c_, Q_ * qw) : compute_out(device_view(buffer(st.obar, Q_ * qw), Q_ * qw), c, obar_c_);
  attention_forward(*mask_, head_view(q_all, Q_, n_q, d), head_view(st.kv, Lk, n_kv, d),
                    head_view(st.kv, Lk, n_kv, d, Lk * kvw), head_view(obar_c, Q_, n_q, d), lse_p_);
  if (!merge_) from_compute(obar_c, st.obar.view());

  float* o_p = st.own.o.data();  // [Q_p, n_q d_h], sized by project_q; used with oproj owned
  if (merge_) {
    // 4. Owner merge: every row's P partials (o in the compute dtype, lse in f32) go to the row's
    //    owner in one all-to-all; the owner merges them in rank order (attention/merge.hpp).
    const int nP = shard_.P;
    const std::vector<std::size_t> recv_o(static_cast<std::size_t>(nP), static_cast<std::size_t>(Qp * qw));
    const std::vector<std::size_t> recv_l(static_cast<std::size_t>(nP), static_cast<std::size_t>(Qp * n_q));
    float* parts = buffer(parts_, nP * Qp * qw);
    float* lse_parts = buffer(lse_parts_, nP * Qp * n_q);
    const TensorView parts_c = compute_out(parts_.view(), c, recv_c_);
    tw = CpClock::now();
    WorkPtr a2a_o = comm_.all_to_all_v_async(obar_c, row_counts(qw), parts_c, recv_o);
    WorkPtr a2a_l = comm_.all_to_all_v_async(lse_p_.view(), row_counts(n_q), lse_parts_.view(), recv_l);
    a2a_o->wait();
    a2a_l->wait();
    timings_.blocking_comm_ms += elapsed_ms(tw);
    from_compute(parts_c, parts_.view());
    std::vector<HeadRows<const float>> o_parts;
    std::vector<std::span<const float>> l_parts;
    for (int r = 0; r < nP; ++r) {
      o_parts.push_back(head_view<const float>(parts + r * Qp * qw, Qp, n_q, d));
      l_parts.emplace_back(lse_parts + r * Qp * n_q, static_cast<std::size_t>(Qp * n_q));
    }
    lse_merge(o_parts, l_parts, head_view(o_p, Qp, n_q, d), std::span<float>(buffer(st.lse, Qp * n_q), Qp * n_q));
    linear_forward(o_p, Qp, qw, w[Params::wo], H, y_p);
  } else {
    // 4. The global log-sum-exp and the rescaled local output; then
    //    oproj all: output projection of all Q rows' partial output, reduce-scatter to the owners;
    //    oproj owned (hierarchical collectives): reduce-scatter the partial output, project the owned rows.
    float* obar = st.obar.data();
    device_copy(buffer(st.lse, Q_ * n_q), lse_p, Q_ * n_q);
    tw = CpClock::now();
    all_reduce_lse(comm_, st.lse, opt_.collectives);
    timings_.blocking_comm_ms += elapsed_ms(tw);
    lse_rescale(head_view(obar, Q_, n_q, d), lse_p_, st.lse);
    if (opt_.oproj == OProj::all) {
      float* ybar = buffer(ybar_, Q_ * H);
      linear_forward(obar, Q_, qw, w[Params::wo], H, ybar);
      tw = CpClock::now();
      reduce_scatter_rows(ybar, H, y_p);
      timings_.blocking_comm_ms += elapsed_ms(tw);
    } else {
      tw = CpClock::now();
      reduce_scatter_rows(obar, qw, o_p);
      timings_.blocking_comm_ms += elapsed_ms(tw);
      linear_forward(o_p, Qp, qw, w[Params::wo], H, y_p);
    }
  }
  bias_add(y_p, Qp, H, w[Params::bo]);
}

void SplitKVLayer::backward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                                 const float* dy_p, float* dx_p, float* dctx_p, AttnLayerParams& grad) {
  using Params = AttnLayerParams;
  Saved& st = static_cast<Saved&>(state);
  const DType c = opt_.compute;
  const std::int64_t H = cfg_.hidden, qw = cfg_.q_width(), kvw = cfg_.kv_width(), d = cfg_.d_h;
  const std::int64_t Qp = own_.Qp(), Lk = own_.Lk(), n_q = cfg_.n_q, n_kv = cfg_.n_kv;

  // 1. oproj all: gather dY; do = g W_o^T and this rank's share of dW_o = obar_p^T g (sums to o^T g).
  //    oproj owned: do_p = dY_p W_o^T and dW_o share o_p^T dY_p locally, then gather do.
  bias_backward(dy_p, Qp, H, grad[Params::bo]);
  ConstTensorView dout_c;      // [Q, n_q d_h] do in the compute dtype, as the attention backward reads it
  float* lse = st.lse.data();  // [Q, n_q] the global lse (the owner merge gathers it below)
  auto tw = CpClock::now();
  if (merge_) {
    // 2. Owner merge: the owner holds its rows' merged o_p and lse_p, so D_p = rowsum(do_p * o_p) is
    //    local; do (compute dtype) and [lse_p | D_p] (f32) are gathered together. do travels and
    //    enters the kernel rounded to the compute dtype: D of the same rounded rows.
    float* dout_p = buffer(g_, Qp * qw);
    linear_backward_input(dy_p, Qp, H, w[Params::wo], qw, dout_p);
    linear_backward_weight(st.own.o.data(), Qp, qw, dy_p, H, grad[Params::wo]);
    const ConstTensorView dout_p_c = to_compute(g_.view(), c, send_c_);
    from_compute(dout_p_c, g_.view());
    float* stats_p = buffer(stats_p_, Qp * 2 * n_q);  // [Q_p, 2, n_q]: lse row, then D row
    float* delta_p = buffer(delta_, Qp * n_q);
    attention_delta(head_view<const float>(dout_p, Qp, n_q, d), head_view<const float>(st.own.o.data(), Qp, n_q, d),
                    std::span<float>(delta_p, static_cast<std::size_t>(Qp * n_q)));
    convert_rows(st.lse.data(), DType::f32, n_q, stats_p, DType::f32, 2 * n_q, Qp, n_q);
    convert_rows(delta_p, DType::f32, n_q, stats_p + n_q, DType::f32, 2 * n_q, Qp, n_q);
    float* stats = buffer(stats_all_, Q_ * 2 * n_q);
    const TensorView dout_all = buffer(dout_c_, Q_ * qw);
    tw = CpClock::now();
    WorkPtr ag_do = comm_.all_gather_v_async(dout_p_c, dout_all, row_counts(qw), opt_.collectives);
    WorkPtr ag_stats = comm_.all_gather_v_async(stats_p_.view(), stats_all_.view(), row_counts(2 * n_q), opt_.collectives);
    ag_do->wait();
    ag_stats->wait();
    timings_.blocking_comm_ms += elapsed_ms(tw);
    dout_c = dout_all;
    lse = buffer(lse_all_, Q_ * n_q);
    buffer(delta_, Q_ * n_q);
    convert_rows(stats, DType::f32, 2 * n_q, lse, DType::f32, n_q, Q_, n_q);
    convert_rows(stats + n_q, DType::f32, 2 * n_q, delta_.data(), DType::f32, n_q, Q_, n_q);
  } else {
    float* dout = buffer(dout_, Q_ * qw);  // [Q, n_q d_h] f32 do
    if (opt_.oproj == OProj::all) {
      float* g = buffer(g_, Q_ * H);
      gather_rows(dy_p, H, g);
      timings_.blocking_comm_ms += elapsed_ms(tw);
      linear_backward_input(g, Q_, H, w[Params::wo], qw, dout);
      linear_backward_weight(st.obar.data(), Q_, qw, g, H, grad[Params::wo]);
    } else {
      float* dout_p = buffer(g_, Qp * qw);
      linear_backward_input(dy_p, Qp, H, w[Params::wo], qw, dout_p);
      linear_backward_weight(st.own.o.data(), Qp, qw, dy_p, H, grad[Params::wo]);
      tw = CpClock::now();
      gather_rows(dout_p, qw, dout);
      timings_.blocking_comm_ms += elapsed_ms(tw);
    }
    // 2. D = rowsum(do * o) needs the global output: sum the per-rank partials.
    buffer(delta_, Q_ * n_q);
    attention_delta(head_view(dout, Q_, n_q, d), head_view(st.obar.data(), Q_, n_q, d), delta_);
    tw = CpClock::now();
    comm_.all_reduce_async(delta_.view(), ReduceOp::sum, opt_.collectives)->wait();
    timings_.blocking_comm_ms += elapsed_ms(tw);
    dout_c = to_compute(dout_.view(), c, dout_c_);
  }
  const std::span<const float> lse_all(lse, static_cast<std::size_t>(Q_ * n_q));

  // 3. Local attention backward with the global lse and D; launch the dq reduce-scatter.
  buffer(dkv_, 2 * Lk * kvw);  // [2, L_k, kvw]: dk rows, then dv rows
  buffer(dq_p_, Qp * qw);
  const TensorView dq_c = buffer(dq_c_, Q_ * qw), dkv_c = compute_out(dkv_.view(), c, dkv_c_);
  attention_backward(*mask_, head_view(st.q_all.view(), Q_, n_q, d), head_view(st.kv, Lk, n_kv, d),
                     head_view(st.kv, Lk, n_kv, d, Lk * kvw), head_view(dout_c, Q_, n_q, d), lse_all, delta_,
                     head_view(dq_c, Q_, n_q, d), head_view(dkv_c, Lk, n_kv, d), head_view(dkv_c, Lk, n_kv, d, Lk * kvw));
  const TensorView dq_p_c = compute_out(dq_p_.view(), c, dq_p_c_);
  WorkPtr rs = comm_.reduce_scatter_v_async(dq_c, dq_p_c, row_counts(qw), ReduceOp::sum, opt_.collectives);
  from_compute(dkv_c, dkv_.view());

  // 4. K/V projection backward (real rows only) while dq travels (polled); dk, dv stay on this rank.
  own_.backward_kv(w, st.own, x_p, ctx_p, dkv_.data(), dx_p, 0.f, dctx_p, grad, rs.get());
  tw = CpClock::now();
  rs->wait();
  timings_.bwd_overlap_exposed_ms = elapsed_ms(tw);
  from_compute(dq_p_c, dq_p_.view());

  // 5. Query projection backward: RoPE^-1, RMSNorm_q backward, then dX_p += dq_lin W_q^T.
  own_.backward_q(w, st.own, x_p, dq_p_.data(), dx_p, 1.f, grad);
}

}  // namespace diffcp
