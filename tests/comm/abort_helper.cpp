// Rank 1 throws while every other rank waits in a barrier it can never leave on its own: the job
// must still end, non-zero, with rank 1's message (diffcp::run_mpi_main's abort policy).
#include "diffcp/comm/mpi_runtime.hpp"
#include "diffcp/core/error.hpp"

int main(int argc, char** argv) {
  return diffcp::run_mpi_main(argc, argv, [](diffcp::Communicator& world) {
    if (world.rank() == 1) DIFFCP_FAIL("deliberate failure on rank ", world.rank());
    world.barrier();
    return 0;
  });
}
