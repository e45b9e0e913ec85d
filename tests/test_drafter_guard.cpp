// The drafter on the guard device (testing/guard_backend.hpp): its parameters, gradients, AdamW
// moments, activations, logit chunks and scratch live in guard memory, which the host cannot touch
// outside the backend's ops and copies; the collectives stage through host buffers. `train` for 20
// steps in each --shard mode (none, optimizer, full: the vocabulary-parallel LM head and
// activation recomputation with it) and one `draft` block equal the CPU backend's runs bit for
// bit (every step's loss and gradient norm, the final parameters, the drafted hidden states). A
// host loop over device memory left anywhere in the drafter faults the test.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/core/random.hpp"
#include "diffcp/drafter/draft.hpp"
#include "diffcp/drafter/model.hpp"
#include "diffcp/drafter/trainer.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/testing/guard_backend.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

struct TrainRun {
  std::vector<double> loss, grad_norm;  // per step
  std::vector<float> params;            // after the last step
  double tau = 0;
};

TrainRun train_on(Backend& b, const TrainOptions& opt) {
  ScopedBackend use(b);
  TrainRun r;
  const TrainResult res = train(test::world(), opt, [&](const TrainEvent& e) {
    if (e.kind != TrainEvent::Kind::step) return;
    r.loss.push_back(e.stats->loss);
    r.grad_norm.push_back(e.stats->grad_norm);
  });
  r.params = res.params;
  r.tau = res.tau;
  return r;
}

TEST(DrafterOnGuardDevice, TrainEqualsTheCpuRunBitForBitInEveryShardMode) {
  TrainOptions opt;  // the tiny preset, 20 short steps
  opt.steps = 20;
  opt.accum = 1;
  opt.context = 64;
  opt.anchors = 3;
  opt.bucket = 32;
  opt.eval_every = 0;  // the last step evaluates (predictions come back to the host)
  for (const char* shard : {"none", "optimizer", "full"}) {
    SCOPED_TRACE(shard);
    opt.shard = shard;
    const std::int64_t ops_before = guard_backend().counters().ops;
    const TrainRun cpu = train_on(cpu_backend(), opt);
    const TrainRun guard = train_on(guard_backend(), opt);
    EXPECT_GT(guard_backend().counters().ops, ops_before);  // it ran on the guard device
    ASSERT_EQ(cpu.loss.size(), 20u);
    EXPECT_EQ(guard.loss, cpu.loss);
    EXPECT_EQ(guard.grad_norm, cpu.grad_norm);
    EXPECT_EQ(guard.tau, cpu.tau);
    ASSERT_EQ(guard.params.size(), cpu.params.size());
    EXPECT_TRUE(guard.params == cpu.params) << "the trained parameters differ";
  }
}

TEST(DrafterOnGuardDevice, DraftEqualsTheCpuRunBitForBit) {
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
  const std::int64_t ops_before = guard_backend().counters().ops;
  const std::vector<float> cpu = run(cpu_backend()), guard = run(guard_backend());
  EXPECT_GT(guard_backend().counters().ops, ops_before);
  ASSERT_EQ(cpu.size(), static_cast<std::size_t>(cfg.block * cfg.hidden));
  EXPECT_TRUE(guard == cpu) << "the drafted hidden states differ";
}

}  // namespace
}  // namespace diffcp
