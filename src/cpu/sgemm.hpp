// The CPU backend's GEMMs on oneDNN (gemm.cpp) and the hooks' typed f32 views. gemm.cpp is compiled
// per ISA like the other kernel files (isa.hpp): oneDNN picks its own kernels at run time, but the
// loops around them (bf16 widening, C += the product) are ours. Private to src/cpu/.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "diffcp/ops/backend.hpp"

#if !defined(DIFFCP_CPU_ISA)
#error "src/cpu kernel files are compiled once per ISA with -DDIFFCP_CPU_ISA=<isa> (src/CMakeLists.txt)"
#endif

namespace diffcp::cpu::DIFFCP_CPU_ISA {

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
// Whether that path runs on bf16 instructions (oneDNN's avx512_core_bf16 or AMX kernels).
bool bf16_gemm_native();
// What of oneDNN determines the GEMMs' bits here: "onednn=2.6.3 onednn_isa=avx512_core_amx
// bf16_gemm=brg:avx512_core_amx_bf16" (the bitwise golden's key: CpuBackend::kernel_key).
std::string onednn_key();

// Typed f32 access to the hooks' views (a wrong dtype or layout is an Error naming the view).
inline HeadRows<const float> rows_f32(ConstTensorView t) { return HeadRows<const float>::from(t); }
inline HeadRows<float> rows_f32(TensorView t) { return HeadRows<float>::from(t); }
inline std::span<const float> span_f32(ConstTensorView t) {
  return {t.ptr<float>(), static_cast<std::size_t>(t.numel())};
}
inline std::span<float> span_f32(TensorView t) { return {t.ptr<float>(), static_cast<std::size_t>(t.numel())}; }

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA
