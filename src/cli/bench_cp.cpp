// `diffcp bench cp`: the CP methods of the drafter attention layer side by side on one workload
// (the generator of `diffcp attn`), one row per method: forward, backward and step time, bytes
// per layer, peak memory, exact-check result. Text table, --json (an array), --csv FILE.
//
// Context layout per method (what each is usually run with): splitkv --balancer (default lpt),
// ring zigzag, ulysses / ringx / lvxattn contiguous (none); --layout-for-all NAME forces one.
// With --methods all, a method that cannot serve the configuration (Ulysses when P does not
// divide n_kv) is a row {"supported": false, "reason": ...} and never communicates; naming such a
// method explicitly is an error, raised before any communication.
#include <cstdio>
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>

#include "diffcp/balance/balancer.hpp"
#include "cli/commands.hpp"
#include "cli/layer_run.hpp"
#include "diffcp/cp/cp_methods.hpp"

namespace diffcp::cli {

void add_bench_command(CLI::App& app, BenchCpOptions& opt, BenchP2pOptions& p2p, BenchCollOptions& coll) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks run under mpirun");
  bench->require_subcommand(1);
  CLI::App* c = bench->add_subcommand("cp", "The CP methods of the drafter attention layer on one workload, one row "
                                            "per method (times, bytes per layer, peak memory, check)");
  c->add_option("--methods", opt.methods, "comma list of splitkv, ulysses, ring, ringx, lvxattn, or all")->capture_default_str();
  add_layer_options(c, opt.layer);
  c->add_flag("--json", opt.layer.json, "print one JSON array, one object per method");
  c->add_option("--csv", opt.csv, "also write the rows to this CSV file");
  c->add_option("--balancer", opt.layer.balancer, "Split-KV's context layout: none | zigzag | lpt | partition")->capture_default_str();
  c->add_option("--layout-for-all", opt.layout_for_all, "one context layout for every method (default: each method's "
                                                        "usual one: ring zigzag, ulysses/ringx/lvxattn none)");
  add_bench_p2p_command(*bench, p2p);
  add_bench_coll_command(*bench, coll);
}

namespace {

struct Entry {
  std::string method, layout, reason;  // reason empty: supported
};

std::string csv_field(const nlohmann::ordered_json& v) {
  if (v.is_null()) return "";
  if (v.is_string()) {
    std::string s = v.get<std::string>(), q = "\"";
    for (char ch : s) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
    return q + "\"";
  }
  return v.dump();
}

const char* const kCsvColumns[] = {
    "method", "P", "supported", "reason", "layout", "J", "samples", "context", "queries", "S", "Q", "hidden", "n_q",
    "n_kv", "d_h", "reps", "warmup", "fwd_ms", "bwd_ms", "step_ms", "exposed_comm_ms", "bytes_per_layer",
    "predicted_bytes_per_layer", "redistribution_bytes", "imbalance_pct", "peak_bytes", "run_peak_bytes",
    "check_passed", "max_abs_err", "inter_bytes_per_layer", "topology", "oproj", "collectives", "max_tol_ratio"};

}  // namespace

