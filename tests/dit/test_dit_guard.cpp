// The DiT's attention exchanges on the guard device (testing/guard_backend.hpp): qkv, out and the
// payload buffers in guard memory, the tokens packed and unpacked by the backend's row gather /
// scatter, the all-to-alls (flat, or TAPA's two phases) and USP's Ring hops staged through the
// host. Flat, TAPA, V-First and cocodiff (start_v, poll, attention, as the model calls them), f32 and bf16,
// at every rank count, group size L in {1, 2} and Ulysses degree U in {P, 1, P/2} (USP: Ring
// attention over P / U groups), and cocodiff (V-Major's caches, its L1 selection and selective
// steps): the output equals the CPU run's bit for bit. Then the whole model: `diffcp dit`'s sampling
// (weights, activations, modulation, RoPE table, the Euler update in guard memory) in every mode in
// f32, USP (Ring attention over all ranks) under Flat and cocodiff, bf16 compute (the rounded
// weights) under cocodiff, and bf16-stored weights sharded over the ranks (their all-gathers in
// guard memory) under V-First and Flat, and the fp8 wire under cocodiff (the codec as device ops,
// V-Major's fp8 caches, bf16 decode): every step's velocity and the final latent equal the CPU run's.
// The exchange test runs its f32 cases in both wires (fp8: Ring's K|V hops too).
// DIFFCP_TEST_DEVICE=cuda runs the same on a GPU (tests/support/device_under_test.hpp): within bounds of
// the CPU's run.
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/core/random.hpp"
#include "diffcp/dit/exchange.hpp"
#include "diffcp/dit/model.hpp"
#include "diffcp/dit/run.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/testing/guard_backend.hpp"
#include "device_under_test.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

TEST(DitExchangeOnGuardDevice, EqualsTheCpuRunBitForBit) {
  DIFFCP_DEVICE_OR_SKIP(dev);
  Communicator& world = test::world();
  const int P = world.size(), p = world.rank();
  const std::int64_t b = 2, n_p = 5, heads = 2 * P, d = 4, H = heads * d;
  ExchangeLayout l{b, n_p, heads, d, b * n_p + 3, {}, {}};  // scrambled rows, 3 rows outside the table
  for (std::int64_t i = 0; i < b * n_p; ++i) l.rows.push_back((i * 7 + 3) % (b * n_p + 3));
  const std::vector<float> qkv_init = random_normal(static_cast<std::size_t>(l.local_rows * 3 * H), 11 + p);
  const std::vector<float> out_init(static_cast<std::size_t>(l.local_rows * H), -1.f);
  // Ulysses degree U: P (no ring), 1 (USP: Ring attention over all P ranks), P / 2.
  std::vector<int> degrees{P};
  if (P > 1) degrees.push_back(1);
  if (P > 2 && P % 2 == 0) degrees.push_back(P / 2);
  // cocodiff: 6 steps, full at steps 0 and 1, selective with a fixed ratio after (the caches of two
  // layers per step: attention() twice per step).
  const CacheSchedule schedule{CacheScheduleKind::fixed, 0.6, 2, 0};
  for (const ExchangeMode mode : {ExchangeMode::flat, ExchangeMode::tapa, ExchangeMode::vfirst, ExchangeMode::cocodiff})
    for (const DType compute : {DType::f32, DType::bf16})
      for (const int U : degrees)
        for (const int L : {1, 2})
          for (const Wire wire : {Wire::compute, Wire::fp8}) {
          // (fp8 with bf16 compute: the sampling test below and test_guard's codec case)
          if (P % L != 0 || (U < P && L > 1) || (wire == Wire::fp8 && compute == DType::bf16)) continue;
          SCOPED_TRACE(std::string(exchange_mode_name(mode)) + " " + dtype_name(compute) + " U=" + std::to_string(U) +
                       " L=" + std::to_string(L) + " wire " + wire_name(wire));
          const auto run = [&](Backend& be) {
            ScopedBackend use(be);
            const auto ex = make_attention_exchange(mode, world, L, schedule, U);
            ex->set_compute(compute);
            ex->set_wire(wire);
            ex->set_layout(l);
            Buffer qkv = to_device(std::span<const float>(qkv_init), be), out = to_device(std::span<const float>(out_init), be);
            const HeadRows<const float> q{qkv.ptr<float>(), l.local_rows, 3 * heads, d, 3 * H};
            const HeadRows<float> o{out.ptr<float>(), l.local_rows, heads, d, H};
            const int steps = mode == ExchangeMode::cocodiff ? 6 : 2;  // the buffers are reused
            std::vector<float> qkv_step(qkv_init);
            for (int step = 0; step < steps; ++step) {
              ex->begin_step(step, steps);
              for (float& x : qkv_step) x *= 0.97f;  // the tokens change a little between steps
              for (int layer = 0; layer < 2; ++layer) {
                copy(qkv.view(), view_of(std::span<const float>(qkv_step)));
                ex->start_v(q);
                ex->poll();
                ex->attention(q, o);
              }
            }
            if (mode == ExchangeMode::cocodiff) {
              EXPECT_GT(ex->stats().selective, 0u);
            }
            return to_host<float>(out.view());
          };
          const std::vector<float> cpu = run(cpu_backend());
          const std::uint64_t staged = world.staging().calls;
          const std::vector<float> guard = run(dev);
          if (mode == ExchangeMode::flat && U == P) {
            EXPECT_GT(world.staging().calls, staged);
          }
          // (fp8: a code may round the other way on a device, so the bf16 bound)
          EXPECT_TRUE(test::matches_cpu(cpu, guard, test::device_bound(wire == Wire::fp8 ? DType::bf16 : compute)));
        }
}

