// The drafter on the guard device (testing/guard_backend.hpp): its parameters, gradients, AdamW
// moments, activations, logit chunks and scratch live in guard memory, which the host cannot touch
// outside the backend's ops and copies; the collectives stage through host buffers. The trainer
// for 20 steps in each --shard mode (none, optimizer, full: the vocabulary-parallel LM head and
// activation recomputation with it, and a held-out evaluation) and one `draft` block equal the
// CPU backend's runs bit for bit (every step's loss and gradient norm, tau, the final parameters,
// the drafted hidden states). A
// host loop over device memory left anywhere in the drafter faults the test. DIFFCP_TEST_DEVICE=cuda
// runs the same on a GPU (tests/support/device_under_test.hpp): within bounds of the CPU's run.
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/core/random.hpp"
#include "diffcp/drafter/draft.hpp"
#include "diffcp/drafter/draft_cache.hpp"
#include "diffcp/drafter/model.hpp"
#include "diffcp/drafter/trainer.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/testing/guard_backend.hpp"
#include "device_under_test.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

struct TrainRun {
  std::vector<double> loss, grad_norm;  // per step
  std::vector<float> params;            // after the last step
  double tau = 0;
};

// 20 optimizer steps of a 21-step schedule (so no step evaluates), then, with `evaluate`, one
// held-out evaluation (the predictions come back to the host).
TrainRun train_on(Backend& b, const TrainOptions& opt, bool evaluate) {
  ScopedBackend use(b);
  TrainRun r;
  Trainer trainer(test::world(), opt);
  for (int s = 0; s < 20; ++s) {
    const StepStats st = trainer.step();
    r.loss.push_back(st.loss);
    r.grad_norm.push_back(st.grad_norm);
  }
  if (evaluate) r.tau = trainer.evaluate();
  r.params = trainer.result().params;
  return r;
}

TEST(DrafterOnGuardDevice, TrainEqualsTheCpuRunBitForBitInEveryShardMode) {
  DIFFCP_DEVICE_OR_SKIP(dev);
  TrainOptions opt;  // the tiny preset, 20 short steps
  opt.steps = 21;
  opt.accum = 1;
  opt.context = 64;
  opt.anchors = 3;
  opt.bucket = 32;
  opt.eval_every = 0;
  // DFlash2 (convolutions, the candidate selector over the vocabulary-parallel head) with full
  for (const auto& [shard, arch] : {std::pair{"none", "dflash"}, std::pair{"optimizer", "dflash"},
                                    std::pair{"full", "dflash"}, std::pair{"full", "dflash2"}}) {
    SCOPED_TRACE(std::string(shard) + " " + arch);
    opt.shard = shard;
    opt.arch = arch;
    const bool evaluate = opt.shard == "full";  // the vocabulary-parallel head's argmax
    const std::int64_t ops_before = test::guard_ops();
    const TrainRun cpu = train_on(cpu_backend(), opt, evaluate);
    const TrainRun guard = train_on(dev, opt, evaluate);
    if (test::device_under_test().exact) {  // it ran on the guard device
      EXPECT_GT(test::guard_ops(), ops_before);
    }
    ASSERT_EQ(cpu.loss.size(), 20u);
    const double bound = test::kDeviceBoundF32;
    EXPECT_TRUE(test::matches_cpu(cpu.loss, guard.loss, bound)) << "the losses differ";
    EXPECT_TRUE(test::matches_cpu(cpu.grad_norm, guard.grad_norm, bound)) << "the gradient norms differ";
    // tau counts argmax matches: on a device a near-tie may go the other way
    EXPECT_TRUE(test::matches_cpu(std::vector{cpu.tau}, std::vector{guard.tau}, test::device_under_test().exact ? 0 : 0.1));
    EXPECT_TRUE(test::matches_cpu(cpu.params, guard.params, bound)) << "the trained parameters differ";
  }
}

// Host syncs (testing/guard_backend.hpp host_syncs: where a GPU's host would wait) of the train
// step's computation, the communicators' staging of device memory left out (NCCL makes none):
// a constant per step (at most 4), the same for 2 and 4 layers and for 4x the context (more
// chunks) up to one step in four.
// A trainer holds the backend it was built on: its step runs there whatever the calling thread's
// active backend (here the CPU's), with the losses of a run made and stepped on the device.
TEST(DrafterOnGuardDevice, ATrainerRunsOnTheBackendItWasBuiltOn) {
  DIFFCP_DEVICE_OR_SKIP(dev);
  TrainOptions opt;
  opt.preset = "tiny";
  opt.steps = 2;
  opt.context = 64;
  opt.anchors = 3;
  opt.bucket = 32;
  opt.eval_every = 0;
  std::vector<double> inside, outside;
  {
    ScopedBackend use(dev);
    Trainer t(test::world(), opt);
    for (int s = 0; s < 2; ++s) inside.push_back(t.step().loss);
  }
  std::optional<Trainer> t;
  {
    ScopedBackend use(dev);
    t.emplace(test::world(), opt);
  }
  ASSERT_EQ(&active_backend(), &cpu_backend());
  const std::int64_t ops = test::guard_ops();
  for (int s = 0; s < 2; ++s) outside.push_back(t->step().loss);
  if (test::device_under_test().exact) EXPECT_GT(test::guard_ops(), ops);
  EXPECT_EQ(inside, outside);
}

