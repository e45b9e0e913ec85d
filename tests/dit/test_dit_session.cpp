// The DiT run policy as a library session (dit/session.hpp, issue #68). Runs at P = 1, 2, 3, 4, 8.
//
//   * DitRunConfig refuses every bad option by its field's name in backticks (what Python's
//     keywords are called; the CLI prints them as flags) and names no CLI flag; identically on
//     every rank, before any communication.
//   * plan_generation derives each family's pipeline defaults (guidance, schedule), drops the
//     negative prompt where its scale is 1, refuses a negative pass without negative
//     conditioning and cfg_parallel without a negative pass.
//   * DitSession::sample equals run_dit_sampling on exchanges made by hand (the path the CLI took
//     before the session), bitwise, in every mode, with classifier-free guidance.
//   * a batch of prompts (per-image text and pooled vectors, a server's requests) equals each image
//     run alone with its own prompt, within fp32 tolerance, in every family and mode;
//   * DitSession::velocity (what diffcp.diffusers calls) equals the one-rank session's within
//     fp32 tolerance, keeps a model per pass, rebuilds it when the shape changes, and, with
//     cfg_parallel, velocity_pair equals two sequential velocity calls.
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/dit/metrics.hpp"
#include "diffcp/dit/session.hpp"
#include "diffcp/testing/compare.hpp"
#include "dit_family_config.hpp"
#include "error_of.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

Communicator& world() { return test::world(); }

// 24 heads: every P <= 8 and every half of it divides them.
DitConfig session_config(DitFamily family) { return test::tiny_family_config(family, 24, 48, 1, 1, 12); }

const DitShape kShape{1, 112, 80, 13};  // a 5 x 7 grid: 35 image tokens, which no P > 1 here divides evenly but 5 and 7

// `o` checked for `cfg` as rank 0 of P: the error, or "" when accepted.
std::string refusal(const DitRunOptions& o, const DitConfig& cfg, int P = 4) {
  return error_of([&] { DitRunConfig run(o, cfg, P, 0); });
}

TEST(DitRunConfig, RefusesEveryBadOptionByItsFieldName) {
  const DitConfig flux1 = session_config(DitFamily::flux1);
  DitConfig schnell = flux1;
  schnell.guidance_embed = false;
  DitConfig one_block = flux1;
  one_block.single_blocks = 0;
  struct Case {
    const char* what;
    DitRunOptions o;
    DitConfig cfg;
    int P;
    std::string want;
  };
  std::vector<Case> cases;
  const auto add = [&](const char* what, auto edit, const DitConfig& cfg, int P, std::string want) {
    DitRunOptions o;
    edit(o);
    cases.push_back({what, o, cfg, P, std::move(want)});
  };
  add("mode", [](DitRunOptions& o) { o.mode = "ring"; }, flux1, 4, "`mode` 'ring': unknown mode");
  add("dtype", [](DitRunOptions& o) { o.dtype = "fp16"; }, flux1, 4, "`dtype` 'fp16': expected f32 or bf16");
  add("wire", [](DitRunOptions& o) { o.wire = "e5m2"; }, flux1, 4, "`wire` 'e5m2': unknown wire format");
  add("cache_ratio", [](DitRunOptions& o) { o.cache_ratio = 2; }, flux1, 4, "`cache_ratio` = 2, expected");
  add("cache_schedule", [](DitRunOptions& o) { o.cache_schedule = "cosine"; }, flux1, 4, "`cache_schedule` 'cosine'");
  add("warmup", [](DitRunOptions& o) { o.warmup = -1; }, flux1, 4, "`warmup` = -1");
  add("step_cache", [](DitRunOptions& o) { o.step_cache = "teacache:1"; }, flux1, 4, "`step_cache` 'teacache:1'");
  add("one block", [](DitRunOptions& o) { o.step_cache = "fbcache:0.1"; }, one_block, 4, "First-Block Cache needs at least two");
  add("steps", [](DitRunOptions& o) { o.steps = 0; }, flux1, 4, "`steps` = 0, expected >= 1");
  add("profile", [](DitRunOptions& o) { o.profile = true, o.steps = 1; }, flux1, 4, "`profile` times the steps after the first");
  add("odd P", [](DitRunOptions& o) { o.cfg_parallel = true; }, flux1, 3, "`cfg_parallel` splits the ranks into two equal halves");
  add("guidance", [](DitRunOptions& o) { o.guidance = 3.5; }, schnell, 4, "`guidance` 3.5: this model has no guidance_in");
  add("true_cfg_scale", [](DitRunOptions& o) { o.true_cfg_scale = 2; }, session_config(DitFamily::sd3), 4,
      "`true_cfg_scale`: FLUX.1's classifier-free guidance scale");
  add("ulysses_degree", [](DitRunOptions& o) { o.ulysses_degree = 3; }, flux1, 4, "`ulysses_degree` U = 3 does not divide P = 4");
  add("ring_degree", [](DitRunOptions& o) { o.ring_degree = 0; }, flux1, 4, "`ring_degree` = 0, expected >= 1");
  add("group_size", [](DitRunOptions& o) { o.group_size = -1; }, flux1, 4, "`group_size` = -1");
  add("weights_dtype", [](DitRunOptions& o) { o.weights_dtype = "fp8"; }, flux1, 4, "`weights_dtype` 'fp8'");
  add("shard_weights", [](DitRunOptions& o) { o.shard_weights = true, o.dtype = "bf16", o.weights_dtype = "f32"; }, flux1, 4,
      "`shard_weights` with bf16 compute needs the weights stored in bf16: `weights_dtype` bf16");
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string err = refusal(c.o, c.cfg, c.P);
    EXPECT_NE(err.find(c.want), std::string::npos) << err;
    EXPECT_EQ(err.find("--"), std::string::npos) << "a library error names a CLI flag: " << err;
  }
  // The defaults are accepted, and resolve: U over every rank that divides the heads, no ring.
  const DitRunConfig run(DitRunOptions{}, flux1, 8, 5);
  EXPECT_EQ(run.deg.ulysses, 8);
  EXPECT_EQ(run.deg.ring, 1);
  EXPECT_EQ(run.pass_P, 8);
  DitRunOptions cfg_par;
  cfg_par.cfg_parallel = true;
  cfg_par.shard_weights = true;
  const DitRunConfig half(cfg_par, flux1, 8, 5);
  EXPECT_EQ(half.pass_P, 4);
  EXPECT_EQ(half.pass_rank, 1);
  EXPECT_EQ(half.weight_shards, 4);
}