// The other families' own ops run on the device too: Qwen-Image with true classifier-free guidance
// (txt_norm, rotated text rows, the guidance combination), FLUX.2 (shared modulation, SwiGLU in
// strided rows, four RoPE axes) and SD3.5 (the position table, the context-pre-only block, CFG):
// the guard run equals the CPU run bit for bit.
TEST(DitSamplingOnGuardDevice, QwenImageFlux2AndSd3EqualTheCpuRunBitForBit) {
  DIFFCP_DEVICE_OR_SKIP(dev);
  Communicator& world = test::world();
  for (const DitFamily family : {DitFamily::qwen_image, DitFamily::flux2, DitFamily::sd3}) {
    SCOPED_TRACE(dit_family_name(family));
    DitConfig cfg = dit_preset("tiny");
    cfg.family = family;
    cfg.heads = 24;
    cfg.head_dim = 8;
    cfg.mlp_hidden = 64;
    cfg.pooled_dim = 0;
    if (family == DitFamily::qwen_image) {
      cfg.rope_axes = {2, 2, 4};
      cfg.single_blocks = 0;
    } else if (family == DitFamily::sd3) {  // the position table (a device gather), the context-pre-only block
      cfg.rope_axes.clear();
      cfg.pos_embed_max = 16;
      cfg.pooled_dim = 32;
      cfg.single_blocks = 0;
      cfg.double_blocks = 2;
    } else {
      cfg.rope_axes = {2, 2, 2, 2};
      cfg.guidance_embed = true;
      cfg.qkv_bias = false;
    }
    const DitShape shape{1, 192, 128, 24};
    DitConditioning cond = prompt_conditioning(cfg, shape, "a guard prompt");
    if (cfg.true_cfg()) {
      const DitConditioning neg = prompt_conditioning(cfg, DitShape{1, 192, 128, 48}, "");
      cond.negative_txt = neg.txt;
      cond.negative_pooled = neg.pooled;
      cond.negative_tokens = 48;
    }
    const std::vector<float> noise = initial_noise(cfg, shape, 5);
    for (const ExchangeMode mode : {ExchangeMode::flat, ExchangeMode::cocodiff}) {
      SCOPED_TRACE(exchange_mode_name(mode));
      const auto run = [&](Backend& be) {
        ScopedBackend use(be);
        DitWeights w(cfg);
        w.init_random(3);
        const CacheSchedule schedule{CacheScheduleKind::fixed, 0.5, 1, 0};
        const auto ex = make_attention_exchange(mode, world, 1, schedule);
        const auto neg = make_attention_exchange(mode, world, 1, schedule);
        SampleOptions opt;
        opt.timesteps = flow_schedule(3, TimeSchedule::flux, shape.image_tokens());
        opt.guidance = 4.0;
        std::vector<std::vector<float>> out;
        opt.on_velocity = [&](int, const std::vector<float>& v) { out.push_back(v); };
        out.push_back(run_dit_sampling(world, w, shape, *ex, cond, noise, opt, neg.get()).latent);
        return out;
      };
      const auto cpu = run(cpu_backend());
      const auto guard = run(dev);
      ASSERT_EQ(cpu.size(), 4u);
      EXPECT_TRUE(test::matches_cpu(cpu, guard, test::kDeviceBoundF32));
    }
  }
}

// The tiny preset with 24 heads of 8 (every U and P in {1, 2, 3, 4, 8} divides the heads), and a
// shape of 96 image and 24 text tokens (every P divides them).
DitConfig every_p_config() {
  DitConfig cfg = dit_preset("tiny");
  cfg.heads = 24;
  cfg.head_dim = 8;
  cfg.rope_axes = flux_rope_axes(8);
  cfg.mlp_hidden = 64;
  return cfg;
}
constexpr DitShape kEveryPShape{1, 192, 128, 24};

TEST(DitSamplingOnGuardDevice, EveryModeEqualsTheCpuRunBitForBit) {
  DIFFCP_DEVICE_OR_SKIP(dev);
  Communicator& world = test::world();
  const int P = world.size();
  DitConfig cfg = every_p_config();
  cfg.guidance_embed = true;
  const DitShape shape = kEveryPShape;
  const DitConditioning cond = prompt_conditioning(cfg, shape, "a guard prompt");
  const std::vector<float> noise = initial_noise(cfg, shape, 5);
  const int steps = 4;
  const CacheSchedule schedule{CacheScheduleKind::fixed, 0.5, 2, 0};  // cocodiff: selective after step 2
  struct Case {
    ExchangeMode mode;
    DType compute;
    int U;
    DType storage = DType::f32;  // the weights' (dit/weights.hpp)
    bool shard = false;          // --shard-weights: the gathers read and write device memory
    Wire wire = Wire::compute;   // --wire
  };
  std::vector<Case> cases;
  for (const ExchangeMode mode : {ExchangeMode::flat, ExchangeMode::tapa, ExchangeMode::vfirst, ExchangeMode::cocodiff})
    cases.push_back({mode, DType::f32, P});
  cases.push_back({ExchangeMode::cocodiff, DType::bf16, P});
  cases.push_back({ExchangeMode::vfirst, DType::f32, P, DType::bf16, true});
  cases.push_back({ExchangeMode::flat, DType::bf16, P, DType::bf16, true});
  // The fp8 wire: V-Major's selective sends and fp8 caches, decoded into bf16 (Ring's fp8 K|V hops:
  // the exchange test above).
  cases.push_back({ExchangeMode::cocodiff, DType::bf16, P, DType::f32, false, Wire::fp8});
  if (P > 1)
    for (const ExchangeMode mode : {ExchangeMode::flat, ExchangeMode::cocodiff}) cases.push_back({mode, DType::f32, 1});
  for (const auto& [mode, compute, U, storage, shard, wire] : cases) {
    const int L = U == P && P % 2 == 0 ? 2 : 1;
    SCOPED_TRACE(std::string(exchange_mode_name(mode)) + " " + dtype_name(compute) + " U=" + std::to_string(U) +
                 " L=" + std::to_string(L) + " weights " + dtype_name(storage) + (shard ? " sharded" : "") + " wire " +
                 wire_name(wire));
    const auto run = [&](Backend& be) {
      ScopedBackend use(be);
      DitWeights w(cfg, storage, shard ? &world : nullptr);
      w.init_random(3);
      const auto ex = make_attention_exchange(mode, world, L, schedule, U);
      ex->set_wire(wire);
      SampleOptions opt;
      opt.timesteps = flow_schedule(steps, TimeSchedule::flux, shape.image_tokens());
      opt.compute = compute;
      std::vector<std::vector<float>> out;
      opt.on_velocity = [&](int, const std::vector<float>& v) { out.push_back(v); };
      out.push_back(run_dit_sampling(world, w, shape, *ex, cond, noise, opt).latent);
      if (mode == ExchangeMode::cocodiff) {
        EXPECT_GT(ex->stats().selective, 0u);
      }
      return out;
    };
    const auto cpu = run(cpu_backend());
    const std::int64_t ops = test::guard_ops();
    const auto guard = run(dev);
    if (test::device_under_test().exact) {
      EXPECT_GT(test::guard_ops(), ops);
    }
    ASSERT_EQ(cpu.size(), static_cast<std::size_t>(steps + 1));
    const bool rounded = compute == DType::bf16 || storage == DType::bf16 || wire == Wire::fp8;
    EXPECT_TRUE(test::matches_cpu(cpu, guard, test::device_bound(rounded ? DType::bf16 : DType::f32)));
  }
}

