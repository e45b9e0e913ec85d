// CPU row-wise DiT ops (ops/elementwise.hpp, dit/ops.hpp's qk_norm_rope): OpenMP over rows, each
// row computed alone (a row's result does not depend on how many rows a rank holds).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <numeric>
#include <vector>

#include "diffcp/core/error.hpp"
#include "diffcp/core/half.hpp"

#include "cpu_backend.hpp"
#include "isa.hpp"  // last (isa.hpp)

namespace diffcp::cpu::DIFFCP_CPU_ISA {

// x: [n] in place
void CpuBackend::silu(TensorView x_v) {
  float* x = x_v.ptr<float>();
  const std::int64_t n = x_v.numel();
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) x[i] = x[i] / (1.f + std::exp(-x[i]));
}

// The drafter's SwiGLU, sigmoid(g) = 1 / (1 + exp(-g)), evaluated as the drafter always did
// (the same expression per element whatever the split: any thread count gives the same bits).
//   gate, up, act: [n]
// gate, up, act: [n], or [rows, cols] each with its own row stride (act may be gate, in place)
void CpuBackend::swiglu_forward(ConstTensorView gate_v, ConstTensorView up_v, TensorView act_v) {
  const float *g = gate_v.ptr<float>(), *u = up_v.ptr<float>();
  float* a = act_v.ptr<float>();
  if (act_v.rank == 1) {
    const std::int64_t n = act_v.numel();
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n; ++i) a[i] = g[i] * (1.f / (1.f + std::exp(-g[i]))) * u[i];
    return;
  }
  const std::int64_t rows = act_v.size(0), cols = act_v.size(1);
  const std::int64_t lg = gate_v.stride[0], lu = up_v.stride[0], la = act_v.stride[0];
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      const float x = g[r * lg + c];
      a[r * la + c] = x * (1.f / (1.f + std::exp(-x))) * u[r * lu + c];
    }
}

// dact, gate, up, dgate, dup: [n]; d/dg silu(g) = s (1 + g (1 - s)), s = sigmoid(g).
void CpuBackend::swiglu_backward(ConstTensorView dact_v, ConstTensorView gate_v, ConstTensorView up_v, TensorView dgate_v,
                                 TensorView dup_v) {
  const float *d = dact_v.ptr<float>(), *g = gate_v.ptr<float>(), *u = up_v.ptr<float>();
  float *dg = dgate_v.ptr<float>(), *du = dup_v.ptr<float>();
  const std::int64_t n = dact_v.numel();
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    const float s = 1.f / (1.f + std::exp(-g[i]));
    du[i] = d[i] * g[i] * s;
    dg[i] = d[i] * u[i] * s * (1.f + g[i] * (1.f - s));
  }
}

// y, x: [n]
void CpuBackend::add(TensorView y_v, ConstTensorView x_v, float alpha) {
  float* y = y_v.ptr<float>();
  const float* x = x_v.ptr<float>();
  const std::int64_t n = y_v.numel();
  if (alpha == 1.f) {
#pragma omp parallel for simd schedule(static)
    for (std::int64_t i = 0; i < n; ++i) y[i] += x[i];
  } else {
#pragma omp parallel for simd schedule(static)
    for (std::int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
  }
}

// v, v_neg: [rows, C] contiguous
void CpuBackend::guidance_combine(TensorView v_v, ConstTensorView neg_v, float scale, bool keep_norm) {
  float* v = v_v.ptr<float>();
  const float* neg = neg_v.ptr<float>();
  const std::int64_t rows = v_v.shape[0], C = v_v.shape[1];
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    float* y = v + r * C;
    const float* n = neg + r * C;
    double cond2 = 0, comb2 = 0;
    for (std::int64_t c = 0; c < C; ++c) {
      const float comb = n[c] + scale * (y[c] - n[c]);
      cond2 += static_cast<double>(y[c]) * y[c];
      comb2 += static_cast<double>(comb) * comb;
      y[c] = comb;
    }
    if (!keep_norm || comb2 == 0) continue;  // a zero row (padding) stays zero, not 0/0
    const float f = static_cast<float>(std::sqrt(cond2) / std::sqrt(comb2));
    for (std::int64_t c = 0; c < C; ++c) y[c] *= f;
  }
}

