// The drafter trainer on P ranks: one step with Split-KV at P equals the single-process step
// (loss and updated parameters), DP x CP equals P = 1 with the same global batch, the loss on the
// synthetic default falls well below the uniform baseline, and a run killed at step k and resumed
// equals the uninterrupted run bitwise.
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <map>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "diffcp/testing/compare.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/cp/splitkv.hpp"
#include "diffcp/drafter/checkpoint.hpp"
#include "diffcp/drafter/data.hpp"
#include "diffcp/drafter/trainer.hpp"
#include "diffcp/io/safetensors.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

using test::world;

TrainOptions small(std::int64_t steps) {
  TrainOptions o;
  o.steps = steps;
  o.accum = 1;
  o.context = 384;
  o.anchors = 6;
  o.lr = 1e-2;
  o.eval_every = 0;
  o.bucket = 64;
  return o;
}

// Run on a communicator of size 1 (every rank alone): the single-process reference.
TrainResult solo(const TrainOptions& o) {
  auto me = world().split(world().rank(), 0, "solo");
  return train(*me, o);
}

void expect_same_step(const TrainResult& a, const TrainResult& ref) {
  EXPECT_NEAR(a.loss, ref.loss, 1e-5 * std::abs(ref.loss));
  ASSERT_EQ(a.params.size(), ref.params.size());
  const std::vector<double> r(ref.params.begin(), ref.params.end());
  // After one AdamW step every parameter moved by ~lr; fp32 reassociation across ranks changes
  // the gradients in their last bits, which Adam's normalisation amplifies for gradients near
  // zero: its first update is lr * g / |g|, so a gradient of ~1e-8 whose last bits differ moves
  // its parameter by a different fraction of lr. So: every parameter within 2e-4 + 1e-3 |x|
  // except at most 1 in 5000, and those by less than one step of the runs' lr (1e-2) in total.
  const CompareResult c = compare<float>(a.params, r, Tolerance{2e-4, 1e-3});
  EXPECT_LE(c.mismatched, std::max<std::int64_t>(1, static_cast<std::int64_t>(r.size()) / 5000))
      << c.mismatched << " parameters differ, max abs err " << c.max_abs << " at " << c.worst;
  EXPECT_LT(c.max_abs, 1e-2) << "parameter " << c.worst;
}

TEST(Trainer, ContextParallelStepEqualsSingleProcess) {
  const TrainOptions o = small(2);
  const TrainResult ref = solo(o);
  const TrainResult cp = train(world(), o);  // cp = P, dp = 1
  expect_same_step(cp, ref);
}

// DFlash2 (--arch dflash2: convolutions and the candidate selector) at P ranks equals one process,
// replicated and with the state and the LM head sharded (the candidates merged across the
// vocabulary slices); the selector's figures are reported and its loss is part of the loss.
TEST(Trainer, Dflash2ContextParallelStepEqualsSingleProcess) {
  for (const char* shard : {"none", "full"}) {
    TrainOptions o = small(2);
    o.arch = "dflash2";
    o.shard = shard;
    const TrainResult ref = solo(o);
    std::optional<double> recall;
    const TrainResult cp = train(world(), o, [&](const TrainEvent& ev) {
      if (ev.kind == TrainEvent::Kind::step) recall = ev.stats->candidate_recall;
    });
    expect_same_step(cp, ref);
    ASSERT_TRUE(recall.has_value());
    EXPECT_GT(*recall, 0.0);
    EXPECT_LE(*recall, 1.0);
  }
  if (world().size() % 2 == 0 && world().size() >= 4) {  // DP x CP, sharded, evaluated after the last step
    TrainOptions o = small(2);
    o.arch = "dflash2";
    o.dp = 2;
    const TrainResult ref = train(world(), o);
    o.shard = "full";
    expect_same_step(train(world(), o), ref);
  }
}

