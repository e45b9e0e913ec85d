// The CPU backend's linear-layer hooks (ops/gemm.hpp, ops/linear.hpp): GEMM on oneDNN (gemm.cpp),
// the bias add and the bias gradient.
#include "cpu_backend.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/core/half.hpp"
#include "isa.hpp"  // last (isa.hpp)

namespace diffcp::cpu::DIFFCP_CPU_ISA {

void CpuBackend::gemm(const GemmArgs& a) {
  if (a.dtype == DType::bf16) {
    gemm_bf16(a.trans_a, a.trans_b, a.M, a.N, a.K, a.alpha, static_cast<const bf16_t*>(a.A), a.lda,
              static_cast<const bf16_t*>(a.B), a.ldb, a.beta, a.C, a.ldc, a.c_dtype, /*fixed_shape=*/false);
    return;
  }
  DIFFCP_CHECK(a.c_dtype == DType::f32, "cpu gemm: f32 A and B with C of ", dtype_name(a.c_dtype));
  sgemm(a.trans_a, a.trans_b, a.M, a.N, a.K, a.alpha, static_cast<const float*>(a.A), a.lda,
        static_cast<const float*>(a.B), a.ldb, a.beta, static_cast<float*>(a.C), a.ldc);
}

// y: [M, N] += b: [N] on every row
void CpuBackend::bias_add(TensorView y_v, ConstTensorView b_v) {
  float* y = y_v.ptr<float>();
  const float* b = b_v.ptr<float>();
  const std::int64_t M = y_v.size(0), N = y_v.size(1);
#pragma omp parallel for schedule(static) if (M * N > (1 << 16))
  for (std::int64_t i = 0; i < M; ++i)
#pragma omp simd
    for (std::int64_t j = 0; j < N; ++j) y[i * N + j] += b[j];
}

// dy: [M, N]  db: [N] += column sums of dy
void CpuBackend::bias_backward(ConstTensorView dy_v, TensorView db_v) {
  const float* dy = dy_v.ptr<float>();
  float* db = db_v.ptr<float>();
  const std::int64_t M = dy_v.size(0), N = dy_v.size(1);
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t j = 0; j < N; ++j) db[j] += dy[i * N + j];
}

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA
