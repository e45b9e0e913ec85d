#include "diffcp/dit/ops.hpp"

#include <cmath>
#include <cstring>
#include <numbers>

#include <oneapi/dnnl/dnnl.h>

#include "diffcp/core/error.hpp"
#include "diffcp/core/fastmath.hpp"

namespace diffcp {

void dit_linear(const float* x, std::int64_t ldx, std::int64_t M, std::int64_t K, const float* W, std::int64_t N,
                const float* bias, float* y, std::int64_t ldy) {
  dit_linear(x, ldx, M, K, W, N, N, bias, y, ldy);
}

void dit_linear(const float* x, std::int64_t ldx, std::int64_t M, std::int64_t K, const float* W, std::int64_t ldw,
                std::int64_t N, const float* bias, float* y, std::int64_t ldy) {
  DIFFCP_CHECK(M >= 0 && K >= 1 && N >= 1 && ldx >= K && ldy >= N && ldw >= N, "dit_linear: M = ", M, ", K = ", K,
               ", N = ", N, ", ldx = ", ldx, ", ldw = ", ldw, ", ldy = ", ldy,
               "; expected K, N >= 1 and row strides >= the row widths");
  if (M == 0) return;
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < M; ++r)
    for (std::int64_t c = 0; c < N; ++c) y[r * ldy + c] = bias ? bias[c] : 0.f;
  const dnnl_status_t st = dnnl_sgemm('N', 'N', M, N, K, 1.f, x, ldx, W, ldw, 1.f, y, ldy);
  DIFFCP_CHECK(st == dnnl_success, "dnnl_sgemm(M=", M, " N=", N, " K=", K, ") failed: status ", static_cast<int>(st));
}

void dit_linear(const std::vector<float>& params, const DitLinear& l, const float* x, std::int64_t ldx,
                std::int64_t M, float* y, std::int64_t ldy) {
  dit_linear(x, ldx, M, l.in, params.data() + l.w, l.out, params.data() + l.b, y, ldy);
}

void silu_inplace(float* x, std::int64_t n) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) x[i] = x[i] / (1.f + std::exp(-x[i]));
}

void gelu_tanh_inplace(float* x, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  // 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)) = x / (1 + 2^(-2 u log2(e))), u = k (x + 0.044715 x^3)
  const float k = static_cast<float>(std::sqrt(2.0 / std::numbers::pi)), m = -2.f * std::numbers::log2e_v<float> * k;
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = x + r * ld;
#pragma omp simd
    for (std::int64_t c = 0; c < cols; ++c) {
      const float v = row[c];
      row[c] = v / (1.f + fast_exp2(m * (v + 0.044715f * v * v * v)));
    }
  }
}

void layernorm_modulate(const float* x, std::int64_t rows, std::int64_t H, const float* shift, const float* scale,
                        float eps, float* y) {
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * H;
    float* yr = y + r * H;
    // Two passes in double: the mean of a wide row, then the centred variance (no cancellation).
    double mean = 0;
    for (std::int64_t c = 0; c < H; ++c) mean += xr[c];
    mean /= static_cast<double>(H);
    double var = 0;
    for (std::int64_t c = 0; c < H; ++c) var += (xr[c] - mean) * (xr[c] - mean);
    var /= static_cast<double>(H);
    const float m = static_cast<float>(mean), rstd = static_cast<float>(1.0 / std::sqrt(var + eps));
    for (std::int64_t c = 0; c < H; ++c) yr[c] = (1.f + scale[c]) * ((xr[c] - m) * rstd) + shift[c];
  }
}

void gated_add(float* x, std::int64_t rows, std::int64_t H, const float* gate, const float* y, std::int64_t ldy) {
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < H; ++c) x[r * H + c] += gate[c] * y[r * ldy + c];
}

std::vector<float> timestep_embedding(double t, std::int64_t dim) {
  DIFFCP_CHECK(dim >= 2 && dim % 2 == 0, "timestep_embedding: dim = ", dim, ", expected even and >= 2");
  const std::int64_t half = dim / 2;
  std::vector<float> e(static_cast<std::size_t>(dim));
  for (std::int64_t i = 0; i < half; ++i) {
    const double arg = 1000.0 * t * std::exp(-std::log(10000.0) * static_cast<double>(i) / static_cast<double>(half));
    e[static_cast<std::size_t>(i)] = static_cast<float>(std::cos(arg));
    e[static_cast<std::size_t>(half + i)] = static_cast<float>(std::sin(arg));
  }
  return e;
}

AxialRope::AxialRope(const DitConfig& cfg, const std::vector<std::array<std::int64_t, 2>>& positions)
    : rows_(static_cast<std::int64_t>(positions.size())), half_(cfg.head_dim / 2) {
  cfg.validate();
  cos_.resize(static_cast<std::size_t>(rows_ * half_));
  sin_.resize(cos_.size());
  for (std::int64_t r = 0; r < rows_; ++r) {
    const double pos[3] = {0.0, static_cast<double>(positions[static_cast<std::size_t>(r)][0]),
                           static_cast<double>(positions[static_cast<std::size_t>(r)][1])};
    std::int64_t k = 0;
    for (int a = 0; a < 3; ++a)
      for (std::int64_t i = 0; i < cfg.rope_axes[static_cast<std::size_t>(a)] / 2; ++i, ++k) {
        const double dim = static_cast<double>(cfg.rope_axes[static_cast<std::size_t>(a)]);
        const double angle = pos[a] * std::pow(cfg.rope_theta, -2.0 * static_cast<double>(i) / dim);
        cos_[static_cast<std::size_t>(r * half_ + k)] = static_cast<float>(std::cos(angle));
        sin_[static_cast<std::size_t>(r * half_ + k)] = static_cast<float>(std::sin(angle));
      }
  }
}

void qk_norm_rope(float* qkv, std::int64_t rows, std::int64_t ld, std::int64_t heads, std::int64_t d,
                  const float* q_scale, const float* k_scale, float eps, const AxialRope* rope) {
  DIFFCP_CHECK(ld >= 3 * heads * d, "qk_norm_rope: row stride ", ld, " < 3 * heads * d_h = ", 3 * heads * d);
  DIFFCP_CHECK(!rope || rope->rows() == rows, "qk_norm_rope: RoPE table has ", rope ? rope->rows() : 0,
               " rows, expected ", rows);
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t h = 0; h < 2 * heads; ++h) {  // q heads, then k heads
      float* x = qkv + r * ld + h * d;
      const float* w = h < heads ? q_scale : k_scale;
      float ss = 0.f;
      for (std::int64_t c = 0; c < d; ++c) ss += x[c] * x[c];
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
      for (std::int64_t c = 0; c < d; ++c) x[c] = x[c] * rstd * w[c];
      if (!rope) continue;
      const float* cs = rope->cos(r);
      const float* sn = rope->sin(r);
      for (std::int64_t k = 0; k < d / 2; ++k) {
        const float x0 = x[2 * k], x1 = x[2 * k + 1];
        x[2 * k] = cs[k] * x0 - sn[k] * x1;
        x[2 * k + 1] = sn[k] * x0 + cs[k] * x1;
      }
    }
}

}  // namespace diffcp