// Ranks in emulated nodes of 2 (DIFFCP_NODE, as scripts/emucluster.sh sets it): the CP group's
// topology has several nodes, so Split-KV runs its hierarchical collectives; the step still equals
// the single-process one.
TEST(Trainer, HierarchicalCollectivesAcrossNodesEqualSingleProcess) {
  if (world().size() < 3) GTEST_SKIP() << "needs 2 nodes with 2 ranks in one: P >= 3";
  TrainOptions o = small(2);
  o.collectives = "hierarchical";
  const TrainResult ref = solo(o);
  ASSERT_EQ(setenv("DIFFCP_NODE", std::to_string(world().rank() / 2).c_str(), 1), 0);
  const TrainResult cp = train(world(), o);
  unsetenv("DIFFCP_NODE");
  EXPECT_EQ(cp.collectives, "hierarchical") << cp.topology;
  expect_same_step(cp, ref);
  o.collectives = "ring";
  EXPECT_THROW(train(world(), o), Error);
}

TEST(Trainer, DataTimesContextParallelEqualsSingleProcessWithTheSameGlobalBatch) {
  const int P = world().size();
  if (P % 2 != 0 || P < 4) GTEST_SKIP() << "needs an even P >= 4";
  TrainOptions mesh = small(2);
  mesh.dp = 2;  // cp = P / 2; global batch = dp * accum = 2 micro-batches
  TrainOptions ref_opt = small(2);
  ref_opt.accum = 2;  // the same two micro-batches, accumulated on one rank
  expect_same_step(train(world(), mesh), solo(ref_opt));
}

TEST(Trainer, LossFallsWellBelowUniformOnTheSyntheticDefault) {
  if (world().size() > 2) GTEST_SKIP() << "one run at P = 1 and P = 2 is enough";
  TrainOptions o;  // the default data and shapes, a shorter schedule
  o.steps = 250;
  o.lr = 1e-2;
  o.eval_every = 0;
  const TrainResult r = train(world(), o);
  EXPECT_LT(r.loss, 0.75 * r.uniform_loss) << "loss " << r.loss << " vs uniform " << r.uniform_loss;
}

// Mixed precision (--dtype bf16: bf16 attention, payloads and GEMMs; f32 master weights, AdamW,
// loss and gradient reduction) trains like f32: the loss at step 400 of the default run within 2 %
// of the f32 run's (measured 0.1-0.4 %), and both far below uniform.
TEST(Trainer, Bf16MixedPrecisionLossAtStep400Within2PercentOfF32) {
  if (world().size() > 2) GTEST_SKIP() << "one run at P = 1 and P = 2 is enough";
  TrainOptions o;  // the default data, shapes and 400-step schedule
  o.eval_every = 0;
  o.keep_params = false;
  const TrainResult f32 = train(world(), o);
  o.dtype = "bf16";
  const TrainResult bf16 = train(world(), o);
  EXPECT_EQ(bf16.dtype, "bf16");
  EXPECT_LT(std::abs(bf16.loss - f32.loss), 0.02 * f32.loss) << "bf16 loss " << bf16.loss << ", f32 " << f32.loss;
  EXPECT_LT(bf16.loss, 0.75 * bf16.uniform_loss);
  o.dtype = "fp16";
  EXPECT_THROW(train(world(), o), Error);
}

