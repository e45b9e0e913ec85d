// `diffcp sim`: what the cost model predicts (sim cp, sim dit, sim train: no MPI, any P) and
// `sim calibrate` (under mpirun: measures this machine into a profile). The machine options every
// prediction takes, and each subcommand's registration and entry point (one file each).
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/sim/machine.hpp"

namespace diffcp::cli {

// --profile NAME|FILE, --P, --ranks-per-node (default: the profile's), --rank-share, --json.
struct SimMachineOptions {
  std::string profile = "h100-ib";
  int P = 8;
  int ranks_per_node = 0;  // 0: the profile's
  double rank_share = 1.0;
  int cores = 0;  // 0: one per rank
  bool json = false;
};
void add_sim_machine_options(CLI::App* c, SimMachineOptions& o);
// The profile loaded and the placement checked (throws naming the bad value).
SimMachine make_sim_machine(const SimMachineOptions& o);
// Prints SimMachine::fit_warnings for the workload's attention shape to stderr, one line each
// ("diffcp sim: warning: ..."), before any prediction is printed.
void warn_profile_fit(const SimMachine& m, std::int64_t n_q, std::int64_t n_kv, std::int64_t d_h);

void add_sim_command(CLI::App& app);
// True when the chosen subcommand measures (calibrate: run under mpirun); the others are pure
// computation and run without MPI.
bool sim_needs_mpi(const CLI::App& app);
int run_sim(const CLI::App& app);
int run_sim_calibrate(Communicator& world);

// Per subcommand (cli/sim_cp.cpp, cli/sim_dit.cpp, cli/sim_train.cpp, cli/sim_calibrate.cpp).
void add_sim_cp(CLI::App* sim);
int run_sim_cp();
void add_sim_dit(CLI::App* sim);
int run_sim_dit();
void add_sim_train(CLI::App* sim);
int run_sim_train();
void add_sim_calibrate(CLI::App* sim);

}  // namespace diffcp::cli
