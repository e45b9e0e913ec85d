// Cost model and balancers (single process): the paper's Figure 5 example, chunk prices against a
// brute-force per-position sum, plan invariants for every balancer (J chunks per rank for lpt,
// every row covered once), locality matching never changing loads, the anchors file, bad input.
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <tuple>

#include <gtest/gtest.h>

#include "diffcp/balance/balancer.hpp"
#include "diffcp/balance/lpt.hpp"
#include "diffcp/core/error.hpp"

namespace diffcp {
namespace {

// Figure 5 of the Split-KV paper: P = 4, B = 2, two packed samples (16 + 8 tokens), 4 anchors each.
PackedBatch figure5() {
  PackedBatch b;
  b.block = 2;
  b.lengths = {16, 8};
  b.anchors = {{6, 10, 11, 12}, {2, 4, 5, 6}};
  return b;
}

TEST(CostModel, Figure5PerPositionCosts) {
  const PackedBatch b = figure5();
  const CostModel cost(b);
  const std::vector<std::int64_t> expected{8, 8, 8, 8, 8, 8, 6, 6, 6, 6, 4, 2, 0, 0, 0, 0,  // sample 0
                                           8, 8, 6, 6, 4, 2, 0, 0};                       // sample 1
  for (std::int64_t x = 0; x < b.context_rows(); ++x) EXPECT_EQ(cost.position_cost(x), expected[static_cast<std::size_t>(x)]) << x;
  // Global two-token chunks L0..L11 as printed in the figure.
  const std::vector<std::int64_t> chunk_price{16, 16, 16, 12, 12, 6, 0, 0, 16, 12, 6, 0};
  for (std::int64_t j = 0; j < 12; ++j) EXPECT_EQ(cost.range_cost(2 * j, 2 * j + 2), chunk_price[static_cast<std::size_t>(j)]) << "L" << j;
}

TEST(Balancers, Figure5ZigzagAndLpt) {
  const PackedBatch b = figure5();
  const CostModel cost(b);
  const PlanLoad zig = plan_load(b, cost, make_balancer("zigzag")->plan(b, cost, 4, 3));
  EXPECT_EQ(zig.context_work, (std::vector<std::int64_t>{24, 24, 30, 34}));
  EXPECT_EQ(zig.rank_work, (std::vector<std::int64_t>{32, 32, 38, 42}));
  EXPECT_NEAR(zig.rho, 42.0 / 36.0, 1e-12);
  const Plan lpt_plan = make_balancer("lpt")->plan(b, cost, 4, 3);
  const PlanLoad lpt = plan_load(b, cost, lpt_plan);
  EXPECT_EQ(lpt.context_work, (std::vector<std::int64_t>{28, 28, 28, 28}));
  EXPECT_EQ(lpt.rank_work, (std::vector<std::int64_t>{36, 36, 36, 36}));
  EXPECT_EQ(lpt.block_work, (std::vector<std::int64_t>{8, 8, 8, 8}));
  EXPECT_DOUBLE_EQ(lpt.rho, 1.0);
}

TEST(CostModel, ChunkPricesEqualBruteForceSums) {
  for (std::uint64_t seed = 1; seed <= 5; ++seed) {
    const PackedBatch b = make_random_batch(3, 200, 20, 8, 0.25, seed, 400);  // uneven lengths, overlapping blocks
    const CostModel cost(b);
    // Brute force from the mask's definition: c(x) = B * #{blocks i : s_i <= x < a_i}.
    std::vector<std::int64_t> c(static_cast<std::size_t>(b.context_rows()), 0);
    for (const auto& blk : b.blocks())
      for (std::int64_t x = blk.sample_start; x < blk.anchor; ++x) c[static_cast<std::size_t>(x)] += b.block;
    for (std::int64_t x = 0; x < b.context_rows(); ++x) ASSERT_EQ(cost.position_cost(x), c[static_cast<std::size_t>(x)]);
    for (std::int64_t n : {1, 7, 32, 100}) {
      for (const PosRange& ch : equal_chunks(b.context_rows(), n)) {
        const std::int64_t brute = std::accumulate(c.begin() + ch.begin, c.begin() + ch.end, std::int64_t{0});
        ASSERT_EQ(cost.range_cost(ch.begin, ch.end), brute) << "chunk [" << ch.begin << ", " << ch.end << ")";
      }
    }
  }
}

// Sliding-window layers (issue #36): per position, per chunk (range_cost and chunk_costs) and per
// block, the model equals a brute-force count of the visible pairs summed over the layers: a
// query row at a_i + r sees context x iff s_i <= x < a_i and a_i + r - x < W (window 0: always).
TEST(CostModel, WindowedLayersEqualBruteForcePairCounts) {
  const std::vector<std::vector<KeyWindow>> mixes = {
      {{}, {}},                                         // two full layers: twice SPEC A.3's model
      {{5, true}, {}},                                  // window below B = 8
      {{37, true}, {37, true}, {}},                     // a window inside samples, twice
      {{12, false}, {100, true}, {1, true}, {0, true}}, // two-sided, wide, W = 1 (own slot only), causal only
  };
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    const PackedBatch b = make_random_batch(3, 200, 20, 8, 0.25, seed, 400);
    for (const auto& layers : mixes) {
      const CostModel cost(b, layers);
      std::vector<std::int64_t> c(static_cast<std::size_t>(b.context_rows()), 0);
      std::int64_t own = 0;
      for (const KeyWindow& w : layers) {
        for (const auto& blk : b.blocks())
          for (std::int64_t r = 0; r < b.block; ++r)
            for (std::int64_t x = blk.sample_start; x < blk.anchor; ++x)
              c[static_cast<std::size_t>(x)] += w.window == 0 || blk.anchor + r - x < w.window;
        for (std::int64_t r = 0; r < b.block; ++r)
          for (std::int64_t j = 0; j < b.block; ++j)
            own += (!w.causal || j <= r) && (w.window == 0 || (r - j < w.window && (w.causal || j - r < w.window)));
      }
      EXPECT_EQ(cost.block_cost(), own);
      for (std::int64_t x = 0; x < b.context_rows(); ++x) ASSERT_EQ(cost.position_cost(x), c[static_cast<std::size_t>(x)]) << x;
      for (std::int64_t n : {1, 7, 32, 100}) {
        const auto chunks = equal_chunks(b.context_rows(), n);
        const auto prices = cost.chunk_costs(chunks);
        for (std::size_t j = 0; j < chunks.size(); ++j) {
          const std::int64_t brute = std::accumulate(c.begin() + chunks[j].begin, c.begin() + chunks[j].end, std::int64_t{0});
          ASSERT_EQ(cost.range_cost(chunks[j].begin, chunks[j].end), brute) << "chunk " << j;
          ASSERT_EQ(prices[j], brute) << "chunk " << j;
        }
      }
    }
  }
  // One full layer through the layer list is SPEC A.3's model exactly.
  const PackedBatch b = make_random_batch(2, 300, 10, 16, 0.25, 9);
  const CostModel spec(b), listed(b, {KeyWindow{}});
  const auto chunks = equal_chunks(b.context_rows(), 24);
  EXPECT_EQ(spec.chunk_costs(chunks), listed.chunk_costs(chunks));
  EXPECT_EQ(spec.block_cost(), 16 * 16);
  EXPECT_EQ(listed.block_cost(), 16 * 16);
}

TEST(Balancers, PlansCoverEveryRowOnceAndLptGivesJChunksPerRank) {
  for (std::uint64_t seed = 1; seed <= 4; ++seed)
    for (int P : {1, 2, 3, 5, 8})
      for (const std::string& name : balancer_names()) {
        const PackedBatch b = make_random_batch(4, 1000, 30, 16, 0.25, seed, 3000);
        const CostModel cost(b);
        const int J = 4;
        const Plan plan = make_balancer(name)->plan(b, cost, P, J);
        SCOPED_TRACE(name + " P=" + std::to_string(P));
        plan.validate(b.context_rows());  // chunks partition [0, S) in order; ranks in range
        std::vector<int> chunks_per_rank(static_cast<std::size_t>(P), 0);
        for (int r : plan.rank) chunks_per_rank[static_cast<std::size_t>(r)] += 1;
        if (name == "lpt") {
          for (int n : chunks_per_rank) EXPECT_EQ(n, J);
        }
        // Rows held = S.
        std::int64_t rows = 0;
        for (const auto& l : plan.chunks_of_rank())
          for (const PosRange& c : l) rows += c.end - c.begin;
        EXPECT_EQ(rows, b.context_rows());
        const PlanLoad load = plan_load(b, cost, plan);
        EXPECT_GE(load.rho, 1.0);
        if (name == "lpt") {
          EXPECT_LT(load.imbalance_pct(), 10.0);
        }
      }
}

// Locality matching only renames bundles: the multiset of loads equals plain LPT's (bundle b on
// rank b), and it keeps at least as many rows in place as that identity mapping on these cases.
TEST(Balancers, LocalityMatchingNeverChangesLoads) {
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    const PackedBatch b = make_random_batch(4, 2000, 40, 16, 0.25, seed);
    const CostModel cost(b);
    const int P = 8, J = 8;
    const Plan plan = LptBalancer().plan(b, cost, P, J);
    // Recompute LPT bundles without matching: sorted multiset of per-rank loads must agree.
    std::vector<std::int64_t> loads = plan_load(b, cost, plan).context_work;
    std::vector<std::int64_t> price;
    for (const PosRange& c : plan.chunks) price.push_back(cost.range_cost(c.begin, c.end));
    std::vector<std::size_t> order(price.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return price[x] > price[y]; });
    std::vector<std::int64_t> bundle_load(P, 0);
    std::vector<int> count(P, 0);
    for (std::size_t j : order) {
      int best = -1;
      for (int r = 0; r < P; ++r)
        if (count[r] < J && (best < 0 || bundle_load[r] < bundle_load[best])) best = r;
      bundle_load[best] += price[j];
      count[best] += 1;
    }
    std::sort(loads.begin(), loads.end());
    std::sort(bundle_load.begin(), bundle_load.end());
    EXPECT_EQ(loads, bundle_load);
    // Rows that stay on their loader rank.
    const auto slices = loader_slices(b.context_rows(), P);
    std::int64_t stay = 0;
    for (std::size_t j = 0; j < plan.chunks.size(); ++j) {
      const PosRange s = slices[static_cast<std::size_t>(plan.rank[j])], c = plan.chunks[j];
      stay += std::max<std::int64_t>(0, std::min(s.end, c.end) - std::max(s.begin, c.begin));
    }
    EXPECT_GT(stay, 0);
  }
}

