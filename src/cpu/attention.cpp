// CPU block-sparse attention (attention/attention.hpp, SPEC A.1/A.2): flash-attention tiling with
// online softmax over the visible key ranges of the DFlash mask; tile GEMMs call sgemm (gemm.cpp)
// directly. Shapes: q, o, do, dq: [Q, n_q, d_h]  k, v, dk, dv: [L_k, n_kv, d_h]  lse, delta: [Q*n_q].
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "cpu_backend.hpp"
#include "diffcp/attention/mask.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/core/fastmath.hpp"
#include "diffcp/core/parallel.hpp"

namespace diffcp::cpu {

namespace {

constexpr std::int64_t kKeyTile = 256;  // keys per tile (measured: 256 and 512 tie, 128 is slower)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// p[j] = 2^(p[j] - shift) for j < n; returns their sum. Out of line: inlined into the tile loops,
// GCC 12 did not vectorise it.
[[gnu::noinline]] float exp2_shifted(float* __restrict p, std::int64_t n, float shift) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (std::int64_t j = 0; j < n; ++j) {
    p[j] = fast_exp2(p[j] - shift);
    sum += p[j];
  }
  return sum;
}

struct Dims {
  std::int64_t Q, Lk, n_q, n_kv, d, G, B, GB;
  float scale;
};

void check_rows(const char* name, HeadRows<const float> t, std::int64_t rows, std::int64_t heads,
                std::int64_t dim) {
  DIFFCP_CHECK(t.rows == rows && t.heads == heads && t.dim == dim, "attention: ", name, " has shape [",
               t.rows, ", ", t.heads, ", ", t.dim, "], expected [", rows, ", ", heads, ", ", dim, "]");
  DIFFCP_CHECK(t.row_stride >= heads * dim, "attention: ", name, " row_stride ", t.row_stride,
               " < heads*dim = ", heads * dim);
  DIFFCP_CHECK(rows == 0 || t.data != nullptr, "attention: ", name, " is null");
}

Dims make_dims(const BlockMask& mask, HeadRows<const float> q, HeadRows<const float> k,
               HeadRows<const float> v, float softmax_scale) {
  Dims s{};
  s.Q = mask.query_rows();
  s.Lk = mask.key_rows();
  s.n_q = q.heads;
  s.n_kv = k.heads;
  s.d = q.dim;
  s.B = mask.block();
  DIFFCP_CHECK(s.n_q >= 1 && s.n_kv >= 1 && s.d >= 1, "attention: n_q = ", s.n_q, ", n_kv = ", s.n_kv,
               ", d_h = ", s.d, "; expected all >= 1");
  DIFFCP_CHECK(s.n_q % s.n_kv == 0, "attention: n_q = ", s.n_q, " is not a multiple of n_kv = ", s.n_kv,
               " (GQA needs n_q % n_kv == 0)");
  check_rows("q", q, s.Q, s.n_q, s.d);
  check_rows("k", k, s.Lk, s.n_kv, s.d);
  check_rows("v", v, s.Lk, s.n_kv, s.d);
  s.G = s.n_q / s.n_kv;
  s.GB = s.G * s.B;
  s.scale = softmax_scale > 0.f ? softmax_scale : 1.f / std::sqrt(static_cast<float>(s.d));
  return s;
}

// Packs the (G*B) x d tile of block i, kv head h: tile row t = g*B + r is query row i*B + r,
// query head h*G + g, multiplied by `mul`.
void pack_tile(HeadRows<const float> x, const Dims& s, std::int64_t i, std::int64_t h, float mul,
               float* tile) {
  for (std::int64_t g = 0; g < s.G; ++g)
    for (std::int64_t r = 0; r < s.B; ++r) {
      const float* src = x.at(i * s.B + r, h * s.G + g);
      float* dst = tile + (g * s.B + r) * s.d;
      for (std::int64_t c = 0; c < s.d; ++c) dst[c] = src[c] * mul;
    }
}

// lse/delta entry of tile row t of block i, kv head h.
inline std::int64_t stat_index(const Dims& s, std::int64_t i, std::int64_t h, std::int64_t t) {
  return (i * s.B + t % s.B) * s.n_q + h * s.G + t / s.B;
}

struct ForwardScratch {
  std::vector<float> q, o, p, m, l;
  std::vector<RowRange> ranges;
  explicit ForwardScratch(const Dims& s)
      : q(s.GB * s.d), o(s.GB * s.d), p(s.GB * kKeyTile), m(s.GB), l(s.GB) {}
};

void forward_item(const BlockMask& mask, const Dims& s, HeadRows<const float> q,
                  HeadRows<const float> k, HeadRows<const float> v, HeadRows<float> o,
                  std::span<float> lse, std::int64_t i, std::int64_t h, ForwardScratch& w) {
  mask.visible_ranges(i, w.ranges);
  const std::int64_t GB = s.GB, d = s.d;
  if (w.ranges.empty()) {
    for (std::int64_t t = 0; t < GB; ++t) {
      std::memset(o.at(i * s.B + t % s.B, h * s.G + t / s.B), 0, sizeof(float) * d);
      lse[stat_index(s, i, h, t)] = kNegInf;
    }
    return;
  }
  // Scores in base 2: q pre-scaled by scale*log2(e), so p = 2^(score - max).
  pack_tile(q, s, i, h, s.scale * kLog2e, w.q.data());
  std::fill(w.o.begin(), w.o.end(), 0.f);
  std::fill(w.m.begin(), w.m.end(), kNegInf);
  std::fill(w.l.begin(), w.l.end(), 0.f);
  for (const RowRange& rr : w.ranges) {
    for (std::int64_t j0 = rr.begin; j0 < rr.end; j0 += kKeyTile) {
      const std::int64_t kt = std::min(kKeyTile, rr.end - j0);
      sgemm(false, true, GB, kt, d, 1.f, w.q.data(), d, k.at(j0, h), k.row_stride, 0.f, w.p.data(), kKeyTile);
      for (std::int64_t t = 0; t < GB; ++t) {
        float* pr = w.p.data() + t * kKeyTile;
        float mx = w.m[t];
#pragma omp simd reduction(max : mx)
        for (std::int64_t j = 0; j < kt; ++j) mx = pr[j] > mx ? pr[j] : mx;  // std::max: not vectorised
        const float sum = exp2_shifted(pr, kt, mx);
        const float alpha = fast_exp2(w.m[t] - mx);  // m = -inf on the first tile -> 0
        if (alpha != 1.f) {
          float* orow = w.o.data() + t * d;
          for (std::int64_t c = 0; c < d; ++c) orow[c] *= alpha;
        }
        w.l[t] = w.l[t] * alpha + sum;
        w.m[t] = mx;
      }
      sgemm(false, false, GB, d, kt, 1.f, w.p.data(), kKeyTile, v.at(j0, h), v.row_stride, 1.f, w.o.data(), d);
    }
  }
  for (std::int64_t t = 0; t < GB; ++t) {
    const float inv = 1.f / w.l[t];
    const float* src = w.o.data() + t * d;
    float* dst = o.at(i * s.B + t % s.B, h * s.G + t / s.B);
    for (std::int64_t c = 0; c < d; ++c) dst[c] = src[c] * inv;
    lse[stat_index(s, i, h, t)] = (w.m[t] + std::log2(w.l[t])) * kLn2;
  }
}

struct BackwardScratch {
  std::vector<float> q, dout, dq, p, dp, lse2, delta;
  std::vector<RowRange> ranges;
  explicit BackwardScratch(const Dims& s)
      : q(s.GB * s.d), dout(s.GB * s.d), dq(s.GB * s.d), p(s.GB * kKeyTile), dp(s.GB * kKeyTile),
        lse2(s.GB), delta(s.GB) {}
};

// Backward of block i, kv head h: accumulates into dk, dv (rows this block sees) and writes dq.
void backward_block(const BlockMask& mask, const Dims& s, HeadRows<const float> q,
                    HeadRows<const float> k, HeadRows<const float> v, HeadRows<const float> dout,
                    std::span<const float> lse, std::span<const float> delta, HeadRows<float> dq,
                    HeadRows<float> dk, HeadRows<float> dv, std::int64_t i, std::int64_t h,
                    BackwardScratch& w) {
  mask.visible_ranges(i, w.ranges);
  const std::int64_t GB = s.GB, d = s.d;
  std::fill(w.dq.begin(), w.dq.end(), 0.f);
  if (!w.ranges.empty()) {
    pack_tile(q, s, i, h, s.scale * kLog2e, w.q.data());
    pack_tile(dout, s, i, h, 1.f, w.dout.data());
    for (std::int64_t t = 0; t < GB; ++t) {
      const float l = lse[stat_index(s, i, h, t)];
      // A row whose global lse is -inf saw no key anywhere: its probabilities are 0.
      w.lse2[t] = std::isfinite(l) ? l * kLog2e : std::numeric_limits<float>::infinity();
      w.delta[t] = delta[stat_index(s, i, h, t)];
    }
  }
  for (const RowRange& rr : w.ranges) {
    for (std::int64_t j0 = rr.begin; j0 < rr.end; j0 += kKeyTile) {
      const std::int64_t kt = std::min(kKeyTile, rr.end - j0);
      float* P = w.p.data();
      float* dP = w.dp.data();
      sgemm(false, true, GB, kt, d, 1.f, w.q.data(), d, k.at(j0, h), k.row_stride, 0.f, P, kKeyTile);
      for (std::int64_t t = 0; t < GB; ++t) {
        exp2_shifted(P + t * kKeyTile, kt, w.lse2[t]);
      }
      // dV += P^T dO
      sgemm(true, false, kt, d, GB, 1.f, P, kKeyTile, w.dout.data(), d, 1.f, dv.at(j0, h), dv.row_stride);
      // dP = dO V^T
      sgemm(false, true, GB, kt, d, 1.f, w.dout.data(), d, v.at(j0, h), v.row_stride, 0.f, dP, kKeyTile);
      for (std::int64_t t = 0; t < GB; ++t) {
        float* pr = P + t * kKeyTile;
        const float* dpr = dP + t * kKeyTile;
        const float D = w.delta[t];
#pragma omp simd
        for (std::int64_t j = 0; j < kt; ++j) pr[j] = pr[j] * (dpr[j] - D);  // dS
      }
      // dQ += scale * dS K ; dK += scale * dS^T q = ln2 * dS^T (q * scale * log2e)
      sgemm(false, false, GB, d, kt, s.scale, P, kKeyTile, k.at(j0, h), k.row_stride, 1.f, w.dq.data(), d);
      sgemm(true, false, kt, d, GB, kLn2, P, kKeyTile, w.q.data(), d, 1.f, dk.at(j0, h), dk.row_stride);
    }
  }
  for (std::int64_t t = 0; t < GB; ++t)
    std::memcpy(dq.at(i * s.B + t % s.B, h * s.G + t / s.B), w.dq.data() + t * d, sizeof(float) * d);
}

void zero_rows(HeadRows<float> x) {
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < x.rows; ++r) std::memset(x.at(r, 0), 0, sizeof(float) * x.heads * x.dim);
}

}  // namespace

