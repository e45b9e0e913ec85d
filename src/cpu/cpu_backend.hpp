// The CPU backend (ops/backend.hpp): f32 on every op; bf16 storage with f32 accumulation on GEMM
// and attention. OpenMP over rows / work items, GEMMs on oneDNN. One file per op family defines its hooks: gemm.cpp, attention.cpp, merge.cpp,
// rmsnorm.cpp, rope.cpp, elementwise.cpp; backend.cpp holds name(), supports() and the instance.
// Private to src/cpu/.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "diffcp/ops/backend.hpp"

namespace diffcp::cpu {

// Row-major C[M, N] = alpha * op(A) * op(B) + beta * C in f32 (shapes as GemmArgs): the one
// place diffcp calls oneDNN's sgemm. Kernels of this backend call it directly (no dispatch per
// tile); single-threaded when called from inside an OpenMP parallel region.
void sgemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const float* A,
           std::int64_t lda, const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc);

// Row-major C[M, N] = alpha * op(A) * op(B) + beta * C with bf16 A and B, f32 accumulation and C
// of c_dtype (f32 or bf16); shapes as sgemm. oneDNN matmul where it has one for this CPU,
// otherwise the operands converted to f32 + sgemm (bf16_gemm_path() says which, and why).
// fixed_shape: a primitive per (M, N, K), fastest for the few shapes of the attention tiles; else
// one per N with M and K at run time (the layers' GEMMs, whose row counts change every step).
void gemm_bf16(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
               const bf16_t* A, std::int64_t lda, const bf16_t* B, std::int64_t ldb, float beta, void* C,
               std::int64_t ldc, DType c_dtype, bool fixed_shape = true);
std::string bf16_gemm_path();

// Typed f32 access to the hooks' views (a wrong dtype or layout is an Error naming the view).
inline HeadRows<const float> rows_f32(ConstTensorView t) { return HeadRows<const float>::from(t); }
inline HeadRows<float> rows_f32(TensorView t) { return HeadRows<float>::from(t); }
inline std::span<const float> span_f32(ConstTensorView t) {
  return {t.ptr<float>(), static_cast<std::size_t>(t.numel())};
}
inline std::span<float> span_f32(TensorView t) { return {t.ptr<float>(), static_cast<std::size_t>(t.numel())}; }

class CpuBackend final : public Backend {
 public:
  const char* name() const override { return "cpu"; }
  bool supports(OpKind op, DType dtype) const override;
  std::string describe(DType dtype) const override;

  void gemm(const GemmArgs& args) override;
  void bias_backward(ConstTensorView dy, TensorView db) override;
  void bias_add(TensorView y, ConstTensorView b) override;
  void attention_forward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                         TensorView o, TensorView lse, float softmax_scale) override;
  void attention_backward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                          ConstTensorView do_, ConstTensorView lse, ConstTensorView delta, TensorView dq,
                          TensorView dk, TensorView dv, float softmax_scale) override;
  void attention_delta(ConstTensorView do_, ConstTensorView o, TensorView delta) override;
  void lse_merge(std::span<const ConstTensorView> o_parts, std::span<const ConstTensorView> lse_parts, TensorView o,
                 TensorView lse) override;
  void lse_rescale(TensorView o_p, ConstTensorView lse_p, ConstTensorView lse) override;
  void rmsnorm_forward(ConstTensorView x, ConstTensorView w, float eps, TensorView y, TensorView rstd) override;
  void rmsnorm_backward(ConstTensorView dy, ConstTensorView x, ConstTensorView rstd, ConstTensorView w,
                        TensorView dx, TensorView dw) override;
  void rope(TensorView x, std::span<const std::int64_t> positions, const RopeTable& table, bool inverse) override;
  void silu(TensorView x) override;
  void swiglu_forward(ConstTensorView gate, ConstTensorView up, TensorView act) override;
  void swiglu_backward(ConstTensorView dact, ConstTensorView gate, ConstTensorView up, TensorView dgate,
                       TensorView dup) override;
  void add(TensorView y, ConstTensorView x) override;
  void adamw_step(TensorView p, ConstTensorView g, TensorView m, TensorView v, const AdamWStepArgs& args) override;
  void gelu_tanh(TensorView x) override;
  void layernorm_modulate(ConstTensorView x, ConstTensorView shift, ConstTensorView scale, float eps,
                          TensorView y) override;
  void gated_add(TensorView x, ConstTensorView gate, ConstTensorView y) override;
  void qk_norm_rope(TensorView qkv, ConstTensorView q_scale, ConstTensorView k_scale, float eps, ConstTensorView cos,
                    ConstTensorView sin) override;
};

}  // namespace diffcp::cpu
