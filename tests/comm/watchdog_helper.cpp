// The collective watchdog ends a job whose operation cannot complete (tests/CMakeLists.txt checks
// the message). argv[1] = timeout in seconds, argv[2] = what goes wrong:
//   stall    rank 1 stops itself (SIGSTOP) before an all_reduce the others wait in
//   sleep    rank 1 sleeps (busy elsewhere) past the timeout before that all_reduce
//   recv     rank 0 receives from rank 1, which never sends
//   none     nothing: 50 all_reduces complete under the watchdog (its normal path)
//   env      the timeout is left to DIFFCP_COMM_TIMEOUT (SECONDS is ignored)
//   hier     nodes of 2 ranks (set_topology(rank / 2)); rank 1 stops itself (SIGSTOP) before a
//            hierarchical all_reduce (its later stages are issued inside wait())
// The all_reduce is the third collective on "world" (two barriers first), so the message names #3.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "diffcp/comm/mpi_runtime.hpp"
#include "diffcp/core/error.hpp"

int main(int argc, char** argv) {
  DIFFCP_CHECK(argc == 3, "usage: watchdog_helper SECONDS stall|sleep|recv|none|env|hier");
  const double timeout = std::atof(argv[1]);
  const std::string mode = argv[2];
  if (mode != "env") diffcp::Communicator::set_watchdog_timeout(timeout);
  return diffcp::run_mpi_main(argc, argv, [&](diffcp::Communicator& world) {
    world.barrier();
    world.barrier();
    std::vector<float> x(1000, 1.0f);
    if (mode == "none" || mode == "env") {
      for (int i = 0; i < 50; ++i) {
        std::fill(x.begin(), x.end(), 1.0f);
        world.all_reduce<float>(x);
        DIFFCP_CHECK(x[0] == static_cast<float>(world.size()), "all_reduce under the watchdog gave ", x[0]);
      }
      return 0;
    }
    if (mode == "hier") {
      world.set_topology(world.rank() / 2);  // collective set-up: not a counted operation
      if (world.rank() == 1) raise(SIGSTOP);
      world.all_reduce<float>(x, diffcp::ReduceOp::sum, diffcp::CollAlgo::hierarchical);
      return 0;
    }
    if (mode == "recv") {
      if (world.rank() == 0) world.recv<float>(x, 1, 7);
      else if (world.rank() == 1) sleep(static_cast<unsigned>(timeout * 3 + 30));
      return 0;
    }
    if (world.rank() == 1) {
      if (mode == "stall") raise(SIGSTOP);
      else if (mode == "sleep") sleep(static_cast<unsigned>(timeout * 3 + 30));
      else DIFFCP_FAIL("unknown mode '", mode, "'");
    }
    world.all_reduce<float>(x);
    return 0;
  });
}
