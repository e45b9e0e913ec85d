// The CUDA backend's element-wise kernels (kernels.hpp). Grid-stride loops over 2-D index spaces;
// each element is computed by one thread with the expression the CPU backend uses (float math,
// expf), so results agree with the CPU's within a few ulps (the op harness's bounds).
#include "kernels.hpp"

#include <cuda_runtime.h>

namespace diffcp::cuda {

namespace {

constexpr int kThreads = 256;

inline cudaStream_t st(Stream s) { return static_cast<cudaStream_t>(s); }

inline unsigned blocks_for(std::int64_t n) {
  const std::int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 * 4 ? 65535 * 4 : b));
}

inline int launched() { return static_cast<int>(cudaGetLastError()); }

// Round to nearest even, NaN kept quiet (as core/half.hpp f32_to_bf16).
__device__ inline std::uint16_t to_bf16(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
__device__ inline float from_bf16(std::uint16_t b) { return __uint_as_float(static_cast<unsigned>(b) << 16); }

template <typename F>
__global__ void each_2d(std::int64_t rows, std::int64_t cols, F f) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    f(i / cols, i % cols);
}

template <typename F>
int launch_2d(std::int64_t rows, std::int64_t cols, Stream s, F f) {
  if (rows <= 0 || cols <= 0) return 0;
  each_2d<<<blocks_for(rows * cols), kThreads, 0, st(s)>>>(rows, cols, f);
  return launched();
}

}  // namespace

int fill_f32(float* x, std::int64_t n, float value, Stream s) {
  return launch_2d(1, n, s, [=] __device__(std::int64_t, std::int64_t c) { x[c] = value; });
}
int fill_bf16(std::uint16_t* x, std::int64_t n, std::uint16_t bits, Stream s) {
  return launch_2d(1, n, s, [=] __device__(std::int64_t, std::int64_t c) { x[c] = bits; });
}
int convert_f32_bf16(const float* src, std::int64_t ld_src, std::uint16_t* dst, std::int64_t ld_dst, std::int64_t rows,
                     std::int64_t cols, Stream s) {
  return launch_2d(rows, cols, s, [=] __device__(std::int64_t r, std::int64_t c) { dst[r * ld_dst + c] = to_bf16(src[r * ld_src + c]); });
}
int convert_bf16_f32(const std::uint16_t* src, std::int64_t ld_src, float* dst, std::int64_t ld_dst, std::int64_t rows,
                     std::int64_t cols, Stream s) {
  return launch_2d(rows, cols, s, [=] __device__(std::int64_t r, std::int64_t c) { dst[r * ld_dst + c] = from_bf16(src[r * ld_src + c]); });
}
int copy_rows(const void* src, std::int64_t ld_src, void* dst, std::int64_t ld_dst, std::int64_t rows, std::int64_t cols,
              int elem_bytes, Stream s) {
  if (rows <= 0 || cols <= 0) return 0;
  const std::size_t w = static_cast<std::size_t>(cols) * elem_bytes;
  return static_cast<int>(cudaMemcpy2DAsync(dst, static_cast<std::size_t>(ld_dst) * elem_bytes, src,
                                            static_cast<std::size_t>(ld_src) * elem_bytes, w, static_cast<std::size_t>(rows),
                                            cudaMemcpyDeviceToDevice, st(s)));
}
int copy_rows_broadcast_f32(const float* src, float* dst, std::int64_t ld_dst, std::int64_t rows, std::int64_t cols, Stream s) {
  return launch_2d(rows, cols, s, [=] __device__(std::int64_t r, std::int64_t c) { dst[r * ld_dst + c] = src[c]; });
}
int copy_rows_broadcast_u16(const std::uint16_t* src, std::uint16_t* dst, std::int64_t ld_dst, std::int64_t rows,
                            std::int64_t cols, Stream s) {
  return launch_2d(rows, cols, s, [=] __device__(std::int64_t r, std::int64_t c) { dst[r * ld_dst + c] = src[c]; });
}
int axpy(float* y, const float* x, float alpha, std::int64_t n, Stream s) {
  if (alpha == 1.f) return launch_2d(1, n, s, [=] __device__(std::int64_t, std::int64_t i) { y[i] += x[i]; });
  return launch_2d(1, n, s, [=] __device__(std::int64_t, std::int64_t i) { y[i] += alpha * x[i]; });
}
int silu(float* x, std::int64_t n, Stream s) {
  return launch_2d(1, n, s, [=] __device__(std::int64_t, std::int64_t i) { x[i] = x[i] / (1.f + expf(-x[i])); });
}
int gelu_tanh(float* x, std::int64_t rows, std::int64_t cols, std::int64_t ld, Stream s) {
  return launch_2d(rows, cols, s, [=] __device__(std::int64_t r, std::int64_t c) {
    const float v = x[r * ld + c], k = 0.7978845608028654f;  // sqrt(2 / pi)
    x[r * ld + c] = 0.5f * v * (1.f + tanhf(k * (v + 0.044715f * v * v * v)));
  });
}
int swiglu_forward(const float* gate, std::int64_t lg, const float* up, std::int64_t lu, float* act, std::int64_t la,
                   std::int64_t rows, std::int64_t cols, Stream s) {
  return launch_2d(rows, cols, s, [=] __device__(std::int64_t r, std::int64_t c) {
    const float g = gate[r * lg + c];
    act[r * la + c] = g * (1.f / (1.f + expf(-g))) * up[r * lu + c];
  });
}
int swiglu_backward(const float* dact, const float* gate, const float* up, float* dgate, float* dup, std::int64_t n,
                    Stream s) {
  return launch_2d(1, n, s, [=] __device__(std::int64_t, std::int64_t i) {
    const float sg = 1.f / (1.f + expf(-gate[i]));
    dup[i] = dact[i] * gate[i] * sg;
    dgate[i] = dact[i] * up[i] * sg * (1.f + gate[i] * (1.f - sg));
  });
}
int bias_add(float* y, const float* b, std::int64_t M, std::int64_t N, Stream s) {
  return launch_2d(M, N, s, [=] __device__(std::int64_t r, std::int64_t c) { y[r * N + c] += b[c]; });
}
int bias_backward(const float* dy, float* db, std::int64_t M, std::int64_t N, Stream s) {
  return launch_2d(1, N, s, [=] __device__(std::int64_t, std::int64_t c) {
    float acc = db[c];
    for (std::int64_t r = 0; r < M; ++r) acc += dy[r * N + c];  // row order, as the CPU's
    db[c] = acc;
  });
}
int scale_f32(float* c, std::int64_t rows, std::int64_t cols, std::int64_t ldc, float beta, Stream s) {
  return launch_2d(rows, cols, s, [=] __device__(std::int64_t r, std::int64_t j) {
    c[r * ldc + j] = beta == 0.f ? 0.f : beta * c[r * ldc + j];
  });
}