// The auto choices: ZeRO-1 (--shard optimizer) for the synthetic shapes on more than one rank,
// none alone; Split-KV's output projection owned when n_q d_h <= H (no more bytes, 1/P of the
// FLOPs), else all; explicit values win, unknown ones are refused.
TEST(Trainer, AutoShardsTheOptimizerAndPicksTheOutputProjectionByShape) {
  TrainOptions o = small(1);
  const TrainResult r = train(world(), o);
  EXPECT_EQ(r.shard, world().size() > 1 ? "optimizer" : "none");
  const DrafterConfig tiny = drafter_preset("tiny");
  EXPECT_EQ(r.oproj, tiny.n_q * tiny.d_h <= tiny.hidden ? "owned" : "all");
  const DrafterConfig wide = drafter_preset("qwen3.5-35b-a3b"), narrow = drafter_preset("qwen3.5-27b");
  ASSERT_EQ(wide.n_q * wide.d_h, 2 * wide.hidden);  // owned would send more bytes
  EXPECT_EQ(choose_oproj_by_shape(wide.attn()), OProj::all);
  ASSERT_LT(narrow.n_q * narrow.d_h, narrow.hidden);  // 4096 < 5120: owned sends fewer
  EXPECT_EQ(choose_oproj_by_shape(narrow.attn()), OProj::owned);
  o.oproj = "all";
  EXPECT_EQ(train(world(), o).oproj, "all");
  o.oproj = "rows";
  EXPECT_THROW(train(world(), o), Error);
}

// --shard optimizer (AdamW moments sharded) and full (parameters, gradients, moments sharded over
// the mesh; the LM head vocabulary-parallel over the CP group) train like the replicated state:
// the same losses and parameters to fp32 rounding, with gradient accumulation (full
// reduce-scatters per micro-batch).
TEST(Trainer, ShardedStateTrainsLikeTheReplicatedOne) {
  TrainOptions o = small(3);
  o.accum = 2;
  o.shard = "none";
  const TrainResult ref = train(world(), o);
  for (const char* mode : {"optimizer", "full"}) {
    o.shard = mode;
    const TrainResult sh = train(world(), o);
    EXPECT_EQ(sh.shard, mode);
    expect_same_step(sh, ref);
  }
  if (world().size() % 2 == 0 && world().size() >= 4) {  // a DP x CP mesh: gathers over all of it
    o.dp = 2;
    o.shard = "none";
    const TrainResult mesh_ref = train(world(), o);
    o.shard = "full";
    expect_same_step(train(world(), o), mesh_ref);
    o.dp = 1;
  }
  o.shard = "full";
  // Activation recomputation reruns the same forward: bitwise the same step.
  o.recompute = "off";
  const TrainResult kept = train(world(), o);
  o.recompute = "on";
  const TrainResult again = train(world(), o);
  EXPECT_TRUE(again.recompute);
  EXPECT_EQ(again.params, kept.params);
  EXPECT_EQ(again.loss, kept.loss);
}

// A checkpoint holds full vectors whatever mesh wrote it: written by the sharded P-rank run and
// resumed by one process, and written by one process and resumed sharded on P ranks; both equal
// the uninterrupted single-process run to fp32 rounding (the reduction order changes with P).
TEST(Trainer, ShardedCheckpointResumesOnAnotherNumberOfRanks) {
  const auto dir = std::filesystem::path(::testing::TempDir()) / ("remesh_np" + std::to_string(world().size()));
  const std::string mine = "r" + std::to_string(world().rank());
  if (world().rank() == 0) std::filesystem::create_directories(dir);
  world().barrier();
  const TrainResult ref = solo(small(4));
  TrainOptions a = small(4);  // P ranks, sharded, killed after step 2
  a.shard = "full";
  a.out = (dir / "wide").string();
  a.save_every = 2;
  a.stop_at = 2;
  train(world(), a);
  std::filesystem::create_directories(dir / mine);
  std::filesystem::copy_file(dir / "wide" / "checkpoint.bin", dir / mine / "checkpoint.bin",
                             std::filesystem::copy_options::overwrite_existing);
  TrainOptions b = small(4);  // ... resumed alone
  b.out = (dir / mine).string();
  b.resume = true;
  expect_same_step(solo(b), ref);
  TrainOptions c = small(4);  // one process killed after step 2 ...
  c.out = (dir / ("solo" + mine)).string();
  c.save_every = 2;
  c.stop_at = 2;
  solo(c);
  world().barrier();
  TrainOptions d = small(4);  // ... resumed sharded on P ranks (rank 0's file)
  d.shard = "full";
  d.out = (dir / "solor0").string();
  d.resume = true;
  expect_same_step(train(world(), d), ref);
}

// Replicated and sharded (--shard full: each rank's slices of the parameters and moments, written
// by rank 0 unit by unit) alike; DFlash2 sharded too.
TEST(Trainer, ResumeAfterAKillIsBitwiseEqualToTheUninterruptedRun) {
  for (const auto& [shard, arch] : {std::pair{"none", "dflash"}, std::pair{"full", "dflash"}, std::pair{"full", "dflash2"}}) {
    const auto dir = std::filesystem::path(::testing::TempDir()) /
                     ("resume_" + std::string(shard) + "_" + arch + "_np" + std::to_string(world().size()));
    auto opts = [&](const std::string& name) {
      TrainOptions o = small(6);
      o.shard = shard;
      o.arch = arch;
      o.out = (dir / name).string();
      o.save_every = 1;
      return o;
    };
    // The loss of every step, as the trainer reports it (the CLI's --log writes these).
    auto into = [](std::vector<double>& losses) {
      return [&losses](const TrainEvent& ev) {
        if (ev.kind == TrainEvent::Kind::step) losses.push_back(ev.stats->loss);
      };
    };
    if (world().rank() == 0) std::filesystem::create_directories(dir);
    world().barrier();
    std::vector<double> a, b;
    const TrainResult full = train(world(), opts("full"), into(a));
    TrainOptions killed = opts("killed");
    killed.stop_at = 3;
    train(world(), killed, into(b));
    TrainOptions resumed = opts("killed");
    resumed.resume = true;
    const TrainResult res = train(world(), resumed, into(b));
    EXPECT_EQ(res.params, full.params);  // bitwise
    EXPECT_EQ(res.loss, full.loss);
    EXPECT_EQ(a.size(), 6u);
    EXPECT_EQ(a, b);  // the loss curve of killed + resumed equals the uninterrupted one, bitwise
  }
}

// The class the CLI drives: a loop of step() and save() is the run train() makes, bitwise;
// step() evaluates as TrainOptions::eval_every says (and after the last step) and reports every
// step and checkpoint to the logger; evaluate() changes no state.
TEST(Trainer, StepLoopEqualsTrainAndReportsEveryStep) {
  const auto dir = std::filesystem::path(::testing::TempDir()) / ("loop_np" + std::to_string(world().size()));
  TrainOptions o = small(3);
  o.eval_every = 2;
  const TrainResult ref = train(world(), o);
  std::vector<std::int64_t> reported;
  std::vector<std::string> saved;
  Trainer t(world(), o, [&](const TrainEvent& ev) {
    if (ev.kind == TrainEvent::Kind::step) reported.push_back(ev.stats->step);
    else saved.push_back(ev.checkpoint);
  });
  EXPECT_EQ(t.step_index(), 0);
  std::vector<bool> evaluated;
  double last_loss = 0;
  while (t.step_index() < o.steps) {
    const StepStats st = t.step();
    EXPECT_EQ(st.step, t.step_index());
    EXPECT_EQ(st.slot_accuracy.size(), static_cast<std::size_t>(drafter_preset("tiny").block - 1));
    EXPECT_EQ(st.phases.size(), ref.phases.size());
    std::map<std::string, double> ph(st.phases.begin(), st.phases.end());
    ASSERT_EQ(ph.size(), st.phases.size()) << "phase names repeat";
    for (const char* name : {"target_features", "redistribution", "fusion", "attention", "attention_comm", "mlp",
                             "lm_head", "gather_wait", "reduce", "optimizer"}) {
      ASSERT_TRUE(ph.count(name)) << name;
      EXPECT_GE(ph[name], 0) << name;
    }
    EXPECT_LE(ph["attention_comm"], ph["attention"]);  // a part of attention, not a phase beside it
    EXPECT_GT(ph["attention"], 0);
    EXPECT_GT(ph["redistribution"], 0);
    EXPECT_GT(st.tokens, 0);
    evaluated.push_back(st.tau.has_value());
    last_loss = st.loss;
  }
  EXPECT_EQ(reported, (std::vector<std::int64_t>{1, 2, 3}));
  EXPECT_EQ(evaluated, (std::vector<bool>{false, true, true}));
  EXPECT_THROW(t.step(), Error);  // the run is done
  const std::string path = (dir / "checkpoint.bin").string();
  t.save(path);
  EXPECT_EQ(saved, std::vector<std::string>{path});
  EXPECT_EQ(t.evaluate(), ref.tau);
  const TrainResult r = t.result();
  EXPECT_EQ(r.params, ref.params);
  EXPECT_EQ(r.loss, ref.loss);
  EXPECT_EQ(last_loss, ref.loss);
  EXPECT_EQ(r.tau, ref.tau);
  if (world().rank() == 0) {
    EXPECT_EQ(load_checkpoint(path).meta.at("step"), 3);
  }
}

// The synthetic corpus exported as safetensors shards (the format tools/extract_shards.py
// writes) trains exactly like the in-memory synthetic source.
// Shards holding the synthetic source's samples (tools/extract_shards.py's format). greedy: no
// target_greedy (0), the dataset tokens themselves (1), or tokens + 1 (2); meta: metadata naming
// target layers [3, 7] of a 12-layer target.
void write_shards(const std::filesystem::path& dir, const DrafterConfig& cfg, int greedy, bool meta) {
  std::filesystem::create_directories(dir);
  SyntheticSpec spec;
  spec.max_length = 256;
  const auto src = make_synthetic_source(cfg, spec);
  std::map<std::string, std::string> md;
  if (meta) md = {{"target_layer_ids", "[3, 7]"}, {"num_target_layers", "12"}};
  std::vector<std::int32_t> all_tokens(static_cast<std::size_t>(cfg.vocab));
  for (std::size_t v = 0; v < all_tokens.size(); ++v) all_tokens[v] = static_cast<std::int32_t>(v);
  std::vector<float> embedding(static_cast<std::size_t>(cfg.vocab * cfg.hidden)), lm_head(embedding.size());
  src->embedding_rows(all_tokens, embedding.data());
  src->lm_head_columns(0, cfg.vocab, lm_head.data());
  write_safetensors((dir / "model.safetensors").string(),
                    {{"embedding", "F32", {cfg.vocab, cfg.hidden}, embedding.data()},
                     {"lm_head", "F32", {cfg.hidden, cfg.vocab}, lm_head.data()}},
                    md);
  std::vector<std::int32_t> tokens, greedy_tokens;
  std::vector<std::uint8_t> mask;
  std::vector<std::int64_t> offsets{0};
  std::vector<float> hidden;
  const std::int64_t T = cfg.target_layers * cfg.hidden;
  for (bool held : {false, true}) {
    const auto& samples = held ? src->heldout() : src->train();
    for (std::size_t i = 0; i < samples.size(); ++i) {
      const auto L = static_cast<std::int64_t>(samples[i].tokens.size());
      tokens.insert(tokens.end(), samples[i].tokens.begin(), samples[i].tokens.end());
      mask.insert(mask.end(), samples[i].loss_mask.begin(), samples[i].loss_mask.end());
      offsets.push_back(offsets.back() + L);
      hidden.resize(hidden.size() + static_cast<std::size_t>(L * T));
      src->hidden(held, i, 0, L, hidden.data() + hidden.size() - static_cast<std::size_t>(L * T));
    }
  }
  for (std::int32_t t : tokens) greedy_tokens.push_back(greedy == 2 ? (t + 1) % static_cast<std::int32_t>(cfg.vocab) : t);
  const auto rows = static_cast<std::int64_t>(tokens.size());
  std::vector<NamedTensor> ts{{"tokens", "I32", {rows}, tokens.data()},
                              {"loss_mask", "U8", {rows}, mask.data()},
                              {"offsets", "I64", {static_cast<std::int64_t>(offsets.size())}, offsets.data()},
                              {"hidden", "F32", {rows, T}, hidden.data()}};
  if (greedy != 0) ts.push_back({"target_greedy", "I32", {rows}, greedy_tokens.data()});
  write_safetensors((dir / "shard_00000.safetensors").string(), ts);
}

