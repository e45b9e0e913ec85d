// Linked into the kernel tests: under DIFFCP_CPU_ISA=<isa> (the ctest entries cpu_isa_<isa>_*),
// every test of the binary runs on that ISA's CPU kernels, or all are skipped, with the reason,
// where the build lacks them or this CPU cannot run them (an AVX-512 path on an AVX2 machine).
#include <cstdio>
#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "diffcp/core/dtype.hpp"
#include "diffcp/ops/backend.hpp"

namespace {

class CpuIsaEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    const char* want = std::getenv("DIFFCP_CPU_ISA");
    if (want == nullptr || *want == '\0') return;
    for (const diffcp::CpuIsa& isa : diffcp::cpu_isas()) {
      if (isa.name != want) continue;
      if (!isa.supported) GTEST_SKIP() << "this CPU cannot run the " << want << " kernels: skipped";
      // The override took effect: the active backend runs this ISA's kernels.
      const std::string kernels = diffcp::active_backend().describe(diffcp::DType::f32);
      ASSERT_NE(kernels.find(std::string("(") + want + " kernels"), std::string::npos) << kernels;
      std::printf("CPU kernels under test: %s\n", kernels.c_str());
      return;
    }
    GTEST_SKIP() << "this build has no " << want << " kernels: skipped";
  }
};

[[maybe_unused]] ::testing::Environment* const g_env = ::testing::AddGlobalTestEnvironment(new CpuIsaEnvironment);

}  // namespace

// mpi_test_main.cpp calls it so that the linker takes this file from the static test-main library.
void diffcp_link_cpu_isa_environment() {}
