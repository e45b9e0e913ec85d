#include "diffcp/drafter/draft_cache.hpp"

#include <algorithm>

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/merge.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/cp/attention_layer.hpp"
#include "diffcp/cp/cp_common.hpp"
#include "diffcp/ops/conv.hpp"
#include "diffcp/ops/elementwise.hpp"
#include "diffcp/ops/linear.hpp"
#include "diffcp/ops/rmsnorm.hpp"

namespace diffcp {

namespace {
const DrafterConfig& validated(const DrafterConfig& c) {
  c.validate();  // before the layout and the RoPE table are made from it
  return c;
}
}  // namespace

DraftCache::DraftCache(Communicator& cp, const DrafterConfig& cfg, std::span<const float> params)
    : cp_(cp), cfg_(validated(cfg)), layout_(cfg_), rope_(cfg_.d_h, cfg_.rope_theta, kChunk) {
  DIFFCP_CHECK(static_cast<std::int64_t>(params.size()) == layout_.total, "draft cache: ", params.size(),
               " parameters, the model has ", layout_.total);
  params_.assign(params);
  layers_.resize(static_cast<std::size_t>(cfg_.layers));
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    layers_[l].window = cfg_.layer_window(static_cast<std::int64_t>(l));
    reserve_rows(layers_[l], kChunk);
  }
}

std::int64_t DraftCache::own_positions() const { return static_cast<std::int64_t>(own_.size()); }

std::int64_t DraftCache::cached_keys(std::int64_t layer) const {
  DIFFCP_CHECK(layer >= 0 && layer < cfg_.layers, "draft cache: layer ", layer, " of ", cfg_.layers);
  return layers_[static_cast<std::size_t>(layer)].rows;
}

std::int64_t DraftCache::bytes() const {
  std::int64_t n = 0;
  for (const Layer& L : layers_) n += static_cast<std::int64_t>(L.k.size() + L.v.size()) * 4;
  return n;
}

// Grows L's K/V to hold `rows` rows, keeping the cached ones (capacity doubles).
void DraftCache::reserve_rows(Layer& L, std::int64_t rows) {
  const std::int64_t kvw = cfg_.attn().kv_width(), cap = static_cast<std::int64_t>(L.k.size()) / kvw;
  if (cap >= rows) return;
  const std::int64_t grown_rows = std::max(rows, 2 * cap);
  for (DeviceVector<float>* kv : {&L.k, &L.v}) {
    DeviceVector<float> grown;
    grown.resize(grown_rows * kvw);
    if (L.rows > 0) device_copy(grown.data(), kv->data(), L.rows * kvw);
    *kv = std::move(grown);
  }
}

// A sliding layer drops the keys no later block sees (positions < length() - W + 1: the block's
// first query sits at length()), once they are at least as many as the live ones (the copy of the
// live rows then never overlaps them, and its cost is amortised over the appends).
void DraftCache::evict(Layer& L) {
  if (L.window.window == 0 || L.rows == 0) return;
  const std::int64_t keep_from = length_ - L.window.window + 1;
  const auto begin = own_.begin() + L.first;
  const std::int64_t dead = std::lower_bound(begin, begin + L.rows, keep_from) - begin;
  if (dead == 0 || dead < L.rows - dead) return;
  const std::int64_t kvw = cfg_.attn().kv_width(), live = L.rows - dead;
  if (live > 0) {
    device_copy(L.k.data(), L.k.data() + dead * kvw, live * kvw);
    device_copy(L.v.data(), L.v.data() + dead * kvw, live * kvw);
  }
  L.rows = live;
  L.first += dead;
}

void DraftCache::ensure_rope(std::int64_t max_pos) {
  if (rope_.max_pos() >= max_pos) return;
  rope_ = RopeTable(cfg_.d_h, cfg_.rope_theta, std::max(max_pos, 2 * rope_.max_pos()));
}

