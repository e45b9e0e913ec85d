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
                       int step, int steps, bool vmajor, const WireFormat& wf) {
  if (!vmajor || schedule.full(step, steps)) return vmajor_predicted_bytes(P, L, n, hd, layers, schedule, 1, false, wf);
  const CacheSchedule fixed{CacheScheduleKind::fixed, schedule.ratio_at(step, steps), 0, 0};
  DIFFCP_CHECK(fixed.cached_tokens(1, 2, n) == schedule.cached_tokens(step, steps, n), "sim dit: step ", step,
               ": the one-step schedule caches a different number of tokens");
  const VMajorBytes two = vmajor_predicted_bytes(P, L, n, hd, layers, fixed, 2, true, wf);
  const VMajorBytes one = vmajor_predicted_bytes(P, L, n, hd, layers, fixed, 1, true, wf);
  return {two.intra - one.intra, two.inter - one.inter, two.inter_qkv - one.inter_qkv};
}

// One attention exchange of one step: its communication (double / single block), the part of it
// not hidden under compute, the elementwise work it adds, and its bytes and inter-group messages.
struct ExchangeCost {
  double comm_d = 0, comm_s = 0, exposed_d = 0, exposed_s = 0, extra = 0;
  double intra = 0, inter = 0, messages = 0;  // per exchange: bytes inside / across groups, inter-group messages
  std::int64_t active = 0;                    // rows each rank sends in the q|k|v phase 2
};

// The DiT's step on the machine (legend: sim/dit.hpp): the compute of the blocks, split where
// the exchange interleaves, and each exchange mode's cost (one member per concern).
class DitStepModel {
 public:
  DitStepModel(const SimMachine& m, const DitConfig& cfg, const DitShape& shape, const DitShard& shard, int L,
               const SimDitOptions& opt)
      : m_(m), cfg_(cfg), opt_(opt), P(m.P), L(L), G(m.P / L), H(static_cast<double>(cfg.hidden())),
        hd(static_cast<double>(cfg.heads / m.P) * static_cast<double>(cfg.head_dim)), n_i(shape.batch * shard.tokens_p()),
        n(static_cast<double>(n_i)), layers(cfg.double_blocks + cfg.single_blocks) {
    const int Rn = std::min(m.R, P);
    // Peers of rank 0 (groups of L consecutive ranks, nodes of R): phase 1 = its L - 1 group mates,
    // phase 2 = the G - 1 ranks k L; the flat group = all P - 1.
    p1_ = {std::min(L, Rn) - 1, L - std::min(L, Rn)};
    const int p2_intra = std::min(G - 1, (Rn + L - 1) / L - 1);
    p2_ = {p2_intra, G - 1 - p2_intra};
    blk_qkv_ = n * 3 * hd * e_;  // one destination's block
    blk_o_ = n * hd * e_;
    compute(shape, shard);
  }

  // Compute of a step outside the exchanges (the same every step).
  double per_step_compute() const { return per_step_ + block_compute_; }
  // A step the First-Block Cache skips: the per-step work, the first block (double if any) and the
  // cache's own elementwise work; the exchange is the caller's.
  double cached_step_compute() const { return per_step_ + (cfg_.double_blocks > 0 ? d_block_ : s_block_) + cache_ew_; }
  // The velocity rows one rank holds: b I_p C_in f32 (CFG-parallel's pair all-gather).
  double velocity_bytes() const { return pair_bytes_; }

  ExchangeCost exchange(ExchangeMode mode, int step) const {
    ExchangeCost c;
    c.active = n_i;
    switch (mode) {
    case ExchangeMode::flat: {
      const double t = m_.uniform_ms((P - 1.0) * blk_qkv_) + m_.uniform_ms((P - 1.0) * blk_o_);
      c.comm_d = c.comm_s = c.exposed_d = c.exposed_s = t;
      c.intra = (L - 1.0) * (blk_qkv_ + blk_o_);
      c.inter = (P - L) * (blk_qkv_ + blk_o_);
      c.messages = 2.0 * (P - L);
      return c;
    }
    case ExchangeMode::tapa: {
      add_o_phases(c);
      const double t = phase1(blk_qkv_) + phase2(blk_qkv_) + (phase1(blk_o_) + phase2(blk_o_));
      c.comm_d = c.comm_s = c.exposed_d = c.exposed_s = t;
      add_full_qkv(c, 1.0);
      return c;
    }
    case ExchangeMode::vfirst:
    case ExchangeMode::cocodiff: {
      add_o_phases(c);
      const bool full = mode == ExchangeMode::vfirst || opt_.schedule.full(step, opt_.steps);
      // V-First: V's phase 1 under the q|k work of the block; the rest in attention().
      const double v1 = phase1(blk_o_), o = phase1(blk_o_) + phase2(blk_o_);
      const double rest = full ? phase1(2 * n * hd * e_) + phase2(blk_o_) + phase2(2 * n * hd * e_) : selective(c, step);
      if (full) add_full_qkv(c, 2.0);
      c.comm_d = c.comm_s = v1 + rest + o;
      c.exposed_d = m_.overlapped(d_window_, v1) - d_window_ + rest + o;
      c.exposed_s = m_.overlapped(s_window_, v1) - s_window_ + rest + o;
      return c;
    }
    }  // no default: a new mode is a compile error here until it is simulated
    DIFFCP_FAIL("sim dit: unknown mode ", static_cast<int>(mode));
  }

 private:
  double phase1(double block_bytes) const { return phase_ms(m_, p1_, G * block_bytes); }  // G blocks per mate
  double phase2(double block_bytes) const { return phase_ms(m_, p2_, L * block_bytes); }  // L blocks per peer

  // The o exchange (head -> sequence) every non-flat mode moves in full.
  void add_o_phases(ExchangeCost& c) const {
    c.intra += (L - 1.0) * G * blk_o_;
    c.inter += (G - 1.0) * L * blk_o_;
    c.messages += G - 1.0;
  }
  // A full q|k|v exchange in `phases_across` inter-group message rounds.
  void add_full_qkv(ExchangeCost& c, double phases_across) const {
    c.intra += (L - 1.0) * G * blk_qkv_;
    c.inter += (G - 1.0) * L * blk_qkv_;
    c.messages += phases_across * (G - 1.0);
  }
  // V-Major selective step: k active rows per source rank; returns the communication after V's
  // phase 1 and adds the bytes and the elementwise work.
  double selective(ExchangeCost& c, int step) const {
    const std::int64_t k_i = n_i - opt_.schedule.cached_tokens(step, opt_.steps, n_i);
    const double k = static_cast<double>(k_i);
    c.active = k_i;
    const double l1_gather = phase_ms(m_, p1_, L * n * f);                                      // L n partial sums per mate
    const double lists = k_i > 0 ? phase_ms(m_, p2_, L * k * sizeof(std::int32_t)) : 0.0;        // active lists
    // L1 over V^p1 and the phase-1 v ([G][L][n][hd], 8 B per element), V^p1's active rows, the
    // scatter of the received rows into QKV^p2.
    c.extra = ew(8 * P * n * hd) + ew(8 * P * k * hd) + ew(8 * P * k * 3 * hd);
    c.intra += (L - 1.0) * G * blk_o_ + (L - 1.0) * L * n * f + (L - 1.0) * G * k * 2 * hd * e_;
    c.inter += (G - 1.0) * L * k * 3 * hd * e_ + (k_i > 0 ? (G - 1.0) * L * k * sizeof(std::int32_t) : 0.0);
    c.messages += k_i > 0 ? 2.0 * (G - 1.0) : 0.0;
    return l1_gather + lists + phase1(k * 2 * hd * e_) + phase2(k * 3 * hd * e_);
  }

  double gemm(double rows, double K, double Ncol) const { return rows > 0 ? m_.gemm_ms(rows, K, Ncol) : 0.0; }
  double ew(double bytes) const { return m_.elementwise_ms(bytes); }

