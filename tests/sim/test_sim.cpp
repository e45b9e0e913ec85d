// `diffcp sim cp` (issue #12), single process: the profile format, the machine's link model, the
// work matrix against the planner's own loads, and the predictions' structure (bytes from the
// closed forms, Split-KV's bytes flat in S, unsupported methods named, P = 1 has no communication).
#include <cmath>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "diffcp/balance/balancer.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/cp/bytes.hpp"
#include "diffcp/cp/cp_methods.hpp"
#include "diffcp/sim/cp.hpp"
#include "diffcp/workload/batch.hpp"
#include "diffcp/sim/machine.hpp"
#include "diffcp/sim/profile.hpp"
#include "error_of.hpp"

namespace diffcp {
namespace {

nlohmann::json h100_json() {
  return {{"name", "t"}, {"ranks_per_node", 8}, {"rank_tflops", 400}, {"intra_gbit", 2400}, {"inter_gbit", 400},
          {"intra_latency_us", 3}, {"inter_latency_us", 5}};
}

SimMachine machine(int P, int R, double inter_gbit = 400) {
  nlohmann::json j = h100_json();
  j["inter_gbit"] = inter_gbit;
  SimMachine m;
  m.profile = Profile::from_json(j, "test");
  m.P = P;
  m.R = R;
  return m;
}

TEST(SimProfile, FormatAndErrors) {
  const Profile p = Profile::from_json(h100_json(), "t");
  EXPECT_EQ(p.gemm_tflops, 400);  // defaults to rank_tflops
  EXPECT_EQ(p.attn_bwd_tflops, 400);
  EXPECT_EQ(p.ranks_per_node, 8);
  EXPECT_EQ(Profile::from_json(p.to_json(), "round trip").to_json(), p.to_json());
  const auto err = [](auto edit) {
    nlohmann::json j = h100_json();
    edit(j);
    return error_of([&] { Profile::from_json(j, "p.json"); });
  };
  EXPECT_NE(err([](nlohmann::json& j) { j["bogus"] = 1; }).find("profile 'p.json': unknown field 'bogus'"), std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j.erase("inter_gbit"); }).find("field 'inter_gbit' is missing"), std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["rank_tflops"] = -1; }).find("'rank_tflops' = -1, expected a positive number"),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["inter_latency_us"] = "fast"; }).find("'inter_latency_us' = \"fast\""),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["ranks_per_node"] = 0; }).find("'ranks_per_node' = 0"), std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["sync_loss"] = -0.1; }).find("'sync_loss' = -0.1, expected a non-negative"),
            std::string::npos);
  EXPECT_EQ(p.sync_loss, 0.0);  // absent: a quiet machine
  EXPECT_EQ(p.gemm_n_half, 0.0);  // absent: no width dependence
  EXPECT_NE(err([](nlohmann::json& j) { j["gemm_n_half"] = -5; }).find("'gemm_n_half' = -5, expected a non-negative"),
            std::string::npos);
  // The shipped profiles load (the emulated cluster's files: one format).
  for (const char* name : {"h100-ib", "aurora"}) EXPECT_NO_THROW(load_profile(name)) << name;
  EXPECT_NE(error_of([] { load_profile("nope"); }).find("profile 'nope': no such file"), std::string::npos);
}

// Issue #41: a profile says what calibrate measured; a prediction that leans on a defaulted link,
// or runs another attention shape than the rates were measured at, is told so.
TEST(SimProfile, MeasuredFieldsAndFitWarnings) {
  nlohmann::json j = h100_json();
  j["measured"] = {{"compute", true}, {"intra_link", true}, {"inter_link", false}, {"comm_overlap", true}, {"sync_loss", true}};
  j["attention_shape"] = {{"n_q", 16}, {"n_kv", 4}, {"d_h", 64}};
  const Profile p = Profile::from_json(j, "t");
  EXPECT_FALSE(p.measured.at("inter_link"));
  EXPECT_EQ(p.attn_d_h, 64);
  EXPECT_EQ(Profile::from_json(p.to_json(), "round trip").to_json(), p.to_json());
  SimMachine m{p, 8, 8};  // one node: the defaulted inter link is not used
  EXPECT_TRUE(m.fit_warnings(16, 4, 64).empty());
  m.P = 16;  // two nodes
  std::vector<std::string> w = m.fit_warnings(16, 4, 64);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_NE(w[0].find("inter-node link"), std::string::npos) << w[0];
  EXPECT_NE(w[0].find("was not measured"), std::string::npos) << w[0];
  w = m.fit_warnings(16, 4, 128);
  ASSERT_EQ(w.size(), 2u);
  EXPECT_NE(w[1].find("measured at 16/4 heads x 64, this workload has 16/4 heads x 128"), std::string::npos) << w[1];
  m.P = 1;  // one rank uses no link
  EXPECT_TRUE(m.fit_warnings(16, 4, 64).empty());
  // Hand-written profiles (published figures) record neither: nothing to warn about.
  EXPECT_TRUE((SimMachine{load_profile("h100-ib"), 64, 8}).fit_warnings(1, 1, 7).empty());
  const auto err = [](auto edit) {
    nlohmann::json jj = h100_json();
    edit(jj);
    return error_of([&] { Profile::from_json(jj, "p.json"); });
  };
  EXPECT_NE(err([](nlohmann::json& jj) { jj["measured"] = {{"links", false}}; }).find("measured: unknown group 'links'"),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& jj) { jj["measured"] = {{"compute", 1}}; }).find("measured.compute = 1, expected true or false"),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& jj) { jj["attention_shape"] = {{"n_q", 8}, {"n_kv", 2}}; }).find("attention_shape"),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& jj) { jj["attention_shape"] = {{"n_q", 8}, {"n_kv", 2}, {"d_h", 0}}; })
                .find("attention_shape.d_h = 0, expected an integer in 1..4096"),
            std::string::npos);
}

// Issue #41: the descriptor table lists the methods in CpMethodId order, and the simulator names
// every method it predicts as itself (its dispatch is a switch over the ids with no default:
// test cp_method_dispatch_exhaustive checks that an unhandled id does not compile).
TEST(SimCp, EveryMethodIsSimulatedAsItself) {
  const std::span<const CpMethod> methods = cp_methods();
  for (std::size_t i = 0; i < methods.size(); ++i) EXPECT_EQ(static_cast<std::size_t>(methods[i].id), i) << methods[i].name;
  const PackedBatch batch = make_random_batch(2, 1024, 16, 16, 0.25, 3);
  const AttnLayerConfig cfg{256, 8, 2, 32, 1e6, 1e-6};
  SimCpOptions opt;
  for (const CpMethod& mth : methods) opt.methods.push_back(mth.name);
  const SimMachine m{load_profile("h100-ib"), 2, 1};  // two nodes; Ulysses needs P | n_kv = 2
  const std::vector<SimCpResult> rows = simulate_cp(m, batch, cfg, opt);
  ASSERT_EQ(rows.size(), methods.size());
  std::set<double> steps;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i].method, methods[i].name);
    EXPECT_TRUE(rows[i].supported()) << rows[i].reason;
    steps.insert(rows[i].step_ms);
  }
  EXPECT_EQ(steps.size(), rows.size());  // five different cost models, not one repeated
}

