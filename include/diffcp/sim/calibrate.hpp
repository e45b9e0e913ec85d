// `diffcp sim calibrate`'s measurements as a library call (the CLI parses, writes and prints):
// this machine measured into a Profile (sim/profile.hpp) for `diffcp sim`.
//
// Compute on every rank at once (they share the host: the slowest rank's rates), with the threads
// the ranks run with: the layers' GEMM (the fixed cost of a tiny call, the rate of a large one, and
// its rate at a narrow width for gemm_n_half), the attention forward and backward rates (the
// kernels on a DFlash mask at the given head shape), a streaming elementwise rate, and sync_loss
// (ranks that synchronise between compute segments). Links, with 2 or more ranks: ping-pong between
// rank 0 and the first rank on its node (intra) and the first on another node (inter; under
// scripts/emucluster.sh the emulated links), an 8-byte round trip for the latency and 4 MiB for the
// bandwidth; comm_overlap: how much of a transfer hides under compute on this host. What cannot
// be measured on the ranks given (one rank: no link; one node: no inter link) is set from defaults
// or copied from the other level, recorded in Profile::measured and said in `warnings`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/sim/profile.hpp"

namespace diffcp {

struct CalibrateOptions {
  int reps = 5;                               // timed repetitions per measurement (median); 1..1000
  std::int64_t n_q = 8, n_kv = 2, d_h = 128;  // the attention shape the kernel rates are measured at
  std::string name;                           // profile name (empty: calibrated-<host>)
  void validate() const;                      // throws diffcp::Error naming the bad value
};

struct Calibration {
  Profile profile;                    // every field; profile.measured says what was measured
  std::vector<std::string> warnings;  // one line per field group that could not be measured
};

// Collective: every rank of `world` calls it with the same options and gets the same result.
Calibration calibrate_machine(Communicator& world, const CalibrateOptions& opt);

}  // namespace diffcp
