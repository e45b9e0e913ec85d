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
  DIFFCP_FAIL("--oproj = '", name, "': expected all, owned or auto");
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

void SplitKVLayer::gather_rows(const float* mine, std::int64_t width, float* all) {
  const std::int64_t Qp = own_.Qp();
  if (opt_.compute == DType::f32) {
    comm_.all_gather_v_async(mine, all, row_counts(width), DType::f32, opt_.collectives)->wait();
    return;
  }
  convert(mine, buffer(send16_, Qp * width), Qp * width);
  comm_.all_gather_v_async(send16_.data(), buffer(recv16_, Q_ * width), row_counts(width), DType::bf16,
                           opt_.collectives)->wait();
  convert(recv16_.data(), all, Q_ * width);
}

void SplitKVLayer::reduce_scatter_rows(const float* all, std::int64_t width, float* mine) {
  const std::int64_t Qp = own_.Qp();
  if (opt_.compute == DType::f32) {
    comm_.reduce_scatter_v_async(all, mine, row_counts(width), DType::f32, ReduceOp::sum, opt_.collectives)->wait();
    return;
  }
  convert(all, buffer(send16_, Q_ * width), Q_ * width);
  comm_.reduce_scatter_v_async(send16_.data(), buffer(recv16_, Qp * width), row_counts(width), DType::bf16,
                               ReduceOp::sum, opt_.collectives)->wait();
  convert(recv16_.data(), mine, Qp * width);
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
  const ScopedF32GemmCompute precision(opt_.compute);  // bf16: the projections' GEMMs too
  const auto t0 = CpClock::now();
  const std::int64_t H = cfg_.hidden, qw = cfg_.q_width(), d = cfg_.d_h, Qp = own_.Qp();

  // 1. Local queries, normed and rotated, then launch their all-gather (bf16 mode: of bf16 rows).
  const bool bf = opt_.compute == DType::bf16;
  own_.project_q(w, x_p, st.own);
  float* q_all = nullptr;
  WorkPtr ag;
  if (bf) {
    bf16_t* q16 = buffer(q16_p_, Qp * qw);
    convert(st.own.q.data(), q16, Qp * qw);
    ag = comm_.all_gather_v_async(q16, buffer(st.q_all16, Q_ * qw), row_counts(qw), DType::bf16, opt_.collectives);
  } else {
    q_all = buffer(st.q_all, Q_ * qw);
    ag = comm_.all_gather_v_async(st.own.q.data(), q_all, row_counts(qw), DType::f32, opt_.collectives);
  }

  // 2. Local keys/values of [ctx_p; X_p] while the all-gather flies (polled between row chunks).
  own_.project_kv(w, x_p, ctx_p, st.own, ag.get());
  auto tw = CpClock::now();
  ag->wait();
  timings_.fwd_overlap_exposed_ms = elapsed_ms(tw);

  // 3. Attention over local keys: this rank's partial (o, lse) of every query row.
  const std::int64_t Lk = own_.Lk(), kvw = cfg_.kv_width(), n_q = cfg_.n_q;
  float* lse_p = buffer(lse_p_, Q_ * n_q);
  // [Q, n_q d_h] f32 partial output: saved for the backward's D unless the owner merge runs.
  float* obar = merge_ ? (bf ? nullptr : buffer(obar_, Q_ * qw)) : buffer(st.obar, Q_ * qw);
  bf16_t* obar16 = bf ? buffer(obar16_, Q_ * qw) : nullptr;
  if (bf) {
    bf16_t* kv16 = buffer(st.kv16, 2 * Lk * kvw);
    convert(st.own.kv.data(), kv16, 2 * Lk * kvw);
    attention_forward(*mask_, head_view(st.q_all16.data(), Q_, n_q, d), head_view(kv16, Lk, cfg_.n_kv, d),
                      head_view(kv16 + Lk * kvw, Lk, cfg_.n_kv, d), head_view(obar16, Q_, n_q, d), lse_p_);
    if (!merge_) convert(obar16, obar, Q_ * qw);
  } else {
    attention_forward(*mask_, head_view(q_all, Q_, n_q, d), own_.k_view(st.own), own_.v_view(st.own),
                      head_view(obar, Q_, n_q, d), lse_p_);
  }

  float* o_p = st.own.o.data();  // [Q_p, n_q d_h], sized by project_q; used with oproj owned
  if (merge_) {
    // 4. Owner merge: every row's P partials (o in the compute dtype, lse in f32) go to the row's
    //    owner in one all-to-all; the owner merges them in rank order (attention/merge.hpp).
    const int nP = shard_.P;
    const std::vector<std::size_t> recv_o(static_cast<std::size_t>(nP), static_cast<std::size_t>(Qp * qw));
    const std::vector<std::size_t> recv_l(static_cast<std::size_t>(nP), static_cast<std::size_t>(Qp * n_q));
    float* parts = buffer(parts_, nP * Qp * qw);
    float* lse_parts = buffer(lse_parts_, nP * Qp * n_q);
    tw = CpClock::now();
    WorkPtr a2a_o = bf ? comm_.all_to_all_v_async(obar16, row_counts(qw), buffer(recv16_, nP * Qp * qw), recv_o,
                                                  DType::bf16)
                       : comm_.all_to_all_v_async(obar, row_counts(qw), parts, recv_o, DType::f32);
    WorkPtr a2a_l = comm_.all_to_all_v_async(lse_p, row_counts(n_q), lse_parts, recv_l, DType::f32);
    a2a_o->wait();
    a2a_l->wait();
    timings_.blocking_comm_ms += elapsed_ms(tw);
    if (bf) convert(recv16_.data(), parts, nP * Qp * qw);
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
  timings_.fwd_ms = elapsed_ms(t0);
}

void SplitKVLayer::backward_impl(CpSavedState& state, const AttnLayerParams& w, const float* x_p, const float* ctx_p,
                                 const float* dy_p, float* dx_p, float* dctx_p, AttnLayerParams& grad) {
  using Params = AttnLayerParams;
  Saved& st = static_cast<Saved&>(state);
  const ScopedF32GemmCompute precision(opt_.compute);
  const auto t0 = CpClock::now();
  const std::int64_t H = cfg_.hidden, qw = cfg_.q_width(), kvw = cfg_.kv_width(), d = cfg_.d_h;
  const std::int64_t Qp = own_.Qp(), Lk = own_.Lk();

  // 1. oproj all: gather dY; do = g W_o^T and this rank's share of dW_o = obar_p^T g (sums to o^T g).
  //    oproj owned: do_p = dY_p W_o^T and dW_o share o_p^T dY_p locally, then gather do.
  const bool bf = opt_.compute == DType::bf16;
  const std::int64_t n_q = cfg_.n_q;
  bias_backward(dy_p, Qp, H, grad[Params::bo]);
  float* dout = bf && merge_ ? nullptr : buffer(dout_, Q_ * qw);        // [Q, n_q d_h] f32 do
  bf16_t* dout16 = bf ? buffer(dout16_, Q_ * qw) : nullptr;            // [Q, n_q d_h] bf16 do
  float* lse = st.lse.data();  // [Q, n_q] the global lse (the owner merge gathers it below)
  auto tw = CpClock::now();
  if (merge_) {
    // 2. Owner merge: the owner holds its rows' merged o_p and lse_p, so D_p = rowsum(do_p * o_p) is
    //    local; do (compute dtype) and [lse_p | D_p] (f32) are gathered together.
    float* dout_p = buffer(g_, Qp * qw);
    linear_backward_input(dy_p, Qp, H, w[Params::wo], qw, dout_p);
    linear_backward_weight(st.own.o.data(), Qp, qw, dy_p, H, grad[Params::wo]);
    if (bf) {  // do travels and enters the kernel rounded to bf16: D of the same rounded rows
      convert(dout_p, buffer(send16_, Qp * qw), Qp * qw);
      convert(send16_.data(), dout_p, Qp * qw);
    }
    float* stats_p = buffer(stats_p_, Qp * 2 * n_q);  // [Q_p, 2, n_q]: lse row, then D row
    float* delta_p = buffer(delta_, Qp * n_q);
    attention_delta(head_view<const float>(dout_p, Qp, n_q, d), head_view<const float>(st.own.o.data(), Qp, n_q, d),
                    std::span<float>(delta_p, static_cast<std::size_t>(Qp * n_q)));
    convert_rows(st.lse.data(), DType::f32, n_q, stats_p, DType::f32, 2 * n_q, Qp, n_q);
    convert_rows(delta_p, DType::f32, n_q, stats_p + n_q, DType::f32, 2 * n_q, Qp, n_q);
    float* stats = buffer(stats_all_, Q_ * 2 * n_q);
    tw = CpClock::now();
    WorkPtr ag_do;
    if (bf) {
      ag_do = comm_.all_gather_v_async(send16_.data(), dout16, row_counts(qw), DType::bf16, opt_.collectives);
    } else {
      ag_do = comm_.all_gather_v_async(dout_p, dout, row_counts(qw), DType::f32, opt_.collectives);
    }
    WorkPtr ag_stats = comm_.all_gather_v_async(stats_p, stats, row_counts(2 * n_q), DType::f32, opt_.collectives);
    ag_do->wait();
    ag_stats->wait();
    timings_.blocking_comm_ms += elapsed_ms(tw);
    lse = buffer(lse_all_, Q_ * n_q);
    buffer(delta_, Q_ * n_q);
    convert_rows(stats, DType::f32, 2 * n_q, lse, DType::f32, n_q, Q_, n_q);
    convert_rows(stats + n_q, DType::f32, 2 * n_q, delta_.data(), DType::f32, n_q, Q_, n_q);
  } else {
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
    comm_.all_reduce<float>(delta_, ReduceOp::sum, opt_.collectives);
    timings_.blocking_comm_ms += elapsed_ms(tw);
    if (bf) convert(dout, dout16, Q_ * qw);
  }
  const std::span<const float> lse_all(lse, static_cast<std::size_t>(Q_ * n_q));

  // 3. Local attention backward with the global lse and D; launch the dq reduce-scatter.
  float* dkv = buffer(dkv_, 2 * Lk * kvw);  // [2, L_k, kvw]: dk rows, then dv rows
  float* dq_p = buffer(dq_p_, Qp * qw);
  WorkPtr rs;
  if (bf) {
    bf16_t* dq16 = buffer(dq16_, Q_ * qw);
    bf16_t* dkv16 = buffer(dkv16_, 2 * Lk * kvw);
    const bf16_t* kv16 = st.kv16.data();
    attention_backward(*mask_, head_view(st.q_all16.data(), Q_, n_q, d), head_view(kv16, Lk, cfg_.n_kv, d),
                       head_view(kv16 + Lk * kvw, Lk, cfg_.n_kv, d), head_view(dout16, Q_, n_q, d), lse_all,
                       delta_, head_view(dq16, Q_, n_q, d), head_view(dkv16, Lk, cfg_.n_kv, d),
                       head_view(dkv16 + Lk * kvw, Lk, cfg_.n_kv, d));
    rs = comm_.reduce_scatter_v_async(dq16, buffer(dq16_p_, Qp * qw), row_counts(qw), DType::bf16, ReduceOp::sum,
                                      opt_.collectives);
    convert(dkv16, dkv, 2 * Lk * kvw);
  } else {
    float* dq_all = buffer(dq_all_, Q_ * qw);
    attention_backward(*mask_, head_view(st.q_all.data(), Q_, n_q, d), own_.k_view(st.own),
                       own_.v_view(st.own), head_view(dout, Q_, n_q, d), lse_all, delta_,
                       head_view(dq_all, Q_, n_q, d), head_view(dkv, Lk, cfg_.n_kv, d),
                       head_view(dkv + Lk * kvw, Lk, cfg_.n_kv, d));
    rs = comm_.reduce_scatter_v_async(dq_all, dq_p, row_counts(qw), DType::f32, ReduceOp::sum, opt_.collectives);
  }

  // 4. K/V projection backward (real rows only) while dq travels (polled); dk, dv stay on this rank.
  own_.backward_kv(w, st.own, x_p, ctx_p, dkv, dx_p, 0.f, dctx_p, grad, rs.get());
  tw = CpClock::now();
  rs->wait();
  timings_.bwd_overlap_exposed_ms = elapsed_ms(tw);
  if (bf) convert(dq16_p_.data(), dq_p, Qp * qw);

  // 5. Query projection backward: RoPE^-1, RMSNorm_q backward, then dX_p += dq_lin W_q^T.
  own_.backward_q(w, st.own, x_p, dq_p, dx_p, 1.f, grad);
  timings_.bwd_ms = elapsed_ms(t0);
}

}  // namespace diffcp
