// Closed-form bytes one drafter attention layer (forward + backward) sends per rank, mean over
// ranks, for every CP method: the one copy that the layers report (predicted_bytes_per_layer(),
// asserted against the communicator's counters in the tests) and that `diffcp sim` predicts with.
//
// Legend: P ranks, Q query rows (N blocks x B), S context rows, L = S + Q rows a ring passes,
// n = Q n_q lse entries, qw = n_q d_h, kvw = n_kv d_h, H hidden. e = dtype_size(dtype) bytes per
// payload element (q, k, v, o, Y and their gradients); the softmax statistics lse and D are f32
// (4 bytes) whatever the payload dtype: they are log-domain sums that bf16 would round away.
// lse_reduces = lse_all_reduces(comm) (cp/lse_reduce.hpp): 1 with a fused log-sum-exp all-reduce
// (MPI), 2 with the max + sum fallback.
#pragma once

#include <cstdint>

#include "diffcp/core/dtype.hpp"
#include "diffcp/cp/attention_layer.hpp"

namespace diffcp {

// Split-KV (SPEC A.2): all-gather q (forward) and dO (backward) rows, reduce-scatter (or, owner
// merge, all-to-all) o and reduce-scatter dq partials: e (P-1)/P 2 Q (qw + w) bytes, w = qw with
// the owned o-projection (`oproj_owned`), H otherwise. The softmax statistics, f32:
//   oproj all:          (lse_reduces + 1) [Q, n_q] all-reduces (lse, then D): 4 (lse_reduces + 1)
//                       2 (P-1)/P n flat, or with the hierarchical collectives over `nodes` nodes
//                       4 (lse_reduces + 1) (2 n (N-1) + 3 n (P-N)) / P (so is oproj owned there);
//   owned, flat:        the owner merge: the lse partials' all-to-all and the [lse | D] all-gather
//                       of the owned rows, 4 * 3 (P-1)/P n (lse_reduces plays no part).
double splitkv_bytes_per_layer(const AttnLayerConfig& cfg, DType dtype, std::int64_t Q, int P, bool oproj_owned,
                               int lse_reduces, int nodes = 0);
// Ulysses: four all-to-alls (q, k|v forward; their gradients back) of (P-1)/P^2 of q and k|v.
double ulysses_bytes_per_layer(const AttnLayerConfig& cfg, DType dtype, std::int64_t Q, std::int64_t L, int P);
// Ring: P-1 hops of the k|v shard forward, 2(P-1) in the backward (k|v and dk|dv): (P-1)/P 2 L kvw
// (2 e + 4): the k|v hops in `dtype`, the dk|dv accumulators always f32 (summed over P-1 hops, as
// ring-flash-attention keeps them); f32: 3 (P-1)/P 2 L kvw elements.
double ring_bytes_per_layer(const AttnLayerConfig& cfg, DType dtype, std::int64_t L, int P);
// RingX: broadcast q and (backward) k|v rows, reduce the o partials and dk|dv: e (P-1)/P (2 Q qw +
// 4 L kvw); plus lse_reduces f32 all-reduces of each [Q_t, n_q] lse: 4 lse_reduces (P-1)/P 2 Q n_q.
double ringx_bytes_per_layer(const AttnLayerConfig& cfg, DType dtype, std::int64_t Q, std::int64_t L, int P,
                             int lse_reduces);
// LV-XAttn: queries and their (o, lse) and dq accumulators travel the ring: (P-1)/P Q ((3 e + 2 * 4)
// qw + 3 n_q 4): q twice and do in `dtype`, the running o and dq accumulators always f32 (summed
// over P-1 hops, as Ring's dk|dv); f32: (P-1)/P Q (5 qw + 3 n_q) elements.
double lvxattn_bytes_per_layer(const AttnLayerConfig& cfg, DType dtype, std::int64_t Q, int P);

}  // namespace diffcp
