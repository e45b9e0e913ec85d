// `diffcp sim dit` and `sim train` (sim/dit.hpp, sim/train.hpp): the predictions' structure
// against the closed forms and the properties the model must have.
#include <gtest/gtest.h>

#include <cmath>

#include "diffcp/core/error.hpp"
#include "diffcp/dit/vmajor.hpp"
#include "diffcp/sim/cp.hpp"
#include "diffcp/sim/dit.hpp"
#include "diffcp/sim/train.hpp"
#include "diffcp/workload/batch.hpp"

namespace diffcp {
namespace {

// A machine of P ranks, R per node, with every rate set (elementwise included, so every term counts).
SimMachine machine(int P, int R, double inter_gbit = 200, double inter_latency_us = 5) {
  SimMachine m;
  m.profile.name = "test";
  m.profile.ranks_per_node = R;
  m.profile.rank_tflops = m.profile.gemm_tflops = m.profile.attn_bwd_tflops = 100;
  m.profile.elementwise_gbs = 1000;
  m.profile.kernel_us = 5;
  m.profile.intra_gbit = 1600;
  m.profile.inter_gbit = inter_gbit;
  m.profile.intra_latency_us = 2;
  m.profile.inter_latency_us = inter_latency_us;
  m.P = P;
  m.R = R;
  return m;
}

const SimDitResult& row(const std::vector<SimDitResult>& rows, const std::string& mode) {
  for (const SimDitResult& r : rows)
    if (r.mode == mode) return r;
  throw Error("no row for mode " + mode);
}

SimDitOptions dit_options(std::vector<std::string> modes, CacheSchedule schedule = {}, int steps = 20) {
  SimDitOptions o;
  o.modes = std::move(modes);
  o.steps = steps;
  o.schedule = schedule;
  return o;
}

// Rows per rank per exchange (n = b n_p) and hd = h_p d_h of a supported shape.
std::int64_t rows_per_rank(const DitShape& s, int P) { return s.batch * s.tokens() / P; }
std::int64_t hd_of(const DitConfig& c, int P) { return c.heads / P * c.head_dim; }

// The default preset (H = 768) with n_h heads, so that more ranks divide them.
DitConfig with_heads(std::int64_t heads) {
  DitConfig c = dit_preset("default");
  c.heads = heads;
  c.head_dim = 768 / heads;
  c.rope_axes = flux_rope_axes(c.head_dim);
  c.validate();
  return c;
}

TEST(SimDit, BytesAreTheClosedForms) {
  const SimMachine m = machine(8, 2);
  const DitConfig cfg = dit_preset("default");
  const DitShape shape{2, 512, 512, 64};
  const CacheSchedule sched{CacheScheduleKind::linear, 0.9, 3, 7};
  const int steps = 20;
  const auto rows = simulate_dit(m, cfg, shape, dit_options({"flat", "tapa", "vfirst", "cocodiff"}, sched, steps));
  const std::int64_t n = rows_per_rank(shape, 8), hd = hd_of(cfg, 8), layers = cfg.double_blocks + cfg.single_blocks;
  const VMajorBytes vm = vmajor_predicted_bytes(8, 2, n, hd, layers, sched, steps, true);
  const VMajorBytes tapa = vmajor_predicted_bytes(8, 2, n, hd, layers, sched, steps, false);
  EXPECT_EQ(row(rows, "cocodiff").bytes_intra_total, vm.intra);
  EXPECT_EQ(row(rows, "cocodiff").bytes_inter_total, vm.inter);
  EXPECT_EQ(row(rows, "tapa").bytes_intra_total, tapa.intra);
  EXPECT_EQ(row(rows, "tapa").bytes_inter_total, tapa.inter);
  EXPECT_EQ(row(rows, "vfirst").bytes_inter_total, tapa.inter);
  EXPECT_DOUBLE_EQ(row(rows, "cocodiff").bytes_inter_group, static_cast<double>(vm.inter) / steps);
  // Flat: (L - 1) blocks inside the group, (P - L) across, per exchange (q|k|v and o).
  const double per_layer_block = static_cast<double>(n) * 4 * hd * 4;  // n rows x (3 hd + hd) f32
  EXPECT_DOUBLE_EQ(row(rows, "flat").bytes_intra_group, layers * 1.0 * per_layer_block);
  EXPECT_DOUBLE_EQ(row(rows, "flat").bytes_inter_group, layers * 6.0 * per_layer_block);
}

TEST(SimDit, CocodiffAtRatioZeroMovesTapasRowsPlusItsMetadata) {
  const SimMachine m = machine(8, 2);
  const DitConfig cfg = dit_preset("default");
  const DitShape shape{1, 512, 512, 64};
  const int steps = 12, L = 2, G = 4;
  const CacheSchedule r0{CacheScheduleKind::fixed, 0.0, 2, 0};  // steps 2..11 selective with r = 0
  const auto rows = simulate_dit(m, cfg, shape, dit_options({"tapa", "cocodiff"}, r0, steps));
  const auto& tapa = row(rows, "tapa");
  const auto& coco = row(rows, "cocodiff");
  const std::int64_t n = rows_per_rank(shape, 8), layers = cfg.double_blocks + cfg.single_blocks;
  // Every q|k|v row still moves; the selective path adds the L1 partials inside the group and
  // the active lists across groups (dit/vmajor.hpp), nothing else.
  const std::uint64_t selective = 10;
  EXPECT_EQ(coco.bytes_intra_total - tapa.bytes_intra_total, selective * layers * (L - 1) * L * n * 4);
  EXPECT_EQ(coco.bytes_inter_total - tapa.bytes_inter_total, selective * layers * (G - 1) * L * n * 4);
  // All steps full (warm-up past the end): exactly TAPA's bytes.
  const CacheSchedule all_full{CacheScheduleKind::fixed, 0.5, steps, 0};
  const auto full = simulate_dit(m, cfg, shape, dit_options({"tapa", "cocodiff"}, all_full, steps));
  EXPECT_EQ(row(full, "cocodiff").bytes_intra_total, row(full, "tapa").bytes_intra_total);
  EXPECT_EQ(row(full, "cocodiff").bytes_inter_total, row(full, "tapa").bytes_inter_total);
}

TEST(SimDit, VMajorInterBytesAndTimeFallAsTheRatioRises) {
  const SimMachine m = machine(16, 2, 100);
  const DitConfig cfg = with_heads(16);
  const DitShape shape{2, 512, 512, 64};
  double last_bytes = 0, last_ms = 0;
  for (const double r : {0.0, 0.25, 0.5, 0.75, 1.0}) {
    const CacheSchedule s{CacheScheduleKind::fixed, r, 1, 0};
    const auto rows = simulate_dit(m, cfg, shape, dit_options({"cocodiff"}, s, 10));
    const auto& c = row(rows, "cocodiff");
    ASSERT_TRUE(c.supported()) << c.reason;
    const VMajorBytes vm = vmajor_predicted_bytes(16, 2, rows_per_rank(shape, 16), hd_of(cfg, 16),
                                                  cfg.double_blocks + cfg.single_blocks, s, 10, true);
    EXPECT_EQ(c.bytes_inter_total, vm.inter);
    if (r > 0) {
      EXPECT_LT(c.bytes_inter_group, last_bytes) << "r = " << r;
      EXPECT_LT(c.total_ms, last_ms) << "r = " << r;
    }
    last_bytes = c.bytes_inter_group;
    last_ms = c.total_ms;
  }
}

TEST(SimDit, TapaSendsFlatsInterGroupBytesInLTimesFewerMessages) {
  for (const int L : {2, 4}) {
    const SimMachine m = machine(16, L);
    const DitConfig cfg = with_heads(16);
    const DitShape shape{1, 512, 512, 64};
    const auto rows = simulate_dit(m, cfg, shape, dit_options({"flat", "tapa"}));
    const auto& flat = row(rows, "flat");
    const auto& tapa = row(rows, "tapa");
    ASSERT_EQ(tapa.L, L);
    // Both send the (P - L) blocks bound for other groups across once; TAPA aggregates them into
    // G - 1 messages (L blocks each) and forwards (L - 1)/L of its data inside the group first.
    EXPECT_DOUBLE_EQ(tapa.bytes_inter_group, flat.bytes_inter_group);
    EXPECT_GT(tapa.bytes_intra_group, flat.bytes_intra_group);
    EXPECT_DOUBLE_EQ(flat.messages_inter_group, L * tapa.messages_inter_group);
  }
}

TEST(SimDit, TapaBeatsFlatWhereInterNodeLatencyDominates) {
  // Many ranks, small blocks, a slow (high-latency) inter-node link: TAPA's G - 1 inter-node
  // latencies instead of P - R pay for its sequential phase 1.
  const SimMachine m = machine(32, 4, 100, 50);
  const DitConfig cfg = with_heads(32);
  const DitShape shape{1, 512, 512, 64};
  const auto rows = simulate_dit(m, cfg, shape, dit_options({"flat", "tapa", "vfirst", "cocodiff"}));
  for (const auto& r : rows) ASSERT_TRUE(r.supported()) << r.mode << ": " << r.reason;
  EXPECT_LE(row(rows, "tapa").step_ms, row(rows, "flat").step_ms);
  EXPECT_LT(row(rows, "tapa").exposed_comm_ms, row(rows, "flat").exposed_comm_ms);
  // V-Major's selective steps move fewer rows. (V-First is not faster than TAPA here: its V and
  // q|k phase 2 are two inter-group all-to-alls, each paying G - 1 of the 50 us latencies.)
  EXPECT_LT(row(rows, "cocodiff").total_ms, row(rows, "vfirst").total_ms);
  // Compute is the same model in every mode except cocodiff's cache work.
  EXPECT_DOUBLE_EQ(row(rows, "tapa").compute_ms, row(rows, "flat").compute_ms);
  EXPECT_DOUBLE_EQ(row(rows, "vfirst").compute_ms, row(rows, "flat").compute_ms);
}

TEST(SimDit, VFirstHidesVsPhaseOneBehindTheQKWork) {
  // No latencies: splitting q|k|v's phase 1 into v and q|k costs nothing, so V-First exposes
  // strictly less than TAPA (what V's phase 1 overlaps), and never more than TAPA moves.
  SimMachine m = machine(8, 4, 100, 0);
  m.profile.intra_latency_us = 0;
  m.profile.intra_gbit = 50;  // a slow phase 1, so it matters
  const DitConfig cfg = dit_preset("default");
  const auto rows = simulate_dit(m, cfg, DitShape{2, 512, 512, 64}, dit_options({"tapa", "vfirst"}));
  const auto& tapa = row(rows, "tapa");
  const auto& vfirst = row(rows, "vfirst");
  EXPECT_LT(vfirst.exposed_comm_ms, tapa.exposed_comm_ms);
  EXPECT_NEAR(vfirst.comm_ms, tapa.comm_ms, 1e-9 * tapa.comm_ms);
  EXPECT_LT(vfirst.step_ms, tapa.step_ms);
}

TEST(SimDit, UnsupportedShapesGiveReasons) {
  const DitConfig cfg = dit_preset("default");  // 24 heads
  const DitShape shape{1, 512, 512, 64};
  const auto heads = simulate_dit(machine(16, 2), cfg, shape, dit_options({"flat", "cocodiff"}));
  ASSERT_EQ(heads.size(), 2u);
  for (const auto& r : heads) {
    EXPECT_FALSE(r.supported());
    EXPECT_NE(r.reason.find("do not divide the 24 attention heads"), std::string::npos) << r.reason;
    EXPECT_EQ(r.reason.find(".cpp:"), std::string::npos) << r.reason;  // no source location in a reason
  }
  const auto tokens = simulate_dit(machine(3, 1), cfg, DitShape{1, 512, 512, 64}, dit_options({"tapa"}));
  EXPECT_TRUE(tokens[0].supported()) << tokens[0].reason;  // 1024 image tokens at P = 3: padded
  SimDitOptions o = dit_options({"tapa"});
  o.group_size = 3;
  const auto group = simulate_dit(machine(8, 2), cfg, shape, o);
  EXPECT_NE(group[0].reason.find("group size L = 3 does not divide P = 8"), std::string::npos) << group[0].reason;
  // Bad input is an error naming the value, not a row.
  EXPECT_THROW(simulate_dit(machine(8, 2), cfg, shape, dit_options({"ulysses"})), Error);
  EXPECT_THROW(simulate_dit(machine(8, 2), cfg, shape, dit_options({"flat"}, {CacheScheduleKind::fixed, 1.5, 5, 10})), Error);
  SimMachine bad = machine(8, 2);
  bad.P = 0;
  EXPECT_THROW(simulate_dit(bad, cfg, shape, dit_options({"flat"})), Error);
}

// Issue #52's serving features: sequential CFG moves twice the bytes of one pass; CFG-parallel
// runs one pass on each half (its bytes the P/2 run's: nothing across nodes when a half is a node)
// plus the velocity pair; a cached step moves one layer's bytes, and the time falls with the
// cached fraction; bad combinations are refused.
TEST(SimDit, CfgParallelAndStepCacheFollowTheirClosedForms) {
  const DitConfig cfg = dit_preset("default");  // 24 heads, 2 double + 4 single blocks
  const DitShape shape{1, 512, 512, 64};
  const int steps = 10;
  const CacheSchedule r0{CacheScheduleKind::fixed, 0.0, 0, 0};
  SimDitOptions one = dit_options({"tapa"}, r0, steps), two = one, par = one;
  two.cfg = true;
  par.cfg = par.cfg_parallel = true;
  const auto p1 = simulate_dit(machine(8, 4), cfg, shape, one), p2 = simulate_dit(machine(8, 4), cfg, shape, two);
  EXPECT_EQ(p2[0].bytes_inter_total, 2 * p1[0].bytes_inter_total);
  EXPECT_EQ(p2[0].bytes_intra_total, 2 * p1[0].bytes_intra_total);
  EXPECT_GT(p2[0].step_ms, 1.9 * p1[0].step_ms);
  const auto half = simulate_dit(machine(4, 4), cfg, shape, one), pp = simulate_dit(machine(8, 4), cfg, shape, par);
  EXPECT_EQ(pp[0].P, 8);
  EXPECT_EQ(pp[0].bytes_inter_total, 0u);  // each half is one node: its all-to-alls stay inside
  EXPECT_EQ(pp[0].bytes_intra_total, half[0].bytes_intra_total);
  EXPECT_GT(pp[0].step_ms, half[0].step_ms);  // + the velocity pair, across the nodes
  EXPECT_LT(pp[0].step_ms, p2[0].step_ms);
  SimDitOptions cached = one;
  cached.cached_fraction = 1.0;  // every step after the first: the first block only
  const auto c = simulate_dit(machine(8, 4), cfg, shape, cached);
  const std::uint64_t per_layer = p1[0].bytes_inter_total / steps / 6;
  EXPECT_EQ(c[0].bytes_inter_total, p1[0].bytes_inter_total / steps + (steps - 1) * per_layer);
  EXPECT_LT(c[0].total_ms, 0.5 * p1[0].total_ms);
  cached.cached_fraction = 0.5;
  EXPECT_LT(simulate_dit(machine(8, 4), cfg, shape, cached)[0].total_ms, p1[0].total_ms);
  EXPECT_NE(simulate_dit(machine(3, 1), cfg, shape, par)[0].reason.find("P = 3 is odd"), std::string::npos);
  SimDitOptions bad = one;
  bad.cfg_parallel = true;  // without cfg
  EXPECT_THROW(simulate_dit(machine(8, 4), cfg, shape, bad), Error);
  bad = one;
  bad.cached_fraction = 1.5;
  EXPECT_THROW(simulate_dit(machine(8, 4), cfg, shape, bad), Error);
  // The fp8 wire: every mode's bytes the closed form's in that format (checked inside), fewer of them
  // across nodes, and a faster step where the links are slow.
  SimDitOptions fp8 = dit_options({"flat", "cocodiff"}, {CacheScheduleKind::linear, 0.9, 2, 4}, steps);
  SimDitOptions f32 = fp8;
  fp8.wire = Wire::fp8;
  const SimMachine slow = machine(8, 4, 10);
  const auto a8 = simulate_dit(slow, cfg, shape, fp8), a32 = simulate_dit(slow, cfg, shape, f32);
  for (const char* mode : {"flat", "cocodiff"}) {
    const double ratio = row(a8, mode).bytes_inter_group / row(a32, mode).bytes_inter_group;
    EXPECT_GT(ratio, 0.25) << mode;
    EXPECT_LT(ratio, 0.25 * (1 + 4.0 / 32) + 0.01) << mode;  // d_h = 32: e4m3 + 4 / 32 scale bytes
    EXPECT_LT(row(a8, mode).step_ms, row(a32, mode).step_ms) << mode;
  }
}

SimTrainOptions train_options(int cp, int dp, std::int64_t global_batch) {
  SimTrainOptions o;
  o.cp = cp;
  o.dp = dp;
  o.global_batch = global_batch;
  o.context = 1024;
  return o;
}

TEST(SimTrain, DataParallelHalvesComputeAtFixedGlobalBatch) {
  const DrafterConfig cfg = drafter_preset("small");
  // One node of 4 (the all-reduce stays on the fast link; across nodes it can cost more than the
  // halved compute of this small preset saves).
  const SimTrainResult a = simulate_train(machine(2, 4), "small", cfg, train_options(1, 2, 8));
  const SimTrainResult b = simulate_train(machine(4, 4), "small", cfg, train_options(1, 4, 8));
  EXPECT_EQ(a.accum, 4);
  EXPECT_EQ(b.accum, 2);
  EXPECT_NEAR(b.phases.attention / a.phases.attention, 0.5, 1e-9);
  EXPECT_NEAR(b.phases.projections_mlp / a.phases.projections_mlp, 0.5, 1e-9);
  EXPECT_NEAR(b.phases.lm_head_loss / a.phases.lm_head_loss, 0.5, 1e-9);
  EXPECT_GT(a.phases.attention, 0);
  // Same tokens per step, less time: more tokens/s.
  EXPECT_GT(b.tokens_per_s, a.tokens_per_s);
}

TEST(SimTrain, GradientAllReduceGrowsWithP) {
  const DrafterConfig cfg = drafter_preset("small");
  double last = -1;
  for (const int P : {1, 2, 4, 8, 16}) {
    const SimTrainResult r = simulate_train(machine(P, 2), "small", cfg, train_options(1, P, 16));
    EXPECT_GT(r.phases.grad_allreduce, last) << "P = " << P;
    last = r.phases.grad_allreduce;
    EXPECT_NEAR(r.step_ms, r.phases.sum(), 1e-9);
  }
}

TEST(SimTrain, ContextParallelAttentionIsSimulateCpsLayer) {
  const DrafterConfig cfg = drafter_preset("small");
  SimTrainOptions o = train_options(4, 2, 0);
  o.accum = 3;
  const SimTrainResult r = simulate_train(machine(8, 4), "small", cfg, o);
  EXPECT_EQ(r.dp, 2);
  EXPECT_EQ(r.cp, 4);
  // The same micro-batch and CP machine through simulate_cp directly.
  const PackedBatch batch = make_random_batch(4, 256, 12, cfg.block, 0.25, o.seed);
  ASSERT_EQ(r.tokens_per_micro_batch, batch.context_rows());
  SimMachine mc = machine(4, 4);
  // The output projection as the trainer's --oproj auto: owned for small (n_q d_h = H).
  EXPECT_EQ(r.oproj, "owned");
  const SimCpResult layer = simulate_cp(mc, batch, cfg.attn(), {{"splitkv"}, "lpt", 4, "owned", "auto", 4}).at(0);
  EXPECT_NEAR(r.phases.attention, 3.0 * cfg.layers * layer.step_ms, 1e-9 * r.phases.attention);
  EXPECT_GT(r.phases.redistribute, 0);
  EXPECT_NEAR(r.tokens_per_s, 2 * 3 * 1024 / (r.step_ms * 1e-3), 1e-6 * r.tokens_per_s);
}

// --shard as the trainer: auto = none on one rank, optimizer (ZeRO-1) for the synthetic shapes,
// full for the real ones; the state's bytes are shard_bytes_per_step's, the AdamW step shrinks by
// P when sharded, full recomputes each layer's forward.
TEST(SimTrain, ShardModesAsTheTrainer) {
  const DrafterConfig small = drafter_preset("small");
  SimTrainOptions o = train_options(0, 0, 0);
  EXPECT_EQ(simulate_train(machine(1, 1), "small", small, o).shard, "none");
  const SimTrainResult z1 = simulate_train(machine(4, 4), "small", small, o);
  EXPECT_EQ(z1.shard, "optimizer");
  o.shard = "none";
  const SimTrainResult none = simulate_train(machine(4, 4), "small", small, o);
  EXPECT_NEAR(z1.phases.optimizer, none.phases.optimizer / 4, 1e-12);
  // Reduce-scatter + all-gather move what the all-reduce moves (up to the pieces' padding).
  EXPECT_NEAR(z1.phases.grad_allreduce / none.phases.grad_allreduce, 1.0, 0.01);
  o.shard = "full";
  const SimTrainResult full = simulate_train(machine(4, 4), "small", small, o);
  EXPECT_GT(full.phases.grad_allreduce, 1.5 * z1.phases.grad_allreduce);  // 3 A = 6 gathers / scatters vs 2
  EXPECT_GT(full.phases.attention, z1.phases.attention);                   // recomputed forwards
  EXPECT_GT(full.phases.projections_mlp, z1.phases.projections_mlp);
  o.shard = "auto";
  o.context = 8192;
  const DrafterConfig real = drafter_preset("qwen3.5-35b-a3b");
  const SimTrainResult r = simulate_train(machine(2, 2), "qwen3.5-35b-a3b", real, o);
  EXPECT_EQ(r.shard, "full");
  EXPECT_EQ(r.oproj, "all");  // n_q d_h = 2 H
  o.shard = "zero3";
  try {
    simulate_train(machine(2, 2), "small", small, o);
    ADD_FAILURE() << "--shard zero3 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("`shard` 'zero3': expected none, optimizer, full or auto"), std::string::npos) << e.what();
  }
}

TEST(SimTrain, BadMeshesAreErrorsNamingTheValue) {
  const DrafterConfig cfg = drafter_preset("small");
  const auto message = [&](const SimMachine& m, const SimTrainOptions& o) {
    try {
      simulate_train(m, "small", cfg, o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(machine(8, 2), train_options(3, 0, 0)).find("`cp` = 3 does not divide P = 8"), std::string::npos);
  EXPECT_NE(message(machine(8, 2), train_options(2, 2, 0)).find("`cp` 2 x `dp` 2 = 4, expected P = 8"), std::string::npos);
  EXPECT_NE(message(machine(12, 4), train_options(6, 0, 0)).find("straddle"), std::string::npos);
  EXPECT_NE(message(machine(8, 2), train_options(2, 4, 6)).find("`global_batch` = 6"), std::string::npos);
  EXPECT_THROW(drafter_preset("huge"), Error);
}

}  // namespace
}  // namespace diffcp
