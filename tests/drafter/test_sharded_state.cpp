// Sharded model state and the vocabulary-parallel LM head on P ranks (drafter/sharded_state.hpp,
// drafter/lm_head.hpp): the head split over P equals the whole head (loss, argmax, dhf) against
// an fp64 reference; one optimizer step of every shard mode sends the closed-form bytes the
// communicator counts and applies the same update as the replicated state; a sharded checkpoint
// reads back on another mesh.
#include <cmath>
#include <filesystem>
#include <random>

#include <gtest/gtest.h>

#include "diffcp/core/error.hpp"
#include "diffcp/core/random.hpp"
#include "diffcp/drafter/checkpoint.hpp"
#include "diffcp/drafter/config.hpp"
#include "diffcp/drafter/lm_head.hpp"
#include "diffcp/drafter/sharded_state.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

using test::world;


TEST(LmHead, VocabularyParallelEqualsTheFp64Reference) {
  const int P = world().size(), me = world().rank();
  const std::int64_t H = 24, V = 101;  // V not divisible by most P
  // Rank r owns 3 + r rows (rank 1 none, to cover Q_p = 0); every rank builds all of them.
  std::vector<std::int64_t> rows(static_cast<std::size_t>(P));
  std::int64_t Q = 0, off = 0;
  for (int r = 0; r < P; ++r) {
    rows[static_cast<std::size_t>(r)] = r == 1 ? 0 : 3 + r;
    if (r < me) off += rows[static_cast<std::size_t>(r)];
    Q += rows[static_cast<std::size_t>(r)];
  }
  const std::vector<float> hf = random_normal(static_cast<std::size_t>(Q * H), 5), W = random_normal(static_cast<std::size_t>(H * V), 6, 0.5);
  std::vector<std::int32_t> target(static_cast<std::size_t>(Q));
  std::vector<double> weight(target.size());
  for (std::int64_t i = 0; i < Q; ++i) {
    target[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((i * 37) % V);
    weight[static_cast<std::size_t>(i)] = i % 4 == 0 ? 0.0 : 1.0 / static_cast<double>(1 + i % 3);
  }
  const auto [v0, v1] = vocab_slice(V, P, me);
  std::vector<float> slice(static_cast<std::size_t>(H * (v1 - v0)));
  for (std::int64_t h = 0; h < H; ++h)
    std::copy_n(W.begin() + h * V + v0, v1 - v0, slice.begin() + h * (v1 - v0));
  LmHead head(&world(), H, V, slice, v0);
  const std::int64_t Qp = rows[static_cast<std::size_t>(me)];
  std::vector<double> ce(static_cast<std::size_t>(Qp));
  std::vector<std::int32_t> argmax(ce.size());
  std::vector<float> dhf(static_cast<std::size_t>(Qp * H));
  head.run(hf.data() + off * H, Qp, target.data() + off, weight.data() + off, ce.data(), argmax.data(), true, dhf.data());
  for (std::int64_t i = 0; i < Qp; ++i) {  // fp64 reference of row off + i
    const float* x = hf.data() + (off + i) * H;
    std::vector<double> lg(static_cast<std::size_t>(V), 0.0);
    for (std::int64_t v = 0; v < V; ++v)
      for (std::int64_t h = 0; h < H; ++h) lg[static_cast<std::size_t>(v)] += static_cast<double>(x[h]) * W[static_cast<std::size_t>(h * V + v)];
    const auto best = std::max_element(lg.begin(), lg.end()) - lg.begin();
    double sum = 0;
    for (double l : lg) sum += std::exp(l - lg[static_cast<std::size_t>(best)]);
    const double lse = lg[static_cast<std::size_t>(best)] + std::log(sum);
    const auto t = static_cast<std::size_t>(target[static_cast<std::size_t>(off + i)]);
    EXPECT_NEAR(ce[static_cast<std::size_t>(i)], lse - lg[t], 1e-4 * (1 + std::abs(lse))) << "row " << off + i;
    EXPECT_EQ(argmax[static_cast<std::size_t>(i)], best) << "row " << off + i;
    const double w = weight[static_cast<std::size_t>(off + i)];
    for (std::int64_t h = 0; h < H; ++h) {
      double d = 0;
      for (std::int64_t v = 0; v < V; ++v)
        d += w * (std::exp(lg[static_cast<std::size_t>(v)] - lse) - (static_cast<std::size_t>(v) == t ? 1.0 : 0.0)) *
             W[static_cast<std::size_t>(h * V + v)];
      EXPECT_NEAR(dhf[static_cast<std::size_t>(i * H + h)], d, 1e-5) << "row " << off + i << " h " << h;
    }
  }
}

// A fake backward: every rank adds rank-dependent gradients to every unit (as CP shares do).
void fake_step(ShardedState& st, std::int64_t accum) {
  const auto& lay = st.layout();
  st.zero_grads();
  for (std::int64_t a = 0; a < accum; ++a) {
    for (int u = 0; u < st.units(); ++u) {
      st.acquire(u, false);
      st.release(u, false);
    }
    for (int u = st.units() - 1; u >= 0; --u) {
      const float* p = st.acquire(u, true);
      float* g = st.unit_grads(u);
      const auto n = lay.units[static_cast<std::size_t>(u)].size;
      for (std::int64_t i = 0; i < n; ++i) g[i] += p[i] * 0.01f + static_cast<float>((world().rank() + 1) * (a + 1)) * 1e-3f;
      st.release(u, true);
    }
  }
}

TEST(ShardedState, EveryModeAppliesTheSameUpdateAndSendsTheClosedFormBytes) {
  const DrafterConfig cfg;  // tiny
  const DrafterLayout lay(cfg);
  const std::vector<float> init = random_normal(static_cast<std::size_t>(lay.total), 11, 0.1);
  std::vector<std::vector<float>> after;
  for (ShardMode mode : {ShardMode::none, ShardMode::optimizer, ShardMode::full}) {
    auto mesh = world().split(0, world().rank(), "mesh");  // fresh counters
    ShardedState st(*mesh, lay, mode);
    st.set_params(init);
    AdamW adam;
    adam.lr = 1e-2;
    const std::int64_t accum = 2;
    mesh->stats().reset();
    fake_step(st, accum);
    const double norm = st.reduce_grads(0.5);
    st.apply(adam, 1e-2, 0.05);  // clips: norm > 0.05
    EXPECT_GT(norm, 0.05);
    std::vector<double> sent{static_cast<double>(mesh->stats().total().bytes_sent)};
    world().all_reduce<double>(sent);
    const int W = world().size();
    EXPECT_NEAR(sent[0] / W, W == 1 ? 0.0 : shard_bytes_per_step(lay, mode, W, accum), 1e-6) << shard_mode_name(mode);
    after.push_back(st.gather_params());
  }
  for (std::size_t k = 1; k < after.size(); ++k) {
    ASSERT_EQ(after[k].size(), after[0].size());
    double worst = 0;
    for (std::size_t i = 0; i < after[0].size(); ++i) worst = std::max(worst, static_cast<double>(std::abs(after[k][i] - after[0][i])));
    EXPECT_LT(worst, 1e-6) << "mode " << k;  // the sums differ in order only
  }
}

TEST(ShardedState, CheckpointWrittenOnThisMeshLoadsOnAnyOther) {
  const DrafterConfig cfg;
  const DrafterLayout lay(cfg);
  const auto path = (std::filesystem::path(::testing::TempDir()) / ("sharded_np" + std::to_string(world().size()) + ".ck")).string();
  ShardedState st(world(), lay, ShardMode::full);
  st.set_params(random_normal(static_cast<std::size_t>(lay.total), 12, 0.1));
  AdamW adam;
  fake_step(st, 1);
  st.reduce_grads(1.0);
  st.apply(adam, 1e-3, 1.0);
  st.save(path, {{"step", 1}});
  const std::vector<float> want = st.gather_params();
  // Read back whole (one process) and sharded on every sub-mesh size 1 .. P.
  const Checkpoint ck = load_checkpoint(path);
  EXPECT_EQ(ck.params, want);
  for (int size = 1; size <= world().size(); ++size) {
    auto sub = world().split(world().rank() < size ? 0 : 1, world().rank(), "sub");
    if (world().rank() >= size) continue;
    for (ShardMode mode : {ShardMode::none, ShardMode::optimizer, ShardMode::full}) {
      ShardedState back(*sub, lay, mode);
      CheckpointReader r(path);
      back.load(r);
      EXPECT_EQ(back.gather_params(), want) << "mesh of " << size << ", " << shard_mode_name(mode);
    }
  }
  world().barrier();
}

TEST(ShardedState, BadModeIsRefused) {
  try {
    parse_shard_mode("zero3");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("`shard` 'zero3': expected none, optimizer or full"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace diffcp
