// The whole drafter training step's gradients against an independent fp64 reference (issue #37):
// the loss of one micro-batch written from SPEC A.1 in plain fp64 loops (context fusion fc +
// RMSNorm, per layer RMSNorm -> Split-KV attention (the fp64 layer reference, its mask built from
// the batch alone) -> residual -> RMSNorm -> SwiGLU -> residual, the final RMSNorm, the frozen LM
// head, cross-entropy per slot with w_k = exp(-(k-1)/gamma) times the loss mask), differentiated by
// central finite differences in fp64, against the analytic gradients of `Drafter::step` (fc,
// norms, SwiGLU, attention, LM head, decay-weighted loss), summed over the CP ranks (P = 1, 2, 3).
// b_o is fixed at zero in the drafter (the DFlash format has none) and is not compared.
#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "diffcp/cp/attention_layer.hpp"
#include "diffcp/drafter/model.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/testing/compare.hpp"
#include "diffcp/testing/reference_layer.hpp"
#include "diffcp/workload/batch.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

using Vec = std::vector<double>;

DrafterConfig tiny_config() {
  DrafterConfig c;
  c.vocab = 32, c.hidden = 16, c.target_layers = 2, c.layers = 2;
  c.n_q = 2, c.n_kv = 1, c.d_h = 8, c.ffn = 24, c.block = 4, c.gamma = 4.0, c.mask_token = 31;
  c.target_layer_ids = {0, 1};
  c.target_depth = 2;
  return c;
}

// One micro-batch in global order: the target's hidden states [S, n_t H], the blocks' input rows
// h_0 [Q, H] (a serving engine's noise embedding: no embedding table needed), tokens, loss mask,
// the frozen LM head [H, V].
struct Problem {
  DrafterConfig cfg;
  PackedBatch batch = make_random_batch(2, 24, 2, cfg.block, 0.25, 11, 40);
  std::vector<float> hidden, block_input, lm_head;
  std::vector<std::int32_t> tokens;
  std::vector<std::uint8_t> loss_mask;
  explicit Problem(DrafterConfig c = tiny_config()) : cfg(std::move(c)) {
    std::mt19937_64 rng(3);
    std::normal_distribution<double> n(0.0, 1.0);
    const std::int64_t S = batch.context_rows(), Q = batch.query_rows(), H = cfg.hidden;
    for (std::int64_t i = 0; i < S * cfg.target_layers * H; ++i) hidden.push_back(static_cast<float>(n(rng)));
    for (std::int64_t i = 0; i < Q * H; ++i) block_input.push_back(static_cast<float>(n(rng)));
    for (std::int64_t i = 0; i < H * cfg.vocab; ++i) lm_head.push_back(static_cast<float>(0.5 * n(rng)));
    for (std::int64_t i = 0; i < S; ++i) {
      tokens.push_back(static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(cfg.vocab - 1)));
      loss_mask.push_back(rng() % 5 != 0);  // a few tokens without loss
    }
  }
};