  // Compute of one double block, split where the exchange interleaves: before start_v (modulation,
  // LayerNorm, v projection), while V's phase 1 flies (q|k projection, QK norm + RoPE), after the
  // attention (proj, gated adds, MLP). Both streams: txt (M_t rows), img (M_i rows). A single block
  // over the n rows: linear1 as v, q|k, m (the m part is polled through too). Attention: h_p heads,
  // b N queries, N keys each (dense per image); the exchange's copies into and out of the head
  // layout. Once per step: conditioning MLPs, embeddings, the final layer and the Euler update.
  void compute(const DitShape& shape, const DitShard& shard) {
    const double Mw = static_cast<double>(cfg_.mlp_hidden), dh = static_cast<double>(cfg_.head_dim);
    const double hp = static_cast<double>(cfg_.heads / P);
    // N: the tokens of an image's attention (Wan: the video tokens only; its text is cross-attended)
    const double b = static_cast<double>(shape.batch), N = static_cast<double>(shard.text + shard.image);
    if (cfg_.cross_attention()) return wan_compute(shape, shard, N);
    const double Mt = b * static_cast<double>(shard.text_p), Mi = b * static_cast<double>(shard.image_p);
    double d_pre = 0, d_post = 0;
    for (const double rows : {Mt, Mi}) {
      d_pre += gemm(1, H, 6 * H) + ew(8 * rows * H) + gemm(rows, H, H);
      d_window_ += gemm(rows, H, 2 * H) + ew(8 * rows * 2 * H);
      d_post += gemm(rows, H, H) + ew(12 * rows * H) + ew(8 * rows * H) + gemm(rows, H, Mw) + ew(8 * rows * Mw) +
                gemm(rows, Mw, H) + ew(12 * rows * H);
    }
    const double s_pre = gemm(1, H, 3 * H) + ew(8 * n * H) + gemm(n, H, H);
    s_window_ = gemm(n, H, 2 * H) + ew(8 * n * 2 * H) + gemm(n, H, Mw);
    const double s_post = ew(8 * n * Mw) + gemm(n, H + Mw, H) + ew(12 * n * H);
    const double attn = m_.attn_fwd_ms(4 * dh * hp * b * N * N);
    // The exchange's copies into and out of the head layout; fp8: the codec on both sides of both.
    const double copies = ew(8 * n * 3 * H) + ew(8 * n * H) + (opt_.wire == Wire::fp8 ? ew(2 * 10 * n * 4 * H) : 0.0);
    const double C_in = static_cast<double>(cfg_.in_channels()), Tp = static_cast<double>(shard.text_p);
    per_step_ = gemm(1, static_cast<double>(cfg_.time_dim), H) + gemm(1, H, H) + gemm(1, static_cast<double>(cfg_.pooled_dim), H) +
                gemm(1, H, H) + gemm(Mi, static_cast<double>(cfg_.embed_in_channels()), H) + gemm(Tp, static_cast<double>(cfg_.text_dim), H) + ew(8 * (b - 1) * Tp * H) +
                gemm(1, H, 2 * H) + ew(8 * Mi * H) + gemm(Mi, H, C_in) + ew(12 * Mi * C_in);
    if (cfg_.guidance_embed) per_step_ += gemm(1, static_cast<double>(cfg_.time_dim), H) + gemm(1, H, H);
    const double D = static_cast<double>(cfg_.double_blocks), S = static_cast<double>(cfg_.single_blocks);
    d_block_ = d_pre + d_window_ + d_post + attn + copies;
    s_block_ = s_pre + s_window_ + s_post + attn + copies;
    block_compute_ = D * d_block_ + S * s_block_;
    cache_ew_ = ew(56 * Mi * H);
    pair_bytes_ = Mi * C_in * f;
  }

