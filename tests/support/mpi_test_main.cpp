// gtest main for multi-rank tests (run under mpirun by ctest). Every rank runs every test; rank 0
// prints the usual report, other ranks print only their failures, tagged with the rank. The
// process exit code is non-zero on any rank with a failure, so mpirun (and ctest) fail.
//
// Test authors: issue the same collectives on every rank in the same order (MPI's rule) and
// prefer EXPECT_* over ASSERT_* before a collective, so a failing rank does not skip a collective
// the others wait in. ctest's TIMEOUT is the last guard against such a hang.
#include <mpi.h>

#include <cstdio>

#include <gtest/gtest.h>

#include "diffcp/comm/mpi_communicator.hpp"
#include "diffcp/comm/mpi_runtime.hpp"
#include "diffcp/core/env.hpp"
#include "mpi_test.hpp"

namespace diffcp::test {

namespace {
Communicator* g_world = nullptr;

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] FAILURE %s:%d\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
  }

 private:
  int rank_;
};
}  // namespace

Communicator& world() { return *g_world; }

}  // namespace diffcp::test

void diffcp_link_cpu_isa_environment();  // cpu_isa_env.cpp: DIFFCP_CPU_ISA runs the tests on that ISA

int main(int argc, char** argv) {
  diffcp_link_cpu_isa_environment();
  ::testing::InitGoogleTest(&argc, argv);
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  diffcp::find_node_local(MPI_COMM_WORLD);  // as run_mpi_main does: a device backend picks its GPU by it
  int rc = 0;
  {
    // DIFFCP_COMM=rendezvous runs the suite over NCCL's semantics (comm/rendezvous_communicator.hpp).
    diffcp::MpiCommunicator mpi_world(MPI_COMM_WORLD, "world");
    const auto kind = diffcp::env_value(diffcp::EnvKnob::comm);
    const std::unique_ptr<diffcp::Communicator> other = diffcp::make_world(kind.value_or("mpi"));
    diffcp::Communicator& world = other ? *other : mpi_world;
    diffcp::test::g_world = &world;
    if (world.rank() != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new diffcp::test::RankFailurePrinter(world.rank()));
    }
    rc = RUN_ALL_TESTS();
    // Every rank learns whether any rank failed, so the exit status is the same everywhere.
    int any = rc != 0, all_any = 0;
    MPI_Allreduce(&any, &all_any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    rc = all_any;
    diffcp::test::g_world = nullptr;
  }
  MPI_Finalize();
  return rc;
}