TEST(SimMachine, LinkLevelsAndSharedUplinks) {
  // One node: everything intra; across nodes the shared uplink dominates and grows with R.
  const SimMachine one = machine(8, 8), two = machine(16, 8), thin = machine(16, 8, 100);
  EXPECT_EQ(one.inter_fraction(), 0.0);
  EXPECT_NEAR(two.inter_fraction(), 8.0 / 15.0, 1e-12);
  const double bytes = 64e6;
  EXPECT_LT(one.uniform_ms(bytes), two.uniform_ms(bytes));
  EXPECT_LT(two.uniform_ms(bytes), thin.uniform_ms(bytes));
  // 8 ranks x 8/15 x 64 MB through a 400 Gbit/s (50 GB/s) uplink: ~5.5 ms.
  EXPECT_NEAR(two.uniform_ms(bytes), 15 * 5e-3 + 8 * bytes * 8.0 / 15 / 50e6, 1e-9);
  // The hierarchical form sends each node's data across once: less time on the uplink.
  EXPECT_LT(two.hierarchical_ms(bytes), two.uniform_ms(bytes));
  EXPECT_EQ(machine(1, 8).uniform_ms(bytes), 0.0);
  // sync_loss slows compute only where ranks synchronise (P > 1): rates / (1 + sync_loss).
  SimMachine noisy = two, solo = machine(1, 8);
  noisy.profile.sync_loss = 0.25;
  solo.profile.sync_loss = 0.25;
  EXPECT_NEAR(noisy.attn_fwd_ms(1e12), 1.25 * two.attn_fwd_ms(1e12), 1e-9);
  EXPECT_NEAR(noisy.gemm_ms(4096, 4096, 4096) - 1.25 * two.gemm_ms(4096, 4096, 4096),
              -0.25 * two.profile.kernel_us * 1e-3, 1e-9);  // the per-call cost is not scaled
  EXPECT_EQ(solo.attn_fwd_ms(1e12), machine(1, 8).attn_fwd_ms(1e12));
  EXPECT_EQ(noisy.uniform_ms(bytes), two.uniform_ms(bytes));  // links are not
  // The GEMM's width efficiency: 1 without n_half and at 1024 wide or more; below, n / (n + n_half)
  // normalised to 1024; n_half is what calibrate solves from the narrow / wide rate ratio.
  SimMachine narrow = one;
  EXPECT_EQ(narrow.gemm_efficiency(1024, 256), 1.0);
  narrow.profile.gemm_n_half = 64;
  EXPECT_EQ(narrow.gemm_efficiency(4096, 1024), 1.0);
  EXPECT_NEAR(narrow.gemm_efficiency(1024, 256), 256.0 * 1088 / (1024.0 * 320), 1e-12);
  EXPECT_NEAR(narrow.gemm_efficiency(128, 4096), 128.0 * 1088 / (1024.0 * 192), 1e-12);  // the smaller of K, N
  EXPECT_NEAR(gemm_n_half_from_ratio(256, narrow.gemm_efficiency(1024, 256)), 64, 1e-9);
  EXPECT_EQ(gemm_n_half_from_ratio(256, 1.1), 0.0);  // the narrow GEMM no slower: no fall
  EXPECT_GT(gemm_n_half_from_ratio(256, 0.2), 1024.0);  // at or below linear: a steep, finite fall
  EXPECT_NEAR(narrow.gemm_ms(4096, 1024, 256) - narrow.profile.kernel_us * 1e-3,
              (one.gemm_ms(4096, 1024, 256) - one.profile.kernel_us * 1e-3) / narrow.gemm_efficiency(1024, 256), 1e-9);
  // A step's work: the slowest rank's with a core each; oversubscribed (4 ranks, 2 cores) the
  // early ranks yield their cores: max(2/4 x max, mean).
  SimMachine four = machine(4, 2);
  const std::vector<double> w{4, 1, 1, 2};
  EXPECT_EQ(four.step_work(w), 4.0);
  four.cores = 2;
  EXPECT_EQ(four.step_work(w), 2.0);
  EXPECT_EQ(four.step_work({1, 1, 1, 5}), 2.5);
  EXPECT_EQ(four.step_work({3, 3, 3, 3}), 3.0);  // balanced: no difference
  four.cores = 5;
  EXPECT_NE(error_of([&] { four.validate(); }).find("`cores` = 5, expected 1..P = 4"), std::string::npos);
  SimMachine bad = one;
  bad.share = 0;
  EXPECT_NE(error_of([&] { bad.validate(); }).find("`rank_share` = 0"), std::string::npos);
}

// The work matrix is the planner's cost model seen per (query owner, context owner): its column
// sums plus the own blocks are exactly the planner's W_p, for every balancer and P.
TEST(SimCp, WorkMatrixEqualsThePlannersLoads) {
  const PackedBatch batch = make_random_batch(4, 2048, 32, 16, 0.25, 3);
  const CostModel cost(batch);
  for (const char* name : {"none", "zigzag", "lpt"})
    for (const int P : {1, 3, 8}) {
      SCOPED_TRACE(std::string(name) + " P " + std::to_string(P));
      const Plan plan = make_balancer(name)->plan(batch, cost, P, 4);
      const PlanLoad load = plan_load(batch, cost, plan);
      const WorkMatrix w = work_matrix(batch, plan);
      for (int p = 0; p < P; ++p) {
        double col = w.D[static_cast<std::size_t>(p)];
        for (int q = 0; q < P; ++q) col += w.at(q, p);
        EXPECT_EQ(col, static_cast<double>(load.rank_work[static_cast<std::size_t>(p)])) << "rank " << p;
      }
    }
}