TEST(Trainer, SafetensorsShardsTrainLikeTheSyntheticSource) {
  const auto dir = std::filesystem::path(::testing::TempDir()) / ("shards_np" + std::to_string(world().size()));
  const DrafterConfig cfg = drafter_preset("tiny");
  if (world().rank() == 0) {
    write_shards(dir / "plain", cfg, 0, false);
    write_shards(dir / "greedy_same", cfg, 1, true);
    write_shards(dir / "greedy_other", cfg, 2, false);
  }
  world().barrier();
  TrainOptions o = small(2);
  o.context = 256;
  const TrainResult synthetic = train(world(), o);
  o.data = (dir / "plain").string();
  o.heldout = 16;  // SyntheticSpec's held-out count: the same split
  const TrainResult shards = train(world(), o);
  EXPECT_EQ(shards.params, synthetic.params);
  EXPECT_EQ(shards.loss, synthetic.loss);
  EXPECT_EQ(shards.tau_reference, "dataset tokens");
  // tau against the target's greedy tokens when the shards carry them: equal to the dataset's
  // tau when they are the dataset tokens, different when they are not.
  o.data = (dir / "greedy_same").string();
  o.out = (dir / "out_np").string() + std::to_string(world().size());
  const TrainResult same = train(world(), o);
  EXPECT_EQ(same.tau_reference, "target greedy tokens");
  EXPECT_EQ(same.tau, shards.tau);
  EXPECT_EQ(same.params, shards.params);
  // The shards' target layers reach the checkpoint (diffcp export needs them).
  const Checkpoint ck = load_checkpoint(o.out + "/checkpoint.bin");
  EXPECT_EQ(ck.meta.at("config").at("target_layer_ids"), nlohmann::json({3, 7}));
  EXPECT_EQ(ck.meta.at("config").at("target_depth"), 12);
  o.out.clear();
  o.data = (dir / "greedy_other").string();
  const TrainResult other = train(world(), o);
  EXPECT_LT(other.tau, shards.tau);
  EXPECT_GE(other.tau, 1.0);
}

TEST(Trainer, MismatchedCheckpointIsRefused) {
  const auto dir = std::filesystem::path(::testing::TempDir()) / ("mismatch_np" + std::to_string(world().size()));
  TrainOptions o = small(1);
  o.out = dir.string();
  train(world(), o);
  TrainOptions other = o;
  other.resume = true;
  other.seed = 2;  // the data order and anchors follow the seed: refuse
  try {
    train(world(), other);
    ADD_FAILURE() << "resuming with another seed must fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("was trained with TrainOptions::seed 1"), std::string::npos) << e.what();
  }
  other = o;
  other.resume = true;
  other.preset = "small";  // another model shape: refuse
  try {
    train(world(), other);
    ADD_FAILURE() << "resuming another model must fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is for a different model"), std::string::npos) << e.what();
  }
}

TEST(Trainer, BadMeshIsRefusedOnEveryRank) {
  TrainOptions o = small(1);
  o.dp = world().size() + 1;
  EXPECT_THROW(train(world(), o), Error);
  o.dp = 1;
  o.cp = world().size() + 1;
  EXPECT_THROW(train(world(), o), Error);
}

}  // namespace
}  // namespace diffcp
