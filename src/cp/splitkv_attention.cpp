#include "cp/splitkv_attention.hpp"

#include <numeric>
#include <utility>

#include "attention/attention.hpp"
#include "attention/merge.hpp"

namespace diffcp {

SplitKVAttention::SplitKVAttention(Communicator& comm, const BlockMask& local_mask, std::int64_t n_q,
                                   std::int64_t n_kv, std::int64_t d_h,
                                   std::vector<std::int64_t> query_rows)
    : comm_(comm), mask_(local_mask), n_q_(n_q), n_kv_(n_kv), d_h_(d_h), Q_(local_mask.query_rows()),
      query_rows_(std::move(query_rows)) {
  DIFFCP_CHECK(static_cast<int>(query_rows_.size()) == comm.size(), "split-kv: ", query_rows_.size(),
               " query-row counts for ", comm.size(), " ranks; expected one per rank");
  std::int64_t total = 0;
  for (std::size_t r = 0; r < query_rows_.size(); ++r) {
    DIFFCP_CHECK(query_rows_[r] >= 0 && query_rows_[r] % mask_.block() == 0, "split-kv: rank ", r,
                 " owns ", query_rows_[r], " query rows, expected a non-negative multiple of B = ",
                 mask_.block());
    total += query_rows_[r];
  }
  DIFFCP_CHECK(total == Q_, "split-kv: ranks own ", total, " query rows in all, expected Q = ", Q_);
}

std::vector<std::size_t> SplitKVAttention::counts(std::int64_t per_row) const {
  std::vector<std::size_t> c(query_rows_.size());
  for (std::size_t r = 0; r < c.size(); ++r) c[r] = static_cast<std::size_t>(query_rows_[r] * per_row);
  return c;
}

void SplitKVAttention::forward(HeadRows<const float> q_p, HeadRows<const float> k_p,
                               HeadRows<const float> v_p, HeadRows<float> o_p) {
  const std::int64_t Qp = query_rows_[static_cast<std::size_t>(comm_.rank())], hd = n_q_ * d_h_;
  DIFFCP_CHECK(q_p.rows == Qp && q_p.heads == n_q_ && q_p.dim == d_h_ && q_p.row_stride == hd,
               "split-kv forward: q_p is [", q_p.rows, ", ", q_p.heads, ", ", q_p.dim,
               "] (row stride ", q_p.row_stride, "), expected contiguous [", Qp, ", ", n_q_, ", ", d_h_, "]");
  DIFFCP_CHECK(o_p.rows == Qp && o_p.heads == n_q_ && o_p.dim == d_h_ && o_p.row_stride == hd,
               "split-kv forward: o_p shape mismatch, expected contiguous [", Qp, ", ", n_q_, ", ", d_h_, "]");
  q_.resize(static_cast<std::size_t>(Q_ * hd));
  comm_.all_gather_v_async(q_p.data, q_.data(), counts(hd), DType::f32)->wait();

  std::vector<float> lse_p(static_cast<std::size_t>(Q_ * n_q_));
  obar_.resize(static_cast<std::size_t>(Q_ * hd));
  attention_forward(mask_, head_rows(std::as_const(q_), Q_, n_q_, d_h_), k_p, v_p,
                    head_rows(obar_, Q_, n_q_, d_h_), lse_p);

  // lse = log sum_p exp(lse_p), stably: max first, then the sum of shifted exponentials.
  std::vector<float> lse_max(lse_p), sum_exp(lse_p.size());
  comm_.all_reduce<float>(lse_max, ReduceOp::max);
  lse_shifted_exp(lse_p, lse_max, sum_exp);
  comm_.all_reduce<float>(sum_exp, ReduceOp::sum);
  lse_.resize(lse_p.size());
  lse_finish(lse_max, sum_exp, lse_);
  lse_rescale(head_rows(obar_, Q_, n_q_, d_h_), lse_p, lse_);

  comm_.reduce_scatter_v_async(obar_.data(), o_p.data, counts(hd), DType::f32, ReduceOp::sum)->wait();
  k_ = k_p;
  v_ = v_p;
}

void SplitKVAttention::backward(HeadRows<const float> do_p, HeadRows<float> dq_p, HeadRows<float> dk_p,
                                HeadRows<float> dv_p) {
  DIFFCP_CHECK(!q_.empty() || Q_ == 0, "split-kv backward called before forward");
  const std::int64_t Qp = query_rows_[static_cast<std::size_t>(comm_.rank())], hd = n_q_ * d_h_;
  DIFFCP_CHECK(do_p.rows == Qp && do_p.heads == n_q_ && do_p.dim == d_h_ && do_p.row_stride == hd,
               "split-kv backward: do_p shape mismatch, expected contiguous [", Qp, ", ", n_q_, ", ", d_h_, "]");
  DIFFCP_CHECK(dq_p.rows == Qp && dq_p.heads == n_q_ && dq_p.dim == d_h_ && dq_p.row_stride == hd,
               "split-kv backward: dq_p shape mismatch, expected contiguous [", Qp, ", ", n_q_, ", ", d_h_, "]");
  std::vector<float> dout(static_cast<std::size_t>(Q_ * hd));
  comm_.all_gather_v_async(do_p.data, dout.data(), counts(hd), DType::f32)->wait();

  // D needs the GLOBAL output: sum over ranks of rowsum(do * obar_p).
  std::vector<float> delta(static_cast<std::size_t>(Q_ * n_q_));
  attention_delta(head_rows(std::as_const(dout), Q_, n_q_, d_h_), head_rows(std::as_const(obar_), Q_, n_q_, d_h_),
                  delta);
  comm_.all_reduce<float>(delta, ReduceOp::sum);

  std::vector<float> dq(static_cast<std::size_t>(Q_ * hd));
  attention_backward(mask_, head_rows(std::as_const(q_), Q_, n_q_, d_h_), k_, v_,
                     head_rows(std::as_const(dout), Q_, n_q_, d_h_), lse_, delta,
                     head_rows(dq, Q_, n_q_, d_h_), dk_p, dv_p);
  comm_.reduce_scatter_v_async(dq.data(), dq_p.data, counts(hd), DType::f32, ReduceOp::sum)->wait();
}

}  // namespace diffcp
