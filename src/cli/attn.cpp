// `diffcp attn`: one drafter attention layer (forward + backward) with Split-KV on the ranks of
// mpirun; --check against the fp64 single-process reference, --json, --dump DIR (.npy files).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "balance/balancer.hpp"
#include "balance/redistribute.hpp"
#include "cp/layer_problem.hpp"
#include "cp/splitkv.hpp"
#include "io/npy.hpp"

namespace diffcp::cli {

void add_attn_command(CLI::App& app, AttnOptions& opt) {
  CLI::App* c = app.add_subcommand("attn", "One drafter attention layer, forward + backward, with Split-KV "
                                           "context parallelism over the mpirun ranks");
  c->add_option("--samples", opt.samples, "samples packed in the micro-batch")->capture_default_str();
  c->add_option("--context", opt.context, "context tokens per sample (16k-style), or a range a:b to draw from")->capture_default_str();
  c->add_option("--queries", opt.queries, "query rows per sample; anchors = queries / block")->capture_default_str();
  c->add_option("--block", opt.block, "block size B")->capture_default_str();
  c->add_option("--prompt-fraction", opt.prompt_fraction, "prompt share of each sample (0.25 = 1:3)")->capture_default_str();
  c->add_option("--hidden", opt.hidden, "model width H")->capture_default_str();
  c->add_option("--n-q", opt.n_q, "query heads")->capture_default_str();
  c->add_option("--n-kv", opt.n_kv, "key/value heads (GQA)")->capture_default_str();
  c->add_option("--d-h", opt.d_h, "head dimension")->capture_default_str();
  c->add_option("--rope-theta", opt.rope_theta, "RoPE base")->capture_default_str();
  c->add_option("--rms-eps", opt.rms_eps, "RMSNorm epsilon")->capture_default_str();
  c->add_option("--dtype", opt.dtype, "storage type (f32)")->capture_default_str();
  c->add_option("--seed", opt.seed, "seed of the batch, weights and inputs")->capture_default_str();
  c->add_option("--reps", opt.reps, "timed repetitions after one warm-up (median reported)")->capture_default_str();
  c->add_flag("--check", opt.check, "compare output and all gradients with the fp64 single-process reference");
  c->add_flag("--json", opt.json, "print one JSON object");
  c->add_option("--dump", opt.dump, "write inputs and outputs as .npy files + meta.json into this directory");
  c->add_option("--balancer", opt.balancer, "context layout: none | zigzag | lpt | partition")->capture_default_str();
  c->add_option("--J", opt.J, "chunks per rank for lpt / partition")->capture_default_str();
  c->add_option("--bucket", opt.bucket, "round the local K/V length up to a multiple of this (1 = off)")->capture_default_str();
}

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

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
  const CountRange context = parse_range(opt.context, "--context");
  const std::int64_t queries = parse_count(opt.queries, "--queries");
  DIFFCP_CHECK(opt.dtype == "f32", "--dtype = '", opt.dtype, "': unknown or unsupported dtype (supported: f32)");
  DIFFCP_CHECK(opt.block >= 1, "--block = ", opt.block, ", expected >= 1");
  DIFFCP_CHECK(queries % opt.block == 0, "--queries = ", queries, " per sample is not a multiple of --block = ", opt.block);
  DIFFCP_CHECK(opt.reps >= 1, "--reps = ", opt.reps, ", expected >= 1");
  DIFFCP_CHECK(opt.bucket >= 1, "--bucket = ", opt.bucket, ", expected >= 1");
  const auto balancer = make_balancer(opt.balancer);
  const AttnLayerConfig cfg{opt.hidden, opt.n_q, opt.n_kv, opt.d_h, opt.rope_theta, opt.rms_eps};
  cfg.validate();
  if (!opt.dump.empty()) prepare_dump_dir(world, opt.dump);

  const int P = world.size(), p = world.rank();
  const PackedBatch batch =
      make_random_batch(opt.samples, context.min, queries / opt.block, opt.block, opt.prompt_fraction, opt.seed, context.max);
  const LayerProblem pb(cfg, batch, opt.seed);

  // Plan the context layout (every rank alike, no communication), then move the context rows from
  // the loader's contiguous slices to their planned ranks: one all-to-all-v, counted on its own
  // communicator apart from the layer's bytes.
  const CostModel cost(batch);
  const Plan plan = balancer->plan(batch, cost, P, opt.J);
  const auto chunks_of_rank = plan.chunks_of_rank();
  CpShard shard = chunked_shard(batch, P, p, chunks_of_rank);
  shard.bucket = opt.bucket;
  const PosRange loaded = loader_slices(batch.context_rows(), P)[static_cast<std::size_t>(p)];
  std::vector<float> loaded_rows(pb.ctx.begin() + loaded.begin * cfg.hidden, pb.ctx.begin() + loaded.end * cfg.hidden);
  const auto redist_comm = world.split(0, p, "redistribute");
  const auto ctx_p = redistribute_rows(*redist_comm, batch, plan, loaded_rows, cfg.hidden);
  const auto x_p = pb.x_rows(shard), dy_p = pb.dy_rows(shard);
  std::vector<float> y_p(x_p.size()), dx_p(x_p.size()), dctx_p(ctx_p.size());
  AttnLayerParams grad(cfg);
  SplitKVLayer layer(world, cfg, shard);

