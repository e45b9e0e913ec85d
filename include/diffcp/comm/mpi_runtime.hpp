// Process-level MPI set-up and the job-wide error policy.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "diffcp/comm/communicator.hpp"

namespace diffcp {

// Initialises MPI (works under mpirun and as a singleton), builds the world communicator, runs
// body(world) and finalises. An exception escaping body on ANY rank prints
//   "diffcp: error on rank R of P: <message>"
// to stderr and calls MPI_Abort, so mpirun tears down every rank and exits non-zero instead of
// leaving the healthy ranks blocked in their next collective. Returns body's exit code.
int run_mpi_main(int argc, char** argv, const std::function<int(Communicator& world)>& body);

// The world over the communicator `kind` names (inside run_mpi_main's body, every rank alike):
// "mpi" (nullptr: use run_mpi_main's world), "rendezvous" (NCCL's semantics on MPI:
// comm/rendezvous_communicator.hpp) or "nccl" (a CUDA build). Anything else throws naming the choices.
std::unique_ptr<Communicator> make_world(const std::string& kind);
// The kinds make_world takes in this build, e.g. {"mpi", "rendezvous"}.
std::vector<std::string> comm_kinds();

}  // namespace diffcp
