#include "plan.hpp"

#include <algorithm>
#include <map>
#include <utility>

#include "diffcp/attention/mask.hpp"

namespace diffcp::cuda {

void attention_plan(const BlockMask& mask, std::vector<std::int64_t>& plan) {
  const std::int64_t N = mask.num_blocks();
  const auto at = [](std::int64_t i) { return static_cast<std::size_t>(i); };
  const auto ranges_so_far = [&] { return (static_cast<std::int64_t>(plan.size()) - 2 * N - 1) / 3; };
  plan.assign(at(2 * N + 1), 0);
  std::vector<RowRange> ranges;
  for (std::int64_t i = 0; i < N; ++i) {
    plan[at(i)] = mask.blocks()[at(i)].ctx_end;
    plan[at(N + i)] = ranges_so_far();
    mask.visible_ranges(i, ranges);
    for (const RowRange& r : ranges) plan.insert(plan.end(), {r.begin, r.end, r.pos});
  }
  plan[at(2 * N)] = ranges_so_far();
}

// A sweep over the ranges' ends: between two consecutive ends the set of blocks is constant.
void attention_key_plan(const BlockMask& mask, const std::vector<std::int64_t>& plan, std::vector<std::int64_t>& key_plan) {
  const std::int64_t N = mask.num_blocks();
  struct Edge {
    std::int64_t row, block, begin, pos;  // begin = -1: the block's range ends at row
  };
  std::vector<Edge> edges;
  for (std::int64_t i = 0; i < N; ++i)
    for (std::int64_t r = plan[static_cast<std::size_t>(N + i)]; r < plan[static_cast<std::size_t>(N + i + 1)]; ++r) {
      const std::int64_t* rg = plan.data() + 2 * N + 1 + 3 * r;
      if (rg[1] <= rg[0]) continue;
      edges.push_back({rg[0], i, rg[0], rg[2]});
      edges.push_back({rg[1], i, -1, 0});
    }
  std::sort(edges.begin(), edges.end(), [](const Edge& x, const Edge& y) {
    return x.row != y.row ? x.row < y.row : x.begin < y.begin;  // at one row, ends before beginnings
  });
  std::map<std::int64_t, std::pair<std::int64_t, std::int64_t>> active;  // block -> its range's (first row, position)
  std::vector<std::int64_t> segs, blocks;
  for (std::size_t e = 0; e < edges.size();) {
    const std::int64_t row = edges[e].row;
    for (; e < edges.size() && edges[e].row == row; ++e) {
      if (edges[e].begin < 0)
        active.erase(edges[e].block);
      else
        active[edges[e].block] = {edges[e].begin, edges[e].pos};
    }
    if (active.empty() || e == edges.size()) continue;
    const std::pair<std::int64_t, std::int64_t>& first = active.begin()->second;
    segs.insert(segs.end(), {row, edges[e].row, first.second + (row - first.first),
                             static_cast<std::int64_t>(blocks.size()), static_cast<std::int64_t>(active.size())});
    for (const auto& entry : active) blocks.push_back(entry.first);
  }
  key_plan.assign(1, static_cast<std::int64_t>(segs.size() / 5));
  key_plan.insert(key_plan.end(), segs.begin(), segs.end());
  key_plan.insert(key_plan.end(), blocks.begin(), blocks.end());
}

AttentionRuns attention_runs(const BlockMask& mask, const std::vector<std::int64_t>& plan) {
  const std::int64_t N = mask.num_blocks(), B = mask.block();
  AttentionRuns R;
  for (std::vector<std::int64_t> blocks : mask.sample_groups()) {
    std::sort(blocks.begin(), blocks.end());
    for (std::size_t b0 = 0; b0 < blocks.size();) {
      std::size_t b1 = b0 + 1;
      while (b1 < blocks.size() && blocks[b1] == blocks[b1 - 1] + 1) ++b1;
      std::vector<std::pair<std::int64_t, std::int64_t>> iv;  // the run's ranges, then merged
      for (std::size_t b = b0; b < b1; ++b)
        for (std::int64_t r = plan[static_cast<std::size_t>(N + blocks[b])]; r < plan[static_cast<std::size_t>(N + blocks[b] + 1)];
             ++r) {
          const std::int64_t* g = plan.data() + 2 * N + 1 + 3 * r;
          if (g[1] > g[0]) iv.emplace_back(g[0], g[1]);
        }
      std::sort(iv.begin(), iv.end());
      AttentionRun run{blocks[b0] * B, static_cast<std::int64_t>(b1 - b0) * B, static_cast<std::int64_t>(R.spans.size() / 3),
                       0, 0};
      for (std::size_t x = 0; x < iv.size();) {
        std::int64_t end = iv[x].second;
        std::size_t y = x + 1;
        for (; y < iv.size() && iv[y].first <= end; ++y) end = std::max(end, iv[y].second);
        R.spans.insert(R.spans.end(), {iv[x].first, end, run.L});
        run.L += (end - iv[x].first + 7) / 8 * 8;
        ++run.n_spans;
        x = y;
      }
      R.runs.push_back(run);
      b0 = b1;
    }
  }
  return R;
}

}  // namespace diffcp::cuda
