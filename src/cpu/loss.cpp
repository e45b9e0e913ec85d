// CPU cross-entropy over a chunk of logits (ops/loss.hpp): the drafter's LM head, DFlash2's logit
// map and its candidates' top-K. Rows are independent (OpenMP over rows); each row is the plain
// sequential double loop, so the bits do not depend on the thread count. Built without FMA
// contraction (src/CMakeLists.txt).
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_backend.hpp"
#include "diffcp/ops/loss.hpp"
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

// The map's derivative at its output y (exactly 1 for the identity).
double map_slope(double y, LogitMap m) {
  if (m.softcap == 0.f) return m.multiplier;
  const double t = y / m.softcap;
  return m.multiplier * (1.0 - t * t);
}

// lg [n] in place: map'(y) (w (exp(y - lse) - [v0 + v == target]) + extra); extra: this row's k
// (id, grad) pairs, ids outside [v0, v0 + n) skipped. add: scratch of k.
void row_dlogits(float* lg, std::int64_t n, std::int64_t v0, std::int32_t target, double w, double lse, LogitMap map,
                 const std::int32_t* ids, const double* grad, std::int64_t k, double* add) {
  for (std::int64_t j = 0; j < k; ++j) {  // the extras' terms at their y, before the dense pass overwrites it
    const std::int64_t c = ids[j] - v0;
    add[j] = c >= 0 && c < n ? map_slope(lg[c], map) * grad[j] : 0.0;
  }
  for (std::int64_t v = 0; v < n; ++v) {
    const double y = lg[v];
    lg[v] = static_cast<float>(map_slope(y, map) * (w * (std::exp(y - lse) - (v0 + v == target ? 1.0 : 0.0))));
  }
  for (std::int64_t j = 0; j < k; ++j) {
    const std::int64_t c = ids[j] - v0;
    if (c >= 0 && c < n) lg[c] = static_cast<float>(static_cast<double>(lg[c]) + add[j]);
  }
}

}  // namespace

// logits: [R, n] (row stride ld)  target: [R]  stats: [R, 4] out  weight: [R] or empty (then no dlogits)
void CpuBackend::cross_entropy(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target,
                               std::span<double> stats, std::span<const double> weight, LogitMap map) {
  float* lg = logits.ptr<float>();
  const std::int64_t R = logits.size(0), n = logits.size(1), ld = logits.stride[0];
  const bool backward = !weight.empty();
#pragma omp parallel for schedule(static) if (R * n > (1 << 15))
  for (std::int64_t i = 0; i < R; ++i) {
    const auto r = static_cast<std::size_t>(i);
    double* st = stats.data() + 4 * r;
    row_stats(lg + i * ld, n, v0, target[r], st);
    if (backward) row_dlogits(lg + i * ld, n, v0, target[r], weight[r], st[0] + std::log(st[1]), map, nullptr, nullptr, 0, nullptr);
  }
}

// logits: [R, n] (row stride ld) in place  target, weight, lse: [R]  extra: [R, k]
void CpuBackend::cross_entropy_backward(TensorView logits, std::int64_t v0, std::span<const std::int32_t> target,
                                        std::span<const double> weight, std::span<const double> lse, LogitMap map,
                                        SparseLogitGrad extra) {
  float* lg = logits.ptr<float>();
  const std::int64_t R = logits.size(0), n = logits.size(1), ld = logits.stride[0];
  const std::int64_t k = R > 0 ? static_cast<std::int64_t>(extra.ids.size()) / R : 0;
#pragma omp parallel if (R * n > (1 << 15))
  {
    std::vector<double> add(static_cast<std::size_t>(k));
#pragma omp for schedule(static)
    for (std::int64_t i = 0; i < R; ++i) {
      const auto r = static_cast<std::size_t>(i);
      row_dlogits(lg + i * ld, n, v0, target[r], weight[r], lse[r], map, extra.ids.data() + i * k,
                  extra.grad.data() + i * k, k, add.data());
    }
  }
}

// logits: [R, n] (row stride ld) in place
void CpuBackend::logit_map(TensorView logits, LogitMap map) {
  float* lg = logits.ptr<float>();
  const std::int64_t R = logits.size(0), n = logits.size(1), ld = logits.stride[0];
  const float m = map.multiplier, cap = map.softcap;
#pragma omp parallel for schedule(static) if (R * n > (1 << 15))
  for (std::int64_t i = 0; i < R; ++i)
    for (std::int64_t v = 0; v < n; ++v) {
      float& y = lg[i * ld + v];
      y = cap > 0.f ? cap * std::tanh(m * y / cap) : m * y;
    }
}

// logits: [R, n] (row stride ld)  values, ids: [R, k] out
void CpuBackend::top_k(ConstTensorView logits, std::int64_t v0, std::span<float> values, std::span<std::int32_t> ids) {
  const float* lg = logits.ptr<const float>();
  const std::int64_t R = logits.size(0), n = logits.size(1), ld = logits.stride[0];
  const std::int64_t k = static_cast<std::int64_t>(values.size()) / R;
#pragma omp parallel if (R * n > (1 << 15))
  {
    std::vector<std::int32_t> heap;  // the k best so far, worst at the front
#pragma omp for schedule(static)
    for (std::int64_t i = 0; i < R; ++i) {
      const float* row = lg + i * ld;
      const auto worse = [&](std::int32_t a, std::int32_t b) {  // heap order: a ranks before b
        return logit_ranks_before(row[a], a, row[b], b);
      };
      heap.clear();
      for (std::int32_t v = 0; v < n; ++v) {
        if (static_cast<std::int64_t>(heap.size()) < k) {
          heap.push_back(v);
          std::push_heap(heap.begin(), heap.end(), worse);
        } else if (logit_ranks_before(row[v], v, row[heap.front()], heap.front())) {
          std::pop_heap(heap.begin(), heap.end(), worse);
          heap.back() = v;
          std::push_heap(heap.begin(), heap.end(), worse);
        }
      }
      std::sort_heap(heap.begin(), heap.end(), worse);  // best first
      for (std::int64_t j = 0; j < k; ++j) {
        values[static_cast<std::size_t>(i * k + j)] = row[heap[static_cast<std::size_t>(j)]];
        ids[static_cast<std::size_t>(i * k + j)] = static_cast<std::int32_t>(v0 + heap[static_cast<std::size_t>(j)]);
      }
    }
  }
}

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA
