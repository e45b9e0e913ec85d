// The CUDA attention's plans (src/cuda/plan.hpp), checked on the host against the mask itself
// (BlockMask::visible_ranges): the forward plan holds every block's anchor and ranges; the key plan
// gives every key row exactly the blocks that see it, and the key's position; the GEMM path's runs
// cover every block once with exactly its visible keys. Masks: DFlash batches
// with and without a sliding window, context segments held out of order with a block whose own
// rows are elsewhere, and the DiT's dense blocks (one image each).
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "../src/cuda/plan.hpp"
#include "diffcp/attention/mask.hpp"
#include "diffcp/workload/batch.hpp"

namespace diffcp {
namespace {

// The GEMM path's runs: every block's rows in exactly one run of consecutive blocks of one sample
// group; a run's spans disjoint, in row order, 8-aligned columns, exactly the union of its blocks'
// visible key rows.
void check_runs(const BlockMask& mask, const std::vector<std::int64_t>& plan) {
  const cuda::AttentionRuns R = cuda::attention_runs(mask, plan);
  const std::int64_t B = mask.block(), N = mask.num_blocks();
  std::vector<int> covered(static_cast<std::size_t>(N), 0);
  std::vector<std::int64_t> group_of(static_cast<std::size_t>(N), -1);
  for (std::size_t g = 0; g < mask.sample_groups().size(); ++g)
    for (const std::int64_t i : mask.sample_groups()[g]) group_of[static_cast<std::size_t>(i)] = static_cast<std::int64_t>(g);
  std::vector<RowRange> ranges;
  for (const cuda::AttentionRun& run : R.runs) {
    ASSERT_EQ(run.row0 % B, 0);
    ASSERT_EQ(run.rows % B, 0);
    ASSERT_GT(run.rows, 0);
    const std::int64_t i0 = run.row0 / B, i1 = i0 + run.rows / B;
    std::set<std::int64_t> want;  // the union of the run's blocks' visible key rows
    for (std::int64_t i = i0; i < i1; ++i) {
      ++covered[static_cast<std::size_t>(i)];
      EXPECT_EQ(group_of[static_cast<std::size_t>(i)], group_of[static_cast<std::size_t>(i0)]) << "block " << i;
      mask.visible_ranges(i, ranges);
      for (const RowRange& r : ranges)
        for (std::int64_t j = r.begin; j < r.end; ++j) want.insert(j);
    }
    std::set<std::int64_t> got;
    std::int64_t col = 0, prev_end = -1;
    for (std::int64_t sp = run.span0; sp < run.span0 + run.n_spans; ++sp) {
      const std::int64_t* g = R.spans.data() + 3 * sp;
      ASSERT_LT(g[0], g[1]);
      EXPECT_GT(g[0], prev_end) << "spans disjoint, not adjacent, in row order";
      EXPECT_EQ(g[2], col);
      col += (g[1] - g[0] + 7) / 8 * 8;
      prev_end = g[1];
      for (std::int64_t j = g[0]; j < g[1]; ++j) got.insert(j);
    }
    EXPECT_EQ(run.L, col);
    EXPECT_EQ(got, want) << "run at row " << run.row0;
  }
  for (std::int64_t i = 0; i < N; ++i) EXPECT_EQ(covered[static_cast<std::size_t>(i)], 1) << "block " << i;
}

void check_plans(const BlockMask& mask) {
  std::vector<std::int64_t> plan, key_plan;
  cuda::attention_plan(mask, plan);
  cuda::attention_key_plan(mask, plan, key_plan);
  check_runs(mask, plan);
  const std::int64_t N = mask.num_blocks(), L = mask.key_rows();
  // Brute force: which blocks see each key row, at which position.
  std::vector<std::set<std::int64_t>> seen(static_cast<std::size_t>(L));
  std::vector<std::int64_t> pos(static_cast<std::size_t>(L), -1);
  std::vector<RowRange> ranges;
  for (std::int64_t i = 0; i < N; ++i) {
    ASSERT_EQ(plan[static_cast<std::size_t>(i)], mask.blocks()[static_cast<std::size_t>(i)].ctx_end);
    mask.visible_ranges(i, ranges);
    const std::int64_t r0 = plan[static_cast<std::size_t>(N + i)], r1 = plan[static_cast<std::size_t>(N + i + 1)];
    ASSERT_EQ(r1 - r0, static_cast<std::int64_t>(ranges.size())) << "block " << i;
    for (std::size_t r = 0; r < ranges.size(); ++r) {
      const std::int64_t* p = plan.data() + 2 * N + 1 + 3 * (r0 + static_cast<std::int64_t>(r));
      EXPECT_EQ(p[0], ranges[r].begin);
      EXPECT_EQ(p[1], ranges[r].end);
      EXPECT_EQ(p[2], ranges[r].pos);
      for (std::int64_t j = ranges[r].begin; j < ranges[r].end; ++j) {
        seen[static_cast<std::size_t>(j)].insert(i);
        const std::int64_t y = ranges[r].pos + (j - ranges[r].begin);
        if (pos[static_cast<std::size_t>(j)] >= 0) {
          ASSERT_EQ(pos[static_cast<std::size_t>(j)], y) << "key row " << j;
        }
        pos[static_cast<std::size_t>(j)] = y;
      }
    }
  }
  // The key plan, row by row.
  const std::int64_t S = key_plan[0];
  const std::int64_t* seg = key_plan.data() + 1;
  const std::int64_t* blocks = seg + 5 * S;
  ASSERT_EQ(static_cast<std::int64_t>(key_plan.size()), 1 + 5 * S + (S > 0 ? seg[5 * (S - 1) + 3] + seg[5 * (S - 1) + 4] : 0));
  std::vector<std::set<std::int64_t>> planned(static_cast<std::size_t>(L));
  std::int64_t prev_end = 0;
  for (std::int64_t s = 0; s < S; ++s) {
    const std::int64_t* g = seg + 5 * s;
    ASSERT_LT(g[0], g[1]);
    ASSERT_GE(g[0], prev_end) << "segments sorted and disjoint";
    ASSERT_GT(g[4], 0);
    prev_end = g[1];
    for (std::int64_t b = 1; b < g[4]; ++b) ASSERT_LT(blocks[g[3] + b - 1], blocks[g[3] + b]);
    for (std::int64_t j = g[0]; j < g[1]; ++j) {
      planned[static_cast<std::size_t>(j)].insert(blocks + g[3], blocks + g[3] + g[4]);
      EXPECT_EQ(g[2] + (j - g[0]), pos[static_cast<std::size_t>(j)]) << "key row " << j;
    }
  }
  for (std::int64_t j = 0; j < L; ++j) EXPECT_EQ(planned[static_cast<std::size_t>(j)], seen[static_cast<std::size_t>(j)]) << "key row " << j;
}

TEST(CudaAttentionPlan, DflashBatches) {
  for (const std::int64_t window : {0, 1, 7, 100}) {
    SCOPED_TRACE("window " + std::to_string(window));
    const PackedBatch batch = make_random_batch(3, 300, 6, 4, 0.25, 5);
    check_plans(full_mask(batch, KeyWindow::sliding(window)));
    check_plans(full_mask(batch, KeyWindow{window, false}));
  }
}

TEST(CudaAttentionPlan, SegmentsOutOfOrderAndOwnRowsElsewhere) {
  // Two samples' context in three segments held out of order; block 2 holds no own rows.
  const std::int64_t B = 4;
  std::vector<ContextSegment> segs{{40, 50, 20}, {0, 0, 30}, {30, 30, 10}};
  std::vector<MaskBlock> blocks{{0, 20, 70}, {0, 40, 74}, {50, 70, -1}, {50, 62, 78}};
  check_plans(BlockMask(B, 82, segs, blocks));
  check_plans(BlockMask(B, 82, segs, blocks, KeyWindow::sliding(9)));
}

TEST(CudaAttentionPlan, DitDenseBlocks) {
  // Two images of 24 tokens on this rank, each block an image seeing its own image's 60 keys.
  std::vector<ContextSegment> segs{{0, 0, 60}, {60, 1000, 60}};
  std::vector<MaskBlock> blocks{{0, 60, -1}, {1000, 1060, -1}};
  check_plans(BlockMask(24, 120, segs, blocks));
}

}  // namespace
}  // namespace diffcp