TEST(DrafterOnGuardDevice, HostSyncsPerStepDoNotGrowWithLayersOrContext) {
  const auto per_step = [](const char* preset, std::int64_t context) {
    ScopedBackend use(test::guard_under_test());
    TrainOptions opt;
    opt.preset = preset;
    opt.steps = 8;  // the held-out evaluation runs after step 8 only
    opt.accum = 1;
    opt.context = context;
    opt.anchors = 3;
    opt.bucket = 32;
    opt.eval_every = 0;
    Trainer trainer(test::world(), opt);
    (void)trainer.step();  // the first step's one-time uploads
    const auto syncs = [] { return test::guard_under_test().counters().host_syncs - Communicator::staged_reads(); };
    const std::int64_t before = syncs();
    for (int s = 0; s < 4; ++s) (void)trainer.step();
    return (syncs() - before) / 4.0;
  };
  const double tiny = per_step("tiny", 64), small = per_step("small", 64), longer = per_step("tiny", 256);
  // At most one step in four differs by one (a data-dependent read), whatever the layers or context.
  EXPECT_LE(std::abs(tiny - small), 0.25) << "2 layers against 4";
  EXPECT_LE(std::abs(tiny - longer), 0.25) << "context 64 against 256";
  for (const double n : {tiny, small, longer}) {
    EXPECT_LE(n, 4.0);
    EXPECT_GE(n, 1.0);  // the loss statistics reach the host once a step at least
  }
  if (test::world().rank() == 0) std::printf("host syncs per train step (computation): %g\n", tiny);
}

TEST(DrafterOnGuardDevice, DraftEqualsTheCpuRunBitForBit) {
  DIFFCP_DEVICE_OR_SKIP(dev);
  const DrafterConfig cfg = drafter_preset("tiny");
  const std::int64_t ctx = 37, T = cfg.target_layers * cfg.hidden;
  std::vector<float> params;
  {
    std::unique_ptr<Communicator> me = test::world().split(test::world().rank(), 0, "solo");
    Drafter d(*me, cfg);
    d.init_params(5);
    params = to_host<float>(d.params().view());
  }
  const std::vector<float> hidden = random_normal(static_cast<std::size_t>(ctx * T), 6);
  const std::vector<float> noise = random_normal(static_cast<std::size_t>(cfg.block * cfg.hidden), 7);
  const auto run = [&](Backend& b) {
    ScopedBackend use(b);
    return draft_block(test::world(), cfg, params, hidden, ctx, noise);
  };
  const std::int64_t ops_before = test::guard_ops();
  const std::vector<float> cpu = run(cpu_backend()), guard = run(dev);
  if (test::device_under_test().exact) {
    EXPECT_GT(test::guard_ops(), ops_before);
  }
  ASSERT_EQ(cpu.size(), static_cast<std::size_t>(cfg.block * cfg.hidden));
  EXPECT_TRUE(test::matches_cpu(cpu, guard, test::kDeviceBoundF32)) << "the drafted hidden states differ";
}

// The draft KV cache (issue #53) on the guard device: the context appended in pieces (crossing its
// chunks over the ranks) and a block drafted after each, with a sliding layer, and with DFlash2's
// convolutions (their taps' projections off their zero init), equal to the CPU's run bit for bit;
// no host code touches its device memory.
TEST(DrafterOnGuardDevice, DraftCacheEqualsTheCpuRunBitForBit) {
  DIFFCP_DEVICE_OR_SKIP(dev);
  for (const bool dflash2 : {false, true}) {
    SCOPED_TRACE(dflash2 ? "dflash2" : "dflash");
    DrafterConfig cfg = drafter_preset("tiny");
    cfg.layer_types = {"sliding_attention", "full_attention"};
    cfg.sliding_window = 20;
    if (dflash2) {
      cfg.conv_taps = 3;
      cfg.conv_group_size = 16;
    }
    const std::int64_t T = cfg.target_layers * cfg.hidden;
    std::vector<float> params;
    {
      std::unique_ptr<Communicator> me = test::world().split(test::world().rank(), 0, "solo");
      Drafter d(*me, cfg);
      d.init_params(8);
      params = to_host<float>(d.params().view());
    }
    if (dflash2) {
      const DrafterLayout lay(cfg);
      const std::int64_t n = cfg.hidden * 2 * cfg.conv_taps * cfg.conv_groups();
      for (const auto& L : lay.layer)
        for (const std::int64_t proj : {L.attn_conv_proj, L.mlp_conv_proj}) {
          const std::vector<float> w = random_normal(static_cast<std::size_t>(n), static_cast<std::uint64_t>(proj), 0.1);
          std::copy(w.begin(), w.end(), params.begin() + proj);
        }
    }
    const std::vector<float> hidden = random_normal(static_cast<std::size_t>(600 * T), 9);
    const auto run = [&](Backend& b) {
      ScopedBackend use(b);
      DraftCache cache(test::world(), cfg, params);
      std::vector<float> out;
      std::int64_t at = 0;
      for (const std::int64_t piece : {1, 300, 7, 292}) {
        cache.append(std::span<const float>(hidden).subspan(static_cast<std::size_t>(at * T), static_cast<std::size_t>(piece * T)));
        at += piece;
        const std::vector<float> noise = random_normal(static_cast<std::size_t>(cfg.block * cfg.hidden), 10 + static_cast<std::uint64_t>(at));
        const std::vector<float> block = cache.draft(noise);
        out.insert(out.end(), block.begin(), block.end());
      }
      return out;
    };
    const std::int64_t ops_before = test::guard_ops();
    const std::vector<float> cpu = run(cpu_backend()), guard = run(dev);
    if (test::device_under_test().exact) {
      EXPECT_GT(test::guard_ops(), ops_before);
    }
    ASSERT_EQ(cpu.size(), static_cast<std::size_t>(4 * cfg.block * cfg.hidden));
    EXPECT_TRUE(test::matches_cpu(cpu, guard, test::kDeviceBoundF32)) << "the drafted hidden states differ";
  }
}

}  // namespace
}  // namespace diffcp
