// Process-level MPI set-up and the job-wide error policy.
#pragma once

#include <mpi.h>

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

// This process's place among the ranks of its machine (MPI_COMM_TYPE_SHARED: the ranks that share
// its memory, and so its GPUs). rank -1 until find_node_local ran. A device backend picks its
// device by it (the CUDA backend: device rank % devices), so P ranks on a node of P GPUs get one
// each without CUDA_VISIBLE_DEVICES set by hand.
struct NodeLocal {
  int rank = -1;
  int size = 0;
};
NodeLocal node_local();
// Collective over `comm` (every rank of it, the first time any of them calls it; later calls do
// nothing): finds node_local(). run_mpi_main and make_communicator call it before anything can
// create a device backend; a program that initialises MPI itself calls it after MPI_Init.
void find_node_local(MPI_Comm comm);

}  // namespace diffcp