void DraftCache::append(std::span<const float> target_hidden) {
  const std::int64_t H = cfg_.hidden, T = cfg_.target_layers * H, kvw = cfg_.attn().kv_width();
  const std::int64_t n = static_cast<std::int64_t>(target_hidden.size()) / std::max<std::int64_t>(T, 1);
  DIFFCP_CHECK(n >= 1 && n * T == static_cast<std::int64_t>(target_hidden.size()), "draft cache: target hidden states hold ",
               target_hidden.size(), " values, expected [n >= 1, n_t*H = ", T, "]");
  // This rank's new positions, and their rows gathered (host).
  std::vector<std::int64_t> pos;
  std::vector<float> rows;
  const std::int64_t P = cp_.size(), p = cp_.rank();
  for (std::int64_t x = length_; x < length_ + n; ++x)
    if ((x / kChunk) % P == p) {
      pos.push_back(x);
      const auto src = target_hidden.begin() + (x - length_) * T;
      rows.insert(rows.end(), src, src + T);
    }
  const std::int64_t m = static_cast<std::int64_t>(pos.size());
  length_ += n;
  if (m > 0) {
    // Context fusion c = RMSNorm(hidden fc), then each layer's k = RoPE(k_norm(c W_k)), v = c W_v.
    hidden_.assign(rows.data(), m * T);
    c_lin_.resize(m * H);
    c_.resize(m * H);
    rstd_.resize(m * std::max(cfg_.n_kv, std::int64_t{1}));
    linear_forward(hidden_.data(), m, T, param(layout_.fc), H, c_lin_.data());
    rmsnorm_forward(c_lin_.data(), m, 1, H, param(layout_.fc_norm), static_cast<float>(cfg_.rms_eps), c_.data(), rstd_.data());
    ensure_rope(length_);
    k_lin_.resize(m * kvw);
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      Layer& L = layers_[l];
      const AttnLayerParams w = AttnLayerParams::view(cfg_.attn(), param(layout_.layer[l].attn));
      reserve_rows(L, L.rows + m + cfg_.block);  // and room for a block's own rows
      float* k = L.k.data() + L.rows * kvw;
      linear_forward(c_.data(), m, H, w[AttnLayerParams::wk], kvw, k_lin_.data());
      rmsnorm_forward(k_lin_.data(), m, cfg_.n_kv, cfg_.d_h, w[AttnLayerParams::k_norm], static_cast<float>(cfg_.rms_eps), k,
                      rstd_.data());
      rope_apply(k, m, cfg_.n_kv, pos, rope_, false);
      linear_forward(c_.data(), m, H, w[AttnLayerParams::wv], kvw, L.v.data() + L.rows * kvw);
      L.rows += m;
    }
    own_.insert(own_.end(), pos.begin(), pos.end());
  }
  for (Layer& L : layers_) evict(L);
}

// The mask of one layer's call: its cached rows (runs of consecutive positions) and, when this
// rank holds them, the block's own b rows after them; one block anchored at length().
BlockMask DraftCache::layer_mask(const Layer& L, std::int64_t b, bool holds_block) const {
  std::vector<ContextSegment> segments;
  for (std::int64_t r = 0; r < L.rows;) {
    const std::int64_t first = own_[static_cast<std::size_t>(L.first + r)];
    // Positions come in whole chunks (the first one possibly cut by eviction): the run ends at
    // the chunk's end, or earlier if the cache does.
    const std::int64_t len = std::min(L.rows - r, (first / kChunk + 1) * kChunk - first);
    if (!segments.empty() && segments.back().pos + segments.back().len == first)
      segments.back().len += len;
    else
      segments.push_back({r, first, len});
    r += len;
  }
  return BlockMask(b, L.rows + (holds_block ? b : 0), std::move(segments), {{0, length_, holds_block ? L.rows : -1}},
                   L.window);
}