// The seeded init with every norm weight moved off 1 and b_o zero (the drafter keeps it zero).
std::vector<float> test_params(const DrafterConfig& cfg) {
  auto self = test::world().split(test::world().rank(), 0, "self");
  Drafter d(*self, cfg);
  d.init_params(7);
  std::vector<float> p = to_host<float>(d.params().view());
  std::mt19937_64 rng(8);
  std::normal_distribution<double> n(0.0, 0.2);
  const DrafterLayout lay(cfg);
  for (const auto& [off, len] : lay.vectors)
    for (std::int64_t j = 0; j < len; ++j) p[static_cast<std::size_t>(off + j)] += static_cast<float>(n(rng));
  const auto a = AttnLayerParams::offsets(cfg.attn());
  for (const auto& L : lay.layer) std::fill_n(p.begin() + L.attn + a[AttnLayerParams::bo], cfg.hidden, 0.f);
  if (cfg.has_selector())  // DFlash2's selector: the successor codebook off its zero init, all of it random
    for (const auto& [off, len] : {std::pair{lay.sel_pred, cfg.vocab * cfg.selector_rank},
                                   std::pair{lay.sel_succ, cfg.vocab * cfg.selector_rank},
                                   std::pair{lay.sel_proj, cfg.hidden * cfg.selector_rank}})
      for (std::int64_t j = 0; j < len; ++j) p[static_cast<std::size_t>(off + j)] = static_cast<float>(2 * n(rng));
  if (cfg.has_conv())  // DFlash2: the taps' projections off their zero init (the bases are vectors: moved above)
    for (const auto& L : lay.layer)
      for (const std::int64_t proj : {L.attn_conv_proj, L.mlp_conv_proj})
        for (std::int64_t j = 0; j < cfg.hidden * 2 * cfg.conv_taps * cfg.conv_groups(); ++j)
          p[static_cast<std::size_t>(proj + j)] = static_cast<float>(n(rng));
  return p;
}

// fp64 loss sum_rows w CE of the micro-batch with parameters p (stored as the drafter stores them:
// matrices [in, out], DrafterLayout's offsets).
// gamma: the loss decay (the config's; another one for the test that the check can fail).
// windows: the layers' sliding windows as the config's fields say (false: every layer full, the
// sliding test's negative control).
// conv_blocks: DFlash2's convolution taps stop at each block's first row (false: they run across
// the blocks, the DFlash2 test's negative control).
// DFlash2's selector (cfg.has_selector(), weight lambda): the logits mapped (multiplier, soft cap),
// and per row lambda w CE over the top-K scores S_j = y[C_j] + (h P . A[prev]) B[C_j] when the
// target is a candidate; prev = the token before the target (lambda 0: no selector loss, the
// selector test's negative control).
constexpr double kLambda = 0.5;
double reference_loss(const Problem& pb, const std::vector<float>& p, double gamma, bool windows = true,
                      bool conv_blocks = true, double lambda = kLambda) {
  const DrafterConfig& c = pb.cfg;
  const DrafterLayout lay(c);
  const std::int64_t S = pb.batch.context_rows(), Q = pb.batch.query_rows(), H = c.hidden, F = c.ffn, T = c.target_layers * H;
  const auto at = [&](std::int64_t off) { return static_cast<double>(p[static_cast<std::size_t>(off)]); };
  const auto lin = [&](const Vec& x, std::int64_t n, std::int64_t in, std::int64_t off, std::int64_t out) {
    Vec y(static_cast<std::size_t>(n * out), 0.0);
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t i = 0; i < in; ++i)
        for (std::int64_t o = 0; o < out; ++o) y[static_cast<std::size_t>(r * out + o)] += x[static_cast<std::size_t>(r * in + i)] * at(off + i * out + o);
    return y;
  };
  const auto norm = [&](Vec x, std::int64_t off) {
    for (std::size_t g = 0; g < x.size(); g += static_cast<std::size_t>(H)) {
      double ss = 0;
      for (std::int64_t j = 0; j < H; ++j) ss += x[g + static_cast<std::size_t>(j)] * x[g + static_cast<std::size_t>(j)];
      const double r = 1.0 / std::sqrt(ss / static_cast<double>(H) + c.rms_eps);
      for (std::int64_t j = 0; j < H; ++j) x[g + static_cast<std::size_t>(j)] *= r * at(off + j);
    }
    return x;
  };
  // DFlash2 (z-lab's GroupedDynamicCausalConv): y[t, c] = sum over o < K of (base[half, o, c] +
  // dyn[t, half, o, c / gs]) x[t - o, c], rows t - o of t's block (conv_blocks) or of the batch
  const std::int64_t K = c.conv_taps, Gc = c.conv_groups(), KG = K * Gc;
  const auto conv = [&](const Vec& x, const Vec& dyn, std::int64_t half, std::int64_t base) {
    Vec y(x.size(), 0.0);
    for (std::int64_t t = 0; t < Q; ++t)
      for (std::int64_t ch = 0; ch < H; ++ch)
        for (std::int64_t o = 0; o < K && o <= (conv_blocks ? t % c.block : t); ++o)
          y[static_cast<std::size_t>(t * H + ch)] +=
              (at(base + (half * K + o) * H + ch) + dyn[static_cast<std::size_t>(t * 2 * KG + half * KG + o * Gc + ch / c.conv_group_size)]) *
              x[static_cast<std::size_t>((t - o) * H + ch)];
    return y;
  };
  const Vec ctx = norm(lin(Vec(pb.hidden.begin(), pb.hidden.end()), S, T, lay.fc, H), lay.fc_norm);
  Vec h(pb.block_input.begin(), pb.block_input.end());
  const Vec no_dy(static_cast<std::size_t>(Q * H), 0.0);
  for (std::size_t l = 0; l < lay.layer.size(); ++l) {
    const DrafterLayout::Layer& L = lay.layer[l];
    const Vec a = norm(h, L.attn_norm);
    const Vec a_dyn = c.has_conv() ? lin(a, Q, H, L.attn_conv_proj, 2 * KG) : Vec{};
    const Vec a_in = c.has_conv() ? conv(a, a_dyn, 0, L.attn_conv_base) : a;
    const AttnLayerParams w = AttnLayerParams::view(c.attn(), p.data() + L.attn);
    // z-lab's DFlashDraftModel: a sliding layer has the config's window and is causal unless
    // config.is_causal says otherwise
    const bool sliding = windows && !c.layer_types.empty() && c.layer_types[l] == "sliding_attention";
    const KeyWindow kw{sliding ? c.sliding_window : 0, c.is_causal ? *c.is_causal : sliding};
    Vec y = reference_attention_layer(c.attn(), pb.batch, w, a_in, ctx, no_dy, kw).y;
    if (c.has_conv()) y = conv(y, a_dyn, 1, L.attn_conv_base);
    for (std::size_t i = 0; i < h.size(); ++i) h[i] += y[i];
    const Vec m = norm(h, L.mlp_norm);
    const Vec m_dyn = c.has_conv() ? lin(m, Q, H, L.mlp_conv_proj, 2 * KG) : Vec{};
    const Vec m_in = c.has_conv() ? conv(m, m_dyn, 0, L.mlp_conv_base) : m;
    const Vec g = lin(m_in, Q, H, L.w_gate, F), u = lin(m_in, Q, H, L.w_up, F);
    Vec act(g.size());
    for (std::size_t i = 0; i < g.size(); ++i) act[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
    Vec down = lin(act, Q, F, L.w_down, H);
    if (c.has_conv()) down = conv(down, m_dyn, 1, L.mlp_conv_base);
    for (std::size_t i = 0; i < h.size(); ++i) h[i] += down[i];
  }
  const Vec hf = norm(h, lay.final_norm);
  // Slot k of block i (sample u, in-sample anchor a) predicts packed token s_u + a + k.
  double loss = 0;
  std::int64_t row = 0, start = 0;
  for (std::size_t u = 0; u < pb.batch.lengths.size(); ++u) {
    for (const std::int64_t anchor : pb.batch.anchors[u])
      for (std::int64_t k = 0; k < c.block; ++k, ++row) {
        const std::int64_t t = start + anchor + k;
        const double w = k == 0 ? 0.0 : std::exp(-static_cast<double>(k - 1) / gamma) * pb.loss_mask[static_cast<std::size_t>(t)];
        if (w == 0) continue;
        Vec logit(static_cast<std::size_t>(c.vocab), 0.0);
        for (std::int64_t j = 0; j < H; ++j)
          for (std::int64_t v = 0; v < c.vocab; ++v)
            logit[static_cast<std::size_t>(v)] += hf[static_cast<std::size_t>(row * H + j)] * pb.lm_head[static_cast<std::size_t>(j * c.vocab + v)];
        for (double& x : logit) {  // DFlash2's map (the identity for DFlash)
          x *= c.output_multiplier;
          if (c.logit_softcap > 0) x = c.logit_softcap * std::tanh(x / c.logit_softcap);
        }
        const std::int32_t gold = pb.tokens[static_cast<std::size_t>(t)];
        double mx = logit[0], se = 0;
        for (const double x : logit) mx = std::max(mx, x);
        for (const double x : logit) se += std::exp(x - mx);
        loss += w * (mx + std::log(se) - logit[static_cast<std::size_t>(gold)]);
        if (!c.has_selector()) continue;
        const std::int64_t K = c.selector_top_k, r = c.selector_rank;
        std::vector<std::int32_t> ids(static_cast<std::size_t>(c.vocab));
        for (std::int32_t v = 0; v < c.vocab; ++v) ids[static_cast<std::size_t>(v)] = v;
        std::stable_sort(ids.begin(), ids.end(), [&](std::int32_t a, std::int32_t b) {
          return logit[static_cast<std::size_t>(a)] > logit[static_cast<std::size_t>(b)];
        });
        const std::int32_t prev = pb.tokens[static_cast<std::size_t>(t - 1)];
        Vec z(static_cast<std::size_t>(r), 0.0);
        for (std::int64_t j = 0; j < r; ++j) {
          for (std::int64_t i = 0; i < H; ++i) z[static_cast<std::size_t>(j)] += hf[static_cast<std::size_t>(row * H + i)] * at(lay.sel_proj + i * r + j);
          z[static_cast<std::size_t>(j)] *= at(lay.sel_pred + prev * r + j);
        }
        Vec S(static_cast<std::size_t>(K));
        std::int64_t slot = -1;
        for (std::int64_t k2 = 0; k2 < K; ++k2) {
          const std::int32_t cand = ids[static_cast<std::size_t>(k2)];
          double sc = logit[static_cast<std::size_t>(cand)];
          for (std::int64_t j = 0; j < r; ++j) sc += z[static_cast<std::size_t>(j)] * at(lay.sel_succ + cand * r + j);
          S[static_cast<std::size_t>(k2)] = sc;
          if (cand == gold) slot = k2;
        }
        if (slot < 0) continue;  // not a candidate: no selector loss
        double sm = S[0], ss = 0;
        for (const double x : S) sm = std::max(sm, x);
        for (const double x : S) ss += std::exp(x - sm);
        loss += lambda * w * (sm + std::log(ss) - S[static_cast<std::size_t>(slot)]);
      }
    start += pb.batch.lengths[u];
  }
  return loss;
}

// This rank's part of the problem's micro-batch over the world (contiguous shards).
DrafterBatch rank_batch(const Problem& pb) {
  Communicator& world = test::world();
  DrafterBatch mb;
  mb.shard = contiguous_shard(pb.batch, world.size(), world.rank());
  mb.tokens = pb.tokens;
  mb.loss_mask = pb.loss_mask;
  const std::int64_t T = pb.cfg.target_layers * pb.cfg.hidden, H = pb.cfg.hidden;
  for (const PosRange& r : mb.shard.chunks)
    mb.hidden_p.insert(mb.hidden_p.end(), pb.hidden.begin() + r.begin * T, pb.hidden.begin() + r.end * T);
  mb.block_input.assign(pb.block_input.begin() + mb.shard.blocks.begin * pb.cfg.block * H,
                        pb.block_input.begin() + mb.shard.blocks.end * pb.cfg.block * H);
  return mb;
}

// The drafter's gradients of the same loss, computed with Split-KV over the world's ranks and
// summed over them. DFlash2's selector: the LM head vocabulary-parallel over the ranks (each its
// slice of columns: the candidates merged across them).
std::vector<float> drafter_gradients(const Problem& pb, const std::vector<float>& p) {
  Communicator& world = test::world();
  const DrafterConfig& c = pb.cfg;
  Drafter d(world, c);
  d.state().set_params(p);
  d.state().zero_grads();
  d.set_selector_loss_weight(kLambda);
  if (c.has_selector()) {
    const auto [v0, v1] = vocab_slice(c.vocab, world.size(), world.rank());
    std::vector<float> slice;
    for (std::int64_t h = 0; h < c.hidden; ++h)
      slice.insert(slice.end(), pb.lm_head.begin() + h * c.vocab + v0, pb.lm_head.begin() + h * c.vocab + v1);
    d.set_lm_head(LmHead(&world, c.hidden, c.vocab, slice, v0));
  } else {
    d.set_lm_head(LmHead(nullptr, c.hidden, c.vocab, pb.lm_head, 0));
  }
  const DrafterBatch mb = rank_batch(pb);
  const DrafterStats st = d.step(mb, true);
  if (c.has_selector()) {  // the selector's loss is there: some targets among the candidates
    std::vector<double> covered{static_cast<double>(st.selector_covered)};
    world.all_reduce<double>(covered);
    EXPECT_GE(covered[0], 3);
  }
  std::vector<double> loss{st.loss_sum};
  world.all_reduce<double>(loss);
  EXPECT_NEAR(loss[0], reference_loss(pb, p, c.gamma), 1e-4 * std::max(1.0, std::abs(loss[0])));
  std::vector<float> g = to_host<float>(d.grads().view());
  world.all_reduce<float>(g);
  return g;
}

// The drafter's gradients against central differences of the fp64 loss; the check must fail
// against `wrong` (a loss with another decay, or without the layers' windows).
void check_gradients(const Problem& pb, const std::function<double(const std::vector<float>&)>& wrong);

TEST(DrafterStep, GradientsEqualFiniteDifferencesOfAnFp64Reference) {
  const Problem pb;
  // against a loss whose decay is off (gamma + 1: every slot's weight but slot 1's changes)
  check_gradients(pb, [&](const std::vector<float>& p) { return reference_loss(pb, p, pb.cfg.gamma + 1.0); });
}

TEST(DrafterStep, SlidingWindowLayersEqualFiniteDifferencesOfAnFp64Reference) {
  DrafterConfig c = tiny_config();
  c.layer_types = {"sliding_attention", "full_attention"};
  c.sliding_window = 3;
  const Problem pb(c);
  // against the same loss with full layers only: the window matters
  check_gradients(pb, [&](const std::vector<float>& p) { return reference_loss(pb, p, pb.cfg.gamma, false); });
}

// DFlash2: each layer's convolutions (3 taps, groups of 4 channels) around its attention and MLP,
// over blocks of 4 rows.
DrafterConfig dflash2_config() {
  DrafterConfig c = tiny_config();
  c.conv_taps = 3;
  c.conv_group_size = 4;
  return c;
}

TEST(DrafterStep, Dflash2ConvolutionsEqualFiniteDifferencesOfAnFp64Reference) {
  for (const std::int64_t B : {4, 8}) {  // (8: the taps of rows past the fourth)
    DrafterConfig c = dflash2_config();
    c.block = B;
    const Problem pb(c);
    // against the same loss with the taps running across the blocks: the block boundary matters
    check_gradients(pb, [&](const std::vector<float>& p) { return reference_loss(pb, p, pb.cfg.gamma, true, false); });
  }
}

// DFlash2's candidate selector (rank 4 over the top 16 of 32: more than a rank's columns at P = 3) on logits x 0.7 soft-capped at 3, with
// the LM head split over the ranks: every gradient (the codebooks and the projection included)
// against the fp64 loss.
TEST(DrafterStep, Dflash2SelectorLossEqualsFiniteDifferencesOfAnFp64Reference) {
  DrafterConfig c = dflash2_config();
  c.selector_rank = 4;
  c.selector_top_k = 16;
  c.output_multiplier = 0.7;
  c.logit_softcap = 3;
  const Problem pb(c);
  // against the same loss without the selector's term: it matters
  check_gradients(pb, [&](const std::vector<float>& p) { return reference_loss(pb, p, pb.cfg.gamma, true, true, 0.0); });
}

// A fresh DFlash2 (identity convolutions: tap 0 of both bases 1, the rest and the projections 0)
// is DFlash: the same loss and, for every tensor they share, the same gradients, bit for bit.
TEST(DrafterStep, AFreshDflash2IsDflash) {
  const Problem v1, v2(dflash2_config());
  const auto run = [](const Problem& pb) {
    Communicator& world = test::world();
    Drafter d(world, pb.cfg);
    d.init_params(7);
    d.state().zero_grads();
    d.set_lm_head(LmHead(nullptr, pb.cfg.hidden, pb.cfg.vocab, pb.lm_head, 0));
    const DrafterBatch mb = rank_batch(pb);
    const double loss = d.step(mb, true).loss_sum;
    return std::make_pair(loss, to_host<float>(d.grads().view()));
  };
  const auto [loss1, g1] = run(v1);
  const auto [loss2, g2] = run(v2);
  EXPECT_EQ(loss1, loss2);
  const DrafterLayout l1(v1.cfg), l2(v2.cfg);
  const auto same = [&](std::int64_t o1, std::int64_t o2, std::int64_t n, const char* what) {
    EXPECT_TRUE(std::equal(g1.begin() + o1, g1.begin() + o1 + n, g2.begin() + o2)) << what;
  };
  same(l1.fc, l2.fc, l2.fc_norm + v2.cfg.hidden - l2.fc, "fc, fc_norm");
  same(l1.final_norm, l2.final_norm, v2.cfg.hidden, "final_norm");
  for (std::size_t l = 0; l < l2.layer.size(); ++l)  // the DFlash part of the layer: attn_norm .. w_down
    same(l1.layer[l].attn_norm, l2.layer[l].attn_norm, l2.layer[l].w_down + v2.cfg.ffn * v2.cfg.hidden - l2.layer[l].attn_norm,
         "a layer's DFlash tensors");
}

// DFlash2's convolutions and selector are local to a block: a DFlash2 step moves over the CP group
// exactly the bytes DFlash's does (Split-KV's, every layer, forward and backward; the LM head whole).
TEST(DrafterStep, Dflash2MovesWhatDflashMoves) {
  DrafterConfig v2 = dflash2_config();
  v2.selector_rank = 4;
  v2.selector_top_k = 6;
  const Problem v1, p2(v2);
  const auto bytes = [](const Problem& pb) {
    Communicator& world = test::world();
    Drafter d(world, pb.cfg);
    d.init_params(7);
    d.state().zero_grads();
    d.set_lm_head(LmHead(nullptr, pb.cfg.hidden, pb.cfg.vocab, pb.lm_head, 0));
    const DrafterBatch mb = rank_batch(pb);
    const std::uint64_t before = world.stats().total().bytes_sent;
    d.step(mb, true);
    return world.stats().total().bytes_sent - before;
  };
  const std::uint64_t b1 = bytes(v1), b2 = bytes(p2);
  EXPECT_EQ(b1, b2);
  if (test::world().size() > 1) EXPECT_GT(b1, 0u);  // Split-KV moved something
}

