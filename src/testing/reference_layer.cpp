#include "diffcp/testing/reference_layer.hpp"

#include <cmath>

#include "diffcp/testing/attention_reference.hpp"
#include "diffcp/core/error.hpp"

namespace diffcp {

namespace {

using Vec = std::vector<double>;

// C[M, N] = A[M, K] B[K, N]
Vec matmul(const Vec& A, const Vec& B, std::int64_t M, std::int64_t K, std::int64_t N) {
  Vec C(static_cast<std::size_t>(M * N), 0.0);
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t k = 0; k < K; ++k) {
      const double a = A[static_cast<std::size_t>(i * K + k)];
      for (std::int64_t j = 0; j < N; ++j) C[static_cast<std::size_t>(i * N + j)] += a * B[static_cast<std::size_t>(k * N + j)];
    }
  return C;
}
// C[M, K] = A[M, N] B[K, N]^T
Vec matmul_nt(const Vec& A, const Vec& B, std::int64_t M, std::int64_t N, std::int64_t K) {
  Vec C(static_cast<std::size_t>(M * K), 0.0);
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t k = 0; k < K; ++k) {
      double s = 0;
      for (std::int64_t j = 0; j < N; ++j) s += A[static_cast<std::size_t>(i * N + j)] * B[static_cast<std::size_t>(k * N + j)];
      C[static_cast<std::size_t>(i * K + k)] = s;
    }
  return C;
}
// C[K, N] = A[M, K]^T B[M, N]
Vec matmul_tn(const Vec& A, const Vec& B, std::int64_t M, std::int64_t K, std::int64_t N) {
  Vec C(static_cast<std::size_t>(K * N), 0.0);
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t k = 0; k < K; ++k) {
      const double a = A[static_cast<std::size_t>(i * K + k)];
      for (std::int64_t j = 0; j < N; ++j) C[static_cast<std::size_t>(k * N + j)] += a * B[static_cast<std::size_t>(i * N + j)];
    }
  return C;
}

Vec param(const AttnLayerParams& w, AttnLayerParams::Id id) { return {w[id], w[id] + w.size(id)}; }

// Per-head RMSNorm over d: y = x / sqrt(mean(x^2) + eps) * g.
Vec rmsnorm(const Vec& x, const Vec& g, std::int64_t d, double eps) {
  Vec y(x.size());
  for (std::size_t v = 0; v < x.size() / static_cast<std::size_t>(d); ++v) {
    double ss = 0;
    for (std::int64_t c = 0; c < d; ++c) ss += x[v * d + c] * x[v * d + c];
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(d) + eps);
    for (std::int64_t c = 0; c < d; ++c) y[v * d + c] = x[v * d + c] * r * g[static_cast<std::size_t>(c)];
  }
  return y;
}
// Backward of rmsnorm: returns dx, adds to dg.
Vec rmsnorm_bwd(const Vec& dy, const Vec& x, const Vec& g, std::int64_t d, double eps, Vec& dg) {
  Vec dx(x.size());
  for (std::size_t v = 0; v < x.size() / static_cast<std::size_t>(d); ++v) {
    double ss = 0, gx = 0;
    for (std::int64_t c = 0; c < d; ++c) ss += x[v * d + c] * x[v * d + c];
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(d) + eps);
    for (std::int64_t c = 0; c < d; ++c) gx += dy[v * d + c] * g[static_cast<std::size_t>(c)] * x[v * d + c];
    for (std::int64_t c = 0; c < d; ++c) {
      dg[static_cast<std::size_t>(c)] += dy[v * d + c] * x[v * d + c] * r;
      dx[v * d + c] = r * dy[v * d + c] * g[static_cast<std::size_t>(c)] - x[v * d + c] * r * r * r * gx / static_cast<double>(d);
    }
  }
  return dx;
}
// Rotate-half RoPE of [rows, heads, d] at per-row positions; sign = -1 is the inverse rotation.
void rope(Vec& x, const std::vector<std::int64_t>& pos, std::int64_t heads, std::int64_t d, double theta, double sign) {
  const std::int64_t half = d / 2;
  for (std::size_t r = 0; r < pos.size(); ++r)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < half; ++i) {
        const double ang = sign * static_cast<double>(pos[r]) * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(d));
        const std::size_t a = (r * static_cast<std::size_t>(heads) + static_cast<std::size_t>(h)) * static_cast<std::size_t>(d) + static_cast<std::size_t>(i);
        const double x1 = x[a], x2 = x[a + static_cast<std::size_t>(half)];
        x[a] = x1 * std::cos(ang) - x2 * std::sin(ang);
        x[a + static_cast<std::size_t>(half)] = x2 * std::cos(ang) + x1 * std::sin(ang);
      }
}

}  // namespace

