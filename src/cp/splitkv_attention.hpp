// The attention core of Split-KV (SPEC A.2), without the projections: on rank p of P,
//   forward:  q = AllGather(q_p); (o_p, lse_p) = Attn(q, k_p, v_p; M_p) over LOCAL keys;
//             lse = log sum_p exp(lse_p) (two Q x n_q all-reduces: max, then sum of exp);
//             obar_p = exp(lse_p - lse) * o_p; o_p = ReduceScatter_sum(obar_p) (own rows).
//   backward: do = AllGather(do_p); D = AllReduce_sum(rowsum(do * obar_p));
//             (dq^(p), dk_p, dv_p) = AttnBwd(q, k_p, v_p, do; lse, D);
//             dq_p = ReduceScatter_sum(dq^(p)); dk_p, dv_p never leave the rank.
// Only Q-sized tensors cross ranks; the result equals single-device attention because the local
// key sets partition the full key set.
//
// Legend: Q = N*B query rows of ALL blocks; rank r owns the query rows
// [sum(query_rows[0..r)), +query_rows[r]) (blocks in global order, a contiguous range per rank);
// Q_p = query_rows[p]; L_k = key rows this rank holds (local_mask.key_rows()).
#pragma once

#include <vector>

#include "attention/mask.hpp"
#include "comm/communicator.hpp"
#include "core/tensor.hpp"

namespace diffcp {

class SplitKVAttention {
 public:
  // Collective-free. local_mask describes this rank's key rows and all N blocks; query_rows has
  // one entry per rank (each a multiple of B, summing to Q).
  SplitKVAttention(Communicator& comm, const BlockMask& local_mask, std::int64_t n_q,
                   std::int64_t n_kv, std::int64_t d_h, std::vector<std::int64_t> query_rows);

  // Collective (every rank of comm, in this order: forward then backward).
  //   q_p: [Q_p, n_q, d_h]   k_p, v_p: [L_k, n_kv, d_h]   o_p: [Q_p, n_q, d_h] out
  // k_p and v_p must stay alive and unchanged until backward() returns.
  void forward(HeadRows<const float> q_p, HeadRows<const float> k_p, HeadRows<const float> v_p,
               HeadRows<float> o_p);
  //   do_p: [Q_p, n_q, d_h]   dq_p: [Q_p, n_q, d_h] out   dk_p, dv_p: [L_k, n_kv, d_h] out
  void backward(HeadRows<const float> do_p, HeadRows<float> dq_p, HeadRows<float> dk_p,
                HeadRows<float> dv_p);

  const std::vector<float>& global_lse() const { return lse_; }  // [Q, n_q], after forward

 private:
  std::vector<std::size_t> counts(std::int64_t per_row) const;  // per-rank element counts
  Communicator& comm_;
  const BlockMask& mask_;
  std::int64_t n_q_, n_kv_, d_h_, Q_;
  std::vector<std::int64_t> query_rows_;
  // Saved by forward for backward.
  std::vector<float> q_, obar_, lse_;  // q: [Q, n_q, d_h], obar_p: [Q, n_q, d_h], lse: [Q, n_q]
  HeadRows<const float> k_{}, v_{};
};

}  // namespace diffcp