void CpuBackend::attention_forward(const BlockMask& mask, ConstTensorView q_v, ConstTensorView k_v,
                                   ConstTensorView v_v, TensorView o_v, TensorView lse_v, float softmax_scale) {
  const auto q = rows_f32(q_v), k = rows_f32(k_v), v = rows_f32(v_v);
  const auto o = rows_f32(o_v);
  const auto lse = span_f32(lse_v);
  const Dims s = make_dims(mask, q, k, v, softmax_scale);
  check_rows("o", o, s.Q, s.n_q, s.d);
  DIFFCP_CHECK(static_cast<std::int64_t>(lse.size()) == s.Q * s.n_q, "attention: lse has ", lse.size(),
               " entries, expected Q*n_q = ", s.Q * s.n_q);
  const std::int64_t items = mask.num_blocks() * s.n_kv;
  ParallelErrors errors;
#pragma omp parallel
  {
    ForwardScratch w(s);
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t it = 0; it < items; ++it)
      errors.run([&] { forward_item(mask, s, q, k, v, o, lse, it / s.n_kv, it % s.n_kv, w); });
  }
  errors.rethrow();
}

void CpuBackend::attention_delta(ConstTensorView do_v, ConstTensorView o_v, TensorView delta_v) {
  const auto do_ = rows_f32(do_v), o = rows_f32(o_v);
  const auto delta = span_f32(delta_v);
  check_rows("o", o, do_.rows, do_.heads, do_.dim);
  DIFFCP_CHECK(static_cast<std::int64_t>(delta.size()) == do_.rows * do_.heads, "attention_delta: delta has ",
               delta.size(), " entries, expected rows*heads = ", do_.rows * do_.heads);
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < do_.rows; ++r)
    for (std::int64_t h = 0; h < do_.heads; ++h) {
      const float* a = do_.at(r, h);
      const float* b = o.at(r, h);
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (std::int64_t c = 0; c < do_.dim; ++c) acc += a[c] * b[c];
      delta[static_cast<std::size_t>(r * do_.heads + h)] = acc;
    }
}

