// The log-sum-exp merge of per-rank softmax statistics (SPEC A.2 step 4) from the collectives any
// backend has: every rank holds lse_p (its keys' log-sum-exp per query row and head) and gets
//   lse = log sum_p exp(lse_p) = m + log sum_p exp(lse_p - m),  m = max_p lse_p
// (-inf where no rank saw a key). When the backend has the fused reduction
// (Communicator::supports_reduce(ReduceOp::logsumexp, f32): MPI's user-defined operator) it is one
// all-reduce; otherwise two: a max, then a sum of the rescaled exponentials (NCCL's way).
#pragma once

#include <span>

#include "diffcp/comm/communicator.hpp"

namespace diffcp {

enum class LseReduce : std::uint8_t {
  best,      // fused when the backend has it, else max + sum
  fallback,  // max + sum (what a backend without the fused operator runs; tests compare the two)
};

// lse: [n] in/out in the active backend's memory, the same n on every rank. Collective over
// `comm`.
void all_reduce_lse(Communicator& comm, std::span<float> lse, CollAlgo algo = CollAlgo::flat,
                    LseReduce how = LseReduce::best);

// How many [n]-element f32 all-reduces all_reduce_lse issues on `comm`: 1 fused, 2 otherwise (the
// closed-form byte counts multiply the all-reduce term by it).
int lse_all_reduces(const Communicator& comm, LseReduce how = LseReduce::best);

}  // namespace diffcp