// x: [n] = value (f32 or bf16)
void CpuBackend::fill(TensorView x_v, float value) {
  const std::int64_t n = x_v.numel();
  if (x_v.dtype == DType::bf16) {
    const bf16_t v{f32_to_bf16(value)};
    bf16_t* x = x_v.ptr<bf16_t>();
#pragma omp parallel for schedule(static) if (n > (1 << 15))
    for (std::int64_t i = 0; i < n; ++i) x[i] = v;
    return;
  }
  float* x = x_v.ptr<float>();
#pragma omp parallel for simd schedule(static) if (n > (1 << 15))
  for (std::int64_t i = 0; i < n; ++i) x[i] = value;
}

// src -> dst: [n], or [rows, cols] with row strides: f32 -> bf16 (round to nearest even), bf16 ->
// f32, or a copy. OpenMP over 64k-element pieces of the rows, from 32k elements on.
void CpuBackend::convert(ConstTensorView src, TensorView dst) {
  const bool flat = src.is_contiguous() && dst.is_contiguous();
  const std::int64_t rows = flat || src.rank < 2 ? 1 : src.size(0), cols = flat || src.rank < 2 ? src.numel() : src.size(1);
  const std::int64_t ld_src = flat || src.rank < 2 ? 0 : src.stride[0], ld_dst = flat || src.rank < 2 ? 0 : dst.stride[0];
  const std::int64_t piece = 1 << 16, pieces = (cols + piece - 1) / piece, es = src.element_size(),
                     ed = dst.element_size();
#pragma omp parallel for collapse(2) schedule(static) if (rows * cols > (1 << 15))
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < pieces; ++c) {
      const std::int64_t i = c * piece, m = std::min(piece, cols - i);
      const char* from = static_cast<const char*>(src.data) + (r * ld_src + i) * es;
      char* to = static_cast<char*>(dst.data) + (r * ld_dst + i) * ed;
      if (src.dtype == dst.dtype) {
        std::memcpy(to, from, static_cast<std::size_t>(m * es));
      } else if (dst.dtype == DType::bf16) {
        simd::to_bf16(reinterpret_cast<const float*>(from), reinterpret_cast<std::uint16_t*>(to), m);
      } else {
        simd::to_f32(reinterpret_cast<const std::uint16_t*>(from), reinterpret_cast<float*>(to), m);
      }
    }
  }
}

namespace {
// n elements from `from` (dtype f) to `to` (dtype t): a copy, or f32 <-> bf16.
void convert_n(const void* from, DType f, void* to, DType t, std::int64_t n) {
  if (f == t)
    std::memcpy(to, from, static_cast<std::size_t>(n) * dtype_size(f));
  else if (t == DType::bf16)
    simd::to_bf16(static_cast<const float*>(from), static_cast<std::uint16_t*>(to), n);
  else
    simd::to_f32(static_cast<const std::uint16_t*>(from), static_cast<float*>(to), n);
}
}  // namespace

namespace {
inline float value_of(float x) { return x; }
inline float value_of(bf16_t x) { return bf16_to_f32(x.bits); }
template <typename T>
void l1_rows(const T* a, const T* b, std::int64_t G, std::int64_t R, std::int64_t w, float* out) {
#pragma omp parallel for schedule(static) if (G * R * w > (1 << 15))
  for (std::int64_t r = 0; r < R; ++r) {
    double s = 0;
    for (std::int64_t g = 0; g < G; ++g) {
      const T* x = a + (g * R + r) * w;
      const T* y = b + (g * R + r) * w;
      for (std::int64_t i = 0; i < w; ++i) s += std::abs(value_of(x[i]) - value_of(y[i]));
    }
    out[r] = static_cast<float>(s);
  }
}
}  // namespace

// a, b: [G, R, w], out: [R]
void CpuBackend::l1_distance(ConstTensorView a, ConstTensorView b, TensorView out) {
  const std::int64_t G = a.size(0), R = a.size(1), w = a.size(2);
  if (a.dtype == DType::bf16)
    l1_rows(a.ptr<const bf16_t>(), b.ptr<const bf16_t>(), G, R, w, out.ptr<float>());
  else
    l1_rows(a.ptr<const float>(), b.ptr<const float>(), G, R, w, out.ptr<float>());
}

namespace {
// rows: [n] i64 (host metadata or device memory: both are this process's memory here), each in [0, M)
const std::int64_t* checked_rows(const char* op, const ConstTensorView& rows, std::int64_t M) {
  DIFFCP_CHECK(rows.dtype == DType::i64 && rows.is_contiguous(), op, ": rows ", rows.describe(), ", expected [n] i64");
  const std::int64_t* r = rows.ptr<const std::int64_t>();
  for (std::int64_t i = 0; i < rows.numel(); ++i)
    DIFFCP_CHECK(r[i] >= 0 && r[i] < M, op, ": row ", r[i], " outside [0, ", M, ")");
  return r;
}
}  // namespace

// src: [M, w], rows: [n], dst: [n, w]: dst[i] = src[rows[i]]
void CpuBackend::gather_rows(ConstTensorView src, ConstTensorView rows_v, TensorView dst) {
  const std::int64_t* rows = checked_rows("gather_rows", rows_v, src.size(0));
  const std::int64_t n = rows_v.numel(), w = dst.size(1);
  const std::size_t es = src.element_size(), ed = dst.element_size();
#pragma omp parallel for schedule(static) if (n * w > (1 << 15))
  for (std::int64_t i = 0; i < n; ++i)
    convert_n(static_cast<const char*>(src.data) + rows[i] * src.stride[0] * es, src.dtype,
              static_cast<char*>(dst.data) + i * dst.stride[0] * ed, dst.dtype, w);
}

// src: [n, w], rows: [n], dst: [M, w]: dst[rows[i]] = src[i]
void CpuBackend::scatter_rows(ConstTensorView src, ConstTensorView rows_v, TensorView dst) {
  const std::int64_t* rows = checked_rows("scatter_rows", rows_v, dst.size(0));
  const std::int64_t n = rows_v.numel(), w = src.size(1);
  const std::size_t es = src.element_size(), ed = dst.element_size();
#pragma omp parallel for schedule(static) if (n * w > (1 << 15))
  for (std::int64_t i = 0; i < n; ++i)
    convert_n(static_cast<const char*>(src.data) + i * src.stride[0] * es, src.dtype,
              static_cast<char*>(dst.data) + rows[i] * dst.stride[0] * ed, dst.dtype, w);
}

// parts: [lanes, S, n] f32  active: [S, k] i32 out (dit/ops.hpp select_active)
void CpuBackend::select_active(ConstTensorView parts, TensorView active_v) {
  const std::int64_t lanes = parts.size(0), S = parts.size(1), n = parts.size(2), k = active_v.size(1);
  const std::int64_t n_c = n - k;
  const float* p = parts.ptr<const float>();
  std::int32_t* active = active_v.ptr<std::int32_t>();
  std::vector<double> d(static_cast<std::size_t>(n));
  std::vector<std::int32_t> order(static_cast<std::size_t>(n));
  // (d, t) ascending, a NaN after every number: a total order, so the choice is one set
  const auto first = [&d](std::int32_t a, std::int32_t b) {
    const bool na = std::isnan(d[static_cast<std::size_t>(a)]), nb = std::isnan(d[static_cast<std::size_t>(b)]);
    if (na != nb) return nb;
    if (!na && d[static_cast<std::size_t>(a)] != d[static_cast<std::size_t>(b)])
      return d[static_cast<std::size_t>(a)] < d[static_cast<std::size_t>(b)];
    return a < b;
  };
  for (std::int64_t s = 0; s < S; ++s) {
    for (std::int64_t t = 0; t < n; ++t) {
      double acc = 0;
      for (std::int64_t lane = 0; lane < lanes; ++lane) acc += p[(lane * S + s) * n + t];
      d[static_cast<std::size_t>(t)] = acc;
    }
    std::iota(order.begin(), order.end(), 0);
    std::nth_element(order.begin(), order.begin() + n_c, order.end(), first);
    std::sort(order.begin() + n_c, order.end());
    std::copy(order.begin() + n_c, order.end(), active + s * k);
  }
}

