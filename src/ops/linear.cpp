// Dense projections (ops/linear.hpp): shapes mapped onto the one GEMM entry point (ops/gemm.hpp).
#include "diffcp/ops/linear.hpp"

#include "diffcp/core/tensor.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/ops/gemm.hpp"

namespace diffcp {

void linear_forward(const float* x, std::int64_t M, std::int64_t K, const float* W, std::int64_t N, float* y,
                    float beta) {
  gemm(false, false, M, N, K, 1.f, x, K, W, N, beta, y, N);
}

void linear_backward_input(const float* dy, std::int64_t M, std::int64_t N, const float* W, std::int64_t K,
                           float* dx, float beta) {
  gemm(false, true, M, K, N, 1.f, dy, N, W, N, beta, dx, K);
}

void linear_backward_weight(const float* x, std::int64_t M, std::int64_t K, const float* dy, std::int64_t N,
                            float* dW) {
  gemm(true, false, K, N, M, 1.f, x, K, dy, N, 1.f, dW, N);
}

void bias_add(float* y, std::int64_t M, std::int64_t N, const float* b) {
  backend_for(OpKind::bias_add, DType::f32)
      .bias_add(TensorView::contiguous(y, DType::f32, {M, N}, active_device()), ConstTensorView::contiguous(b, DType::f32, {N}, active_device()));
}

void bias_backward(const float* dy, std::int64_t M, std::int64_t N, float* db) {
  backend_for(OpKind::bias_backward, DType::f32)
      .bias_backward(ConstTensorView::contiguous(dy, DType::f32, {M, N}, active_device()), TensorView::contiguous(db, DType::f32, {N}, active_device()));
}

}  // namespace diffcp
