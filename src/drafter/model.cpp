#include "drafter/model.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "core/error.hpp"
#include "ops/linear.hpp"
#include "ops/rmsnorm.hpp"

namespace diffcp {

namespace {

float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// dst[i] += src[i]
void add_into(std::vector<float>& dst, const std::vector<float>& src) {
  for (std::size_t i = 0; i < dst.size(); ++i) dst[i] += src[i];
}

// Row-wise RMSNorm over H (one "head" of width H): y = x * rstd * w.
void norm_rows(const std::vector<float>& x, std::int64_t rows, std::int64_t H, const float* w, double eps,
               std::vector<float>& y, std::vector<float>& rstd) {
  y.resize(static_cast<std::size_t>(rows * H));
  rstd.resize(static_cast<std::size_t>(rows));
  rmsnorm_forward(x.data(), rows, 1, H, w, static_cast<float>(eps), y.data(), rstd.data());
}

// dx = RMSNormBwd(dy) with dw accumulated.
std::vector<float> norm_rows_bwd(const std::vector<float>& dy, const std::vector<float>& x, const std::vector<float>& rstd,
                                 std::int64_t rows, std::int64_t H, const float* w, float* dw) {
  std::vector<float> dx(dy.size());
  rmsnorm_backward(dy.data(), x.data(), rstd.data(), rows, 1, H, w, dx.data(), dw);
  return dx;
}

}  // namespace

Drafter::Drafter(Communicator& cp, const DrafterConfig& cfg, SplitKVOptions attn)
    : comm_(cp), cfg_(cfg), attn_opt_(attn), layout_(cfg) {
  params_.assign(static_cast<std::size_t>(layout_.total), 0.f);
  grads_.assign(params_.size(), 0.f);
  layers_.resize(static_cast<std::size_t>(cfg_.layers));
}

void Drafter::init_params(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto fill = [&](std::int64_t off, std::int64_t n, double mean, double std) {
    std::normal_distribution<double> d(mean, std);
    for (std::int64_t j = 0; j < n; ++j) params_[static_cast<std::size_t>(off + j)] = static_cast<float>(d(rng));
  };
  const std::int64_t H = cfg_.hidden, F = cfg_.ffn;
  fill(layout_.fc, cfg_.target_layers * H * H, 0, 1 / std::sqrt(static_cast<double>(cfg_.target_layers * H)));
  for (std::int64_t l = 0; l < cfg_.layers; ++l) {
    const auto& L = layout_.layer[static_cast<std::size_t>(l)];
    AttnLayerParams a(cfg_.attn());
    a.init_random(seed + 1000 + static_cast<std::uint64_t>(l));
    std::fill_n(a[AttnLayerParams::bo], a.size(AttnLayerParams::bo), 0.f);  // fixed at zero (no bias in the format)
    std::copy(a.all().begin(), a.all().end(), params_.begin() + L.attn);
    fill(L.w_gate, H * F, 0, 1 / std::sqrt(static_cast<double>(H)));
    fill(L.w_up, H * F, 0, 1 / std::sqrt(static_cast<double>(H)));
    fill(L.w_down, F * H, 0, 1 / std::sqrt(static_cast<double>(F)) / std::sqrt(2.0 * static_cast<double>(cfg_.layers)));
  }
  // Norm weights start at 1 (attention's own q/k norms come from init_random above).
  for (std::int64_t l = 0; l < cfg_.layers; ++l) {
    const auto& L = layout_.layer[static_cast<std::size_t>(l)];
    std::fill_n(params_.begin() + L.attn_norm, H, 1.f);
    std::fill_n(params_.begin() + L.mlp_norm, H, 1.f);
  }
  std::fill_n(params_.begin() + layout_.fc_norm, H, 1.f);
  std::fill_n(params_.begin() + layout_.final_norm, H, 1.f);
}

AttnLayerParams Drafter::attn_params(std::vector<float>& buf, std::int64_t l) const {
  return AttnLayerParams(cfg_.attn(), buf.data() + layout_.layer[static_cast<std::size_t>(l)].attn);
}

void Drafter::embed(const DrafterBatch& mb) {
  const std::int64_t H = cfg_.hidden, B = cfg_.block, Qp = mb.shard.own_query_rows();
  if (!mb.block_input.empty() || Qp == 0) {
    DIFFCP_CHECK(static_cast<std::int64_t>(mb.block_input.size()) == Qp * H, "drafter: block_input has ",
                 mb.block_input.size(), " values, expected Q_p * H = ", Qp, " * ", H);
    h_ = mb.block_input;
    return;
  }
  DIFFCP_CHECK(static_cast<std::int64_t>(embedding_.size()) == cfg_.vocab * H, "drafter: the embedding has ",
               embedding_.size(), " values, expected V * H = ", cfg_.vocab, " * ", H);
  const auto refs = mb.shard.batch.blocks();
  h_.resize(static_cast<std::size_t>(Qp * H));
  std::int64_t r = 0;
  for (std::int64_t i = mb.shard.blocks.begin; i < mb.shard.blocks.end; ++i)
    for (std::int64_t k = 0; k < B; ++k, ++r) {
      const std::int32_t tok = k == 0 ? mb.tokens[static_cast<std::size_t>(refs[static_cast<std::size_t>(i)].anchor)] : cfg_.mask_token;
      std::copy_n(embedding_.begin() + tok * H, H, h_.begin() + r * H);
    }
}

void Drafter::forward(const DrafterBatch& mb) {
  const std::int64_t H = cfg_.hidden, F = cfg_.ffn, B = cfg_.block, T = cfg_.target_layers * H;
  const CpShard& s = mb.shard;
  const std::int64_t S = s.batch.context_rows(), Qp = s.own_query_rows(), Cp = s.context_rows();
  DIFFCP_CHECK(s.batch.block == B, "drafter: batch block ", s.batch.block, " != config block ", B);
  DIFFCP_CHECK(static_cast<std::int64_t>(mb.tokens.size()) == S && static_cast<std::int64_t>(mb.loss_mask.size()) == S,
               "drafter: ", mb.tokens.size(), " tokens and ", mb.loss_mask.size(), " mask entries for S = ", S);
  DIFFCP_CHECK(static_cast<std::int64_t>(mb.hidden_p.size()) == Cp * T, "drafter: hidden_p has ", mb.hidden_p.size(),
               " values, expected C_p * n_t * H = ", Cp, " * ", T);
  const float* P = params_.data();

  // Context fusion: c = RMSNorm(hidden_p fc).
  c_lin_.resize(static_cast<std::size_t>(Cp * H));
  linear_forward(mb.hidden_p.data(), Cp, T, P + layout_.fc, H, c_lin_.data());
  norm_rows(c_lin_, Cp, H, P + layout_.fc_norm, cfg_.rms_eps, c_, c_rstd_);

  embed(mb);
  std::vector<float> y(h_.size());
  for (std::int64_t l = 0; l < cfg_.layers; ++l) {
    LayerState& L = layers_[static_cast<std::size_t>(l)];
    const auto& off = layout_.layer[static_cast<std::size_t>(l)];
    if (!L.attn)
      L.attn = std::make_unique<SplitKVLayer>(comm_, cfg_.attn(), s, attn_opt_);
    else
      L.attn->reshard(s);
    L.h_in = h_;
    norm_rows(h_, Qp, H, P + off.attn_norm, cfg_.rms_eps, L.a, L.a_rstd);
    L.attn->forward(attn_params(params_, l), L.a.data(), c_.data(), y.data());
    add_into(h_, y);
    L.h_mid = h_;
    norm_rows(h_, Qp, H, P + off.mlp_norm, cfg_.rms_eps, L.m, L.m_rstd);
    L.gate.resize(static_cast<std::size_t>(Qp * F));
    L.up.resize(L.gate.size());
    L.act.resize(L.gate.size());
    linear_forward(L.m.data(), Qp, H, P + off.w_gate, F, L.gate.data());
    linear_forward(L.m.data(), Qp, H, P + off.w_up, F, L.up.data());
    for (std::size_t j = 0; j < L.act.size(); ++j) L.act[j] = L.gate[j] * sigmoid(L.gate[j]) * L.up[j];
    linear_forward(L.act.data(), Qp, F, P + off.w_down, H, h_.data(), 1.f);  // h += act W_down
  }
  norm_rows(h_, Qp, H, P + layout_.final_norm, cfg_.rms_eps, hf_, hf_rstd_);
}

const std::vector<float>& Drafter::forward_hidden(const DrafterBatch& mb) {
  forward(mb);
  return hf_;
}

DrafterStats Drafter::step(const DrafterBatch& mb, bool backward) {
  const std::int64_t H = cfg_.hidden, F = cfg_.ffn, V = cfg_.vocab, B = cfg_.block, T = cfg_.target_layers * H;
  const CpShard& s = mb.shard;
  const std::int64_t Qp = s.own_query_rows(), Cp = s.context_rows();
  DIFFCP_CHECK(static_cast<std::int64_t>(lm_head_.size()) == H * V, "drafter: the LM head has ", lm_head_.size(),
               " values, expected H * V = ", H, " * ", V);
  forward(mb);
  const float* P = params_.data();
  logits_.resize(static_cast<std::size_t>(Qp * V));
  linear_forward(hf_.data(), Qp, H, lm_head_.data(), V, logits_.data());

  // Decay-weighted cross-entropy; dlogits overwrite logits when training.
  DrafterStats st;
  st.correct.assign(static_cast<std::size_t>(B), 0);
  st.counted.assign(static_cast<std::size_t>(B), 0);
  argmax_.assign(static_cast<std::size_t>(Qp), 0);
  const auto refs = s.batch.blocks();
  for (std::int64_t r = 0; r < Qp; ++r) {
    const std::int64_t k = r % B, anchor = refs[static_cast<std::size_t>(s.blocks.begin + r / B)].anchor;
    const std::int32_t target = mb.tokens[static_cast<std::size_t>(anchor + k)];
    const double w = k == 0 ? 0.0 : std::exp(-static_cast<double>(k - 1) / cfg_.gamma) * mb.loss_mask[static_cast<std::size_t>(anchor + k)];
    float* lg = logits_.data() + r * V;
    const auto best = static_cast<std::int32_t>(std::max_element(lg, lg + V) - lg);
    argmax_[static_cast<std::size_t>(r)] = best;
    double mx = lg[best], sum = 0;
    for (std::int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(lg[v]) - mx);
    const double lse = mx + std::log(sum);
    if (w > 0) {
      st.loss_sum += w * (lse - lg[target]);
      st.weight_sum += w;
      st.correct[static_cast<std::size_t>(k)] += best == target;
      st.counted[static_cast<std::size_t>(k)] += 1;
    }
    if (backward) {
      for (std::int64_t v = 0; v < V; ++v)
        lg[v] = static_cast<float>(w * (std::exp(static_cast<double>(lg[v]) - lse) - (v == target ? 1.0 : 0.0)));
    }
  }
  if (!backward) return st;

  float* G = grads_.data();
  std::vector<float> dhf(static_cast<std::size_t>(Qp * H));
  linear_backward_input(logits_.data(), Qp, V, lm_head_.data(), H, dhf.data());
  std::vector<float> dh = norm_rows_bwd(dhf, h_, hf_rstd_, Qp, H, P + layout_.final_norm, G + layout_.final_norm);
  std::vector<float> dc(static_cast<std::size_t>(Cp * H), 0.f), dc_l(dc.size()), da(dh.size());
  std::vector<float> dact(static_cast<std::size_t>(Qp * F)), dgate(dact.size()), dup(dact.size()), dm(dh.size());
  for (std::int64_t l = cfg_.layers - 1; l >= 0; --l) {
    LayerState& L = layers_[static_cast<std::size_t>(l)];
    const auto& off = layout_.layer[static_cast<std::size_t>(l)];
    // MLP: h_out = h_mid + act W_down, act = silu(gate) * up.
    linear_backward_weight(L.act.data(), Qp, F, dh.data(), H, G + off.w_down);
    linear_backward_input(dh.data(), Qp, H, P + off.w_down, F, dact.data());
    for (std::size_t j = 0; j < dact.size(); ++j) {
      const float sg = sigmoid(L.gate[j]);
      dup[j] = dact[j] * L.gate[j] * sg;
      dgate[j] = dact[j] * L.up[j] * sg * (1.f + L.gate[j] * (1.f - sg));
    }
    linear_backward_weight(L.m.data(), Qp, H, dgate.data(), F, G + off.w_gate);
    linear_backward_weight(L.m.data(), Qp, H, dup.data(), F, G + off.w_up);
    linear_backward_input(dgate.data(), Qp, F, P + off.w_gate, H, dm.data());
    linear_backward_input(dup.data(), Qp, F, P + off.w_up, H, dm.data(), 1.f);
    add_into(dh, norm_rows_bwd(dm, L.h_mid, L.m_rstd, Qp, H, P + off.mlp_norm, G + off.mlp_norm));
    // Attention: h_mid = h_in + SplitKV(a, c).
    AttnLayerParams gview = attn_params(grads_, l);
    L.attn->backward(attn_params(params_, l), dh.data(), da.data(), dc_l.data(), gview);
    std::fill_n(gview[AttnLayerParams::bo], gview.size(AttnLayerParams::bo), 0.f);  // b_o stays zero
    add_into(dh, norm_rows_bwd(da, L.h_in, L.a_rstd, Qp, H, P + off.attn_norm, G + off.attn_norm));
    add_into(dc, dc_l);
  }
  // The embedding is frozen: dh stops here. Context fusion backward.
  const std::vector<float> dc_lin = norm_rows_bwd(dc, c_lin_, c_rstd_, Cp, H, P + layout_.fc_norm, G + layout_.fc_norm);
  linear_backward_weight(mb.hidden_p.data(), Cp, T, dc_lin.data(), H, G + layout_.fc);
  return st;
}

}  // namespace diffcp
