#include "diffcp/drafter/lm_head.hpp"

#include <algorithm>
#include <cmath>

#include "diffcp/core/error.hpp"
#include "diffcp/ops/linear.hpp"

namespace diffcp {

namespace {
constexpr std::int64_t kChunkValues = std::int64_t{1} << 25;  // logits held at once: 128 MB of f32

// Per-row statistics of a logits chunk over columns [v0, v0 + n): max, sum exp(l - max), the
// first argmax (global id) and the target's logit (0 when the target is not in the slice).
void row_stats(const float* lg, std::int64_t n, std::int64_t v0, std::int32_t target, double* st) {
  const auto best = std::max_element(lg, lg + n) - lg;
  const double mx = lg[best];
  double sum = 0;
  for (std::int64_t v = 0; v < n; ++v) sum += std::exp(static_cast<double>(lg[v]) - mx);
  st[0] = mx;
  st[1] = sum;
  st[2] = static_cast<double>(v0 + best);
  st[3] = target >= v0 && target < v0 + n ? static_cast<double>(lg[target - v0]) : 0.0;
}

// dlogits in place: w (exp(l - lse) - [v == target]) over columns [v0, v0 + n).
void dlogits(float* lg, std::int64_t n, std::int64_t v0, std::int32_t target, double w, double lse) {
  for (std::int64_t v = 0; v < n; ++v)
    lg[v] = static_cast<float>(w * (std::exp(static_cast<double>(lg[v]) - lse) - (v0 + v == target ? 1.0 : 0.0)));
}
}  // namespace

std::pair<std::int64_t, std::int64_t> vocab_slice(std::int64_t V, int G, int r) {
  return {V * r / G, V * (r + 1) / G};
}

LmHead::LmHead(Communicator* group, std::int64_t H, std::int64_t V, std::vector<float> w, std::int64_t v0)
    : group_(group != nullptr && group->size() > 1 ? group : nullptr), H_(H), V_(V), v0_(v0), w_(std::move(w)) {
  DIFFCP_CHECK(H >= 1 && !w_.empty() && static_cast<std::int64_t>(w_.size()) % H == 0, "LM head: ", w_.size(),
               " values are not [H = ", H, ", columns]");
  v1_ = v0_ + static_cast<std::int64_t>(w_.size()) / H;
  DIFFCP_CHECK(v0_ >= 0 && v1_ <= V && (group_ != nullptr || (v0_ == 0 && v1_ == V)), "LM head: columns [", v0_, ", ", v1_,
               ") of a vocabulary of ", V, group_ == nullptr ? " without a group holding the rest" : "");
}

void LmHead::run(const float* hf, std::int64_t Qp, const std::int32_t* target, const double* weight, double* ce,
                 std::int32_t* argmax, bool backward, float* dhf) {
  const std::int64_t n = v1_ - v0_, H = H_;
  const std::int64_t R = std::clamp<std::int64_t>(kChunkValues / n, 8, std::max<std::int64_t>(Qp, 8));
  if (group_ == nullptr) {  // the whole head: one pass
    std::vector<float> lg(static_cast<std::size_t>(std::min(R, Qp) * n));
    for (std::int64_t a = 0; a < Qp; a += R) {
      const std::int64_t rows = std::min(R, Qp - a);
      linear_forward(hf + a * H, rows, H, w_.data(), n, lg.data());
      for (std::int64_t i = 0; i < rows; ++i) {
        double st[4];
        float* row = lg.data() + i * n;
        row_stats(row, n, 0, target[a + i], st);
        const double lse = st[0] + std::log(st[1]);
        ce[a + i] = lse - st[3];
        argmax[a + i] = static_cast<std::int32_t>(st[2]);
        if (backward) dlogits(row, n, 0, target[a + i], weight[a + i], lse);
      }
      if (backward) linear_backward_input(lg.data(), rows, n, w_.data(), H, dhf + a * H);
    }
    return;
  }
  Communicator& g = *group_;
  const int G = g.size(), me = g.rank();
  std::vector<std::int64_t> q(static_cast<std::size_t>(G));
  g.all_gather<std::int64_t>(std::vector<std::int64_t>{Qp}, q);
  std::vector<std::size_t> rows_of(static_cast<std::size_t>(G)), vals_of(rows_of.size());
  std::int64_t Q = 0, off = 0;
  for (int r = 0; r < G; ++r) {
    rows_of[static_cast<std::size_t>(r)] = static_cast<std::size_t>(q[static_cast<std::size_t>(r)]);
    vals_of[static_cast<std::size_t>(r)] = static_cast<std::size_t>(q[static_cast<std::size_t>(r)] * H);
    if (r < me) off += q[static_cast<std::size_t>(r)];
    Q += q[static_cast<std::size_t>(r)];
  }
  std::vector<float> hf_all(static_cast<std::size_t>(Q * H));
  std::vector<std::int32_t> t_all(static_cast<std::size_t>(Q));
  std::vector<double> w_all(static_cast<std::size_t>(Q));
  g.all_gather_v<float>(std::span<const float>(hf, static_cast<std::size_t>(Qp * H)), hf_all, vals_of);
  g.all_gather_v<std::int32_t>(std::span<const std::int32_t>(target, static_cast<std::size_t>(Qp)), t_all, rows_of);
  g.all_gather_v<double>(std::span<const double>(weight, static_cast<std::size_t>(Qp)), w_all, rows_of);
  std::vector<double> mine(static_cast<std::size_t>(Q * 4)), all(static_cast<std::size_t>(Q * 4 * G));
  std::vector<float> lg(static_cast<std::size_t>(std::min(R, Q) * n));
  for (std::int64_t a = 0; a < Q; a += R) {
    const std::int64_t rows = std::min(R, Q - a);
    linear_forward(hf_all.data() + a * H, rows, H, w_.data(), n, lg.data());
    for (std::int64_t i = 0; i < rows; ++i)
      row_stats(lg.data() + i * n, n, v0_, t_all[static_cast<std::size_t>(a + i)], mine.data() + (a + i) * 4);
  }
  g.all_gather<double>(mine, all);
  std::vector<double> lse(static_cast<std::size_t>(Q));
  for (std::int64_t i = 0; i < Q; ++i) {
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
    lse[static_cast<std::size_t>(i)] = M + std::log(S);
    if (i >= off && i < off + Qp) {
      ce[i - off] = lse[static_cast<std::size_t>(i)] - tgt;
      argmax[i - off] = static_cast<std::int32_t>(idx);
    }
  }
  if (!backward) return;
  std::vector<float> dhf_all(static_cast<std::size_t>(Q * H));
  for (std::int64_t a = 0; a < Q; a += R) {
    const std::int64_t rows = std::min(R, Q - a);
    linear_forward(hf_all.data() + a * H, rows, H, w_.data(), n, lg.data());
    for (std::int64_t i = 0; i < rows; ++i) {
      const auto k = static_cast<std::size_t>(a + i);
      dlogits(lg.data() + i * n, n, v0_, t_all[k], w_all[k], lse[k]);
    }
    linear_backward_input(lg.data(), rows, n, w_.data(), H, dhf_all.data() + a * H);
  }
  g.reduce_scatter_v<float>(dhf_all, std::span<float>(dhf, static_cast<std::size_t>(Qp * H)), vals_of);
}

}  // namespace diffcp
