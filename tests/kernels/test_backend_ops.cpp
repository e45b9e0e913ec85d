// The op harness (testing/op_harness.hpp) over every registered backend: each op of each backend
// within its stated error bound of the CPU backend, at every shape; and the harness itself can
// fail: a backend that gets one op wrong (by more than the bound) fails with that op's case, shape
// and array named, its other cases pass or are skipped, and a difference below the bound passes.
#include <cctype>
#include <cstdio>
#include <cstring>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/ops/backend.hpp"
#include "diffcp/testing/guard_backend.hpp"
#include "diffcp/testing/op_harness.hpp"
#ifdef DIFFCP_HAVE_CUDA
#include "diffcp/cuda/backend.hpp"
#endif

namespace diffcp {
// gtest prints a target by its name.
void PrintTo(const OpHarnessTarget& t, std::ostream* os) { *os << t.name; }

namespace {

// `-o OP` / `-b BACKEND` (ggml's test-backend-ops filters): only the cases whose name or ops
// contain OP, only the target named BACKEND ("cpu" alone: every CPU ISA). Set in main().
std::string g_op, g_backend;

bool selected(const std::string& target) {
  return g_backend.empty() || target == g_backend || (g_backend == "cpu" && target.starts_with("cpu:"));
}

std::vector<OpHarnessTarget> selected_targets() {
  std::vector<OpHarnessTarget> out;
  for (const OpHarnessTarget& t : op_harness_targets())
    if (selected(t.name)) out.push_back(t);
  return out;
}

// Each target (every registered backend but the CPU's, every CPU ISA this machine runs) within
// each case's bound of its reference. One ctest per target.
class OpHarnessTargets : public ::testing::TestWithParam<OpHarnessTarget> {};

TEST_P(OpHarnessTargets, EveryCaseWithinItsBoundOfTheReference) {
  const OpHarnessTarget& t = GetParam();
  std::set<std::string> ran, names;
  for (const OpResult& r : run_op_harness(*t.backend, {.op = g_op, .reference = t.reference})) {
    SCOPED_TRACE(t.name + ": " + r.name + " [" + r.shape + "]");
    EXPECT_TRUE(r.failure.empty()) << r.failure;
    if (!r.skipped) ran.insert(r.name);
  }
  for (const OpCase& c : op_cases()) names.insert(c.name);
  if (!g_op.empty()) {
    EXPECT_FALSE(ran.empty()) << "-o " << g_op << ": no case of " << t.name << " matches";
  } else if (t.name.starts_with("guard") || t.name.starts_with("cpu:")) {
    EXPECT_EQ(ran, names) << t.name << " supports every op the CPU does";
  } else {
    EXPECT_FALSE(ran.empty());
  }
}

INSTANTIATE_TEST_SUITE_P(OpHarness, OpHarnessTargets, ::testing::ValuesIn(selected_targets()),
                         [](const ::testing::TestParamInfo<OpHarnessTarget>& i) {
                           std::string n = i.param.name;
                           for (char& ch : n)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(OpHarnessTargets);  // -b naming nothing here

// What must be among the targets: both guard devices always; every CPU ISA this machine runs where the
// build has more than one; the CUDA backend where there is a device (skipped, saying why, elsewhere).
TEST(OpHarness, TheTargetsAreEveryBackendAndEveryCpuIsaHere) {
  std::set<std::string> targets;
  for (const OpHarnessTarget& t : op_harness_targets()) targets.insert(t.name);
  EXPECT_TRUE(targets.count("guard"));
  EXPECT_TRUE(targets.count("guard-async"));
  std::vector<std::string> isas;
  for (const CpuIsa& isa : cpu_isas())
    if (isa.supported) isas.push_back(isa.name);
  if (isas.size() > 1) {
    for (const std::string& isa : isas) EXPECT_TRUE(targets.count("cpu:" + isa)) << isa;
  }
#ifndef DIFFCP_HAVE_CUDA
  GTEST_SKIP() << "not built with the CUDA backend (-DDIFFCP_CUDA=ON)";
#else
  std::string why;
  if (!cuda_device_present(&why)) GTEST_SKIP() << "no CUDA device here: " << why;
  EXPECT_TRUE(targets.count("cuda"));
#endif
}

TEST(OpHarness, EveryOpKindHasACaseAndEdgeShapes) {
  std::set<OpKind> covered;
  std::set<std::string> shapes_of_gemm;
  for (const OpCase& c : op_cases()) {
    for (const auto& [op, dt] : c.ops) covered.insert(op);
    if (c.name.starts_with("gemm f32 (")) shapes_of_gemm.insert(c.shape);
  }
  EXPECT_EQ(static_cast<int>(covered.size()), kOpKindCount);
  EXPECT_EQ(shapes_of_gemm.size(), 3u);
  EXPECT_TRUE(shapes_of_gemm.count("M 1 N 3 K 1"));
}

// A host-memory backend that runs the CPU's kernels for the element-wise silu / GELUs and the f32
// GEMM, and supports nothing else; `error` perturbs its tanh GELU's output and its GEMM's alpha.
class Miscomputing final : public Backend {
 public:
  explicit Miscomputing(float error) : error_(error) {}
  const char* name() const override { return "miscomputing"; }
  bool supports(OpKind op, DType dtype) const override {
    return dtype == DType::f32 && (op == OpKind::silu || op == OpKind::gelu_tanh || op == OpKind::gelu || op == OpKind::gemm);
  }
  void silu(TensorView x) override { cpu_backend().silu(x); }
  void gelu(TensorView x) override { cpu_backend().gelu(x); }
  void gelu_tanh(TensorView x) override {
    cpu_backend().gelu_tanh(x);
    x.ptr<float>()[0] *= 1.f + error_;
  }
  void gemm(const GemmArgs& args) override {
    GemmArgs a = args;
    a.alpha *= 1.f + error_;
    cpu_backend().gemm(a);
  }

 private:
  float error_;
};

TEST(OpHarness, AWrongOpFailsNamingItsCaseShapeAndArray) {
  Miscomputing wrong(1e-3f);
  int failed = 0, passed = 0, skipped = 0;
  for (const OpResult& r : run_op_harness(wrong)) {
    if (r.skipped) {
      ++skipped;
      EXPECT_FALSE(r.skip_reason.empty());
      continue;
    }
    SCOPED_TRACE(r.name + " [" + r.shape + "]");
    if (r.name == "silu / gelu" || r.name.starts_with("gemm f32 (")) {
      ++failed;
      EXPECT_NE(r.failure.find("normalised error"), std::string::npos) << r.failure;
      EXPECT_NE(r.failure.find(r.name == "silu / gelu" ? "array 1 (f32[" : "array 2 (f32["), std::string::npos) << r.failure;
    } else {
      ++passed;
      EXPECT_TRUE(r.failure.empty()) << r.failure;
    }
  }
  EXPECT_EQ(failed, 6);  // 3 shapes each
  EXPECT_EQ(passed, 0);
  EXPECT_GT(skipped, 20);
  // Below the bound (f32 rounding-sized): it passes.
  Miscomputing close(1e-7f);
  for (const OpResult& r : run_op_harness(close)) EXPECT_TRUE(r.failure.empty()) << r.name << " [" << r.shape << "]: " << r.failure;
}

}  // namespace
}  // namespace diffcp

// test_backend_ops [-o OP] [-b BACKEND] [gtest flags]
int main(int argc, char** argv) {
  std::vector<char*> rest{argv[0]};
  for (int i = 1; i < argc; ++i) {
    const bool o = std::strcmp(argv[i], "-o") == 0, b = std::strcmp(argv[i], "-b") == 0;
    if ((o || b) && i + 1 == argc) {
      std::fprintf(stderr, "test_backend_ops: %s needs a value (-o OP: a case or op name part; -b BACKEND: a target)\n", argv[i]);
      return 2;
    }
    if (o) diffcp::g_op = argv[++i];
    else if (b) diffcp::g_backend = argv[++i];
    else rest.push_back(argv[i]);
  }
  (void)diffcp::guard_backend();  // registers the test library's backends
  (void)diffcp::guard_async_backend();
#ifdef DIFFCP_HAVE_CUDA
  if (diffcp::cuda_device_present(nullptr)) (void)diffcp::cuda_backend();  // registers it
#endif
  if (!diffcp::g_backend.empty() && diffcp::selected_targets().empty()) {
    std::string names;
    for (const diffcp::OpHarnessTarget& t : diffcp::op_harness_targets()) names += " " + t.name;
    std::fprintf(stderr, "test_backend_ops: -b %s: no such target here; targets:%s\n", diffcp::g_backend.c_str(), names.c_str());
    return 2;
  }
  int n = static_cast<int>(rest.size());
  ::testing::InitGoogleTest(&n, rest.data());
  return RUN_ALL_TESTS();
}
