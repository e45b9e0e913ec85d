#include "diffcp/sim/cp.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>

#include "diffcp/balance/balancer.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/cp/bytes.hpp"
#include "diffcp/cp/cp_methods.hpp"
#include "diffcp/cp/shard.hpp"
#include "diffcp/cp/splitkv.hpp"

namespace diffcp {

WorkMatrix work_matrix(const PackedBatch& batch, const Plan& plan) {
  const int P = plan.P;
  const std::int64_t B = batch.block, N = batch.num_blocks();
  WorkMatrix w{P, std::vector<double>(static_cast<std::size_t>(P) * static_cast<std::size_t>(P), 0.0),
               std::vector<double>(static_cast<std::size_t>(P), 0.0)};
  const std::vector<PackedBatch::BlockRef> blocks = batch.blocks();
  for (int q = 0; q < P; ++q) {
    const Shard own = even_shard(N, P, q);
    w.D[static_cast<std::size_t>(q)] = static_cast<double>(own.size() * B * B);
    for (std::int64_t i = own.begin; i < own.end; ++i) {
      // Block i sees the context [s_u, a_i) of its sample: intersect with every chunk.
      const std::int64_t lo = blocks[static_cast<std::size_t>(i)].sample_start, hi = blocks[static_cast<std::size_t>(i)].anchor;
      auto it = std::upper_bound(plan.chunks.begin(), plan.chunks.end(), lo,
                                 [](std::int64_t x, const PosRange& c) { return x < c.end; });
      for (; it != plan.chunks.end() && it->begin < hi; ++it) {
        const std::int64_t overlap = std::min(hi, it->end) - std::max(lo, it->begin);
        if (overlap > 0) {
          const int c = plan.rank[static_cast<std::size_t>(it - plan.chunks.begin())];
          w.M[static_cast<std::size_t>(q) * static_cast<std::size_t>(P) + static_cast<std::size_t>(c)] +=
              static_cast<double>(overlap * B);
        }
      }
    }
  }
  return w;
}

namespace {

struct LayoutData {
  Plan plan;
  WorkMatrix work;
  std::vector<double> context_rows;  // [P] C_p
  double plan_ms = 0;
};

double vmax(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end()); }

// SimCpOptions::elem (bytes per payload element) as the dtype the closed forms of cp/bytes.hpp take.
DType payload_dtype(int elem) {
  for (DType t : {DType::f32, DType::bf16, DType::f64})
    if (static_cast<int>(dtype_size(t)) == elem) return t;
  DIFFCP_FAIL("sim cp: elem = ", elem, " bytes per element; expected 4 (f32), 2 (bf16) or 8 (f64)");
}
// The ring-like methods' schedule: the (query owner, context owner) pair rank p of P works on at
// step t (cp/ring.cpp, cp/ringx.cpp, cp/lvxattn.cpp).
std::pair<int, int> ring_owner_pair(CpMethodId id, int t, int p, int P) {
  const int behind = ((p - t) % P + P) % P;
  switch (id) {
  case CpMethodId::ring: return {p, behind};     // K/V shards travel, queries stay
  case CpMethodId::ringx: return {t, p};         // rank t's queries are broadcast
  case CpMethodId::lvxattn: return {behind, p};  // queries travel, K/V shards stay
  case CpMethodId::splitkv:
  case CpMethodId::ulysses: break;
  }
  DIFFCP_FAIL("sim cp: method ", static_cast<int>(id), " has no ring schedule");
}

// The simulated machine runs the fused log-sum-exp all-reduce (MPI's; cp/lse_reduce.hpp).
constexpr int kLseReduces = 1;

// One layer step (forward + backward) of each method on the machine, one member per method (a new
// method adds its member and its case in simulate_cp's switch). Each fills the SimCpResult's
// method-specific fields (bytes, peak memory, Split-KV's choices) and the step's parts below.
class CpStepModel {
 public:
  CpStepModel(const SimMachine& m, const PackedBatch& batch, const AttnLayerConfig& cfg, const SimCpOptions& opt,
              const WorkMatrix& W, double Cp)
      : m(m), cfg(cfg), opt(opt), P(m.P), dtype(payload_dtype(opt.elem)), e(opt.elem), H(static_cast<double>(cfg.hidden)),
        qw(static_cast<double>(cfg.q_width())), kvw(static_cast<double>(cfg.kv_width())), nq(static_cast<double>(cfg.n_q)),
        dh(static_cast<double>(cfg.d_h)), Q(batch.query_rows()), S(batch.context_rows()),
        Qp(static_cast<double>((batch.num_blocks() + P - 1) / P * batch.block)), Cp(Cp), Lrows(static_cast<double>(S + Q)),
        W(W), g_q(m.gemm_ms(Qp, H, qw)), g_kv(2 * m.gemm_ms(Cp + Qp, H, kvw)), g_o(m.gemm_ms(Qp, qw, H)),
        rank_pairs(static_cast<std::size_t>(P), 0.0) {}

  void splitkv(SimCpResult& r) {
    bool owned = opt.oproj == "owned";
    if (opt.oproj == "auto")
      owned = choose_oproj(cfg, Q, P, m.profile.gemm_tflops * 1e3 * m.rate_share(),
                          m.multi_node() ? m.profile.inter_gbit / m.R : m.profile.intra_gbit, dtype) == OProj::owned;
    r.oproj = owned ? "owned" : "all";
    if (!owned) g_o = m.gemm_ms(static_cast<double>(Q), qw, H);
    const double w = owned ? qw : H;
    const bool hier = m.hierarchy_useful() && opt.collectives != "flat";  // as the layer decides
    const auto coll = [&](double bytes) { return hier ? m.hierarchical_ms(bytes) : m.uniform_ms(bytes); };
    for (int p = 0; p < P; ++p) {
      double s = W.D[static_cast<std::size_t>(p)];
      for (int q = 0; q < P; ++q) s += W.at(q, p);
      rank_pairs[static_cast<std::size_t>(p)] = s;
    }
    const double wmax = m.step_work(rank_pairs);
    attn_f = m.attn_fwd_ms(wmax * fwd_pair);
    attn_b = m.attn_bwd_ms(wmax * bwd_pair);
    const double frac = (P - 1.0) / P, n = static_cast<double>(Q) * nq;
    const double ag_q = coll(e * frac * Q * qw), rs_dq = coll(e * frac * Q * qw);
    // The owner merge (owned, flat) carries the statistics with the rows and has no all-reduce.
    const bool merge = owned && !hier;
    const double ar = merge ? 0 : m.allreduce_small_ms(stat * 2 * frac * n);
    const double rs_o = coll(e * frac * Q * w + (merge ? stat * frac * n : 0));
    const double ag_do = coll(e * frac * Q * w + (merge ? stat * 2 * frac * n : 0));
    fwd_exposed = m.overlapped(g_kv, ag_q) - g_kv + rs_o + ar;
    bwd_exposed = ag_do + ar + m.overlapped(2 * g_kv, rs_dq) - 2 * g_kv;
    f = g_q + m.overlapped(g_kv, ag_q) + attn_f + rs_o + ar + g_o;
    b = ag_do + ar + attn_b + m.overlapped(2 * g_kv, rs_dq) + 2 * g_q + 2 * g_o;
    comm = ag_q + rs_o + 2 * ar + ag_do + rs_dq;
    r.bytes_per_layer = splitkv_bytes_per_layer(cfg, dtype, Q, P, owned, kLseReduces, hier ? m.nodes() : 0);
    r.inter_node_bytes_per_layer =
        hier ? (e * (m.nodes() - 1.0) * (2 * Q * qw + 2 * Q * w) + stat * (kLseReduces + 1) * 2 * n * (m.nodes() - 1.0)) / P
             : r.bytes_per_layer * m.inter_fraction();
    r.collectives = hier ? "hierarchical" : "flat";
    r.peak_bytes = e * (Qp * H * 4 + Cp * H * 2 + (Cp + Qp) * 2 * kvw * 2 + static_cast<double>(Q) * (2 * qw + w + 2 * nq));
  }

  void ulysses(SimCpResult& r) {
    double total = 0;
    for (const double d : W.D) total += d;
    for (const double x : W.M) total += x;
    std::fill(rank_pairs.begin(), rank_pairs.end(), total / P);
    attn_f = m.attn_fwd_ms(total / P * fwd_pair);
    attn_b = m.attn_bwd_ms(total / P * bwd_pair);
    const double frac = (P - 1.0) / (static_cast<double>(P) * P);
    const double a_q = m.uniform_ms(e * frac * Q * qw), a_kv = m.uniform_ms(e * frac * 2 * Lrows * kvw);
    fwd_exposed = m.overlapped(g_kv, a_q) - g_kv + a_kv + a_q;
    bwd_exposed = a_q + a_q + a_kv;
    f = g_q + m.overlapped(g_kv, a_q) + a_kv + attn_f + a_q + g_o;
    b = a_q + attn_b + a_q + a_kv + 2 * (g_q + g_kv + g_o);
    comm = 4 * a_q + 2 * a_kv;
    r.bytes_per_layer = ulysses_bytes_per_layer(cfg, dtype, Q, S + Q, P);
    r.inter_node_bytes_per_layer = r.bytes_per_layer * m.inter_fraction();
    r.peak_bytes = e * (Qp * H * 4 + Cp * H * 2 + static_cast<double>(Q) * qw / P * 3 + Lrows * kvw * 2 / P * 3);
  }

  // Ring, RingX, LV-XAttn: P steps, rank p on the pair ring_owner_pair(id, t, p) at step t.
  void ring_like(CpMethodId id, SimCpResult& r) {
    // The ring-like methods: per step t, rank p works on the pair (query owner, context owner).
    const auto owner_pair = [&](int t, int p) { return ring_owner_pair(id, t, p, P); };
    double step_kv = e * 2 * Lrows / P * kvw;  // ring: one k|v shard
    std::vector<double> step_pairs(static_cast<std::size_t>(P));
    for (int t = 0; t < P; ++t) {
      for (int p = 0; p < P; ++p) {
        const auto [qo, co] = owner_pair(t, p);
        const double pairs = W.at(qo, co) + (qo == co ? W.D[static_cast<std::size_t>(qo)] : 0.0);
        rank_pairs[static_cast<std::size_t>(p)] += pairs;
        step_pairs[static_cast<std::size_t>(p)] = pairs;
      }
      const double wf = m.step_work(step_pairs);
      const double af = m.attn_fwd_ms(wf * fwd_pair), ab = m.attn_bwd_ms(wf * bwd_pair);
      attn_f += af;
      attn_b += ab;
      const bool last = t == P - 1;
      const double Qt = static_cast<double>(Q) / P;
      if (id == CpMethodId::ring) {
        const double hf = last ? 0 : m.hop_ms(step_kv), hb = last ? 0 : 2 * m.hop_ms(step_kv);
        f += m.overlapped(af, hf);
        b += m.overlapped(ab, hb);
        fwd_exposed += m.overlapped(af, hf) - af;
        bwd_exposed += m.overlapped(ab, hb) - ab;
        comm += hf + hb;
      } else if (id == CpMethodId::ringx) {
        // Broadcasts of q_t (next one posted ahead), lse all-reduce and o reduce at rank t;
        // backward: broadcast k|v_t, reduce dk|dv at rank t.
        const double frac = (P - 1.0) / P;
        const double bq = m.uniform_ms(e * frac * Qt * qw), lse = m.allreduce_small_ms(stat * 2 * frac * Qt * nq);
        const double ro = m.uniform_ms(e * frac * Qt * qw);
        const double bkv = m.uniform_ms(e * frac * 2 * Lrows / P * kvw), rkv = bkv;
        f += m.overlapped(af, bq) + lse + ro;
        b += m.overlapped(ab, bkv) + rkv;
        fwd_exposed += m.overlapped(af, bq) - af + lse + ro;
        bwd_exposed += m.overlapped(ab, bkv) - ab + rkv;
        comm += bq + lse + ro + bkv + rkv;
      } else {  // lvxattn, as cp/lvxattn.cpp runs it: q (and its backward inputs) hop ahead, the accumulators behind
        const double hq = m.hop_ms(e * Qt * qw), hacc = m.hop_ms(Qt * (e * qw + stat * nq));
        const double hqb = m.hop_ms(Qt * (e * 2 * qw + stat * 2 * nq)), hdq = m.hop_ms(e * Qt * qw);
        // During step t the query state for step t + 1 arrives (posted one step ahead; step 0's
        // own block also covers the forward's K/V projection) and, from step 2 on, the running
        // accumulator of step t - 1 (the previous rank's, merged after this step's attention):
        // both share the link into this rank. After the last step the accumulator goes home:
        // exposed in the forward, under the K/V projection's backward in the backward.
        const double cf = (last ? 0 : hq) + (t >= 2 ? hacc : 0), cb = (last ? 0 : hqb) + (t >= 2 ? hdq : 0);
        const double window = t == 0 ? g_kv : 0;  // compute besides the attention the transfer hides under
        const double sf = cf > 0 ? m.overlapped(window + af, cf) - window : af, sb = m.overlapped(ab, cb);
        f += sf;
        b += sb;
        fwd_exposed += sf - af;
        bwd_exposed += sb - ab;
        comm += cf + cb;
        if (last && P > 1) {
          f += hacc;
          fwd_exposed += hacc;
          const double home = m.overlapped(2 * g_kv, hdq) - 2 * g_kv;
          b += home;
          bwd_exposed += home;
          comm += hacc + hdq;
        }
      }
    }
    f += g_q + g_kv + g_o;
    b += 2 * (g_q + g_kv + g_o);
    if (id == CpMethodId::ring) {
      r.bytes_per_layer = ring_bytes_per_layer(cfg, dtype, S + Q, P);
      r.peak_bytes = e * (Qp * H * 4 + Cp * H * 2 + 3 * step_kv / e + Qp * (2 * qw + nq));
    } else if (id == CpMethodId::ringx) {
      r.bytes_per_layer = ringx_bytes_per_layer(cfg, dtype, Q, S + Q, P, kLseReduces);
      r.peak_bytes = e * (Qp * H * 4 + Cp * H * 2 + 2 * Qp * qw * 2 + 2 * step_kv / e + (Cp + Qp) * 2 * kvw * 2);
    } else {
      r.bytes_per_layer = lvxattn_bytes_per_layer(cfg, dtype, Q, P);
      r.peak_bytes = e * (Qp * H * 4 + Cp * H * 2 + (Cp + Qp) * 2 * kvw * 2 + 4 * Qp * (qw + nq));
    }
    // Ring hops cross nodes for one rank in R; the rooted collectives like a uniform one.
    r.inter_node_bytes_per_layer =
        r.bytes_per_layer * (id == CpMethodId::ringx ? m.inter_fraction() : (m.multi_node() ? 1.0 / m.R : 0.0));
  }

