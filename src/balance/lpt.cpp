#include "balance/lpt.hpp"

#include <algorithm>
#include <numeric>
#include <queue>

namespace diffcp {

Plan LptBalancer::plan(const PackedBatch& batch, const CostModel& cost, int P, int J) const {
  const std::int64_t S = batch.context_rows();
  check_plan_args(name(), S, P, J);
  Plan plan{name(), P, J, equal_chunks(S, static_cast<std::int64_t>(P) * J), {}};
  const std::size_t n = plan.chunks.size();
  // Chunks are contiguous: one prefix-cost lookup per boundary.
  std::vector<std::int64_t> price(n);
  std::int64_t left = cost.prefix(0);
  for (std::size_t j = 0; j < n; ++j) {
    const std::int64_t right = cost.prefix(plan.chunks[j].end);
    price[j] = right - left;
    left = right;
  }
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return price[a] > price[b]; });

  // Least-loaded bundle with room: a min-heap on (load, bundle); a full bundle is not pushed back.
  using Entry = std::pair<std::int64_t, int>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (int b = 0; b < P; ++b) heap.push({0, b});
  std::vector<int> count(static_cast<std::size_t>(P), 0), bundle(n);
  for (std::size_t j : order) {
    auto [load, b] = heap.top();
    heap.pop();
    bundle[j] = b;
    if (++count[static_cast<std::size_t>(b)] < J) heap.push({load + price[j], b});
  }

  // Locality matching: rows of bundle b already on rank r (the loader's slices), greedily largest
  // first; unmatched bundles take the remaining ranks in order.
  const auto slices = loader_slices(S, P);
  std::vector<std::tuple<std::int64_t, int, int>> overlap;  // (rows, bundle, rank)
  for (std::size_t j = 0; j < n; ++j) {
    const PosRange c = plan.chunks[j];
    // slices are even: the ranks a chunk touches follow from its ends.
    auto r = static_cast<int>(std::upper_bound(slices.begin(), slices.end(), c.begin,
                                               [](std::int64_t x, const PosRange& s) { return x < s.end; }) -
                              slices.begin());
    for (; r < P && slices[static_cast<std::size_t>(r)].begin < c.end; ++r) {
      const std::int64_t rows = std::min(c.end, slices[static_cast<std::size_t>(r)].end) -
                                std::max(c.begin, slices[static_cast<std::size_t>(r)].begin);
      if (rows > 0) overlap.emplace_back(rows, bundle[j], r);
    }
  }
  // Sum per (bundle, rank) pair, then match largest first.
  std::sort(overlap.begin(), overlap.end(), [](const auto& a, const auto& b) {
    return std::tie(std::get<1>(a), std::get<2>(a)) < std::tie(std::get<1>(b), std::get<2>(b));
  });
  std::vector<std::tuple<std::int64_t, int, int>> pairs;
  for (const auto& [rows, b, r] : overlap) {
    if (!pairs.empty() && std::get<1>(pairs.back()) == b && std::get<2>(pairs.back()) == r)
      std::get<0>(pairs.back()) += rows;
    else
      pairs.emplace_back(rows, b, r);
  }
  std::stable_sort(pairs.begin(), pairs.end(), [](const auto& a, const auto& b) { return std::get<0>(a) > std::get<0>(b); });
  std::vector<int> rank_of_bundle(static_cast<std::size_t>(P), -1), bundle_of_rank(static_cast<std::size_t>(P), -1);
  for (const auto& [rows, b, r] : pairs)
    if (rank_of_bundle[static_cast<std::size_t>(b)] < 0 && bundle_of_rank[static_cast<std::size_t>(r)] < 0) {
      rank_of_bundle[static_cast<std::size_t>(b)] = r;
      bundle_of_rank[static_cast<std::size_t>(r)] = b;
    }
  int next_rank = 0;
  for (int b = 0; b < P; ++b) {
    if (rank_of_bundle[static_cast<std::size_t>(b)] >= 0) continue;
    while (bundle_of_rank[static_cast<std::size_t>(next_rank)] >= 0) ++next_rank;
    rank_of_bundle[static_cast<std::size_t>(b)] = next_rank;
    bundle_of_rank[static_cast<std::size_t>(next_rank)] = b;
  }
  plan.rank.resize(n);
  for (std::size_t j = 0; j < n; ++j) plan.rank[j] = rank_of_bundle[static_cast<std::size_t>(bundle[j])];
  return plan;
}

}  // namespace diffcp
