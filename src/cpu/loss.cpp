// CPU cross-entropy over a chunk of logits (ops/loss.hpp): the drafter's LM head. Rows are
// independent (OpenMP over rows); each row is the plain sequential double loop, so the bits do
// not depend on the thread count. Built without FMA contraction (src/CMakeLists.txt).
#include <algorithm>
#include <cmath>

#include "cpu_backend.hpp"
#include "isa.hpp"  // last (isa.hpp)

namespace diffcp::cpu::DIFFCP_CPU_ISA {

namespace {
// Per-row statistics of lg [n] over columns [v0, v0 + n): max, sum exp(l - max), the first argmax
// (global id) and the target's logit (0 when the target is not in the slice).
void row_stats(const float* lg, std::int64_t n, std::int64_t v0, std::int32_t target, double* st) {
  const auto best = std::max_element(lg, lg + n) - lg;
  const double mx = lg[best];
  double sum = 0;
  for (std::int64_t v = 0; v < n; ++v) sum += std::exp(static_cast<double>(lg[v]) - mx);
  st[0] = mx;
  st[1] = sum;
  st[2] = static_cast<double>(v0 + best);
  st[3] = target >= v0 && target < v0 + n ? static_cast<double>(lg[target - v0]) : 0.0;
}

// lg [n] in place: w (exp(l - lse) - [v0 + v == target]).
void row_dlogits(float* lg, std::int64_t n, std::int64_t v0, std::int32_t target, double w, double lse) {
  for (std::int64_t v = 0; v < n; ++v)
    lg[v] = static_cast<float>(w * (std::exp(static_cast<double>(lg[v]) - lse) - (v0 + v == target ? 1.0 : 0.0)));
}
}  // namespace

// logits: [R, n] (row stride ld)  target: [R]  stats: [R, 4] out  weight: [R] or empty (then no dlogits)
void CpuBackend::cross_entropy(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target,
                               std::span<double> stats, std::span<const double> weight) {
  float* lg = logits.ptr<float>();
  const std::int64_t R = logits.size(0), n = logits.size(1), ld = logits.stride[0];
  const bool backward = !weight.empty();
#pragma omp parallel for schedule(static) if (R * n > (1 << 15))
  for (std::int64_t i = 0; i < R; ++i) {
    const auto r = static_cast<std::size_t>(i);
    double* st = stats.data() + 4 * r;
    row_stats(lg + i * ld, n, v0, target[r], st);
    if (backward) row_dlogits(lg + i * ld, n, v0, target[r], weight[r], st[0] + std::log(st[1]));
  }
}

// logits: [R, n] (row stride ld) in place  target, weight, lse: [R]
void CpuBackend::cross_entropy_backward(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target,
                                        std::span<const double> weight, std::span<const double> lse) {
  float* lg = logits.ptr<float>();
  const std::int64_t R = logits.size(0), n = logits.size(1), ld = logits.stride[0];
#pragma omp parallel for schedule(static) if (R * n > (1 << 15))
  for (std::int64_t i = 0; i < R; ++i) {
    const auto r = static_cast<std::size_t>(i);
    row_dlogits(lg + i * ld, n, v0, target[r], weight[r], lse[r]);
  }
}

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA
