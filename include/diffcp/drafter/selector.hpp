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
//
// Training (selector_loss; NeMo AutoModel's recipe, z-lab published none): teacher forcing, prev =
// the true previous token (the anchor for row 1), the candidates (U, C) of the LM head's mapped
// logits (lm_head.hpp forward), and per row with weight w > 0 whose gold token is among C at slot
// g: lambda w (logsumexp(S) - S_g). A row whose gold token is not a candidate adds no loss (the
// selector never sees it at drafting: inserting it, as SpecForge does, would train a score for a
// candidate that does not exist there) and counts against candidate_recall. Every term of S is
// differentiated: U (into the LM head's logits), the codebook rows used, P and the hidden row.
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

// Codebook rows by token: tokens [m] ascending, unique; rows [m, r] (host).
struct CodebookRows {
  std::span<const std::int32_t> tokens;
  std::span<const float> rows;
};

// The selector's loss over n rows (teacher forcing) and its gradients, host, O(n K r).
//   hp: [n, r] the rows' h P   values, candidates: [n, K] (lm_head.hpp forward's, best first)
//   prev, gold: [n] tokens     weight: [n] (0: no loss)   lambda: the loss's weight
//   pred: rows of A holding every prev   succ: rows of Bc holding every candidate (of every row:
//   the choice is made for rows of weight 0 too)
struct SelectorLoss {
  double loss_sum = 0;                 // lambda * sum of w CE over the rows with a covered gold
  std::int64_t rows = 0, covered = 0;  // rows with w > 0; those whose gold is a candidate
  std::int64_t correct = 0;            // rows with w > 0 whose first max of S is the gold token
  std::vector<std::int32_t> choice;    // [n] every row's candidate of S's first maximum (the greedy draft)
  std::vector<double> dvalues;         // [n, K] d loss / d U
  std::vector<float> dhp;              // [n, r] d loss / d (h P)
  std::vector<float> dpred, dsucc;     // [m, r] d loss / d the rows of pred, of succ (their order)
};
SelectorLoss selector_loss(const DrafterConfig& cfg, double lambda, std::span<const float> hp,
                           std::span<const float> values, std::span<const std::int32_t> candidates,
                           std::span<const std::int32_t> prev, std::span<const std::int32_t> gold,
                           std::span<const double> weight, CodebookRows pred, CodebookRows succ);

}  // namespace diffcp
