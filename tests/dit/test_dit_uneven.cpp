// Any token count at any P (issue #35): text and image token counts that P does not divide run with
// padding rows (dit/config.hpp, DitShard) and equal the single-process run to fp32 rounding. Runs at
// P = 1..8 (5, 6 and 7 too: ctest registers this file at every P).
//
// Covered, at every P, with odd image grids (multiples of 16 pixels) and text counts P does not
// divide, down to ranks (and at P = 8 whole Ulysses groups of USP) that hold no real token:
//   * the shard: T_p = ceil(T/P), I_p = ceil(N_img/P), the real rows per rank sum to T and N_img.
//   * every family (FLUX.1, Qwen-Image with a negative prompt of another length, FLUX.2, SD3.5 with
//     its position table) and every mode (flat, TAPA, V-First, CoCoDiff at r = 0) against the
//     one-rank run, batch 2 (fp32 tolerance, as test_dit's EqualsSingleProcess tests); TAPA and
//     V-First bitwise Flat's.
//   * USP (Ulysses x Ring) at every degree pair: the same, and Ring's bytes the closed form of the
//     padded n_p (the closed forms take n_p = T_p + I_p).
//   * the padding rows' velocity is 0, so the padded latent rows stay 0.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/dit/run.hpp"
#include "diffcp/dit/sampler.hpp"
#include "diffcp/dit/vmajor.hpp"
#include "diffcp/testing/compare.hpp"
#include "dit_family_config.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

Communicator& world() { return test::world(); }

// 2P heads (so Ulysses runs over all P ranks); FLUX's one block of each kind, two double blocks
// in the families without single ones.
DitConfig uneven_config(DitFamily family) {
  const bool singles = family == DitFamily::flux1 || family == DitFamily::flux2;
  return test::tiny_family_config(family, 2 * world().size(), 48, singles ? 1 : 2, 1, 12);
}

// 112 x 80 pixels: a 5 x 7 grid, 35 image tokens; 13 text tokens (prime: no P > 1 divides either).
// 48 x 16: 3 image tokens and 2 text tokens, fewer than the ranks at P > 3.
const DitShape kShapes[] = {{2, 112, 80, 13}, {2, 48, 16, 2}};

struct Pass {
  DitConditioning cond;
  SampleOptions opt;
};

Pass make_pass(const DitConfig& cfg, const DitShape& shape) {
  Pass p{prompt_conditioning(cfg, shape, "an uneven test"),
         {flow_schedule(3, TimeSchedule::flux, shape.image_tokens()), 4.0, {}}};
  if (cfg.true_cfg()) {  // a negative prompt of 5 tokens: its own padding
    const DitConditioning neg = prompt_conditioning(cfg, DitShape{1, 16, 16, 5}, "");
    p.cond.negative_txt = neg.txt;
    p.cond.negative_pooled = cfg.has_pooled() ? neg.pooled : std::vector<float>{};
    p.cond.negative_tokens = 5;
  }
  return p;
}

DitRun sample(Communicator& comm, const DitWeights& w, const DitShape& shape, const Pass& pass, ExchangeMode mode, int L,
              int U = 0) {
  const CacheSchedule r0{CacheScheduleKind::fixed, 0.0, 0, 0};
  const auto ex = make_attention_exchange(mode, comm, L, r0, U);
  const auto neg = make_attention_exchange(mode, comm, L, r0, U);
  return run_dit_sampling(comm, w, shape, *ex, pass.cond, initial_noise(w.config(), shape, 5), pass.opt, neg.get());
}

TEST(DitUneven, ShardCountsCoverEveryToken) {
  const int P = world().size();
  for (const DitShape& shape : kShapes) {
    std::int64_t text = 0, image = 0;
    for (int r = 0; r < P; ++r) {
      const DitShard s = make_dit_shard(uneven_config(DitFamily::flux1), shape, P, r);
      EXPECT_EQ(s.text_p, (shape.text_tokens + P - 1) / P);
      EXPECT_EQ(s.image_p, (shape.image_tokens() + P - 1) / P);
      EXPECT_EQ(s.padded(), shape.text_tokens % P != 0 || shape.image_tokens() % P != 0);
      text += s.text_valid(r);
      image += s.image_valid(r);
    }
    EXPECT_EQ(text, shape.text_tokens);
    EXPECT_EQ(image, shape.image_tokens());
  }
}