  // The step's parts (ms; the slowest rank's) and each rank's attention pairs per head.
  double f = 0, b = 0, fwd_exposed = 0, bwd_exposed = 0, comm = 0;

 private:
  const SimMachine& m;
  const AttnLayerConfig& cfg;
  const SimCpOptions& opt;
  const int P;
  const DType dtype;
  const double e, H, qw, kvw, nq, dh;
  const double stat = 4;  // bytes of an lse / D entry: f32 whatever the payload dtype
  const std::int64_t Q, S;
  const double Qp, Cp, Lrows;  // the busiest rank's query rows and context rows; all K/V rows
  const double fwd_pair = 4 * dh * nq, bwd_pair = 10 * dh * nq;  // FLOPs per visible pair per head
  const WorkMatrix& W;
  // Projections of the busiest rank (forward; the backward is 2x: dX and dW).
  const double g_q, g_kv;
  double g_o;
  double attn_f = 0, attn_b = 0;

 public:
  std::vector<double> rank_pairs;  // each rank's attention pairs per head in the whole layer (the imbalance)
};

}  // namespace

std::vector<SimCpResult> simulate_cp(const SimMachine& m, const PackedBatch& batch, const AttnLayerConfig& cfg,
                                     const SimCpOptions& opt) {
  m.validate();
  cfg.validate();
  batch.validate();
  const int P = m.P;
  // The work matrix holds P x P doubles (8192: 512 MiB) and the ring-like methods walk it.
  DIFFCP_CHECK(P <= 8192, "sim cp: P = ", P, " ranks; the per-rank work matrix is P x P, supported up to P = 8192");

  std::map<std::string, LayoutData> layouts;
  const auto layout = [&](const std::string& name) -> LayoutData& {
    auto it = layouts.find(name);
    if (it != layouts.end()) return it->second;
    LayoutData d;
    const auto t0 = std::chrono::steady_clock::now();
    d.plan = make_balancer(name)->plan(batch, CostModel(batch), P, opt.J);
    d.plan_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    d.work = work_matrix(batch, d.plan);
    d.context_rows.assign(static_cast<std::size_t>(P), 0.0);
    for (std::size_t j = 0; j < d.plan.chunks.size(); ++j)
      d.context_rows[static_cast<std::size_t>(d.plan.rank[j])] += static_cast<double>(d.plan.chunks[j].end - d.plan.chunks[j].begin);
    return layouts.emplace(name, std::move(d)).first->second;
  };

  std::vector<SimCpResult> out;
  for (const std::string& method : opt.methods) {
    SimCpResult r;
    r.method = method;
    r.P = P;
    const CpMethod& desc = cp_method(method);
    r.reason = desc.unsupported_reason(cfg, P);
    r.layout = desc.splitkv_options ? opt.balancer : desc.default_layout;
    if (!r.supported()) {
      out.push_back(r);
      continue;
    }
    const LayoutData& L = layout(r.layout);
    r.plan_ms = L.plan_ms;
    CpStepModel step(m, batch, cfg, opt, L.work, vmax(L.context_rows));
    switch (desc.id) {
    case CpMethodId::splitkv: step.splitkv(r); break;
    case CpMethodId::ulysses: step.ulysses(r); break;
    case CpMethodId::ring:
    case CpMethodId::ringx:
    case CpMethodId::lvxattn: step.ring_like(desc.id, r); break;
    }  // no default: a new CpMethodId is a compile error here until it is simulated
    r.fwd_ms = step.f;
    r.bwd_ms = step.b;
    r.step_ms = step.f + step.b;
    r.comm_ms = step.comm;
    r.exposed_comm_ms = step.fwd_exposed + step.bwd_exposed;
    r.compute_ms = r.step_ms - r.exposed_comm_ms;
    double mean = 0;
    for (const double x : step.rank_pairs) mean += x / P;
    r.imbalance_pct = mean > 0 ? 100.0 * (vmax(step.rank_pairs) / mean - 1.0) : 0.0;
    out.push_back(r);
  }
  return out;
}

}  // namespace diffcp
