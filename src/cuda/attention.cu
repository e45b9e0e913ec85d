// The CUDA block-sparse attention (attention.hpp). One warp per (query row, query head): the
// query (and, backward, dO) row in shared memory, the block's visible key ranges walked 32 keys at
// a time, lane j scoring key j (a dot over d against the shared row), online softmax in base 2
// across the chunks, and the lanes then own the head's dimensions (lane + 32 c) for the P V
// (dQ, dK, dV) updates, so those loads and stores are coalesced.
#include "attention.hpp"

#include <cuda_runtime.h>

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

template <typename T>
__global__ void __launch_bounds__(kWarps * kLanes)
    backward_kernel(AttentionDims a, const T* q, const T* k, const T* v, const T* dout, const float* lse,
                    const float* delta, T* dq, float* dk, float* dv, const std::int64_t* plan) {
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
      float p = 0.f, ds = 0.f;
      if (valid) {
        p = exp2f(c * dot(qs, k + j * a.ld_k + it.kvh * d, d) - lse2);
        ds = p * (dot(dos, v + j * a.ld_v + it.kvh * d, d) - D);  // dS = P (dP - D)
      }
      const int n = static_cast<int>(end - j0 < kLanes ? end - j0 : kLanes);
      for (int t = 0; t < n; ++t) {
        const float pt = __shfl_sync(kFull, p, t), dst = __shfl_sync(kFull, ds, t);
        if (pt == 0.f && dst == 0.f) continue;  // the warp agrees
        const std::int64_t kr = j0 + t;
        const T* krow = k + kr * a.ld_k + it.kvh * d;
        float* dkr = dk + kr * a.ld_dk + it.kvh * d;
        float* dvr = dv + kr * a.ld_dv + it.kvh * d;
#pragma unroll
        for (int e = 0; e < kMaxPerLane; ++e) {
          const std::int64_t x = lane + e * kLanes;
          if (x < d) {
            acc[e] += dst * load(krow, x);         // dQ += scale dS K
            atomicAdd(dkr + x, a.scale * dst * qs[x]);  // dK += scale dS^T q
            atomicAdd(dvr + x, pt * dos[x]);        // dV += P^T dO
          }
        }
      }
    }
  }
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e)
    if (lane + e * kLanes < d) store(dq, it.row * a.ld_dq + it.head * d + lane + e * kLanes, a.scale * acc[e]);
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
                       const float* delta, void* dq, float* dk_acc, float* dv_acc, const std::int64_t* plan,
                       const AttentionDims& a, Stream s) {
  if (a.Q * a.n_q == 0) return 0;
  const std::size_t smem = sizeof(float) * kWarps * 2 * static_cast<std::size_t>(a.d);
  const auto st = static_cast<cudaStream_t>(s);
  if (bf16)
    backward_kernel<std::uint16_t><<<ctas(a), kWarps * kLanes, smem, st>>>(
        a, static_cast<const std::uint16_t*>(q), static_cast<const std::uint16_t*>(k),
        static_cast<const std::uint16_t*>(v), static_cast<const std::uint16_t*>(do_), lse, delta,
        static_cast<std::uint16_t*>(dq), dk_acc, dv_acc, plan);
  else
    backward_kernel<float><<<ctas(a), kWarps * kLanes, smem, st>>>(
        a, static_cast<const float*>(q), static_cast<const float*>(k), static_cast<const float*>(v),
        static_cast<const float*>(do_), lse, delta, static_cast<float*>(dq), dk_acc, dv_acc, plan);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace diffcp::cuda
