// The CUDA backend's kernels (kernels.cu), with plain C++ arguments so that nvcc never reads the
// library's headers: device pointers, sizes, row strides (elements) and the backend's stream.
// Each enqueues on `stream` and returns cudaSuccess or the launch error (as an int: no CUDA header
// here). Element types: f32 as float, bf16 as its uint16 bits.
#pragma once

#include <cstdint>

namespace diffcp::cuda {

using Stream = void*;  // cudaStream_t

int fill_f32(float* x, std::int64_t n, float value, Stream s);
int fill_bf16(std::uint16_t* x, std::int64_t n, std::uint16_t bits, Stream s);
// rows x cols, row strides ld_* (elements); f32 -> bf16 round to nearest even, bf16 -> f32 exact,
// or a copy (same dtype: elem_bytes 2 or 4)
int convert_f32_bf16(const float* src, std::int64_t ld_src, std::uint16_t* dst, std::int64_t ld_dst, std::int64_t rows,
                     std::int64_t cols, Stream s);
int convert_bf16_f32(const std::uint16_t* src, std::int64_t ld_src, float* dst, std::int64_t ld_dst, std::int64_t rows,
                     std::int64_t cols, Stream s);
int copy_rows(const void* src, std::int64_t ld_src, void* dst, std::int64_t ld_dst, std::int64_t rows, std::int64_t cols,
              int elem_bytes, Stream s);
// dst[r, :cols] = src[:cols] for every row r (row stride ld_dst): one row broadcast
int copy_rows_broadcast_f32(const float* src, float* dst, std::int64_t ld_dst, std::int64_t rows, std::int64_t cols, Stream s);
int copy_rows_broadcast_u16(const std::uint16_t* src, std::uint16_t* dst, std::int64_t ld_dst, std::int64_t rows,
                            std::int64_t cols, Stream s);
// y[n] += alpha x[n] (alpha = 1: y + x exactly)
int axpy(float* y, const float* x, float alpha, std::int64_t n, Stream s);
// x[n] = silu(x) in place
int silu(float* x, std::int64_t n, Stream s);
// x: rows x cols (row stride ld) in place: GELU, tanh approximation
int gelu_tanh(float* x, std::int64_t rows, std::int64_t cols, std::int64_t ld, Stream s);
int gelu(float* x, std::int64_t rows, std::int64_t cols, std::int64_t ld, Stream s);
// act = silu(gate) * up, rows x cols with a row stride each (rows = 1: [n])
int swiglu_forward(const float* gate, std::int64_t lg, const float* up, std::int64_t lu, float* act, std::int64_t la,
                   std::int64_t rows, std::int64_t cols, Stream s);
int swiglu_backward(const float* dact, const float* gate, const float* up, float* dgate, float* dup, std::int64_t n,
                    Stream s);
// db[N] += column sums of dy (M x N, contiguous), summed in row order
int bias_backward(const float* dy, float* db, std::int64_t M, std::int64_t N, Stream s);
// C (rows x cols, row stride ldc, f32 or bf16 bits) = beta * C: the GEMM's K = 0 case
int scale_f32(float* c, std::int64_t rows, std::int64_t cols, std::int64_t ldc, float beta, Stream s);

// ---- per (row, head) vectors of a [rows, heads, dim] tensor with row stride ld (heads contiguous) ----
// o[r, h, :] *= exp(lse_p - lse) (0 where lse_p = -inf); lse_p, lse: [rows * heads]
int lse_rescale(float* o, std::int64_t rows, std::int64_t heads, std::int64_t dim, std::int64_t ld, const float* lse_p,
                const float* lse, Stream s);
// x[n] = exp(x - m) (0 where m = -inf), or m + log(x) (-inf where m = -inf)
int lse_shift(float* x, const float* m, std::int64_t n, bool to_exp, Stream s);
// delta[r * heads + h] = sum_c do[r, h, c] o[r, h, c] in f32 (bf16: the bits widened); ld_*: row strides
int attention_delta_f32(const float* do_, std::int64_t ld_do, const float* o, std::int64_t ld_o, float* delta,
                        std::int64_t rows, std::int64_t heads, std::int64_t dim, Stream s);
int attention_delta_bf16(const std::uint16_t* do_, std::int64_t ld_do, const std::uint16_t* o, std::int64_t ld_o,
                         float* delta, std::int64_t rows, std::int64_t heads, std::int64_t dim, Stream s);
// RMSNorm over the last dim of contiguous [v, d] (v = rows * heads vectors): y = x * rstd * w,
// rstd[v] = 1 / sqrt(mean(x^2) + eps) (y may alias x)
int rmsnorm_forward(const float* x, const float* w, float eps, float* y, float* rstd, std::int64_t v, std::int64_t d,
                    Stream s);
// dx = rstd * (dy w - x rstd^2 sum(dy w x) / d) (dx may alias dy);  dw[c] += sum_v dy x rstd (vector order)
int rmsnorm_backward(const float* dy, const float* x, const float* rstd, const float* w, float* dx, float* dw,
                     std::int64_t v, std::int64_t d, Stream s);
// x: rows x H (contiguous) += gate[H] * y (row stride ldy)
int gated_add(float* x, const float* gate, const float* y, std::int64_t ldy, std::int64_t rows, std::int64_t H, Stream s);
// y = (1 + scale) * LayerNorm(x) + shift per row (no affine; mean and variance per row):
// x, y: rows x H contiguous, shift, scale: [H]
int layernorm_modulate(const float* x, const float* shift, const float* scale, float eps, float* y, std::int64_t rows,
                       std::int64_t H, Stream s);
// x[n] = float(double(x) * scale) in place, and out[0] (device, double) = sum of the new x^2 in double
int scale_sumsq(float* x, std::int64_t n, double scale, double* out, Stream s);
// AdamW (ops/optim.hpp): m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2,
// p = p decay - step m / (sqrt(v) inv_sqrt_c2 + eps)
int adamw_step(float* p, const float* g, float* m, float* v, std::int64_t n, float b1, float b2, float step,
               float inv_sqrt_c2, float eps, float decay, Stream s);

// ---- the rest of the op set: merges, rotations, row movement, V-Major, CFG, the loss, fp8 ----
// The lse merge of P partial results (attention/merge.hpp); parts: device array [P] of
// {o_p pointer, o_p row stride, lse_p pointer} as three int64 (pointers as integers):
// o: [rows, heads, dim] (row stride ld) out, lse: [rows * heads] out. Parts summed in index order.
int lse_merge(const std::int64_t* parts, std::int64_t P, float* o, std::int64_t ld, float* lse, std::int64_t rows,
              std::int64_t heads, std::int64_t dim, Stream s);
// Rotate-half RoPE in place (ops/rope.hpp): x: [rows, heads, d] contiguous; cs, sn: [rows, d/2]
// (each row's position's table entries); sign -1: the inverse rotation.
int rope(float* x, const float* cs, const float* sn, std::int64_t rows, std::int64_t heads, std::int64_t d, float sign,
         Stream s);
// The DiT's q/k RMSNorm (+ interleaved-pair RoPE): qkv: [rows, 3, heads, d] (row stride ld), the q
// and k heads in place; q_scale, k_scale: [d], or [heads * d] across_heads (one norm over a row's q,
// one over its k: Wan); cs, sn: [rows, d/2] or null (no rotation).
int qk_norm_rope(float* qkv, std::int64_t ld, std::int64_t rows, std::int64_t heads, std::int64_t d, const float* q_scale,
                 const float* k_scale, float eps, const float* cs, const float* sn, bool across_heads, Stream s);
// dst[i, :w] = src[idx[i], :w] (gather) or dst[idx[i], :w] = src[i, :w] (scatter), idx: device [n];
// each element converted from src_bytes to dst_bytes (4 = f32, 2 = bf16 bits, 1 = u8: same sizes copy)
// (a row outside [0, M) of the [M, w] side is skipped: device row lists are not checked on the host)
int move_rows(const void* src, std::int64_t ld_src, int src_bytes, void* dst, std::int64_t ld_dst, int dst_bytes,
              const std::int64_t* idx, std::int64_t M, std::int64_t n, std::int64_t w, bool scatter, Stream s);
// V-Major's choice (dit/ops.hpp select_active): parts: [lanes, S, n] f32, active: [S, k] i32 out;
// scratch: S n doubles then S n i32 flags (device)
int select_active(const float* parts, std::int64_t lanes, std::int64_t S, std::int64_t n, std::int64_t k,
                  std::int32_t* active, double* scratch, Stream s);
// ops/conv.hpp's dynamic convolution: x, y, dy, dx: [T, H]  dyn, ddyn: [T, K, G] (row strides ld, ld_d)
// base, dbase: [K, H] (dbase +=); blocks of `block` rows
int dynamic_conv_forward(const float* x, const float* dyn, std::int64_t ld, const float* base, std::int64_t T,
                         std::int64_t H, std::int64_t K, std::int64_t G, std::int64_t block, float* y, Stream s);
int dynamic_conv_backward(const float* dy, const float* x, const float* dyn, std::int64_t ld, const float* base,
                          std::int64_t T, std::int64_t H, std::int64_t K, std::int64_t G, std::int64_t block, float* dx,
                          float* ddyn, std::int64_t ld_d, float* dbase, Stream s);
// rows[b, a] = b stride + map[active[b mod S, a]] (map null: the identity; a token outside [0, n): -1)
int token_rows(const std::int32_t* active, std::int64_t S, std::int64_t k, const std::int64_t* map, std::int64_t n,
               std::int64_t B, std::int64_t stride, std::int64_t* rows, Stream s);
// out[r] = float(sum over g, then i, of |a - b| in double): a, b: [G, R, w] contiguous (bf16: bits)
int l1_distance(const void* a, const void* b, bool bf16, float* out, std::int64_t G, std::int64_t R, std::int64_t w,
                Stream s);
// v: [rows, C] in place = neg + scale (v - neg), rescaled to v's norm per row when keep_norm
int guidance_combine(float* v, const float* neg, float scale, bool keep_norm, std::int64_t rows, std::int64_t C, Stream s);
// ops/loss.hpp's cross-entropy chunk: logits [R, n] (row stride ld); target: device [R];
// stats: device [R, 4] out (max, sum exp(l - max), first argmax + v0, the target's logit or 0);
// weight: device [R] or null: then logits become map'(l) w (exp(l - lse) - [v0 + v == target]) in
// place (mult, cap: the LogitMap; map'(y) = mult (1 - (y / cap)^2), mult when cap = 0).
int cross_entropy(float* logits, std::int64_t ld, std::int64_t R, std::int64_t n, std::int64_t v0, const std::int32_t* target,
                  double* stats, const double* weight, float mult, float cap, Stream s);
// logits [R, n] in place = map'(y) (w (exp(y - lse) - [v0 + v == target]) + extra); target, weight,
// lse: device [R]; ids, grad: device [R, k] (k = 0: none), add: device scratch [R, k] f64
int cross_entropy_backward(float* logits, std::int64_t ld, std::int64_t R, std::int64_t n, std::int64_t v0,
                           const std::int32_t* target, const double* weight, const double* lse, float mult, float cap,
                           const std::int32_t* ids, const double* grad, std::int64_t k, double* add, Stream s);
// logits [R, n] (row stride ld) in place = mult l, then cap tanh(. / cap) when cap > 0
int logit_map(float* logits, std::int64_t ld, std::int64_t R, std::int64_t n, float mult, float cap, Stream s);
// each row's k largest of logits [R, n] (row stride ld) by (value desc, id asc, NaN last): values,
// ids: device [R, k] out, ids + v0. One block per row, k selection passes (O(k n) per row).
int top_k(const float* logits, std::int64_t ld, std::int64_t R, std::int64_t n, std::int64_t v0, std::int64_t k,
          float* values, std::int32_t* ids, Stream s);
// ops/fp8.hpp's blocked e4m3 codec: x: [n, d] contiguous (bf16: bits), enc: [n, d + 4]
int fp8_encode(const void* x, bool bf16, std::uint8_t* enc, std::int64_t n, std::int64_t d, Stream s);
int fp8_decode(const std::uint8_t* enc, void* x, bool bf16, std::int64_t n, std::int64_t d, Stream s);
// y: [M, N] (row stride ldy) += b[N] on every row (bias_add, and dense_linear's bias)
int bias_add_rows(float* y, std::int64_t ldy, const float* b, std::int64_t M, std::int64_t N, Stream s);

}  // namespace diffcp::cuda
