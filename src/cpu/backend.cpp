// The CPU backend's identity: what it supports, what it says it runs, and this ISA's instance.
#include "cpu_backend.hpp"
#include "isa.hpp"  // last (isa.hpp)

namespace diffcp::cpu::DIFFCP_CPU_ISA {

// f32 everywhere; bf16 (f32 accumulation, f32 lse / delta) on GEMM, dense_linear and attention, and bf16
// memory ops (fill, convert, row gather / scatter) and V-Major's L1 distance; u8 rows (copies,
// gathers, scatters); the fp8 codec from / to f32 and bf16; token_rows on i32 indices.
bool CpuBackend::supports(OpKind op, DType dtype) const {
  if (dtype == DType::f32) return op != OpKind::dense_linear;  // dense_linear: bf16 weights
  if (dtype == DType::u8)  // raw rows: same-dtype copies, gathers and scatters
    return op == OpKind::convert || op == OpKind::gather_rows || op == OpKind::scatter_rows;
  if (dtype == DType::i32) return op == OpKind::token_rows;  // token indices -> row lists
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

namespace {
// Which kernel runs the DiT's dense attention blocks of `dtype` (attention.cpp: fused_item):
// "amx" (tiles; then the block-sparse bf16 forward runs on them too: amx_sparse_item), "vec"
// (fused on vector registers) or "none" (the tile path over oneDNN).
const char* dense_attention_path(DType dtype) {
  if (dtype == DType::bf16 && amx_attention_ready(kAmxHeadDim)) return "amx";
  return vec_attention_ready(dtype, kVecHeadDim) ? "vec" : "none";
}
}  // namespace

std::string CpuBackend::describe(DType dtype) const {
  const std::string kernels = "cpu (" DIFFCP_STR(DIFFCP_CPU_ISA) " kernels, " + std::to_string(DIFFCP_SIMD_BYTES * 8) +
                              "-bit vectors): ";
  const std::string path = dense_attention_path(dtype);
  const std::string dense = path == "amx"   ? "; attention fused on AMX tiles (block-sparse forward and backward, dense forward)"
                            : path == "vec" ? (DIFFCP_SIMD_BYTES == 64 ? "; dense attention blocks fused on AVX-512 registers"
                                                                       : "; dense attention blocks fused on AVX2 registers")
                                            : "";
  return kernels + (dtype == DType::bf16 ? bf16_gemm_path() : dtype_name(dtype) + std::string(" oneDNN sgemm")) + dense;
}

bool CpuBackend::native_arithmetic(DType dtype) const { return dtype != DType::bf16 || bf16_gemm_native(); }

std::string CpuBackend::kernel_key() const {
  std::string cxx = __VERSION__;
  for (char& c : cxx)
    if (c == ' ') c = '_';
  return "cpu_kernels=v" + std::to_string(kCpuKernelsVersion) + " isa=" DIFFCP_STR(DIFFCP_CPU_ISA) " cxx=" + cxx +
         " " + onednn_key() + " dense_f32=" + dense_attention_path(DType::f32) +
         " dense_bf16=" + dense_attention_path(DType::bf16);
}

Backend& backend() {
  static CpuBackend b;
  return b;
}

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA
