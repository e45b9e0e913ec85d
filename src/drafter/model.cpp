#include "diffcp/drafter/model.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>

#include "diffcp/core/error.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/ops/conv.hpp"
#include "diffcp/ops/elementwise.hpp"
#include "diffcp/ops/linear.hpp"
#include "diffcp/ops/rmsnorm.hpp"

namespace diffcp {

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// A [rows, cols] view of the active backend's memory.
TensorView dview(float* p, std::int64_t rows, std::int64_t cols) {
  return TensorView::contiguous(p, DType::f32, {rows, cols}, active_device());
}

// Whether the backend computes on host memory (the CPU): the batch's host inputs are then its
// operands as they are, with no copy of the largest input (the target hidden states).
bool computes_on_host() { return active_device() == Device::host; }

// dst[i] += src[i] (the backend's add op)
void add_into(DeviceVector<float>& dst, const DeviceVector<float>& src) {
  diffcp::add_into(dst.data(), src.data(), static_cast<std::int64_t>(dst.size()));
}

// Row-wise RMSNorm over H (one "head" of width H): y = x * rstd * w.
void norm_rows(const DeviceVector<float>& x, std::int64_t rows, std::int64_t H, const float* w, double eps,
               DeviceVector<float>& y, DeviceVector<float>& rstd) {
  y.resize(rows * H);
  rstd.resize(rows);
  rmsnorm_forward(x.data(), rows, 1, H, w, static_cast<float>(eps), y.data(), rstd.data());
}

// dx [rows, H] = RMSNormBwd(dy) with dw accumulated.
void norm_rows_bwd(const DeviceVector<float>& dy, const DeviceVector<float>& x, const DeviceVector<float>& rstd,
                   std::int64_t rows, std::int64_t H, const float* w, float* dw, DeviceVector<float>& dx) {
  dx.resize(rows * H);
  rmsnorm_backward(dy.data(), x.data(), rstd.data(), rows, 1, H, w, dx.data(), dw);
}

}  // namespace

Drafter::Drafter(Communicator& cp, const DrafterConfig& cfg, SplitKVOptions attn)
    : comm_(cp), cfg_(cfg), attn_opt_(attn), layout_(cfg) {
  layers_.resize(static_cast<std::size_t>(cfg_.layers));
}

void Drafter::use_state(ShardedState& state) {
  DIFFCP_CHECK(state.layout().total == layout_.total && state.units() == static_cast<int>(layout_.units.size()),
               "drafter: a state of ", state.layout().total, " parameters for a model of ", layout_.total);
  DIFFCP_CHECK(own_state_ == nullptr, "drafter: use_state() after the resident state was used");
  state_ = &state;
}

ShardedState& Drafter::state() {
  if (state_ == nullptr) {  // made on first use: a sharded run never allocates the resident one
    own_state_ = std::make_unique<ShardedState>(comm_, layout_, ShardMode::none);
    state_ = own_state_.get();
  }
  return *state_;
}

void Drafter::set_embedding(std::vector<float> table) {
  const std::int64_t V = cfg_.vocab, H = cfg_.hidden;
  DIFFCP_CHECK(static_cast<std::int64_t>(table.size()) == V * H, "drafter: the embedding has ", table.size(),
               " values, expected V * H = ", V, " * ", H);
  embedding_ = [t = std::move(table), H](std::span<const std::int32_t> tokens, float* out) {
    for (std::size_t i = 0; i < tokens.size(); ++i) std::copy_n(t.begin() + tokens[i] * H, H, out + static_cast<std::int64_t>(i) * H);
  };
}

void Drafter::init_params(std::uint64_t seed) {
  std::mt19937_64 rng(seed);  // one stream through the units in order
  const std::int64_t H = cfg_.hidden, F = cfg_.ffn, L = cfg_.layers;
  state().init([&](int u, float* out) {
    auto fill = [&](std::int64_t off, std::int64_t n, double std) {
      std::normal_distribution<double> d(0.0, std);
      for (std::int64_t j = 0; j < n; ++j) out[rel(u, off) + j] = static_cast<float>(d(rng));
    };
    auto ones = [&](std::int64_t off) { std::fill_n(out + rel(u, off), H, 1.f); };
    if (u == 0) {
      fill(layout_.fc, cfg_.target_layers * H * H, 1 / std::sqrt(static_cast<double>(cfg_.target_layers * H)));
      ones(layout_.fc_norm);
    } else if (u <= L) {
      const auto& Ly = layout_.layer[static_cast<std::size_t>(u - 1)];
      AttnLayerParams a(cfg_.attn());
      a.init_random(seed + 1000 + static_cast<std::uint64_t>(u - 1));
      std::fill_n(a[AttnLayerParams::bo], a.size(AttnLayerParams::bo), 0.f);  // fixed at zero (no bias in the format)
      std::copy(a.all().begin(), a.all().end(), out + rel(u, Ly.attn));
      fill(Ly.w_gate, H * F, 1 / std::sqrt(static_cast<double>(H)));
      fill(Ly.w_up, H * F, 1 / std::sqrt(static_cast<double>(H)));
      fill(Ly.w_down, F * H, 1 / std::sqrt(static_cast<double>(F)) / std::sqrt(2.0 * static_cast<double>(L)));
      ones(Ly.attn_norm);  // attention's own q/k norms come from init_random above
      ones(Ly.mlp_norm);
      if (cfg_.has_conv()) {  // the identity (no random draw: the other tensors are DFlash's): tap 0 of both bases 1
        const std::int64_t K = cfg_.conv_taps, W = H * 2 * K * cfg_.conv_groups();
        for (const std::int64_t base : {Ly.attn_conv_base, Ly.mlp_conv_base}) {
          std::fill_n(out + rel(u, base), 2 * K * H, 0.f);
          std::fill_n(out + rel(u, base), H, 1.f);
          std::fill_n(out + rel(u, base) + K * H, H, 1.f);
        }
        for (const std::int64_t proj : {Ly.attn_conv_proj, Ly.mlp_conv_proj}) std::fill_n(out + rel(u, proj), W, 0.f);
      }
    } else {
      ones(layout_.final_norm);
      if (cfg_.has_selector()) {  // NeMo's identity init: successor codebook 0 (scores = the top-K logits)
        const std::int64_t r = cfg_.selector_rank;
        fill(layout_.sel_pred, cfg_.vocab * r, 0.02);
        std::fill_n(out + rel(u, layout_.sel_succ), cfg_.vocab * r, 0.f);
        fill(layout_.sel_proj, H * r, 1 / std::sqrt(static_cast<double>(H)));
      }
    }
  });
}

DynamicConvShape Drafter::conv_shape(std::int64_t rows) const {
  return {rows, cfg_.hidden, cfg_.conv_taps, cfg_.conv_groups(), cfg_.block};
}

const float* Drafter::acquire(int u, bool backward) {
  const auto t0 = std::chrono::steady_clock::now();
  const float* p = state().acquire(u, backward);
  phases_.gather_wait += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return p;
}

void Drafter::embed(const DrafterBatch& mb) {
  const std::int64_t H = cfg_.hidden, B = cfg_.block, Qp = mb.shard.own_query_rows();
  if (!mb.block_input.empty() || Qp == 0) {
    DIFFCP_CHECK(static_cast<std::int64_t>(mb.block_input.size()) == Qp * H, "drafter: block_input has ",
                 mb.block_input.size(), " values, expected Q_p * H = ", Qp, " * ", H);
    h_.assign(mb.block_input.data(), Qp * H);
    return;
  }
  DIFFCP_CHECK(static_cast<bool>(embedding_), "drafter: no embedding set (set_embedding) and no block_input");
  const auto refs = mb.shard.batch.blocks();
  std::vector<std::int32_t> tokens;
  for (std::int64_t i = mb.shard.blocks.begin; i < mb.shard.blocks.end; ++i)
    for (std::int64_t k = 0; k < B; ++k)
      tokens.push_back(k == 0 ? mb.tokens[static_cast<std::size_t>(refs[static_cast<std::size_t>(i)].anchor)] : cfg_.mask_token);
  if (computes_on_host()) {
    h_.resize(Qp * H);
    embedding_(tokens, h_.data());
    return;
  }
  std::vector<float> rows(static_cast<std::size_t>(Qp * H));  // host: the source's rows, then uploaded
  embedding_(tokens, rows.data());
  h_.assign(rows.data(), Qp * H);
}

void Drafter::layer_forward(std::int64_t l, LayerState& L, const float* params, const CpShard& s) {
  const std::int64_t H = cfg_.hidden, F = cfg_.ffn, Qp = s.own_query_rows();
  const int u = static_cast<int>(l) + 1;
  const auto& off = layout_.layer[static_cast<std::size_t>(l)];
  auto t0 = Clock::now();
  CpShard layer_shard = s;  // the layer's own key window (a sliding-window layer's)
  layer_shard.window = cfg_.layer_window(l);
  if (!L.attn)
    L.attn = std::make_unique<SplitKVLayer>(comm_, cfg_.attn(), std::move(layer_shard), attn_opt_);
  else
    L.attn->reshard(std::move(layer_shard));
  L.h_in.assign(h_.data(), Qp * H, active_device());
  norm_rows(h_, Qp, H, params + rel(u, off.attn_norm), cfg_.rms_eps, L.a, L.a_rstd);
  const std::int64_t Cp = s.context_rows();
  const bool conv = cfg_.has_conv();
  const DynamicConvShape cs = conv_shape(Qp);
  if (conv) {
    L.a_dyn.resize(Qp * 2 * cs.taps * cs.groups);
    L.a_conv.resize(Qp * H);
    dynamic_conv_prepare(L.a.data(), params + rel(u, off.attn_conv_proj), params + rel(u, off.attn_conv_base), cs,
                         L.a_dyn.data(), L.a_conv.data());
  }
  if (L.attn_saved) L.attn->discard(std::move(L.attn_saved));  // its backward never ran (evaluation, recompute)
  DeviceVector<float>& y = L.h_mid;  // attention's output (after its second convolution), then h + it
  y.resize(Qp * H);
  DeviceVector<float>& attn_out = conv ? L.o : y;
  attn_out.resize(Qp * H);
  L.attn_saved = L.attn->forward(AttnLayerParams::view(cfg_.attn(), params + rel(u, off.attn)),
                                 dview((conv ? L.a_conv : L.a).data(), Qp, H), dview(c_.data(), Cp, H),
                                 dview(attn_out.data(), Qp, H));
  L.attn_fwd_comm = L.attn->timings().exposed_comm_ms();
  phases_.attention_comm += L.attn_fwd_comm;
  if (conv) dynamic_conv_finish(L.o.data(), L.a_dyn.data(), params + rel(u, off.attn_conv_base), cs, y.data());
  add_into(h_, y);
  phases_.attention += ms_since(t0);
  t0 = Clock::now();
  L.h_mid.assign(h_.data(), Qp * H, active_device());
  norm_rows(h_, Qp, H, params + rel(u, off.mlp_norm), cfg_.rms_eps, L.m, L.m_rstd);
  if (conv) {
    L.m_dyn.resize(Qp * 2 * cs.taps * cs.groups);
    L.m_conv.resize(Qp * H);
    dynamic_conv_prepare(L.m.data(), params + rel(u, off.mlp_conv_proj), params + rel(u, off.mlp_conv_base), cs,
                         L.m_dyn.data(), L.m_conv.data());
  }
  const float* mlp_in = (conv ? L.m_conv : L.m).data();
  L.gate.resize(Qp * F);
  L.up.resize(Qp * F);
  L.act.resize(Qp * F);
  linear_forward(mlp_in, Qp, H, params + rel(u, off.w_gate), F, L.gate.data());
  linear_forward(mlp_in, Qp, H, params + rel(u, off.w_up), F, L.up.data());
  swiglu_forward(L.gate.data(), L.up.data(), L.act.data(), static_cast<std::int64_t>(L.act.size()));
  if (!conv) {
    linear_forward(L.act.data(), Qp, F, params + rel(u, off.w_down), H, h_.data(), 1.f);  // h += act W_down
  } else {  // h += conv_1(act W_down)
    L.z.resize(Qp * H);
    conv_out_.resize(Qp * H);
    linear_forward(L.act.data(), Qp, F, params + rel(u, off.w_down), H, L.z.data());
    dynamic_conv_finish(L.z.data(), L.m_dyn.data(), params + rel(u, off.mlp_conv_base), cs, conv_out_.data());
    add_into(h_, conv_out_);
  }
  phases_.mlp += ms_since(t0);
}

void Drafter::forward(const DrafterBatch& mb) {
  const std::int64_t H = cfg_.hidden, B = cfg_.block, T = cfg_.target_layers * H;
  const int Lu = static_cast<int>(cfg_.layers) + 1;  // the final norm's unit
  const CpShard& s = mb.shard;
  const std::int64_t S = s.batch.context_rows(), Qp = s.own_query_rows(), Cp = s.context_rows();
  DIFFCP_CHECK(s.batch.block == B, "drafter: batch block ", s.batch.block, " != config block ", B);
  DIFFCP_CHECK(static_cast<std::int64_t>(mb.tokens.size()) == S && static_cast<std::int64_t>(mb.loss_mask.size()) == S,
               "drafter: ", mb.tokens.size(), " tokens and ", mb.loss_mask.size(), " mask entries for S = ", S);
  DIFFCP_CHECK(static_cast<std::int64_t>(mb.hidden_p.size()) == Cp * T, "drafter: hidden_p has ", mb.hidden_p.size(),
               " values, expected C_p * n_t * H = ", Cp, " * ", T);

  // Context fusion: c = RMSNorm(hidden_p fc).
  const float* params = acquire(0, false);
  auto t0 = Clock::now();
  if (computes_on_host()) {
    hidden_in_ = mb.hidden_p.data();
  } else {
    hidden_.assign(mb.hidden_p.data(), Cp * T);
    hidden_in_ = hidden_.data();
  }
  c_lin_.resize(Cp * H);
  linear_forward(hidden_in_, Cp, T, params + rel(0, layout_.fc), H, c_lin_.data());
  norm_rows(c_lin_, Cp, H, params + rel(0, layout_.fc_norm), cfg_.rms_eps, c_, c_rstd_);
  state().release(0, false);
  phases_.fusion += ms_since(t0);

  embed(mb);
  for (std::int64_t l = 0; l < cfg_.layers; ++l) {
    const int u = static_cast<int>(l) + 1;
    LayerState& L = recompute_ ? scratch_ : layers_[static_cast<std::size_t>(l)];
    params = acquire(u, false);
    layer_forward(l, L, params, s);
    if (recompute_) layers_[static_cast<std::size_t>(l)].h_in = std::move(scratch_.h_in);  // all the layer keeps
    state().release(u, false);
  }
  params = acquire(Lu, false);
  norm_rows(h_, Qp, H, params + rel(Lu, layout_.final_norm), cfg_.rms_eps, hf_, hf_rstd_);
  state().release(Lu, false);
}

const DeviceVector<float>& Drafter::forward_hidden(const DrafterBatch& mb) {
  forward(mb);
  return hf_;
}

DrafterStats Drafter::step(const DrafterBatch& mb, bool backward) {
  DIFFCP_CHECK(lm_head_ != nullptr, "drafter: no LM head set (set_lm_head)");
  forward(mb);
  DeviceVector<float> dhf;  // [Q_p, H] (this step only: the memory is the next forward's)
  const DrafterStats st = loss(mb, backward, dhf);
  if (backward) this->backward(mb, dhf);
  return st;
}

void Drafter::idle_step() {
  state().gather_rounds_only();
  if (cfg_.has_selector()) {  // loss()'s selector reads the last unit again
    const int Lu = static_cast<int>(cfg_.layers) + 1;
    acquire(Lu, false);
    state().release(Lu, false);
  }
}

void Drafter::set_lm_head(LmHead head) {
  head.set_logit_map({static_cast<float>(cfg_.output_multiplier), static_cast<float>(cfg_.logit_softcap)});
  lm_head_ = std::make_unique<LmHead>(std::move(head));
}

void Drafter::set_selector_loss_weight(double lambda) {
  DIFFCP_CHECK(std::isfinite(lambda) && lambda >= 0, "drafter: selector loss weight ", lambda, ", expected finite and >= 0");
  selector_lambda_ = lambda;
}

DrafterStats Drafter::loss(const DrafterBatch& mb, bool backward, DeviceVector<float>& dhf) {
  // Decay-weighted cross-entropy (lm_head.hpp: vocabulary-parallel when the head is split).
  const auto t0 = Clock::now();
  const std::int64_t H = cfg_.hidden, B = cfg_.block;
  const CpShard& s = mb.shard;
  const std::int64_t Qp = s.own_query_rows();
  DrafterStats st;
  st.correct.assign(static_cast<std::size_t>(B), 0);
  st.counted.assign(static_cast<std::size_t>(B), 0);
  argmax_.assign(static_cast<std::size_t>(Qp), 0);
  const auto refs = s.batch.blocks();
  std::vector<std::int32_t> target(static_cast<std::size_t>(Qp)), prev(target.size());
  std::vector<double> weight(target.size()), ce(target.size());
  DIFFCP_CHECK(mb.prev_tokens.empty() || mb.prev_tokens.size() == mb.tokens.size(), "drafter: ", mb.prev_tokens.size(),
               " predecessor tokens for ", mb.tokens.size(), " tokens");
  const std::vector<std::int32_t>& before = mb.prev_tokens.empty() ? mb.tokens : mb.prev_tokens;
  for (std::int64_t r = 0; r < Qp; ++r) {
    const std::int64_t k = r % B, anchor = refs[static_cast<std::size_t>(s.blocks.begin + r / B)].anchor;
    target[static_cast<std::size_t>(r)] = mb.tokens[static_cast<std::size_t>(anchor + k)];
    prev[static_cast<std::size_t>(r)] = (k <= 1 ? mb.tokens : before)[static_cast<std::size_t>(anchor + std::max<std::int64_t>(k - 1, 0))];
    weight[static_cast<std::size_t>(r)] =
        k == 0 ? 0.0 : std::exp(-static_cast<double>(k - 1) / cfg_.gamma) * mb.loss_mask[static_cast<std::size_t>(anchor + k)];
  }
  dhf.resize(backward ? Qp * H : 0);
  if (!cfg_.has_selector()) {
    lm_head_->run(hf_.data(), Qp, target.data(), weight.data(), ce.data(), argmax_.data(), backward, dhf.data());
  } else {  // DFlash2: the candidates, the selector's loss on them, its gradient into the logits'
    const std::int64_t K = cfg_.selector_top_k;
    std::vector<float> top_v(static_cast<std::size_t>(Qp * K));
    std::vector<std::int32_t> top_i(top_v.size());
    lm_head_->forward(hf_.data(), Qp, target.data(), weight.data(), ce.data(), argmax_.data(), K, top_v, top_i);
    SelectorLoss sl = selector_step(prev, target, weight, top_v, top_i, backward);
    if (backward)
      lm_head_->backward(dhf.data(), {top_i, sl.dvalues});
    else
      lm_head_->release();
    argmax_ = std::move(sl.choice);  // what the drafter drafts: the selector's choice
    st.selector_loss_sum = sl.loss_sum;
    st.selector_rows = sl.rows;
    st.selector_covered = sl.covered;
    st.selector_correct = sl.correct;
    st.loss_sum += sl.loss_sum;
  }
  for (std::int64_t r = 0; r < Qp; ++r) {
    const auto i = static_cast<std::size_t>(r), k = static_cast<std::size_t>(r % B);
    if (weight[i] > 0) {
      st.loss_sum += weight[i] * ce[i];
      st.weight_sum += weight[i];
      st.correct[k] += argmax_[i] == target[i];
      st.counted[k] += 1;
    }
  }
  phases_.lm_head += ms_since(t0);
  return st;
}

SelectorLoss Drafter::selector_step(std::span<const std::int32_t> prev, std::span<const std::int32_t> target,
                                    std::span<const double> weight, std::span<const float> top_v,
                                    std::span<const std::int32_t> top_i, bool backward) {
  const std::int64_t H = cfg_.hidden, V = cfg_.vocab, r = cfg_.selector_rank;
  const std::int64_t Qp = static_cast<std::int64_t>(prev.size());
  const int Lu = static_cast<int>(cfg_.layers) + 1;
  const auto unique = [](std::span<const std::int32_t> t) {
    std::vector<std::int32_t> u(t.begin(), t.end());
    std::sort(u.begin(), u.end());
    u.erase(std::unique(u.begin(), u.end()), u.end());
    return u;
  };
  SelectorGrads g;
  g.pred_tokens = unique(prev);
  g.succ_tokens = unique(top_i);
  // h P [Q_p, r] and the codebook rows used, from the last unit's parameters (host copies: O(Q_p r))
  const float* params = acquire(Lu, false);
  DeviceVector<float> hp, rows;
  hp.resize(Qp * r);
  linear_forward(hf_.data(), Qp, H, params + rel(Lu, layout_.sel_proj), r, hp.data());
  const auto codebook_rows = [&](std::int64_t off, const std::vector<std::int32_t>& tokens) {
    const std::vector<std::int64_t> at(tokens.begin(), tokens.end());
    rows.resize(static_cast<std::int64_t>(at.size()) * r);
    if (!at.empty()) gather_rows(params + rel(Lu, off), DType::f32, V, r, at, r, rows.data(), DType::f32, r);
    return to_host<float>(rows.view());
  };
  const std::vector<float> pred = codebook_rows(layout_.sel_pred, g.pred_tokens);
  const std::vector<float> succ = codebook_rows(layout_.sel_succ, g.succ_tokens);
  const std::vector<float> hp_host = to_host<float>(hp.view());
  state().release(Lu, false);
  SelectorLoss sl = selector_loss(cfg_, selector_lambda_, hp_host, top_v, top_i, prev, target, weight,
                                  {g.pred_tokens, pred}, {g.succ_tokens, succ});
  if (backward) {
    g.dhp.assign(sl.dhp);
    g.dpred = std::move(sl.dpred);
    g.dsucc = std::move(sl.dsucc);
    selector_grads_ = std::move(g);
  }
  return sl;
}

void Drafter::backward(const DrafterBatch& mb, DeviceVector<float>& dhf) {
  const std::int64_t H = cfg_.hidden, F = cfg_.ffn, T = cfg_.target_layers * H;
  const int Lu = static_cast<int>(cfg_.layers) + 1;
  const CpShard& s = mb.shard;
  const std::int64_t Qp = s.own_query_rows(), Cp = s.context_rows();
  BackwardScratch bs;  // this backward's only (its memory is the next forward's)
  const float* params = acquire(Lu, true);
  if (selector_grads_) {  // DFlash2: the selector's part of dhf and of its parameters' gradients
    apply_selector_grads(params, state().unit_grads(Lu), dhf);
    selector_grads_.reset();
  }
  norm_rows_bwd(dhf, h_, hf_rstd_, Qp, H, params + rel(Lu, layout_.final_norm),
                state().unit_grads(Lu) + rel(Lu, layout_.final_norm), bs.dh);
  state().release(Lu, true);
  bs.dc.resize(Cp * H);
  fill(bs.dc.data(), Cp * H, 0.f);
  bs.dc_l.resize(Cp * H);
  bs.da.resize(Qp * H);
  bs.dm.resize(Qp * H);
  bs.dact.resize(Qp * F);
  bs.dgate.resize(Qp * F);
  bs.dup.resize(Qp * F);
  for (std::int64_t l = cfg_.layers - 1; l >= 0; --l) layer_backward(l, s, bs);
  // The embedding is frozen: dh stops here. Context fusion backward.
  params = acquire(0, true);
  float* G = state().unit_grads(0);
  const auto t0 = Clock::now();
  norm_rows_bwd(bs.dc, c_lin_, c_rstd_, Cp, H, params + rel(0, layout_.fc_norm), G + rel(0, layout_.fc_norm), bs.dc_lin);
  linear_backward_weight(hidden_in_, Cp, T, bs.dc_lin.data(), H, G + rel(0, layout_.fc));
  phases_.fusion += ms_since(t0);
  state().release(0, true);
}

void Drafter::apply_selector_grads(const float* params, float* grads, DeviceVector<float>& dhf) {
  const SelectorGrads& g = *selector_grads_;
  const int Lu = static_cast<int>(cfg_.layers) + 1;
  const std::int64_t H = cfg_.hidden, V = cfg_.vocab, r = cfg_.selector_rank;
  const std::int64_t Qp = static_cast<std::int64_t>(g.dhp.size()) / r;
  // h P: dhf += d(hP) P^T, dP += h^T d(hP)
  linear_backward_input(g.dhp.data(), Qp, r, params + rel(Lu, layout_.sel_proj), H, dhf.data(), 1.f);
  linear_backward_weight(hf_.data(), Qp, H, g.dhp.data(), r, grads + rel(Lu, layout_.sel_proj));
  // The codebook rows used: read, add, write back (each token once: the lists are unique)
  const auto add_rows = [&](std::int64_t off, const std::vector<std::int32_t>& tokens, const std::vector<float>& d) {
    if (tokens.empty()) return;
    const std::vector<std::int64_t> at(tokens.begin(), tokens.end());
    const std::int64_t m = static_cast<std::int64_t>(at.size());
    DeviceVector<float> rows, drows;
    rows.resize(m * r);
    gather_rows(grads + rel(Lu, off), DType::f32, V, r, at, r, rows.data(), DType::f32, r);
    drows.assign(d);
    add_into(rows.data(), drows.data(), m * r);
    scatter_rows(rows.data(), DType::f32, r, at, r, grads + rel(Lu, off), DType::f32, V, r);
  };
  add_rows(layout_.sel_pred, g.pred_tokens, g.dpred);
  add_rows(layout_.sel_succ, g.succ_tokens, g.dsucc);
}

void Drafter::layer_backward(std::int64_t l, const CpShard& s, BackwardScratch& bs) {
  const std::int64_t H = cfg_.hidden, F = cfg_.ffn;
  const std::int64_t Qp = s.own_query_rows(), Cp = s.context_rows();
  const int u = static_cast<int>(l) + 1;
  const auto& off = layout_.layer[static_cast<std::size_t>(l)];
  const float* params = acquire(u, true);
  float* G = state().unit_grads(u);
  if (recompute_) {  // the layer's forward again, from its input
    const DeviceVector<float>& in = layers_[static_cast<std::size_t>(l)].h_in;
    h_.assign(in.data(), static_cast<std::int64_t>(in.size()), active_device());
    layer_forward(l, scratch_, params, s);
  }
  LayerState& L = recompute_ ? scratch_ : layers_[static_cast<std::size_t>(l)];
  DeviceVector<float>& dh = bs.dh;
  const bool conv = cfg_.has_conv();
  const DynamicConvShape cs = conv_shape(Qp);
  if (conv) {
    bs.dconv.resize(Qp * H);
    bs.ddyn.resize(Qp * 2 * cs.taps * cs.groups);
  }
  auto t0 = Clock::now();
  // MLP: h_out = h_mid + z (DFlash2: + conv_1(z)), z = act W_down, act = silu(gate) * up.
  if (conv)  // dz into dconv; the second taps' gradients into ddyn's second half
    dynamic_conv_finish_backward(dh.data(), L.z.data(), L.m_dyn.data(), params + rel(u, off.mlp_conv_base), cs,
                                 bs.dconv.data(), bs.ddyn.data(), G + rel(u, off.mlp_conv_base));
  const float* dz = (conv ? bs.dconv : dh).data();
  const float* mlp_in = (conv ? L.m_conv : L.m).data();
  linear_backward_weight(L.act.data(), Qp, F, dz, H, G + rel(u, off.w_down));
  linear_backward_input(dz, Qp, H, params + rel(u, off.w_down), F, bs.dact.data());
  swiglu_backward(bs.dact.data(), L.gate.data(), L.up.data(), bs.dgate.data(), bs.dup.data(), Qp * F);
  linear_backward_weight(mlp_in, Qp, H, bs.dgate.data(), F, G + rel(u, off.w_gate));
  linear_backward_weight(mlp_in, Qp, H, bs.dup.data(), F, G + rel(u, off.w_up));
  linear_backward_input(bs.dgate.data(), Qp, F, params + rel(u, off.w_gate), H, bs.dm.data());
  linear_backward_input(bs.dup.data(), Qp, F, params + rel(u, off.w_up), H, bs.dm.data(), 1.f);
  if (conv)  // bs.dm is d(m_conv): m's gradient into dconv
    dynamic_conv_prepare_backward(bs.dm.data(), L.m.data(), L.m_dyn.data(), params + rel(u, off.mlp_conv_proj),
                                  params + rel(u, off.mlp_conv_base), cs, bs.dconv.data(), bs.ddyn.data(),
                                  G + rel(u, off.mlp_conv_proj), G + rel(u, off.mlp_conv_base));
  // The norms' input gradients go into the buffer that is free at that point (da here, dm below):
  // no extra [Q_p, H] lives through the attention's backward, the step's peak.
  norm_rows_bwd(conv ? bs.dconv : bs.dm, L.h_mid, L.m_rstd, Qp, H, params + rel(u, off.mlp_norm),
                G + rel(u, off.mlp_norm), bs.da);
  add_into(dh, bs.da);
  phases_.mlp += ms_since(t0);
  t0 = Clock::now();
  // Attention: h_mid = h_in + SplitKV(a, c).
  AttnLayerParams gview(cfg_.attn(), G + rel(u, off.attn));
  if (conv)  // DFlash2: h_mid = h_in + conv_1(o), o = SplitKV(conv_0(a), c): do into dconv
    dynamic_conv_finish_backward(dh.data(), L.o.data(), L.a_dyn.data(), params + rel(u, off.attn_conv_base), cs,
                                 bs.dconv.data(), bs.ddyn.data(), G + rel(u, off.attn_conv_base));
  L.attn->backward(std::move(L.attn_saved), AttnLayerParams::view(cfg_.attn(), params + rel(u, off.attn)),
                   dview((conv ? bs.dconv : dh).data(), Qp, H), dview(bs.da.data(), Qp, H), dview(bs.dc_l.data(), Cp, H),
                   gview);
  fill(gview[AttnLayerParams::bo], gview.size(AttnLayerParams::bo), 0.f);  // b_o stays zero
  phases_.attention_comm += L.attn->timings().exposed_comm_ms() - L.attn_fwd_comm;  // timings(): forward + backward
  if (conv)  // bs.da is d(a_conv): a's gradient into dconv
    dynamic_conv_prepare_backward(bs.da.data(), L.a.data(), L.a_dyn.data(), params + rel(u, off.attn_conv_proj),
                                  params + rel(u, off.attn_conv_base), cs, bs.dconv.data(), bs.ddyn.data(),
                                  G + rel(u, off.attn_conv_proj), G + rel(u, off.attn_conv_base));
  norm_rows_bwd(conv ? bs.dconv : bs.da, L.h_in, L.a_rstd, Qp, H, params + rel(u, off.attn_norm),
                G + rel(u, off.attn_norm), bs.dm);
  add_into(dh, bs.dm);
  add_into(bs.dc, bs.dc_l);
  phases_.attention += ms_since(t0);
  state().release(u, true);
}

}  // namespace diffcp
