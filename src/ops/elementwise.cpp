// ops/elementwise.hpp: views to the active backend (CPU: src/cpu/elementwise.cpp).
#include "diffcp/ops/elementwise.hpp"

#include "diffcp/core/error.hpp"
#include "diffcp/ops/backend.hpp"

namespace diffcp {

namespace {
// [rows, cols] with row stride ld.
template <typename View, typename T>
View strided_rows(T* p, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  View t = View::contiguous(p, DType::f32, {rows, cols}, active_device());
  t.stride[0] = ld;
  return t;
}
}  // namespace

void silu_inplace(float* x, std::int64_t n) {
  backend_for(OpKind::silu, DType::f32).silu(TensorView::contiguous(x, DType::f32, {n}, active_device()));
}

void swiglu_forward(const float* gate, const float* up, float* act, std::int64_t n) {
  backend_for(OpKind::swiglu_forward, DType::f32)
      .swiglu_forward(ConstTensorView::contiguous(gate, DType::f32, {n}, active_device()), ConstTensorView::contiguous(up, DType::f32, {n}, active_device()),
                      TensorView::contiguous(act, DType::f32, {n}, active_device()));
}

void swiglu_rows(float* x, std::int64_t rows, std::int64_t M, std::int64_t ld) {
  DIFFCP_CHECK(rows >= 0 && M >= 1 && ld >= 2 * M, "swiglu_rows: rows = ", rows, ", M = ", M, ", ld = ", ld);
  if (rows == 0) return;
  backend_for(OpKind::swiglu_forward, DType::f32)
      .swiglu_forward(strided_rows<ConstTensorView>(x, rows, M, ld), strided_rows<ConstTensorView>(x + M, rows, M, ld),
                      strided_rows<TensorView>(x, rows, M, ld));
}

void swiglu_backward(const float* dact, const float* gate, const float* up, float* dgate, float* dup, std::int64_t n) {
  backend_for(OpKind::swiglu_backward, DType::f32)
      .swiglu_backward(ConstTensorView::contiguous(dact, DType::f32, {n}, active_device()), ConstTensorView::contiguous(gate, DType::f32, {n}, active_device()),
                       ConstTensorView::contiguous(up, DType::f32, {n}, active_device()), TensorView::contiguous(dgate, DType::f32, {n}, active_device()),
                       TensorView::contiguous(dup, DType::f32, {n}, active_device()));
}

void add_into(float* y, const float* x, std::int64_t n) { axpy(y, 1.f, x, n); }

void axpy(float* y, float alpha, const float* x, std::int64_t n) {
  backend_for(OpKind::add, DType::f32)
      .add(TensorView::contiguous(y, DType::f32, {n}, active_device()), ConstTensorView::contiguous(x, DType::f32, {n}, active_device()), alpha);
}

void guidance_combine(float* v, const float* v_neg, std::int64_t rows, std::int64_t C, float scale, bool keep_norm) {
  DIFFCP_CHECK(rows >= 0 && C >= 1, "guidance_combine: rows = ", rows, ", C = ", C);
  if (rows == 0) return;
  backend_for(OpKind::guidance_combine, DType::f32)
      .guidance_combine(TensorView::contiguous(v, DType::f32, {rows, C}, active_device()),
                        ConstTensorView::contiguous(v_neg, DType::f32, {rows, C}, active_device()), scale, keep_norm);
}

void gelu_tanh_inplace(float* x, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  backend_for(OpKind::gelu_tanh, DType::f32).gelu_tanh(strided_rows<TensorView>(x, rows, cols, ld));
}

void gelu_inplace(float* x, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  backend_for(OpKind::gelu, DType::f32).gelu(strided_rows<TensorView>(x, rows, cols, ld));
}

void layernorm_modulate(const float* x, std::int64_t rows, std::int64_t H, const float* shift, const float* scale,
                        float eps, float* y) {
  backend_for(OpKind::layernorm_modulate, DType::f32)
      .layernorm_modulate(ConstTensorView::contiguous(x, DType::f32, {rows, H}, active_device()),
                          ConstTensorView::contiguous(shift, DType::f32, {H}, active_device()),
                          ConstTensorView::contiguous(scale, DType::f32, {H}, active_device()), eps,
                          TensorView::contiguous(y, DType::f32, {rows, H}, active_device()));
}

void gated_add(float* x, std::int64_t rows, std::int64_t H, const float* gate, const float* y, std::int64_t ldy) {
  backend_for(OpKind::gated_add, DType::f32)
      .gated_add(TensorView::contiguous(x, DType::f32, {rows, H}, active_device()), ConstTensorView::contiguous(gate, DType::f32, {H}, active_device()),
                 strided_rows<ConstTensorView>(y, rows, H, ldy));
}

}  // namespace diffcp
