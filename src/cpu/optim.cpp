// CPU AdamW step (ops/optim.hpp). Built without FMA contraction (src/CMakeLists.txt): the
// vectorised loop and its scalar tail round alike, so any split of a vector gives the same bits.
#include "cpu_backend.hpp"
#include "isa.hpp"  // last (isa.hpp)

namespace diffcp::cpu::DIFFCP_CPU_ISA {

// p, m, v: [n] in place  g: [n]; float math as fused AdamW kernels do it, one expression per element.
void CpuBackend::adamw_step(TensorView p_v, ConstTensorView g_v, TensorView m_v, TensorView v_v, const AdamWStepArgs& a) {
  float *p = p_v.ptr<float>(), *m = m_v.ptr<float>(), *v = v_v.ptr<float>();
  const float* g = g_v.ptr<float>();
  const std::int64_t n = p_v.numel();
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) {
    const float mi = a.b1 * m[i] + (1.f - a.b1) * g[i];
    const float vi = a.b2 * v[i] + (1.f - a.b2) * g[i] * g[i];
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * a.decay - a.step * mi / (__builtin_sqrtf(vi) * a.inv_sqrt_c2 + a.eps);
  }
}

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA

namespace diffcp::cpu::DIFFCP_CPU_ISA {

// x: [n] in place; the sum of squares in double, in index order (no contraction: this file).
double CpuBackend::scale_sumsq(TensorView x_v, double scale) {
  float* x = x_v.ptr<float>();
  const std::int64_t n = x_v.numel();
  double ss = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    x[i] = static_cast<float>(static_cast<double>(x[i]) * scale);
    ss += static_cast<double>(x[i]) * x[i];
  }
  return ss;
}

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA
