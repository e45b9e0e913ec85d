// diffcp's one GEMM entry point, row-major: every dense product of the library (linear layers,
// DiT projections) goes through it to the active backend (ops/backend.hpp). The CPU backend
// runs it on oneDNN sgemm, multi-threaded by oneDNN's OpenMP (single-threaded when called from
// inside a parallel region).
#pragma once

#include <cstdint>

#include "diffcp/core/dtype.hpp"

namespace diffcp {

// C[M, N] = alpha * op(A) * op(B) + beta * C, op(X) = X^T when trans_x:
//   A: [M, K] row stride lda (trans_a: [K, M])   B: [K, N] row stride ldb (trans_b: [N, K])
//   C: [M, N] row stride ldc.  A, B, C hold `dtype`.
// K = 0: C = beta * C (beta = 0 writes zeros). M = 0 or N = 0: nothing.
void gemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const void* A,
          std::int64_t lda, const void* B, std::int64_t ldb, float beta, void* C, std::int64_t ldc,
          DType dtype = DType::f32);

// C[M, N] (f32) = alpha * op(A) * op(B) + beta * C with A and B already in bf16, f32 accumulation
// (shapes as gemm): the mixed-precision GEMM for operands the caller keeps in bf16, e.g. weights
// rounded once instead of at every call.
void gemm_bf16_f32acc(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
                      const bf16_t* A, std::int64_t lda, const bf16_t* B, std::int64_t ldb, float beta, float* C,
                      std::int64_t ldc);

// The compute precision of f32 GEMMs (autocast, as torch's set_float32_matmul_precision("medium")
// or AMP): f32 (default), or bf16 — A and B rounded to bf16, products accumulated in f32, C f32.
// What mixed-precision training runs: f32 master weights, optimizer, loss and gradient reduction,
// bf16 GEMMs. The calling thread's setting, as its current backend (ops/backend.hpp): the layer,
// trainer or DiT run that owns a compute dtype installs it (ScopedF32GemmCompute) around its ops,
// and the GEMM wrappers read it when an op is issued (a queued op carries it). bf16 needs the
// active backend's bf16 GEMM.
DType f32_gemm_compute();
void set_f32_gemm_compute(DType compute);  // f32 | bf16
class ScopedF32GemmCompute {
 public:
  explicit ScopedF32GemmCompute(DType compute) : previous_(f32_gemm_compute()) { set_f32_gemm_compute(compute); }
  ~ScopedF32GemmCompute() { set_f32_gemm_compute(previous_); }
  ScopedF32GemmCompute(const ScopedF32GemmCompute&) = delete;
  ScopedF32GemmCompute& operator=(const ScopedF32GemmCompute&) = delete;

 private:
  DType previous_;
};

}  // namespace diffcp