int run_bench_cp(Communicator& world, const BenchCpOptions& opt) {
  // Everything is checked alike on every rank before the first communication.
  const AttnOptions& o = opt.layer;
  const LayerWorkload wl = make_workload(o);
  const AttnLayerConfig& cfg = wl.cfg;
  const PackedBatch& batch = wl.batch;
  const int P = world.size();
  const bool all = opt.methods == "all";
  std::vector<Entry> entries;
  for (const std::string& m : parse_method_list(opt.methods)) {
    const CpMethod& method = cp_method(m);  // throws for an unknown name, listing the names
    Entry e{m, "", method.unsupported_reason(cfg, P)};
    DIFFCP_CHECK(all || e.reason.empty(), "--methods ", m, ": ", e.reason,
                 " (drop it from --methods, or use --methods all to list it as unsupported)");
    e.layout = !opt.layout_for_all.empty() ? opt.layout_for_all : method.splitkv_options ? o.balancer : method.default_layout;
    if (e.reason.empty()) plan_layout(batch, e.layout, P, o.J);  // throws for a bad layout or J
    entries.push_back(e);
  }
  std::ofstream csv;
  if (!opt.csv.empty()) {
    std::int32_t ok = 1;
    if (world.rank() == 0) {
      csv.open(opt.csv);
      ok = csv.good();
    }
    world.broadcast<std::int32_t>(std::span<std::int32_t>(&ok, 1), 0);
    DIFFCP_CHECK(ok, "--csv '", opt.csv, "': cannot open this file for writing");
  }

  LayerProblem pb(cfg, batch, o.seed);
  pb.window = KeyWindow::sliding(o.window);
  const ReferenceLayerResult ref = o.check ? pb.reference() : ReferenceLayerResult{};
  // Rows keep their keys in this order (method first, the per-op byte counts last).
  using Json = nlohmann::ordered_json;
  const Json workload{{"samples", o.samples}, {"context", o.context}, {"queries", wl.queries},
                                {"S", batch.context_rows()}, {"Q", batch.query_rows()}, {"hidden", cfg.hidden},
                                {"n_q", cfg.n_q}, {"n_kv", cfg.n_kv}, {"d_h", cfg.d_h}};
  Json rows = Json::array();
  bool all_pass = true;
  for (const Entry& e : entries) {
    Json row{{"method", e.method}, {"P", P}, {"supported", e.reason.empty()}};
    if (!e.reason.empty()) {
      row["reason"] = e.reason;
      row.update(workload);
      rows.push_back(row);
      continue;
    }
    const LayerRunSpec spec = layer_run_spec(o, e.method, e.layout, o.check ? &ref : nullptr);
    const LayerRun run = run_layer(world, pb, spec);
    row.update({{"layout", e.layout}, {"J", run.J}});
    row.update(workload);
    row.update({{"reps", o.reps}, {"warmup", o.warmup},
                {"fwd_ms", run.fwd_ms}, {"bwd_ms", run.bwd_ms}, {"step_ms", run.step_ms},
                {"exposed_comm_ms", run.exposed_comm_ms},
                {"bytes_per_layer", run.bytes_per_layer}, {"predicted_bytes_per_layer", run.predicted_bytes_per_layer},
                {"inter_bytes_per_layer", run.inter_bytes_per_layer}, {"topology", run.topology},
                {"redistribution_bytes", run.redistribution_bytes}, {"imbalance_pct", run.imbalance_pct},
                {"peak_bytes", run.peak_bytes}, {"run_peak_bytes", run.run_peak_bytes}, {"peak_reset", run.peak_reset},
                {"check_passed", run.checked ? Json(run.check_passed) : Json()},
});
    if (cp_method(e.method).splitkv_options)
      row.update({{"predicted_inter_bytes_per_layer", run.predicted_inter_bytes_per_layer}, {"oproj", run.oproj},
                  {"collectives", run.collectives}});
    if (run.checked)
      add_check_json(row, run.check_passed, run.max_abs_err, run.max_rel_err, run.max_tol_ratio, run.mismatches, run.tolerance,
                     kLayerAtolScale);
    row["bytes"] = Json::parse(run.bytes.dump());
    all_pass = all_pass && run.check_passed;
    rows.push_back(row);
  }

  if (world.rank() != 0) return all_pass ? 0 : 2;
  if (csv.is_open()) {
    std::string line;
    for (const char* col : kCsvColumns) line += (line.empty() ? "" : ",") + std::string(col);
    csv << line << "\n";
    for (const auto& row : rows) {
      line.clear();
      bool first = true;
      for (const char* col : kCsvColumns) {
        line += (first ? "" : ",") + (row.contains(col) ? csv_field(row[col]) : std::string());
        first = false;
      }
      csv << line << "\n";
    }
    csv.close();
    DIFFCP_CHECK(!csv.fail(), "--csv '", opt.csv, "': writing failed");
  }
  if (o.json) {
    std::cout << rows.dump() << std::endl;
    return all_pass ? 0 : 2;
  }
  std::printf("diffcp bench cp: P=%d, %lld samples x %s context, %lld queries/sample (B=%lld): S=%lld, Q=%lld (Q:S = 1:%.1f); "
              "H=%lld n_q=%lld n_kv=%lld d_h=%lld, f32\n",
              P, static_cast<long long>(o.samples), o.context.c_str(), static_cast<long long>(wl.queries),
              static_cast<long long>(o.block), static_cast<long long>(batch.context_rows()),
              static_cast<long long>(batch.query_rows()),
              static_cast<double>(batch.context_rows()) / static_cast<double>(batch.query_rows()),
              static_cast<long long>(cfg.hidden), static_cast<long long>(cfg.n_q), static_cast<long long>(cfg.n_kv),
              static_cast<long long>(cfg.d_h));
  std::printf("  times: median of %d after %d warm-up, slowest rank; bytes: sent per rank by one layer (fwd + bwd), "
              "mean over ranks; peak: max over ranks of the process's peak RSS / of what the run added to it\n",
              o.reps, o.warmup);
  std::printf("  %-8s %-9s %10s %10s %10s %11s %13s %13s %9s %9s  %s\n", "method", "layout", "fwd ms", "bwd ms", "step ms",
              "exposed ms", "MB/layer/rank", "predicted MB", "peak MiB", "run MiB", "check");
  for (const auto& row : rows) {
    const std::string m = row["method"];
    if (!row["supported"].get<bool>()) {
      std::printf("  %-8s not supported: %s\n", m.c_str(), row["reason"].get<std::string>().c_str());
      continue;
    }
    const std::string check = row["check_passed"].is_null() ? "-" : row["check_passed"].get<bool>() ? "PASSED" : "FAILED";
    std::printf("  %-8s %-9s %10.2f %10.2f %10.2f %11.2f %13.3f %13.3f %9.1f %9.1f  %s\n", m.c_str(),
                row["layout"].get<std::string>().c_str(), row["fwd_ms"].get<double>(), row["bwd_ms"].get<double>(),
                row["step_ms"].get<double>(), row["exposed_comm_ms"].get<double>(),
                row["bytes_per_layer"].get<double>() / 1e6, row["predicted_bytes_per_layer"].get<double>() / 1e6,
                row["peak_bytes"].get<double>() / (1 << 20), row["run_peak_bytes"].get<double>() / (1 << 20), check.c_str());
  }
  if (!opt.csv.empty()) std::printf("  wrote %s\n", opt.csv.c_str());
  return all_pass ? 0 : 2;
}

}  // namespace diffcp::cli
