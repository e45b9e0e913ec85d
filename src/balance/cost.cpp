#include "diffcp/balance/cost.hpp"

#include <algorithm>
#include <numeric>

#include "diffcp/core/error.hpp"
#include "diffcp/cp/shard.hpp"

namespace diffcp {

CostModel::CostModel(const PackedBatch& batch)
    : block_cost_(batch.block * batch.block), B_(batch.block), S_(batch.context_rows()) {
  batch.validate();
  starts_ = batch.sample_starts();
  anchors_ = batch.anchors;
  sample_prefix_.assign(1, 0);
  for (std::size_t u = 0; u < anchors_.size(); ++u) {
    std::vector<std::int64_t> pre(1, 0);
    for (std::int64_t a : anchors_[u]) pre.push_back(pre.back() + a);
    // A sample's total: every anchor a contributes its a context keys before it.
    sample_prefix_.push_back(sample_prefix_.back() + B_ * pre.back());
    anchor_prefix_.push_back(std::move(pre));
  }
}

CostModel::CostModel(const PackedBatch& batch, const std::vector<KeyWindow>& layers) : CostModel(batch) {
  DIFFCP_CHECK(!layers.empty(), "cost: a drafter of no layers");
  full_layers_ = 0;
  block_cost_ = 0;
  for (const KeyWindow& w : layers) {
    DIFFCP_CHECK(w.window >= 0 && w.window <= kMaxKeyWindow, "cost: sliding window ", w.window,
                 ", expected 1 .. 2^40 (or 0: none)");
    for (std::int64_t r = 0; r < B_; ++r)  // the block's own pairs: slot r (at a + r) sees slot j (at a + j)
      for (std::int64_t j = 0; j < B_; ++j) block_cost_ += w.sees(r, j);
    if (w.window == 0) {
      ++full_layers_;
      continue;
    }
    auto it = std::find_if(windows_.begin(), windows_.end(), [&](const WindowTerm& t) { return t.window == w.window; });
    if (it == windows_.end()) {
      windows_.push_back({w.window, 0, {}, {}});
      it = windows_.end() - 1;
    }
    ++it->layers;
  }
  for (WindowTerm& t : windows_) {
    t.sample_prefix.assign(1, 0);
    for (const auto& anchors : anchors_) {
      std::vector<std::int64_t> pre(1, 0);
      for (std::int64_t a : anchors) pre.push_back(pre.back() + F(t, a));
      t.sample_prefix.push_back(t.sample_prefix.back() + pre.back());
      t.anchor_F_prefix.push_back(std::move(pre));
    }
  }
}

std::int64_t CostModel::F(const WindowTerm& w, std::int64_t n) const {
  // f(d) = clamp(W - d, 0, B): B for d <= W - B, then W - d down to 1 at d = W - 1, then 0.
  const std::int64_t W = w.window, flat = std::max<std::int64_t>(W - B_, 0);
  std::int64_t sum = B_ * std::min(n, flat);
  const std::int64_t lo = flat + 1, hi = std::min(n, W - 1);
  if (hi >= lo) sum += (hi - lo + 1) * W - (lo + hi) * (hi - lo + 1) / 2;
  return sum;
}

std::int64_t CostModel::window_prefix(const WindowTerm& w, std::size_t u, std::int64_t t) const {
  // Anchors a <= t: all their keys are before t, F(a). Anchors in (t, t + W): keys [0, t) are
  // d = a - t + 1 .. a rows before them, F(a) - F(a - t). Anchors >= t + W see none of [0, t).
  const auto& a = anchors_[u];
  const std::size_t k = static_cast<std::size_t>(std::upper_bound(a.begin(), a.end(), t) - a.begin());
  std::int64_t sum = w.sample_prefix[u] + w.anchor_F_prefix[u][k];
  for (std::size_t i = k; i < a.size() && a[i] < t + w.window; ++i) sum += F(w, a[i]) - F(w, a[i] - t);
  return sum;
}

std::int64_t CostModel::position_cost(std::int64_t x) const {
  DIFFCP_CHECK(0 <= x && x < S_, "cost: position ", x, " outside [0, ", S_, ")");
  const std::size_t u = static_cast<std::size_t>(std::upper_bound(starts_.begin(), starts_.end(), x) - starts_.begin() - 1);
  const auto& a = anchors_[u];
  const std::int64_t t = x - starts_[u];  // in-sample position; visible to anchors a > t
  const auto first = std::upper_bound(a.begin(), a.end(), t);
  std::int64_t c = full_layers_ * B_ * static_cast<std::int64_t>(a.end() - first);
  for (const WindowTerm& w : windows_)
    for (auto i = first; i != a.end() && *i < t + w.window; ++i)
      c += w.layers * std::clamp<std::int64_t>(w.window - (*i - t), 0, B_);
  return c;
}

std::int64_t CostModel::prefix(std::int64_t x) const {
  DIFFCP_CHECK(0 <= x && x <= S_, "cost: prefix end ", x, " outside [0, ", S_, "]");
  if (x == S_) {
    std::int64_t total = full_layers_ * sample_prefix_.back();
    for (const WindowTerm& w : windows_) total += w.layers * w.sample_prefix.back();
    return total;
  }
  const std::size_t u = static_cast<std::size_t>(std::upper_bound(starts_.begin(), starts_.end(), x) - starts_.begin() - 1);
  const auto& a = anchors_[u];
  const std::int64_t t = x - starts_[u];  // rows [0, t) of sample u are before x
  // sum_i min(a_i, t): anchors <= t contribute a_i, the others t.
  const std::size_t k = static_cast<std::size_t>(std::upper_bound(a.begin(), a.end(), t) - a.begin());
  const std::int64_t within = anchor_prefix_[u][k] + static_cast<std::int64_t>(a.size() - k) * t;
  std::int64_t sum = full_layers_ * (sample_prefix_[u] + B_ * within);
  for (const WindowTerm& w : windows_) sum += w.layers * window_prefix(w, u, t);
  return sum;
}

std::vector<std::int64_t> CostModel::chunk_costs(const std::vector<PosRange>& chunks) const {
  std::vector<std::int64_t> out(chunks.size());
  std::size_t u = 0, k = 0;  // the sample holding x; anchors of u that are <= x - s_u
  auto prefix_at = [&](std::int64_t x) {  // prefix(x) for x not below the previous call's
    if (!windows_.empty()) return prefix(x);  // sliding layers: binary searches, few anchors per window
    if (x == S_) return full_layers_ * sample_prefix_.back();
    while (u + 1 < starts_.size() && starts_[u + 1] <= x) {
      ++u;
      k = 0;
    }
    const auto& a = anchors_[u];
    const std::int64_t t = x - starts_[u];
    while (k < a.size() && a[k] <= t) ++k;
    return full_layers_ * (sample_prefix_[u] + B_ * (anchor_prefix_[u][k] + static_cast<std::int64_t>(a.size() - k) * t));
  };
  std::int64_t end = chunks.empty() ? 0 : chunks[0].begin;
  DIFFCP_CHECK(0 <= end && end <= S_, "cost: chunk 0 begins at ", end, ", outside [0, ", S_, "]");
  std::int64_t left = prefix_at(end);
  for (std::size_t j = 0; j < chunks.size(); ++j) {
    DIFFCP_CHECK(chunks[j].begin == end && end <= chunks[j].end && chunks[j].end <= S_, "cost: chunk ", j, " [",
                 chunks[j].begin, ", ", chunks[j].end, ") does not continue at ", end, " within [0, ", S_, "]");
    end = chunks[j].end;
    const std::int64_t right = prefix_at(end);
    out[j] = right - left;
    left = right;
  }
  return out;
}

void Plan::validate(std::int64_t S) const {
  DIFFCP_CHECK(P >= 1, "plan: P = ", P, ", expected >= 1");
  DIFFCP_CHECK(chunks.size() == rank.size(), "plan: ", chunks.size(), " chunks but ", rank.size(), " rank entries");
  std::int64_t next = 0;
  for (std::size_t j = 0; j < chunks.size(); ++j) {
    DIFFCP_CHECK(chunks[j].begin == next && chunks[j].end >= chunks[j].begin, "plan: chunk ", j, " [", chunks[j].begin,
                 ", ", chunks[j].end, ") does not continue at position ", next);
    DIFFCP_CHECK(0 <= rank[j] && rank[j] < P, "plan: chunk ", j, " goes to rank ", rank[j], " outside [0, ", P, ")");
    next = chunks[j].end;
  }
  DIFFCP_CHECK(next == S, "plan: chunks cover [0, ", next, ") of the context [0, ", S, ")");
}

std::vector<std::vector<PosRange>> Plan::chunks_of_rank() const {
  std::vector<std::vector<PosRange>> out(static_cast<std::size_t>(P));
  for (std::size_t j = 0; j < chunks.size(); ++j) {
    if (chunks[j].end == chunks[j].begin) continue;
    auto& l = out[static_cast<std::size_t>(rank[j])];
    if (!l.empty() && l.back().end == chunks[j].begin)
      l.back().end = chunks[j].end;
    else
      l.push_back(chunks[j]);
  }
  return out;
}

PlanLoad plan_load(const PackedBatch& batch, const CostModel& cost, const Plan& plan) {
  plan.validate(batch.context_rows());
  const std::size_t P = static_cast<std::size_t>(plan.P);
  PlanLoad load;
  load.context_work.assign(P, 0);
  load.block_work.assign(P, 0);
  load.rank_work.assign(P, 0);
  const std::vector<std::int64_t> price = cost.chunk_costs(plan.chunks);
  for (std::size_t j = 0; j < plan.chunks.size(); ++j) load.context_work[static_cast<std::size_t>(plan.rank[j])] += price[j];
  const std::int64_t N = batch.num_blocks();
  for (std::size_t p = 0; p < P; ++p) {
    load.block_work[p] = even_shard(N, plan.P, static_cast<std::int64_t>(p)).size() * cost.block_cost();
    load.rank_work[p] = load.context_work[p] + load.block_work[p];
  }
  const std::int64_t total = std::accumulate(load.rank_work.begin(), load.rank_work.end(), std::int64_t{0});
  const std::int64_t mx = *std::max_element(load.rank_work.begin(), load.rank_work.end());
  load.rho = total == 0 ? 1.0 : static_cast<double>(mx) * static_cast<double>(P) / static_cast<double>(total);
  return load;
}

}  // namespace diffcp
