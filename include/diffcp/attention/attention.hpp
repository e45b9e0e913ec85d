// Block-sparse attention for the DFlash mask (SPEC A.1): forward with log-sum-exp, and a
// backward that takes the GLOBAL lse and D so that it serves Split-KV (SPEC A.2) unchanged.
// The functions run on the active backend (ops/backend.hpp); the algorithm below is the CPU
// backend's (src/cpu/attention.cpp).
//
// Legend: Q = N*B query rows, L_k key rows held by this call, n_q query heads, n_kv kv heads
//         (GQA: query head j uses kv head j / (n_q/n_kv)), d_h head dim.
// Algorithm: flash-attention tiling with online softmax. Work item = (block, kv head): the
// G = n_q/n_kv query heads of a kv head and the B rows of a block form one (G*B) x d_h query tile,
// so each K/V tile is loaded once for all G heads. Tile GEMMs are the CPU backend's oneDNN sgemm,
// called directly (no dispatch per tile) and single-threaded inside our OpenMP loop; only visible
// key ranges are visited, so work is proportional to the unmasked pairs. Storage f32 or bf16 (the
// overloads below); accumulation, softmax, lse and D always f32.
#pragma once

#include <span>

#include "diffcp/attention/mask.hpp"
#include "diffcp/core/tensor.hpp"

namespace diffcp {

// Forward over the keys this call holds.
//   q:   [Q, n_q, d_h]      k, v: [L_k, n_kv, d_h]
//   o:   [Q, n_q, d_h] out  lse:  [Q, n_q] out, natural log of sum_j exp(scale * q.k_j)
// A row that sees no key here gets lse = -inf and o = 0 (no NaN).
// softmax_scale <= 0 means 1/sqrt(d_h).
void attention_forward(const BlockMask& mask, HeadRows<const float> q, HeadRows<const float> k,
                       HeadRows<const float> v, HeadRows<float> o, std::span<float> lse,
                       float softmax_scale = 0.f);

// D = rowsum(do * o) per (row, head).  do_, o: [Q, n_q, d_h]  delta: [Q, n_q] out.
void attention_delta(HeadRows<const float> do_, HeadRows<const float> o, std::span<float> delta);

// Backward over the keys this call holds, given the GLOBAL softmax statistics.
//   q, do_: [Q, n_q, d_h]    k, v: [L_k, n_kv, d_h]
//   lse:   [Q, n_q] global log-sum-exp (over all keys of all calls)
//   delta: [Q, n_q] global D = rowsum(do * o) with the global (merged) o
//   dq: [Q, n_q, d_h] out (this call's share; sum over calls)   dk, dv: [L_k, n_kv, d_h] out
// All outputs are overwritten; key rows no block sees get 0.
void attention_backward(const BlockMask& mask, HeadRows<const float> q, HeadRows<const float> k,
                        HeadRows<const float> v, HeadRows<const float> do_,
                        std::span<const float> lse, std::span<const float> delta,
                        HeadRows<float> dq, HeadRows<float> dk, HeadRows<float> dv,
                        float softmax_scale = 0.f);

// The same three ops with bf16 storage of q, k, v, o, do, dq, dk, dv (shapes as above); lse and
// delta stay f32. Tile GEMMs take bf16 operands with f32 accumulation (P and dS are rounded to
// bf16 as GEMM operands, as FlashAttention does); dk and dv are accumulated in f32 and rounded once.
void attention_forward(const BlockMask& mask, HeadRows<const bf16_t> q, HeadRows<const bf16_t> k,
                       HeadRows<const bf16_t> v, HeadRows<bf16_t> o, std::span<float> lse,
                       float softmax_scale = 0.f);
void attention_delta(HeadRows<const bf16_t> do_, HeadRows<const bf16_t> o, std::span<float> delta);
void attention_backward(const BlockMask& mask, HeadRows<const bf16_t> q, HeadRows<const bf16_t> k,
                        HeadRows<const bf16_t> v, HeadRows<const bf16_t> do_,
                        std::span<const float> lse, std::span<const float> delta,
                        HeadRows<bf16_t> dq, HeadRows<bf16_t> dk, HeadRows<bf16_t> dv,
                        float softmax_scale = 0.f);

// The three ops on views of one storage dtype, f32 or bf16 (the rank-3 views [rows, heads, d_h]
// have contiguous heads: core/tensor.hpp head_view), dispatched on q's dtype; a view of another
// dtype is an error naming it. What the CP methods call, one code path for both compute dtypes.
void attention_forward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView o,
                       std::span<float> lse, float softmax_scale = 0.f);
void attention_delta(ConstTensorView do_, ConstTensorView o, std::span<float> delta);
void attention_backward(const BlockMask& mask, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                        ConstTensorView do_, std::span<const float> lse, std::span<const float> delta, TensorView dq,
                        TensorView dk, TensorView dv, float softmax_scale = 0.f);

// FLOPs as FlashAttention counts them, over visible pairs only: 4*d_h per pair per query head
// forward, 10*d_h backward (score recomputation included).
double attention_forward_flops(const BlockMask& mask, std::int64_t n_q, std::int64_t d_h);
double attention_backward_flops(const BlockMask& mask, std::int64_t n_q, std::int64_t d_h);

}  // namespace diffcp