// active: [S, k] i32  map: [n] i64 or none  rows: [B, k] i64 out (dit/ops.hpp token_rows)
void CpuBackend::token_rows(ConstTensorView active_v, ConstTensorView map_v, std::int64_t n, std::int64_t stride,
                            TensorView rows_v) {
  const std::int64_t S = active_v.size(0), k = active_v.size(1), B = rows_v.size(0);
  const std::int32_t* active = active_v.ptr<const std::int32_t>();
  const std::int64_t* map = map_v.rank == 0 ? nullptr : map_v.ptr<const std::int64_t>();
  std::int64_t* rows = rows_v.ptr<std::int64_t>();
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t a = 0; a < k; ++a) {
      const std::int32_t t = active[(b % S) * k + a];
      DIFFCP_CHECK(t >= 0 && t < n, "token_rows: token ", t, " outside [0, ", n, ")");
      rows[b * k + a] = b * stride + (map ? map[t] : t);
    }
}

// x: [rows, cols] (row stride ld) in place
void CpuBackend::gelu_tanh(TensorView x_v) {
  float* x = x_v.ptr<float>();
  const std::int64_t rows = x_v.size(0), cols = x_v.size(1), ld = x_v.stride[0];
  // 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)) = x / (1 + 2^(-2 u log2(e))), u = k (x + 0.044715 x^3);
  // 2^ on the SIMD layer (isa.hpp: as a plain loop, GCC did not vectorise it for AVX2).
  const float k = static_cast<float>(std::sqrt(2.0 / std::numbers::pi)), m = -2.f * std::numbers::log2e_v<float> * k;
  using namespace simd;
  const auto gelu = [m](vf v) { return v / (1.f + simd::exp2(m * (v + 0.044715f * v * v * v))); };
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = x + r * ld;
    std::int64_t c = 0;
    for (; c + kLanes <= cols; c += kLanes) store(row + c, gelu(load(row + c)));
    if (c < cols) store_part(row + c, gelu(load_part(row + c, cols - c, 0.f)), cols - c);
  }
}

// x: [rows, cols] (row stride ld) in place; the erf in fp32 per element (a small op: Wan I2V's image
// embedder runs it once per call on its 257 context tokens)
void CpuBackend::gelu(TensorView x_v) {
  float* x = x_v.ptr<float>();
  const std::int64_t rows = x_v.size(0), cols = x_v.size(1), ld = x_v.stride[0];
  const float r2 = static_cast<float>(1.0 / std::numbers::sqrt2);
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      const float v = x[r * ld + c];
      x[r * ld + c] = 0.5f * v * (1.f + std::erf(v * r2));
    }
}

// x, y: [rows, H] contiguous  shift, scale: [H]
void CpuBackend::layernorm_modulate(ConstTensorView x_v, ConstTensorView shift_v, ConstTensorView scale_v, float eps,
                                    TensorView y_v) {
  const float *x = x_v.ptr<float>(), *shift = shift_v.ptr<float>(), *scale = scale_v.ptr<float>();
  float* y = y_v.ptr<float>();
  const std::int64_t rows = x_v.size(0), H = x_v.size(1);
  using namespace simd;
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * H;
    float* yr = y + r * H;
    // Two passes, each over kLanes partial sums (f32 lanes, a short sum each): the mean, then the
    // centred variance (no cancellation). Vectors: the scalar double loops were 3x slower (issue #54).
    vf s{};
    std::int64_t c = 0;
    for (; c + kLanes <= H; c += kLanes) s += load(xr + c);
    if (c < H) s += load_part(xr + c, H - c, 0.f);
    const float m = hsum(s) / static_cast<float>(H);
    const vf mv = broadcast(m);
    vf q{};
    for (c = 0; c + kLanes <= H; c += kLanes) {
      const vf d = load(xr + c) - mv;
      q += d * d;
    }
    if (c < H) {
      const vf d = load_part(xr + c, H - c, m) - mv;
      q += d * d;
    }
    const float rstd = 1.f / std::sqrt(hsum(q) / static_cast<float>(H) + eps);
#pragma omp simd
    for (std::int64_t j = 0; j < H; ++j) yr[j] = (1.f + scale[j]) * ((xr[j] - m) * rstd) + shift[j];
  }
}

// x: [rows, H] contiguous  gate: [H]  y: [rows, H] (row stride ldy)
void CpuBackend::gated_add(TensorView x_v, ConstTensorView gate_v, ConstTensorView y_v) {
  float* x = x_v.ptr<float>();
  const float *gate = gate_v.ptr<float>(), *y = y_v.ptr<float>();
  const std::int64_t rows = x_v.size(0), H = x_v.size(1), ldy = y_v.stride[0];
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < H; ++c) x[r * H + c] += gate[c] * y[r * ldy + c];
}

// qkv: [rows, 3, heads, d] (row stride ld)  q_scale, k_scale: [d] (per head) or [heads * d] (across
// heads: one rstd for a row's q, one for its k)  cos, sin: [rows, d/2] or rank 0
void CpuBackend::qk_norm_rope(TensorView qkv_v, ConstTensorView q_scale_v, ConstTensorView k_scale_v, float eps,
                              ConstTensorView cos_v, ConstTensorView sin_v) {
  float* qkv = qkv_v.ptr<float>();
  const float *q_scale = q_scale_v.ptr<float>(), *k_scale = k_scale_v.ptr<float>();
  const bool rotate = cos_v.rank != 0;
  const float* cos = rotate ? cos_v.ptr<float>() : nullptr;
  const float* sin = rotate ? sin_v.ptr<float>() : nullptr;
  const std::int64_t rows = qkv_v.size(0), heads = qkv_v.size(2), d = qkv_v.size(3), ld = qkv_v.stride[0];
  const std::int64_t span = q_scale_v.size(0);  // d, or heads * d across heads
  DIFFCP_CHECK((span == d || span == heads * d) && k_scale_v.size(0) == span, "qk_norm_rope: scales [", span, "] and [",
               k_scale_v.size(0), "], expected both [d_h = ", d, "] or both [heads * d_h = ", heads * d, "]");
  const auto rms = [eps](const float* x, std::int64_t n) {
    float ss = 0.f;
    for (std::int64_t c = 0; c < n; ++c) ss += x[c] * x[c];
    return 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  };
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    float rstd[2] = {0.f, 0.f};  // across heads: q's, k's
    if (span != d)
      for (int part = 0; part < 2; ++part) rstd[part] = rms(qkv + r * ld + part * heads * d, heads * d);
    for (std::int64_t h = 0; h < 2 * heads; ++h) {  // q heads, then k heads
      float* x = qkv + r * ld + h * d;
      const float* w = (h < heads ? q_scale : k_scale) + (span == d ? 0 : (h % heads) * d);
      const float s = span == d ? rms(x, d) : rstd[h < heads ? 0 : 1];
      for (std::int64_t c = 0; c < d; ++c) x[c] = x[c] * s * w[c];
      if (!rotate) continue;
      const float* cs = cos + r * (d / 2);
      const float* sn = sin + r * (d / 2);
      for (std::int64_t k = 0; k < d / 2; ++k) {
        const float x0 = x[2 * k], x1 = x[2 * k + 1];
        x[2 * k] = cs[k] * x0 - sn[k] * x1;
        x[2 * k + 1] = sn[k] * x0 + cs[k] * x1;
      }
    }
  }
}

}  // namespace diffcp::cpu::DIFFCP_CPU_ISA
