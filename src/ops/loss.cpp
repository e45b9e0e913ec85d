// ops/loss.hpp: views to the active backend (CPU: src/cpu/loss.cpp).
#include "diffcp/ops/loss.hpp"

#include <cmath>

#include "diffcp/core/error.hpp"

namespace diffcp {

namespace {
void check_map(LogitMap map, const char* op) {
  DIFFCP_CHECK(std::isfinite(map.multiplier) && map.multiplier != 0.f && std::isfinite(map.softcap) && map.softcap >= 0.f,
               op, ": logit map multiplier ", map.multiplier, ", soft cap ", map.softcap,
               "; expected a finite nonzero multiplier and a finite cap >= 0 (0: none)");
}
}  // namespace

void logit_map(float* logits, std::int64_t R, std::int64_t n, LogitMap map) {
  DIFFCP_CHECK(R >= 0 && n >= 1, "logit_map: R = ", R, ", n = ", n);
  check_map(map, "logit_map");
  if (R == 0 || map.identity()) return;
  backend_for(OpKind::logit_map, DType::f32)
      .logit_map(TensorView::contiguous(logits, DType::f32, {R, n}, active_device()), map);
}

void top_k(const float* logits, std::int64_t R, std::int64_t n, std::int64_t v0, std::span<float> values,
           std::span<std::int32_t> ids) {
  const std::int64_t k = R > 0 ? static_cast<std::int64_t>(values.size()) / R : 0;
  DIFFCP_CHECK(R >= 0 && n >= 1 && values.size() == ids.size() && (R == 0 || (k >= 1 && k <= n && k * R == static_cast<std::int64_t>(values.size()))),
               "top_k: R = ", R, ", n = ", n, ", ", values.size(), " values, ", ids.size(),
               " ids; expected [R, k] each with 1 <= k <= n");
  if (R == 0) return;
  backend_for(OpKind::top_k, DType::f32)
      .top_k(ConstTensorView::contiguous(logits, DType::f32, {R, n}, active_device()), v0, values, ids);
}

void cross_entropy(float* logits, std::int64_t R, std::int64_t n, std::int64_t v0, std::span<const std::int32_t> target,
                   std::span<double> stats, std::span<const double> weight, LogitMap map) {
  DIFFCP_CHECK(R >= 0 && n >= 1 && static_cast<std::int64_t>(target.size()) == R &&
                   static_cast<std::int64_t>(stats.size()) == 4 * R &&
                   (weight.empty() || (static_cast<std::int64_t>(weight.size()) == R && v0 == 0)),
               "cross_entropy: R = ", R, ", n = ", n, ", v0 = ", v0, ", ", target.size(), " targets, ", stats.size(),
               " stats, ", weight.size(), " weights; expected [R], [R, 4], [R] or none (with v0 = 0)");
  check_map(map, "cross_entropy");
  if (R == 0) return;
  backend_for(OpKind::cross_entropy, DType::f32)
      .cross_entropy(TensorView::contiguous(logits, DType::f32, {R, n}, active_device()), v0, target, stats,
                     weight, map);
}

void cross_entropy_backward(float* logits, std::int64_t R, std::int64_t n, std::int64_t v0,
                            std::span<const std::int32_t> target, std::span<const double> weight,
                            std::span<const double> lse, LogitMap map, SparseLogitGrad extra) {
  DIFFCP_CHECK(R >= 0 && n >= 1 && static_cast<std::int64_t>(target.size()) == R &&
                   static_cast<std::int64_t>(weight.size()) == R && static_cast<std::int64_t>(lse.size()) == R,
               "cross_entropy_backward: R = ", R, ", ", target.size(), " targets, ", weight.size(), " weights, ",
               lse.size(), " lse; expected R each");
  DIFFCP_CHECK(extra.ids.size() == extra.grad.size() && (R == 0 || extra.ids.size() % static_cast<std::size_t>(R) == 0),
               "cross_entropy_backward: ", extra.ids.size(), " extra ids, ", extra.grad.size(),
               " extra gradients; expected [R, k] each (R = ", R, ")");
  check_map(map, "cross_entropy_backward");
  if (R == 0) return;
  backend_for(OpKind::cross_entropy_backward, DType::f32)
      .cross_entropy_backward(TensorView::contiguous(logits, DType::f32, {R, n}, active_device()), v0, target,
                              weight, lse, map, extra);
}

}  // namespace diffcp