// A prompt's stand-in conditioning, with a negative prompt of 7 tokens where the family takes one.
DitConditioning conditioning(const DitConfig& cfg, bool negative = true) {
  DitConditioning c = prompt_conditioning(cfg, kShape, "a session test");
  if (negative && cfg.accepts_negative()) {
    const DitConditioning neg = prompt_conditioning(cfg, DitShape{1, 16, 16, 7}, "");
    c.negative_txt = neg.txt;
    c.negative_pooled = cfg.has_pooled() ? neg.pooled : std::vector<float>{};
    c.negative_tokens = 7;
  }
  return c;
}

TEST(PlanGeneration, DerivesEachFamilysPipelineDefaults) {
  struct Want {
    DitFamily family;
    double guidance;
    const char* schedule;
    bool negative_pass;
  };
  // FluxPipeline 3.5 (distilled: FLUX's shifted schedule; true CFG off at true_cfg_scale 1),
  // Flux2Pipeline 4 (its dynamic shift), QwenImagePipeline 4 and StableDiffusion3Pipeline 7 (true
  // CFG: the negative pass runs).
  for (const Want& w : {Want{DitFamily::flux1, 3.5, "flux", false}, Want{DitFamily::flux2, 4.0, "flux2", false},
                        Want{DitFamily::qwen_image, 4.0, "linear", true}, Want{DitFamily::sd3, 7.0, "linear", true}}) {
    SCOPED_TRACE(dit_family_name(w.family));
    DitConfig cfg = session_config(w.family);
    cfg.guidance_embed = w.family == DitFamily::flux1 || w.family == DitFamily::flux2;
    const DitRunConfig run(DitRunOptions{}, cfg, world().size(), world().rank());
    const DitGeneration g = plan_generation(run, kShape, conditioning(cfg));
    EXPECT_EQ(g.opt.guidance, w.guidance);
    EXPECT_EQ(g.schedule_name, w.schedule);
    EXPECT_EQ(g.negative_pass, w.negative_pass);
    EXPECT_EQ(g.cond.has_negative(), w.negative_pass) << "the negative prompt is dropped where no negative pass runs";
    EXPECT_EQ(g.opt.timesteps.size(), static_cast<std::size_t>(run.options.steps + 1));
  }
  const DitConfig qwen = session_config(DitFamily::qwen_image);
  DitRunOptions o;
  const DitRunConfig run(o, qwen, world().size(), world().rank());
  std::string err = error_of([&] { plan_generation(run, kShape, conditioning(qwen, false)); });
  EXPECT_NE(err.find("`guidance` 4: classifier-free guidance needs the negative prompt's embeddings"), std::string::npos) << err;
  o.guidance = 1.0;  // one conditional pass: no negative needed
  EXPECT_FALSE(plan_generation(DitRunConfig(o, qwen, world().size(), world().rank()), kShape, conditioning(qwen, false)).negative_pass);
  if (world().size() % 2 == 0) {
    o.cfg_parallel = true;
    err = error_of([&] { plan_generation(DitRunConfig(o, qwen, world().size(), world().rank()), kShape, conditioning(qwen)); });
    EXPECT_NE(err.find("`cfg_parallel`: this run has no negative pass to run beside the prompt's (`guidance` <= 1)"),
              std::string::npos) << err;
  }
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(DitSession, SampleEqualsTheRunOnExchangesMadeByHand) {
  const DitConfig cfg = session_config(DitFamily::qwen_image);
  for (const char* mode : {"flat", "tapa", "vfirst", "cocodiff"}) {
    SCOPED_TRACE(mode);
    DitRunOptions o;
    o.mode = mode;
    o.steps = 3;
    o.warmup = 1;
    o.cache_ratio = 0.5;
    DitSession session(world(), DitRunConfig(o, cfg, world().size(), world().rank()), nullptr, DitFileFormat::diffusers, 7);
    const DitGeneration g = plan_generation(session.run(), kShape, conditioning(cfg));
    ASSERT_TRUE(g.negative_pass);
    const std::vector<float> noise = initial_noise(cfg, kShape, 5);
    const DitRun run = session.sample(g, noise);
    const auto ex = make_attention_exchange(session.run().mode, world(), 0, session.run().schedule, 0);
    const auto neg = make_attention_exchange(session.run().mode, world(), 0, session.run().schedule, 0);
    const DitRun by_hand = run_dit_sampling(world(), session.weights(), kShape, *ex, g.cond, noise, g.opt, neg.get());
    EXPECT_TRUE(bitwise_equal(run.latent, by_hand.latent)) << "max |diff| " << max_abs_diff(run.latent, by_hand.latent);
    EXPECT_EQ(run.stats.bytes_inter + run.stats.bytes_intra, by_hand.stats.bytes_inter + by_hand.stats.bytes_intra);
    // The report's reductions: every rank the same figures, the steps counted, both passes.
    const DitReport r = session.report(g, run);
    EXPECT_EQ(r.P, world().size());
    EXPECT_EQ(r.cfg_passes, 2);
    EXPECT_EQ(r.steps_computed, (std::vector<int>{3, 3}));
    std::vector<double> mine{r.bytes_inter, r.bytes_intra, r.step_ms}, rank0 = mine;
    world().broadcast<double>(std::span<double>(rank0), 0);
    EXPECT_EQ(mine, rank0);
  }
}

TEST(DitSession, VelocityEqualsTheOneRankSessionAndFollowsTheShape) {
  const DitConfig cfg = session_config(DitFamily::flux1);
  const auto self = world().split(world().rank(), 0, "self");
  DitRunOptions o;
  o.mode = "cocodiff";
  o.cache_ratio = 0;  // exact
  DitSession par(world(), DitRunConfig(o, cfg, world().size(), world().rank()), nullptr, DitFileFormat::bfl, 3);
  DitSession one(*self, DitRunConfig(DitRunOptions{}, cfg, 1, 0), nullptr, DitFileFormat::bfl, 3);
  for (const DitShape& shape : {kShape, DitShape{2, 48, 64, 5}, kShape}) {  // a new shape rebuilds pass 0's model
    SCOPED_TRACE(std::to_string(shape.width) + "x" + std::to_string(shape.height));
    const DitConditioning c = prompt_conditioning(cfg, shape, "velocity");
    const std::vector<float> x = initial_noise(cfg, shape, 9);
    const std::vector<float> got = par.velocity(0, shape, x, c.txt, c.pooled, 0.7, 3.5, 0, 4);
    const std::vector<float> want = one.velocity(0, shape, x, c.txt, c.pooled, 0.7, 3.5, 0, 4);
    const std::vector<double> ref(want.begin(), want.end());
    const CompareResult r = compare<float>(got, ref, scaled_to(kTolF32, ref));
    EXPECT_TRUE(r.pass()) << "max_abs " << r.max_abs << " worst ratio " << r.worst_ratio;
  }
  const std::string err = error_of([&] { par.velocity_shape({1, 34, cfg.in_channels()}, 80, 112, {13, cfg.text_dim}, {cfg.pooled_dim}); });
  EXPECT_NE(err.find("velocity: 34 image tokens, a 112x80 image has 35"), std::string::npos) << err;
  if (world().size() % 2 == 1) return;
  // cfg_parallel: a pair of passes at once equals the two passes one after the other.
  const DitConfig qwen = session_config(DitFamily::qwen_image);
  DitRunOptions pair_o;
  pair_o.cfg_parallel = true;
  DitSession pair(world(), DitRunConfig(pair_o, qwen, world().size(), world().rank()), nullptr, DitFileFormat::diffusers, 4);
  DitSession seq(world(), DitRunConfig(DitRunOptions{}, qwen, world().size(), world().rank()), nullptr, DitFileFormat::diffusers, 4);
  const DitConditioning c = conditioning(qwen);
  const DitShape neg_shape = negative_shape(kShape, c);
  const std::vector<float> x = initial_noise(qwen, kShape, 2), none;
  const auto v = pair.velocity_pair(0, kShape, neg_shape, {&x, &c.txt, &none}, {&x, &c.negative_txt, &none}, 0.5, 0, 0, 2);
  const std::vector<float> v0 = seq.velocity(0, kShape, x, c.txt, none, 0.5, 0, 0, 2);
  const std::vector<float> v1 = seq.velocity(1, neg_shape, x, c.negative_txt, none, 0.5, 0, 0, 2);
  for (const auto& [a, b] : {std::pair{&v[0], &v0}, std::pair{&v[1], &v1}}) {
    const std::vector<double> ref(b->begin(), b->end());
    const CompareResult r = compare<float>(*a, ref, scaled_to(kTolF32, ref));
    EXPECT_TRUE(r.pass()) << "max_abs " << r.max_abs << " worst ratio " << r.worst_ratio;
  }
}

TEST(DitSession, ABatchOfPromptsEqualsEachImageAlone) {
  const DitShape one{1, 112, 80, 13}, three{3, 112, 80, 13};
  for (const DitFamily family : {DitFamily::flux1, DitFamily::flux2, DitFamily::qwen_image, DitFamily::sd3}) {
    const DitConfig cfg = session_config(family);
    for (const char* mode : {"flat", "cocodiff"}) {
      SCOPED_TRACE(std::string(dit_family_name(family)) + " " + mode);
      DitRunOptions o;
      o.mode = mode;
      o.cache_ratio = 0;  // exact
      DitSession session(world(), DitRunConfig(o, cfg, world().size(), world().rank()), nullptr, DitFileFormat::bfl, 8);
      std::vector<float> x, txt, pooled;
      std::vector<std::vector<float>> alone;
      const std::vector<float> noise = initial_noise(cfg, three, 4);
      const std::size_t per_x = noise.size() / 3;
      for (int j = 0; j < 3; ++j) {
        const DitConditioning c = prompt_conditioning(cfg, one, "prompt " + std::to_string(j));
        const std::vector<float> xj(noise.begin() + j * per_x, noise.begin() + (j + 1) * per_x);
        alone.push_back(session.velocity(j + 1, one, xj, c.txt, c.pooled, 0.6, 3.5, 0, 4));
        txt.insert(txt.end(), c.txt.begin(), c.txt.end());
        pooled.insert(pooled.end(), c.pooled.begin(), c.pooled.end());
      }
      ASSERT_EQ(session.velocity_shape({3, 35, cfg.in_channels()}, 80, 112, {3, 13, cfg.text_dim},
                                       {static_cast<std::int64_t>(pooled.size())}).batch, 3);
      const std::vector<float> batch = session.velocity(0, three, noise, txt, pooled, 0.6, 3.5, 0, 4);
      for (int j = 0; j < 3; ++j) {
        const std::vector<float> got(batch.begin() + j * per_x, batch.begin() + (j + 1) * per_x);
        const std::vector<double> ref(alone[j].begin(), alone[j].end());
        const CompareResult r = compare<float>(got, ref, scaled_to(kTolF32, ref));
        EXPECT_TRUE(r.pass()) << "image " << j << ": max_abs " << r.max_abs << " worst ratio " << r.worst_ratio;
      }
      // The images differ (their prompts do): a batch that shared image 0's prompt would fail above.
      EXPECT_GT(max_abs_diff(alone[0], alone[1]), 1e-3);
    }
  }
}

}  // namespace
}  // namespace diffcp
