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
int gelu(float* x, std::int64_t rows, std::int64_t cols, std::int64_t ld, Stream s) {
  return launch_2d(rows, cols, s, [=] __device__(std::int64_t r, std::int64_t c) {
    const float v = x[r * ld + c];
    x[r * ld + c] = 0.5f * v * (1.f + erff(v * 0.7071067811865476f));  // 1 / sqrt(2)
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
namespace {
// RMSNorm, one warp per vector of d (the drafter's hidden rows, the heads' d_h): lane partial
// sums over a warp tree.
__device__ inline float warp_total(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__global__ void rmsnorm_forward_rows(const float* x, const float* w, float eps, float* y, float* rstd, std::int64_t v,
                                     std::int64_t d) {
  const std::int64_t i = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) / 32;
  if (i >= v) return;  // whole warps
  const int lane = threadIdx.x % 32;
  const float* xv = x + i * d;
  float ss = 0.f;
  for (std::int64_t c = lane; c < d; c += 32) ss += xv[c] * xv[c];
  const float r = 1.f / sqrtf(warp_total(ss) / static_cast<float>(d) + eps);
  if (lane == 0) rstd[i] = r;
  float* yv = y + i * d;  // (may alias x: each element is read before its lane writes it)
  for (std::int64_t c = lane; c < d; c += 32) yv[c] = xv[c] * r * w[c];
}
__global__ void rmsnorm_backward_rows(const float* dy, const float* x, const float* rstd, const float* w, float* dx,
                                      std::int64_t v, std::int64_t d) {
  const std::int64_t i = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) / 32;
  if (i >= v) return;  // whole warps
  const int lane = threadIdx.x % 32;
  const float* xv = x + i * d;
  const float* dyv = dy + i * d;
  const float r = rstd[i];
  float gx = 0.f;
  for (std::int64_t c = lane; c < d; c += 32) gx += dyv[c] * w[c] * xv[c];
  const float k = r * r * warp_total(gx) / static_cast<float>(d);
  float* dxv = dx + i * d;  // (may alias dy: read before written, per element and lane)
  for (std::int64_t c = lane; c < d; c += 32) dxv[c] = r * (dyv[c] * w[c] - xv[c] * k);
}
unsigned warp_blocks(std::int64_t n) { return static_cast<unsigned>((n + kThreads / 32 - 1) / (kThreads / 32)); }
}  // namespace

int rmsnorm_forward(const float* x, const float* w, float eps, float* y, float* rstd, std::int64_t v, std::int64_t d,
                    Stream s) {
  if (v <= 0 || d <= 0) return 0;
  rmsnorm_forward_rows<<<warp_blocks(v), kThreads, 0, st(s)>>>(x, w, eps, y, rstd, v, d);
  return launched();
}
int rmsnorm_backward(const float* dy, const float* x, const float* rstd, const float* w, float* dx, float* dw,
                     std::int64_t v, std::int64_t d, Stream s) {
  // dw first (it reads dy, which dx may overwrite), one thread per column over the vectors in order.
  int e = launch_2d(1, d, s, [=] __device__(std::int64_t, std::int64_t c) {
    float acc = 0.f;
    for (std::int64_t i = 0; i < v; ++i) acc += dy[i * d + c] * x[i * d + c] * rstd[i];
    dw[c] += acc;
  });
  if (e != 0 || v <= 0) return e;
  rmsnorm_backward_rows<<<warp_blocks(v), kThreads, 0, st(s)>>>(dy, x, rstd, w, dx, v, d);
  return launched();
}
int gated_add(float* x, const float* gate, const float* y, std::int64_t ldy, std::int64_t rows, std::int64_t H, Stream s) {
  return launch_2d(rows, H, s, [=] __device__(std::int64_t r, std::int64_t c) { x[r * H + c] += gate[c] * y[r * ldy + c]; });
}
namespace {
// One warp per row (the DiT's rows are H = 768 .. 6144 wide): the mean, then the centred variance
// (no cancellation), each a sum of lane partials over a warp tree, in f32 as the CPU's lane sums.
__global__ void layernorm_modulate_rows(const float* x, const float* shift, const float* scale, float eps, float* y,
                                        std::int64_t rows, std::int64_t H) {
  const std::int64_t r = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) / 32;
  if (r >= rows) return;  // whole warps
  const int lane = threadIdx.x % 32;
  const float* xr = x + r * H;
  float s = 0.f;
  for (std::int64_t c = lane; c < H; c += 32) s += xr[c];
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const float m = s / static_cast<float>(H);
  float q = 0.f;
  for (std::int64_t c = lane; c < H; c += 32) q += (xr[c] - m) * (xr[c] - m);
  for (int o = 16; o > 0; o >>= 1) q += __shfl_xor_sync(0xffffffffu, q, o);
  const float rstd = 1.f / sqrtf(q / static_cast<float>(H) + eps);
  float* yr = y + r * H;
  for (std::int64_t c = lane; c < H; c += 32) yr[c] = (1.f + scale[c]) * ((xr[c] - m) * rstd) + shift[c];
}
}  // namespace

int layernorm_modulate(const float* x, const float* shift, const float* scale, float eps, float* y, std::int64_t rows,
                       std::int64_t H, Stream s) {
  if (rows <= 0 || H <= 0) return 0;
  const std::int64_t warps_per_block = kThreads / 32;
  layernorm_modulate_rows<<<static_cast<unsigned>((rows + warps_per_block - 1) / warps_per_block), kThreads, 0, st(s)>>>(
      x, shift, scale, eps, y, rows, H);
  return launched();
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

int lse_merge(const std::int64_t* parts, std::int64_t P, float* o, std::int64_t ld, float* lse, std::int64_t rows,
              std::int64_t heads, std::int64_t dim, Stream s) {
  return launch_2d(1, rows * heads, s, [=] __device__(std::int64_t, std::int64_t v) {
    const std::int64_t r = v / heads, h = v % heads;
    const auto part_lse = [&](std::int64_t p) { return reinterpret_cast<const float*>(parts[3 * p + 2])[v]; };
    float mx = -INFINITY;
    for (std::int64_t p = 0; p < P; ++p) mx = fmaxf(mx, part_lse(p));
    float* dst = o + r * ld + h * dim;
    for (std::int64_t c = 0; c < dim; ++c) dst[c] = 0.f;
    if (mx == -INFINITY) {
      lse[v] = -INFINITY;
      return;
    }
    float sum = 0.f;
    for (std::int64_t p = 0; p < P; ++p) sum += expf(part_lse(p) - mx);
    const float merged = mx + logf(sum);
    lse[v] = merged;
    for (std::int64_t p = 0; p < P; ++p) {
      const float wgt = expf(part_lse(p) - merged);
      const float* src = reinterpret_cast<const float*>(parts[3 * p]) + r * parts[3 * p + 1] + h * dim;
      for (std::int64_t c = 0; c < dim; ++c) dst[c] += wgt * src[c];
    }
  });
}

int rope(float* x, const float* cs, const float* sn, std::int64_t rows, std::int64_t heads, std::int64_t d, float sign,
         Stream s) {
  const std::int64_t half = d / 2;
  return launch_2d(rows * heads, half, s, [=] __device__(std::int64_t v, std::int64_t i) {
    const std::int64_t r = v / heads;
    float* x0 = x + v * d;
    const float a = x0[i], b = x0[i + half], c = cs[r * half + i], si = sign * sn[r * half + i];
    x0[i] = a * c - b * si;
    x0[i + half] = b * c + a * si;
  });
}

int qk_norm_rope(float* qkv, std::int64_t ld, std::int64_t rows, std::int64_t heads, std::int64_t d, const float* q_scale,
                 const float* k_scale, float eps, const float* cs, const float* sn, bool across_heads, Stream s) {
  // One thread per (row, head), or per (row, q | k) across heads (its norm spans the row's heads).
  const std::int64_t parts = across_heads ? 2 : 2 * heads, span = across_heads ? heads * d : d;
  return launch_2d(rows, parts, s, [=] __device__(std::int64_t r, std::int64_t part) {
    const bool is_q = across_heads ? part == 0 : part < heads;
    float* x = qkv + r * ld + part * span;
    const float* w = is_q ? q_scale : k_scale;
    float ss = 0.f;
    for (std::int64_t c = 0; c < span; ++c) ss += x[c] * x[c];
    const float rstd = 1.f / sqrtf(ss / static_cast<float>(span) + eps);
    for (std::int64_t c = 0; c < span; ++c) x[c] = x[c] * rstd * w[c];
    if (cs == nullptr) return;
    for (std::int64_t k = 0; k < span / 2; ++k) {  // pairs of each head: k % (d/2) is the head's pair
      const std::int64_t j = k % (d / 2);
      const float x0 = x[2 * k], x1 = x[2 * k + 1], c = cs[r * (d / 2) + j], si = sn[r * (d / 2) + j];
      x[2 * k] = c * x0 - si * x1;
      x[2 * k + 1] = si * x0 + c * x1;
    }
  });
}

int move_rows(const void* src, std::int64_t ld_src, int src_bytes, void* dst, std::int64_t ld_dst, int dst_bytes,
              const std::int64_t* idx, std::int64_t M, std::int64_t n, std::int64_t w, bool scatter, Stream s) {
  return launch_2d(n, w, s, [=] __device__(std::int64_t i, std::int64_t c) {
    if (idx[i] < 0 || idx[i] >= M) return;  // a device row list is not checked on the host: skip
    const std::int64_t from = (scatter ? i : idx[i]) * ld_src + c, to = (scatter ? idx[i] : i) * ld_dst + c;
    if (src_bytes == 4 && dst_bytes == 2)
      static_cast<std::uint16_t*>(dst)[to] = to_bf16(static_cast<const float*>(src)[from]);
    else if (src_bytes == 2 && dst_bytes == 4)
      static_cast<float*>(dst)[to] = from_bf16(static_cast<const std::uint16_t*>(src)[from]);
    else if (src_bytes == 4)
      static_cast<float*>(dst)[to] = static_cast<const float*>(src)[from];
    else if (src_bytes == 2)
      static_cast<std::uint16_t*>(dst)[to] = static_cast<const std::uint16_t*>(src)[from];
    else
      static_cast<std::uint8_t*>(dst)[to] = static_cast<const std::uint8_t*>(src)[from];
  });
}

namespace {
// Per source s (one block): the tokens flagged active, in ascending order, packed into active[s, :]
// (a block-wide prefix count over chunks of blockDim.x tokens: a ballot per warp, the warps' counts
// scanned by thread 0).
__global__ void compact_active(const std::int32_t* flags, std::int64_t n, std::int64_t k, std::int32_t* active) {
  __shared__ int warp_base[32];
  __shared__ int base, chunk;
  const std::int64_t s = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  for (std::int64_t t0 = 0; t0 < n; t0 += blockDim.x) {
    const std::int64_t t = t0 + threadIdx.x;
    const bool on = t < n && flags[s * n + t] != 0;
    const unsigned m = __ballot_sync(0xffffffffu, on);
    if (lane == 0) warp_base[warp] = __popc(m);
    __syncthreads();
    if (threadIdx.x == 0) {
      int acc = 0;
      for (int w = 0; w < warps; ++w) {
        const int c = warp_base[w];
        warp_base[w] = acc;
        acc += c;
      }
      chunk = acc;
    }
    __syncthreads();
    const int at = base + warp_base[warp] + __popc(m & ((1u << lane) - 1u));
    if (on && at < k) active[s * k + at] = static_cast<std::int32_t>(t);
    __syncthreads();
    if (threadIdx.x == 0) base += chunk;
    __syncthreads();
  }
}
}  // namespace

int select_active(const float* parts, std::int64_t lanes, std::int64_t S, std::int64_t n, std::int64_t k,
                  std::int32_t* active, double* scratch, Stream s) {
  if (S <= 0 || n <= 0 || k <= 0) return 0;
  double* d = scratch;                                               // [S, n]
  std::int32_t* flags = reinterpret_cast<std::int32_t*>(d + S * n);  // [S, n]
  const std::int64_t n_c = n - k;
  int rc = launch_2d(S, n, s, [=] __device__(std::int64_t src, std::int64_t t) {
    double acc = 0;
    for (std::int64_t lane = 0; lane < lanes; ++lane) acc += parts[(lane * S + src) * n + t];
    d[src * n + t] = acc;
  });
  if (rc != 0) return rc;
  // rank of t in the order (d, t), a NaN after every number: the n_c first stay cached
  rc = launch_2d(S, n, s, [=] __device__(std::int64_t src, std::int64_t t) {
    const double* ds = d + src * n;
    const double x = ds[t];
    const bool xn = isnan(x);
    std::int64_t rank = 0;
    for (std::int64_t u = 0; u < n; ++u) {
      const double y = ds[u];
      const bool yn = isnan(y);
      rank += yn != xn ? !yn : (!xn && y != x ? y < x : u < t);
    }
    flags[src * n + t] = rank >= n_c;
  });
  if (rc != 0) return rc;
  compact_active<<<static_cast<unsigned>(S), 1024, 0, st(s)>>>(flags, n, k, active);
  return launched();
}

int token_rows(const std::int32_t* active, std::int64_t S, std::int64_t k, const std::int64_t* map, std::int64_t n,
               std::int64_t B, std::int64_t stride, std::int64_t* rows, Stream s) {
  return launch_2d(B, k, s, [=] __device__(std::int64_t b, std::int64_t a) {
    const std::int32_t t = active[(b % S) * k + a];
    rows[b * k + a] = t < 0 || t >= n ? -1 : b * stride + (map ? map[t] : t);  // -1: skipped by move_rows
  });
}

int l1_distance(const void* a, const void* b, bool bf16, float* out, std::int64_t G, std::int64_t R, std::int64_t w,
                Stream s) {
  return launch_2d(1, R, s, [=] __device__(std::int64_t, std::int64_t r) {
    double acc = 0;
    for (std::int64_t g = 0; g < G; ++g)
      for (std::int64_t i = 0; i < w; ++i) {
        const std::int64_t e = (g * R + r) * w + i;
        const float x = bf16 ? from_bf16(static_cast<const std::uint16_t*>(a)[e]) : static_cast<const float*>(a)[e];
        const float y = bf16 ? from_bf16(static_cast<const std::uint16_t*>(b)[e]) : static_cast<const float*>(b)[e];
        acc += fabsf(x - y);
      }
    out[r] = static_cast<float>(acc);
  });
}

int guidance_combine(float* v, const float* neg, float scale, bool keep_norm, std::int64_t rows, std::int64_t C, Stream s) {
  return launch_2d(1, rows, s, [=] __device__(std::int64_t, std::int64_t r) {
    float* y = v + r * C;
    const float* n = neg + r * C;
    double cond2 = 0, comb2 = 0;
    for (std::int64_t c = 0; c < C; ++c) {
      const float comb = n[c] + scale * (y[c] - n[c]);
      cond2 += static_cast<double>(y[c]) * y[c];
      comb2 += static_cast<double>(comb) * comb;
      y[c] = comb;
    }
    if (!keep_norm || comb2 == 0) return;  // a zero row (padding) stays zero
    const float f = static_cast<float>(sqrt(cond2) / sqrt(comb2));
    for (std::int64_t c = 0; c < C; ++c) y[c] *= f;
  });
}

namespace {
// One block per row: max with its first index, then sum exp(l - max) in double (a tree over the
// threads' strided partial sums), then dlogits when weight is given.
__device__ inline double map_slope(double y, float mult, float cap) {
  if (cap == 0.f) return mult;
  const double t = y / cap;
  return mult * (1.0 - t * t);
}

__global__ void cross_entropy_rows(float* logits, std::int64_t ld, std::int64_t n, std::int64_t v0,
                                   const std::int32_t* target, double* stats, const double* weight, float mult,
                                   float cap) {
  __shared__ float best_v[kThreads];
  __shared__ std::int64_t best_i[kThreads];
  __shared__ double part[kThreads];
  const std::int64_t row = blockIdx.x;
  float* lg = logits + row * ld;
  const int t = threadIdx.x;
  float bv = -INFINITY;
  std::int64_t bi = n;  // none yet
  for (std::int64_t v = t; v < n; v += kThreads)
    if (bi == n || lg[v] > bv) bv = lg[v], bi = v;  // strided: ascending v, so ties keep the first
  best_v[t] = bv;
  best_i[t] = bi;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (t < w) {
      const float ov = best_v[t + w];
      const std::int64_t oi = best_i[t + w];
      if (oi < n && (best_i[t] == n || ov > best_v[t] || (ov == best_v[t] && oi < best_i[t]))) best_v[t] = ov, best_i[t] = oi;
    }
    __syncthreads();
  }
  const double mx = best_v[0];
  double acc = 0;
  for (std::int64_t v = t; v < n; v += kThreads) acc += exp(static_cast<double>(lg[v]) - mx);
  part[t] = acc;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (t < w) part[t] += part[t + w];
    __syncthreads();
  }
  const std::int64_t tg = target[row];
  const double sum = part[0];
  if (t == 0) {
    double* st = stats + 4 * row;
    st[0] = mx;
    st[1] = sum;
    st[2] = static_cast<double>(v0 + best_i[0]);
    st[3] = tg >= v0 && tg < v0 + n ? static_cast<double>(lg[tg - v0]) : 0.0;
  }
  if (weight == nullptr) return;
  __syncthreads();  // every thread has read the logits it needs
  const double w = weight[row], lse = mx + log(sum);
  for (std::int64_t v = t; v < n; v += kThreads) {
    const double y = lg[v];
    lg[v] = static_cast<float>(map_slope(y, mult, cap) * (w * (exp(y - lse) - (v0 + v == tg ? 1.0 : 0.0))));
  }
}

// (a, ia) ranks before (b, ib): the larger value, then the lower id; a NaN after every number.
__device__ inline bool ranks_before(float a, std::int64_t ia, float b, std::int64_t ib) {
  if (isnan(a) || isnan(b)) return !isnan(a) || (isnan(b) && ia < ib);
  return a > b || (a == b && ia < ib);
}

// One block per row: pass j picks the best element ranked after pass j - 1's pick (a tree over the
// threads' strided bests), so the picks come out in rank order.
__global__ void top_k_rows(const float* logits, std::int64_t ld, std::int64_t n, std::int64_t v0, std::int64_t k,
                           float* values, std::int32_t* ids) {
  __shared__ float best_v[kThreads];
  __shared__ std::int64_t best_i[kThreads];
  const std::int64_t row = blockIdx.x;
  const float* lg = logits + row * ld;
  const int t = threadIdx.x;
  float prev_v = 0.f;
  std::int64_t prev_i = -1;  // none yet
  for (std::int64_t j = 0; j < k; ++j) {
    float bv = 0.f;
    std::int64_t bi = n;  // none
    for (std::int64_t v = t; v < n; v += kThreads)
      if ((prev_i < 0 || ranks_before(prev_v, prev_i, lg[v], v)) && (bi == n || ranks_before(lg[v], v, bv, bi))) bv = lg[v], bi = v;
    best_v[t] = bv;
    best_i[t] = bi;
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w /= 2) {
      if (t < w) {
        const float ov = best_v[t + w];
        const std::int64_t oi = best_i[t + w];
        if (oi < n && (best_i[t] == n || ranks_before(ov, oi, best_v[t], best_i[t]))) best_v[t] = ov, best_i[t] = oi;
      }
      __syncthreads();
    }
    prev_v = best_v[0];
    prev_i = best_i[0];
    if (t == 0) {
      values[row * k + j] = prev_v;
      ids[row * k + j] = static_cast<std::int32_t>(v0 + prev_i);
    }
    __syncthreads();  // every thread has read this pass's pick before the next pass writes
  }
}
}  // namespace

int cross_entropy(float* logits, std::int64_t ld, std::int64_t R, std::int64_t n, std::int64_t v0, const std::int32_t* target,
                  double* stats, const double* weight, float mult, float cap, Stream s) {
  if (R <= 0 || n <= 0) return 0;
  cross_entropy_rows<<<static_cast<unsigned>(R), kThreads, 0, st(s)>>>(logits, ld, n, v0, target, stats, weight, mult,
                                                                        cap);
  return launched();
}
int cross_entropy_backward(float* logits, std::int64_t ld, std::int64_t R, std::int64_t n, std::int64_t v0,
                           const std::int32_t* target, const double* weight, const double* lse, float mult, float cap,
                           const std::int32_t* ids, const double* grad, std::int64_t k, double* add, Stream s) {
  // the extras' terms at their y first (the dense pass overwrites it), then added in id order per row
  int rc = launch_2d(R, k, s, [=] __device__(std::int64_t r, std::int64_t j) {
    const std::int64_t c = ids[r * k + j] - v0;
    add[r * k + j] = c >= 0 && c < n ? map_slope(logits[r * ld + c], mult, cap) * grad[r * k + j] : 0.0;
  });
  if (rc != 0) return rc;
  rc = launch_2d(R, n, s, [=] __device__(std::int64_t r, std::int64_t v) {
    float& l = logits[r * ld + v];
    const double y = l;
    l = static_cast<float>(map_slope(y, mult, cap) * (weight[r] * (exp(y - lse[r]) - (v0 + v == target[r] ? 1.0 : 0.0))));
  });
  if (rc != 0) return rc;
  return launch_2d(R, k > 0 ? 1 : 0, s, [=] __device__(std::int64_t r, std::int64_t) {
    for (std::int64_t j = 0; j < k; ++j) {  // one thread per row: repeated ids add up
      const std::int64_t c = ids[r * k + j] - v0;
      if (c >= 0 && c < n) logits[r * ld + c] = static_cast<float>(static_cast<double>(logits[r * ld + c]) + add[r * k + j]);
    }
  });
}
int logit_map(float* logits, std::int64_t ld, std::int64_t R, std::int64_t n, float mult, float cap, Stream s) {
  return launch_2d(R, n, s, [=] __device__(std::int64_t r, std::int64_t v) {
    float& y = logits[r * ld + v];
    y = cap > 0.f ? cap * tanhf(mult * y / cap) : mult * y;
  });
}
int top_k(const float* logits, std::int64_t ld, std::int64_t R, std::int64_t n, std::int64_t v0, std::int64_t k,
          float* values, std::int32_t* ids, Stream s) {
  if (R <= 0 || k <= 0) return 0;
  top_k_rows<<<static_cast<unsigned>(R), kThreads, 0, st(s)>>>(logits, ld, n, v0, k, values, ids);
  return launched();
}

namespace {
constexpr float kE4M3Max = 448.f;
// ops/fp8.hpp's e4m3_from_float / e4m3_to_float.
__device__ inline std::uint8_t e4m3_code(float y) {
  const unsigned bits = __float_as_uint(y);
  const std::uint8_t sign = static_cast<std::uint8_t>((bits >> 24) & 0x80u);
  const float a = fabsf(y);
  if (!(a < kE4M3Max)) return sign | 0x7Eu;
  const unsigned ab = bits & 0x7FFFFFFFu;
  if (ab < (121u << 23)) return sign | static_cast<std::uint8_t>(rintf(a * 512.f));
  const unsigned r = (ab + 0x7FFFFu + ((ab >> 20) & 1u)) >> 20;
  return sign | static_cast<std::uint8_t>(r - (120u << 3));
}
__device__ inline float e4m3_value(std::uint8_t c) {
  const int e = (c >> 3) & 0xF, m = c & 7;
  const float v = e == 15 && m == 7 ? __int_as_float(0x7fc00000) : e == 0 ? ldexpf(static_cast<float>(m), -9)
                                                                          : ldexpf(static_cast<float>(8 + m), e - 10);
  return (c & 0x80) ? -v : v;
}
}  // namespace

int fp8_encode(const void* x, bool bf16, std::uint8_t* enc, std::int64_t n, std::int64_t d, Stream s) {
  return launch_2d(1, n, s, [=] __device__(std::int64_t, std::int64_t b) {
    const auto value = [&](std::int64_t i) {
      return bf16 ? from_bf16(static_cast<const std::uint16_t*>(x)[b * d + i]) : static_cast<const float*>(x)[b * d + i];
    };
    float amax = 0.f;
    for (std::int64_t i = 0; i < d; ++i) {  // NaN propagates: the block decodes to NaN
      const float a = fabsf(value(i));
      if (a > amax || isnan(a)) amax = a;
    }
    const float sc = amax / kE4M3Max;
    std::uint8_t* e = enc + b * (d + 4);
    const unsigned sb = __float_as_uint(sc);
    for (int k = 0; k < 4; ++k) e[k] = static_cast<std::uint8_t>(sb >> (8 * k));  // little-endian f32, as memcpy
    for (std::int64_t i = 0; i < d; ++i)  // (x / s with x's sign, as the CPU: inf / inf is NaN)
      e[4 + i] = sc == 0.f ? 0 : e4m3_code(copysignf(fabsf(value(i) / sc), value(i)));
  });
}
int fp8_decode(const std::uint8_t* enc, void* x, bool bf16, std::int64_t n, std::int64_t d, Stream s) {
  return launch_2d(n, d, s, [=] __device__(std::int64_t b, std::int64_t i) {
    const std::uint8_t* e = enc + b * (d + 4);
    const float sc = __uint_as_float(static_cast<unsigned>(e[0]) | static_cast<unsigned>(e[1]) << 8 |
                                     static_cast<unsigned>(e[2]) << 16 | static_cast<unsigned>(e[3]) << 24);
    const float v = e4m3_value(e[4 + i]) * sc;
    if (bf16)
      static_cast<std::uint16_t*>(x)[b * d + i] = to_bf16(v);
    else
      static_cast<float*>(x)[b * d + i] = v;
  });
}

int bias_add_rows(float* y, std::int64_t ldy, const float* b, std::int64_t M, std::int64_t N, Stream s) {
  return launch_2d(M, N, s, [=] __device__(std::int64_t r, std::int64_t c) { y[r * ldy + c] += b[c]; });
}

// ---- DFlash2's grouped dynamic causal convolution (ops/conv.hpp) ----
int dynamic_conv_forward(const float* x, const float* dyn, std::int64_t ld, const float* base, std::int64_t T,
                         std::int64_t H, std::int64_t K, std::int64_t G, std::int64_t block, float* y, Stream s) {
  const std::int64_t gs = H / G;
  return launch_2d(T, H, s, [=] __device__(std::int64_t t, std::int64_t c) {
    float acc = 0.f;
    const std::int64_t taps = t % block + 1 < K ? t % block + 1 : K;
    for (std::int64_t o = 0; o < taps; ++o) acc += (base[o * H + c] + dyn[t * ld + o * G + c / gs]) * x[(t - o) * H + c];
    y[t * H + c] = acc;
  });
}

int dynamic_conv_backward(const float* dy, const float* x, const float* dyn, std::int64_t ld, const float* base,
                          std::int64_t T, std::int64_t H, std::int64_t K, std::int64_t G, std::int64_t block, float* dx,
                          float* ddyn, std::int64_t ld_d, float* dbase, Stream s) {
  const std::int64_t gs = H / G;
  int rc = launch_2d(T, H, s, [=] __device__(std::int64_t r, std::int64_t c) {
    float acc = 0.f;
    const std::int64_t taps = block - r % block < K ? block - r % block : K;
    for (std::int64_t o = 0; o < taps; ++o)
      acc += (base[o * H + c] + dyn[(r + o) * ld + o * G + c / gs]) * dy[(r + o) * H + c];
    dx[r * H + c] = acc;
  });
  if (rc != 0) return rc;
  rc = launch_2d(T, K * G, s, [=] __device__(std::int64_t t, std::int64_t j) {
    const std::int64_t o = j / G, g = j % G;
    float acc = 0.f;
    if (o <= t % block)
      for (std::int64_t c = g * gs; c < (g + 1) * gs; ++c) acc += dy[t * H + c] * x[(t - o) * H + c];
    ddyn[t * ld_d + j] = acc;
  });
  if (rc != 0) return rc;
  return launch_2d(K, H, s, [=] __device__(std::int64_t o, std::int64_t c) {
    float acc = dbase[o * H + c];
    for (std::int64_t t = 0; t < T; ++t)
      if (o <= t % block) acc += dy[t * H + c] * x[(t - o) * H + c];
    dbase[o * H + c] = acc;
  });
}

}  // namespace diffcp::cuda