  // One warm-up, then `reps` timed runs; per run the slowest rank's time counts.
  std::vector<double> fwd, bwd, exposed, ag_exposed, rs_exposed, blocking;
  CommStats layer_stats;
  for (int rep = 0; rep <= opt.reps; ++rep) {
    std::fill(grad.all().begin(), grad.all().end(), 0.f);
    world.barrier();
    world.stats().reset();
    layer.forward(pb.w, x_p.data(), ctx_p.data(), y_p.data());
    layer.backward(pb.w, dy_p.data(), dx_p.data(), dctx_p.data(), grad);
    layer_stats = world.stats();
    const CpTimings& t = layer.timings();
    std::vector<double> v{t.fwd_ms, t.bwd_ms, t.exposed_comm_ms(), t.fwd_overlap_exposed_ms, t.bwd_overlap_exposed_ms, t.blocking_comm_ms};
    world.all_reduce<double>(v, ReduceOp::max);
    if (rep == 0) continue;
    fwd.push_back(v[0]), bwd.push_back(v[1]), exposed.push_back(v[2]);
    ag_exposed.push_back(v[3]), rs_exposed.push_back(v[4]), blocking.push_back(v[5]);
  }
  allreduce_grads(world, grad);

  // Bytes of one layer (forward + backward), summed over ranks.
  nlohmann::json bytes = nlohmann::json::object();
  std::vector<std::uint64_t> sent;
  for (std::size_t k = 0; k < kNumCommOps; ++k) sent.push_back(layer_stats[static_cast<CommOp>(k)].bytes_sent);
  world.all_reduce<std::uint64_t>(sent);
  std::uint64_t total_sent = 0;
  for (std::size_t k = 0; k < kNumCommOps; ++k) {
    const OpCounter& c = layer_stats[static_cast<CommOp>(k)];
    if (c.calls == 0) continue;
    bytes[comm_op_name(static_cast<CommOp>(k))] = {{"calls", c.calls}, {"sent_total", sent[k]},
                                                   {"sent_per_rank", static_cast<double>(sent[k]) / P}};
    total_sent += sent[k];
  }
  const double per_layer = static_cast<double>(total_sent) / P;
  std::vector<std::uint64_t> redist_sent{redist_comm->stats().total().bytes_sent};
  world.all_reduce<std::uint64_t>(redist_sent);

  nlohmann::json out{
      {"config", {{"P", P}, {"samples", opt.samples}, {"context", opt.context}, {"queries", queries},
                  {"balancer", opt.balancer}, {"J", plan.J}, {"bucket", opt.bucket},
                  {"anchors", queries / opt.block}, {"block", opt.block}, {"prompt_fraction", opt.prompt_fraction},
                  {"hidden", cfg.hidden}, {"n_q", cfg.n_q}, {"n_kv", cfg.n_kv}, {"d_h", cfg.d_h},
                  {"rope_theta", cfg.rope_theta}, {"rms_eps", cfg.rms_eps}, {"dtype", opt.dtype}, {"seed", opt.seed},
                  {"S", batch.context_rows()}, {"Q", batch.query_rows()}, {"reps", opt.reps}}},
      {"bytes", bytes},
      {"attention_bytes_per_layer", per_layer},
      {"predicted_bytes_per_layer", layer.predicted_bytes_per_layer()},
      {"redistribution_bytes", static_cast<double>(redist_sent[0]) / P},
      {"imbalance_pct", plan_load(batch, cost, plan).imbalance_pct()},
      {"fwd_ms", median(fwd)},
      {"bwd_ms", median(bwd)},
      {"exposed_comm_ms", median(exposed)},
      {"fwd_allgather_exposed_ms", median(ag_exposed)},
      {"bwd_reducescatter_exposed_ms", median(rs_exposed)},
      {"blocking_comm_ms", median(blocking)}};

  bool pass = true;
  if (opt.check) {
    const LayerCheck c = check_layer(pb.reference(), shard, cfg.hidden, y_p, dx_p, dctx_p, grad);
    const CompareResult all = c.all();
    std::vector<double> err{all.max_abs, all.max_rel};
    std::vector<std::int64_t> bad{all.mismatched};
    world.all_reduce<double>(err, ReduceOp::max);
    world.all_reduce<std::int64_t>(bad);
    pass = bad[0] == 0;
    out["max_abs_err"] = err[0];
    out["max_rel_err"] = err[1];
    out["check_passed"] = pass;
    out["mismatches"] = bad[0];
  }

