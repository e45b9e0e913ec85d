// DFlash2's grouped dynamic causal convolution (ops/conv.hpp) on the CPU: rows in parallel, the
// channels of a row vectorised, every element's taps summed in the order the header states.
#include <algorithm>

#include "cpu_backend.hpp"

#if defined(_OPENMP)  // (the fuzz project builds without -fopenmp: one thread)
#include <omp.h>
#endif

#include "isa.hpp"  // last (isa.hpp)

namespace diffcp::cpu::DIFFCP_CPU_ISA {

// x: [T, H]  dyn: [T, K, G] (row stride ld)  base: [K, H]  y: [T, H] out
void CpuBackend::dynamic_conv_forward(ConstTensorView x_v, ConstTensorView dyn_v, ConstTensorView base_v,
                                      std::int64_t block, TensorView y_v) {
  const float *x = x_v.ptr<const float>(), *dyn = dyn_v.ptr<const float>(), *base = base_v.ptr<const float>();
  float* y = y_v.ptr<float>();
  const std::int64_t T = x_v.size(0), H = x_v.size(1), K = dyn_v.size(1), G = dyn_v.size(2), gs = H / G;
  const std::int64_t ld = dyn_v.stride[0];
#pragma omp parallel for schedule(static) if (T * H * K > (1 << 16))
  for (std::int64_t t = 0; t < T; ++t) {
    float* yt = y + t * H;
    for (std::int64_t c = 0; c < H; ++c) yt[c] = 0.f;
    const std::int64_t taps = std::min(K, t % block + 1);
    for (std::int64_t o = 0; o < taps; ++o) {
      const float* xs = x + (t - o) * H;
      const float* b = base + o * H;
      const float* d = dyn + t * ld + o * G;
      for (std::int64_t g = 0; g < G; ++g) {
        const float dg = d[g];
        for (std::int64_t c = g * gs; c < (g + 1) * gs; ++c) yt[c] += (b[c] + dg) * xs[c];
      }
    }
  }
}

// dy, x: [T, H]  dyn: [T, K, G]  base: [K, H]  dx: [T, H] out  ddyn: [T, K, G] out  dbase: [K, H] +=
void CpuBackend::dynamic_conv_backward(ConstTensorView dy_v, ConstTensorView x_v, ConstTensorView dyn_v,
                                       ConstTensorView base_v, std::int64_t block, TensorView dx_v, TensorView ddyn_v,
                                       TensorView dbase_v) {
  const float *dy = dy_v.ptr<const float>(), *x = x_v.ptr<const float>(), *dyn = dyn_v.ptr<const float>();
  const float* base = base_v.ptr<const float>();
  float *dx = dx_v.ptr<float>(), *ddyn = ddyn_v.ptr<float>(), *dbase = dbase_v.ptr<float>();
  const std::int64_t T = x_v.size(0), H = x_v.size(1), K = dyn_v.size(1), G = dyn_v.size(2), gs = H / G;
  const std::int64_t ld = dyn_v.stride[0], ld_d = ddyn_v.stride[0];
  const bool par = T * H * K > (1 << 16);
  (void)par;  // (without OpenMP the pragmas are ignored)
  // dx[s, c] = sum over o ascending of (base[o, c] + dyn[s + o, o, g]) dy[s + o, c], s + o in s's block;
  // ddyn[t, o, g] = sum over c of group g ascending of dy[t, c] x[t - o, c] (0 across the block start)
#pragma omp parallel for schedule(static) if (par)
  for (std::int64_t s = 0; s < T; ++s) {
    float* dxs = dx + s * H;
    for (std::int64_t c = 0; c < H; ++c) dxs[c] = 0.f;
    const std::int64_t taps = std::min(K, block - s % block);
    for (std::int64_t o = 0; o < taps; ++o) {
      const float* dyt = dy + (s + o) * H;
      const float* b = base + o * H;
      const float* d = dyn + (s + o) * ld + o * G;
      for (std::int64_t g = 0; g < G; ++g) {
        const float dg = d[g];
        for (std::int64_t c = g * gs; c < (g + 1) * gs; ++c) dxs[c] += (b[c] + dg) * dyt[c];
      }
    }
    const std::int64_t t = s;  // ddyn's row t
    const std::int64_t valid = std::min(K, t % block + 1);
    for (std::int64_t o = 0; o < K; ++o)
      for (std::int64_t g = 0; g < G; ++g) {
        float acc = 0.f;
        if (o < valid)
          for (std::int64_t c = g * gs; c < (g + 1) * gs; ++c) acc += dy[t * H + c] * x[(t - o) * H + c];
        ddyn[t * ld_d + o * G + g] = acc;
      }
  }
  // dbase[o, c] += sum over rows t ascending (o <= p(t)) of dy[t, c] x[t - o, c]: each thread a
  // range of columns, its rows read in order (contiguous, vectorised over c)
#pragma omp parallel if (par)
  {
#if defined(_OPENMP)
    const int n = omp_get_num_threads(), me = omp_get_thread_num();
#else
    const int n = 1, me = 0;
#endif
    const std::int64_t c0 = H * me / n, c1 = H * (me + 1) / n;
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t valid = std::min(K, t % block + 1);
      for (std::int64_t o = 0; o < valid; ++o) {
        float* db = dbase + o * H;
        const float *dyt = dy + t * H, *xs = x + (t - o) * H;
        for (std::int64_t c = c0; c < c1; ++c) db[c] += dyt[c] * xs[c];
      }
    }
  }
}

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA
