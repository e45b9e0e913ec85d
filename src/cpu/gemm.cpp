#include "diffcp/ops/linear.hpp"

#include <oneapi/dnnl/dnnl.h>

#include "diffcp/core/error.hpp"

namespace diffcp {

namespace {
void sgemm(char ta, char tb, std::int64_t M, std::int64_t N, std::int64_t K, const float* A, std::int64_t lda,
           const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // oneDNN needs K >= 1; the product is empty: C = beta * C
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.f ? 0.f : beta * C[i * ldc + j];
    return;
  }
  const dnnl_status_t st = dnnl_sgemm(ta, tb, M, N, K, 1.f, A, lda, B, ldb, beta, C, ldc);
  DIFFCP_CHECK(st == dnnl_success, "dnnl_sgemm(", ta, tb, " M=", M, " N=", N, " K=", K, ") failed: status ",
               static_cast<int>(st));
}
}  // namespace

void linear_forward(const float* x, std::int64_t M, std::int64_t K, const float* W, std::int64_t N, float* y,
                    float beta) {
  sgemm('N', 'N', M, N, K, x, K, W, N, beta, y, N);
}

void linear_backward_input(const float* dy, std::int64_t M, std::int64_t N, const float* W, std::int64_t K,
                           float* dx, float beta) {
  sgemm('N', 'T', M, K, N, dy, N, W, N, beta, dx, K);
}

void linear_backward_weight(const float* x, std::int64_t M, std::int64_t K, const float* dy, std::int64_t N,
                            float* dW) {
  sgemm('T', 'N', K, N, M, x, K, dy, N, 1.f, dW, N);
}

void bias_backward(const float* dy, std::int64_t M, std::int64_t N, float* db) {
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t j = 0; j < N; ++j) db[j] += dy[i * N + j];
}

}  // namespace diffcp
