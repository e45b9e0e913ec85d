// Process-level MPI set-up and the job-wide error policy.
#pragma once

#include <functional>

#include "diffcp/comm/communicator.hpp"

namespace diffcp {

// Initialises MPI (works under mpirun and as a singleton), builds the world communicator, runs
// body(world) and finalises. An exception escaping body on ANY rank prints
//   "diffcp: error on rank R of P: <message>"
// to stderr and calls MPI_Abort, so mpirun tears down every rank and exits non-zero instead of
// leaving the healthy ranks blocked in their next collective. Returns body's exit code.
int run_mpi_main(int argc, char** argv, const std::function<int(Communicator& world)>& body);

}  // namespace diffcp
