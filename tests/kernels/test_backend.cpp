// The compute seam (ops/backend.hpp): the CPU backend's supports() table, the registry, and a toy
// second backend that runs GEMM (delegating to the CPU one) and declines attention, so that
// linear_forward works on it and attention_forward fails naming the backend and the op.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <iterator>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include <thread>

#include <gtest/gtest.h>

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/mask.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/core/random.hpp"
#include "diffcp/dit/ops.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/ops/conv.hpp"
#include "diffcp/ops/elementwise.hpp"
#include "diffcp/ops/loss.hpp"
#include "diffcp/ops/optim.hpp"
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
                          OpKind::layernorm_modulate, OpKind::gated_add, OpKind::qk_norm_rope,
                          OpKind::swiglu_forward, OpKind::swiglu_backward, OpKind::add, OpKind::adamw_step, OpKind::bias_add,
                          OpKind::fill, OpKind::convert, OpKind::lse_shift, OpKind::gather_rows,
                          OpKind::scatter_rows, OpKind::l1_distance, OpKind::cross_entropy,
                          OpKind::cross_entropy_backward, OpKind::scale_sumsq, OpKind::guidance_combine,
                          OpKind::fp8_encode, OpKind::fp8_decode, OpKind::dense_linear, OpKind::select_active,
                          OpKind::token_rows, OpKind::dynamic_conv_forward, OpKind::dynamic_conv_backward,
                          OpKind::logit_map, OpKind::top_k, OpKind::gelu};

// dense_linear is the bf16-weight product of inference only (ops/backend.hpp).
TEST(Backend, CpuSupportsF32EverywhereBf16OnGemmAndAttention) {
  static_assert(std::size(kAllOps) == kOpKindCount);
  Backend& cpu = find_backend("cpu");
  EXPECT_EQ(&cpu, &cpu_backend());
  EXPECT_EQ(&active_backend(), &cpu);
  for (OpKind op : kAllOps) {
    const bool bf16 = op == OpKind::gemm || op == OpKind::attention_forward || op == OpKind::attention_backward ||
                      op == OpKind::attention_delta || op == OpKind::fill || op == OpKind::convert ||
                      op == OpKind::gather_rows || op == OpKind::scatter_rows || op == OpKind::l1_distance ||
                      op == OpKind::fp8_encode || op == OpKind::fp8_decode || op == OpKind::dense_linear;
    EXPECT_EQ(cpu.supports(op, DType::f32), op != OpKind::dense_linear) << op_name(op);
    EXPECT_EQ(cpu.supports(op, DType::bf16), bf16) << op_name(op);
    EXPECT_EQ(cpu.supports(op, DType::i32), op == OpKind::token_rows) << op_name(op);
    EXPECT_FALSE(cpu.supports(op, DType::f64)) << op_name(op);
    EXPECT_STRNE(op_name(op), "?");
  }
}

// One build, kernels per ISA (src/cpu/isa.hpp): the default is the widest this CPU runs, each
// supported ISA says it runs, and an unknown one is refused with the list.
TEST(Backend, CpuIsasDefaultToTheWidestThisCpuRuns) {
  const std::vector<CpuIsa> isas = cpu_isas();
  ASSERT_FALSE(isas.empty());
  const char* forced = std::getenv("DIFFCP_CPU_ISA");
  for (const CpuIsa& isa : isas) {
    if (!isa.supported) {
      EXPECT_NE(error_of([&] { cpu_backend(isa.name); }).find("this CPU lacks the instructions"), std::string::npos);
      continue;
    }
    const std::string kernels = cpu_backend(isa.name).describe(DType::f32);
    EXPECT_NE(kernels.find("(" + isa.name + " kernels"), std::string::npos) << kernels;
  }
  if (forced == nullptr || *forced == '\0') {
    const auto widest = std::find_if(isas.begin(), isas.end(), [](const CpuIsa& i) { return i.supported; });
    ASSERT_NE(widest, isas.end());
    EXPECT_EQ(&cpu_backend(), &cpu_backend(widest->name)) << cpu_backend().describe(DType::f32);
  } else {
    EXPECT_EQ(&cpu_backend(), &cpu_backend(forced));
  }
  const std::string msg = error_of([] { cpu_backend("sse9"); });
  EXPECT_NE(msg.find("CPU kernels 'sse9' are not compiled in; compiled in: " + isas.front().name), std::string::npos)
      << msg;
}

TEST(Backend, CpuDeclinesBf16RmsnormWithTheClearError) {
  const std::string msg = error_of([] { backend_for(OpKind::rmsnorm_forward, DType::bf16); });
  EXPECT_NE(msg.find("backend 'cpu' does not support rmsnorm_forward on bf16"), std::string::npos) << msg;
}

// bf16 GEMM (bf16 A, B, C; f32 accumulation) against fp64 on the same bf16 numbers, every
// transpose, beta 0 and 1, strided operands: the error is C's own bf16 rounding plus the f32 sums'.
TEST(Backend, CpuBf16GemmMatchesFp64OnBf16Inputs) {
  const std::int64_t M = 37, N = 50, K = 300, pad = 3;
  for (int variant = 0; variant < 8; ++variant) {
    const bool ta = variant & 1, tb = variant & 2;
    const float beta = (variant & 4) ? 1.f : 0.f;
    const std::int64_t a_rows = ta ? K : M, a_cols = ta ? M : K, b_rows = tb ? N : K, b_cols = tb ? K : N;
    const std::int64_t lda = a_cols + pad, ldb = b_cols + pad, ldc = N + pad;
    auto round = [](std::vector<float> x) {
      std::vector<std::uint16_t> h(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) h[i] = f32_to_bf16(x[i]);
      return h;
    };
    const auto a = round(random_normal(static_cast<std::size_t>(a_rows * lda), 1));
    const auto b = round(random_normal(static_cast<std::size_t>(b_rows * ldb), 2));
    auto c = round(random_normal(static_cast<std::size_t>(M * ldc), 3));
    const auto c0 = c;
    gemm(ta, tb, M, N, K, 0.5f, a.data(), lda, b.data(), ldb, beta, c.data(), ldc, DType::bf16);
    double worst = 0;
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j) {
        double ref = beta * bf16_to_f32(c0[static_cast<std::size_t>(i * ldc + j)]), mag = std::abs(ref);
        for (std::int64_t l = 0; l < K; ++l) {
          const double x = bf16_to_f32(a[static_cast<std::size_t>(ta ? l * lda + i : i * lda + l)]);
          const double y = bf16_to_f32(b[static_cast<std::size_t>(tb ? j * ldb + l : l * ldb + j)]);
          ref += 0.5 * x * y;
          mag += std::abs(0.5 * x * y);
        }
        const double got = bf16_to_f32(c[static_cast<std::size_t>(i * ldc + j)]);
        // half a bf16 ulp of the result (2^-9 relative) + f32 accumulation (K * 2^-24 of the magnitude)
        worst = std::max(worst, std::abs(got - ref) / (std::abs(ref) * 0x1p-8 + mag * K * 0x1p-24 + 1e-30));
      }
    EXPECT_LE(worst, 1.0) << "ta " << ta << " tb " << tb << " beta " << beta;
    for (std::int64_t i = 0; i < M; ++i)  // the padding of C is untouched
      for (std::int64_t j = N; j < ldc; ++j)
        EXPECT_EQ(c[static_cast<std::size_t>(i * ldc + j)], c0[static_cast<std::size_t>(i * ldc + j)]);
  }
}

// Autocast: under ScopedF32GemmCompute(bf16) an f32 GEMM multiplies the bf16-rounded operands with
// f32 accumulation into f32 C (equal to fp64 on the rounded inputs up to f32 sums); outside the scope
// it is f32 again.
TEST(Backend, F32GemmUnderBf16ComputeRoundsTheOperandsOnly) {
  const std::int64_t M = 9, N = 17, K = 130;
  const auto a = random_normal(static_cast<std::size_t>(M * K), 4), b = random_normal(static_cast<std::size_t>(N * K), 5);
  auto run = [&] {
    std::vector<float> c(static_cast<std::size_t>(M * N), 1.f);
    gemm(false, true, M, N, K, 1.f, a.data(), K, b.data(), K, 1.f, c.data(), N);  // B given as [N, K]
    return c;
  };
  auto reference = [&](bool round) {
    std::vector<double> c(static_cast<std::size_t>(M * N), 1.0);
    auto r = [&](float x) { return round ? static_cast<double>(bf16_to_f32(f32_to_bf16(x))) : static_cast<double>(x); };
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j)
        for (std::int64_t l = 0; l < K; ++l)
          c[static_cast<std::size_t>(i * N + j)] += r(a[static_cast<std::size_t>(i * K + l)]) * r(b[static_cast<std::size_t>(j * K + l)]);
    return c;
  };
  std::vector<float> c16;
  {
    ScopedF32GemmCompute bf16(DType::bf16);
    EXPECT_EQ(f32_gemm_compute(), DType::bf16);
    c16 = run();
  }
  EXPECT_EQ(f32_gemm_compute(), DType::f32);
  const std::vector<float> c32 = run();
  const auto r16 = reference(true), r32 = reference(false);
  double e16 = 0, e32 = 0, gap = 0;
  for (std::size_t i = 0; i < c16.size(); ++i) {
    e16 = std::max(e16, std::abs(c16[i] - r16[i]));
    e32 = std::max(e32, std::abs(c32[i] - r32[i]));
    gap = std::max(gap, std::abs(r16[i] - r32[i]));
  }
  EXPECT_LT(e16, 1e-4) << "bf16 compute vs fp64 on the rounded operands";
  EXPECT_LT(e32, 1e-4) << "f32 vs fp64";
  EXPECT_GT(gap, 1e-3) << "the rounding is visible at this size, so the two checks above tell the modes apart";
  EXPECT_THROW(set_f32_gemm_compute(DType::f64), Error);
}

// The drafter's glue ops (issue #33: glue loops become backend ops): SwiGLU forward against fp64,
// its backward against central differences of the fp64 forward, and add.
TEST(Backend, SwigluForwardBackwardAddAndBiasAddMatchFp64) {
  const std::int64_t n = 1000;  // over a thread's static share, with a tail
  std::vector<float> g(n), u(n), d(n), act(n), dg(n), du(n);
  for (std::int64_t i = 0; i < n; ++i) {
    g[i] = -8.f + 16.f * static_cast<float>(i) / static_cast<float>(n);  // silu's whole range, 0 included
    u[i] = std::sin(0.37f * static_cast<float>(i));
    d[i] = std::cos(0.11f * static_cast<float>(i));
  }
  swiglu_forward(g.data(), u.data(), act.data(), n);
  swiglu_backward(d.data(), g.data(), u.data(), dg.data(), du.data(), n);
  const auto f = [](double gate, double up) { return gate / (1.0 + std::exp(-gate)) * up; };
  for (std::int64_t i = 0; i < n; ++i) {
    const double x = g[i], y = u[i], h = 1e-5;
    EXPECT_NEAR(act[i], f(x, y), 1e-6 * (1 + std::abs(f(x, y)))) << i;
    EXPECT_NEAR(dg[i], d[i] * (f(x + h, y) - f(x - h, y)) / (2 * h), 1e-5) << i;
    EXPECT_NEAR(du[i], d[i] * f(x, 1.0), 1e-5) << i;
  }
  std::vector<float> y = u;
  add_into(y.data(), d.data(), n);
  for (std::int64_t i = 0; i < n; ++i) EXPECT_EQ(y[i], u[i] + d[i]) << i;
  // bias_add: every row gets the same bias, exactly.
  std::vector<float> rows = u;  // 40 rows of 25
  bias_add(rows.data(), 40, 25, d.data());
  for (std::int64_t r = 0; r < 40; ++r)
    for (std::int64_t c = 0; c < 25; ++c) EXPECT_EQ(rows[r * 25 + c], u[r * 25 + c] + d[c]) << r << "," << c;
  // A backend that lacks them says so by name.
  const std::string msg = error_of([] { backend_for(OpKind::swiglu_backward, DType::bf16); });
  EXPECT_NE(msg.find("backend 'cpu' does not support swiglu_backward on bf16"), std::string::npos) << msg;
}

