// `diffcp sim`: registration of its subcommands, and the machine options they share.
#include "cli/sim.hpp"

#include <cstdio>

#include "diffcp/core/error.hpp"

namespace diffcp::cli {

void add_sim_machine_options(CLI::App* c, SimMachineOptions& o) {
  c->add_option("--profile", o.profile, "cluster profile: h100-ib | aurora | a file (diffcp sim calibrate writes one)")->capture_default_str();
  c->add_option("--P", o.P, "ranks")->capture_default_str();
  c->add_option("--ranks-per-node", o.ranks_per_node, "ranks per node, placed in rank order (default: the profile's)");
  c->add_option("--rank-share", o.rank_share, "fraction of the profile's compute rate a rank gets (0.5: two ranks per "
                                              "core, as the oversubscribed runs here)")->capture_default_str();
  c->add_option("--cores", o.cores, "cores the P ranks run on, when fewer than P (oversubscribed: a rank that "
                                    "finishes a step early yields its core); 0 = one per rank")->capture_default_str();
  c->add_flag("--json", o.json, "print JSON");
}

SimMachine make_sim_machine(const SimMachineOptions& o) {
  SimMachine m;
  m.profile = load_profile(o.profile);
  m.P = o.P;
  m.R = o.ranks_per_node > 0 ? o.ranks_per_node : m.profile.ranks_per_node;
  DIFFCP_CHECK(o.ranks_per_node >= 0, "--ranks-per-node = ", o.ranks_per_node, ", expected >= 1");
  m.share = o.rank_share;
  m.cores = o.cores;
  m.validate();
  DIFFCP_CHECK(m.P % m.R == 0 || m.P < m.R, "--P = ", m.P, " ranks do not fill nodes of ", m.R,
               " ranks (--ranks-per-node; the profile's nodes have ", m.profile.ranks_per_node, ")");
  return m;
}

void warn_profile_fit(const SimMachine& m, std::int64_t n_q, std::int64_t n_kv, std::int64_t d_h) {
  for (const std::string& w : m.fit_warnings(n_q, n_kv, d_h)) std::fprintf(stderr, "diffcp sim: warning: %s\n", w.c_str());
}

void add_sim_command(CLI::App& app) {
  CLI::App* sim = app.add_subcommand("sim", "Predict step times from a cost model (no MPI) or "
                                            "calibrate one on this machine (under mpirun)");
  sim->require_subcommand(1);
  add_sim_cp(sim);
  add_sim_dit(sim);
  add_sim_train(sim);
  add_sim_calibrate(sim);
}

bool sim_needs_mpi(const CLI::App& app) {
  const CLI::App* sim = app.get_subcommand("sim");
  return sim->got_subcommand("calibrate");
}

int run_sim(const CLI::App& app) {
  const CLI::App* sim = app.get_subcommand("sim");
  if (sim->got_subcommand("cp")) return run_sim_cp();
  if (sim->got_subcommand("dit")) return run_sim_dit();
  if (sim->got_subcommand("train")) return run_sim_train();
  DIFFCP_FAIL("diffcp sim: no subcommand");
}

}  // namespace diffcp::cli
