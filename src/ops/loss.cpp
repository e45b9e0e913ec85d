// ops/loss.hpp: views to the active backend (CPU: src/cpu/loss.cpp).
#include "diffcp/ops/loss.hpp"

#include "diffcp/core/error.hpp"

namespace diffcp {

void cross_entropy(float* logits, std::int64_t R, std::int64_t n, std::int64_t v0, std::span<const std::int32_t> target,
                   std::span<double> stats, std::span<const double> weight) {
  DIFFCP_CHECK(R >= 0 && n >= 1 && static_cast<std::int64_t>(target.size()) == R &&
                   static_cast<std::int64_t>(stats.size()) == 4 * R &&
                   (weight.empty() || (static_cast<std::int64_t>(weight.size()) == R && v0 == 0)),
               "cross_entropy: R = ", R, ", n = ", n, ", v0 = ", v0, ", ", target.size(), " targets, ", stats.size(),
               " stats, ", weight.size(), " weights; expected [R], [R, 4], [R] or none (with v0 = 0)");
  if (R == 0) return;
  backend_for(OpKind::cross_entropy, DType::f32)
      .cross_entropy(TensorView::contiguous(logits, DType::f32, {R, n}, active_device()), v0, target, stats,
                     weight);
}

void cross_entropy_backward(float* logits, std::int64_t R, std::int64_t n, std::int64_t v0,
                            std::span<const std::int32_t> target, std::span<const double> weight,
                            std::span<const double> lse) {
  DIFFCP_CHECK(R >= 0 && n >= 1 && static_cast<std::int64_t>(target.size()) == R &&
                   static_cast<std::int64_t>(weight.size()) == R && static_cast<std::int64_t>(lse.size()) == R,
               "cross_entropy_backward: R = ", R, ", ", target.size(), " targets, ", weight.size(), " weights, ",
               lse.size(), " lse; expected R each");
  if (R == 0) return;
  backend_for(OpKind::cross_entropy_backward, DType::f32)
      .cross_entropy_backward(TensorView::contiguous(logits, DType::f32, {R, n}, active_device()), v0, target,
                              weight, lse);
}

}  // namespace diffcp
