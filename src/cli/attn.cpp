// `diffcp attn`: one drafter attention layer (forward + backward) with one CP method (--method,
// Split-KV by default) on the ranks of mpirun; --check against the fp64 single-process reference,
// --json, --dump DIR (.npy files). The run and its measurement are cli/layer_run's, shared with
// `diffcp bench cp`.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/layer_run.hpp"
#include "diffcp/cp/cp_methods.hpp"
#include "diffcp/cp/splitkv.hpp"
#include "diffcp/io/npy.hpp"
#include "diffcp/ops/backend.hpp"

namespace diffcp::cli {

void add_attn_command(CLI::App& app, AttnOptions& opt) {
  CLI::App* c = app.add_subcommand("attn", "One drafter attention layer, forward + backward, with one context-parallel "
                                           "method (Split-KV by default) over the mpirun ranks");
  c->add_option("--method", opt.method, "CP method: splitkv | ulysses | ring | ringx | lvxattn")->capture_default_str();
  add_layer_options(c, opt);
  c->add_flag("--json", opt.json, "print one JSON object");
  c->add_option("--dump", opt.dump, "write inputs and outputs as .npy files + meta.json into this directory");
  c->add_option("--balancer", opt.balancer, "context layout: none | zigzag | lpt | partition")->capture_default_str();
}

namespace {

// Rows held per rank (counts in rows), gathered on every rank into global order: rank r's rows
// are the packed ranges chunks_of_rank[r] (context) or its block range (blocks).
std::vector<float> gather_rows(Communicator& comm, const std::vector<float>& mine, std::int64_t width,
                               const std::vector<std::vector<PosRange>>& ranges_of_rank, std::int64_t total_rows) {
  std::vector<std::size_t> counts;
  for (const auto& ranges : ranges_of_rank) {
    std::int64_t rows = 0;
    for (const PosRange& r : ranges) rows += r.end - r.begin;
    counts.push_back(static_cast<std::size_t>(rows * width));
  }
  std::vector<float> all(static_cast<std::size_t>(total_rows * width)), packed(all.size());
  comm.all_gather_v<float>(mine, packed, counts);
  std::size_t off = 0;
  for (const auto& ranges : ranges_of_rank)
    for (const PosRange& r : ranges) {
      std::copy_n(packed.begin() + static_cast<std::ptrdiff_t>(off), (r.end - r.begin) * width,
                  all.begin() + r.begin * width);
      off += static_cast<std::size_t>((r.end - r.begin) * width);
    }
  return all;
}

// Rank 0 creates DIR and tries a file in it; every rank learns the outcome and fails alike.
void prepare_dump_dir(Communicator& comm, const std::string& dir) {
  std::int32_t ok = 1;
  if (comm.rank() == 0) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    const std::string probe = dir + "/.diffcp_write_probe";
    ok = !ec && std::ofstream(probe).good();
    std::filesystem::remove(probe, ec);
  }
  comm.broadcast<std::int32_t>(std::span<std::int32_t>(&ok, 1), 0);
  DIFFCP_CHECK(ok, "--dump '", dir, "': cannot create or write to this directory");
}

}  // namespace

int run_attn(Communicator& world, const AttnOptions& opt) {
  // Everything is checked alike on every rank before the first communication.
  const LayerWorkload wl = make_workload(opt);
  const AttnLayerConfig& cfg = wl.cfg;
  const PackedBatch& batch = wl.batch;
  const int P = world.size(), p = world.rank();
  const CpMethod& method = cp_method(opt.method);
  const std::string why = method.unsupported_reason(cfg, P);
  DIFFCP_CHECK(why.empty(), "--method ", opt.method, ": ", why);
  plan_layout(batch, opt.balancer, P, opt.J);  // a bad layout or J fails here, on every rank, before any communication
  if (!opt.dump.empty()) prepare_dump_dir(world, opt.dump);

  LayerProblem pb(cfg, batch, opt.seed);
  pb.window = KeyWindow::sliding(opt.window);
  const ReferenceLayerResult ref = opt.check ? pb.reference() : ReferenceLayerResult{};
  const LayerRunSpec spec = layer_run_spec(opt, opt.method, opt.balancer, opt.check ? &ref : nullptr);
  const LayerRun run = run_layer(world, pb, spec);
  const std::int64_t queries = wl.queries;

  const std::int64_t visible_pairs = full_mask(batch, pb.window).visible_pairs();
  nlohmann::json out{
      {"config", {{"P", P}, {"method", opt.method}, {"samples", opt.samples}, {"context", opt.context}, {"queries", queries},
                  {"balancer", opt.balancer}, {"J", run.J}, {"bucket", opt.bucket},
                  {"anchors", queries / opt.block}, {"block", opt.block}, {"prompt_fraction", opt.prompt_fraction},
                  {"hidden", cfg.hidden}, {"n_q", cfg.n_q}, {"n_kv", cfg.n_kv}, {"d_h", cfg.d_h},
                  {"rope_theta", cfg.rope_theta}, {"rms_eps", cfg.rms_eps}, {"dtype", opt.dtype}, {"seed", opt.seed},
                  {"S", batch.context_rows()}, {"Q", batch.query_rows()}, {"reps", opt.reps}, {"warmup", opt.warmup},
                  {"window", opt.window}}},
      {"method", opt.method},
      {"bytes", run.bytes},
      {"attention_bytes_per_layer", run.bytes_per_layer},
      {"predicted_bytes_per_layer", run.predicted_bytes_per_layer},
      {"inter_bytes_per_layer", run.inter_bytes_per_layer},
      {"topology", run.topology},
      {"redistribution_bytes", run.redistribution_bytes},
      {"imbalance_pct", run.imbalance_pct},
      // the attention's work: unmasked (query, key) pairs per head, and their share of full attention's
      {"visible_pairs", visible_pairs},
      {"visible_pair_share", static_cast<double>(visible_pairs) / static_cast<double>(full_mask(batch).visible_pairs())},
      {"fwd_ms", run.fwd_ms},
      {"bwd_ms", run.bwd_ms},
      {"step_ms", run.step_ms},
      {"exposed_comm_ms", run.exposed_comm_ms},
      {"fwd_allgather_exposed_ms", run.fwd_overlap_exposed_ms},
      {"bwd_reducescatter_exposed_ms", run.bwd_overlap_exposed_ms},
      {"blocking_comm_ms", run.blocking_comm_ms},
      {"peak_bytes", run.peak_bytes},
      {"run_peak_bytes", run.run_peak_bytes},
      {"peak_reset", run.peak_reset}};

  const bool pass = run.check_passed;
  if (method.splitkv_options) {
    out["predicted_inter_bytes_per_layer"] = run.predicted_inter_bytes_per_layer;
    out["oproj"] = run.oproj;
    out["collectives"] = run.collectives;
    if (opt.oproj == "auto") out["oproj_auto"] = {{"gemm_gflops", run.oproj_gemm_gflops}, {"link_gbit", run.oproj_link_gbit}};
  }
  if (run.checked)
    add_check_json(out, pass, run.max_abs_err, run.max_rel_err, run.max_tol_ratio, run.mismatches, run.tolerance,
                   kLayerAtolScale);
  if (!opt.dump.empty()) {
    const std::int64_t H = cfg.hidden, B = batch.block, Q = batch.query_rows(), S = batch.context_rows();
    std::vector<std::vector<PosRange>> blk_ranges;
    for (int r = 0; r < P; ++r) {
      const Shard b = even_shard(batch.num_blocks(), P, r);
      blk_ranges.push_back({{b.begin * B, b.end * B}});
    }
    const auto y = gather_rows(world, run.y_p, H, blk_ranges, Q), dx = gather_rows(world, run.dx_p, H, blk_ranges, Q);
    const auto dctx = gather_rows(world, run.dctx_p, H, run.chunks_of_rank, S);
    // Only a method that keeps the global lse has one (Split-KV; the baselines keep per-step
    // partials): decided alike on every rank (a rank may own no rows).
    std::vector<std::int64_t> lse_values{static_cast<std::int64_t>(run.lse.size())};
    world.all_reduce<std::int64_t>(lse_values);
    const bool has_lse = lse_values[0] > 0;
    const auto lse = has_lse ? gather_rows(world, run.lse, cfg.n_q, blk_ranges, Q) : std::vector<float>{};
    if (p == 0) {
      const std::string d = opt.dump + "/";
      write_npy(d + "x.npy", pb.x.data(), {Q, H});
      write_npy(d + "ctx.npy", pb.ctx.data(), {S, H});
      write_npy(d + "dy.npy", pb.dy.data(), {Q, H});
      write_npy(d + "y.npy", y.data(), {Q, H});
      write_npy(d + "dx.npy", dx.data(), {Q, H});
      write_npy(d + "dctx.npy", dctx.data(), {S, H});
      if (has_lse) write_npy(d + "lse.npy", lse.data(), {Q, cfg.n_q});
      const AttnLayerParams& grad = *run.grad;
      for (int i = 0; i < AttnLayerParams::kCount; ++i) {
        const auto id = static_cast<AttnLayerParams::Id>(i);
        write_npy(d + AttnLayerParams::name(id) + ".npy", pb.w[id], pb.w.shape(id));
        write_npy(d + "d" + AttnLayerParams::name(id) + ".npy", grad[id], grad.shape(id));
      }
      std::vector<std::int64_t> anchors;
      for (const auto& b : batch.blocks()) anchors.push_back(b.anchor);
      const nlohmann::json meta{{"P", P}, {"method", opt.method}, {"block", B}, {"n_q", cfg.n_q}, {"n_kv", cfg.n_kv},
                                {"d_h", cfg.d_h}, {"hidden", H}, {"rope_theta", cfg.rope_theta}, {"rms_eps", cfg.rms_eps},
                                {"sample_starts", batch.sample_starts()}, {"sample_lengths", batch.lengths},
                                {"anchors", anchors}, {"softmax_scale", 1.0 / std::sqrt(static_cast<double>(cfg.d_h))}};
      std::ofstream(d + "meta.json") << meta.dump(2) << "\n";
    }
  }

  if (p == 0) {
    if (opt.json) {
      std::cout << out.dump() << std::endl;
    } else {
      std::printf("diffcp attn: %s drafter attention layer on %d ranks\n", method.title, P);
      std::printf("  batch: %lld samples x %s context, %lld queries/sample (%lld anchors, B=%lld): S=%lld, Q=%lld\n",
                  static_cast<long long>(opt.samples), opt.context.c_str(), static_cast<long long>(queries),
                  static_cast<long long>(queries / opt.block), static_cast<long long>(opt.block),
                  static_cast<long long>(batch.context_rows()), static_cast<long long>(batch.query_rows()));
      std::printf("  context layout: %s (J=%d, bucket %lld): imbalance %.2f %%, redistribution %.0f bytes/rank\n",
                  opt.balancer.c_str(), run.J, static_cast<long long>(opt.bucket), run.imbalance_pct,
                  run.redistribution_bytes);
      if (opt.window > 0)
        std::printf("  sliding window %lld (causal): %.4f of full attention's (query, key) pairs\n",
                    static_cast<long long>(opt.window), out["visible_pair_share"].get<double>());
      std::printf("  layer: H=%lld n_q=%lld n_kv=%lld d_h=%lld, %s\n", static_cast<long long>(cfg.hidden),
                  static_cast<long long>(cfg.n_q), static_cast<long long>(cfg.n_kv), static_cast<long long>(cfg.d_h),
                  wl.dtype == DType::bf16 ? "bf16 attention and row payloads, f32 projections and boundary" : "f32");
      if (wl.dtype == DType::bf16) std::printf("  bf16 path: %s\n", active_backend().describe(DType::bf16).c_str());
      std::printf("  time (median of %d after %d warm-up, slowest rank): forward %.2f ms, backward %.2f ms, step %.2f ms, "
                  "exposed communication %.2f ms\n",
                  opt.reps, opt.warmup, run.fwd_ms, run.bwd_ms, run.step_ms, run.exposed_comm_ms);
      if (method.splitkv_options)
        std::printf("  bytes per layer per rank: %.0f measured, %.0f predicted (cp/splitkv.hpp); to other nodes: %.0f "
                    "measured, %.0f predicted; %s, oproj %s, %s collectives\n",
                    run.bytes_per_layer, run.predicted_bytes_per_layer, run.inter_bytes_per_layer,
                    run.predicted_inter_bytes_per_layer, run.topology.c_str(), run.oproj.c_str(), run.collectives.c_str());
      else
        std::printf("  bytes per layer per rank: %.0f measured, %.0f predicted by the %s closed form (cp/%s.hpp)\n",
                    run.bytes_per_layer, run.predicted_bytes_per_layer, method.title, opt.method.c_str());
      for (auto it = run.bytes.begin(); it != run.bytes.end(); ++it)
        std::printf("    %-15s %s\n", it.key().c_str(), it.value().dump().c_str());
      std::printf("  peak resident memory, max over ranks: %.1f MiB process (VmHWM%s), %.1f MiB added by the run\n",
                  static_cast<double>(run.peak_bytes) / (1 << 20), run.peak_reset ? ", reset at the run's start" : " since process start",
                  static_cast<double>(run.run_peak_bytes) / (1 << 20));
      if (run.checked)
        std::printf("  check vs fp64 single-process reference (y, dX, dctx, all parameter gradients): max abs err %.3g, "
                    "max rel err %.3g (of each tensor's max |ref|), worst error %.3g of its tolerance (atol %.3g x max(1, "
                    "max|ref|) + rtol %.3g |ref|; <= 1 passes), %lld mismatches -> %s\n",
                    run.max_abs_err, run.max_rel_err, run.max_tol_ratio, run.tolerance.atol, run.tolerance.rtol,
                    static_cast<long long>(run.mismatches), pass ? "PASSED" : "FAILED");
      if (!opt.dump.empty()) std::printf("  wrote .npy files and meta.json to %s\n", opt.dump.c_str());
    }
  }
  return pass ? 0 : 2;
}

}  // namespace diffcp::cli
