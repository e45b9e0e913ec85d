// Shared helpers of the multi-rank tests (linked with mpi_test_main.cpp).
#pragma once

#include "diffcp/comm/communicator.hpp"

namespace diffcp::test {

// MPI_COMM_WORLD wrapped as a diffcp communicator; valid inside tests.
Communicator& world();

}  // namespace diffcp::test
