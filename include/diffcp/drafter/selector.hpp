// DFlash2's candidate selector at drafting (issue #67; z-lab's CandidateSelector.select): the
// drafted tokens of one block chosen among each row's top-K logits, scored with the previous
// drafted token through two codebooks.
//
// Legend: n draft rows (the block's rows 1 .. b-1), H hidden, V vocabulary, K = selector_top_k,
//         r = selector_rank; A = predecessor codebook [V, r], Bc = successor codebook [V, r],
//         P = hidden projection [H, r] (DrafterLayout sel_pred, sel_succ, sel_proj).
// Per row i, in order:
//   u = logits[i] * output_multiplier, then cap * tanh(u / cap) when logit_softcap = cap > 0
//   (U, C) = the K largest u and their token ids, by descending u (ties: lower id first)
//   S_j = U_j + sum over r of A[prev, r] (h_i P)[r] Bc[C_j, r]     (in double)
//   greedy (temperature 0): idx = the first maximum of S; else q = softmax(S / temperature) and
//   idx is drawn from q (no top-k / top-p on q, as the reference)
//   prev = C[idx] (prev starts as the anchor: the block's verified first token)
// A verifier accepts a drafted token x with u q(x) < p(x) and on rejection draws from
// max(0, p - q scattered over C) renormalised (p when no mass is left): speculative sampling with
// q zero outside the candidates, which diffcp.speculative does by scattering q into the vocabulary.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "diffcp/drafter/config.hpp"

namespace diffcp {

struct Proposal {
  std::vector<std::int32_t> path;        // [n] the drafted tokens
  std::vector<std::int32_t> candidates;  // [n, K] each row's candidates (the order above)
  std::vector<float> q;                  // [n, K] the draw's distribution (empty when greedy)
};

// params: [DrafterLayout(cfg).total] host  hidden: [n, H] host  logits: [n, V] host (the target's LM
// head on the hidden rows, before the multiplier and the cap). Needs cfg.has_selector(); anchor in
// [0, V); temperature >= 0; seed: the draws' (std::mt19937_64). Errors name the bad value.
Proposal propose(const DrafterConfig& cfg, std::span<const float> params, std::span<const float> hidden,
                 std::span<const float> logits, std::int32_t anchor, double temperature, std::uint64_t seed);

}  // namespace diffcp
