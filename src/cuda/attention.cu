// The CUDA block-sparse attention (attention.hpp). One warp per (query row, query head): the
// query (and, backward, dO) row in shared memory, the block's visible key ranges walked 32 keys at
// a time, lane j scoring key j (a dot over d against the shared row), online softmax in base 2
// across the chunks, and the lanes then own the head's dimensions (lane + 32 c) for the P V
// (dQ, dK, dV) updates, so those loads and stores are coalesced.
#include "attention.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace diffcp::cuda {

namespace {

constexpr int kWarps = 4;  // warps per CTA: 4 (row, head) items
constexpr int kLanes = 32;
constexpr int kMaxPerLane = static_cast<int>(kMaxHeadDim / kLanes);  // head dims per lane
constexpr unsigned kFull = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ inline float load(const float* p, std::int64_t i) { return p[i]; }
__device__ inline float load(const std::uint16_t* p, std::int64_t i) { return __uint_as_float(static_cast<unsigned>(p[i]) << 16); }
__device__ inline void store(float* p, std::int64_t i, float x) { p[i] = x; }
// Round to nearest even, NaN kept quiet (core/half.hpp's f32_to_bf16).
__device__ inline void store(std::uint16_t* p, std::int64_t i, float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    p[i] = static_cast<std::uint16_t>((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  p[i] = static_cast<std::uint16_t>(u >> 16);
}

__device__ inline float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFull, x, o));
  return x;
}
__device__ inline float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
  return x;
}

// KeyWindow::sees (attention/mask.hpp).
__device__ inline bool sees(const AttentionDims& a, std::int64_t qpos, std::int64_t y) {
  if (a.causal && y > qpos) return false;
  return a.window == 0 || (qpos - y < a.window && (a.causal || y - qpos < a.window));
}

// The (row, head) item of this warp, and where its block's ranges are.
struct Item {
  std::int64_t row, head, kvh, qpos, r_begin, r_end;
  const std::int64_t* ranges;
};
__device__ inline bool item_of(const AttentionDims& a, const std::int64_t* plan, Item& it) {
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / kLanes;
  if (item >= a.Q * a.n_q) return false;
  it.row = item / a.n_q;
  it.head = item % a.n_q;
  it.kvh = it.head / (a.n_q / a.n_kv);
  const std::int64_t blk = it.row / a.B;
  it.qpos = plan[blk] + it.row % a.B;
  const std::int64_t* off = plan + a.N;
  it.r_begin = off[blk];
  it.r_end = off[blk + 1];
  it.ranges = plan + 2 * a.N + 1;
  return true;
}

// sum_c x[c] * y[c] for c < d: x in shared memory (one row), y a row of global memory.
template <typename T>
__device__ inline float dot(const float* x, const T* y, std::int64_t d) {
  float acc = 0.f;
  for (std::int64_t c = 0; c < d; ++c) acc += x[c] * load(y, c);
  return acc;
}

template <typename T>
__global__ void __launch_bounds__(kWarps * kLanes)
    forward_kernel(AttentionDims a, const T* q, const T* k, const T* v, T* o, float* lse, const std::int64_t* plan) {
  extern __shared__ float smem[];  // [kWarps, d]: each warp's scaled query row
  Item it;
  if (!item_of(a, plan, it)) return;  // whole warps only: no CTA-wide barrier below
  const int lane = threadIdx.x % kLanes;
  const std::int64_t d = a.d;
  float* qs = smem + (threadIdx.x / kLanes) * d;
  const float c = a.scale * kLog2e;  // scores in base 2: s = c q.k, p = 2^(s - m)
  for (std::int64_t e = lane; e < d; e += kLanes) qs[e] = c * load(q, it.row * a.ld_q + it.head * d + e);
  __syncwarp();
  float acc[kMaxPerLane];
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) acc[e] = 0.f;
  float m = -INFINITY, l = 0.f;
  for (std::int64_t r = it.r_begin; r < it.r_end; ++r) {
    const std::int64_t begin = it.ranges[3 * r], end = it.ranges[3 * r + 1], pos = it.ranges[3 * r + 2];
    for (std::int64_t j0 = begin; j0 < end; j0 += kLanes) {
      const std::int64_t j = j0 + lane;
      const bool valid = j < end && sees(a, it.qpos, pos + (j - begin));
      const float s = valid ? dot(qs, k + j * a.ld_k + it.kvh * d, d) : -INFINITY;
      const float mx = fmaxf(m, warp_max(s));
      if (mx == -INFINITY) continue;  // nothing visible yet (the warp agrees)
      const float p = valid ? exp2f(s - mx) : 0.f;
      const float alpha = exp2f(m - mx);  // m = -inf: 0
      l = l * alpha + warp_sum(p);
      m = mx;
      const int n = static_cast<int>(end - j0 < kLanes ? end - j0 : kLanes);
#pragma unroll
      for (int e = 0; e < kMaxPerLane; ++e) acc[e] *= alpha;
      for (int t = 0; t < n; ++t) {
        const float pt = __shfl_sync(kFull, p, t);
        if (pt == 0.f) continue;  // the warp agrees
        const T* vr = v + (j0 + t) * a.ld_v + it.kvh * d;
#pragma unroll
        for (int e = 0; e < kMaxPerLane; ++e)
          if (lane + e * kLanes < d) acc[e] += pt * load(vr, lane + e * kLanes);
      }
    }
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e)
    if (lane + e * kLanes < d) store(o, it.row * a.ld_o + it.head * d + lane + e * kLanes, acc[e] * inv);
  if (lane == 0) lse[it.row * a.n_q + it.head] = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
}

// dQ of one (query row, head): the forward's walk, with P = 2^(c q.k - lse log2 e) from the global
// lse and dS = P (dP - D); dQ = scale sum dS k.
template <typename T>
__global__ void __launch_bounds__(kWarps * kLanes)
    dq_kernel(AttentionDims a, const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,
              T* dq, const std::int64_t* plan) {
  extern __shared__ float smem[];  // [kWarps, 2, d]: each warp's query row and dO row
  Item it;
  if (!item_of(a, plan, it)) return;
  const int lane = threadIdx.x % kLanes;
  const std::int64_t d = a.d;
  float* qs = smem + (threadIdx.x / kLanes) * 2 * d;
  float* dos = qs + d;
  for (std::int64_t e = lane; e < d; e += kLanes) {
    qs[e] = load(q, it.row * a.ld_q + it.head * d + e);
    dos[e] = load(dout, it.row * a.ld_do + it.head * d + e);
  }
  __syncwarp();
  const float c = a.scale * kLog2e;
  const float l0 = lse[it.row * a.n_q + it.head];
  const float lse2 = isfinite(l0) ? l0 * kLog2e : INFINITY;  // a row that saw no key: P = 0
  const float D = delta[it.row * a.n_q + it.head];
  float acc[kMaxPerLane];  // dQ / scale
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) acc[e] = 0.f;
  for (std::int64_t r = it.r_begin; r < it.r_end; ++r) {
    const std::int64_t begin = it.ranges[3 * r], end = it.ranges[3 * r + 1], pos = it.ranges[3 * r + 2];
    for (std::int64_t j0 = begin; j0 < end; j0 += kLanes) {
      const std::int64_t j = j0 + lane;
      const bool valid = j < end && sees(a, it.qpos, pos + (j - begin));
      float ds = 0.f;
      if (valid) {
        const float p = exp2f(c * dot(qs, k + j * a.ld_k + it.kvh * d, d) - lse2);
        ds = p * (dot(dos, v + j * a.ld_v + it.kvh * d, d) - D);  // dS = P (dP - D)
      }
      const int n = static_cast<int>(end - j0 < kLanes ? end - j0 : kLanes);
      for (int t = 0; t < n; ++t) {
        const float dst = __shfl_sync(kFull, ds, t);
        if (dst == 0.f) continue;  // the warp agrees
        const T* krow = k + (j0 + t) * a.ld_k + it.kvh * d;
#pragma unroll
        for (int e = 0; e < kMaxPerLane; ++e)
          if (lane + e * kLanes < d) acc[e] += dst * load(krow, lane + e * kLanes);
      }
    }
  }
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e)
    if (lane + e * kLanes < d) store(dq, it.row * a.ld_dq + it.head * d + lane + e * kLanes, a.scale * acc[e]);
}

// dK, dV of one (key row j, kv head h): the blocks that see the key (the key plan), 32 of a block's
// G B query rows at a time, lane t scoring its row against the key (P and dS as dq_kernel), then
// the lanes own the head's dimensions: dV = sum P dO, dK = scale sum dS q.
template <typename T>
__global__ void __launch_bounds__(kWarps * kLanes)
    dkdv_kernel(AttentionDims a, const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,
                T* dk, T* dv, const std::int64_t* plan, const std::int64_t* key_plan) {
  extern __shared__ float smem[];  // [kWarps, 2, d]: each warp's K row and V row
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / kLanes;
  if (item >= a.L_k * a.n_kv) return;  // whole warps only
  const std::int64_t j = item / a.n_kv, h = item % a.n_kv, d = a.d, G = a.n_q / a.n_kv, GB = G * a.B;
  const int lane = threadIdx.x % kLanes;
  float* ks = smem + (threadIdx.x / kLanes) * 2 * d;
  float* vs = ks + d;
  for (std::int64_t e = lane; e < d; e += kLanes) {
    ks[e] = load(k, j * a.ld_k + h * d + e);
    vs[e] = load(v, j * a.ld_v + h * d + e);
  }
  __syncwarp();
  float acc_k[kMaxPerLane], acc_v[kMaxPerLane];  // dK / scale, dV
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) acc_k[e] = acc_v[e] = 0.f;
  // The segment holding row j: the first whose end is past j.
  const std::int64_t n_seg = key_plan[0];
  const std::int64_t* seg = key_plan + 1;
  const std::int64_t* blocks = seg + 5 * n_seg;
  std::int64_t lo = 0, hi = n_seg;
  while (lo < hi) {
    const std::int64_t mid = (lo + hi) / 2;
    if (seg[5 * mid + 1] <= j) lo = mid + 1;
    else hi = mid;
  }
  const float c = a.scale * kLog2e;
  if (lo < n_seg && seg[5 * lo] <= j) {
    const std::int64_t* sg = seg + 5 * lo;
    const std::int64_t y = sg[2] + (j - sg[0]);  // the key's position
    for (std::int64_t b = sg[3]; b < sg[3] + sg[4]; ++b) {
      const std::int64_t i = blocks[b], anchor = plan[i];
      for (std::int64_t t0 = 0; t0 < GB; t0 += kLanes) {
        const std::int64_t t = t0 + lane;  // tile row t = g B + r: query row i B + r, head h G + g
        float p = 0.f, ds = 0.f;
        if (t < GB && sees(a, anchor + t % a.B, y)) {
          const std::int64_t row = i * a.B + t % a.B, head = h * G + t / a.B, st = row * a.n_q + head;
          const float l0 = lse[st];
          const float lse2 = isfinite(l0) ? l0 * kLog2e : INFINITY;
          p = exp2f(c * dot(ks, q + row * a.ld_q + head * d, d) - lse2);
          ds = p * (dot(vs, dout + row * a.ld_do + head * d, d) - delta[st]);
        }
        const int n = static_cast<int>(GB - t0 < kLanes ? GB - t0 : kLanes);
        for (int u = 0; u < n; ++u) {
          const float pu = __shfl_sync(kFull, p, u), dsu = __shfl_sync(kFull, ds, u);
          if (pu == 0.f && dsu == 0.f) continue;  // the warp agrees
          const std::int64_t tu = t0 + u, row = i * a.B + tu % a.B, head = h * G + tu / a.B;
          const T* qr = q + row * a.ld_q + head * d;
          const T* dor = dout + row * a.ld_do + head * d;
#pragma unroll
          for (int e = 0; e < kMaxPerLane; ++e)
            if (lane + e * kLanes < d) {
              acc_k[e] += dsu * load(qr, lane + e * kLanes);
              acc_v[e] += pu * load(dor, lane + e * kLanes);
            }
        }
      }
    }
  }
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e)
    if (lane + e * kLanes < d) {
      store(dk, j * a.ld_dk + h * d + lane + e * kLanes, a.scale * acc_k[e]);
      store(dv, j * a.ld_dv + h * d + lane + e * kLanes, acc_v[e]);
    }
}

unsigned ctas(const AttentionDims& a) { return static_cast<unsigned>((a.Q * a.n_q + kWarps - 1) / kWarps); }

}  // namespace

int attention_forward(bool bf16, const void* q, const void* k, const void* v, void* o, float* lse,
                      const std::int64_t* plan, const AttentionDims& a, Stream s) {
  if (a.Q * a.n_q == 0) return 0;
  const std::size_t smem = sizeof(float) * kWarps * static_cast<std::size_t>(a.d);
  const auto st = static_cast<cudaStream_t>(s);
  if (bf16)
    forward_kernel<std::uint16_t><<<ctas(a), kWarps * kLanes, smem, st>>>(
        a, static_cast<const std::uint16_t*>(q), static_cast<const std::uint16_t*>(k),
        static_cast<const std::uint16_t*>(v), static_cast<std::uint16_t*>(o), lse, plan);
  else
    forward_kernel<float><<<ctas(a), kWarps * kLanes, smem, st>>>(a, static_cast<const float*>(q), static_cast<const float*>(k),
                                                                 static_cast<const float*>(v), static_cast<float*>(o), lse, plan);
  return static_cast<int>(cudaGetLastError());
}

int attention_backward(bool bf16, const void* q, const void* k, const void* v, const void* do_, const float* lse,
                       const float* delta, void* dq, void* dk, void* dv, const std::int64_t* plan,
                       const std::int64_t* key_plan, const AttentionDims& a, Stream s) {
  const std::size_t smem = sizeof(float) * kWarps * 2 * static_cast<std::size_t>(a.d);
  const auto st = static_cast<cudaStream_t>(s);
  const unsigned key_ctas = static_cast<unsigned>((a.L_k * a.n_kv + kWarps - 1) / kWarps);
  using U = std::uint16_t;
  if (a.Q * a.n_q > 0) {
    if (bf16)
      dq_kernel<U><<<ctas(a), kWarps * kLanes, smem, st>>>(a, static_cast<const U*>(q), static_cast<const U*>(k),
                                                           static_cast<const U*>(v), static_cast<const U*>(do_), lse,
                                                           delta, static_cast<U*>(dq), plan);
    else
      dq_kernel<float><<<ctas(a), kWarps * kLanes, smem, st>>>(
          a, static_cast<const float*>(q), static_cast<const float*>(k), static_cast<const float*>(v),
          static_cast<const float*>(do_), lse, delta, static_cast<float*>(dq), plan);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return static_cast<int>(e);
  }
  if (key_ctas > 0) {
    if (bf16)
      dkdv_kernel<U><<<key_ctas, kWarps * kLanes, smem, st>>>(a, static_cast<const U*>(q), static_cast<const U*>(k),
                                                              static_cast<const U*>(v), static_cast<const U*>(do_), lse,
                                                              delta, static_cast<U*>(dk), static_cast<U*>(dv), plan,
                                                              key_plan);
    else
      dkdv_kernel<float><<<key_ctas, kWarps * kLanes, smem, st>>>(
          a, static_cast<const float*>(q), static_cast<const float*>(k), static_cast<const float*>(v),
          static_cast<const float*>(do_), lse, delta, static_cast<float*>(dk), static_cast<float*>(dv), plan, key_plan);
  }
  return static_cast<int>(cudaGetLastError());
}

namespace {

template <typename P_T>
__global__ void __launch_bounds__(kWarps * kLanes)
    masked_softmax_kernel(AttentionDims a, const float* S, P_T* P, std::int64_t r0, std::int64_t rc, std::int64_t L,
                          const std::int64_t* spans, std::int64_t n_spans, const std::int64_t* plan, float* lse,
                          float* inv_l) {
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / kLanes;
  if (item >= a.n_q * rc) return;  // whole warps only
  const std::int64_t hq = item / rc, r = item % rc, row = r0 + r, blk = row / a.B;
  const std::int64_t qpos = plan[blk] + row % a.B, rb = plan[a.N + blk], re = plan[a.N + blk + 1];
  const std::int64_t* ranges = plan + 2 * a.N + 1;
  const int lane = threadIdx.x % kLanes;
  const float* srow = S + (hq * rc + r) * L;
  P_T* prow = P + (hq * rc + r) * L;
  // Whether this row sees key row j (its block's ranges, then the window).
  const auto visible = [&](std::int64_t j) {
    for (std::int64_t q = rb; q < re; ++q) {
      const std::int64_t* g = ranges + 3 * q;
      if (j >= g[0] && j < g[1]) return sees(a, qpos, g[2] + (j - g[0]));
    }
    return false;
  };
  float m = -INFINITY;
  for (std::int64_t sp = 0; sp < n_spans; ++sp) {
    const std::int64_t* g = spans + 3 * sp;
    for (std::int64_t j = g[0] + lane; j < g[1]; j += kLanes)
      if (visible(j)) m = fmaxf(m, srow[g[2] + (j - g[0])]);
  }
  m = warp_max(m);
  float l = 0.f;
  for (std::int64_t sp = 0; sp < n_spans; ++sp) {
    const std::int64_t* g = spans + 3 * sp;
    for (std::int64_t j = g[0] + lane; j < g[1]; j += kLanes) {
      const std::int64_t c = g[2] + (j - g[0]);
      const float p = m != -INFINITY && visible(j) ? exp2f(srow[c] - m) : 0.f;
      l += p;
      store(prow, c, p);  // (f32: P is S; each element is read before this lane writes it)
    }
  }
  l = warp_sum(l);
  if (lane == 0) {
    lse[row * a.n_q + hq] = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
    inv_l[r * a.n_q + hq] = l > 0.f ? 1.f / l : 0.f;
  }
}

template <typename T>
__global__ void scale_rows_kernel(const float* O, const float* inv_l, T* o, std::int64_t r0, std::int64_t rc, AttentionDims a) {
  const std::int64_t w = a.n_q * a.d, n = rc * w;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = e / w, c = e % w;
    store(o, (r0 + r) * a.ld_o + c, O[e] * inv_l[r * a.n_q + c / a.d]);
  }
}

}  // namespace

int masked_softmax(bool bf16, const float* S, void* P, std::int64_t r0, std::int64_t rc, std::int64_t L,
                   const std::int64_t* spans, std::int64_t n_spans, const std::int64_t* plan, float* lse, float* inv_l,
                   const AttentionDims& a, Stream s) {
  if (a.n_q * rc == 0) return 0;
  const unsigned grid = static_cast<unsigned>((a.n_q * rc + kWarps - 1) / kWarps);
  const auto st = static_cast<cudaStream_t>(s);
  if (bf16)
    masked_softmax_kernel<std::uint16_t><<<grid, kWarps * kLanes, 0, st>>>(a, S, static_cast<std::uint16_t*>(P), r0, rc, L,
                                                                         spans, n_spans, plan, lse, inv_l);
  else
    masked_softmax_kernel<float><<<grid, kWarps * kLanes, 0, st>>>(a, S, static_cast<float*>(P), r0, rc, L, spans, n_spans,
                                                                  plan, lse, inv_l);
  return static_cast<int>(cudaGetLastError());
}

int scale_rows(bool bf16, const float* O, const float* inv_l, void* o, std::int64_t r0, std::int64_t rc,
               const AttentionDims& a, Stream s) {
  const std::int64_t n = rc * a.n_q * a.d;
  if (n == 0) return 0;
  const unsigned grid = static_cast<unsigned>(std::min<std::int64_t>((n + 255) / 256, 65535 * 8));
  const auto st = static_cast<cudaStream_t>(s);
  if (bf16)
    scale_rows_kernel<std::uint16_t><<<grid, 256, 0, st>>>(O, inv_l, static_cast<std::uint16_t*>(o), r0, rc, a);
  else
    scale_rows_kernel<float><<<grid, 256, 0, st>>>(O, inv_l, static_cast<float*>(o), r0, rc, a);
  return static_cast<int>(cudaGetLastError());
}

namespace {

__global__ void __launch_bounds__(kWarps * kLanes)
    masked_probs_kernel(AttentionDims a, const float* lse, float* S, std::uint16_t* Pb, std::int64_t r0, std::int64_t rc,
                        std::int64_t L, const std::int64_t* spans, std::int64_t n_spans, const std::int64_t* plan) {
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / kLanes;
  if (item >= a.n_q * rc) return;  // whole warps only
  const std::int64_t hq = item / rc, r = item % rc, row = r0 + r, blk = row / a.B;
  const std::int64_t qpos = plan[blk] + row % a.B, rb = plan[a.N + blk], re = plan[a.N + blk + 1];
  const std::int64_t* ranges = plan + 2 * a.N + 1;
  const int lane = threadIdx.x % kLanes;
  const float l0 = lse[row * a.n_q + hq];
  const float lse2 = isfinite(l0) ? l0 * kLog2e : INFINITY;  // a row that saw no key: P = 0
  float* srow = S + (hq * rc + r) * L;
  for (std::int64_t sp = 0; sp < n_spans; ++sp) {
    const std::int64_t* g = spans + 3 * sp;
    for (std::int64_t j = g[0] + lane; j < g[1]; j += kLanes) {
      bool vis = false;
      for (std::int64_t q = rb; q < re && !vis; ++q) {
        const std::int64_t* rg = ranges + 3 * q;
        if (j >= rg[0] && j < rg[1]) vis = sees(a, qpos, rg[2] + (j - rg[0]));
      }
      const std::int64_t c = g[2] + (j - g[0]);
      const float p = vis ? exp2f(srow[c] - lse2) : 0.f;
      srow[c] = p;
      if (Pb != nullptr) store(Pb + (hq * rc + r) * L, c, p);
    }
  }
}

__global__ void softmax_grad_kernel(AttentionDims a, const float* P, float* dP, std::uint16_t* dSb, const float* delta,
                                    std::int64_t r0, std::int64_t rc, std::int64_t L) {
  const std::int64_t n = a.n_q * rc * L;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t hq = e / (rc * L), r = (e / L) % rc;
    const float ds = P[e] * (dP[e] - delta[(r0 + r) * a.n_q + hq]);
    dP[e] = ds;
    if (dSb != nullptr) store(dSb, e, ds);
  }
}

}  // namespace

int masked_probs(const float* lse, float* S, std::uint16_t* Pb, std::int64_t r0, std::int64_t rc, std::int64_t L,
                 const std::int64_t* spans, std::int64_t n_spans, const std::int64_t* plan, const AttentionDims& a,
                 Stream s) {
  if (a.n_q * rc == 0) return 0;
  const unsigned grid = static_cast<unsigned>((a.n_q * rc + kWarps - 1) / kWarps);
  masked_probs_kernel<<<grid, kWarps * kLanes, 0, static_cast<cudaStream_t>(s)>>>(a, lse, S, Pb, r0, rc, L, spans, n_spans,
                                                                                plan);
  return static_cast<int>(cudaGetLastError());
}

int softmax_grad(const float* P, float* dP, std::uint16_t* dSb, const float* delta, std::int64_t r0, std::int64_t rc,
                 std::int64_t L, const AttentionDims& a, Stream s) {
  const std::int64_t n = a.n_q * rc * L;
  if (n == 0) return 0;
  const unsigned grid = static_cast<unsigned>(std::min<std::int64_t>((n + 255) / 256, 65535 * 8));
  softmax_grad_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(s)>>>(a, P, dP, dSb, delta, r0, rc, L);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace diffcp::cuda