int lse_rescale(float* o, std::int64_t rows, std::int64_t heads, std::int64_t dim, std::int64_t ld, const float* lse_p,
                const float* lse, Stream s) {
  return launch_2d(rows * heads, dim, s, [=] __device__(std::int64_t v, std::int64_t c) {
    const float lp = lse_p[v];
    const float wgt = lp == -INFINITY ? 0.f : expf(lp - lse[v]);
    o[(v / heads) * ld + (v % heads) * dim + c] *= wgt;
  });
}
int lse_shift(float* x, const float* m, std::int64_t n, bool to_exp, Stream s) {
  if (to_exp)
    return launch_2d(1, n, s, [=] __device__(std::int64_t, std::int64_t i) { x[i] = m[i] == -INFINITY ? 0.f : expf(x[i] - m[i]); });
  return launch_2d(1, n, s, [=] __device__(std::int64_t, std::int64_t i) {
    x[i] = m[i] == -INFINITY ? -INFINITY : m[i] + logf(x[i]);
  });
}
int attention_delta_f32(const float* do_, std::int64_t ld_do, const float* o, std::int64_t ld_o, float* delta,
                        std::int64_t rows, std::int64_t heads, std::int64_t dim, Stream s) {
  return launch_2d(1, rows * heads, s, [=] __device__(std::int64_t, std::int64_t v) {
    const float* a = do_ + (v / heads) * ld_do + (v % heads) * dim;
    const float* b = o + (v / heads) * ld_o + (v % heads) * dim;
    float acc = 0.f;
    for (std::int64_t c = 0; c < dim; ++c) acc += a[c] * b[c];
    delta[v] = acc;
  });
}
int attention_delta_bf16(const std::uint16_t* do_, std::int64_t ld_do, const std::uint16_t* o, std::int64_t ld_o,
                         float* delta, std::int64_t rows, std::int64_t heads, std::int64_t dim, Stream s) {
  return launch_2d(1, rows * heads, s, [=] __device__(std::int64_t, std::int64_t v) {
    const std::uint16_t* a = do_ + (v / heads) * ld_do + (v % heads) * dim;
    const std::uint16_t* b = o + (v / heads) * ld_o + (v % heads) * dim;
    float acc = 0.f;
    for (std::int64_t c = 0; c < dim; ++c) acc += from_bf16(a[c]) * from_bf16(b[c]);
    delta[v] = acc;
  });
}
int rmsnorm_forward(const float* x, const float* w, float eps, float* y, float* rstd, std::int64_t v, std::int64_t d,
                    Stream s) {
  return launch_2d(1, v, s, [=] __device__(std::int64_t, std::int64_t i) {
    const float* xv = x + i * d;
    float ss = 0.f;
    for (std::int64_t c = 0; c < d; ++c) ss += xv[c] * xv[c];
    const float r = 1.f / sqrtf(ss / static_cast<float>(d) + eps);
    rstd[i] = r;
    float* yv = y + i * d;
    for (std::int64_t c = 0; c < d; ++c) yv[c] = xv[c] * r * w[c];
  });
}
int rmsnorm_backward(const float* dy, const float* x, const float* rstd, const float* w, float* dx, float* dw,
                     std::int64_t v, std::int64_t d, Stream s) {
  // dw first (it reads dy, which dx may overwrite), one thread per column over the vectors in order.
  int e = launch_2d(1, d, s, [=] __device__(std::int64_t, std::int64_t c) {
    float acc = 0.f;
    for (std::int64_t i = 0; i < v; ++i) acc += dy[i * d + c] * x[i * d + c] * rstd[i];
    dw[c] += acc;
  });
  if (e != 0) return e;
  return launch_2d(1, v, s, [=] __device__(std::int64_t, std::int64_t i) {
    const float* xv = x + i * d;
    const float* dyv = dy + i * d;
    const float r = rstd[i];
    float gx = 0.f;
    for (std::int64_t c = 0; c < d; ++c) gx += dyv[c] * w[c] * xv[c];
    const float k = r * r * gx / static_cast<float>(d);
    float* dxv = dx + i * d;
    for (std::int64_t c = 0; c < d; ++c) dxv[c] = r * (dyv[c] * w[c] - xv[c] * k);
  });
}
int gated_add(float* x, const float* gate, const float* y, std::int64_t ldy, std::int64_t rows, std::int64_t H, Stream s) {
  return launch_2d(rows, H, s, [=] __device__(std::int64_t r, std::int64_t c) { x[r * H + c] += gate[c] * y[r * ldy + c]; });
}
int layernorm_modulate(const float* x, const float* shift, const float* scale, float eps, float* y, std::int64_t rows,
                       std::int64_t H, Stream s) {
  return launch_2d(1, rows, s, [=] __device__(std::int64_t, std::int64_t r) {
    const float* xr = x + r * H;
    float* yr = y + r * H;
    double sum = 0;
    for (std::int64_t c = 0; c < H; ++c) sum += xr[c];
    const float m = static_cast<float>(sum / static_cast<double>(H));
    double q = 0;
    for (std::int64_t c = 0; c < H; ++c) q += static_cast<double>(xr[c] - m) * (xr[c] - m);
    const float rstd = 1.f / sqrtf(static_cast<float>(q / static_cast<double>(H)) + eps);
    for (std::int64_t c = 0; c < H; ++c) yr[c] = (1.f + scale[c]) * ((xr[c] - m) * rstd) + shift[c];
  });
}