// SPEC A.1's mask written out from the batch's own numbers (lengths, in-sample anchors, B), not
// from the library's BlockMask, so that a bug in the mask code cannot hide in the reference.
// Keys: the packed context (samples one after the other) and then the blocks' rows in block order
// (samples in order, anchors in order); block i of sample u with anchor a sees the context keys of
// sample u at in-sample positions < a, and its own B rows. A sliding layer (z-lab's
// DFlashDraftModel._attention_mask, written out again here): query slot r at position a + r sees
// key position y only if a + r - y < W, and y <= a + r when causal (else also y - (a + r) < W).
DenseVisibility spec_visibility(const PackedBatch& batch, KeyWindow layer) {
  const std::int64_t B = batch.block, W = layer.window;
  auto in_window = [&](std::int64_t qp, std::int64_t y) {
    if (layer.causal && y > qp) return false;
    if (W == 0) return true;
    return qp - y < W && (layer.causal || y - qp < W);
  };
  std::int64_t S = 0, N = 0;
  for (std::size_t u = 0; u < batch.lengths.size(); ++u) {
    S += batch.lengths[u];
    N += static_cast<std::int64_t>(batch.anchors[u].size());
  }
  DenseVisibility v{N, B, S + N * B, {}};
  v.visible.assign(static_cast<std::size_t>(N * B * v.key_rows), 0);
  std::int64_t i = 0, start = 0;
  for (std::size_t u = 0; u < batch.lengths.size(); ++u) {
    for (const std::int64_t a : batch.anchors[u]) {
      for (std::int64_t r = 0; r < B; ++r) {
        char* row = &v.visible[static_cast<std::size_t>((i * B + r) * v.key_rows)];
        for (std::int64_t x = 0; x < a; ++x) row[start + x] = in_window(a + r, x);          // context before the anchor
        for (std::int64_t k = 0; k < B; ++k) row[S + i * B + k] = in_window(a + r, a + k);  // its own block
      }
      ++i;
    }
    start += batch.lengths[u];
  }
  return v;
}

