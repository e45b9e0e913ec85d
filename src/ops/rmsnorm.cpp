// ops/rmsnorm.hpp: contiguous views to the active backend (CPU: src/cpu/rmsnorm.cpp).
#include "diffcp/ops/rmsnorm.hpp"

#include "diffcp/ops/backend.hpp"

namespace diffcp {

void rmsnorm_forward(const float* x, std::int64_t rows, std::int64_t heads, std::int64_t d, const float* w,
                     float eps, float* y, float* rstd) {
  backend_for(OpKind::rmsnorm_forward, DType::f32)
      .rmsnorm_forward(ConstTensorView::contiguous(x, DType::f32, {rows, heads, d}, active_device()),
                       ConstTensorView::contiguous(w, DType::f32, {d}, active_device()), eps,
                       TensorView::contiguous(y, DType::f32, {rows, heads, d}, active_device()),
                       TensorView::contiguous(rstd, DType::f32, {rows, heads}, active_device()));
}

void rmsnorm_backward(const float* dy, const float* x, const float* rstd, std::int64_t rows, std::int64_t heads,
                      std::int64_t d, const float* w, float* dx, float* dw) {
  backend_for(OpKind::rmsnorm_backward, DType::f32)
      .rmsnorm_backward(ConstTensorView::contiguous(dy, DType::f32, {rows, heads, d}, active_device()),
                        ConstTensorView::contiguous(x, DType::f32, {rows, heads, d}, active_device()),
                        ConstTensorView::contiguous(rstd, DType::f32, {rows, heads}, active_device()),
                        ConstTensorView::contiguous(w, DType::f32, {d}, active_device()),
                        TensorView::contiguous(dx, DType::f32, {rows, heads, d}, active_device()),
                        TensorView::contiguous(dw, DType::f32, {d}, active_device()));
}

}  // namespace diffcp