  // Wan's blocks (dit/model.hpp): self-attention as a single block's (v, then q|k under V's phase
  // 1), then the cross-attention to the T context rows every rank holds (q [n, H] x [H, H], k | v
  // [T, H] x [H, 2H], their RMS norms, all n_h heads over n queries x T keys, out [H, H]; no
  // exchange) and the MLP; per step the time MLP and projection [1, H] x [H, 6H], the text MLP over
  // the T rows, the patch embedding and the final layer.
  // I2V: the image context's keys / values [I, H] x [H, 2H], their norm, the n queries over its I
  // keys (all heads) and the sum into the text's output; 0 without one.
  double image_cross(double I) const {
    if (cfg_.image_dim == 0 || I == 0) return 0.0;
    return gemm(I, H, 2 * H) + ew(8 * I * H) + m_.attn_fwd_ms(4 * static_cast<double>(cfg_.head_dim * cfg_.heads) * n * I) +
           ew(12 * n * H);
  }
  void wan_compute(const DitShape& shape, const DitShard& shard, double N) {
    const double Mw = static_cast<double>(cfg_.mlp_hidden), dh = static_cast<double>(cfg_.head_dim);
    const double hp = static_cast<double>(cfg_.heads / P), b = static_cast<double>(shape.batch);
    const double T = static_cast<double>(shard.context), Mi = b * static_cast<double>(shard.image_p);
    const double pre = ew(8 * 6 * H) + ew(8 * n * H) + gemm(n, H, H);
    s_window_ = gemm(n, H, 2 * H) + ew(8 * n * 2 * H);
    const double cross = ew(8 * n * H) + gemm(n, H, H) + gemm(T, H, 2 * H) + ew(8 * (n + T) * H) +
                         m_.attn_fwd_ms(4 * dh * static_cast<double>(cfg_.heads) * n * T) + gemm(n, H, H) + ew(12 * n * H) +
                         image_cross(static_cast<double>(shape.image_context));
    const double post = gemm(n, H, H) + ew(12 * n * H) + cross + ew(8 * n * H) + gemm(n, H, Mw) + ew(8 * n * Mw) +
                        gemm(n, Mw, H) + ew(12 * n * H);
    const double attn = m_.attn_fwd_ms(4 * dh * hp * b * N * N);
    const double copies = ew(8 * n * 3 * H) + ew(8 * n * H) + (opt_.wire == Wire::fp8 ? ew(2 * 10 * n * 4 * H) : 0.0);
    const double C_in = static_cast<double>(cfg_.in_channels());
    per_step_ = gemm(1, static_cast<double>(cfg_.time_dim), H) + gemm(1, H, H) + gemm(1, H, 6 * H) +
                gemm(T, static_cast<double>(cfg_.text_dim), H) + ew(8 * T * H) + gemm(T, H, H) +
                gemm(Mi, static_cast<double>(cfg_.embed_in_channels()), H) +
                (cfg_.image_dim > 0 ? gemm(static_cast<double>(shape.image_context), static_cast<double>(cfg_.image_dim),
                                           static_cast<double>(cfg_.image_dim)) +
                                          gemm(static_cast<double>(shape.image_context), static_cast<double>(cfg_.image_dim), H)
                                    : 0.0) +
                ew(8 * Mi * H) + gemm(Mi, H, C_in) + ew(12 * Mi * C_in);
    s_block_ = pre + s_window_ + post + attn + copies;
    block_compute_ = static_cast<double>(cfg_.single_blocks) * s_block_;
    cache_ew_ = ew(56 * Mi * H);
    pair_bytes_ = Mi * C_in * f;
  }

  const SimMachine& m_;
  const DitConfig& cfg_;
  const SimDitOptions& opt_;
  static constexpr double f = sizeof(float);
  // Payload bytes per element on the wire: f32, or fp8's e4m3 plus one f32 scale per d_h elements.
  const double e_ = opt_.wire == Wire::fp8 ? 1.0 + 4.0 / static_cast<double>(cfg_.head_dim) : f;

 public:
  const int P, L, G;
  const double H, hd;
  const std::int64_t n_i;  // rows per rank per exchange
  const double n;
  const std::int64_t layers;

 private:
  Peers p1_, p2_;
  double blk_qkv_ = 0, blk_o_ = 0;
  double d_window_ = 0, s_window_ = 0, per_step_ = 0, block_compute_ = 0;
  double d_block_ = 0, s_block_ = 0, cache_ew_ = 0, pair_bytes_ = 0;
};

// Rows of `modes` that cannot run, with the reason.
std::vector<SimDitResult> unsupported_rows(const SimDitOptions& opt, int P, int L, const std::string& reason) {
  std::vector<SimDitResult> out;
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

// Whether First-Block Cache skips step `step` of `steps` when it skips round(fraction (steps - 1))
// of the steps after the first, spread evenly.
bool cached_step(int step, int steps, double fraction) {
  if (step == 0 || steps < 2) return false;
  const double k = std::round(fraction * (steps - 1)) / (steps - 1);
  return std::floor(step * k + 1e-9) != std::floor((step - 1) * k + 1e-9);
}

// One mode's run: every step's exchanges on the model, their bytes checked against the closed form.
// m: the whole machine (the model's may be a CFG-parallel half of it).
SimDitResult simulate_mode(const SimMachine& m, const DitStepModel& model, const std::string& mode_name, const DitConfig& cfg,
                           const SimDitOptions& opt) {
  const ExchangeMode mode = parse_exchange_mode(mode_name);
  SimDitResult r;
  r.mode = mode_name;
  r.P = m.P;
  r.L = model.L;
  r.steps = opt.steps;
  const bool vmajor = mode == ExchangeMode::cocodiff;
  const double D = static_cast<double>(cfg.double_blocks), S = static_cast<double>(cfg.single_blocks);
  const double layers = static_cast<double>(model.layers);
  const std::int64_t hd_i = cfg.heads / model.P * cfg.head_dim;
  const WireFormat wf{DType::f32, opt.wire, cfg.head_dim};
  // Passes a rank runs per step; CFG-parallel's pair: rank p and p + P/2, on another node when a
  // half holds whole nodes.
  const double passes = opt.cfg && !opt.cfg_parallel ? 2.0 : 1.0;
  bool pair_crosses = false;  // the slowest pair decides: any rank p < P/2 whose partner is on another node
  for (int p = 0; p < m.P / 2; ++p) pair_crosses = pair_crosses || p / m.R != (p + m.P / 2) / m.R;
  const Peers pair = pair_crosses ? Peers{0, 1} : Peers{1, 0};
  const double pair_ms = opt.cfg_parallel ? phase_ms(m, pair, model.velocity_bytes()) : 0.0;
  std::vector<double> step_times;
  for (int step = 0; step < opt.steps; ++step) {
    const ExchangeCost c = model.exchange(mode, step);
    SimDitStep s;
    s.active = c.active;
    if (cached_step(step, opt.steps, opt.cached_fraction)) {  // the first block and its exchange only
      const bool first_double = cfg.double_blocks > 0;
      s.bytes_intra = static_cast<std::uint64_t>(std::llround(passes * c.intra));
      s.bytes_inter = static_cast<std::uint64_t>(std::llround(passes * c.inter));
      s.comm_ms = passes * (first_double ? c.comm_d : c.comm_s) + pair_ms;
      s.exposed_comm_ms = passes * (first_double ? c.exposed_d : c.exposed_s) + pair_ms;
      s.compute_ms = passes * (model.cached_step_compute() + c.extra);
    } else if (mode == ExchangeMode::flat) {
      s.bytes_intra = static_cast<std::uint64_t>(std::llround(passes * layers * c.intra));
      s.bytes_inter = static_cast<std::uint64_t>(std::llround(passes * layers * c.inter));
    } else {
      // The reported bytes are the closed form's; the timed pieces must add up to them.
      const VMajorBytes cf = step_bytes(model.P, model.L, model.n_i, hd_i, model.layers, opt.schedule, step, opt.steps, vmajor, wf);
      DIFFCP_CHECK(std::llround(layers * c.intra) == static_cast<long long>(cf.intra) &&
                       std::llround(layers * c.inter) == static_cast<long long>(cf.inter),
                   "sim dit: mode ", mode_name, " step ", step, ": the timed pieces move ", layers * c.intra, " / ",
                   layers * c.inter, " bytes, the closed form ", cf.intra, " / ", cf.inter);
      s.bytes_intra = static_cast<std::uint64_t>(passes) * cf.intra;
      s.bytes_inter = static_cast<std::uint64_t>(passes) * cf.inter;
    }
    if (!cached_step(step, opt.steps, opt.cached_fraction)) {
      s.comm_ms = passes * (D * c.comm_d + S * c.comm_s) + pair_ms;
      s.exposed_comm_ms = passes * (D * c.exposed_d + S * c.exposed_s) + pair_ms;
      s.compute_ms = passes * (model.per_step_compute() + layers * c.extra);
    }
    s.step_ms = s.compute_ms + s.exposed_comm_ms;
    r.total_ms += s.step_ms;
    r.compute_ms += s.compute_ms / opt.steps;
    r.exposed_comm_ms += s.exposed_comm_ms / opt.steps;
    r.comm_ms += s.comm_ms / opt.steps;
    r.bytes_intra_total += s.bytes_intra;
    r.bytes_inter_total += s.bytes_inter;
    r.messages_inter_group += layers * c.messages;  // divided by the steps below
    step_times.push_back(s.step_ms);
    r.per_step.push_back(s);
  }
  if (mode != ExchangeMode::flat && opt.cached_fraction == 0) {
    // The run's closed form (times the passes) equals the sum of its steps'.
    const VMajorBytes run = vmajor_predicted_bytes(model.P, model.L, model.n_i, hd_i, model.layers, opt.schedule, opt.steps, vmajor, wf);
    DIFFCP_CHECK(static_cast<std::uint64_t>(passes) * run.intra == r.bytes_intra_total &&
                     static_cast<std::uint64_t>(passes) * run.inter == r.bytes_inter_total, "sim dit: mode ", mode_name,
                 ": per-step bytes ", r.bytes_intra_total, " / ", r.bytes_inter_total, " != the run's closed form ",
                 run.intra, " / ", run.inter);
  }
  r.step_ms = median(step_times);
  r.bytes_intra_group = static_cast<double>(r.bytes_intra_total) / opt.steps;
  r.messages_inter_group /= opt.steps;
  r.bytes_inter_group = static_cast<double>(r.bytes_inter_total) / opt.steps;
  return r;
}

}  // namespace

std::vector<SimDitResult> simulate_dit(const SimMachine& m, const DitConfig& cfg, const DitShape& shape,
                                       const SimDitOptions& opt) {
  m.validate();
  cfg.validate();
  shape.validate();
  opt.schedule.validate();
  DIFFCP_CHECK(opt.steps >= 1, "sim dit: `steps` = ", opt.steps, ", expected >= 1");
  DIFFCP_CHECK(opt.group_size >= 0, "sim dit: `group_size` = ", opt.group_size, ", expected >= 1 (0: the ranks of a node)");
  DIFFCP_CHECK(!opt.modes.empty(), "sim dit: no modes");
  DIFFCP_CHECK(std::isfinite(opt.cached_fraction) && opt.cached_fraction >= 0 && opt.cached_fraction <= 1,
               "sim dit: `cached_fraction` = ", opt.cached_fraction, ", expected in [0, 1]");
  DIFFCP_CHECK(!opt.cfg_parallel || opt.cfg, "sim dit: `cfg_parallel` runs the two passes of classifier-free guidance: add `cfg`");
  for (const std::string& mode : opt.modes) parse_exchange_mode(mode);  // throws naming the modes

  // CFG-parallel: each half of the ranks runs one pass, the model on P/2 of them.
  if (opt.cfg_parallel && m.P % 2 != 0)
    return unsupported_rows(opt, m.P, 1, "sim dit: --cfg-parallel splits the ranks into two equal halves; P = " +
                                             std::to_string(m.P) + " is odd");
  SimMachine half = m;
  if (opt.cfg_parallel) half.P = m.P / 2;
  const int P = half.P;
  const int L = opt.group_size > 0 ? opt.group_size : std::min(m.R, P);
  DitShard shard;
  try {
    shard = make_dit_shard(cfg, shape, P, 0);
  } catch (const Error& e) {
    return unsupported_rows(opt, m.P, L, reason_of(e));
  }
  if (P % L != 0)
    return unsupported_rows(opt, m.P, L, "sim dit: group size L = " + std::to_string(L) + " does not divide P = " + std::to_string(P) + " ranks");
  const DitStepModel model(half, cfg, shape, shard, L, opt);
  std::vector<SimDitResult> out;
  for (const std::string& mode : opt.modes) out.push_back(simulate_mode(m, model, mode, cfg, opt));
  return out;
}

}  // namespace diffcp
