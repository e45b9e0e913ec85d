#include "diffcp/cp/bytes.hpp"

namespace diffcp {

namespace {
constexpr double kStat = 4;  // bytes of an lse / D entry: f32 whatever the payload dtype
double elem(DType dtype) { return static_cast<double>(dtype_size(dtype)); }
}  // namespace

double splitkv_bytes_per_layer(const AttnLayerConfig& cfg, DType dtype, std::int64_t Q_rows, int P_ranks, bool oproj_owned,
                               int lse_reduces, int nodes) {
  const double P = P_ranks, Q = static_cast<double>(Q_rows), n = Q * static_cast<double>(cfg.n_q);
  const double w = static_cast<double>(oproj_owned ? cfg.q_width() : cfg.hidden);
  const double rows = elem(dtype) * (P - 1) / P * 2 * Q * (static_cast<double>(cfg.q_width()) + w);
  if (oproj_owned && nodes <= 0) return rows + kStat * 3 * (P - 1) / P * n;  // owner merge: lse, then [lse | D]
  const double reduces = lse_reduces + 1;  // the lse all-reduce(s), then D
  if (nodes <= 0) return rows + kStat * reduces * 2 * (P - 1) / P * n;
  const double N = nodes;
  return rows + kStat * reduces * (2 * n * (N - 1) + 3 * n * (P - N)) / P;
}

double ulysses_bytes_per_layer(const AttnLayerConfig& cfg, DType dtype, std::int64_t Q_rows, std::int64_t L_rows, int P_ranks) {
  const double P = P_ranks, Q = static_cast<double>(Q_rows), L = static_cast<double>(L_rows);
  return elem(dtype) * (P - 1) / (P * P) * 4 *
         (Q * static_cast<double>(cfg.q_width()) + L * static_cast<double>(cfg.kv_width()));
}

double ring_bytes_per_layer(const AttnLayerConfig& cfg, DType dtype, std::int64_t L_rows, int P_ranks) {
  const double P = P_ranks, L = static_cast<double>(L_rows);
  // K/V shards hop twice (forward, backward) in `dtype`; the dk/dv accumulators once, always in f32.
  return (2 * elem(dtype) + elem(DType::f32)) * (P - 1) / P * 2 * L * static_cast<double>(cfg.kv_width());
}

double ringx_bytes_per_layer(const AttnLayerConfig& cfg, DType dtype, std::int64_t Q_rows, std::int64_t L_rows, int P_ranks,
                             int lse_reduces) {
  const double P = P_ranks, Q = static_cast<double>(Q_rows), L = static_cast<double>(L_rows);
  const double n_q = static_cast<double>(cfg.n_q), qw = static_cast<double>(cfg.q_width());
  return (P - 1) / P *
         (elem(dtype) * (2 * Q * qw + 4 * L * static_cast<double>(cfg.kv_width())) + kStat * lse_reduces * 2 * Q * n_q);
}

double lvxattn_bytes_per_layer(const AttnLayerConfig& cfg, DType dtype, std::int64_t Q_rows, int P_ranks) {
  const double P = P_ranks, Q = static_cast<double>(Q_rows);
  // q (forward, backward) and do in `dtype`; the running o and the dq accumulator always f32.
  return (P - 1) / P * Q *
         ((3 * elem(dtype) + 2 * elem(DType::f32)) * static_cast<double>(cfg.q_width()) +
          kStat * 3 * static_cast<double>(cfg.n_q));
}

}  // namespace diffcp
