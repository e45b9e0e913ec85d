// The CUDA backend's block-sparse attention (attention.cu): the DFlash mask of attention/mask.hpp
// (and the DiT's dense attention, which is the same mask with one block per image), forward and
// backward, f32 or bf16 storage with f32 math all through (scores, softmax, P and dS never
// rounded; lse and delta f32). Plain C++ arguments, as kernels.hpp.
//
// Work follows the mask: a warp per (query row, query head) walks only its block's visible key
// ranges (the plan below), 32 keys at a time, and masks a KeyWindow's edge per key (forward, and
// the backward's dQ); a warp per (key row, kv head) walks the blocks that see its key (the key
// plan) for dK and dV: no atomics, every output written once, deterministic. This is the
// correctness-first kernel (SIMT f32 math, no tensor cores).
#pragma once

#include <cstdint>

namespace diffcp::cuda {

using Stream = void*;  // cudaStream_t

// The mask as the kernels read it, one int64 array in device memory (made by the backend from a
// BlockMask): [anchor: N][range_offset: N + 1][ranges: R x 3], where block i's query slot r sits
// at position anchor[i] + r, and its visible key ranges are ranges[range_offset[i] ..
// range_offset[i + 1]), each {first local key row, end row, position of the first row}.
//
// The key plan (backward), one int64 array in device memory: [S][segments: S x 5][blocks], where
// segment s = {first key row, end row, position of the first row, first entry in blocks, count}
// covers key rows that the same blocks see (blocks[first .. first + count)); segments are sorted
// by row and disjoint; a key row in no segment is seen by no query (its dK, dV are 0).
struct AttentionDims {
  std::int64_t Q = 0, L_k = 0, n_q = 0, n_kv = 0, d = 0, B = 0, N = 0;  // d <= kMaxHeadDim
  std::int64_t window = 0;  // KeyWindow (attention/mask.hpp): 0 = unbounded
  bool causal = false;
  float scale = 0;  // the softmax scale (> 0)
  // row strides (elements) of q, k, v, o / do, dq, dk, dv: head h of row r at x + r * ld + h * d
  std::int64_t ld_q = 0, ld_k = 0, ld_v = 0, ld_o = 0, ld_do = 0, ld_dq = 0, ld_dk = 0, ld_dv = 0;
};
inline constexpr std::int64_t kMaxHeadDim = 256;

// q: [Q, n_q, d]  k, v: [L_k, n_kv, d]  o: [Q, n_q, d] out  lse: [Q * n_q] out (natural log; -inf
// and o = 0 for a row that sees no key). bf16: element pointers hold bf16 bits.
int attention_forward(bool bf16, const void* q, const void* k, const void* v, void* o, float* lse,
                      const std::int64_t* plan, const AttentionDims& a, Stream s);
// q, do_: [Q, n_q, d]  k, v: [L_k, n_kv, d]  lse, delta: [Q * n_q] (global)
// dq: [Q, n_q, d] out  dk, dv: [L_k, n_kv, d] out (all in the storage dtype; rows a.L_k).
int attention_backward(bool bf16, const void* q, const void* k, const void* v, const void* do_, const float* lse,
                       const float* delta, void* dq, void* dk, void* dv, const std::int64_t* plan,
                       const std::int64_t* key_plan, const AttentionDims& a, Stream s);

// ---- the tensor-core forward: the scores of a run of query rows against its key spans as GEMMs
// (cuBLASLt, by the backend), then these two kernels ----
// S: [n_q, rc, L] f32, the scores in base 2 (scale log2 e q.k) of query rows [r0, r0 + rc) against
// the L columns of the key spans; spans: device [n_spans, 3] {first key row, end row, first column}.
// Writes P = 2^(S - m) where the mask lets the row see the key, else 0 ([n_q, rc, L] in the storage
// dtype: P may be S itself for f32), lse [Q * n_q] (natural log; -inf for a row that sees nothing)
// and inv_l [rc, n_q] = 1 / sum P (0 for such a row).
int masked_softmax(bool bf16, const float* S, void* P, std::int64_t r0, std::int64_t rc, std::int64_t L,
                   const std::int64_t* spans, std::int64_t n_spans, const std::int64_t* plan, float* lse, float* inv_l,
                   const AttentionDims& a, Stream s);
// The backward's probabilities from the global lse: S [n_q, rc, L] f32 scores in base 2 becomes
// P = 2^(S - lse log2 e) where the mask lets the row see the key, else 0 (in place, f32), and, with
// bf16 storage, P's bf16 copy in Pb (the GEMMs' operand; null for f32).
int masked_probs(const float* lse, float* S, std::uint16_t* Pb, std::int64_t r0, std::int64_t rc, std::int64_t L,
                 const std::int64_t* spans, std::int64_t n_spans, const std::int64_t* plan, const AttentionDims& a,
                 Stream s);
// dS = P (dP - D) over [n_q, rc, L]: dP (f32) in place, and its bf16 copy in dSb (null for f32);
// D: delta [Q * n_q] of rows [r0, r0 + rc).
int softmax_grad(const float* P, float* dP, std::uint16_t* dSb, const float* delta, std::int64_t r0, std::int64_t rc,
                 std::int64_t L, const AttentionDims& a, Stream s);
// o[r0 + r, h, :] = O[r, h, :] * inv_l[r, h] in the storage dtype: O [rc, n_q * d] f32 (P V).
int scale_rows(bool bf16, const float* O, const float* inv_l, void* o, std::int64_t r0, std::int64_t rc,
               const AttentionDims& a, Stream s);

}  // namespace diffcp::cuda
