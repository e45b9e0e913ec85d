// The DiT's row-wise operations (FLUX semantics), fp32, OpenMP over rows. Every op treats rows
// independently, so a row's result does not depend on how many rows a rank holds: only the GEMMs
// and the attention can round differently between P = 1 and P > 1.
//
// Legend: rows of width H (hidden), ld = elements between consecutive rows (>= the row's width).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "diffcp/dit/config.hpp"

namespace diffcp {

// y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W[K, N] (row stride N) + bias[N] through
// oneDNN sgemm (bias copied into y first, then accumulated with beta = 1). ops/linear.hpp has no
// row strides, which the fused single-block tensors need (e.g. linear2 reads [attention | MLP]
// columns of a wider row).
void dit_linear(const float* x, std::int64_t ldx, std::int64_t M, std::int64_t K, const float* W, std::int64_t N,
                const float* bias, float* y, std::int64_t ldy);
// The same with W's row stride given: W[K, N] (row stride ldw >= N), e.g. a column slice of a
// wider weight (V-First projects V's columns of the fused qkv weight first).
void dit_linear(const float* x, std::int64_t ldx, std::int64_t M, std::int64_t K, const float* W, std::int64_t ldw,
                std::int64_t N, const float* bias, float* y, std::int64_t ldy);
// The same with the layer's parameters: x: [M, l.in], y: [M, l.out]; params: the model allocation.
void dit_linear(const std::vector<float>& params, const DitLinear& l, const float* x, std::int64_t ldx,
                std::int64_t M, float* y, std::int64_t ldy);

// x[n] = silu(x) = x / (1 + exp(-x))
void silu_inplace(float* x, std::int64_t n);
// x[rows, cols] (row stride ld) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3) (GELU, tanh
// form), evaluated as x / (1 + exp(-2u)) with a polynomial exp2 (relative error ~1e-6)
void gelu_tanh_inplace(float* x, std::int64_t rows, std::int64_t cols, std::int64_t ld);

// y[rows, H] = (1 + scale) * LayerNorm(x) + shift: LayerNorm without affine weights (mean and
// variance over H, eps), shift, scale: [H] (adaLN modulation). x, y: contiguous, may not alias.
void layernorm_modulate(const float* x, std::int64_t rows, std::int64_t H, const float* shift, const float* scale,
                        float eps, float* y);
// x[rows, H] += gate[H] * y[rows, H] (y row stride ldy): a gated residual.
void gated_add(float* x, std::int64_t rows, std::int64_t H, const float* gate, const float* y, std::int64_t ldy);

// FLUX's timestep features of t in [0, 1]: with s = 1000 t, half = dim/2 and
// f_i = exp(-ln(10000) i / half): [cos(s f_0..s f_{half-1}), sin(s f_0..s f_{half-1})]. [dim]
std::vector<float> timestep_embedding(double t, std::int64_t dim);

// RoPE over (token index, image row, image column), FLUX's EmbedND: head-dim pair k = (2k, 2k+1)
// (adjacent elements) belongs to axis a while k < (axes[0] + ... + axes[a]) / 2; with i its index
// inside the axis, its angle is pos_a * theta^(-2i/axes[a]), and (x0, x1) -> (cos x0 - sin x1,
// sin x0 + cos x1). Text tokens sit at position (0, 0, 0) (FLUX's txt_ids): the identity, skipped.
// Image token (r, c) of the grid sits at (0, r, c). Angles in double, stored as float.
class AxialRope {
 public:
  // The table of `positions` [n] given as (row, col) pairs.
  AxialRope(const DitConfig& cfg, const std::vector<std::array<std::int64_t, 2>>& positions);
  std::int64_t rows() const { return rows_; }
  const float* cos(std::int64_t r) const { return cos_.data() + r * half_; }  // [d_h/2]
  const float* sin(std::int64_t r) const { return sin_.data() + r * half_; }

 private:
  std::int64_t rows_, half_;
  std::vector<float> cos_, sin_;
};

// Per-head QK RMSNorm, then RoPE, in place on the q and k parts of fused qkv rows:
//   qkv: [rows, 3, n_h, d_h] (row stride ld): q heads, k heads, v heads (v untouched)
//   q_scale, k_scale: [d_h]  x -> x / sqrt(mean(x^2) + eps) * scale
//   rope: null (text rows: no rotation) or a table whose row r rotates qkv row r (rope->rows() == rows)
void qk_norm_rope(float* qkv, std::int64_t rows, std::int64_t ld, std::int64_t heads, std::int64_t d,
                  const float* q_scale, const float* k_scale, float eps, const AxialRope* rope);

}  // namespace diffcp
