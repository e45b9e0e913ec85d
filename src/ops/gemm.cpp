// gemm (ops/gemm.hpp): argument checks, then the active backend.
#include "diffcp/ops/gemm.hpp"

#include "diffcp/core/error.hpp"
#include "diffcp/ops/backend.hpp"

namespace diffcp {

void gemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const void* A,
          std::int64_t lda, const void* B, std::int64_t ldb, float beta, void* C, std::int64_t ldc, DType dtype) {
  DIFFCP_CHECK(M >= 0 && N >= 0 && K >= 0, "gemm: M = ", M, ", N = ", N, ", K = ", K, "; expected >= 0");
  // Row strides: at least the stored row width.
  const std::int64_t a_cols = trans_a ? M : K, b_cols = trans_b ? K : N;
  DIFFCP_CHECK(lda >= a_cols && ldb >= b_cols && ldc >= N,
               "gemm: lda = ", lda, ", ldb = ", ldb, ", ldc = ", ldc, " below the row widths ", a_cols, ", ",
               b_cols, ", ", N);
  if (M == 0 || N == 0) return;
  backend_for(OpKind::gemm, dtype).gemm({trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, dtype});
}

}  // namespace diffcp