// Host syncs of the DiT step's computation (testing/guard_backend.hpp host_syncs; the
// communicators' staging of device memory left out: NCCL makes none), by the difference of a
// 4-step and an 8-step run: one per step (the latent read once a run aside), the same with 2 and 6
// blocks, in Flat mode and in cocodiff's selective steps (V-Major's choice stays on the device).
TEST(DitSamplingOnGuardDevice, HostSyncsPerStepDoNotGrowWithBlocks) {
  Communicator& world = test::world();
  const DitShape shape = kEveryPShape;
  const CacheSchedule schedule{CacheScheduleKind::fixed, 0.5, 1, 0};  // cocodiff: selective after step 1
  const auto per_step = [&](ExchangeMode mode, std::int64_t double_blocks, std::int64_t single_blocks) {
    ScopedBackend use(test::guard_under_test());
    DitConfig cfg = every_p_config();
    cfg.double_blocks = double_blocks;
    cfg.single_blocks = single_blocks;
    DitWeights w(cfg, DType::f32, nullptr);
    w.init_random(3);
    const DitConditioning cond = prompt_conditioning(cfg, shape, "a counted prompt");
    const std::vector<float> noise = initial_noise(cfg, shape, 5);
    const auto syncs = [&](int steps) {
      const auto ex = make_attention_exchange(mode, world, 1, schedule);
      SampleOptions opt;
      opt.timesteps = flow_schedule(steps, TimeSchedule::flux, shape.image_tokens());
      const auto count = [] { return test::guard_under_test().counters().host_syncs - Communicator::staged_reads(); };
      const std::int64_t before = count();
      (void)run_dit_sampling(world, w, shape, *ex, cond, noise, opt);
      if (mode == ExchangeMode::cocodiff) EXPECT_GT(ex->stats().selective, 0u);
      return count() - before;
    };
    const std::int64_t four = syncs(4), eight = syncs(8);
    return (eight - four) / 4.0;
  };
  for (const ExchangeMode mode : {ExchangeMode::flat, ExchangeMode::cocodiff}) {
    SCOPED_TRACE(exchange_mode_name(mode));
    const double two = per_step(mode, 1, 1), six = per_step(mode, 2, 4);
    EXPECT_EQ(two, six) << "2 blocks against 6";
    EXPECT_EQ(two, 1.0);
    if (world.rank() == 0) std::printf("host syncs per DiT step (%s, computation): %g\n", exchange_mode_name(mode), two);
  }
}

// Issue #52 on the guard device: CFG-parallel (the velocity pair's all-gather on device memory) and
// First-Block Cache (its residual copies, L1 sums and cached rows on device memory) under cocodiff
// in Qwen-Image: every step's velocity and the final latent equal the CPU run's bit for bit.
TEST(DitServingOnGuardDevice, CfgParallelAndStepCacheEqualTheCpuRunBitForBit) {
  DIFFCP_DEVICE_OR_SKIP(dev);
  Communicator& world = test::world();
  const int P = world.size();
  DitConfig cfg = dit_preset("tiny");
  cfg.family = DitFamily::qwen_image;
  cfg.heads = 24;
  cfg.head_dim = 8;
  cfg.rope_axes = {2, 2, 4};
  cfg.mlp_hidden = 64;
  cfg.pooled_dim = 0;
  cfg.single_blocks = 0;
  cfg.double_blocks = 2;
  const DitShape shape{1, 192, 128, 24};
  DitConditioning cond = prompt_conditioning(cfg, shape, "a guard prompt");
  const DitConditioning neg = prompt_conditioning(cfg, DitShape{1, 192, 128, 10}, "");
  cond.negative_txt = neg.txt;
  cond.negative_tokens = 10;
  const std::vector<float> noise = initial_noise(cfg, shape, 5);
  const std::optional<CfgGroups> groups = P % 2 == 0 ? std::optional<CfgGroups>(make_cfg_groups(world)) : std::nullopt;
  const auto run = [&](Backend& be) {
    ScopedBackend use(be);
    DitWeights w(cfg);
    w.init_random(3);
    Communicator& pass_comm = groups ? *groups->group : world;
    const CacheSchedule schedule{CacheScheduleKind::fixed, 0.5, 1, 0};
    const auto ex = make_attention_exchange(ExchangeMode::cocodiff, pass_comm, 1, schedule);
    const auto ex_neg = groups ? nullptr : make_attention_exchange(ExchangeMode::cocodiff, world, 1, schedule);
    SampleOptions opt;
    opt.timesteps = flow_schedule(4, TimeSchedule::flux, shape.image_tokens());
    opt.guidance = 4.0;
    opt.step_cache = parse_step_cache("fbcache:1e9");  // step 0 full, the others cached
    std::vector<std::vector<float>> out;
    opt.on_velocity = [&](int, const std::vector<float>& v) { out.push_back(v); };
    const DitRun r = run_dit_sampling(world, w, shape, *ex, cond, noise, opt, ex_neg.get(), groups ? &*groups : nullptr);
    out.push_back(r.latent);
    out.push_back({static_cast<float>(r.steps_cached[0]), static_cast<float>(r.steps_cached[1])});
    return out;
  };
  const auto cpu = run(cpu_backend());
  const auto guard = run(dev);
  ASSERT_EQ(cpu.size(), 6u);
  EXPECT_GT(cpu.back()[0], 0.f) << "the step cache skipped no step: the test covers less than it says";
  EXPECT_TRUE(test::matches_cpu(cpu, guard, test::kDeviceBoundF32));
}

}  // namespace
}  // namespace diffcp