void CpuBackend::attention_backward(const BlockMask& mask, ConstTensorView q_v, ConstTensorView k_v,
                                    ConstTensorView v_v, ConstTensorView do_v, ConstTensorView lse_v,
                                    ConstTensorView delta_v, TensorView dq_v, TensorView dk_v, TensorView dv_v,
                                    float softmax_scale) {
  const auto q = rows_f32(q_v), k = rows_f32(k_v), v = rows_f32(v_v), do_ = rows_f32(do_v);
  const auto dq = rows_f32(dq_v), dk = rows_f32(dk_v), dv = rows_f32(dv_v);
  const auto lse = span_f32(lse_v), delta = span_f32(delta_v);
  const Dims s = make_dims(mask, q, k, v, softmax_scale);
  check_rows("do", do_, s.Q, s.n_q, s.d);
  check_rows("dq", dq, s.Q, s.n_q, s.d);
  check_rows("dk", dk, s.Lk, s.n_kv, s.d);
  check_rows("dv", dv, s.Lk, s.n_kv, s.d);
  DIFFCP_CHECK(static_cast<std::int64_t>(lse.size()) == s.Q * s.n_q &&
                   static_cast<std::int64_t>(delta.size()) == s.Q * s.n_q,
               "attention backward: lse has ", lse.size(), " and delta ", delta.size(),
               " entries, expected Q*n_q = ", s.Q * s.n_q);
  zero_rows(dk);
  zero_rows(dv);
  // Work item = (sample group, kv head). Groups touch disjoint key rows and their blocks own
  // disjoint query rows, so items never write the same dq/dk/dv element: no atomics, no
  // per-thread copies. Largest items first for the dynamic schedule.
  const auto& groups = mask.sample_groups();
  std::vector<std::int64_t> cost(groups.size(), 0);
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (std::int64_t i : groups[g]) cost[g] += mask.visible_keys(i) + 1;
  std::vector<std::int64_t> order(groups.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return cost[a] > cost[b]; });
  const std::int64_t items = static_cast<std::int64_t>(groups.size()) * s.n_kv;
  ParallelErrors errors;
#pragma omp parallel
  {
    BackwardScratch w(s);
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t it = 0; it < items; ++it)
      errors.run([&] {
        const auto& group = groups[static_cast<std::size_t>(order[static_cast<std::size_t>(it / s.n_kv)])];
        for (std::int64_t i : group) backward_block(mask, s, q, k, v, do_, lse, delta, dq, dk, dv, i, it % s.n_kv, w);
      });
  }
  errors.rethrow();
}

}  // namespace diffcp::cpu