TEST(Balancers, LptReachesLowImbalanceOnThePaperWorkload) {
  // SPEC A.5 shape scaled down: b = 4 samples x 64k, 512 anchors each, P = 8, J = 16.
  const PackedBatch b = make_random_batch(4, 65536, 512, 16, 0.25, 3);
  const CostModel cost(b);
  const PlanLoad lpt = plan_load(b, cost, make_balancer("lpt")->plan(b, cost, 8, 16));
  const PlanLoad none = plan_load(b, cost, make_balancer("none")->plan(b, cost, 8, 16));
  EXPECT_LT(lpt.imbalance_pct(), 1.0);
  EXPECT_GT(none.imbalance_pct(), 10 * lpt.imbalance_pct());
}

// A drafter of sliding-window layers (W = 2048, issue #36) on the same workload: LPT fed the
// windows' real work balances it; fed full-attention costs, its plan is several times worse under
// the windows (the work concentrates in the W rows before each anchor, not over the whole prefix).
TEST(Balancers, WindowAwareLptBeatsFullCostPlanningOnAWindowedBatch) {
  const PackedBatch b = make_random_batch(4, 65536, 512, 16, 0.25, 3);
  const std::vector<KeyWindow> layers(5, KeyWindow{2048, true});
  const CostModel real(b, layers), full(b);
  const auto lpt = make_balancer("lpt");
  const PlanLoad aware = plan_load(b, real, lpt->plan(b, real, 8, 16));
  const PlanLoad blind = plan_load(b, real, lpt->plan(b, full, 8, 16));
  EXPECT_LT(aware.imbalance_pct(), 3.0);
  EXPECT_GT(blind.imbalance_pct(), 3 * aware.imbalance_pct());
}