// The closed forms count payload elements of the dtype's size and the lse / D statistics (and
// Ring's dk|dv accumulators) as f32; the max + sum lse fallback adds one all-reduce of the statistics.
TEST(CpBytes, ElementSizeFromTheDtypeStatisticsInF32) {
  const AttnLayerConfig cfg{96, 4, 2, 32};
  const std::int64_t Q = 64, L = 1000, P = 4;
  const double f = (P - 1.0) / P, qw = 128, kvw = 64, H = 96, n = Q * 4.0;
  for (DType t : {DType::f32, DType::bf16}) {
    const double e = static_cast<double>(dtype_size(t));
    SCOPED_TRACE(dtype_name(t));
    EXPECT_DOUBLE_EQ(splitkv_bytes_per_layer(cfg, t, Q, P, false, 1), e * f * 2 * Q * (qw + H) + 4 * 2 * 2 * f * n);
    // Owned, flat: the owner merge (lse partials all-to-all, [lse | D] all-gather), whatever lse_reduces.
    EXPECT_DOUBLE_EQ(splitkv_bytes_per_layer(cfg, t, Q, P, true, 2), e * f * 2 * Q * (qw + qw) + 4 * 3 * f * n);
    EXPECT_DOUBLE_EQ(splitkv_bytes_per_layer(cfg, t, Q, P, true, 1), e * f * 2 * Q * (qw + qw) + 4 * 3 * f * n);
    EXPECT_DOUBLE_EQ(splitkv_bytes_per_layer(cfg, t, Q, P, true, 1, 2),
                     e * f * 2 * Q * (qw + qw) + 4 * 2 * (2 * n * 1 + 3 * n * 2) / P);
    EXPECT_DOUBLE_EQ(splitkv_bytes_per_layer(cfg, t, Q, P, false, 1, 2),
                     e * f * 2 * Q * (qw + H) + 4 * 2 * (2 * n * 1 + 3 * n * 2) / P);
    EXPECT_DOUBLE_EQ(ulysses_bytes_per_layer(cfg, t, Q, L, P), e * f / P * 4 * (Q * qw + L * kvw));
    // Ring: the k|v hops in the dtype, the dk|dv accumulators always f32.
    EXPECT_DOUBLE_EQ(ring_bytes_per_layer(cfg, t, L, P), (2 * e + 4) * f * 2 * L * kvw);
    EXPECT_DOUBLE_EQ(ringx_bytes_per_layer(cfg, t, Q, L, P, 2), f * (e * (2 * Q * qw + 4 * L * kvw) + 4 * 2 * 2 * Q * 4));
    // LV-XAttn: q (twice) and do in the dtype, the running o and the dq accumulator always f32.
    EXPECT_DOUBLE_EQ(lvxattn_bytes_per_layer(cfg, t, Q, P), f * Q * ((3 * e + 2 * 4) * qw + 4 * 3 * 4));
  }
}

TEST(SimCp, PredictionsUseTheClosedFormsAndTheRealPlanner) {
  const AttnLayerConfig cfg{1024, 8, 2, 128, 1e6, 1e-6};
  const SimCpOptions opt{{"splitkv", "ulysses", "ring", "ringx", "lvxattn"}, "lpt", 16, "all", "flat", 4};
  const auto run = [&](std::int64_t context, int P, int R) {
    return simulate_cp(machine(P, R), make_random_batch(P, context, 16, 16, 0.25, 1), cfg, opt);
  };
  const std::vector<SimCpResult> a = run(4096, 16, 8), b = run(16384, 16, 8);
  const PackedBatch batch = make_random_batch(16, 4096, 16, 16, 0.25, 1);
  const std::int64_t Q = batch.query_rows(), S = batch.context_rows();
  EXPECT_EQ(a[0].bytes_per_layer, splitkv_bytes_per_layer(cfg, DType::f32, Q, 16, false, 1, 0));
  EXPECT_EQ(a[2].bytes_per_layer, ring_bytes_per_layer(cfg, DType::f32, S + Q, 16));
  EXPECT_EQ(a[3].bytes_per_layer, ringx_bytes_per_layer(cfg, DType::f32, Q, S + Q, 16, 1));
  EXPECT_EQ(a[4].bytes_per_layer, lvxattn_bytes_per_layer(cfg, DType::f32, Q, 16));
  // Split-KV and LV-XAttn move Q-sized tensors: bytes flat in S; Ring's grow with it.
  EXPECT_EQ(a[0].bytes_per_layer, b[0].bytes_per_layer);
  EXPECT_EQ(a[4].bytes_per_layer, b[4].bytes_per_layer);
  EXPECT_GT(b[2].bytes_per_layer, 3 * a[2].bytes_per_layer);
  // Ulysses cannot shard 2 kv heads over 16 ranks: a reason, no numbers.
  EXPECT_FALSE(a[1].supported());
  EXPECT_NE(a[1].reason.find("n_kv"), std::string::npos);
  for (const SimCpResult& r : a) {
    if (!r.supported()) continue;
    SCOPED_TRACE(r.method);
    EXPECT_NEAR(r.step_ms, r.fwd_ms + r.bwd_ms, 1e-9);
    EXPECT_NEAR(r.compute_ms + r.exposed_comm_ms, r.step_ms, 1e-9);
    EXPECT_GE(r.comm_ms, r.exposed_comm_ms - 1e-12);
    EXPECT_GT(r.inter_node_bytes_per_layer, 0);
    EXPECT_LT(r.inter_node_bytes_per_layer, r.bytes_per_layer);
    EXPECT_GT(r.peak_bytes, 0);
  }
  // LPT balances the attention work better than the contiguous layout the ring-likes run with.
  EXPECT_LT(a[0].imbalance_pct, a[4].imbalance_pct);
  // One rank: nothing to communicate.
  for (const SimCpResult& r : run(4096, 1, 8)) {
    EXPECT_EQ(r.bytes_per_layer, 0) << r.method;
    EXPECT_EQ(r.exposed_comm_ms, 0) << r.method;
  }
}

}  // namespace
}  // namespace diffcp
