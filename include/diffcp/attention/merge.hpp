// Log-sum-exp merging of attention results computed over disjoint key sets (flash-attention's
// "combine"): with partial (o_p, lse_p),
//   lse = log sum_p exp(lse_p),   o = sum_p exp(lse_p - lse) * o_p.
// Partials with lse_p = -inf (no visible key) contribute nothing; if all are -inf the merged row
// is lse = -inf, o = 0. Both run on the active backend (ops/backend.hpp; CPU: src/cpu/merge.cpp).
#pragma once

#include <span>
#include <vector>

#include "diffcp/core/tensor.hpp"

namespace diffcp {

// lse: [rows*heads] per partial; o: [rows, heads, dim] per partial. Writes (o, lse) merged.
void lse_merge(std::span<const HeadRows<const float>> o_parts,
               std::span<const std::span<const float>> lse_parts, HeadRows<float> o,
               std::span<float> lse);

// The per-rank half of a distributed merge (SPEC A.2 step 4): given this partial (o_p, lse_p) and
// the already-reduced global lse, o_p *= exp(lse_p - lse) in place, so that summing the rescaled
// partials over ranks gives the merged output.
//   o_p: [rows, heads, dim] in/out   lse_p, lse: [rows*heads]
void lse_rescale(HeadRows<float> o_p, std::span<const float> lse_p, std::span<const float> lse);

// The two element-wise halves of the lse all-reduce without a fused operator (cp/lse_reduce.hpp),
// given m = the max over ranks:  x: [n] in place, m: [n]
//   lse_shift_to_exp:   x = exp(x - m), 0 where m = -inf (no rank saw a key)
//   lse_shift_from_exp: x = m + log(x), -inf where m = -inf
void lse_shift_to_exp(std::span<float> x, std::span<const float> m);
void lse_shift_from_exp(std::span<float> x, std::span<const float> m);

}  // namespace diffcp
