// DiT serving features (issue #52): CFG-parallel and step caching (First-Block Cache). Runs at
// P = 1, 2, 3, 4, 8 (ctest registers every P).
//
//   * CFG-parallel (dit/run.hpp): the two passes of classifier-free guidance on two halves of the
//     ranks. In every family with CFG (Qwen-Image's norm-keeping guidance, SD3.5's, FLUX.1's true
//     CFG beside its distilled guidance), every mode (flat,
//     TAPA, V-First, CoCoDiff at r = 0 and at r > 0) and USP where the half allows it, with a
//     negative prompt of another length (its own padding) and an image grid no half divides:
//       - bitwise the sequential run on one half (the same P/2-rank exchanges, pass for pass);
//       - the sequential run over all P ranks and the one-rank run within fp32 tolerance;
//       - the velocity pair's bytes the closed form cfg_pair_bytes; each rank's exchange bytes the
//         half's pass's (the two ranks of a pair add up to the half's sequential run);
//       - odd P (1, 3) and a run without a negative pass refused by name, on every rank.
//   * First-Block Cache (dit/step_cache.hpp):
//       - the cache itself on synthetic rows: rel_l1 equals a float64 host sum over the real rows
//         of every rank (padding rows excluded), the decision the same on every rank, a cached
//         step's rows exactly x + R_f, the first step always full;
//       - threshold 0 bitwise the exact run in every mode (USP too) and every family;
//       - a huge threshold computes one step, caches the rest, and equals the one-rank run with
//         the same cache (fp32 tolerance): the decision does not depend on P;
//       - with CFG-parallel: bitwise the sequential half run with the same cache;
//       - bad specs and a one-block model refused by name.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/dit/metrics.hpp"
#include "diffcp/dit/run.hpp"
#include "diffcp/dit/sampler.hpp"
#include "diffcp/dit/step_cache.hpp"
#include "diffcp/dit/usp.hpp"
#include "diffcp/testing/compare.hpp"
#include "dit_family_config.hpp"
#include "error_of.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

Communicator& world() { return test::world(); }

// 24 heads (every half of P <= 8 divides them), two double blocks (SD3.5 and Qwen-Image have no
// single ones; FLUX.1 one of each).
DitConfig serving_config(DitFamily family) {
  const bool singles = family == DitFamily::flux1 || family == DitFamily::flux2;
  return test::tiny_family_config(family, 24, 48, singles ? 1 : 2, 1, 12);
}

// 112 x 80 pixels: a 5 x 7 grid (35 image tokens: no half of P > 2 divides them), 13 text tokens.
const DitShape kShape{1, 112, 80, 13};

struct Inputs {
  DitConditioning cond;
  SampleOptions opt;
  std::vector<float> noise;
};

Inputs make_inputs(const DitConfig& cfg, int steps = 3) {
  Inputs in{prompt_conditioning(cfg, kShape, "a serving test"),
            {flow_schedule(steps, TimeSchedule::flux, kShape.image_tokens()), 4.0, {}},
            initial_noise(cfg, kShape, 11)};
  if (cfg.accepts_negative()) {  // a negative prompt of 7 tokens (FLUX.1: its true CFG, scale 3)
    const DitConditioning neg = prompt_conditioning(cfg, DitShape{1, 16, 16, 7}, "");
    in.cond.negative_txt = neg.txt;
    in.cond.negative_pooled = cfg.has_pooled() ? neg.pooled : std::vector<float>{};
    in.cond.negative_tokens = 7;
    in.opt.true_cfg_scale = 3.0;
  }
  return in;
}

struct ModeCase {
  ExchangeMode mode;
  CacheSchedule schedule;
  int ulysses;  // 0: all ranks of the run
};

// Every mode; CoCoDiff exact (r = 0) and lossy (r = 0.5 after one warm-up step); USP where the
// half has at least two ranks.
std::vector<ModeCase> mode_cases(int half) {
  const CacheSchedule r0{CacheScheduleKind::fixed, 0.0, 0, 0}, lossy{CacheScheduleKind::fixed, 0.5, 1, 0};
  std::vector<ModeCase> m{{ExchangeMode::flat, r0, 0},
                          {ExchangeMode::tapa, r0, 0},
                          {ExchangeMode::vfirst, r0, 0},
                          {ExchangeMode::cocodiff, r0, 0},
                          {ExchangeMode::cocodiff, lossy, 0}};
  if (half >= 2) m.push_back({ExchangeMode::flat, r0, 1});  // USP: Ring over the half's ranks
  return m;
}

// A sequential run (both passes on every rank of `comm`) in mode `m`.
DitRun sequential(Communicator& comm, const DitWeights& w, const Inputs& in, const ModeCase& m, const SampleOptions& opt) {
  const int L = 1;
  const auto ex = make_attention_exchange(m.mode, comm, L, m.schedule, m.ulysses);
  const auto neg = make_attention_exchange(m.mode, comm, L, m.schedule, m.ulysses);
  return run_dit_sampling(comm, w, kShape, *ex, in.cond, in.noise, opt, neg.get());
}

DitRun cfg_parallel(const CfgGroups& g, const DitWeights& w, const Inputs& in, const ModeCase& m, const SampleOptions& opt) {
  const auto ex = make_attention_exchange(m.mode, *g.group, 1, m.schedule, m.ulysses);
  return run_dit_sampling(world(), w, kShape, *ex, in.cond, in.noise, opt, nullptr, &g);
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---------------------------------------------------------------------------------------------
TEST(CfgParallel, OddRankCountsAndRunsWithoutANegativePassAreRefused) {
  const int P = world().size();
  if (P % 2 == 1) {
    EXPECT_NE(error_of([] { make_cfg_groups(world()); }).find("P = " + std::to_string(P) + " is odd"), std::string::npos);
    return;
  }
  const CfgGroups g = make_cfg_groups(world());
  EXPECT_EQ(g.group->size(), P / 2);
  EXPECT_EQ(g.pass(), world().rank() < P / 2 ? 0 : 1);
  // FLUX.2 has no classifier-free guidance pass; FLUX.1 with true_cfg_scale 1 and Qwen-Image with
  // guidance 1 run one pass.
  for (const DitFamily family : {DitFamily::flux2, DitFamily::flux1, DitFamily::qwen_image}) {
    const DitConfig cfg = serving_config(family);
    DitWeights w(cfg);
    w.init_random(3);
    Inputs in = make_inputs(cfg);
    in.opt.guidance = 1.0;
    in.opt.true_cfg_scale = 1.0;
    const std::string err = error_of([&] { cfg_parallel(g, w, in, {ExchangeMode::flat, {}, 0}, in.opt); });
    EXPECT_NE(err.find("`cfg_parallel`: this run has no negative pass"), std::string::npos) << err;
  }
}

TEST(CfgParallel, EqualsTheSequentialRunInEveryFamilyAndMode) {
  const int P = world().size();
  if (P % 2 == 1) GTEST_SKIP() << "CFG-parallel needs an even P";
  const CfgGroups g = make_cfg_groups(world());
  const auto self = world().split(world().rank(), 0, "self");
  for (const DitFamily family : {DitFamily::qwen_image, DitFamily::sd3, DitFamily::flux1}) {
    SCOPED_TRACE(dit_family_name(family));
    const DitConfig cfg = serving_config(family);
    DitWeights w(cfg);
    w.init_random(21);
    const Inputs in = make_inputs(cfg);
    ASSERT_TRUE(uses_negative_pass(cfg, in.cond, in.opt));
    const ModeCase flat{ExchangeMode::flat, {}, 0};
    const std::vector<float> single = sequential(*self, w, in, flat, in.opt).latent;
    const std::vector<double> ref(single.begin(), single.end());
    for (const ModeCase& m : mode_cases(P / 2)) {
      SCOPED_TRACE(std::string(exchange_mode_name(m.mode)) + (m.ulysses ? " USP" : "") + " r " +
                   std::to_string(m.schedule.ratio));
      const DitRun par = cfg_parallel(g, w, in, m, in.opt);
      const DitRun half = sequential(*g.group, w, in, m, in.opt);
      EXPECT_TRUE(bitwise_equal(par.latent, half.latent)) << "max |diff| " << max_abs_diff(par.latent, half.latent);
      // The velocity pair: b I_p C_in floats a step, I_p of the half's shard.
      const DitShard hs = make_dit_shard(cfg, kShape, P / 2, g.group->rank(), m.ulysses == 0 ? P / 2 : m.ulysses);
      EXPECT_EQ(par.cfg_pair_bytes, (in.opt.timesteps.size() - 1) * cfg_pair_bytes(cfg, kShape, hs));
      // Each rank moves its pass's bytes: the pair together moves what the half's sequential run does.
      std::vector<double> pair_sum{static_cast<double>(par.stats.bytes_intra + par.stats.bytes_inter),
                                   static_cast<double>(par.stats.calls)};
      g.pair->all_reduce<double>(pair_sum);
      EXPECT_EQ(pair_sum[0], static_cast<double>(half.stats.bytes_intra + half.stats.bytes_inter));
      EXPECT_EQ(pair_sum[1], static_cast<double>(half.stats.calls));
      if (m.schedule.ratio > 0) continue;  // V-Major's stale rows: lossy by design, bitwise above is the check
      const CompareResult c = compare<float>(par.latent, ref, scaled_to(kTolF32, ref));
      EXPECT_TRUE(c.pass()) << "vs one rank: max_abs " << c.max_abs << " worst ratio " << c.worst_ratio;
      const std::vector<float> full = sequential(world(), w, in, {m.mode, m.schedule, m.ulysses == 0 ? 0 : 2}, in.opt).latent;
      const std::vector<double> full_ref(full.begin(), full.end());
      const CompareResult cf = compare<float>(par.latent, full_ref, scaled_to(kTolF32, full_ref));
      EXPECT_TRUE(cf.pass()) << "vs sequential at P: max_abs " << cf.max_abs << " worst ratio " << cf.worst_ratio;
    }
  }
}

// ---------------------------------------------------------------------------------------------
TEST(StepCache, SpecsAndOneBlockModelsAreRefusedByName) {
  EXPECT_FALSE(parse_step_cache("none").enabled);
  const StepCacheSpec s = parse_step_cache("fbcache:0.08");
  EXPECT_TRUE(s.enabled);
  EXPECT_DOUBLE_EQ(s.threshold, 0.08);
  EXPECT_EQ(s.name(), "fbcache:0.08");
  for (const char* bad : {"fbcache", "fbcache:", "fbcache:-1", "fbcache:nan", "fbcache:0.1x", "teacache:0.1", ""})
    EXPECT_NE(error_of([&] { parse_step_cache(bad); }).find("`step_cache`"), std::string::npos) << bad;
  DitConfig cfg = serving_config(DitFamily::flux1);
  cfg.double_blocks = 1;
  cfg.single_blocks = 0;
  DitWeights w(cfg);
  const auto ex = make_attention_exchange(ExchangeMode::flat, world(), 1);
  DitModel model(w, kShape, *ex);
  EXPECT_NE(error_of([&] { model.set_step_cache(s, world()); }).find("needs at least two"), std::string::npos);
}

// The cache on synthetic rows: b = 2 images of I_p = 3 rows (2 real), H = 4; rank r's rows carry
// r-dependent values, padding rows huge (they must not count).
TEST(StepCache, DecisionIsTheRelativeL1OverEveryRanksRealRowsAndCachedRowsAddTheResidual) {
  const int P = world().size(), p = world().rank();
  const std::int64_t b = 2, Ip = 3, iv = 2, H = 4, n = b * Ip * H;
  const auto rows = [&](double base, double step) {  // x[j, i, h] on this rank
    std::vector<float> x(static_cast<std::size_t>(n));
    for (std::int64_t j = 0; j < b; ++j)
      for (std::int64_t i = 0; i < Ip; ++i)
        for (std::int64_t h = 0; h < H; ++h)
          x[static_cast<std::size_t>((j * Ip + i) * H + h)] =
              i < iv ? static_cast<float>(base + step * (1 + p + j + 0.5 * i) * (h % 2 ? 1 : -1)) : 1e6f * (1 + h);
    return x;
  };
  // Step f (full): before = rows(1, 0), after first = rows(1, 0.1), after last = rows(2, 0.3).
  // Step k: before = rows(1, 0), after first = rows(1, 0.1 + d). rel = sum|d ...| / sum|0.1 ...|.
  const double d = 0.004;
  // Host float64: r1 = after - before over real rows; both sums over every rank (the same formula).
  double num = 0, den = 0;
  for (int r = 0; r < P; ++r)
    for (std::int64_t j = 0; j < b; ++j)
      for (std::int64_t i = 0; i < iv; ++i)
        for (std::int64_t h = 0; h < H; ++h) {
          const double unit = (1 + r + j + 0.5 * i);
          num += std::abs(static_cast<double>(static_cast<float>(1 + (0.1 + d) * unit * (h % 2 ? 1 : -1)) - 1.0f) -
                          static_cast<double>(static_cast<float>(1 + 0.1 * unit * (h % 2 ? 1 : -1)) - 1.0f));
          den += std::abs(static_cast<double>(static_cast<float>(1 + 0.1 * unit * (h % 2 ? 1 : -1)) - 1.0f));
        }
  const double rel = num / den;
  for (const double threshold : {rel * 1.01, rel * 0.99}) {
    SCOPED_TRACE(threshold);
    FirstBlockCache c(threshold, world(), b, Ip, iv, H);
    DeviceVector<float> x;
    x.assign(rows(1, 0));
    c.enter(x.data());
    x.assign(rows(1, 0.1));
    EXPECT_FALSE(c.reuse(x.data())) << "the first step is full";
    const std::vector<float> after_first = rows(1, 0.1), after_last = rows(2, 0.3);
    x.assign(after_last);
    c.leave(x.data());
    x.assign(rows(1, 0));
    c.enter(x.data());
    const std::vector<float> first_k = rows(1, 0.1 + d);
    x.assign(first_k);
    const bool cached = c.reuse(x.data());
    EXPECT_EQ(cached, threshold > rel);
    ASSERT_EQ(c.stats().rel_l1.size(), 2u);
    EXPECT_TRUE(std::isnan(c.stats().rel_l1[0]));
    EXPECT_NEAR(c.stats().rel_l1[1], rel, 1e-6 * rel);
    EXPECT_EQ(c.stats().computed, cached ? 1 : 2);
    const std::vector<float> got = to_host<float>(x.view());
    for (std::size_t i = 0; i < got.size(); ++i) {
      // cached: x + (after_last - after_first), as the cache computes it in f32: x - (after_first - after_last)
      const float want = cached ? first_k[i] - (after_first[i] - after_last[i]) : first_k[i];
      ASSERT_EQ(got[i], want) << "element " << i;
    }
  }
}

// Threshold 0 never caches: bitwise the run without a cache, in every mode and family.
TEST(StepCache, ThresholdZeroIsBitwiseTheExactRun) {
  const int P = world().size();
  for (const DitFamily family : {DitFamily::flux1, DitFamily::qwen_image, DitFamily::sd3}) {
    SCOPED_TRACE(dit_family_name(family));
    const DitConfig cfg = serving_config(family);
    DitWeights w(cfg);
    w.init_random(5);
    const Inputs in = make_inputs(cfg);
    SampleOptions zero = in.opt;
    zero.step_cache = parse_step_cache("fbcache:0");
    for (const ModeCase& m : mode_cases(P)) {
      SCOPED_TRACE(std::string(exchange_mode_name(m.mode)) + (m.ulysses ? " USP" : ""));
      const DitRun exact = sequential(world(), w, in, m, in.opt), cached = sequential(world(), w, in, m, zero);
      EXPECT_TRUE(bitwise_equal(exact.latent, cached.latent)) << "max |diff| " << max_abs_diff(exact.latent, cached.latent);
      EXPECT_EQ(cached.steps_computed[0], 3);
      EXPECT_EQ(cached.steps_cached[0], 0);
      EXPECT_EQ(cached.steps_computed[1], cfg.accepts_negative() ? 3 : 0);
      EXPECT_EQ(cached.rel_l1.size(), 3u);
    }
  }
}

// A huge threshold computes the first step and caches the rest; P ranks equal one rank with the
// same cache; the cache changes the image (the skip is real); every rank saw the same rel_l1.
TEST(StepCache, CachedRunsEqualTheOneRankCachedRunAndDecideAlike) {
  const int P = world().size();
  const auto self = world().split(world().rank(), 0, "self");
  for (const DitFamily family : {DitFamily::flux1, DitFamily::sd3}) {
    SCOPED_TRACE(dit_family_name(family));
    const DitConfig cfg = serving_config(family);
    DitWeights w(cfg);
    w.init_random(8);
    const Inputs in = make_inputs(cfg, 4);
    SampleOptions huge = in.opt;
    huge.step_cache = parse_step_cache("fbcache:1e9");
    const ModeCase flat{ExchangeMode::flat, {}, 0};
    const std::vector<float> single = sequential(*self, w, in, flat, huge).latent;
    const std::vector<double> ref(single.begin(), single.end());
    EXPECT_GT(max_abs_diff(single, sequential(*self, w, in, flat, in.opt).latent), 1e-4) << "the cache changes nothing";
    for (const ModeCase& m : mode_cases(P)) {
      SCOPED_TRACE(std::string(exchange_mode_name(m.mode)) + (m.ulysses ? " USP" : ""));
      const DitRun run = sequential(world(), w, in, m, huge);
      EXPECT_EQ(run.steps_computed[0], 1);
      EXPECT_EQ(run.steps_cached[0], 3);
      if (cfg.accepts_negative()) {
        EXPECT_EQ(run.steps_cached[1], 3);
      }
      if (m.schedule.ratio == 0) {
        const CompareResult c = compare<float>(run.latent, ref, scaled_to(kTolF32, ref));
        EXPECT_TRUE(c.pass()) << "max_abs " << c.max_abs << " worst ratio " << c.worst_ratio;
      }
      // The decision's input is all-reduced: rel_l1 bitwise the same on every rank.
      std::vector<double> mine(run.rel_l1.begin() + 1, run.rel_l1.end()), lo = mine, hi = mine;
      world().all_reduce<double>(lo, ReduceOp::max);
      for (double& v : hi) v = -v;
      world().all_reduce<double>(hi, ReduceOp::max);
      for (std::size_t i = 0; i < mine.size(); ++i) EXPECT_EQ(lo[i], -hi[i]) << "step " << i + 1;
    }
  }
}

// With CFG-parallel each half decides for its pass: bitwise the sequential half run with the same
// cache, at a threshold that caches some steps and not others.
TEST(StepCache, ComposesWithCfgParallel) {
  const int P = world().size();
  if (P % 2 == 1) GTEST_SKIP() << "CFG-parallel needs an even P";
  const CfgGroups g = make_cfg_groups(world());
  const DitConfig cfg = serving_config(DitFamily::qwen_image);
  DitWeights w(cfg);
  w.init_random(9);
  const Inputs in = make_inputs(cfg, 6);
  // The rel_l1 of the exact run's steps tell which threshold splits them.
  SampleOptions probe = in.opt;
  probe.step_cache = parse_step_cache("fbcache:0");
  const ModeCase m{ExchangeMode::cocodiff, {CacheScheduleKind::fixed, 0.0, 0, 0}, 0};
  const DitRun p0 = sequential(*g.group, w, in, m, probe);
  std::vector<double> rel(p0.rel_l1.begin() + 1, p0.rel_l1.end());
  std::sort(rel.begin(), rel.end());
  SampleOptions opt = in.opt;
  opt.step_cache = {true, 0.5 * (rel[rel.size() / 2 - 1] + rel[rel.size() / 2])};  // about half the steps cached
  const DitRun par = cfg_parallel(g, w, in, m, opt), half = sequential(*g.group, w, in, m, opt);
  EXPECT_TRUE(bitwise_equal(par.latent, half.latent)) << "max |diff| " << max_abs_diff(par.latent, half.latent);
  for (int q = 0; q < 2; ++q) {
    EXPECT_EQ(par.steps_computed[q], half.steps_computed[q]) << "pass " << q;
    EXPECT_EQ(par.steps_cached[q], half.steps_cached[q]) << "pass " << q;
  }
  EXPECT_GT(par.steps_cached[0], 0);
  EXPECT_GT(par.steps_computed[0], 1);
}

}  // namespace
}  // namespace diffcp