TEST(Balancers, LptAtP1024OnTheIssueWorkload) {
  // SPEC A.5 full size at the largest group: b = 4 samples x 256k, 512 anchors each, P = 1024,
  // J = 16 (diffcp plan --balancer lpt --P 1024 --J 16 --samples 4 --context 256k --queries 8k).
  const PackedBatch b = make_random_batch(4, 262144, 512, 16, 0.25, 1);
  const CostModel cost(b);
  const int P = 1024, J = 16;
  const Plan plan = make_balancer("lpt")->plan(b, cost, P, J);
  plan.validate(b.context_rows());
  std::vector<int> chunks_per_rank(P, 0);
  for (int r : plan.rank) chunks_per_rank[static_cast<std::size_t>(r)] += 1;
  for (int r = 0; r < P; ++r) EXPECT_EQ(chunks_per_rank[static_cast<std::size_t>(r)], J) << "rank " << r;
  EXPECT_LE(plan_load(b, cost, plan).imbalance_pct(), 0.3);
}

// LPT + locality matching written out plainly (O(P) scans for the least-loaded bundle, comparison
// sorts, a map of (bundle, rank) rows): the balancer must give exactly this plan.
Plan reference_lpt(const PackedBatch& b, const CostModel& cost, int P, int J) {
  const std::int64_t S = b.context_rows();
  Plan plan{"lpt", P, J, equal_chunks(S, static_cast<std::int64_t>(P) * J), {}};
  const std::size_t n = plan.chunks.size();
  std::vector<std::int64_t> price(n);
  for (std::size_t j = 0; j < n; ++j) price[j] = cost.range_cost(plan.chunks[j].begin, plan.chunks[j].end);
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return price[x] > price[y]; });
  std::vector<std::int64_t> load(P, 0);
  std::vector<int> count(P, 0), bundle(n);
  for (std::size_t j : order) {
    int best = -1;  // least (load, bundle) with room
    for (int q = 0; q < P; ++q)
      if (count[q] < J && (best < 0 || load[q] < load[best])) best = q;
    bundle[j] = best;
    load[best] += price[j];
    count[best] += 1;
  }
  std::map<std::pair<int, int>, std::int64_t> rows;  // (bundle, rank) -> rows already there
  const auto slices = loader_slices(S, P);
  for (std::size_t j = 0; j < n; ++j)
    for (int r = 0; r < P; ++r) {
      const std::int64_t o = std::min(plan.chunks[j].end, slices[r].end) - std::max(plan.chunks[j].begin, slices[r].begin);
      if (o > 0) rows[{bundle[j], r}] += o;
    }
  std::vector<std::tuple<std::int64_t, int, int>> pairs;  // (-rows, bundle, rank): sorts largest first, ties in (b, r) order
  for (const auto& [br, o] : rows) pairs.emplace_back(-o, br.first, br.second);
  std::sort(pairs.begin(), pairs.end());
  std::vector<int> rank_of(P, -1), bundle_of(P, -1);
  auto match = [&](int q, int r) {
    rank_of[q] = r;
    bundle_of[r] = q;
  };
  for (const auto& [o, q, r] : pairs)
    if (rank_of[q] < 0 && bundle_of[r] < 0) match(q, r);
  for (int q = 0, r = 0; q < P; ++q)
    if (rank_of[q] < 0) {
      while (bundle_of[r] >= 0) ++r;
      match(q, r);
    }
  for (std::size_t j = 0; j < n; ++j) plan.rank.push_back(rank_of[bundle[j]]);
  return plan;
}

TEST(Balancers, LptEqualsThePlainReference) {
  struct Case {
    std::int64_t samples, context, anchors, context_max;
    int P, J;
  };
  const std::vector<Case> cases{{4, 1000, 30, 3000, 1, 4},   {4, 1000, 30, 3000, 3, 4},  {4, 1000, 30, 3000, 8, 1},
                                {5, 3000, 40, 9000, 13, 7},  {3, 4096, 64, 0, 64, 16},   {4, 2000, 40, 0, 8, 8},
                                {16, 4096, 64, 8000, 100, 3}, {2, 65536, 512, 0, 1024, 16}};
  for (std::uint64_t seed = 1; seed <= 3; ++seed)
    for (const Case& c : cases) {
      const PackedBatch b = make_random_batch(c.samples, c.context, c.anchors, 16, 0.25, seed, c.context_max);
      const CostModel cost(b);
      SCOPED_TRACE("seed " + std::to_string(seed) + " P=" + std::to_string(c.P) + " J=" + std::to_string(c.J));
      const Plan got = LptBalancer().plan(b, cost, c.P, c.J), want = reference_lpt(b, cost, c.P, c.J);
      ASSERT_EQ(got.chunks.size(), want.chunks.size());
      for (std::size_t j = 0; j < got.chunks.size(); ++j)
        ASSERT_TRUE(got.chunks[j].begin == want.chunks[j].begin && got.chunks[j].end == want.chunks[j].end) << j;
      EXPECT_EQ(got.rank, want.rank);
    }
}

TEST(CostModel, ChunkCostsEqualRangeCosts) {
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    const PackedBatch b = make_random_batch(5, 300, 20, 8, 0.25, seed, 900);  // uneven lengths
    const CostModel cost(b);
    for (std::int64_t n : {std::int64_t{1}, std::int64_t{7}, std::int64_t{100}, b.context_rows()}) {
      const auto chunks = equal_chunks(b.context_rows(), n);
      const std::vector<std::int64_t> got = cost.chunk_costs(chunks);
      ASSERT_EQ(got.size(), chunks.size());
      for (std::size_t j = 0; j < chunks.size(); ++j) ASSERT_EQ(got[j], cost.range_cost(chunks[j].begin, chunks[j].end)) << j;
    }
  }
  const CostModel cost(figure5());
  EXPECT_THROW(cost.chunk_costs({{0, 4}, {5, 8}}), Error);  // a gap
  EXPECT_THROW(cost.chunk_costs({{20, 30}}), Error);        // past S = 24
  EXPECT_EQ(cost.chunk_costs({{6, 10}, {10, 10}, {10, 24}}), (std::vector<std::int64_t>{24, 0, 40}));
}

TEST(AnchorsFile, ReadsTheDocumentedFormatAndRejectsBadFiles) {
  const auto dir = std::filesystem::path(::testing::TempDir());
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  };
  const PackedBatch b = read_anchors_file(
      write("ok.json", R"({"block": 2, "samples": [{"length": 16, "anchors": [6, 10, 11, 12]}, {"length": 8, "anchors": [2, 4, 5, 6]}]})"));
  EXPECT_EQ(b.lengths, figure5().lengths);
  EXPECT_EQ(b.anchors, figure5().anchors);
  auto expect_error = [](const std::string& path, const std::string& needle) {
    try {
      read_anchors_file(path);
      ADD_FAILURE() << "expected an error for " << path;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(write("trunc.json", R"({"block": 2, "samples": [)"), "not valid JSON");
  expect_error(write("type.json", R"({"block": "two", "samples": []})"), "\"block\" = \"two\", expected an integer");
  expect_error(write("shape.json", R"({"samples": []})"), "expected {");
  expect_error(write("past.json", R"({"block": 4, "samples": [{"length": 10, "anchors": [7]}]})"), "past the sample end");
  expect_error(write("unsorted.json", R"({"block": 2, "samples": [{"length": 10, "anchors": [5, 3]}]})"), "not strictly increasing");
  expect_error((dir / "missing.json").string(), "cannot read");
  {
    std::ofstream big(dir / "huge.json");
    big << std::string((64u << 20) + 16, ' ');
  }
  expect_error((dir / "huge.json").string(), "over the 64 MiB limit");
}

TEST(BadInput, BalancerArguments) {
  const PackedBatch b = make_random_batch(1, 100, 4, 8, 0.25, 1);
  const CostModel cost(b);
  EXPECT_THROW(make_balancer("random"), Error);
  EXPECT_THROW(make_balancer("lpt")->plan(b, cost, 4, 0), Error);    // J < 1
  EXPECT_THROW(make_balancer("lpt")->plan(b, cost, 0, 4), Error);    // P < 1
  EXPECT_THROW(make_balancer("lpt")->plan(b, cost, 10, 20), Error);  // P*J > S
  EXPECT_THROW(cost.position_cost(100), Error);
}

}  // namespace
}  // namespace diffcp
