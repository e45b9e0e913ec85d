#include "diffcp/testing/layer_run.hpp"

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <string>

#include "diffcp/balance/redistribute.hpp"
#include "diffcp/core/stats.hpp"
#include "diffcp/cp/cp_methods.hpp"
#include "diffcp/cp/splitkv.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/ops/linear.hpp"

namespace diffcp {

Plan plan_layout(const PackedBatch& batch, const std::string& layout, int P, int J, KeyWindow window) {
  return make_balancer(layout)->plan(batch, CostModel(batch, {window}), P, J);
}

namespace {

// Resident-memory probe of this process (Linux /proc). VmHWM is the peak resident set size;
// writing "5" to /proc/self/clear_refs resets it to the current size (Linux >= 4.0), so the
// peak of one run is measured apart from what ran before it in the same process.
std::uint64_t status_kib(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(f, line))
    if (line.rfind(k, 0) == 0) return std::stoull(line.substr(k.size()));
  return 0;
}

struct PeakProbe {
  bool reset = false;
  std::uint64_t start_bytes = 0;
  PeakProbe() {
    malloc_trim(0);  // hand memory freed by an earlier run back, so it does not count as resident now
    std::ofstream f("/proc/self/clear_refs");
    reset = static_cast<bool>(f << "5" << std::flush);
    start_bytes = status_kib("VmRSS") * 1024;
  }
  std::uint64_t peak_bytes() const { return status_kib("VmHWM") * 1024; }
};

// --oproj auto (SplitKVLayer's choose_oproj): the W_o GEMM rate measured on this rank's share of
// rows and, unless given, the link rate of one rank in the dY all-gather; slowest rank's times, so
// every rank decides alike.
OProj resolve_oproj(Communicator& world, const LayerProblem& pb, const LayerRunSpec& spec, CollAlgo algo,
                    LayerRun& run) {
  if (spec.oproj != "auto") return parse_oproj(spec.oproj);
  const int P = world.size();
  const std::int64_t Q = pb.batch.query_rows(), H = pb.cfg.hidden, qw = pb.cfg.q_width();
  if (P == 1) return OProj::all;
  const std::int64_t rows = std::max<std::int64_t>(1, Q / P);
  // The GEMM on the active backend's memory, as the layer runs it (the all-gather's rate is the link's).
  Backend& be = active_backend();
  Buffer o(DType::f32, rows * qw, be), y(DType::f32, rows * H, be), wo(DType::f32, qw * H, be);
  fill(o.view(), 0.5f);
  fill(wo.view(), 0.01f);
  std::vector<std::size_t> counts;
  for (int r = 0; r < P; ++r) counts.push_back(static_cast<std::size_t>((Q / P + (r < Q % P)) * H));
  std::vector<float> mine(counts[static_cast<std::size_t>(world.rank())]), all(static_cast<std::size_t>(Q * H));
  std::vector<double> gemm_ms, ag_ms;
  for (int rep = 0; rep < 3; ++rep) {
    be.synchronize();
    auto t0 = std::chrono::steady_clock::now();
    linear_forward(o.ptr<float>(), rows, qw, wo.ptr<float>(), H, y.ptr<float>());
    be.synchronize();
    gemm_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (spec.link_gbit > 0) continue;
    world.barrier();
    t0 = std::chrono::steady_clock::now();
    world.all_gather_v_async(mine.data(), all.data(), counts, DType::f32, algo)->wait();
    ag_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::vector<double> t{median(gemm_ms), spec.link_gbit > 0 ? 0.0 : median(ag_ms)};
  world.all_reduce<double>(t, ReduceOp::max);
  run.oproj_gemm_gflops = 2.0 * static_cast<double>(rows * qw * H) / (std::max(t[0], 1e-6) * 1e6);
  // A rank receives (P-1)/P of the gathered buffer.
  run.oproj_link_gbit = spec.link_gbit > 0 ? spec.link_gbit
                                           : 8.0 * 4.0 * static_cast<double>(Q * H) * (P - 1) / P / (std::max(t[1], 1e-6) * 1e6);
  return choose_oproj(pb.cfg, Q, P, run.oproj_gemm_gflops, run.oproj_link_gbit);
}

}  // namespace

LayerRun run_layer(Communicator& world, const LayerProblem& pb, const LayerRunSpec& spec) {
  const int P = world.size(), p = world.rank();
  const AttnLayerConfig& cfg = pb.cfg;
  const PackedBatch& batch = pb.batch;
  // Everything that can be refused is refused here, alike on every rank, before communicating.
  const CpMethod& method = cp_method(spec.method);
  const std::string why = method.unsupported_reason(cfg, P);
  DIFFCP_CHECK(why.empty(), why);
  DIFFCP_CHECK(spec.reps >= 1 && spec.warmup >= 0, "run_layer: reps = ", spec.reps, ", warmup = ", spec.warmup,
               "; expected reps >= 1, warmup >= 0");
  const Plan plan = plan_layout(batch, spec.layout, P, spec.J, pb.window);

  LayerRun run;
  world.discover_topology();
  run.topology = world.topology().describe();
  run.method = spec.method;
  run.layout = spec.layout;
  run.J = plan.J;
  const PeakProbe probe;

  // Move the context rows from the loader's contiguous slices to their planned ranks: one
  // all-to-all-v, counted on its own communicator apart from the layer's bytes.
  run.chunks_of_rank = plan.chunks_of_rank();
  run.shard = chunked_shard(batch, P, p, run.chunks_of_rank);
  run.shard.bucket = spec.bucket;
  run.shard.window = pb.window;
  const PosRange loaded = loader_slices(batch.context_rows(), P)[static_cast<std::size_t>(p)];
  std::vector<float> loaded_rows(pb.ctx.begin() + loaded.begin * cfg.hidden, pb.ctx.begin() + loaded.end * cfg.hidden);
  const auto redist_comm = world.split(0, p, "redistribute");
  const auto ctx_p = redistribute_rows(*redist_comm, batch, plan, loaded_rows, cfg.hidden);
  std::vector<float>().swap(loaded_rows);
  const auto x_p = pb.x_rows(run.shard), dy_p = pb.dy_rows(run.shard);
  // Inputs, weights, outputs and gradients in the active backend's memory. On the host they are
  // the vectors themselves (no copy: the peak memory reported stays the layer's); a device backend
  // gets copies, and the results come back for the report and the check.
  Backend& be = active_backend();
  const bool on_host = be.device() == Device::host;
  run.y_p.resize(x_p.size());
  run.dx_p.resize(x_p.size());
  run.dctx_p.resize(ctx_p.size());
  run.grad = std::make_unique<AttnLayerParams>(cfg);
  std::vector<Buffer> copies;  // a device backend's
  const auto in = [&](std::span<const float> v) -> const float* {
    if (on_host) return v.data();
    copies.push_back(to_device(v, be));
    return copies.back().ptr<float>();
  };
  const auto out = [&](std::span<float> v) -> float* {
    if (on_host) return v.data();
    copies.emplace_back(DType::f32, static_cast<std::int64_t>(v.size()), be);
    return copies.back().ptr<float>();
  };
  const float *x_d = in(x_p), *ctx_d = in(ctx_p), *dy_d = in(dy_p), *w_d = in(pb.w.all());
  float *y_d = out(run.y_p), *dx_d = out(run.dx_p), *dctx_d = out(run.dctx_p), *grad_d = out(run.grad->all());
  const Device dev = be.device();
  const auto rows = [&](const float* p, std::int64_t n) { return ConstTensorView::contiguous(p, DType::f32, {n, cfg.hidden}, dev); };
  const auto out_rows = [&](float* p, std::int64_t n) { return TensorView::contiguous(p, DType::f32, {n, cfg.hidden}, dev); };
  const AttnLayerParams w = AttnLayerParams::view(cfg, w_d);
  AttnLayerParams grad(cfg, grad_d);
  SplitKVOptions skv;
  skv.compute = spec.dtype;
  if (method.splitkv_options) {
    skv.collectives = spec.collectives == "auto" ? CollAlgo::hierarchical : parse_coll_algo(spec.collectives);
    skv.oproj = resolve_oproj(world, pb, spec, skv.collectives, run);
    run.oproj = oproj_name(skv.oproj);
    run.collectives = skv.collectives == CollAlgo::hierarchical && world.hierarchy_useful() ? "hierarchical" : "flat";
  }
  run.layer = method.make(world, cfg, run.shard, skv);
  CpAttentionLayer& layer = *run.layer;
  const std::int64_t Qp = run.shard.own_query_rows(), Cp = run.shard.context_rows();

  // `warmup` untimed runs, then `reps` timed ones; per run the slowest rank's time counts.
  std::vector<double> fwd, bwd, step, exposed, fwd_exposed, bwd_exposed, blocking;
  CommStats layer_stats;
  for (int rep = 0; rep < spec.warmup + spec.reps; ++rep) {
    fill(TensorView::contiguous(grad_d, DType::f32, {AttnLayerParams::count(cfg)}, dev), 0.f);
    world.barrier();
    world.stats().reset();
    CpSaved saved = layer.forward(w, rows(x_d, Qp), rows(ctx_d, Cp), out_rows(y_d, Qp));
    if (rep + 1 == spec.warmup + spec.reps) {
      const std::span<const float> lse = layer.saved_lse(saved);
      run.lse = to_host<float>(device_view(lse));
    }
    layer.backward(std::move(saved), w, rows(dy_d, Qp), out_rows(dx_d, Qp), out_rows(dctx_d, Cp), grad);
    layer_stats = world.stats();
    const CpTimings& t = layer.timings();
    std::vector<double> v{t.fwd_ms, t.bwd_ms, t.fwd_ms + t.bwd_ms, t.exposed_comm_ms(),
                          t.fwd_overlap_exposed_ms, t.bwd_overlap_exposed_ms, t.blocking_comm_ms};
    world.all_reduce<double>(v, ReduceOp::max);
    if (rep < spec.warmup) continue;
    fwd.push_back(v[0]), bwd.push_back(v[1]), step.push_back(v[2]), exposed.push_back(v[3]);
    fwd_exposed.push_back(v[4]), bwd_exposed.push_back(v[5]), blocking.push_back(v[6]);
  }
  allreduce_grads(world, grad);
  if (!on_host) {  // the results back to the host vectors
    for (auto [host, d] : {std::pair{std::span<float>(run.y_p), y_d}, {std::span<float>(run.dx_p), dx_d},
                           {std::span<float>(run.dctx_p), dctx_d}, {run.grad->all(), grad_d}})
      copy(view_of(host), TensorView::contiguous(d, DType::f32, {static_cast<std::int64_t>(host.size())}, dev));
  }
  const std::uint64_t hwm = probe.peak_bytes();
  std::vector<std::uint64_t> peak{hwm, hwm - std::min(hwm, probe.start_bytes)};
  std::vector<std::uint64_t> resets{probe.reset ? 1u : 0u};
  world.all_reduce<std::uint64_t>(peak, ReduceOp::max);
  world.all_reduce<std::uint64_t>(resets);
  run.peak_bytes = peak[0];
  run.run_peak_bytes = peak[1];
  run.peak_reset = resets[0] == static_cast<std::uint64_t>(P);

  run.fwd_ms = median(fwd), run.bwd_ms = median(bwd), run.step_ms = median(step);
  run.exposed_comm_ms = median(exposed), run.fwd_overlap_exposed_ms = median(fwd_exposed);
  run.bwd_overlap_exposed_ms = median(bwd_exposed), run.blocking_comm_ms = median(blocking);

  // Bytes of one layer (forward + backward), summed over ranks.
  run.bytes = nlohmann::json::object();
  std::vector<std::uint64_t> sent;
  for (std::size_t k = 0; k < kNumCommOps; ++k) sent.push_back(layer_stats[static_cast<CommOp>(k)].bytes_sent);
  sent.push_back(layer_stats.total().bytes_sent_inter);
  world.all_reduce<std::uint64_t>(sent);
  run.inter_bytes_per_layer = static_cast<double>(sent.back()) / P;
  run.predicted_inter_bytes_per_layer = layer.predicted_inter_bytes_per_layer();
  std::uint64_t total_sent = 0;
  for (std::size_t k = 0; k < kNumCommOps; ++k) {
    const OpCounter& c = layer_stats[static_cast<CommOp>(k)];
    if (c.calls == 0) continue;
    run.bytes[comm_op_name(static_cast<CommOp>(k))] = {{"calls", c.calls}, {"sent_total", sent[k]},
                                                       {"sent_per_rank", static_cast<double>(sent[k]) / P}};
    total_sent += sent[k];
  }
  run.bytes_per_layer = static_cast<double>(total_sent) / P;
  run.predicted_bytes_per_layer = layer.predicted_bytes_per_layer();
  std::vector<std::uint64_t> redist_sent{redist_comm->stats().total().bytes_sent};
  world.all_reduce<std::uint64_t>(redist_sent);
  run.redistribution_bytes = static_cast<double>(redist_sent[0]) / P;
  run.imbalance_pct = plan_load(batch, CostModel(batch, {pb.window}), plan).imbalance_pct();

  if (spec.reference) {
    run.tolerance = spec.dtype == DType::bf16 ? kTolBf16Layer : kTolF32;
    const LayerCheck c = check_layer(*spec.reference, run.shard, cfg.hidden, run.y_p, run.dx_p, run.dctx_p, *run.grad,
                                     run.tolerance);
    const CompareResult all = c.all();
    std::vector<double> err{all.max_abs, all.max_rel, all.worst_ratio};
    std::vector<std::int64_t> bad{all.mismatched};
    world.all_reduce<double>(err, ReduceOp::max);
    world.all_reduce<std::int64_t>(bad);
    run.checked = true;
    run.check_passed = bad[0] == 0;
    run.max_abs_err = err[0];
    run.max_rel_err = err[1];
    run.max_tol_ratio = err[2];
    run.mismatches = bad[0];
  }
  return run;
}

}  // namespace diffcp
