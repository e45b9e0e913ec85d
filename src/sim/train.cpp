#include "diffcp/sim/train.hpp"

#include <algorithm>
#include <cmath>

#include "diffcp/core/error.hpp"
#include "diffcp/cp/splitkv.hpp"
#include "diffcp/drafter/sharded_state.hpp"
#include "diffcp/sim/cp.hpp"
#include "diffcp/workload/batch.hpp"

namespace diffcp {

SimTrainResult simulate_train(const SimMachine& m, const std::string& preset, const DrafterConfig& cfg,
                              const SimTrainOptions& opt) {
  m.validate();
  cfg.validate();
  const int P = m.P;
  DIFFCP_CHECK(opt.cp >= 0 && opt.dp >= 0, "sim train: `cp` = ", opt.cp, ", `dp` = ", opt.dp, ", expected >= 1 (0: derived)");
  int C = opt.cp, DP = opt.dp;
  if (C > 0) DIFFCP_CHECK(P % C == 0, "sim train: `cp` = ", C, " does not divide P = ", P, " ranks");
  if (DP > 0) DIFFCP_CHECK(P % DP == 0, "sim train: `dp` = ", DP, " does not divide P = ", P, " ranks");
  if (C == 0) C = DP > 0 ? P / DP : P;
  if (DP == 0) DP = P / C;
  DIFFCP_CHECK(C * DP == P, "sim train: `cp` ", C, " x `dp` ", DP, " = ", C * DP, ", expected P = ", P, " ranks");
  // CP groups are C consecutive ranks (trainer.cpp: world.split by rank / C); they must tile the nodes.
  const int Rn = std::min(m.R, P);
  DIFFCP_CHECK(C % Rn == 0 || Rn % C == 0, "sim train: `cp` = ", C, ": CP groups of ", C, " consecutive ranks straddle ",
               "nodes of ", Rn, " ranks (expected one to divide the other)");
  std::int64_t A = opt.accum;
  if (opt.global_batch > 0) {
    DIFFCP_CHECK(opt.global_batch % DP == 0, "sim train: `global_batch` = ", opt.global_batch,
                 " micro-batches is not a multiple of DP = ", DP);
    A = opt.global_batch / DP;
  }
  DIFFCP_CHECK(opt.global_batch >= 0 && A >= 1, "sim train: `accum` = ", A, ", expected >= 1 micro-batch per replica");
  DIFFCP_CHECK(opt.collectives == "auto" || opt.collectives == "flat" || opt.collectives == "hierarchical",
               "sim train: `collectives` '", opt.collectives, "': expected flat, hierarchical or auto");
  const bool real_shape = cfg.vocab > 4096;  // as the trainer decides its defaults
  const ShardMode shard = resolve_shard_mode(opt.shard, real_shape, P);  // the trainer's --shard
  const bool recompute = shard == ShardMode::full;  // --recompute auto
  const std::int64_t length = opt.sample_length > 0 ? opt.sample_length : real_shape ? opt.context : std::min<std::int64_t>(256, opt.context);
  DIFFCP_CHECK(opt.context >= 1 && length >= cfg.block && length <= opt.context, "sim train: sample length ", length,
               " tokens (`sample_length`), `context` ", opt.context, ": expected block B = ", cfg.block,
               " <= sample length <= context");

  // One micro-batch (legend: sim/train.hpp).
  const std::int64_t samples = opt.context / length;
  const auto prompt = static_cast<std::int64_t>(std::llround(opt.prompt_fraction * static_cast<double>(length)));
  const std::int64_t candidates = length - cfg.block - std::min(prompt, length - cfg.block) + 1;
  const std::int64_t want = opt.anchors > 0 ? opt.anchors : real_shape ? 512 : 12;
  const PackedBatch batch = make_random_batch(samples, length, std::min(want, candidates), cfg.block, opt.prompt_fraction, opt.seed);

  // The CP group's machine: C ranks, min(R, C) to a node.
  SimMachine mc = m;
  mc.P = C;
  mc.R = std::min(m.R, C);
  const char* oproj = choose_oproj_by_shape(cfg.attn()) == OProj::owned ? "owned" : "all";
  const SimCpOptions cp_opt{{"splitkv"}, opt.balancer, opt.J, oproj, opt.collectives, 4};
  const SimCpResult layer = simulate_cp(mc, batch, cfg.attn(), cp_opt).at(0);
  DIFFCP_CHECK(layer.supported(), "sim train: Split-KV cannot serve the layer: ", layer.reason);

  const double H = static_cast<double>(cfg.hidden), F = static_cast<double>(cfg.ffn), V = static_cast<double>(cfg.vocab);
  const double T = static_cast<double>(cfg.target_layers * cfg.hidden), Ld = static_cast<double>(cfg.layers);
  const double S = static_cast<double>(batch.context_rows());
  const double Cp = std::ceil(S / C);
  const double Qp = static_cast<double>((batch.num_blocks() + C - 1) / C * cfg.block);
  const auto gemm = [&](double M, double K, double N) { return M > 0 ? m.gemm_ms(M, K, N) : 0.0; };
  const auto ew = [&](double bytes) { return m.elementwise_ms(bytes); };
  const DrafterLayout layout(cfg);
  const double W = static_cast<double>(layout.total);

  // Per micro-batch on the busiest CP rank. RMSNorm: forward 8 B, backward 12 B per element;
  // residual add / gradient add 12 B, activation copies 8 B.
  const double fusion = gemm(Cp, T, H) + gemm(T, Cp, H) + ew(8 * Cp * H) + ew(12 * Cp * H);
  const double mlp_forward = 2 * gemm(Qp, H, F) + gemm(Qp, F, H) + ew(12 * Qp * F);
  const double mlp_layer = 2 * gemm(Qp, H, F) + gemm(Qp, F, H)                 // forward
                           + gemm(F, Qp, H) + gemm(Qp, H, F)                   // W_down: dW, dX
                           + 2 * (gemm(H, Qp, F) + gemm(Qp, F, H))             // W_gate, W_up: dW, dX
                           + ew(12 * Qp * F) + ew(20 * Qp * F)                 // silu(gate) * up, its backward
                           + 2 * (ew(8 * Qp * H) + ew(12 * Qp * H))            // attn_norm, mlp_norm
                           + 2 * ew(8 * Qp * H) + 4 * ew(12 * Qp * H);         // h_in / h_mid copies, residual adds
  const double projections_mlp = fusion + Ld * mlp_layer + ew(8 * Qp * H) + ew(8 * Qp * H) + ew(12 * Qp * H);  // + embed, final norm
  const double lm_head = gemm(Qp, H, V) + gemm(Qp, V, H) + ew(12 * Qp * V);
  const double redistribute = mc.uniform_ms((C - 1.0) / C * Cp * T * 4);

  SimTrainResult r;
  r.preset = preset;
  r.P = P;
  r.dp = DP;
  r.cp = C;
  r.accum = A;
  r.tokens_per_micro_batch = batch.context_rows();
  r.query_rows = batch.query_rows();
  r.parameters = layout.total;
  r.imbalance_pct = layer.imbalance_pct;
  const double a = static_cast<double>(A);
  r.shard = shard_mode_name(shard);
  r.oproj = oproj;
  // Recomputation (with full) runs each layer's forward again in the backward.
  r.phases.attention = a * Ld * (layer.step_ms + (recompute ? layer.fwd_ms : 0.0));
  r.phases.projections_mlp = a * (projections_mlp + (recompute ? Ld * mlp_forward : 0.0));
  r.phases.lm_head_loss = a * lm_head;
  r.phases.redistribute = a * redistribute;
  // The model state's bytes: the closed form the trainer's tests assert (drafter/sharded_state.hpp).
  r.phases.grad_allreduce = m.uniform_ms(shard_bytes_per_step(layout, shard, P, A)) + m.allreduce_small_ms(8.0 * (3 + 2 * cfg.block));
  r.phases.optimizer = ew(52 * W / (shard == ShardMode::none ? 1.0 : P));
  r.phases.planner = a * layer.plan_ms;
  r.step_ms = r.phases.sum();
  r.tokens_per_s = r.step_ms > 0 ? DP * a * S / (r.step_ms * 1e-3) : 0.0;
  return r;
}

}  // namespace diffcp
