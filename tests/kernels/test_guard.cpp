// The guard device (testing/guard_backend.hpp) and the backend's memory (ops/buffer.hpp):
//  - a host touch of guard memory faults at once (the guard works);
//  - a host pointer handed to a guard op is refused with an error naming the op and the tensor;
//  - every op computes on the guard bit for bit what it computes on the CPU backend, each op's
//    arguments living in guard buffers and reaching the host only through the backend's copy
//    (the op harness's cases, testing/op_harness.hpp: every op at several shapes);
//  - Buffer, fill, convert and copy on both backends;
//  - guard-async: ops in issue order, host sources taken at the call, frees in stream order, a host
//    read of a queued result faults naming the op, a failed op reported at the next wait.
#include <csignal>
#include <cstring>
#include <algorithm>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/mask.hpp"
#include "diffcp/attention/merge.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/core/random.hpp"
#include "diffcp/dit/ops.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/ops/fp8.hpp"
#include "diffcp/ops/elementwise.hpp"
#include "diffcp/ops/gemm.hpp"
#include "diffcp/ops/linear.hpp"
#include "diffcp/ops/loss.hpp"
#include "diffcp/ops/optim.hpp"
#include "diffcp/ops/rmsnorm.hpp"
#include "diffcp/ops/rope.hpp"
#include "diffcp/testing/guard_backend.hpp"
#include "diffcp/testing/op_harness.hpp"
#include "error_of.hpp"

namespace diffcp {
namespace {

TEST(GuardDevice, HostReadOfDeviceMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Buffer b(DType::f32, 16, guard_backend());
  EXPECT_EXIT(
      {
        const volatile float* p = b.ptr<float>();
        std::printf("%f\n", static_cast<double>(p[3]));
      },
      testing::KilledBySignal(SIGSEGV), "guard device: SIGSEGV at 0x[0-9a-f]+: host code touched guard device memory \\(a "
                                        "buffer of 64 bytes at 0x[0-9a-f]+\\).*No op has written it");
}

TEST(GuardDevice, HostWriteOfDeviceMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Buffer b(DType::bf16, 1000, guard_backend());
  EXPECT_EXIT({ static_cast<volatile bf16_t*>(b.data())[999].bits = 1; }, testing::KilledBySignal(SIGSEGV),
              "guard device: SIGSEGV");
}

TEST(GuardDevice, HostPointersInDeviceOpsAreRefused) {
  std::vector<float> y(8, 1.f), x(8, 2.f);
  Buffer dy(DType::f32, 8, guard_backend());
  ScopedBackend on(guard_backend());
  const std::string e = error_of([&] { add_into(y.data(), x.data(), 8); });
  EXPECT_TRUE(e.starts_with("guard: add: ") && e.find(" (32 bytes at ") != std::string::npos &&
              e.find("is not guard device memory: host memory handed to a device op") != std::string::npos)
      << e;
  // A view one element past the buffer's end is refused as well (the allocated size is checked,
  // not the page-rounded mapping), and so is guard memory in a view labelled host.
  Buffer small(DType::f32, 10, guard_backend());
  EXPECT_NE(error_of([&] { add_into(small.ptr<float>(), small.ptr<float>(), 11); }).find("is not guard device memory"),
            std::string::npos);
  EXPECT_NO_THROW(add_into(small.ptr<float>(), small.ptr<float>(), 10));
  std::vector<float> host(10);
  EXPECT_NE(error_of([&] {
              copy(view_of(std::span<float>(host)), ConstTensorView::contiguous(small.data(), DType::f32, {10}));
            }).find("is guard device memory in a view labelled host"),
            std::string::npos);
  EXPECT_NE(error_of([&] { fill(view_of(std::span<float>(y)), 0.f); }).find("is not a contiguous view of guard memory"),
            std::string::npos);
}

TEST(GuardDevice, BuffersCopiesFillAndConvert) {
  for (Backend* b : {&cpu_backend(), static_cast<Backend*>(&guard_backend())}) {
    SCOPED_TRACE(b->name());
    ScopedBackend on(*b);
    const std::vector<float> host = random_normal(1000, 5);
    Buffer f = to_device(std::span<const float>(host), *b);
    EXPECT_EQ(f.device(), b->device());
    EXPECT_EQ(f.bytes(), 4000u);
    Buffer h(DType::bf16, 1000, *b), back(DType::f32, 1000, *b);
    convert(f.view(), h.view());
    convert(h.view(), back.view());
    const std::vector<float> round = to_host<float>(back.view());
    for (std::size_t i = 0; i < host.size(); ++i) ASSERT_EQ(round[i], bf16_to_f32(f32_to_bf16(host[i]))) << i;
    // [rows, cols] with a row stride: the middle 3 of every 10 values.
    Buffer mid(DType::bf16, 300, *b);
    TensorView rows = f.view({100, 10});
    rows.data = f.ptr<float>() + 4;
    rows.shape[1] = 3;
    convert(rows, mid.view({100, 3}));
    const std::vector<bf16_t> m = to_host<bf16_t>(mid.view());
    for (int r = 0; r < 100; ++r)
      for (int c = 0; c < 3; ++c) ASSERT_EQ(m[r * 3 + c].bits, f32_to_bf16(host[r * 10 + 4 + c]));
    fill(h.view(), 1.5f);
    for (bf16_t v : to_host<bf16_t>(h.view())) ASSERT_EQ(bf16_to_f32(v.bits), 1.5f);
    // reserve() grows only; a grown buffer is a fresh allocation of the same backend.
    f.reserve(10);
    EXPECT_EQ(f.numel(), 1000);
    f.reserve(5000);
    EXPECT_EQ(f.numel(), 5000);
    EXPECT_EQ(f.backend(), b);
    EXPECT_NE(error_of([&] { (void)f.view({5001}); }).find("does not fit"), std::string::npos);
    EXPECT_NE(error_of([&] { convert(f.view({10}), h.view({11})); }).find("differ in shape"), std::string::npos);
  }
  const GuardBackend::Counters c = guard_backend().counters();
  EXPECT_GE(c.host_to_device, 4000u);
  EXPECT_GE(c.device_to_host, 4000u + 600u + 2000u);
}

// ---- every op: the guard computes what the CPU computes, bit for bit (the harness's cases) ----

TEST(GuardDevice, EveryOpComputesWhatTheCpuComputes) {
  for (GuardBackend* g : {&guard_backend(), &guard_async_backend()}) {
    std::set<OpKind> covered;
    for (const OpCase& c : op_cases()) {
      SCOPED_TRACE(std::string(g->name()) + ": " + c.name + " [" + c.shape + "]");
      const std::int64_t ops_before = g->counters().ops;
      const auto cpu = run_op_case(cpu_backend(), c);
      const auto guard = run_op_case(*g, c);
      EXPECT_GE(g->counters().ops - ops_before, static_cast<std::int64_t>(c.ops.size()));
      ASSERT_EQ(cpu.size(), guard.size());
      for (std::size_t i = 0; i < cpu.size(); ++i) EXPECT_TRUE(cpu[i] == guard[i]) << "array " << i << " differs";
      for (const auto& [op, dtype] : c.ops) covered.insert(op);
    }
    for (int k = 0; k < kOpKindCount; ++k)
      EXPECT_TRUE(covered.count(static_cast<OpKind>(k))) << op_name(static_cast<OpKind>(k)) << " has no guard case";
  }
}

// ---- guard-async: CUDA's execution model (ops queued, run in issue order by a worker thread) ----

TEST(GuardAsyncDevice, OpsRunInIssueOrderAndHostSourcesAreTakenAtTheCall) {
  GuardBackend& g = guard_async_backend();
  ScopedBackend on(g);
  constexpr std::int64_t n = 1 << 16;
  std::vector<float> host(n, 1.f);
  Buffer a(DType::f32, n, g), b(DType::f32, n, g);
  const GuardBackend::Counters before = g.counters();
  copy(a.view(), view_of(std::span<const float>(host)));  // queued; the source may be reused at once
  std::fill(host.begin(), host.end(), 7.f);
  add_into(a.ptr<float>(), a.ptr<float>(), n);  // 2
  {
    Buffer tmp(DType::f32, n, g);  // freed while the ops that read it are still queued: in stream order
    fill(tmp.view(), 3.f);
    add_into(a.ptr<float>(), tmp.ptr<float>(), n);  // 5
  }
  fill(b.view(), 0.5f);
  add_into(a.ptr<float>(), b.ptr<float>(), n);  // 5.5
  EXPECT_EQ(g.counters().host_syncs, before.host_syncs);  // nothing so far waited for the device
  for (float v : to_host<float>(a.view())) ASSERT_EQ(v, 5.5f);
  const GuardBackend::Counters after = g.counters();
  EXPECT_EQ(after.host_syncs - before.host_syncs, 1);  // the copy into host memory
  EXPECT_EQ(after.ops - before.ops, 5);
  g.synchronize();
  EXPECT_EQ(g.counters().host_syncs - before.host_syncs, 2);
}

// A host read of a result the stream has not produced yet faults, naming the op queued to write it.
void read_a_queued_result() {
  GuardBackend& g = guard_async_backend();
  ScopedBackend on(g);
  constexpr std::int64_t m = 768;
  Buffer x(DType::f32, m * m, g), y(DType::f32, m * m, g);
  fill(x.view(), 1.f);
  for (int i = 0; i < 8; ++i)  // seconds of queued work ahead of the read
    gemm(false, false, m, m, m, 1.f, x.data(), m, x.data(), m, 0.f, y.data(), m);
  fill(y.view(), 2.f);
  const volatile float* p = y.ptr<float>();
  std::printf("%f\n", static_cast<double>(p[0]));
}

TEST(GuardAsyncDevice, AHostReadOfAQueuedResultFaultsNamingTheOp) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(read_a_queued_result(), testing::KilledBySignal(SIGSEGV),
              "host code touched guard-async device memory \\(a buffer of [0-9]+ bytes at 0x[0-9a-f]+\\).*Last "
              "written by fill \\(op [0-9]+, still queued: a result read before a synchronize covered it\\)");
}

// An op that fails on the stream is reported at the next host wait, once, naming it; the guard
// (immediate) reports it at the call. Here the CPU kernel's own check fails: delta has 1 element for 4 rows.
TEST(GuardAsyncDevice, AnOpThatFailsOnTheStreamIsReportedAtTheNextWaitNamingIt) {
  for (GuardBackend* g : {&guard_backend(), &guard_async_backend()}) {
    SCOPED_TRACE(g->name());
    ScopedBackend on(*g);
    Buffer o(DType::f32, 2 * 2 * 4, *g), delta(DType::f32, 1, *g);
    fill(o.view(), 1.f);
    const auto call = [&] { g->attention_delta(o.view({2, 2, 4}), o.view({2, 2, 4}), delta.view()); };
    if (g->mode() == GuardBackend::Mode::immediate) {
      EXPECT_NE(error_of(call).find("attention_delta: delta has 1"), std::string::npos);
      continue;
    }
    EXPECT_NO_THROW(call());  // queued
    // Reported at the next call (when the stream has failed by then) or else at the wait, where
    // this fill, queued after the failure, is skipped.
    const std::string e = error_of([&] {
      fill(delta.view(), 0.f);
      g->synchronize();
    });
    EXPECT_TRUE(e.starts_with("guard-async: attention_delta (op ") && e.find(" on the stream) failed: ") != std::string::npos &&
                e.find("attention_delta: delta has 1") != std::string::npos)
        << e;
    EXPECT_NO_THROW(g->synchronize());  // reported once
    fill(delta.view(), 4.f);
    EXPECT_EQ(to_host<float>(delta.view()), std::vector<float>{4.f});
  }
}

}  // namespace
}  // namespace diffcp
