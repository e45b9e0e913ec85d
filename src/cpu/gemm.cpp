// CPU GEMM (ops/gemm.hpp) on oneDNN sgemm, and the bias gradient of ops/linear.hpp.
// Row-major throughout: C[M, N] = alpha * op(A)[M, K] * op(B)[K, N] + beta * C.
#include <oneapi/dnnl/dnnl.h>

#include "cpu_backend.hpp"
#include "diffcp/core/error.hpp"

namespace diffcp::cpu {

void sgemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const float* A,
           std::int64_t lda, const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) [[unlikely]] {  // oneDNN needs K >= 1; the product is empty: C = beta * C
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.f ? 0.f : beta * C[i * ldc + j];
    return;
  }
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  const dnnl_status_t st = dnnl_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  DIFFCP_CHECK(st == dnnl_success, "dnnl_sgemm(", ta, tb, " M=", M, " N=", N, " K=", K, ") failed: status ",
               static_cast<int>(st));
}

void CpuBackend::gemm(const GemmArgs& a) {
  sgemm(a.trans_a, a.trans_b, a.M, a.N, a.K, a.alpha, static_cast<const float*>(a.A), a.lda,
        static_cast<const float*>(a.B), a.ldb, a.beta, static_cast<float*>(a.C), a.ldc);
}

// dy: [M, N]  db: [N] += column sums of dy
void CpuBackend::bias_backward(ConstTensorView dy_v, TensorView db_v) {
  const float* dy = dy_v.ptr<float>();
  float* db = db_v.ptr<float>();
  const std::int64_t M = dy_v.size(0), N = dy_v.size(1);
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t j = 0; j < N; ++j) db[j] += dy[i * N + j];
}

}  // namespace diffcp::cpu
