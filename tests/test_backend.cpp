// The compute seam (ops/backend.hpp): the CPU backend's supports() table, the registry, and a toy
// second backend that runs GEMM (delegating to the CPU one) and declines attention, so that
// linear_forward works on it and attention_forward fails naming the backend and the op.
#include <cmath>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/mask.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/core/random.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/ops/gemm.hpp"
#include "diffcp/ops/linear.hpp"

namespace diffcp {
namespace {

// Supports gemm on f32 only and counts the GEMMs it ran; every other hook keeps the default.
class ToyBackend final : public Backend {
 public:
  const char* name() const override { return "toy"; }
  bool supports(OpKind op, DType dtype) const override { return op == OpKind::gemm && dtype == DType::f32; }
  void gemm(const GemmArgs& args) override {
    ++gemms;
    cpu_backend().gemm(args);
  }
  int gemms = 0;
};

ToyBackend& toy() {
  static ToyBackend b;  // outlives the registry's use of it
  register_backend(b);
  return b;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

const OpKind kAllOps[] = {OpKind::gemm,         OpKind::bias_backward,   OpKind::attention_forward,
                          OpKind::attention_backward, OpKind::attention_delta, OpKind::lse_merge,
                          OpKind::lse_rescale,  OpKind::rmsnorm_forward, OpKind::rmsnorm_backward,
                          OpKind::rope,         OpKind::silu,            OpKind::gelu_tanh,
                          OpKind::layernorm_modulate, OpKind::gated_add, OpKind::qk_norm_rope};

TEST(Backend, CpuSupportsF32NotBf16ForEveryOp) {
  static_assert(std::size(kAllOps) == kOpKindCount);
  Backend& cpu = find_backend("cpu");
  EXPECT_EQ(&cpu, &cpu_backend());
  EXPECT_EQ(&active_backend(), &cpu);
  for (OpKind op : kAllOps) {
    EXPECT_TRUE(cpu.supports(op, DType::f32)) << op_name(op);
    EXPECT_FALSE(cpu.supports(op, DType::bf16)) << op_name(op);
    EXPECT_STRNE(op_name(op), "?");
  }
}

TEST(Backend, CpuDeclinesBf16GemmWithTheClearError) {
  std::vector<std::uint16_t> a(4), b(4), c(4);
  const std::string msg = error_of([&] { gemm(false, false, 2, 2, 2, 1.f, a.data(), 2, b.data(), 2, 0.f, c.data(), 2, DType::bf16); });
  EXPECT_NE(msg.find("backend 'cpu' does not support gemm on bf16"), std::string::npos) << msg;
}

TEST(Backend, FindUnknownListsTheRegisteredNames) {
  toy();
  const std::string msg = error_of([] { find_backend("nope"); });
  EXPECT_NE(msg.find("unknown backend 'nope'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cpu"), std::string::npos) << msg;
  EXPECT_NE(msg.find("toy"), std::string::npos) << msg;
  EXPECT_EQ(&find_backend("toy"), &toy());
}

TEST(Backend, RegisteringASecondBackendUnderATakenNameFails) {
  toy();
  ToyBackend other;
  const std::string msg = error_of([&] { register_backend(other); });
  EXPECT_NE(msg.find("a backend named 'toy' is already registered"), std::string::npos) << msg;
  EXPECT_EQ(&find_backend("toy"), &toy());  // the first one stays
  EXPECT_NO_THROW(register_backend(toy()));  // the same object again: nothing
}

TEST(Backend, ToyRunsGemmAndDeclinesAttention) {
  const std::int64_t M = 5, K = 7, N = 3;
  const std::vector<float> x = random_normal(static_cast<std::size_t>(M * K), 1);
  const std::vector<float> W = random_normal(static_cast<std::size_t>(K * N), 2);
  std::vector<float> y_cpu(static_cast<std::size_t>(M * N)), y_toy(y_cpu.size());
  linear_forward(x.data(), M, K, W.data(), N, y_cpu.data());

  // A 2-row block seeing 2 context rows and its own 2 rows: Q = 2, L_k = 4.
  const BlockMask mask(2, 4, {{0, 0, 2}}, {{0, 2, 2}});
  const std::int64_t n_q = 2, n_kv = 1, d_h = 4;
  const std::vector<float> q = random_normal(static_cast<std::size_t>(2 * n_q * d_h), 3);
  const std::vector<float> kv = random_normal(static_cast<std::size_t>(4 * n_kv * d_h), 4);
  std::vector<float> o(q.size()), lse(static_cast<std::size_t>(2 * n_q));
  auto run_attention = [&] {
    attention_forward(mask, head_rows(q, 2, n_q, d_h), head_rows(kv, 4, n_kv, d_h), head_rows(kv, 4, n_kv, d_h),
                      head_rows(o, 2, n_q, d_h), lse);
  };
  {
    ScopedBackend scoped(toy());
    EXPECT_EQ(&active_backend(), &toy());
    const int before = toy().gemms;
    linear_forward(x.data(), M, K, W.data(), N, y_toy.data());
    EXPECT_EQ(toy().gemms, before + 1);
    EXPECT_EQ(y_toy, y_cpu);  // the same oneDNN call on the same data: bitwise

    const std::string msg = error_of(run_attention);
    EXPECT_NE(msg.find("backend 'toy' does not support attention_forward on f32"), std::string::npos) << msg;
    // supports() declines first; a hook left at its default fails with the same words.
    const std::string hook = error_of([&] {
      toy().attention_delta(ConstTensorView{}, ConstTensorView{}, TensorView{});
    });
    EXPECT_NE(hook.find("backend 'toy' does not support attention_delta on f32"), std::string::npos) << hook;
  }
  // Switching back restores the CPU backend: attention runs again.
  EXPECT_EQ(&active_backend(), &cpu_backend());
  EXPECT_NO_THROW(run_attention());
  for (float l : lse) EXPECT_TRUE(std::isfinite(l));

  Backend& previous = set_backend(toy());
  EXPECT_EQ(&previous, &cpu_backend());
  EXPECT_EQ(&set_backend(previous), &toy());
  EXPECT_EQ(&active_backend(), &cpu_backend());
}

}  // namespace
}  // namespace diffcp
