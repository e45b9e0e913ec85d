#include "diffcp/testing/attention_reference.hpp"

#include <cmath>
#include <limits>

#include "diffcp/core/error.hpp"

namespace diffcp {

namespace {
double scale_of(const RefShape& s) {
  return s.softmax_scale > 0 ? s.softmax_scale : 1.0 / std::sqrt(static_cast<double>(s.d_h));
}
void check_size(const std::vector<double>& x, std::int64_t n, const char* name) {
  DIFFCP_CHECK(static_cast<std::int64_t>(x.size()) == n, "reference: ", name, " has ", x.size(),
               " elements, expected ", n);
}
void check_size_char(const std::vector<char>& x, std::int64_t n) {
  DIFFCP_CHECK(static_cast<std::int64_t>(x.size()) == n, "reference: visibility has ", x.size(), " cells, expected ", n);
}
double dot(const double* a, const double* b, std::int64_t n) {
  double s = 0;
  for (std::int64_t c = 0; c < n; ++c) s += a[c] * b[c];
  return s;
}
}  // namespace

std::vector<char> reference_visibility(const BlockMask& mask) {
  const std::int64_t N = mask.num_blocks(), Lk = mask.key_rows(), B = mask.block();
  const KeyWindow& win = mask.window();
  std::vector<std::int64_t> row_pos(static_cast<std::size_t>(Lk), -1), row_block(static_cast<std::size_t>(Lk), -1);
  std::vector<std::int64_t> row_slot(static_cast<std::size_t>(Lk), -1);
  for (const ContextSegment& g : mask.segments())
    for (std::int64_t r = 0; r < g.len; ++r) row_pos[static_cast<std::size_t>(g.row + r)] = g.pos + r;
  for (std::int64_t i = 0; i < N; ++i) {
    const MaskBlock& b = mask.blocks()[static_cast<std::size_t>(i)];
    if (b.own_row >= 0)
      for (std::int64_t r = 0; r < B; ++r) {
        row_block[static_cast<std::size_t>(b.own_row + r)] = i;
        row_slot[static_cast<std::size_t>(b.own_row + r)] = r;
      }
  }
  std::vector<char> vis(static_cast<std::size_t>(N * B * Lk), 0);
  for (std::int64_t i = 0; i < N; ++i) {
    const MaskBlock& b = mask.blocks()[static_cast<std::size_t>(i)];
    for (std::int64_t r = 0; r < B; ++r)
      for (std::int64_t j = 0; j < Lk; ++j) {
        const std::int64_t x = row_pos[static_cast<std::size_t>(j)];
        const bool ctx = x >= 0 && b.ctx_begin <= x && x < b.ctx_end;  // same sample, before anchor
        const bool own = row_block[static_cast<std::size_t>(j)] == i;    // own block
        // the window, by position: query slot r at a + r, context x at x, own slot at a + slot
        const std::int64_t y = own ? b.ctx_end + row_slot[static_cast<std::size_t>(j)] : x;
        vis[static_cast<std::size_t>((i * B + r) * Lk + j)] = (ctx || own) && win.sees(b.ctx_end + r, y);
      }
  }
  return vis;
}

DenseVisibility dense_visibility(const BlockMask& mask) {
  return {mask.num_blocks(), mask.block(), mask.key_rows(), reference_visibility(mask)};
}

void reference_attention_forward(const BlockMask& mask, const RefShape& s, const std::vector<double>& q,
                                 const std::vector<double>& k, const std::vector<double>& v,
                                 std::vector<double>& o, std::vector<double>& lse) {
  reference_attention_forward(dense_visibility(mask), s, q, k, v, o, lse);
}

void reference_attention_backward(const BlockMask& mask, const RefShape& s, const std::vector<double>& q,
                                  const std::vector<double>& k, const std::vector<double>& v,
                                  const std::vector<double>& dout, const std::vector<double>& lse,
                                  const std::vector<double>& delta, std::vector<double>& dq,
                                  std::vector<double>& dk, std::vector<double>& dv) {
  reference_attention_backward(dense_visibility(mask), s, q, k, v, dout, lse, delta, dq, dk, dv);
}

void reference_attention_forward(const DenseVisibility& dv, const RefShape& s, const std::vector<double>& q,
                                 const std::vector<double>& k, const std::vector<double>& v,
                                 std::vector<double>& o, std::vector<double>& lse) {
  const std::int64_t Q = dv.query_rows(), Lk = dv.key_rows, d = s.d_h;
  const std::int64_t G = s.n_q / s.n_kv;
  check_size(q, Q * s.n_q * d, "q");
  check_size(k, Lk * s.n_kv * d, "k");
  check_size(v, Lk * s.n_kv * d, "v");
  check_size_char(dv.visible, Q * Lk);
  const double scale = scale_of(s);
  const std::vector<char>& vis = dv.visible;
  o.assign(static_cast<std::size_t>(Q * s.n_q * d), 0.0);
  lse.assign(static_cast<std::size_t>(Q * s.n_q), -std::numeric_limits<double>::infinity());
  std::vector<double> score(static_cast<std::size_t>(Lk));
  for (std::int64_t row = 0; row < Q; ++row)
    for (std::int64_t h = 0; h < s.n_q; ++h) {
      const std::int64_t hk = h / G;
      const double* qr = &q[static_cast<std::size_t>((row * s.n_q + h) * d)];
      double mx = -std::numeric_limits<double>::infinity();
      for (std::int64_t j = 0; j < Lk; ++j)
        if (vis[static_cast<std::size_t>(row * Lk + j)]) {
          score[static_cast<std::size_t>(j)] = scale * dot(qr, &k[static_cast<std::size_t>((j * s.n_kv + hk) * d)], d);
          mx = std::max(mx, score[static_cast<std::size_t>(j)]);
        }
      if (mx == -std::numeric_limits<double>::infinity()) continue;  // no visible key: o = 0, lse = -inf
      double sum = 0;
      for (std::int64_t j = 0; j < Lk; ++j)
        if (vis[static_cast<std::size_t>(row * Lk + j)]) sum += std::exp(score[static_cast<std::size_t>(j)] - mx);
      const double l = mx + std::log(sum);
      lse[static_cast<std::size_t>(row * s.n_q + h)] = l;
      double* orow = &o[static_cast<std::size_t>((row * s.n_q + h) * d)];
      for (std::int64_t j = 0; j < Lk; ++j)
        if (vis[static_cast<std::size_t>(row * Lk + j)]) {
          const double p = std::exp(score[static_cast<std::size_t>(j)] - l);
          const double* vr = &v[static_cast<std::size_t>((j * s.n_kv + hk) * d)];
          for (std::int64_t c = 0; c < d; ++c) orow[c] += p * vr[c];
        }
    }
}

void reference_attention_backward(const DenseVisibility& visibility, const RefShape& s, const std::vector<double>& q,
                                  const std::vector<double>& k, const std::vector<double>& v,
                                  const std::vector<double>& dout, const std::vector<double>& lse,
                                  const std::vector<double>& delta, std::vector<double>& dq,
                                  std::vector<double>& dk, std::vector<double>& dv) {
  const std::int64_t Q = visibility.query_rows(), Lk = visibility.key_rows, d = s.d_h;
  const std::int64_t G = s.n_q / s.n_kv;
  check_size(q, Q * s.n_q * d, "q");
  check_size(dout, Q * s.n_q * d, "do");
  check_size(k, Lk * s.n_kv * d, "k");
  check_size(v, Lk * s.n_kv * d, "v");
  check_size(lse, Q * s.n_q, "lse");
  check_size(delta, Q * s.n_q, "delta");
  check_size_char(visibility.visible, Q * Lk);
  const double scale = scale_of(s);
  const std::vector<char>& vis = visibility.visible;
  dq.assign(q.size(), 0.0);
  dk.assign(k.size(), 0.0);
  dv.assign(v.size(), 0.0);
  for (std::int64_t row = 0; row < Q; ++row)
    for (std::int64_t h = 0; h < s.n_q; ++h) {
      const std::int64_t hk = h / G;
      const std::size_t rh = static_cast<std::size_t>(row * s.n_q + h);
      const double* qr = &q[rh * static_cast<std::size_t>(d)];
      const double* dor = &dout[rh * static_cast<std::size_t>(d)];
      double* dqr = &dq[rh * static_cast<std::size_t>(d)];
      for (std::int64_t j = 0; j < Lk; ++j) {
        if (!vis[static_cast<std::size_t>(row * Lk + j)]) continue;
        const std::size_t jk = static_cast<std::size_t>((j * s.n_kv + hk) * d);
        const double p = std::exp(scale * dot(qr, &k[jk], d) - lse[rh]);
        const double ds = p * (dot(dor, &v[jk], d) - delta[rh]);
        for (std::int64_t c = 0; c < d; ++c) {
          dv[jk + static_cast<std::size_t>(c)] += p * dor[c];
          dqr[c] += scale * ds * k[jk + static_cast<std::size_t>(c)];
          dk[jk + static_cast<std::size_t>(c)] += scale * ds * qr[c];
        }
      }
    }
}

std::vector<double> reference_delta(const std::vector<double>& dout, const std::vector<double>& o,
                                    std::int64_t rows_heads, std::int64_t d_h) {
  check_size(dout, rows_heads * d_h, "do");
  check_size(o, rows_heads * d_h, "o");
  std::vector<double> delta(static_cast<std::size_t>(rows_heads));
  for (std::int64_t r = 0; r < rows_heads; ++r)
    delta[static_cast<std::size_t>(r)] = dot(&dout[static_cast<std::size_t>(r * d_h)], &o[static_cast<std::size_t>(r * d_h)], d_h);
  return delta;
}

}  // namespace diffcp
