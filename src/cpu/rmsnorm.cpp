#include "diffcp/ops/rmsnorm.hpp"

#include <cmath>
#include <vector>

#include <omp.h>

namespace diffcp {

void rmsnorm_forward(const float* x, std::int64_t rows, std::int64_t heads, std::int64_t d, const float* w,
                     float eps, float* y, float* rstd) {
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

void rmsnorm_backward(const float* dy, const float* x, const float* rstd, std::int64_t rows, std::int64_t heads,
                      std::int64_t d, const float* w, float* dx, float* dw) {
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

}  // namespace diffcp
