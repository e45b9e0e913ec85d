// The device backend of the *_guard tests (test_cp_guard, test_dit_guard, test_drafter_guard):
// the guard device by default (testing/guard_backend.hpp: it computes what the CPU computes, so
// the runs equal the CPU's bit for bit), or the backend DIFFCP_TEST_DEVICE names ("guard-async":
// the same device in CUDA's stream order, equally exact; "cuda": the
// same tests on a GPU, scripts/gpu_check.sh; its kernels differ from the CPU's, so the runs agree
// with the CPU's within a bound relative to the largest value, and f32 layers still pass the fp64
// reference).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/core/error.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/testing/guard_backend.hpp"
#ifdef DIFFCP_HAVE_CUDA
#include "diffcp/cuda/backend.hpp"
#endif

namespace diffcp::test {

// Bounds of a non-exact device against the CPU, relative to the largest |value| of the CPU's run:
// f32 compute, and bf16 compute (both runs round to bf16, at different places).
inline constexpr double kDeviceBoundF32 = 1e-3;
inline constexpr double kDeviceBoundBf16 = 5e-2;

struct DeviceUnderTest {
  Backend* backend = nullptr;  // null: not available here (skip_reason says why)
  bool exact = true;           // the guard: equal to the CPU bit for bit
  std::string skip_reason;
  std::string error;           // a name that is no device of this build: the tests fail
};

inline const DeviceUnderTest& device_under_test() {
  static const DeviceUnderTest d = [] {
    DeviceUnderTest r;
    const char* env = std::getenv("DIFFCP_TEST_DEVICE");
    const std::string name = env != nullptr && *env != '\0' ? env : "guard";
    if (name == "guard" || name == "guard-async") {
      r.backend = name == "guard" ? &guard_backend() : &guard_async_backend();
      return r;
    }
    r.exact = false;
#ifdef DIFFCP_HAVE_CUDA
    if (name == "cuda") {
      std::string why;
      if (cuda_device_present(&why))
        r.backend = &cuda_backend();
      else
        r.skip_reason = "DIFFCP_TEST_DEVICE=cuda: " + why;
      return r;
    }
#endif
    r.error = "DIFFCP_TEST_DEVICE=" + name + ": not a device of this build (guard, guard-async, or cuda in a CUDA build)";
    return r;
  }();
  return d;
}

// The guard device under test (guard-async where DIFFCP_TEST_DEVICE names it), else the guard:
// the tests that count ops and host syncs read its counters.
inline GuardBackend& guard_under_test() {
  Backend* b = device_under_test().backend;
  return b != nullptr && is_guard(*b) ? static_cast<GuardBackend&>(*b) : guard_backend();
}
inline std::int64_t guard_ops() { return guard_under_test().counters().ops; }

// Whether `dev` (the device's run) matches `cpu` (the CPU's): equal on an exact device, else
// within bound * max |cpu| everywhere (and the same length). The message names the worst element.
template <typename T>
::testing::AssertionResult matches_cpu(const std::vector<T>& cpu, const std::vector<T>& dev, double bound) {
  if (cpu.size() != dev.size())
    return ::testing::AssertionFailure() << "lengths differ: cpu " << cpu.size() << ", device " << dev.size();
  if (device_under_test().exact) {
    for (std::size_t i = 0; i < cpu.size(); ++i)
      if (!(cpu[i] == dev[i]) && !(std::isnan(static_cast<double>(cpu[i])) && std::isnan(static_cast<double>(dev[i]))))
        return ::testing::AssertionFailure() << "element " << i << " differs: cpu " << cpu[i] << ", device " << dev[i];
    return ::testing::AssertionSuccess();
  }
  double peak = 0, worst = -1;
  std::size_t at = 0;
  for (const T& x : cpu) peak = std::max(peak, std::abs(static_cast<double>(x)));
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    const double e = std::abs(static_cast<double>(cpu[i]) - static_cast<double>(dev[i]));
    if (!(e <= worst)) worst = e, at = i;  // NaN counts as the worst
  }
  if (cpu.empty() || worst <= bound * std::max(peak, 1e-30))
    return ::testing::AssertionSuccess() << "worst " << worst / std::max(peak, 1e-30) << " of the peak";
  return ::testing::AssertionFailure() << "element " << at << ": cpu " << cpu[at] << ", device " << dev[at] << " (error "
                                       << worst / std::max(peak, 1e-30) << " of the peak " << peak << ", bound " << bound
                                       << ")";
}
template <typename T>
::testing::AssertionResult matches_cpu(const std::vector<std::vector<T>>& cpu, const std::vector<std::vector<T>>& dev,
                                       double bound) {
  if (cpu.size() != dev.size())
    return ::testing::AssertionFailure() << "counts differ: cpu " << cpu.size() << ", device " << dev.size();
  for (std::size_t i = 0; i < cpu.size(); ++i)
    if (auto r = matches_cpu(cpu[i], dev[i], bound); !r) return ::testing::AssertionFailure() << "part " << i << ": " << r.message();
  return ::testing::AssertionSuccess();
}

inline double device_bound(DType compute) { return compute == DType::bf16 ? kDeviceBoundBf16 : kDeviceBoundF32; }

}  // namespace diffcp::test

// The device of this test, or a skip saying why there is none.
#define DIFFCP_DEVICE_OR_SKIP(dev)                                                                 \
  if (!::diffcp::test::device_under_test().error.empty())                                          \
    FAIL() << ::diffcp::test::device_under_test().error;                                           \
  if (::diffcp::test::device_under_test().backend == nullptr)                                      \
    GTEST_SKIP() << ::diffcp::test::device_under_test().skip_reason;                               \
  ::diffcp::Backend& dev = *::diffcp::test::device_under_test().backend
