// gemm (ops/gemm.hpp): argument checks, then the active backend.
#include "diffcp/ops/gemm.hpp"

#include "diffcp/core/error.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/ops/buffer.hpp"

namespace diffcp {

namespace {

// The calling thread's, as the current backend (ops/backend.hpp): a run installs its own.
thread_local DType g_f32_compute = DType::f32;

// The stored [rows, cols] matrix at x (row stride ld, the backend's memory) rounded into a dense
// bf16 one in `out` (a workspace in the active backend's memory, grown as needed).
const bf16_t* round_to_bf16(const float* x, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                            DeviceVector<bf16_t>& out) {
  out.resize(rows * cols);
  convert_rows(x, DType::f32, ld, out.data(), DType::bf16, cols, rows, cols);
  return out.data();
}

}  // namespace

void gemm_bf16_f32acc(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
                      const bf16_t* A, std::int64_t lda, const bf16_t* B, std::int64_t ldb, float beta, float* C,
                      std::int64_t ldc) {
  DIFFCP_CHECK(M >= 0 && N >= 0 && K >= 0, "gemm_bf16_f32acc: M = ", M, ", N = ", N, ", K = ", K, "; expected >= 0");
  const std::int64_t a_cols = trans_a ? M : K, b_cols = trans_b ? K : N;
  DIFFCP_CHECK(lda >= a_cols && ldb >= b_cols && ldc >= N, "gemm_bf16_f32acc: lda = ", lda, ", ldb = ", ldb,
               ", ldc = ", ldc, " below the row widths ", a_cols, ", ", b_cols, ", ", N);
  if (M == 0 || N == 0) return;
  backend_for(OpKind::gemm, DType::bf16)
      .gemm({trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, DType::bf16, DType::f32});
}

DType f32_gemm_compute() { return g_f32_compute; }

void set_f32_gemm_compute(DType compute) {
  DIFFCP_CHECK(compute == DType::f32 || compute == DType::bf16, "f32 GEMM compute precision ", dtype_name(compute),
               ": expected f32 or bf16");
  g_f32_compute = compute;
}

void gemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const void* A,
          std::int64_t lda, const void* B, std::int64_t ldb, float beta, void* C, std::int64_t ldc, DType dtype) {
  DIFFCP_CHECK(M >= 0 && N >= 0 && K >= 0, "gemm: M = ", M, ", N = ", N, ", K = ", K, "; expected >= 0");
  // Row strides: at least the stored row width.
  const std::int64_t a_cols = trans_a ? M : K, b_cols = trans_b ? K : N;
  DIFFCP_CHECK(lda >= a_cols && ldb >= b_cols && ldc >= N,
               "gemm: lda = ", lda, ", ldb = ", ldb, ", ldc = ", ldc, " below the row widths ", a_cols, ", ",
               b_cols, ", ", N);
  if (M == 0 || N == 0) return;
  if (dtype == DType::f32 && f32_gemm_compute() == DType::bf16) {
    thread_local DeviceVector<bf16_t> a16, b16;
    const std::int64_t a_rows = trans_a ? K : M, a_cols = trans_a ? M : K;
    const std::int64_t b_rows = trans_b ? N : K, b_cols = trans_b ? K : N;
    const bf16_t* a = round_to_bf16(static_cast<const float*>(A), a_rows, a_cols, lda, a16);
    const bf16_t* bb = round_to_bf16(static_cast<const float*>(B), b_rows, b_cols, ldb, b16);
    gemm_bf16_f32acc(trans_a, trans_b, M, N, K, alpha, a, a_cols, bb, b_cols, beta, static_cast<float*>(C), ldc);
    return;
  }
  backend_for(OpKind::gemm, dtype).gemm({trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, dtype, dtype});
}

}  // namespace diffcp
