// CPU rotate-half RoPE (ops/rope.hpp): OpenMP over rows.
#include "cpu_backend.hpp"
#include "diffcp/ops/rope.hpp"
#include "isa.hpp"  // last (isa.hpp)

namespace diffcp::cpu::DIFFCP_CPU_ISA {

// x: [rows, heads, d_h] in place  positions: [rows], validated by rope_apply (no throw inside OpenMP)
void CpuBackend::rope(TensorView x_v, std::span<const std::int64_t> positions, const RopeTable& table, bool inverse) {
  float* x = x_v.ptr<float>();
  const std::int64_t rows = x_v.size(0), heads = x_v.size(1);
  const std::int64_t d = table.d_h(), half = d / 2;
  const float sign = inverse ? -1.f : 1.f;
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t pos = positions[static_cast<std::size_t>(r)];
    const float* c = table.cos(pos);
    const float* s = table.sin(pos);
    for (std::int64_t h = 0; h < heads; ++h) {
      float* v = x + (r * heads + h) * d;
      for (std::int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half], sn = sign * s[i];
        v[i] = a * c[i] - b * sn;
        v[i + half] = b * c[i] + a * sn;
      }
    }
  }
}

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA
