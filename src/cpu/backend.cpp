// The CPU backend's identity: what it supports, what it says it runs, and this ISA's instance.
#include "cpu_backend.hpp"
#include "isa.hpp"  // last (isa.hpp)

namespace diffcp::cpu::DIFFCP_CPU_ISA {

// f32 everywhere; bf16 (f32 accumulation, f32 lse / delta) on GEMM, dense_linear and attention, and bf16
// memory ops (fill, convert, row gather / scatter) and V-Major's L1 distance; u8 rows (copies,
// gathers, scatters); the fp8 codec from / to f32 and bf16.
bool CpuBackend::supports(OpKind op, DType dtype) const {
  if (dtype == DType::f32) return op != OpKind::dense_linear;  // dense_linear: bf16 weights
  if (dtype == DType::u8)  // raw rows: same-dtype copies, gathers and scatters
    return op == OpKind::convert || op == OpKind::gather_rows || op == OpKind::scatter_rows;
  if (dtype != DType::bf16) return false;
  switch (op) {
    case OpKind::gemm:
    case OpKind::attention_forward:
    case OpKind::attention_backward:
    case OpKind::attention_delta:
    case OpKind::fill:
    case OpKind::convert:
    case OpKind::gather_rows:
    case OpKind::scatter_rows:
    case OpKind::l1_distance:
    case OpKind::fp8_encode:
    case OpKind::fp8_decode:
    case OpKind::dense_linear: return true;
    default: return false;
  }
}

#define DIFFCP_STR2(x) #x
#define DIFFCP_STR(x) DIFFCP_STR2(x)

std::string CpuBackend::describe(DType dtype) const {
  const std::string kernels = "cpu (" DIFFCP_STR(DIFFCP_CPU_ISA) " kernels, " + std::to_string(DIFFCP_SIMD_BYTES * 8) +
                              "-bit vectors): ";
  // The DiT's dense attention blocks (attention.cpp: fused_item).
  const std::string dense = dtype == DType::bf16 && amx_attention_ready(kAmxHeadDim)
                                ? "; dense attention blocks fused on AMX tiles"
                            : vec_attention_ready(dtype, kVecHeadDim)
                                ? (DIFFCP_SIMD_BYTES == 64 ? "; dense attention blocks fused on AVX-512 registers"
                                                           : "; dense attention blocks fused on AVX2 registers")
                                : "";
  return kernels + (dtype == DType::bf16 ? bf16_gemm_path() : dtype_name(dtype) + std::string(" oneDNN sgemm")) + dense;
}

std::string CpuBackend::kernel_key() const {
  const char* dense_f32 = vec_attention_ready(DType::f32, kVecHeadDim) ? "vec" : "none";
  const char* dense_bf16 = amx_attention_ready(kAmxHeadDim)                     ? "amx"
                           : vec_attention_ready(DType::bf16, kVecHeadDim) ? "vec"
                                                                           : "none";
  std::string cxx = __VERSION__;
  for (char& c : cxx)
    if (c == ' ') c = '_';
  return "cpu_kernels=v" + std::to_string(kCpuKernelsVersion) + " isa=" DIFFCP_STR(DIFFCP_CPU_ISA) " cxx=" + cxx +
         " " + onednn_key() + " dense_f32=" + dense_f32 + " dense_bf16=" + dense_bf16;
}

Backend& backend() {
  static CpuBackend b;
  return b;
}

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA
