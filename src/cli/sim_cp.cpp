// `diffcp sim cp`: the CP methods of the drafter attention layer predicted on a profile's machine
// (sim/cp.hpp), on the workload `diffcp bench cp` would run (same options and generator).
#include <cstdio>

#include <nlohmann/json.hpp>

#include "cli/layer_run.hpp"
#include "cli/sim.hpp"
#include "diffcp/cp/cp_methods.hpp"
#include "diffcp/sim/cp.hpp"

namespace diffcp::cli {

namespace {
struct SimCpCli {
  SimMachineOptions machine;
  AttnOptions layer;
  std::string methods = "all", balancer = "lpt", oproj = "auto", collectives = "auto";
};
SimCpCli g_cp;

std::vector<std::string> method_list(const std::string& text) {
  std::vector<std::string> out = parse_method_list(text);
  for (const std::string& name : out) cp_method(name);  // names an unknown one
  return out;
}
}  // namespace

void add_sim_cp(CLI::App* sim) {
  SimCpCli& o = g_cp;
  CLI::App* c = sim->add_subcommand("cp", "Predict the CP methods of the drafter attention layer (bench cp's workload) "
                                          "on P ranks of a profile");
  add_sim_machine_options(c, o.machine);
  add_workload_options(c, o.layer);
  c->add_option("--methods", o.methods, "comma list of splitkv, ulysses, ring, ringx, lvxattn, or all")->capture_default_str();
  c->add_option("--balancer", o.balancer, "Split-KV's context layout: none | zigzag | lpt | partition")->capture_default_str();
  c->add_option("--oproj", o.oproj, "Split-KV output projection: all | owned | auto (the cost model on the profile's rates)")->capture_default_str();
  c->add_option("--collectives", o.collectives, "Split-KV collectives: flat | hierarchical | auto (hierarchical across nodes)")->capture_default_str();
}

int run_sim_cp() {
  const SimCpCli& o = g_cp;
  const SimMachine m = make_sim_machine(o.machine);
  const LayerWorkload w = make_workload(o.layer);
  DIFFCP_CHECK(w.dtype == DType::f32, "sim cp: --dtype bf16 is not modelled yet (the calibrated rates are f32's)");
  DIFFCP_CHECK(o.oproj == "auto" || o.oproj == "all" || o.oproj == "owned", "--oproj '", o.oproj,
               "': expected all, owned or auto");
  DIFFCP_CHECK(o.collectives == "auto" || o.collectives == "flat" || o.collectives == "hierarchical", "--collectives '",
               o.collectives, "': expected flat, hierarchical or auto");
  SimCpOptions opt{method_list(o.methods), o.balancer, o.layer.J, o.oproj, o.collectives, 4};
  warn_profile_fit(m, w.cfg.n_q, w.cfg.n_kv, w.cfg.d_h);
  const std::vector<SimCpResult> rows = simulate_cp(m, w.batch, w.cfg, opt);
  // As bench cp: with --methods all an unsupported method is a row with its reason; named
  // explicitly, it is an error.
  if (o.methods != "all")
    for (const SimCpResult& r : rows) DIFFCP_CHECK(r.supported(), "sim cp: ", r.reason);
  nlohmann::ordered_json arr = nlohmann::ordered_json::array();
  for (const SimCpResult& r : rows) {
    nlohmann::ordered_json j{{"method", r.method}, {"P", r.P}, {"profile", m.profile.name},
                             {"ranks_per_node", m.R}, {"supported", r.supported()}, {"reason", r.reason}};
    if (r.supported()) {
      j.update(nlohmann::ordered_json{{"layout", r.layout}, {"fwd_ms", r.fwd_ms}, {"bwd_ms", r.bwd_ms},
                                      {"step_ms", r.step_ms}, {"compute_ms", r.compute_ms}, {"comm_ms", r.comm_ms},
                                      {"exposed_comm_ms", r.exposed_comm_ms}, {"bytes_per_layer", r.bytes_per_layer},
                                      {"inter_node_bytes_per_layer", r.inter_node_bytes_per_layer},
                                      {"imbalance_pct", r.imbalance_pct}, {"peak_bytes", r.peak_bytes},
                                      {"plan_ms", r.plan_ms}});
      if (!r.oproj.empty()) {
        j["oproj"] = r.oproj;
        j["collectives"] = r.collectives;
      }
    }
    arr.push_back(j);
  }
  if (o.machine.json) {
    std::printf("%s\n", arr.dump().c_str());
    return 0;
  }
  std::printf("diffcp sim cp: profile %s, P = %d (%d per node, %d nodes), S = %lld, Q = %lld, H %lld, %lld/%lld heads x %lld\n",
              m.profile.name.c_str(), m.P, m.R, m.nodes(), static_cast<long long>(w.batch.context_rows()),
              static_cast<long long>(w.batch.query_rows()), static_cast<long long>(w.cfg.hidden),
              static_cast<long long>(w.cfg.n_q), static_cast<long long>(w.cfg.n_kv), static_cast<long long>(w.cfg.d_h));
  std::printf("  %-9s %9s %9s %9s %9s %9s %12s %12s %8s\n", "method", "fwd_ms", "bwd_ms", "step_ms", "exposed", "comm",
              "bytes/layer", "inter/layer", "imbal%");
  for (const SimCpResult& r : rows) {
    if (!r.supported()) {
      std::printf("  %-9s unsupported: %s\n", r.method.c_str(), r.reason.c_str());
      continue;
    }
    std::printf("  %-9s %9.3f %9.3f %9.3f %9.3f %9.3f %12.4g %12.4g %8.2f\n", r.method.c_str(), r.fwd_ms, r.bwd_ms,
                r.step_ms, r.exposed_comm_ms, r.comm_ms, r.bytes_per_layer, r.inter_node_bytes_per_layer, r.imbalance_pct);
  }
  return 0;
}

}  // namespace diffcp::cli
