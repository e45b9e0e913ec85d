// Cross-entropy over a chunk of logits as backend ops (the drafter's LM head, drafter/lm_head.hpp),
// DFlash2's logit map and the candidate selector's top-K. Token ids, weights and the per-row
// results are host metadata, O(rows); the logits are device memory. CPU: src/cpu/loss.cpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>

#include "diffcp/ops/backend.hpp"

namespace diffcp {

// logits [R, n] in place: y = multiplier l, then y = softcap tanh(y / softcap) when softcap > 0
// (DFlash2's output_multiplier and final_logit_softcapping; the identity by default). Its
// derivative is multiplier (1 - (y / softcap)^2), a function of y: the backward ops take the
// mapped logits and the map, and return d/dl.
void logit_map(float* logits, std::int64_t R, std::int64_t n, LogitMap map);

// logits: [R, n] columns [v0, v0 + n) of the vocabulary (device)  target: [R] global token ids
// stats: [R, 4] out: max, sum exp(l - max), first argmax (global id), target logit (0 outside the slice)
// weight: [R] or empty. Given, the chunk must be the whole vocabulary (v0 = 0) and the logits become
// dlogits = w (softmax - onehot) in place (lse = max + log sum from the same row).
// map: the logits are map's output (logit_map): the dlogits are d/dl of its input.
void cross_entropy(float* logits, std::int64_t R, std::int64_t n, std::int64_t v0, std::span<const std::int32_t> target,
                   std::span<double> stats, std::span<const double> weight = {}, LogitMap map = {});
// logits: [R, n] in place -> map'(y) (w (exp(y - lse) - [v0 + v == target]) + extra)  target, weight, lse: [R]
// extra: the sparse gradient on chosen logits (the candidate selector's; none by default).
void cross_entropy_backward(float* logits, std::int64_t R, std::int64_t n, std::int64_t v0,
                            std::span<const std::int32_t> target, std::span<const double> weight,
                            std::span<const double> lse, LogitMap map = {}, SparseLogitGrad extra = {});
// top_k's order: (a, ia) before (b, ib) when a is larger, or equal with the lower id; a NaN after
// every number (the order the ranks' candidates are merged in, drafter/lm_head.cpp).
inline bool logit_ranks_before(float a, std::int32_t ia, float b, std::int32_t ib) {
  if (std::isnan(a) || std::isnan(b)) return !std::isnan(a) || (std::isnan(b) && ia < ib);
  return a > b || (a == b && ia < ib);
}
// logits: [R, n] columns [v0, v0 + n)  values, ids: [R, k] out (host), 1 <= k <= n: each row's k
// largest logits, by value descending then id ascending (a NaN after every number), ids global.
void top_k(const float* logits, std::int64_t R, std::int64_t n, std::int64_t v0, std::span<float> values,
           std::span<std::int32_t> ids);

}  // namespace diffcp
