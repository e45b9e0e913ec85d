#include "diffcp/sim/dit.hpp"

#include <algorithm>
#include <cmath>

#include "diffcp/core/error.hpp"
#include "diffcp/core/stats.hpp"
#include "diffcp/dit/exchange.hpp"
#include "diffcp/dit/vmajor.hpp"

namespace diffcp {

namespace {

// A diffcp::Error's message without its " [file:line in func]" suffix (a row's reason).
std::string reason_of(const Error& e) {
  std::string s = e.what();
  const std::size_t at = s.rfind(" [");
  return at == std::string::npos ? s : s.substr(0, at);
}

// Peers of one uniform exchange phase as rank 0 sees them (every rank alike when the groups and
// the nodes tile): `intra` on its node, `inter` on other nodes.
struct Peers {
  int intra = 0, inter = 0;
};

// Alpha-beta time of a phase in which every rank sends `bytes_per_peer` to each of its peers at
// once: the machine's rule for uniform collectives (sim/machine.hpp), i.e. one latency per peer
// (the inter-node one when any peer is off the node), the intra and inter bytes concurrently, the
// uplink shared by the node's ranks. Equal to machine.uniform_ms for the flat group's peers.
double phase_ms(const SimMachine& m, Peers peers, double bytes_per_peer) {
  const int n = peers.intra + peers.inter;
  if (n == 0 || bytes_per_peer <= 0) return 0;
  const Profile& p = m.profile;
  const double lat = n * (peers.inter > 0 ? p.inter_latency_us : p.intra_latency_us) * 1e-3;
  const double intra_bytes_per_ms = p.intra_gbit * 1e9 / 8 / 1e3, inter_bytes_per_ms = p.inter_gbit * 1e9 / 8 / 1e3;
  const double on_uplink = std::min(m.R, m.P);
  return lat + std::max(peers.intra * bytes_per_peer / intra_bytes_per_ms,
                        on_uplink * peers.inter * bytes_per_peer / inter_bytes_per_ms);
}

// The closed form's bytes of one step (vmajor_predicted_bytes counts whole runs under a schedule;
// one step is a one- or two-step run with a schedule in the same state): a full step is TAPA's
// one-step run; a selective step with r is a fixed-r two-step run (step 0 is always full) minus
// its first step.
VMajorBytes step_bytes(int P, int L, std::int64_t n, std::int64_t hd, std::int64_t layers, const CacheSchedule& schedule,
                       int step, int steps, bool vmajor) {
  if (!vmajor || schedule.full(step, steps)) return vmajor_predicted_bytes(P, L, n, hd, layers, schedule, 1, false);
  const CacheSchedule fixed{CacheScheduleKind::fixed, schedule.ratio_at(step, steps), 0, 0};
  DIFFCP_CHECK(fixed.cached_tokens(1, 2, n) == schedule.cached_tokens(step, steps, n), "sim dit: step ", step,
               ": the one-step schedule caches a different number of tokens");
  const VMajorBytes two = vmajor_predicted_bytes(P, L, n, hd, layers, fixed, 2, true);
  const VMajorBytes one = vmajor_predicted_bytes(P, L, n, hd, layers, fixed, 1, true);
  return {two.intra - one.intra, two.inter - one.inter, two.inter_qkv - one.inter_qkv};
}


}  // namespace

std::vector<SimDitResult> simulate_dit(const SimMachine& m, const DitConfig& cfg, const DitShape& shape,
                                       const SimDitOptions& opt) {
  m.validate();
  cfg.validate();
  shape.validate();
  opt.schedule.validate();
  DIFFCP_CHECK(opt.steps >= 1, "sim dit: --steps = ", opt.steps, ", expected >= 1");
  DIFFCP_CHECK(opt.group_size >= 0, "sim dit: --group-size = ", opt.group_size, ", expected >= 1 (0: the ranks of a node)");
  DIFFCP_CHECK(!opt.modes.empty(), "sim dit: no modes");
  for (const std::string& mode : opt.modes) parse_exchange_mode(mode);  // throws naming the modes

  const int P = m.P;
  const int L = opt.group_size > 0 ? opt.group_size : std::min(m.R, P);
  std::string reason;
  DitShard shard;
  try {
    shard = make_dit_shard(cfg, shape, P, 0);
  } catch (const Error& e) {
    reason = reason_of(e);
  }
  if (reason.empty() && P % L != 0)
    reason = "sim dit: group size L = " + std::to_string(L) + " does not divide P = " + std::to_string(P) + " ranks";

  std::vector<SimDitResult> out;
  if (!reason.empty()) {
    for (const std::string& mode : opt.modes) {
      SimDitResult r;
      r.mode = mode;
      r.reason = reason;
      r.P = P;
      r.L = L;
      r.steps = opt.steps;
      out.push_back(r);
    }
    return out;
  }

  // Shapes (legend: sim/dit.hpp).
  const double f = sizeof(float);
  const double H = static_cast<double>(cfg.hidden()), Mw = static_cast<double>(cfg.mlp_hidden);
  const double dh = static_cast<double>(cfg.head_dim), hp = static_cast<double>(cfg.heads / P), hd = hp * dh;
  const double b = static_cast<double>(shape.batch), N = static_cast<double>(shape.tokens());
  const double Mt = b * static_cast<double>(shard.text_p), Mi = b * static_cast<double>(shard.image_p);
  const std::int64_t n_i = shape.batch * shard.tokens_p();  // n rows per rank per exchange
  const double n = static_cast<double>(n_i);
  const std::int64_t layers = cfg.double_blocks + cfg.single_blocks;
  const int G = P / L;

  const auto gemm = [&](double rows, double K, double Ncol) { return rows > 0 ? m.gemm_ms(rows, K, Ncol) : 0.0; };
  const auto ew = [&](double bytes) { return m.elementwise_ms(bytes); };

  // Compute of one double block, split where the exchange interleaves: before start_v (modulation,
  // LayerNorm, v projection), while V's phase 1 flies (q|k projection, QK norm + RoPE), after the
  // attention (proj, gated adds, MLP). Both streams: txt (M_t rows), img (M_i rows).
  double d_pre = 0, d_window = 0, d_post = 0;
  for (const double rows : {Mt, Mi}) {
    d_pre += gemm(1, H, 6 * H) + ew(8 * rows * H) + gemm(rows, H, H);
    d_window += gemm(rows, H, 2 * H) + ew(8 * rows * 2 * H);
    d_post += gemm(rows, H, H) + ew(12 * rows * H) + ew(8 * rows * H) + gemm(rows, H, Mw) + ew(8 * rows * Mw) +
              gemm(rows, Mw, H) + ew(12 * rows * H);
  }
  // One single block over the n rows: linear1 as v, q|k, m (the m part is polled through too).
  const double s_pre = gemm(1, H, 3 * H) + ew(8 * n * H) + gemm(n, H, H);
  const double s_window = gemm(n, H, 2 * H) + ew(8 * n * 2 * H) + gemm(n, H, Mw);
  const double s_post = ew(8 * n * Mw) + gemm(n, H + Mw, H) + ew(12 * n * H);
  // Attention: h_p heads, b N queries, N keys each (dense per image); the exchange's copies into
  // and out of the head layout.
  const double attn = m.attn_fwd_ms(4 * dh * hp * b * N * N);
  const double copies = ew(8 * n * 3 * H) + ew(8 * n * H);
  // Once per step: conditioning MLPs, embeddings, the final layer and the Euler update.
  const double C_in = static_cast<double>(cfg.in_channels()), Tp = static_cast<double>(shard.text_p);
  double per_step = gemm(1, static_cast<double>(cfg.time_dim), H) + gemm(1, H, H) +
                    gemm(1, static_cast<double>(cfg.pooled_dim), H) + gemm(1, H, H) + gemm(Mi, C_in, H) +
                    gemm(Tp, static_cast<double>(cfg.text_dim), H) + ew(8 * (b - 1) * Tp * H) + gemm(1, H, 2 * H) +
                    ew(8 * Mi * H) + gemm(Mi, H, C_in) + ew(12 * Mi * C_in);
  if (cfg.guidance_embed) per_step += gemm(1, static_cast<double>(cfg.time_dim), H) + gemm(1, H, H);
  const double D = static_cast<double>(cfg.double_blocks), S = static_cast<double>(cfg.single_blocks);
  const double block_compute = D * (d_pre + d_window + d_post) + S * (s_pre + s_window + s_post) +
                               static_cast<double>(layers) * (attn + copies);

  // Peers of rank 0 (groups of L consecutive ranks, nodes of R): phase 1 = its L - 1 group mates,
  // phase 2 = the G - 1 ranks k L; the flat group = all P - 1.
  const int Rn = std::min(m.R, P);
  const Peers p1{std::min(L, Rn) - 1, L - std::min(L, Rn)};
  const int p2_intra = std::min(G - 1, (Rn + L - 1) / L - 1);
  const Peers p2{p2_intra, G - 1 - p2_intra};
  const auto phase1 = [&](double block_bytes) { return phase_ms(m, p1, G * block_bytes); };  // G blocks per mate
  const auto phase2 = [&](double block_bytes) { return phase_ms(m, p2, L * block_bytes); };  // L blocks per peer
  const double blk_qkv = n * 3 * hd * f, blk_o = n * hd * f;  // one destination's block

  for (const std::string& mode_name : opt.modes) {
    const ExchangeMode mode = parse_exchange_mode(mode_name);
    SimDitResult r;
    r.mode = mode_name;
    r.P = P;
    r.L = L;
    r.steps = opt.steps;
    const bool vmajor = mode == ExchangeMode::cocodiff;
    std::vector<double> step_times;
    for (int step = 0; step < opt.steps; ++step) {
      SimDitStep s;
      // Per exchange: communication, the part of it exposed, elementwise work it adds; then the
      // bytes of each piece, checked against the closed form below.
      double comm_d = 0, comm_s = 0, exposed_d = 0, exposed_s = 0, extra = 0;
      double intra = 0, inter = 0, messages = 0;  // per exchange: bytes inside / across groups, inter-group messages
      s.active = n_i;
      if (mode == ExchangeMode::flat) {
        const double t = m.uniform_ms((P - 1.0) * blk_qkv) + m.uniform_ms((P - 1.0) * blk_o);
        comm_d = comm_s = exposed_d = exposed_s = t;
        intra = (L - 1.0) * (blk_qkv + blk_o);
        inter = (P - L) * (blk_qkv + blk_o);
        messages = 2.0 * (P - L);
      } else {
        const double o = phase1(blk_o) + phase2(blk_o);
        intra = (L - 1.0) * G * blk_o;
        inter = (G - 1.0) * L * blk_o;
        messages = G - 1.0;
        const bool full = !vmajor || opt.schedule.full(step, opt.steps);
        if (mode == ExchangeMode::tapa) {
          const double t = phase1(blk_qkv) + phase2(blk_qkv) + o;
          comm_d = comm_s = exposed_d = exposed_s = t;
          intra += (L - 1.0) * G * blk_qkv;
          inter += (G - 1.0) * L * blk_qkv;
          messages += G - 1.0;
        } else {
          // V-First: V's phase 1 under the q|k work of the block; the rest in attention().
          const double v1 = phase1(blk_o);
          double rest = 0;
          if (full) {
            rest = phase1(2 * n * hd * f) + phase2(blk_o) + phase2(2 * n * hd * f);
            intra += (L - 1.0) * G * blk_qkv;
            inter += (G - 1.0) * L * blk_qkv;
            messages += 2.0 * (G - 1.0);
          } else {
            // V-Major selective: k active rows per source rank.
            const std::int64_t k_i = n_i - opt.schedule.cached_tokens(step, opt.steps, n_i);
            const double k = static_cast<double>(k_i);
            s.active = k_i;
            const double l1_gather = phase_ms(m, p1, L * n * f);                       // L n partial sums per mate
            const double lists = k_i > 0 ? phase_ms(m, p2, L * k * sizeof(std::int32_t)) : 0.0;  // active lists
            rest = l1_gather + lists + phase1(k * 2 * hd * f) + phase2(k * 3 * hd * f);
            // L1 over V^p1 and the phase-1 v ([G][L][n][hd], 8 B per element), V^p1's active rows,
            // the scatter of the received rows into QKV^p2.
            extra = ew(8 * P * n * hd) + ew(8 * P * k * hd) + ew(8 * P * k * 3 * hd);
            intra += (L - 1.0) * G * blk_o + (L - 1.0) * L * n * f + (L - 1.0) * G * k * 2 * hd * f;
            inter += (G - 1.0) * L * k * 3 * hd * f + (k_i > 0 ? (G - 1.0) * L * k * sizeof(std::int32_t) : 0.0);
            messages += k_i > 0 ? 2.0 * (G - 1.0) : 0.0;
          }
          comm_d = comm_s = v1 + rest + o;
          exposed_d = m.overlapped(d_window, v1) - d_window + rest + o;
          exposed_s = m.overlapped(s_window, v1) - s_window + rest + o;
        }
      }
      if (mode == ExchangeMode::flat) {
        s.bytes_intra = static_cast<std::uint64_t>(std::llround(static_cast<double>(layers) * intra));
        s.bytes_inter = static_cast<std::uint64_t>(std::llround(static_cast<double>(layers) * inter));
      } else {
        // The reported bytes are the closed form's; the timed pieces must add up to them.
        const VMajorBytes cf = step_bytes(P, L, n_i, cfg.heads / P * cfg.head_dim, layers, opt.schedule, step, opt.steps, vmajor);
        DIFFCP_CHECK(std::llround(static_cast<double>(layers) * intra) == static_cast<long long>(cf.intra) &&
                         std::llround(static_cast<double>(layers) * inter) == static_cast<long long>(cf.inter),
                     "sim dit: mode ", mode_name, " step ", step, ": the timed pieces move ", layers * intra,
                     " / ", layers * inter, " bytes, the closed form ", cf.intra, " / ", cf.inter);
        s.bytes_intra = cf.intra;
        s.bytes_inter = cf.inter;
      }
      s.comm_ms = D * comm_d + S * comm_s;
      s.exposed_comm_ms = D * exposed_d + S * exposed_s;
      s.compute_ms = per_step + block_compute + static_cast<double>(layers) * extra;
      s.step_ms = s.compute_ms + s.exposed_comm_ms;
      r.total_ms += s.step_ms;
      r.compute_ms += s.compute_ms / opt.steps;
      r.exposed_comm_ms += s.exposed_comm_ms / opt.steps;
      r.comm_ms += s.comm_ms / opt.steps;
      r.bytes_intra_total += s.bytes_intra;
      r.bytes_inter_total += s.bytes_inter;
      r.messages_inter_group += static_cast<double>(layers) * messages;  // divided by the steps below
      step_times.push_back(s.step_ms);
      r.per_step.push_back(s);
    }
    if (mode != ExchangeMode::flat) {
      // The run's closed form equals the sum of its steps'.
      const VMajorBytes run = vmajor_predicted_bytes(P, L, n_i, cfg.heads / P * cfg.head_dim, layers, opt.schedule,
                                                     opt.steps, vmajor);
      DIFFCP_CHECK(run.intra == r.bytes_intra_total && run.inter == r.bytes_inter_total, "sim dit: mode ", mode_name,
                   ": per-step bytes ", r.bytes_intra_total, " / ", r.bytes_inter_total, " != the run's closed form ",
                   run.intra, " / ", run.inter);
    }
    r.step_ms = median(step_times);
    r.bytes_intra_group = static_cast<double>(r.bytes_intra_total) / opt.steps;
    r.messages_inter_group /= opt.steps;
    r.bytes_inter_group = static_cast<double>(r.bytes_inter_total) / opt.steps;
    out.push_back(r);
  }
  return out;
}

}  // namespace diffcp
