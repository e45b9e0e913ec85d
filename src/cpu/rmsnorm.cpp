// CPU per-head RMSNorm (ops/rmsnorm.hpp): OpenMP over (row, head) vectors.
#include <cmath>
#include <vector>

#include "cpu_backend.hpp"

// Built without -fopenmp (the fuzz project), the pragmas are ignored and the loops run on one
// thread; omp.h is then not needed (clang's copy comes from libomp-dev, which we do not install).
#if defined(_OPENMP)
#include <omp.h>
#else
static int omp_get_max_threads() { return 1; }
static int omp_get_thread_num() { return 0; }
#endif

#include "isa.hpp"  // last (isa.hpp)

namespace diffcp::cpu::DIFFCP_CPU_ISA {

// x, y: [rows, heads, d]  w: [d]  rstd: [rows, heads]
void CpuBackend::rmsnorm_forward(ConstTensorView x_v, ConstTensorView w_v, float eps, TensorView y_v,
                                 TensorView rstd_v) {
  const float *x = x_v.ptr<float>(), *w = w_v.ptr<float>();
  float *y = y_v.ptr<float>(), *rstd = rstd_v.ptr<float>();
  const std::int64_t rows = x_v.size(0), heads = x_v.size(1), d = x_v.size(2);
#pragma omp parallel for schedule(static)
  for (std::int64_t v = 0; v < rows * heads; ++v) {
    const float* xv = x + v * d;
    float ss = 0.f;
    for (std::int64_t c = 0; c < d; ++c) ss += xv[c] * xv[c];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    rstd[v] = r;
    float* yv = y + v * d;
    for (std::int64_t c = 0; c < d; ++c) yv[c] = xv[c] * r * w[c];
  }
}

// dy, x, dx: [rows, heads, d]  rstd: [rows, heads]  w, dw: [d]
void CpuBackend::rmsnorm_backward(ConstTensorView dy_v, ConstTensorView x_v, ConstTensorView rstd_v,
                                  ConstTensorView w_v, TensorView dx_v, TensorView dw_v) {
  const float *dy = dy_v.ptr<float>(), *x = x_v.ptr<float>(), *rstd = rstd_v.ptr<float>(), *w = w_v.ptr<float>();
  float *dx = dx_v.ptr<float>(), *dw = dw_v.ptr<float>();
  const std::int64_t rows = x_v.size(0), heads = x_v.size(1), d = x_v.size(2);
  // dx_j = r * (g_j - x_j * r^2 * sum_i(g_i x_i) / d) with g = dy * w;  dw_j += dy_j * x_j * r.
  // dw is reduced through per-thread partials (fixed order per thread count: deterministic).
  const int T = omp_get_max_threads();
  std::vector<float> partial(static_cast<std::size_t>(T * d), 0.f);
#pragma omp parallel
  {
    float* dwt = partial.data() + static_cast<std::int64_t>(omp_get_thread_num()) * d;
#pragma omp for schedule(static)
    for (std::int64_t v = 0; v < rows * heads; ++v) {
      const float* xv = x + v * d;
      const float* dyv = dy + v * d;
      const float r = rstd[v];
      float gx = 0.f;
      for (std::int64_t c = 0; c < d; ++c) gx += dyv[c] * w[c] * xv[c];
      const float k = r * r * gx / static_cast<float>(d);
      float* dxv = dx + v * d;
      for (std::int64_t c = 0; c < d; ++c) {
        dwt[c] += dyv[c] * xv[c] * r;
        dxv[c] = r * (dyv[c] * w[c] - xv[c] * k);
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (std::int64_t c = 0; c < d; ++c) dw[c] += partial[static_cast<std::size_t>(t * d + c)];
}

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA
