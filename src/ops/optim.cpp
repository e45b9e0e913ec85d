// ops/optim.hpp: views to the active backend.
#include "diffcp/ops/optim.hpp"

namespace diffcp {

void adamw_step(float* p, const float* g, float* m, float* v, std::int64_t n, const AdamWStepArgs& args) {
  backend_for(OpKind::adamw_step, DType::f32)
      .adamw_step(TensorView::contiguous(p, DType::f32, {n}, active_device()), ConstTensorView::contiguous(g, DType::f32, {n}, active_device()),
                  TensorView::contiguous(m, DType::f32, {n}, active_device()), TensorView::contiguous(v, DType::f32, {n}, active_device()), args);
}

double scale_sumsq(float* x, std::int64_t n, double scale) {
  if (n == 0) return 0;
  return backend_for(OpKind::scale_sumsq, DType::f32).scale_sumsq(TensorView::contiguous(x, DType::f32, {n}, active_device()), scale);
}

}  // namespace diffcp
