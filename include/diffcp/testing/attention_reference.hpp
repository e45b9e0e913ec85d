// Plain fp64 reference of the block-sparse attention: dense over every (query row, key row) pair,
// visibility evaluated straight from SPEC A.1's definition. Used only by tests and --check.
// All tensors are contiguous: q, o, do, dq: [Q, n_q, d_h]; k, v, dk, dv: [L_k, n_kv, d_h];
// lse, delta: [Q, n_q]. softmax_scale <= 0 means 1/sqrt(d_h).
#pragma once

#include <vector>

#include "diffcp/attention/mask.hpp"

namespace diffcp {

struct RefShape {
  std::int64_t n_q, n_kv, d_h;
  double softmax_scale = 0.0;
};

// visible[q * L_k + j]: does query row q (row q % B of block q / B) see local key row j (dense,
// for reference use only), the mask's KeyWindow applied cell by cell.
std::vector<char> reference_visibility(const BlockMask& mask);

// Which key rows each query row sees, dense: [Q, key_rows], cell q * key_rows + j; the queries
// are blocks x block rows in block order. From a BlockMask (reference_visibility), or built
// straight from SPEC A.1 where the reference must not share the library's mask code
// (testing/reference_layer.hpp).
struct DenseVisibility {
  std::int64_t blocks = 0, block = 0, key_rows = 0;
  std::vector<char> visible;
  std::int64_t query_rows() const { return blocks * block; }
};
DenseVisibility dense_visibility(const BlockMask& mask);

void reference_attention_forward(const DenseVisibility& vis, const RefShape& shape,
                                 const std::vector<double>& q, const std::vector<double>& k,
                                 const std::vector<double>& v, std::vector<double>& o,
                                 std::vector<double>& lse);
void reference_attention_forward(const BlockMask& mask, const RefShape& shape,
                                 const std::vector<double>& q, const std::vector<double>& k,
                                 const std::vector<double>& v, std::vector<double>& o,
                                 std::vector<double>& lse);

// With the GLOBAL lse and delta (as the kernel's backward): P = exp(scale*q.k - lse),
// dS = P * (do.v - delta); dq = scale*dS k, dk = scale*dS^T q, dv = P^T do.
void reference_attention_backward(const DenseVisibility& vis, const RefShape& shape,
                                  const std::vector<double>& q, const std::vector<double>& k,
                                  const std::vector<double>& v, const std::vector<double>& dout,
                                  const std::vector<double>& lse, const std::vector<double>& delta,
                                  std::vector<double>& dq, std::vector<double>& dk,
                                  std::vector<double>& dv);
void reference_attention_backward(const BlockMask& mask, const RefShape& shape,
                                  const std::vector<double>& q, const std::vector<double>& k,
                                  const std::vector<double>& v, const std::vector<double>& dout,
                                  const std::vector<double>& lse, const std::vector<double>& delta,
                                  std::vector<double>& dq, std::vector<double>& dk,
                                  std::vector<double>& dv);

// delta = rowsum(do * o): [Q, n_q]
std::vector<double> reference_delta(const std::vector<double>& dout, const std::vector<double>& o,
                                    std::int64_t rows_heads, std::int64_t d_h);

}  // namespace diffcp
