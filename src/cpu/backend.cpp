// The CPU backend's identity: what it supports and its one instance (cpu_backend()).
#include "cpu_backend.hpp"

namespace diffcp {

namespace cpu {

// f32 everywhere; bf16 (f32 accumulation, f32 lse / delta) on GEMM and attention.
bool CpuBackend::supports(OpKind op, DType dtype) const {
  if (dtype == DType::f32) return true;
  if (dtype != DType::bf16) return false;
  switch (op) {
    case OpKind::gemm:
    case OpKind::attention_forward:
    case OpKind::attention_backward:
    case OpKind::attention_delta: return true;
    default: return false;
  }
}

std::string CpuBackend::describe(DType dtype) const {
  if (dtype == DType::bf16) return "cpu: " + bf16_gemm_path();
  return std::string("cpu: ") + dtype_name(dtype) + " oneDNN sgemm";
}

}  // namespace cpu

Backend& cpu_backend() {
  static cpu::CpuBackend b;
  return b;
}

}  // namespace diffcp