void check_gradients(const Problem& pb, const std::function<double(const std::vector<float>&)>& wrong) {
  std::vector<float> p = test_params(pb.cfg);
  const std::vector<float> g = drafter_gradients(pb, p);
  // Every tensor, 6 entries each (seeded), by central differences of the fp64 loss.
  const DrafterLayout lay(pb.cfg);
  const auto a = AttnLayerParams::offsets(pb.cfg.attn());
  const std::int64_t H = pb.cfg.hidden, T = pb.cfg.target_layers * H, F = pb.cfg.ffn;
  std::vector<std::pair<std::int64_t, std::int64_t>> tensors{{lay.fc, T * H}, {lay.fc_norm, H}, {lay.final_norm, H}};
  for (const auto& L : lay.layer) {
    tensors.insert(tensors.end(), {{L.attn_norm, H}, {L.mlp_norm, H}, {L.w_gate, H * F}, {L.w_up, H * F}, {L.w_down, F * H}});
    if (pb.cfg.has_selector() && &L == &lay.layer.front()) {
      const std::int64_t Vr = pb.cfg.vocab * pb.cfg.selector_rank;
      tensors.insert(tensors.end(), {{lay.sel_pred, Vr}, {lay.sel_pred, Vr}, {lay.sel_succ, Vr}, {lay.sel_succ, Vr},
                                     {lay.sel_proj, H * pb.cfg.selector_rank}});
    }
    if (pb.cfg.has_conv()) {
      const std::int64_t KH = pb.cfg.conv_taps * H, W = H * 2 * pb.cfg.conv_taps * pb.cfg.conv_groups();
      tensors.insert(tensors.end(), {{L.attn_conv_base, KH}, {L.attn_conv_base + KH, KH}, {L.attn_conv_proj, W},
                                     {L.mlp_conv_base, KH}, {L.mlp_conv_base + KH, KH}, {L.mlp_conv_proj, W}});
    }
    for (const auto id : {AttnLayerParams::wq, AttnLayerParams::wk, AttnLayerParams::wv, AttnLayerParams::wo,
                          AttnLayerParams::q_norm, AttnLayerParams::k_norm})
      tensors.push_back({L.attn + a[id], a[id + 1] - a[id]});
  }
  std::mt19937_64 rng(5);
  std::vector<std::size_t> picked;
  for (const auto& [off, size] : tensors)
    for (int s = 0; s < 6; ++s)
      picked.push_back(static_cast<std::size_t>(off + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(size))));
  // Central differences of an fp64 loss at the picked parameters.
  const auto finite_differences = [&](const std::function<double(const std::vector<float>&)>& loss) {
    std::vector<double> out;
    for (const std::size_t j : picked) {
      const float x = p[j];
      const float hi = x + 1e-3f, lo = x - 1e-3f;
      p[j] = hi;
      const double up = loss(p);
      p[j] = lo;
      const double down = loss(p);
      p[j] = x;
      out.push_back((up - down) / (static_cast<double>(hi) - static_cast<double>(lo)));
    }
    return out;
  };
  const std::vector<double> fd = finite_differences([&](const std::vector<float>& q) { return reference_loss(pb, q, pb.cfg.gamma); });
  std::vector<double> got;
  for (const std::size_t j : picked) got.push_back(static_cast<double>(g[j]));
  double scale = 0;
  for (const double v : fd) scale = std::max(scale, std::abs(v));
  ASSERT_GT(scale, 1e-3);  // the loss depends on the parameters at all
  const CompareResult r = compare<double>(got, fd, {2e-4 * scale, 2e-3});
  EXPECT_TRUE(r.pass()) << r.mismatched << " of " << fd.size() << " gradients off; worst ratio " << r.worst_ratio << " at "
                        << r.worst << ": drafter " << got[static_cast<std::size_t>(r.worst)] << ", finite differences "
                        << fd[static_cast<std::size_t>(r.worst)];
  // The check can fail: against the wrong loss, the drafter's gradients no longer match.
  const std::vector<double> fd_wrong = finite_differences(wrong);
  EXPECT_FALSE(compare<double>(got, fd_wrong, {2e-4 * scale, 2e-3}).pass());
}

}  // namespace
}  // namespace diffcp
