// The DiT's operations (FLUX semantics), fp32: projections with row strides (on ops/gemm.hpp),
// the timestep features, the axial RoPE table and the fused QK-norm + RoPE; the row-wise element
// ops are ops/elementwise.hpp (included here). Every row-wise op treats rows independently, so a
// row's result does not depend on how many rows a rank holds: only the GEMMs and the attention can
// round differently between P = 1 and P > 1. The ops run on the active backend (ops/backend.hpp).
//
// Legend: rows of width H (hidden), ld = elements between consecutive rows (>= the row's width).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "diffcp/core/dtype.hpp"
#include "diffcp/dit/config.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/ops/elementwise.hpp"

namespace diffcp {

// y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W[K, N] (row stride ldw >= N) + bias[N]
// through gemm (ops/gemm.hpp): bias (or 0 when null) copied into y first, then accumulated with
// beta = 1. ops/linear.hpp has no row strides, which the fused single-block tensors need (e.g.
// linear2 reads [attention | MLP] columns of a wider row; V-First projects V's columns of the fused
// qkv weight first: a column slice of a wider weight).
void dit_linear(const float* x, std::int64_t ldx, std::int64_t M, std::int64_t K, const float* W, std::int64_t ldw,
                std::int64_t N, const float* bias, float* y, std::int64_t ldy);
// The same with W already rounded to bf16 (W16: [K, N], row stride ldw): x is rounded per call, the
// product accumulated in f32 by the backend's dense_linear (ops/backend.hpp), reading `packed`
// (W16 as the backend's pack_weight laid it out; null: W16) — the same result either way. What
// the model runs under bf16 compute, its weights rounded once (DitModel).
void dit_linear(const float* x, std::int64_t ldx, std::int64_t M, std::int64_t K, const bf16_t* W16, std::int64_t ldw,
                std::int64_t N, const float* bias, float* y, std::int64_t ldy, const PackedWeight* packed = nullptr);
// The one the model calls: w, the weight columns a GEMM reads ([K, N], row stride >= N, f32 or bf16:
// DitWeights::gemm_weight), dispatched on its dtype to the two above; packed: bf16 only (or null).
void dit_linear(const float* x, std::int64_t ldx, std::int64_t M, ConstTensorView w, const float* bias, float* y,
                std::int64_t ldy, const PackedWeight* packed = nullptr);

// FLUX's timestep features of t in [0, 1]: with s = 1000 t, half = dim/2 and
// f_i = exp(-ln(10000) i / half): [cos(s f_0..s f_{half-1}), sin(s f_0..s f_{half-1})]. [dim]
std::vector<float> timestep_embedding(double t, std::int64_t dim);

// RoPE over up to four axes (FLUX: token index, image row, image column; Qwen-Image: frame, row,
// column; FLUX.2: frame, row, column, text index), FLUX's EmbedND and diffusers' QwenEmbedRope alike: head-dim pair k = (2k, 2k+1)
// (adjacent elements) belongs to axis a while k < (axes[0] + ... + axes[a]) / 2; with i its index
// inside the axis, its angle is pos_a * theta^(-2i/axes[a]), and (x0, x1) -> (cos x0 - sin x1,
// sin x0 + cos x1). Each family's positions: dit/config.hpp (DitFamily). Angles in double, stored
// as float, in the memory of the backend active at construction.
class AxialRope {
 public:
  // The table of `positions` [n], one position per axis (cfg.rope_axes.size() of them read).
  AxialRope(const DitConfig& cfg, const std::vector<std::array<double, kMaxRopeAxes>>& positions);
  std::int64_t rows() const { return rows_; }
  const float* cos(std::int64_t r) const { return cos_.data() + r * half_; }  // [d_h/2]
  const float* sin(std::int64_t r) const { return sin_.data() + r * half_; }

 private:
  std::int64_t rows_, half_;
  DeviceVector<float> cos_, sin_;  // [rows, d_h/2]
};

// Per-head QK RMSNorm, then RoPE, in place on the q and k parts of fused qkv rows:
//   qkv: [rows, 3, n_h, d_h] (row stride ld): q heads, k heads, v heads (v untouched)
//   q_scale, k_scale: [d_h]  x -> x / sqrt(mean(x^2) + eps) * scale, per head; across_heads (Wan's
//                    rms_norm_across_heads): [n_h d_h], the mean over a row's whole q (k)
//   rope: null (no rotation: FLUX's text rows) or a table whose row r rotates qkv row r (rope->rows() == rows)
void qk_norm_rope(float* qkv, std::int64_t rows, std::int64_t ld, std::int64_t heads, std::int64_t d,
                  const float* q_scale, const float* k_scale, float eps, const AxialRope* rope, bool across_heads = false);

// V-Major's token distance (SPEC B.4): a, b: [G, R, w] contiguous of `t` (f32 or bf16), out: [R]
// f32: out[r] = sum over g, then over i, of |a[g, r, i] - b[g, r, i]| (in f32, summed in double in
// that order, rounded once).
void l1_distance(const void* a, const void* b, DType t, std::int64_t G, std::int64_t R, std::int64_t w, float* out);

// V-Major's token choice (SPEC B.4), on the device (no host sync):
//   parts: [lanes, S, n] f32, each lane's partial distance of source s's token t
//   active: [S, k] i32 out, 0 <= k <= n
// d[s, t] = the sum over lanes, in lane order, in double. Per source the n - k tokens first in the
// order (d, t) (a NaN distance after every number) stay cached; the other k are active, ascending.
void select_active(const float* parts, std::int64_t lanes, std::int64_t S, std::int64_t n, std::int64_t k,
                   std::int32_t* active);
// Row lists from token lists, on the device:
//   active: [S, k] i32 with entries in [0, n)  map: [n] i64, or null (the identity)
//   rows: [B, k] i64 out: rows[b, a] = b * stride + map[active[b mod S, a]]
void token_rows(const std::int32_t* active, std::int64_t S, std::int64_t k, const std::int64_t* map, std::int64_t n,
                std::int64_t B, std::int64_t stride, std::int64_t* rows);

}  // namespace diffcp
