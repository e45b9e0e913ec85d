// Cross-entropy over a chunk of logits as backend ops (the drafter's LM head, drafter/lm_head.hpp).
// Token ids, weights and the per-row results are host metadata, O(rows); the logits are device
// memory. CPU: src/cpu/loss.cpp.
#pragma once

#include <cstdint>
#include <span>

#include "diffcp/ops/backend.hpp"

namespace diffcp {

// logits: [R, n] columns [v0, v0 + n) of the vocabulary (device)  target: [R] global token ids
// stats: [R, 4] out: max, sum exp(l - max), first argmax (global id), target logit (0 outside the slice)
// weight: [R] or empty. Given, the chunk must be the whole vocabulary (v0 = 0) and the logits become
// dlogits = w (softmax - onehot) in place (lse = max + log sum from the same row).
void cross_entropy(float* logits, std::int64_t R, std::int64_t n, std::int64_t v0, std::span<const std::int32_t> target,
                   std::span<double> stats, std::span<const double> weight = {});
// logits: [R, n] in place -> w (exp(l - lse) - [v0 + v == target])  target, weight, lse: [R]
void cross_entropy_backward(float* logits, std::int64_t R, std::int64_t n, std::int64_t v0,
                            std::span<const std::int32_t> target, std::span<const double> weight,
                            std::span<const double> lse);

}  // namespace diffcp
