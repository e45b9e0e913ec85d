// Cost model and balancers (single process): the paper's Figure 5 example, chunk prices against a
// brute-force per-position sum, plan invariants for every balancer (J chunks per rank for lpt,
// every row covered once), locality matching never changing loads, the anchors file, bad input.
#include <filesystem>
#include <fstream>
#include <numeric>

#include <gtest/gtest.h>

#include "balance/balancer.hpp"
#include "balance/lpt.hpp"
#include "core/error.hpp"

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
  expect_error(write("type.json", R"({"block": "two", "samples": []})"), "wrong type");
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