  if (!opt.dump.empty()) {
    const std::int64_t H = cfg.hidden, B = batch.block, Q = batch.query_rows(), S = batch.context_rows();
    std::vector<std::vector<PosRange>> blk_ranges;
    for (int r = 0; r < P; ++r) {
      const Shard b = even_shard(batch.num_blocks(), P, r);
      blk_ranges.push_back({{b.begin * B, b.end * B}});
    }
    const auto& ctx_ranges = chunks_of_rank;
    const auto y = gather_rows(world, y_p, H, blk_ranges, Q), dx = gather_rows(world, dx_p, H, blk_ranges, Q);
    const auto dctx = gather_rows(world, dctx_p, H, ctx_ranges, S);
    if (p == 0) {
      const std::string d = opt.dump + "/";
      write_npy(d + "x.npy", pb.x.data(), {Q, H});
      write_npy(d + "ctx.npy", pb.ctx.data(), {S, H});
      write_npy(d + "dy.npy", pb.dy.data(), {Q, H});
      write_npy(d + "y.npy", y.data(), {Q, H});
      write_npy(d + "dx.npy", dx.data(), {Q, H});
      write_npy(d + "dctx.npy", dctx.data(), {S, H});
      write_npy(d + "lse.npy", layer.lse().data(), {Q, cfg.n_q});
      for (int i = 0; i < AttnLayerParams::kCount; ++i) {
        const auto id = static_cast<AttnLayerParams::Id>(i);
        write_npy(d + AttnLayerParams::name(id) + ".npy", pb.w[id], pb.w.shape(id));
        write_npy(d + "d" + AttnLayerParams::name(id) + ".npy", grad[id], grad.shape(id));
      }
      std::vector<std::int64_t> anchors;
      for (const auto& b : batch.blocks()) anchors.push_back(b.anchor);
      const nlohmann::json meta{{"P", P}, {"block", B}, {"n_q", cfg.n_q}, {"n_kv", cfg.n_kv}, {"d_h", cfg.d_h},
                                {"hidden", H}, {"rope_theta", cfg.rope_theta}, {"rms_eps", cfg.rms_eps},
                                {"sample_starts", batch.sample_starts()}, {"sample_lengths", batch.lengths},
                                {"anchors", anchors}, {"softmax_scale", 1.0 / std::sqrt(static_cast<double>(cfg.d_h))}};
      std::ofstream(d + "meta.json") << meta.dump(2) << "\n";
    }
  }

  if (p == 0) {
    if (opt.json) {
      std::cout << out.dump() << std::endl;
    } else {
      std::printf("diffcp attn: Split-KV drafter attention layer on %d ranks\n", P);
      std::printf("  batch: %lld samples x %s context, %lld queries/sample (%lld anchors, B=%lld): S=%lld, Q=%lld\n",
                  static_cast<long long>(opt.samples), opt.context.c_str(), static_cast<long long>(queries),
                  static_cast<long long>(queries / opt.block), static_cast<long long>(opt.block),
                  static_cast<long long>(batch.context_rows()), static_cast<long long>(batch.query_rows()));
      std::printf("  context layout: %s (J=%d, bucket %lld): imbalance %.2f %%, redistribution %.0f bytes/rank\n",
                  opt.balancer.c_str(), plan.J, static_cast<long long>(opt.bucket), out["imbalance_pct"].get<double>(),
                  out["redistribution_bytes"].get<double>());
      std::printf("  layer: H=%lld n_q=%lld n_kv=%lld d_h=%lld, f32\n", static_cast<long long>(cfg.hidden),
                  static_cast<long long>(cfg.n_q), static_cast<long long>(cfg.n_kv), static_cast<long long>(cfg.d_h));
      std::printf("  time (median of %d, slowest rank): forward %.2f ms, backward %.2f ms, exposed communication %.2f ms\n",
                  opt.reps, median(fwd), median(bwd), median(exposed));
      std::printf("  bytes per layer per rank: %.0f measured, %.0f predicted by (P-1)/P*2Q(n_q*d_h+H) + 4(P-1)/P*Q*n_q\n",
                  per_layer, layer.predicted_bytes_per_layer());
      for (auto it = bytes.begin(); it != bytes.end(); ++it)
        std::printf("    %-15s %s\n", it.key().c_str(), it.value().dump().c_str());
      if (opt.check)
        std::printf("  check vs fp64 single-process reference (y, dX, dctx, all parameter gradients): max abs err %.3g, "
                    "max rel err %.3g -> %s\n",
                    out["max_abs_err"].get<double>(), out["max_rel_err"].get<double>(), pass ? "PASSED" : "FAILED");
      if (!opt.dump.empty()) std::printf("  wrote .npy files and meta.json to %s\n", opt.dump.c_str());
    }
  }
  return pass ? 0 : 2;
}

}  // namespace diffcp::cli
