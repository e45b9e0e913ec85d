#include "diffcp/drafter/lm_head.hpp"

#include <algorithm>
#include <cmath>

#include "diffcp/core/error.hpp"
#include "diffcp/ops/linear.hpp"
#include "diffcp/ops/loss.hpp"

namespace diffcp {

namespace {
constexpr std::int64_t kChunkValues = std::int64_t{1} << 25;  // logits held at once: 128 MB of f32
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

void LmHead::run(const float* hf, std::int64_t Qp, const std::int32_t* target, const double* weight, double* ce,
                 std::int32_t* argmax, bool backward, float* dhf) {
  const std::int64_t n = v1_ - v0_, H = H_;
  const std::int64_t R = std::clamp<std::int64_t>(kChunkValues / n, 8, std::max<std::int64_t>(Qp, 8));
  const auto rows_of_span = [](auto* p, std::int64_t at, std::int64_t rows) {
    return std::span(p + at, static_cast<std::size_t>(rows));
  };
  // Scratch of this call only (freed on return, as the model's backward needs the memory):
  DeviceVector<float> lg, hf_all, dhf_all;  // [R, n] one chunk of logits; [Q, H] the group's rows x 2
  if (group_ == nullptr) {  // the whole head: one pass
    lg.resize(std::min(R, Qp) * n);
    std::vector<double> st(static_cast<std::size_t>(4 * std::min(R, Qp)));
    for (std::int64_t a = 0; a < Qp; a += R) {
      const std::int64_t rows = std::min(R, Qp - a);
      linear_forward(hf + a * H, rows, H, w_.data(), n, lg.data());
      const std::span<double> stats(st.data(), static_cast<std::size_t>(4 * rows));
      cross_entropy(lg.data(), rows, n, 0, rows_of_span(target, a, rows), stats,
                    backward ? rows_of_span(weight, a, rows) : std::span<const double>());
      for (std::int64_t i = 0; i < rows; ++i) {
        const double* s = stats.data() + 4 * i;
        ce[a + i] = s[0] + std::log(s[1]) - s[3];
        argmax[a + i] = static_cast<std::int32_t>(s[2]);
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
  hf_all.resize(Q * H);
  std::vector<std::int32_t> t_all(static_cast<std::size_t>(Q));
  std::vector<double> w_all(static_cast<std::size_t>(Q));
  g.all_gather_v_async(hf, hf_all.data(), vals_of, DType::f32)->wait();
  g.all_gather_v<std::int32_t>(std::span<const std::int32_t>(target, static_cast<std::size_t>(Qp)), t_all, rows_of);
  g.all_gather_v<double>(std::span<const double>(weight, static_cast<std::size_t>(Qp)), w_all, rows_of);
  std::vector<double> mine(static_cast<std::size_t>(Q * 4)), all(static_cast<std::size_t>(Q * 4 * G));
  lg.resize(std::min(R, Q) * n);
  for (std::int64_t a = 0; a < Q; a += R) {
    const std::int64_t rows = std::min(R, Q - a);
    linear_forward(hf_all.data() + a * H, rows, H, w_.data(), n, lg.data());
    cross_entropy(lg.data(), rows, n, v0_, rows_of_span(t_all.data(), a, rows), rows_of_span(mine.data(), 4 * a, 4 * rows));
  }
  g.all_gather<double>(mine, all);
  std::vector<double> lse(static_cast<std::size_t>(Q));
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
    lse[static_cast<std::size_t>(i)] = M + std::log(S);
    if (i >= off && i < off + Qp) {
      ce[i - off] = lse[static_cast<std::size_t>(i)] - tgt;
      argmax[i - off] = static_cast<std::int32_t>(idx);
    }
  }
  if (!backward) return;
  dhf_all.resize(Q * H);
  for (std::int64_t a = 0; a < Q; a += R) {
    const std::int64_t rows = std::min(R, Q - a);
    linear_forward(hf_all.data() + a * H, rows, H, w_.data(), n, lg.data());
    cross_entropy_backward(lg.data(), rows, n, v0_, rows_of_span(t_all.data(), a, rows),
                           rows_of_span(w_all.data(), a, rows), rows_of_span(lse.data(), a, rows));
    linear_backward_input(lg.data(), rows, n, w_.data(), H, dhf_all.data() + a * H);
  }
  g.reduce_scatter_v_async(dhf_all.data(), dhf, vals_of, DType::f32, ReduceOp::sum)->wait();
}

}  // namespace diffcp
