#include "diffcp/cp/bytes.hpp"

namespace diffcp {

double splitkv_bytes_per_layer(const AttnLayerConfig& cfg, std::int64_t Q_rows, int P_ranks, bool oproj_owned, int nodes,
                               int elem) {
  const double P = P_ranks, Q = static_cast<double>(Q_rows), n = Q * static_cast<double>(cfg.n_q);
  const double w = static_cast<double>(oproj_owned ? cfg.q_width() : cfg.hidden);
  const double rows = (P - 1) / P * 2 * Q * (static_cast<double>(cfg.q_width()) + w);
  if (nodes <= 0) return elem * (rows + 2 * 2 * (P - 1) / P * n);
  const double N = nodes;
  return elem * (rows + 2 * (2 * n * (N - 1) + 3 * n * (P - N)) / P);
}

double ulysses_bytes_per_layer(const AttnLayerConfig& cfg, std::int64_t Q_rows, std::int64_t L_rows, int P_ranks, int elem) {
  const double P = P_ranks, Q = static_cast<double>(Q_rows), L = static_cast<double>(L_rows);
  return elem * (P - 1) / (P * P) * 4 * (Q * static_cast<double>(cfg.q_width()) + L * static_cast<double>(cfg.kv_width()));
}

double ring_bytes_per_layer(const AttnLayerConfig& cfg, std::int64_t L_rows, int P_ranks, int elem) {
  const double P = P_ranks, L = static_cast<double>(L_rows);
  return elem * 3 * (P - 1) / P * 2 * L * static_cast<double>(cfg.kv_width());
}

double ringx_bytes_per_layer(const AttnLayerConfig& cfg, std::int64_t Q_rows, std::int64_t L_rows, int P_ranks, int elem) {
  const double P = P_ranks, Q = static_cast<double>(Q_rows), L = static_cast<double>(L_rows);
  const double n_q = static_cast<double>(cfg.n_q), qw = static_cast<double>(cfg.q_width());
  return elem * (P - 1) / P * (2 * Q * qw + 2 * Q * n_q + 4 * L * static_cast<double>(cfg.kv_width()));
}

double lvxattn_bytes_per_layer(const AttnLayerConfig& cfg, std::int64_t Q_rows, int P_ranks, int elem) {
  const double P = P_ranks, Q = static_cast<double>(Q_rows);
  return elem * (P - 1) / P * Q * static_cast<double>(5 * cfg.q_width() + 3 * cfg.n_q);
}

}  // namespace diffcp
