// The CPU backend's identity: what it supports and its one instance (cpu_backend()).
#include "cpu_backend.hpp"

namespace diffcp {

namespace cpu {
// f32 everywhere; bf16 is issue #14.
bool CpuBackend::supports(OpKind, DType dtype) const { return dtype == DType::f32; }
}  // namespace cpu

Backend& cpu_backend() {
  static cpu::CpuBackend b;
  return b;
}

}  // namespace diffcp
