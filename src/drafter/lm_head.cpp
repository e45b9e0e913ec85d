#include "diffcp/drafter/lm_head.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "diffcp/core/error.hpp"
#include "diffcp/ops/linear.hpp"
#include "diffcp/ops/loss.hpp"

namespace diffcp {

namespace {
constexpr std::int64_t kChunkValues = std::int64_t{1} << 25;  // logits held at once: 128 MB of f32

// rows [at, at + n) of p as a span
template <typename T>
std::span<T> span_of(T* p, std::int64_t at, std::int64_t n) {
  return std::span<T>(p + at, static_cast<std::size_t>(n));
}
}  // namespace

std::pair<std::int64_t, std::int64_t> vocab_slice(std::int64_t V, int G, int r) {
  return {V * r / G, V * (r + 1) / G};
}

LmHead::LmHead(Communicator* group, std::int64_t H, std::int64_t V, std::span<const float> w, std::int64_t v0)
    : LmHead(group, H, V, v0, v0 + (H >= 1 ? static_cast<std::int64_t>(w.size()) / H : 0),
             [&](std::int64_t c0, std::int64_t c1, float* out) {
               const std::int64_t n = static_cast<std::int64_t>(w.size()) / H;
               for (std::int64_t h = 0; h < H; ++h)
                 std::copy_n(w.begin() + h * n + (c0 - v0), c1 - c0, out + h * (c1 - c0));
             }) {
  DIFFCP_CHECK(static_cast<std::int64_t>(w.size()) % H == 0, "LM head: ", w.size(), " values are not [H = ", H, ", columns]");
}

LmHead::LmHead(Communicator* group, std::int64_t H, std::int64_t V, std::int64_t v0, std::int64_t v1,
               const Columns& columns)
    : group_(group != nullptr && group->size() > 1 ? group : nullptr), H_(H), V_(V), v0_(v0), v1_(v1) {
  DIFFCP_CHECK(H >= 1 && v0_ < v1_, "LM head: H = ", H, ", columns [", v0_, ", ", v1_, "): expected H >= 1 and columns");
  DIFFCP_CHECK(v0_ >= 0 && v1_ <= V && (group_ != nullptr || (v0_ == 0 && v1_ == V)), "LM head: columns [", v0_, ", ", v1_,
               ") of a vocabulary of ", V, group_ == nullptr ? " without a group holding the rest" : "");
  const std::int64_t n = v1_ - v0_, step = std::max<std::int64_t>(1, (std::int64_t{1} << 20) / H);
  w_.resize(H * n);
  std::vector<float> slice;        // host: [H, c1 - c0]
  DeviceVector<float> slice_dev;   // the same, uploaded, then copied into its columns of w_
  for (std::int64_t c0 = v0_; c0 < v1_; c0 += step) {
    const std::int64_t c1 = std::min(v1_, c0 + step), m = H * (c1 - c0);
    slice.resize(static_cast<std::size_t>(m));
    columns(c0, c1, slice.data());
    slice_dev.assign(slice);
    convert_rows(slice_dev.data(), DType::f32, c1 - c0, w_.data() + (c0 - v0_), DType::f32, n, H, c1 - c0);
  }
}

void LmHead::logits(const float* hf, std::int64_t rows) {
  linear_forward(hf, rows, H_, w_.data(), v1_ - v0_, lg_.data());
  logit_map(lg_.data(), rows, v1_ - v0_, map_);
}

void LmHead::run(const float* hf, std::int64_t Qp, const std::int32_t* target, const double* weight, double* ce,
                 std::int32_t* argmax, bool backward, float* dhf) {
  if (group_ != nullptr || !backward) {
    forward(hf, Qp, target, weight, ce, argmax);
    if (backward) this->backward(dhf);
    else release();
    return;
  }
  // The whole head with its backward: one pass (the dlogits from the statistics' own row).
  Qp_ = Qp;
  const std::int64_t n = v1_ - v0_, R = rows_per_chunk();
  lg_.resize(std::min(R, Qp) * n);
  std::vector<double> st(static_cast<std::size_t>(4 * std::min(R, Qp)));
  for (std::int64_t a = 0; a < Qp; a += R) {
    const std::int64_t rows = std::min(R, Qp - a);
    logits(hf + a * H_, rows);
    const std::span<double> stats(st.data(), static_cast<std::size_t>(4 * rows));
    cross_entropy(lg_.data(), rows, n, 0, span_of(target, a, rows), stats, span_of(weight, a, rows), map_);
    for (std::int64_t i = 0; i < rows; ++i) {
      const double* s = stats.data() + 4 * i;
      ce[a + i] = s[0] + std::log(s[1]) - s[3];
      argmax[a + i] = static_cast<std::int32_t>(s[2]);
    }
    linear_backward_input(lg_.data(), rows, n, w_.data(), H_, dhf + a * H_);
  }
  release();
}

void LmHead::forward(const float* hf, std::int64_t Qp, const std::int32_t* target, const double* weight, double* ce,
                     std::int32_t* argmax, std::int64_t K, std::span<float> top_values, std::span<std::int32_t> top_ids) {
  const std::int64_t n = v1_ - v0_, H = H_;
  DIFFCP_CHECK(K >= 0 && K <= V_ && static_cast<std::int64_t>(top_values.size()) == Qp * K &&
                   top_ids.size() == top_values.size(),
               "LM head: ", K, " candidates per row of ", Qp, " rows into ", top_values.size(), " values and ",
               top_ids.size(), " ids: expected [Q_p, K] each with K <= the vocabulary (", V_, ")");
  Qp_ = Qp, K_ = K;
  std::vector<std::int64_t> q{Qp};
  const int G = group_ != nullptr ? group_->size() : 1, me = group_ != nullptr ? group_->rank() : 0;
  if (group_ != nullptr) {  // every rank's rows, targets and weights
    q.resize(static_cast<std::size_t>(G));
    group_->all_gather<std::int64_t>(std::vector<std::int64_t>{Qp}, q);
  }
  rows_of_.assign(static_cast<std::size_t>(G), 0);
  std::vector<std::size_t> vals_of(rows_of_.size());
  Q_ = 0, off_ = 0;
  for (int r = 0; r < G; ++r) {
    rows_of_[static_cast<std::size_t>(r)] = static_cast<std::size_t>(q[static_cast<std::size_t>(r)]);
    vals_of[static_cast<std::size_t>(r)] = static_cast<std::size_t>(q[static_cast<std::size_t>(r)] * H);
    if (r < me) off_ += q[static_cast<std::size_t>(r)];
    Q_ += q[static_cast<std::size_t>(r)];
  }
  const std::int64_t Q = Q_;
  t_all_.resize(static_cast<std::size_t>(Q));
  w_all_.resize(static_cast<std::size_t>(Q));
  if (group_ != nullptr) {
    Communicator& g = *group_;
    hf_all_.resize(Q * H);
    g.all_gather_v_async(hf, hf_all_.data(), vals_of, DType::f32)->wait();
    g.all_gather_v<std::int32_t>(std::span<const std::int32_t>(target, static_cast<std::size_t>(Qp)), t_all_, rows_of_);
    g.all_gather_v<double>(std::span<const double>(weight, static_cast<std::size_t>(Qp)), w_all_, rows_of_);
    hf_ = hf_all_.data();
  } else {
    std::copy_n(target, Qp, t_all_.begin());
    std::copy_n(weight, Qp, w_all_.begin());
    hf_ = hf;
  }
  // Per chunk: this slice's statistics of every row, and its K best (min(K, n) of them; the rest
  // of the row's K padded with NaN values of id INT32_MAX, which rank after every candidate).
  const std::int64_t R = rows_per_chunk(), k = std::min(K, n);
  std::vector<double> mine(static_cast<std::size_t>(Q * 4));
  std::vector<float> top_v(static_cast<std::size_t>(Q * K), std::numeric_limits<float>::quiet_NaN());
  std::vector<std::int32_t> top_i(top_v.size(), std::numeric_limits<std::int32_t>::max());
  std::vector<float> chunk_v;
  std::vector<std::int32_t> chunk_i;
  lg_.resize(std::min(R, Q) * n);
  for (std::int64_t a = 0; a < Q; a += R) {
    const std::int64_t rows = std::min(R, Q - a);
    logits(hf_ + a * H, rows);
    cross_entropy(lg_.data(), rows, n, v0_, span_of(t_all_.data(), a, rows), span_of(mine.data(), 4 * a, 4 * rows));
    if (K == 0) continue;
    chunk_v.resize(static_cast<std::size_t>(rows * k));
    chunk_i.resize(chunk_v.size());
    top_k(lg_.data(), rows, n, v0_, chunk_v, chunk_i);
    for (std::int64_t i = 0; i < rows; ++i) {
      std::copy_n(chunk_v.begin() + i * k, k, top_v.begin() + (a + i) * K);
      std::copy_n(chunk_i.begin() + i * k, k, top_i.begin() + (a + i) * K);
    }
  }
  std::vector<double> all(static_cast<std::size_t>(Q * 4 * G));
  std::vector<float> all_v(static_cast<std::size_t>(Q * K * G));
  std::vector<std::int32_t> all_i(all_v.size());
  if (group_ != nullptr) {
    group_->all_gather<double>(mine, all);
    if (K > 0) {
      group_->all_gather<float>(top_v, all_v);
      group_->all_gather<std::int32_t>(top_i, all_i);
    }
  } else {
    all = std::move(mine);
    all_v = std::move(top_v);
    all_i = std::move(top_i);
  }
  lse_.resize(static_cast<std::size_t>(Q));
  for (std::int64_t i = 0; i < Q; ++i) {  // combine in rank order (O(Q) host statistics)
    double M = -INFINITY, S = 0, tgt = 0, idx = 0;
    for (int r = 0; r < G; ++r) {
      const double* st = all.data() + (static_cast<std::int64_t>(r) * Q + i) * 4;
      if (st[0] > M) M = st[0], idx = st[2];  // strict: the lowest rank (lowest ids) wins ties
    }
    for (int r = 0; r < G; ++r) {
      const double* st = all.data() + (static_cast<std::int64_t>(r) * Q + i) * 4;
      S += st[1] * std::exp(st[0] - M);
      tgt += st[3];
    }
    lse_[static_cast<std::size_t>(i)] = M + std::log(S);
    if (i >= off_ && i < off_ + Qp) {
      ce[i - off_] = lse_[static_cast<std::size_t>(i)] - tgt;
      argmax[i - off_] = static_cast<std::int32_t>(idx);
    }
  }
  // The candidates of this rank's rows: the K best of the ranks' K best (rank r's at [r][Q][K]).
  std::vector<std::pair<float, std::int32_t>> pool(static_cast<std::size_t>(G * K));
  for (std::int64_t i = 0; K > 0 && i < Qp; ++i) {
    for (int r = 0; r < G; ++r)
      for (std::int64_t j = 0; j < K; ++j) {
        const auto at = static_cast<std::size_t>((static_cast<std::int64_t>(r) * Q + off_ + i) * K + j);
        pool[static_cast<std::size_t>(r * K + j)] = {all_v[at], all_i[at]};
      }
    std::partial_sort(pool.begin(), pool.begin() + K, pool.end(),
                      [](const auto& a, const auto& b) { return logit_ranks_before(a.first, a.second, b.first, b.second); });
    for (std::int64_t j = 0; j < K; ++j) {
      top_values[static_cast<std::size_t>(i * K + j)] = pool[static_cast<std::size_t>(j)].first;
      top_ids[static_cast<std::size_t>(i * K + j)] = pool[static_cast<std::size_t>(j)].second;
    }
  }
}

void LmHead::backward(float* dhf, SparseLogitGrad extra) {
  const std::int64_t n = v1_ - v0_, H = H_, Q = Q_, K = K_;
  DIFFCP_CHECK(static_cast<std::int64_t>(extra.ids.size()) == (K > 0 ? Qp_ * K : 0) && extra.grad.size() == extra.ids.size(),
               "LM head backward: ", extra.ids.size(), " extra ids, ", extra.grad.size(), " gradients; expected ",
               K > 0 ? Qp_ * K : 0, " each (forward's rows x its K)");
  std::vector<std::int32_t> ids(extra.ids.begin(), extra.ids.end());
  std::vector<double> grad(extra.grad.begin(), extra.grad.end());
  DeviceVector<float> dhf_all;  // [Q, H]: the group's rows' gradients, reduce-scattered to their owners
  if (group_ != nullptr) {
    if (K > 0) {
      std::vector<std::size_t> k_of(rows_of_.size());
      for (std::size_t r = 0; r < k_of.size(); ++r) k_of[r] = rows_of_[r] * static_cast<std::size_t>(K);
      ids.resize(static_cast<std::size_t>(Q * K));
      grad.resize(ids.size());
      group_->all_gather_v<std::int32_t>(extra.ids, ids, k_of);
      group_->all_gather_v<double>(extra.grad, grad, k_of);
    }
    dhf_all.resize(Q * H);
  }
  float* out = group_ != nullptr ? dhf_all.data() : dhf;
  const std::int64_t R = rows_per_chunk();
  for (std::int64_t a = 0; a < Q; a += R) {
    const std::int64_t rows = std::min(R, Q - a);
    logits(hf_ + a * H, rows);
    cross_entropy_backward(lg_.data(), rows, n, v0_, span_of(t_all_.data(), a, rows), span_of(w_all_.data(), a, rows),
                           span_of(lse_.data(), a, rows), map_,
                           {span_of(ids.data(), a * K, rows * K), span_of(grad.data(), a * K, rows * K)});
    linear_backward_input(lg_.data(), rows, n, w_.data(), H, out + a * H);
  }
  if (group_ != nullptr) {
    std::vector<std::size_t> vals_of(rows_of_.size());
    for (std::size_t r = 0; r < vals_of.size(); ++r) vals_of[r] = rows_of_[r] * static_cast<std::size_t>(H);
    group_->reduce_scatter_v_async(dhf_all.data(), dhf, vals_of, DType::f32, ReduceOp::sum)->wait();
  }
  release();
}

void LmHead::release() {
  lg_ = {};
  hf_all_ = {};
  hf_ = nullptr;
}

// Rows of logits per chunk: ~32 M values, at least 8, at most this rank's rows (at least 8).
std::int64_t LmHead::rows_per_chunk() const {
  return std::clamp<std::int64_t>(kChunkValues / (v1_ - v0_), 8, std::max<std::int64_t>(Qp_, 8));
}

}  // namespace diffcp