// The AdamW step as a backend op: against the fp64 formula, and any split of the vector gives the
// same bits (the sharded optimizer relies on it).
TEST(Backend, AdamwStepMatchesFp64AndAnySplitGivesTheSameBits) {
  const std::int64_t n = 1003;
  std::vector<float> p(n), g(n), m(n), v(n);
  for (std::int64_t i = 0; i < n; ++i) {
    p[i] = std::sin(0.1f * static_cast<float>(i));
    g[i] = std::cos(0.07f * static_cast<float>(i));
    m[i] = 0.01f * g[i];
    v[i] = 0.001f + 0.0001f * static_cast<float>(i % 7);
  }
  const AdamWStepArgs a{0.9f, 0.999f, 1e-3f, 1.3f, 1e-8f, 0.9999f};
  std::vector<float> p1 = p, m1 = m, v1 = v, p2 = p, m2 = m, v2 = v;
  adamw_step(p1.data(), g.data(), m1.data(), v1.data(), n, a);
  adamw_step(p2.data(), g.data(), m2.data(), v2.data(), 517, a);  // two pieces, an odd split
  adamw_step(p2.data() + 517, g.data() + 517, m2.data() + 517, v2.data() + 517, n - 517, a);
  EXPECT_EQ(p1, p2);
  EXPECT_EQ(m1, m2);
  EXPECT_EQ(v1, v2);
  for (std::int64_t i = 0; i < n; ++i) {
    const double mi = 0.9 * m[i] + 0.1 * g[i], vi = 0.999 * v[i] + 0.001 * double(g[i]) * g[i];
    const double want = p[i] * 0.9999 - 1e-3 * mi / (std::sqrt(vi) * 1.3 + 1e-8);
    EXPECT_NEAR(p1[i], want, 1e-6 * (1 + std::abs(want))) << i;
    EXPECT_NEAR(m1[i], mi, 1e-6) << i;
    EXPECT_NEAR(v1[i], vi, 1e-7) << i;
  }
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

// The active backend and the f32 GEMM precision are the calling thread's: a thread starts on the
// CPU backend in f32, and another thread's choice never reaches it (as CUDA's current device).
TEST(Backend, TheActiveBackendAndPrecisionAreTheCallingThreads) {
  ScopedBackend scoped(toy());
  ScopedF32GemmCompute bf16(DType::bf16);
  const Backend* seen = nullptr;
  DType precision = DType::bf16;
  std::thread([&] {
    seen = &active_backend();
    precision = f32_gemm_compute();
  }).join();
  EXPECT_EQ(seen, &cpu_backend());
  EXPECT_EQ(precision, DType::f32);
  EXPECT_EQ(&active_backend(), &toy());
  EXPECT_EQ(f32_gemm_compute(), DType::bf16);
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

// V-Major's choice on the device (dit/ops.hpp select_active) against a plain sort: per source the
// n - k tokens first in (distance summed over the lanes in lane order in double, index) stay
// cached, a NaN after every number; ties, NaNs, k = 0 and k = n included. token_rows maps the
// lists into row numbers; bad sizes are errors naming the values.
// DFlash2's logits (ops/loss.hpp): top_k orders by value, then id, a NaN last; logit_map is
// multiplier x soft cap; the backward through it with a sparse extra gradient equals the plain
// double formula (repeated ids add up, ids outside the chunk skipped).
TEST(Backend, TopKLogitMapAndTheSelectorsGradient) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x{1.f, 3.f, 3.f, nan, 2.f, /* row 2 */ -1.f, -1.f, -1.f, -1.f, 5.f};
  std::vector<float> val(8);
  std::vector<std::int32_t> ids(8);
  top_k(x.data(), 2, 5, 10, val, ids);
  EXPECT_EQ(ids, (std::vector<std::int32_t>{11, 12, 14, 10, 14, 10, 11, 12}));  // v0 + column
  EXPECT_EQ(val[0], 3.f);
  std::vector<float> all(5);
  std::vector<std::int32_t> all_i(5);
  top_k(x.data(), 1, 5, 0, all, all_i);
  EXPECT_EQ(all_i.back(), 3);  // the NaN last
  std::vector<float> too_many(12);
  std::vector<std::int32_t> too_many_i(12);
  EXPECT_THROW(top_k(x.data(), 2, 5, 0, too_many, too_many_i), Error);  // k = 6 of 5 columns
  const LogitMap map{0.5f, 2.f};
  std::vector<float> y{-3.f, 0.25f, 4.f, 1.f};
  const std::vector<float> z = y;
  logit_map(y.data(), 1, 4, map);
  for (std::size_t i = 0; i < 4; ++i) EXPECT_NEAR(y[i], 2.0 * std::tanh(0.5 * z[i] / 2.0), 1e-6);
  // backward: map'(y) (w (softmax(y) - onehot) + extra), extra at ids {2, 2, 9 (outside), 0}
  const std::vector<float> y0 = y;
  std::vector<double> st(4);
  const std::int32_t target[] = {1};
  cross_entropy(y.data(), 1, 4, 0, target, st);
  const double lse = st[0] + std::log(st[1]), w = 0.75;
  const std::vector<std::int32_t> ex_ids{2, 2, 9, 0};
  const std::vector<double> ex{0.5, 0.25, 7.0, -1.0};
  cross_entropy_backward(y.data(), 1, 4, 0, target, {&w, 1}, {&lse, 1}, map, {ex_ids, ex});
  for (std::size_t v = 0; v < 4; ++v) {
    const double e = v == 2 ? 0.75 : v == 0 ? -1.0 : 0.0;
    const double t = static_cast<double>(y0[v]) / 2.0;
    const double want = 0.5 * (1 - t * t) * (w * (std::exp(y0[v] - lse) - (v == 1 ? 1.0 : 0.0)) + e);
    EXPECT_NEAR(y[v], want, 1e-6) << v;
  }
}

TEST(Backend, SelectActiveKeepsTheNearestTokensAndTokenRowsNumberThem) {
  constexpr std::int64_t lanes = 3, S = 4, n = 13;
  std::vector<float> parts = random_normal<float>(lanes * S * n, 11);
  for (float& x : parts) x = std::round(x);  // many ties
  parts[(0 * S + 2) * n + 5] = std::numeric_limits<float>::quiet_NaN();            // source 2, token 5
  parts[(2 * S + 3) * n + 0] = std::numeric_limits<float>::infinity();              // source 3, token 0
  for (const std::int64_t k : {std::int64_t{0}, std::int64_t{1}, std::int64_t{6}, n}) {
    SCOPED_TRACE("k = " + std::to_string(k));
    std::vector<std::int32_t> active(static_cast<std::size_t>(S * k), -7);
    select_active(parts.data(), lanes, S, n, k, active.data());
    for (std::int64_t s = 0; s < S; ++s) {
      std::vector<double> d(n, 0.0);
      for (std::int64_t lane = 0; lane < lanes; ++lane)
        for (std::int64_t t = 0; t < n; ++t) d[t] += parts[(lane * S + s) * n + t];
      std::vector<std::int32_t> order(n);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
        if (std::isnan(d[a]) || std::isnan(d[b])) return !std::isnan(d[a]) && std::isnan(d[b]);
        return d[a] < d[b];
      });
      std::vector<std::int32_t> want(order.begin() + (n - k), order.end());
      std::sort(want.begin(), want.end());
      EXPECT_EQ(std::vector<std::int32_t>(active.begin() + s * k, active.begin() + (s + 1) * k), want) << "source " << s;
      if (s == 2 && k > 0)  // the NaN distance is last in the order: active whenever any token is
        EXPECT_EQ(std::count(active.begin() + s * k, active.begin() + (s + 1) * k, 5), 1);
    }
    if (k == 0) continue;
    const std::vector<std::int64_t> map = {40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52};
    std::vector<std::int64_t> rows(static_cast<std::size_t>(6 * k));
    token_rows(active.data(), S, k, map.data(), n, 6, 100, rows.data());
    for (std::int64_t b = 0; b < 6; ++b)
      for (std::int64_t a = 0; a < k; ++a)
        EXPECT_EQ(rows[b * k + a], b * 100 + 40 + active[(b % S) * k + a]);
    token_rows(active.data(), S, k, nullptr, n, 2, n, rows.data());
    EXPECT_EQ(rows[k], n + active[k]);
  }
  std::vector<std::int32_t> active(4 * 14);
  EXPECT_NE(error_of([&] { select_active(parts.data(), lanes, S, n, n + 1, active.data()); }).find("k = 14"),
            std::string::npos);
  const std::int32_t outside[] = {3, 13};
  std::int64_t rows[2];
  EXPECT_NE(error_of([&] { token_rows(outside, 1, 2, nullptr, n, 1, 0, rows); }).find("token 13 outside [0, 13)"),
            std::string::npos);
}

// DFlash2's grouped dynamic causal convolution (ops/conv.hpp) against a plain fp64 reference, and
// its backward against central differences of that reference (the conv is linear in each of x, the
// taps and the base kernel, so the differences are exact up to rounding): blocks of 3 rows with 3
// taps (the first rows of a block see fewer), the taps a slice of a wider row (the projection's
// [T, 2, K, G]), dbase accumulated onto what it held. Bad shapes are errors naming the values.
TEST(Backend, DynamicConvMatchesFp64AndItsGradientsDifferences) {
  constexpr std::int64_t T = 9, H = 8, K = 3, G = 2, gs = H / G, block = 3, ld = 2 * K * G;
  const DynamicConvShape shape{T, H, K, G, block};
  const std::vector<float> x = random_normal<float>(T * H, 21), dyn = random_normal<float>(T * ld, 22),
                           base = random_normal<float>(K * H, 23), w = random_normal<float>(T * H, 24);
  const auto reference = [&](const std::vector<double>& xd, const std::vector<double>& dd, const std::vector<double>& bd) {
    std::vector<double> y(T * H, 0.0);
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t c = 0; c < H; ++c)
        for (std::int64_t o = 0; o < K && o <= t % block; ++o)
          y[t * H + c] += (bd[o * H + c] + dd[t * ld + o * G + c / gs]) * xd[(t - o) * H + c];
    return y;
  };
  const auto widen = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
  std::vector<double> xd = widen(x), dd = widen(dyn), bd = widen(base);
  const std::vector<double> y_ref = reference(xd, dd, bd);
  std::vector<float> y(T * H);
  dynamic_conv_forward(x.data(), dyn.data(), ld, base.data(), shape, y.data());
  double scale = 0;
  for (double v : y_ref) scale = std::max(scale, std::abs(v));
  for (std::int64_t i = 0; i < T * H; ++i) EXPECT_NEAR(y[i], y_ref[i], 1e-6 * scale) << "y " << i;

  // L = sum w y: dy = w; each gradient against (L(v + h) - L(v - h)) / 2h on the fp64 reference
  const auto loss = [&] {
    const std::vector<double> yy = reference(xd, dd, bd);
    double l = 0;
    for (std::int64_t i = 0; i < T * H; ++i) l += w[i] * yy[i];
    return l;
  };
  const auto numeric = [&](std::vector<double>& v, std::size_t i) {
    const double keep = v[i], h = 1e-3;
    v[i] = keep + h;
    const double up = loss();
    v[i] = keep - h;
    const double down = loss();
    v[i] = keep;
    return (up - down) / (2 * h);
  };
  std::vector<float> dx(T * H), ddyn(T * ld, 7.f), dbase(K * H, 0.5f);
  dynamic_conv_backward(w.data(), x.data(), dyn.data(), ld, base.data(), shape, dx.data(), ddyn.data() + K * G, ld,
                        dbase.data());
  for (std::size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx[i], numeric(xd, i), 1e-4) << "dx " << i;
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < K * G; ++j) {
      EXPECT_NEAR(ddyn[t * ld + K * G + j], numeric(dd, t * ld + j), 1e-4) << "ddyn " << t << ", " << j;
      EXPECT_EQ(ddyn[t * ld + j], 7.f) << "outside the taps' columns";
    }
  for (std::size_t i = 0; i < dbase.size(); ++i) EXPECT_NEAR(dbase[i], 0.5 + numeric(bd, i), 1e-4) << "dbase " << i;
  EXPECT_EQ(ddyn[0 * ld + K * G + 1 * G], 0.f);  // row 0, tap 1: before the block start

  EXPECT_NE(error_of([&] { dynamic_conv_forward(x.data(), dyn.data(), ld, base.data(), {T, H, K, 3, block}, y.data()); })
                .find("H = 8 is not a multiple of G = 3"),
            std::string::npos);
  EXPECT_NE(error_of([&] { dynamic_conv_forward(x.data(), dyn.data(), ld, base.data(), {T, H, K, G, 4}, y.data()); })
                .find("not whole blocks of 4"),
            std::string::npos);
  EXPECT_NE(error_of([&] { dynamic_conv_forward(x.data(), dyn.data(), ld, base.data(), shape, const_cast<float*>(x.data())); })
                .find("aliases"),
            std::string::npos);
  std::vector<float> x2 = x;
  EXPECT_NE(error_of([&] {
              dynamic_conv_backward(w.data(), x2.data(), dyn.data(), ld, base.data(), shape, x2.data(), ddyn.data(), ld,
                                    dbase.data());
            }).find("dx aliases x"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              dynamic_conv_backward(w.data(), x.data(), dyn.data(), ld, base.data(), shape, dx.data(),
                                    const_cast<float*>(dyn.data()) + 1, ld, dbase.data());
            }).find("ddyn overlaps dyn"),
            std::string::npos);
}

}  // namespace
}  // namespace diffcp