std::vector<float> DraftCache::draft(std::span<const float> noise) {
  const std::int64_t H = cfg_.hidden, F = cfg_.ffn, qw = cfg_.attn().q_width(), kvw = cfg_.attn().kv_width();
  const std::int64_t b = static_cast<std::int64_t>(noise.size()) / H;
  DIFFCP_CHECK(b >= 1 && b <= cfg_.block && b * H == static_cast<std::int64_t>(noise.size()), "draft cache: the noise embedding holds ",
               noise.size(), " values, expected [b, H = ", H, "] with 1 <= b <= B = ", cfg_.block);
  DIFFCP_CHECK(length_ >= 1, "draft cache: no context yet (append the prompt's target hidden states first)");
  const float eps = static_cast<float>(cfg_.rms_eps);
  const std::int64_t P = cp_.size();
  const bool holds_block = cp_.rank() == 0;
  std::vector<std::int64_t> qpos(static_cast<std::size_t>(b));
  for (std::int64_t r = 0; r < b; ++r) qpos[static_cast<std::size_t>(r)] = length_ + r;
  ensure_rope(length_ + b);
  h_.assign(noise.data(), b * H);
  a_.resize(b * H);
  q_.resize(b * qw);
  o_.resize(b * qw);
  lse_.resize(b * cfg_.n_q);
  y_.resize(b * H);
  gate_.resize(b * F);
  up_.resize(b * F);
  act_.resize(b * F);
  rstd_.resize(b * std::max(cfg_.n_q, std::int64_t{1}));
  k_lin_.resize(b * kvw);
  // DFlash2: the block is one sequence of b rows for the convolutions; the taps of a sublayer's two
  // convolutions predicted from its normed input (dyn_ [b, 2 K G]); conv_ [b, H] a convolved row set
  const bool conv = cfg_.has_conv();
  const DynamicConvShape cs{b, H, cfg_.conv_taps, cfg_.conv_groups(), b};
  if (conv) {
    dyn_.resize(b * 2 * cs.taps * cs.groups);
    conv_.resize(b * H);
  }
  // a sublayer's input after its first convolution (a_ itself without convolutions)
  const auto prepare = [&](std::int64_t proj, std::int64_t base) {
    if (!conv) return a_.data();
    dynamic_conv_prepare(a_.data(), param(proj), param(base), cs, dyn_.data(), conv_.data());
    return conv_.data();
  };
  const std::int64_t part = b * qw + b * cfg_.n_q;  // one rank's partial: o [b, n_q, d_h], then lse [b, n_q]
  if (P > 1) {
    send_.resize(part);
    parts_.resize(P * part);
  }
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    Layer& L = layers_[l];
    const auto& off = layout_.layer[l];
    const AttnLayerParams w = AttnLayerParams::view(cfg_.attn(), param(off.attn));
    // Attention: q from the block's rows; the block's own K/V after the cached rows (rank 0).
    rmsnorm_forward(h_.data(), b, 1, H, param(off.attn_norm), eps, a_.data(), rstd_.data());
    const float* a = prepare(off.attn_conv_proj, off.attn_conv_base);
    linear_forward(a, b, H, w[AttnLayerParams::wq], qw, q_.data());
    rmsnorm_forward(q_.data(), b, cfg_.n_q, cfg_.d_h, w[AttnLayerParams::q_norm], eps, q_.data(), rstd_.data());
    rope_apply(q_.data(), b, cfg_.n_q, qpos, rope_, false);
    if (holds_block) {
      reserve_rows(L, L.rows + b);
      float* k = L.k.data() + L.rows * kvw;
      linear_forward(a, b, H, w[AttnLayerParams::wk], kvw, k_lin_.data());
      rmsnorm_forward(k_lin_.data(), b, cfg_.n_kv, cfg_.d_h, w[AttnLayerParams::k_norm], eps, k, rstd_.data());
      rope_apply(k, b, cfg_.n_kv, qpos, rope_, false);
      linear_forward(a, b, H, w[AttnLayerParams::wv], kvw, L.v.data() + L.rows * kvw);
    }
    const BlockMask mask = layer_mask(L, b, holds_block);
    const std::int64_t keys = mask.key_rows();
    // P > 1: this rank's partial (o, lse) into its send buffer (not aliasing the gather's receive buffer).
    float* o = P > 1 ? send_.data() : o_.data();
    float* lse = P > 1 ? send_.data() + b * qw : lse_.data();
    attention_forward(mask, head_view<const float>(q_.data(), b, cfg_.n_q, cfg_.d_h),
                      head_view<const float>(L.k.data(), keys, cfg_.n_kv, cfg_.d_h),
                      head_view<const float>(L.v.data(), keys, cfg_.n_kv, cfg_.d_h), head_view(o, b, cfg_.n_q, cfg_.d_h),
                      {lse, static_cast<std::size_t>(b * cfg_.n_q)});
    if (P > 1) {  // Split-KV: the partials of every rank, merged in rank order (the same on every rank)
      cp_.all_gather_async(send_.data(), parts_.data(), static_cast<std::size_t>(part), DType::f32)->wait();
      std::vector<HeadRows<const float>> o_parts;
      std::vector<std::span<const float>> lse_parts;
      for (std::int64_t r = 0; r < P; ++r) {
        const float* at = parts_.data() + r * part;
        o_parts.push_back(head_view(at, b, cfg_.n_q, cfg_.d_h));
        lse_parts.emplace_back(at + b * qw, static_cast<std::size_t>(b * cfg_.n_q));
      }
      lse_merge(o_parts, lse_parts, head_view(o_.data(), b, cfg_.n_q, cfg_.d_h), lse_);
    }
    linear_forward(o_.data(), b, qw, w[AttnLayerParams::wo], H, y_.data());
    bias_add(y_.data(), b, H, w[AttnLayerParams::bo]);
    if (conv) dynamic_conv_finish(y_.data(), dyn_.data(), param(off.attn_conv_base), cs, conv_.data());
    add_into(h_.data(), (conv ? conv_ : y_).data(), b * H);
    // MLP: h += silu(m W_gate) * (m W_up) W_down, m = RMSNorm(h) (DFlash2: both convolved).
    rmsnorm_forward(h_.data(), b, 1, H, param(off.mlp_norm), eps, a_.data(), rstd_.data());
    const float* m = prepare(off.mlp_conv_proj, off.mlp_conv_base);
    linear_forward(m, b, H, param(off.w_gate), F, gate_.data());
    linear_forward(m, b, H, param(off.w_up), F, up_.data());
    swiglu_forward(gate_.data(), up_.data(), act_.data(), b * F);
    if (!conv) {
      linear_forward(act_.data(), b, F, param(off.w_down), H, h_.data(), 1.f);
    } else {
      linear_forward(act_.data(), b, F, param(off.w_down), H, y_.data());
      dynamic_conv_finish(y_.data(), dyn_.data(), param(off.mlp_conv_base), cs, conv_.data());
      add_into(h_.data(), conv_.data(), b * H);
    }
  }
  rmsnorm_forward(h_.data(), b, 1, H, param(layout_.final_norm), eps, y_.data(), rstd_.data());
  return to_host<float>(y_.view());
}

}  // namespace diffcp
