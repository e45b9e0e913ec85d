// Closed-form bytes one drafter attention layer (forward + backward) sends per rank, mean over
// ranks, for every CP method: the one copy that the layers report (predicted_bytes_per_layer(),
// asserted against the communicator's counters in the tests) and that `diffcp sim` predicts with.
//
// Legend: P ranks, Q query rows (N blocks x B), S context rows, L = S + Q rows a ring passes,
// n = Q n_q lse entries, qw = n_q d_h, kvw = n_kv d_h, H hidden; elem = bytes per element (4: f32).
#pragma once

#include <cstdint>

#include "diffcp/cp/attention_layer.hpp"

namespace diffcp {

// Split-KV (SPEC A.2): all-gather q (forward) and dO (backward) rows, reduce-scatter o / dq
// partials: (P-1)/P 2 Q (qw + w) elements, w = qw with the owned o-projection (`oproj_owned`), H
// otherwise; plus the lse and D all-reduces: 2 x 2 (P-1)/P n flat, or with the hierarchical
// collectives over `nodes` nodes 2 (2 n (N-1) + 3 n (P-N)) / P.
double splitkv_bytes_per_layer(const AttnLayerConfig& cfg, std::int64_t Q, int P, bool oproj_owned, int nodes = 0,
                               int elem = 4);
// Ulysses: four all-to-alls (q, k|v forward; their gradients back) of (P-1)/P^2 of q and k|v.
double ulysses_bytes_per_layer(const AttnLayerConfig& cfg, std::int64_t Q, std::int64_t L, int P, int elem = 4);
// Ring: P-1 hops of the k|v shard forward, 2(P-1) in the backward (k|v and dk|dv): 3 (P-1)/P 2 L kvw.
double ring_bytes_per_layer(const AttnLayerConfig& cfg, std::int64_t L, int P, int elem = 4);
// RingX: broadcast q and (backward) dO rows + lse, reduce the o partials and dq/dk|dv.
double ringx_bytes_per_layer(const AttnLayerConfig& cfg, std::int64_t Q, std::int64_t L, int P, int elem = 4);
// LV-XAttn: queries and their (o, lse) accumulators travel the ring: (P-1)/P Q (5 qw + 3 n_q).
double lvxattn_bytes_per_layer(const AttnLayerConfig& cfg, std::int64_t Q, int P, int elem = 4);

}  // namespace diffcp
