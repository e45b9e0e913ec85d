// `diffcp sim calibrate --out FILE`: measures this machine into a profile for `diffcp sim`
// (sim/calibrate.hpp does the measuring; this file parses, warns, writes and prints).
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/sim.hpp"
#include "diffcp/sim/calibrate.hpp"

namespace diffcp::cli {

namespace {
struct CalibrateCli {
  std::string out;
  CalibrateOptions opt;
};
CalibrateCli g_cal;
}  // namespace

void add_sim_calibrate(CLI::App* sim) {
  CalibrateCli& o = g_cal;
  CLI::App* c = sim->add_subcommand("calibrate", "Measure this machine (compute on every rank at once; links between rank "
                                                 "0 and a rank on its node and on another) into a profile; run under mpirun");
  c->add_option("--out", o.out, "profile file to write")->required();
  c->add_option("--name", o.opt.name, "profile name (default: calibrated-<host>)");
  c->add_option("--reps", o.opt.reps, "timed repetitions per measurement (median)")->capture_default_str();
  c->add_option("--n-q", o.opt.n_q, "attention shape the kernel rates are measured at: query heads")->capture_default_str();
  c->add_option("--n-kv", o.opt.n_kv, "... key/value heads")->capture_default_str();
  c->add_option("--d-h", o.opt.d_h, "... head dimension (the rate depends on it: calibrate at the shape you predict)")->capture_default_str();
}

int run_sim_calibrate(Communicator& world) {
  const CalibrateCli& o = g_cal;
  o.opt.validate();  // on every rank, before any communication
  const Calibration cal = calibrate_machine(world, o.opt);
  if (world.rank() != 0) return 0;
  for (const std::string& w : cal.warnings) std::fprintf(stderr, "diffcp sim calibrate: warning: %s\n", w.c_str());
  const nlohmann::json j = cal.profile.to_json();
  Profile::from_json(j, o.out);  // what sim reads back
  const std::string tmp = o.out + ".tmp";
  {
    std::ofstream f(tmp);
    f << j.dump(1) << "\n";
    DIFFCP_CHECK(f.good(), "sim calibrate: cannot write '", tmp, "'");
  }
  DIFFCP_CHECK(std::rename(tmp.c_str(), o.out.c_str()) == 0, "sim calibrate: cannot write '", o.out, "'");
  std::printf("%s\n", j.dump(1).c_str());
  return 0;
}

}  // namespace diffcp::cli