TEST(DitUneven, EveryFamilyAndModeEqualsSingleProcess) {
  auto self = world().split(world().rank(), 0, "self");
  for (const DitFamily family : {DitFamily::flux1, DitFamily::qwen_image, DitFamily::flux2, DitFamily::sd3}) {
    const DitConfig cfg = uneven_config(family);
    DitWeights w(cfg);
    w.init_random(23);
    for (const DitShape& shape : kShapes) {
      SCOPED_TRACE(std::string(dit_family_name(family)) + " " + std::to_string(shape.width) + "x" +
                   std::to_string(shape.height) + ", T = " + std::to_string(shape.text_tokens));
      const Pass pass = make_pass(cfg, shape);
      const std::vector<float> single = sample(*self, w, shape, pass, ExchangeMode::flat, 1).latent;
      const std::vector<double> ref(single.begin(), single.end());
      std::vector<float> flat;
      for (const ExchangeMode mode : {ExchangeMode::flat, ExchangeMode::tapa, ExchangeMode::vfirst, ExchangeMode::cocodiff}) {
        SCOPED_TRACE(exchange_mode_name(mode));
        const int L = mode == ExchangeMode::flat ? 1 : (world().size() % 2 == 0 ? 2 : 1);
        const std::vector<float> got = sample(world(), w, shape, pass, mode, L).latent;
        for (const float v : got) ASSERT_TRUE(std::isfinite(v));
        const CompareResult c = compare<float>(got, ref, scaled_to(kTolF32, ref));
        EXPECT_TRUE(c.pass()) << "max_abs " << c.max_abs << " max_rel " << c.max_rel << " worst ratio " << c.worst_ratio;
        if (mode == ExchangeMode::flat) flat = got;
        if (mode == ExchangeMode::tapa || mode == ExchangeMode::vfirst) {
          EXPECT_EQ(0, std::memcmp(got.data(), flat.data(), got.size() * sizeof(float)));
        }
      }
    }
  }
}

TEST(DitUneven, UspEveryDegreeEqualsSingleProcessWithPaddedRingBytes) {
  const int P = world().size();
  if (P == 1) GTEST_SKIP() << "USP needs P > 1";
  const DitConfig cfg = uneven_config(DitFamily::flux1);
  DitWeights w(cfg);
  w.init_random(29);
  auto self = world().split(world().rank(), 0, "self");
  for (const DitShape& shape : kShapes) {
    SCOPED_TRACE(std::to_string(shape.width) + "x" + std::to_string(shape.height));
    const Pass pass = make_pass(cfg, shape);
    const std::vector<float> single = sample(*self, w, shape, pass, ExchangeMode::flat, 1).latent;
    const std::vector<double> ref(single.begin(), single.end());
    const DitShard s = make_dit_shard(cfg, shape, P, world().rank());
    for (int U = 1; U < P; ++U) {
      if (P % U != 0) continue;
      SCOPED_TRACE("U = " + std::to_string(U));
      for (const ExchangeMode mode : {ExchangeMode::flat, ExchangeMode::cocodiff}) {
        SCOPED_TRACE(exchange_mode_name(mode));
        const DitRun run = sample(world(), w, shape, pass, mode, 1, U);
        const CompareResult c = compare<float>(run.latent, ref, scaled_to(kTolF32, ref));
        EXPECT_TRUE(c.pass()) << "max_abs " << c.max_abs << " max_rel " << c.max_rel << " worst ratio " << c.worst_ratio;
        const std::int64_t layers = cfg.double_blocks + cfg.single_blocks;
        EXPECT_EQ(run.stats.ring_bytes, 3u * static_cast<std::uint64_t>(layers) *
                                            ring_kv_bytes(P / U, shape.batch * s.tokens_p(), cfg.hidden()));
      }
    }
  }
}

TEST(DitUneven, PaddingRowsHaveZeroVelocity) {
  const int P = world().size();
  const DitConfig cfg = uneven_config(DitFamily::flux1);
  DitWeights w(cfg);
  w.init_random(31);
  const DitShape shape = kShapes[0];
  const auto ex = make_attention_exchange(ExchangeMode::flat, world(), 1);
  DitModel model(w, shape, *ex);
  const DitShard& s = model.shard();
  std::vector<float> x_p = shard_latent(initial_noise(cfg, shape, 3), cfg, shape, s);
  const std::int64_t C = cfg.in_channels(), iv = s.image_valid(s.p);
  euler_sample(model, x_p, prompt_conditioning(cfg, shape, "zero"), {flow_schedule(2), 3.5, {}});
  double pad = 0, real = 0;
  for (std::int64_t j = 0; j < shape.batch; ++j)
    for (std::int64_t i = 0; i < s.image_p; ++i)
      for (std::int64_t c = 0; c < C; ++c) (i < iv ? real : pad) += std::abs(x_p[static_cast<std::size_t>((j * s.image_p + i) * C + c)]);
  EXPECT_EQ(pad, 0.0);
  if (iv > 0) {
    EXPECT_GT(real, 0.0);
  }
  if (P > 1) {
    EXPECT_TRUE(s.padded());
  }
}

}  // namespace
}  // namespace diffcp
