// The op harness (testing/op_harness.hpp) over every registered backend: each op of each backend
// within its stated error bound of the CPU backend, at every shape; and the harness itself can
// fail: a backend that gets one op wrong (by more than the bound) fails with that op's case, shape
// and array named, its other cases pass or are skipped, and a difference below the bound passes.
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "diffcp/ops/backend.hpp"
#include "diffcp/testing/guard_backend.hpp"
#include "diffcp/testing/op_harness.hpp"
#ifdef DIFFCP_HAVE_CUDA
#include "diffcp/cuda/backend.hpp"
#endif

namespace diffcp {
namespace {

// The CUDA backend (a -DDIFFCP_CUDA=ON build) through the harness, where this machine has a GPU;
// skipped, saying why, elsewhere.
TEST(OpHarness, CudaBackendWithinItsBoundsOfTheCpu) {
#ifndef DIFFCP_HAVE_CUDA
  GTEST_SKIP() << "not built with the CUDA backend (-DDIFFCP_CUDA=ON)";
#else
  std::string why;
  if (!cuda_device_present(&why)) {
    GTEST_SKIP() << "no CUDA device here: " << why;
  }
  int ran = 0;
  for (const OpResult& r : run_op_harness(cuda_backend())) {
    SCOPED_TRACE("cuda: " + r.name + " [" + r.shape + "]");
    EXPECT_TRUE(r.failure.empty()) << r.failure;
    ran += !r.skipped;
  }
  EXPECT_GT(ran, 0);
#endif
}

TEST(OpHarness, EveryRegisteredBackendIsWithinItsBoundsOfTheCpu) {
  (void)guard_backend();  // registers the test library's backend
  int backends = 0;
  for (Backend* b : registered_backends()) {
    if (b == &cpu_backend()) continue;
    ++backends;
    std::set<std::string> ran;
    for (const OpResult& r : run_op_harness(*b)) {
      SCOPED_TRACE(std::string(b->name()) + ": " + r.name + " [" + r.shape + "]");
      EXPECT_TRUE(r.failure.empty()) << r.failure;
      if (!r.skipped) ran.insert(r.name);
    }
    std::set<std::string> names;
    for (const OpCase& c : op_cases()) names.insert(c.name);
    if (b == &guard_backend()) {
      EXPECT_EQ(ran, names) << "the guard supports every op the CPU does";
    }
  }
  EXPECT_GE(backends, 1);
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

// A host-memory backend that runs the CPU's kernels for the element-wise silu / GELU and the f32
// GEMM, and supports nothing else; `error` perturbs its GELU output and its GEMM's alpha.
class Miscomputing final : public Backend {
 public:
  explicit Miscomputing(float error) : error_(error) {}
  const char* name() const override { return "miscomputing"; }
  bool supports(OpKind op, DType dtype) const override {
    return dtype == DType::f32 && (op == OpKind::silu || op == OpKind::gelu_tanh || op == OpKind::gemm);
  }
  void silu(TensorView x) override { cpu_backend().silu(x); }
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