namespace {
// One block: out[0] = sum of x^2 in double (strided partial sums, then a tree in shared memory).
__global__ void sumsq_one_block(const float* x, std::int64_t n, double* out) {
  __shared__ double part[kThreads];
  double acc = 0;
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += static_cast<double>(x[i]) * x[i];
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[0] = part[0];
}
}  // namespace

int scale_sumsq(float* x, std::int64_t n, double scale, double* out, Stream s) {
  const int e = launch_2d(1, n, s, [=] __device__(std::int64_t, std::int64_t i) {
    x[i] = static_cast<float>(static_cast<double>(x[i]) * scale);
  });
  if (e != 0) return e;
  sumsq_one_block<<<1, kThreads, 0, st(s)>>>(x, n, out);
  return launched();
}

int adamw_step(float* p, const float* g, float* m, float* v, std::int64_t n, float b1, float b2, float step,
               float inv_sqrt_c2, float eps, float decay, Stream s) {
  return launch_2d(1, n, s, [=] __device__(std::int64_t, std::int64_t i) {
    const float mi = b1 * m[i] + (1.f - b1) * g[i];
    const float vi = b2 * v[i] + (1.f - b2) * g[i] * g[i];
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - step * mi / (sqrtf(vi) * inv_sqrt_c2 + eps);
  });
}

}  // namespace diffcp::cuda