ReferenceLayerResult reference_attention_layer(const AttnLayerConfig& cfg, const PackedBatch& batch,
                                               const AttnLayerParams& w, const Vec& x, const Vec& ctx, const Vec& dy,
                                               KeyWindow layer) {
  using Params = AttnLayerParams;
  cfg.validate();
  const std::int64_t S = batch.context_rows(), Q = batch.query_rows(), H = cfg.hidden, d = cfg.d_h;
  const std::int64_t qw = cfg.q_width(), kvw = cfg.kv_width(), L = S + Q;
  DIFFCP_CHECK(static_cast<std::int64_t>(x.size()) == Q * H && static_cast<std::int64_t>(dy.size()) == Q * H &&
                   static_cast<std::int64_t>(ctx.size()) == S * H,
               "reference layer: x/dy must be [Q, H] = [", Q, ", ", H, "] and ctx [S, H] = [", S, ", ", H, "]");
  // Positions: context x of sample u at x - s_u; block i's slot k at a_i - s_u + k.
  std::vector<std::int64_t> qpos, kpos;
  for (std::size_t u = 0; u < batch.lengths.size(); ++u)
    for (std::int64_t t = 0; t < batch.lengths[u]; ++t) kpos.push_back(t);
  for (std::size_t u = 0; u < batch.anchors.size(); ++u)
    for (const std::int64_t a : batch.anchors[u])
      for (std::int64_t k = 0; k < batch.block; ++k) qpos.push_back(a + k);
  kpos.insert(kpos.end(), qpos.begin(), qpos.end());

  Vec U(ctx);
  U.insert(U.end(), x.begin(), x.end());  // [ctx; x]: [L, H]
  const Vec Wq = param(w, Params::wq), Wk = param(w, Params::wk), Wv = param(w, Params::wv), Wo = param(w, Params::wo), bo = param(w, Params::bo);
  const Vec gq = param(w, Params::q_norm), gk = param(w, Params::k_norm);

  const Vec q_lin = matmul(x, Wq, Q, H, qw), k_lin = matmul(U, Wk, L, H, kvw);
  Vec q = rmsnorm(q_lin, gq, d, cfg.rms_eps), k = rmsnorm(k_lin, gk, d, cfg.rms_eps);
  rope(q, qpos, cfg.n_q, d, cfg.rope_theta, 1.0);
  rope(k, kpos, cfg.n_kv, d, cfg.rope_theta, 1.0);
  const Vec v = matmul(U, Wv, L, H, kvw);

  ReferenceLayerResult r;
  const DenseVisibility mask = spec_visibility(batch, layer);  // not the library's BlockMask
  const RefShape shape{cfg.n_q, cfg.n_kv, cfg.d_h};
  Vec o;
  reference_attention_forward(mask, shape, q, k, v, o, r.lse);
  r.y = matmul(o, Wo, Q, qw, H);
  for (std::int64_t i = 0; i < Q; ++i)
    for (std::int64_t c = 0; c < H; ++c) r.y[static_cast<std::size_t>(i * H + c)] += bo[static_cast<std::size_t>(c)];

  // Backward.
  const Params layout(cfg);
  r.grad.assign(layout.all().size(), 0.0);
  auto put = [&](Params::Id id, const Vec& g) {
    const std::size_t off = static_cast<std::size_t>(layout[id] - layout[Params::wq]);
    for (std::size_t j = 0; j < g.size(); ++j) r.grad[off + j] = g[j];
  };
  const Vec dout = matmul_nt(dy, Wo, Q, H, qw);
  put(Params::wo, matmul_tn(o, dy, Q, qw, H));
  Vec dbo(static_cast<std::size_t>(H), 0.0);
  for (std::int64_t i = 0; i < Q; ++i)
    for (std::int64_t c = 0; c < H; ++c) dbo[static_cast<std::size_t>(c)] += dy[static_cast<std::size_t>(i * H + c)];
  put(Params::bo, dbo);
  Vec dq, dk, dv;
  reference_attention_backward(mask, shape, q, k, v, dout, r.lse, reference_delta(dout, o, Q * cfg.n_q, d), dq, dk, dv);
  rope(dq, qpos, cfg.n_q, d, cfg.rope_theta, -1.0);
  rope(dk, kpos, cfg.n_kv, d, cfg.rope_theta, -1.0);
  Vec dgq(static_cast<std::size_t>(d), 0.0), dgk(static_cast<std::size_t>(d), 0.0);
  const Vec dq_lin = rmsnorm_bwd(dq, q_lin, gq, d, cfg.rms_eps, dgq);
  const Vec dk_lin = rmsnorm_bwd(dk, k_lin, gk, d, cfg.rms_eps, dgk);
  put(Params::q_norm, dgq);
  put(Params::k_norm, dgk);
  put(Params::wq, matmul_tn(x, dq_lin, Q, H, qw));
  put(Params::wk, matmul_tn(U, dk_lin, L, H, kvw));
  put(Params::wv, matmul_tn(U, dv, L, H, kvw));
  Vec dU = matmul_nt(dk_lin, Wk, L, kvw, H);
  const Vec dU_v = matmul_nt(dv, Wv, L, kvw, H);
  for (std::size_t j = 0; j < dU.size(); ++j) dU[j] += dU_v[j];
  r.dctx.assign(dU.begin(), dU.begin() + S * H);
  r.dx = matmul_nt(dq_lin, Wq, Q, qw, H);
  for (std::int64_t j = 0; j < Q * H; ++j) r.dx[static_cast<std::size_t>(j)] += dU[static_cast<std::size_t>(S * H + j)];
  return r;
}

}  // namespace diffcp
