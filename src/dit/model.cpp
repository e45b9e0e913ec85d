#include "diffcp/dit/model.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "diffcp/attention/attention.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/ops/gemm.hpp"
#include "diffcp/ops/rmsnorm.hpp"

namespace diffcp {

DitModel::DitModel(const DitWeights& weights, const DitShape& shape, AttentionExchange& exchange)
    : w_(weights), cfg_(weights.config()), shape_(shape),
      shard_(make_dit_shard(cfg_, shape, exchange.seq_size(), exchange.seq_rank(), exchange.size())), ex_(exchange) {
  const std::int64_t b = shape_.batch, Tp = shard_.text_p, Ip = shard_.image_p, H = cfg_.hidden();
  const std::int64_t Mt = b * Tp, Mi = b * Ip;
  Mp_ = Mt + Mi;

  // Image token n (row-major over the g_h x g_w grid) sits at row n / g_w, column n % g_w; rank p
  // holds n in [p I_p, (p+1) I_p) of every image and text tokens [p T_p, (p+1) T_p). RoPE positions
  // by family (dit/config.hpp): FLUX's text rows are at the origin (no rotation). Padding rows
  // (n >= N_img, text index >= T) take the positions their index gives; no query sees them.
  const std::int64_t gh = shape_.grid_h(), gw = shape_.grid_w();
  const bool qwen = cfg_.family == DitFamily::qwen_image;
  std::vector<std::array<double, kMaxRopeAxes>> pos, tpos;
  for (std::int64_t j = 0; j < b; ++j)
    for (std::int64_t i = 0; i < Ip; ++i) {
      // token n at frame f (0 but in video), row r, column c: frame-major (Wan's flatten order)
      const std::int64_t n = shard_.p * Ip + i, f = n / (gh * gw), r = n % (gh * gw) / gw, c = n % gw;
      pos.push_back(qwen ? std::array<double, kMaxRopeAxes>{0.0, static_cast<double>(r - (gh - gh / 2)),
                                                            static_cast<double>(c - (gw - gw / 2)), 0.0}
                         : std::array<double, kMaxRopeAxes>{static_cast<double>(f), static_cast<double>(r),
                                                            static_cast<double>(c), 0.0});
    }
  if (!cfg_.rope_axes.empty()) rope_ = std::make_unique<AxialRope>(cfg_, pos);  // SD3: no RoPE
  if (cfg_.family == DitFamily::sd3) {
    // SD3's position table, cropped at its centre to the g_h x g_w grid (diffusers' PatchEmbed):
    // token (r, c) takes row (top + r) * max + left + c, top = (max - g_h) / 2, left = (max - g_w) / 2.
    const std::int64_t mx = cfg_.pos_embed_max;  // gh, gw <= mx: make_dit_shard
    std::vector<std::int64_t> rows;
    for (std::int64_t j = 0; j < b; ++j)
      for (std::int64_t i = 0; i < Ip; ++i) {
        const std::int64_t n = std::min(shard_.p * Ip + i, shard_.image - 1);  // padding: the last token's row
        rows.push_back(((mx - gh) / 2 + n / gw) * mx + (mx - gw) / 2 + n % gw);
      }
    pos_rows_.resize(Mi * H);
    gather_rows(param(w_.layout().pos_embed), DType::f32, mx * mx, H, rows, H, pos_rows_.data(), DType::f32, H);
  }
  if (cfg_.family == DitFamily::qwen_image || cfg_.family == DitFamily::flux2) {  // rotated text rows
    const std::int64_t m = std::max(gh / 2, gw / 2);
    for (std::int64_t j = 0; j < b; ++j)
      for (std::int64_t t = 0; t < Tp; ++t) {
        const double i = static_cast<double>(shard_.p * Tp + t);
        tpos.push_back(qwen ? std::array<double, kMaxRopeAxes>{m + i, m + i, m + i, 0.0}
                            : std::array<double, kMaxRopeAxes>{0.0, 0.0, 0.0, i});  // FLUX.2: (0, 0, 0, i)
      }
    txt_rope_ = std::make_unique<AxialRope>(cfg_, tpos);
  }
  txt_rows_ = {0, Mt, txt_rope_.get(), Tp};
  img_rows_ = {Mt, Mi, rope_.get(), Ip};

  // Exchange order per image: the real text rows, the real image rows, then the padding rows.
  ExchangeLayout l{b, Tp + Ip, cfg_.heads, cfg_.head_dim, Mp_, {}, {}};
  const std::int64_t tv = shard_.text_valid(shard_.p), iv = shard_.image_valid(shard_.p);
  for (std::int64_t j = 0; j < b; ++j) {
    for (std::int64_t t = 0; t < tv; ++t) l.rows.push_back(j * Tp + t);
    for (std::int64_t t = 0; t < iv; ++t) l.rows.push_back(Mt + j * Ip + t);
    for (std::int64_t t = tv; t < Tp; ++t) l.rows.push_back(j * Tp + t);
    for (std::int64_t t = iv; t < Ip; ++t) l.rows.push_back(Mt + j * Ip + t);
  }
  for (int r = 0; r < shard_.P; ++r) l.valid.push_back(shard_.text_valid(r) + shard_.image_valid(r));
  ex_.set_layout(std::move(l));

  DIFFCP_CHECK(&active_backend() == w_.backend(), "DitModel: the active backend '", active_backend().name(),
               "' is not the one holding the weights ('", w_.backend()->name(), "')");
  for (DeviceVector<float>* v : {&x_, &xm_, &attn_, &y_}) v->resize(Mp_ * H);
  big_.resize(Mp_ * (3 * H + cfg_.mlp_in()));
  temb_.resize(cfg_.time_dim);
  if (qwen) {
    txt_normed_.resize(b * Tp * cfg_.text_dim);
    txt_rstd_.resize(b * Tp);
  }
  for (DeviceVector<float>* v : {&h_, &vec_, &silu_vec_}) v->resize(b * H);
  mod_.resize(b * 6 * H);
  mods_.resize(2 * b * 6 * H);
  if (cfg_.cross_attention()) {  // Wan: the context is sized for a batch of prompts (per_image)
    const std::int64_t T = shard_.context;
    for (DeviceVector<float>* v : {&ctx_h_, &ctx_, &ck_, &cv_}) v->resize(b * T * H);
    ctx_rstd_.resize(b * T);
    q_rstd_.resize(Mp_);
    cross_lse_.resize(Mp_ * cfg_.heads);
    ln_scale_.resize(std::max(H, cfg_.image_dim));
    minus_ones_.resize(std::max(H, cfg_.image_dim));
    fill(minus_ones_.data(), std::max(H, cfg_.image_dim), -1.f);
    // Image j's I_p query rows see its context: key rows [0, T) shared, or [j T, (j + 1) T) per image.
    const auto context_masks = [&](std::int64_t T, std::vector<BlockMask>& masks) {
      for (const bool own : {false, true}) {
        std::vector<ContextSegment> segments;
        std::vector<MaskBlock> blocks;
        for (std::int64_t j = 0; j < b; ++j) {
          const std::int64_t at = own ? j * T : 0;
          if (own || j == 0) segments.push_back({at, at, T});
          blocks.push_back({at, at + T, -1});
        }
        masks.emplace_back(Ip, own ? b * T : T, std::move(segments), std::move(blocks));
      }
    };
    context_masks(T, cross_masks_);
    const std::int64_t I = shape_.image_context, Di = cfg_.image_dim;
    DIFFCP_CHECK((I > 0) == (Di > 0) && (cfg_.image_pos_tokens == 0 || I == cfg_.image_pos_tokens),
                 "dit: ", I, " image context tokens for a model ",
                 Di > 0 ? "with an image context (image_dim " + std::to_string(Di) + ")" : std::string("without one"),
                 cfg_.image_pos_tokens > 0 ? "; its position table needs " + std::to_string(cfg_.image_pos_tokens) : std::string());
    if (Di > 0) {
      for (DeviceVector<float>* v : {&ictx_in_, &ictx_n_}) v->resize(b * I * Di);
      for (DeviceVector<float>* v : {&ictx_, &ik_, &iv_}) v->resize(b * I * std::max(H, Di));
      ictx_rstd_.resize(b * I);
      img_attn_.resize(Mp_ * H);
      img_lse_.resize(Mp_ * cfg_.heads);
      context_masks(I, image_masks_);
    }
  } else {
    DIFFCP_CHECK(shape_.image_context == 0, "dit: ", shape_.image_context, " image context tokens for a ",
                 dit_family_name(cfg_.family), " model (Wan I2V's only)");
  }
}

void DitModel::project(const DitLinear& l, const float* x, std::int64_t rows, std::int64_t c0, std::int64_t ncols, float* y,
                       std::int64_t ldy) {
  const DitPhaseScope t(timing_, DitPhase::gemm);
  // One rank with replicated weights has nothing to progress: one GEMM over all rows (the GEMM
  // libraries run a tall M faster than chunks of 64: issue #54). Every mode of one P chunks alike.
  const std::int64_t chunk = one_rank() ? std::max<std::int64_t>(rows, 1) : kPollRows;
  for (std::int64_t r0 = 0; r0 < rows; r0 += chunk) {
    linear(l, x + r0 * l.in, l.in, std::min(chunk, rows - r0), c0, ncols, y + r0 * ldy, ldy);
    ex_.poll();
    w_.poll();
  }
}

void DitModel::linear(const DitLinear& l, const float* x, std::int64_t ldx, std::int64_t M, std::int64_t c0,
                      std::int64_t ncols, float* y, std::int64_t ldy) const {
  // W: [in, out], columns c0.. with row stride out, in the dtype the GEMM reads
  dit_linear(x, ldx, M, w_.gemm_weight(l, c0, ncols), param(l.b) + c0, y, ldy, w_.packed(l, c0, ncols));
}

void DitModel::modulation(const DitLinear& l, float* out) const { linear(l, silu_vec_.data(), l.in, nv_, out, l.out); }

void DitModel::velocity(const float* x_p, const float* txt_p, const float* pooled, double t, double guidance,
                        float* v_p, bool per_image, std::span<const double> token_t) {
  const DitLayout& L = w_.layout();
  DIFFCP_CHECK(&active_backend() == w_.backend(), "DitModel::velocity: the active backend '",
               active_backend().name(), "' is not the one holding the weights ('", w_.backend()->name(), "')");
  // bf16 compute on f32 weights: the weights' rounded copy (DitWeights::rounded), the activations
  // rounded at each GEMM; f32: the f32 weights. bf16 weights: bf16 GEMMs in either compute.
  DIFFCP_CHECK(!(f32_gemm_compute() == DType::bf16 && w_.storage() == DType::f32 && w_.sharded()),
               "dit: bf16 compute on sharded f32 weights is not supported; store them in bf16 (`weights_dtype` bf16)");
  w_.begin_forward();
  // The first evaluation is the warm-up (primitives made, weights packed): not profiled.
  timing_ = evaluations_++ > 0 ? profile_ : nullptr;
  if (timing_) ++timing_->evaluations;
  if (cfg_.cross_attention()) return wan_velocity(x_p, txt_p, pooled, t, v_p, per_image, token_t);
  DIFFCP_CHECK(token_t.empty(), "dit: per-token timesteps are Wan's (TI2V's image conditioning); ",
               dit_family_name(cfg_.family), " takes one timestep");
  const std::int64_t H = cfg_.hidden(), Tp = shard_.text_p;
  std::optional<DitPhaseScope> phase(std::in_place, timing_, DitPhase::conditioning);
  // vec = MLP_time(timestep features) + MLP_vector(pooled); the blocks use silu(vec).
  time_mlp(t);
  if (cfg_.guidance_embed) {  // FLUX.1-dev: vec += MLP_guidance(timestep_embedding(guidance))
    temb_.assign(timestep_embedding(guidance, cfg_.time_dim));
    linear(L.guidance_in0, temb_.data(), cfg_.time_dim, 1, h_.data(), H);
    silu_inplace(h_.data(), H);
    linear(L.guidance_in1, h_.data(), H, 1, y_.data(), H);
    add_into(vec_.data(), y_.data(), H);
  }
  // Per image: each image's pooled vector gives its own vec (the time and guidance terms shared).
  nv_ = per_image && cfg_.has_pooled() ? shape_.batch : 1;
  for (std::int64_t j = 1; j < nv_; ++j) device_copy(vec_.data() + j * H, vec_.data(), H);
  if (cfg_.has_pooled()) {  // FLUX: vec += MLP_vector(pooled)
    linear(L.vector_in0, pooled, cfg_.pooled_dim, nv_, h_.data(), H);
    silu_inplace(h_.data(), nv_ * H);
    linear(L.vector_in1, h_.data(), H, nv_, silu_vec_.data(), H);
    add_into(silu_vec_.data(), vec_.data(), nv_ * H);
  } else {
    device_copy(silu_vec_.data(), vec_.data(), H);
  }
  silu_inplace(silu_vec_.data(), nv_ * H);

  // Embeddings: the text rows shared by every image are projected once and copied; per image, each
  // image's own.
  linear(L.img_in, x_p, cfg_.in_channels(), img_rows_.rows, x_.data() + img_rows_.row0 * H, H);
  if (L.pos_embed >= 0) add_into(x_.data() + img_rows_.row0 * H, pos_rows_.data(), img_rows_.rows * H);  // SD3
  if (Tp > 0) {
    const std::int64_t text_rows = per_image ? shape_.batch * Tp : Tp;
    if (L.txt_norm >= 0) {  // Qwen-Image: txt_in(RMSNorm(txt))
      rmsnorm_forward(txt_p, text_rows, 1, cfg_.text_dim, param(L.txt_norm), static_cast<float>(cfg_.eps),
                      txt_normed_.data(), txt_rstd_.data());
      txt_p = txt_normed_.data();
    }
    linear(L.txt_in, txt_p, cfg_.text_dim, text_rows, x_.data(), H);
    if (!per_image)
      for (std::int64_t j = 1; j < shape_.batch; ++j) device_copy(x_.data() + j * Tp * H, x_.data(), Tp * H);
  }

  phase.reset();
  // The blocks; with a step cache, the first one, then the rest unless the cache stands in for them.
  float* img_x = x_.data() + img_rows_.row0 * H;
  if (step_cache_) step_cache_->enter(img_x);
  std::size_t first_double = 0, first_single = 0;
  if (!L.double_blocks.empty())
    double_block(L.double_blocks[first_double++]);
  else if (!L.single_blocks.empty())
    single_block(L.single_blocks[first_single++]);
  if (!step_cache_ || !step_cache_->reuse(img_x)) {
    for (std::size_t i = first_double; i < L.double_blocks.size(); ++i) double_block(L.double_blocks[i]);
    for (std::size_t i = first_single; i < L.single_blocks.size(); ++i) single_block(L.single_blocks[i]);
    if (step_cache_) step_cache_->leave(img_x);
  }

  // Final layer on the image rows: (shift, scale).
  const DitPhaseScope final_phase(timing_, DitPhase::final_layer);
  modulation(L.final_mod, mod_.data());
  for_images(img_rows_, [&](std::int64_t r0, std::int64_t rows, std::int64_t j) {
    const float* mod = mod_.data() + j * L.final_mod.out;
    layernorm_modulate(x_.data() + r0 * H, rows, H, mod, mod + H, static_cast<float>(cfg_.eps),
                       xm_.data() + (r0 - img_rows_.row0) * H);
  });
  linear(L.final_linear, xm_.data(), H, img_rows_.rows, v_p, cfg_.in_channels());
  zero_padding(v_p);
}

void DitModel::time_mlp(double t) {
  const DitLayout& L = w_.layout();
  const std::int64_t H = cfg_.hidden();
  temb_.assign(timestep_embedding(t, cfg_.time_dim));  // host math on one scalar
  linear(L.time_in0, temb_.data(), cfg_.time_dim, 1, h_.data(), H);
  silu_inplace(h_.data(), H);
  linear(L.time_in1, h_.data(), H, 1, vec_.data(), H);
}

void DitModel::zero_padding(float* v_p) const {
  const std::int64_t C = cfg_.in_channels(), Ip = shard_.image_p, iv = shard_.image_valid(shard_.p);
  if (iv < Ip)  // padding rows: v = 0, so they stay as they came in
    for (std::int64_t j = 0; j < shape_.batch; ++j) fill(v_p + (j * Ip + iv) * C, (Ip - iv) * C, 0.f);
}

void DitModel::v_first_qkv(const DitLinear& l, std::int64_t whole_cols, std::int64_t ld) {
  const std::int64_t H = cfg_.hidden();
  if (one_rank())
    project(l, xm_.data(), Mp_, 0, whole_cols, big_.data(), ld);
  else
    project(l, xm_.data(), Mp_, 2 * H, H, big_.data() + 2 * H, ld);
  ex_.start_v({big_.data(), Mp_, 3 * cfg_.heads, cfg_.head_dim, ld});
  if (!one_rank()) project(l, xm_.data(), Mp_, 0, 2 * H, big_.data(), ld);
}

// I2V: ictx_ = LN2(Lin2(GELU(Lin1(LN1(image [+ positions]))))), LN with weight and bias (eps 1e-5,
// diffusers' FP32LayerNorm), as (1 + (w - 1)) LN + b.
void DitModel::wan_image_context(const float* image_p) {
  const DitLayout& L = w_.layout();
  const std::int64_t H = cfg_.hidden(), Di = cfg_.image_dim, rows = n_ctx_ * shape_.image_context;
  constexpr float kEps = 1e-5f;
  const float* in = image_p;
  if (L.image_pos >= 0) {  // FLF2V: the first and last frames' tokens take their learned positions
    device_copy(ictx_in_.data(), image_p, rows * Di);
    for (std::int64_t j = 0; j < n_ctx_; ++j)
      add_into(ictx_in_.data() + j * shape_.image_context * Di, param(L.image_pos), shape_.image_context * Di);
    in = ictx_in_.data();
  }
  affine_layernorm(in, rows, Di, L.image_norm1_w, L.image_norm1_b, kEps, ictx_n_.data());
  linear(L.image_in, ictx_n_.data(), Di, rows, ik_.data(), Di);
  gelu_inplace(ik_.data(), rows, Di, Di);
  linear(L.image_in2, ik_.data(), Di, rows, iv_.data(), H);
  affine_layernorm(iv_.data(), rows, H, L.image_norm2_w, L.image_norm2_b, kEps, ictx_.data());
}

// y[rows, cols] = LN(x) * w + b (weight and bias: the layout's vectors at w, b), as (1 + (w - 1)) LN + b.
void DitModel::affine_layernorm(const float* x, std::int64_t rows, std::int64_t cols, std::int64_t w, std::int64_t b,
                                float eps, float* y) {
  device_copy(ln_scale_.data(), param(w), cols);
  add_into(ln_scale_.data(), minus_ones_.data(), cols);
  layernorm_modulate(x, rows, cols, param(b), ln_scale_.data(), eps, y);
}

// The rows of each timestep: one run of every row at t, or (token_t) runs of this rank's consecutive
// rows whose tokens share a timestep (padding rows: the last token's), each with its slot among the
// distinct values.
void DitModel::wan_timestep_runs(double t, std::span<const double> token_t) {
  runs_.clear();
  slot_t_.clear();
  if (token_t.empty()) {
    slot_t_.push_back(t);
    runs_.push_back({0, Mp_, 0});
    return;
  }
  const std::int64_t N = shard_.image, Ip = shard_.image_p;
  DIFFCP_CHECK(static_cast<std::int64_t>(token_t.size()) == N, "dit: ", token_t.size(), " per-token timesteps for ", N,
               " video tokens");
  for (std::int64_t j = 0; j < shape_.batch; ++j)
    for (std::int64_t i = 0; i < Ip; ++i) {
      const double tn = token_t[static_cast<std::size_t>(std::min(shard_.p * Ip + i, N - 1))];
      const auto at = std::find(slot_t_.begin(), slot_t_.end(), tn);
      const int slot = static_cast<int>(at - slot_t_.begin());
      if (at == slot_t_.end()) slot_t_.push_back(tn);
      const std::int64_t row = j * Ip + i;
      if (!runs_.empty() && runs_.back().slot == slot && runs_.back().row0 + runs_.back().rows == row)
        ++runs_.back().rows;
      else
        runs_.push_back({row, 1, slot});
    }
}

void DitModel::wan_velocity(const float* x_p, const float* txt_p, const float* image_p, double t, float* v_p,
                            bool per_image, std::span<const double> token_t) {
  const DitLayout& L = w_.layout();
  const std::int64_t H = cfg_.hidden(), C = cfg_.in_channels();
  nv_ = 1;  // no pooled vector: one modulation for every image
  n_ctx_ = per_image ? shape_.batch : 1;
  const std::int64_t ctx_rows = n_ctx_ * shard_.context;
  std::optional<DitPhaseScope> phase(std::in_place, timing_, DitPhase::conditioning);
  // Per timestep slot k: temb_k = MLP_time(features(t_k)) in slot_temb_; tp_k = time_proj(silu(temb_k)) in tproj_
  wan_timestep_runs(t, token_t);
  const std::int64_t S = static_cast<std::int64_t>(slot_t_.size());
  if (static_cast<std::int64_t>(slot_temb_.size()) < S * H) {
    slot_temb_.resize(S * H);
    tproj_.resize(S * 6 * H);
    mod_.resize(std::max(S, shape_.batch) * 6 * H);
  }
  for (std::int64_t k = 0; k < S; ++k) {
    time_mlp(slot_t_[static_cast<std::size_t>(k)]);
    device_copy(slot_temb_.data() + k * H, vec_.data(), H);
    device_copy(silu_vec_.data(), vec_.data(), H);
    silu_inplace(silu_vec_.data(), H);
    linear(L.time_proj, silu_vec_.data(), H, 1, tproj_.data() + k * 6 * H, 6 * H);
  }
  // The context (every rank the whole text) and the video tokens.
  linear(L.txt_in, txt_p, cfg_.text_dim, ctx_rows, ctx_h_.data(), H);
  gelu_tanh_inplace(ctx_h_.data(), ctx_rows, H, H);
  linear(L.txt_in2, ctx_h_.data(), H, ctx_rows, ctx_.data(), H);
  if (cfg_.image_dim > 0) wan_image_context(image_p);
  linear(L.img_in, x_p, cfg_.embed_in_channels(), Mp_, x_.data(), H);
  phase.reset();

  if (step_cache_) step_cache_->enter(x_.data());
  wan_block(L.wan_blocks[0]);
  if (!step_cache_ || !step_cache_->reuse(x_.data())) {
    for (std::size_t i = 1; i < L.wan_blocks.size(); ++i) wan_block(L.wan_blocks[i]);
    if (step_cache_) step_cache_->leave(x_.data());
  }

  // Final layer: (shift, scale) = final_table + temb (not silu'd), per timestep slot.
  const DitPhaseScope final_phase(timing_, DitPhase::final_layer);
  for (std::int64_t k = 0; k < S; ++k) {
    float* m = mod_.data() + k * 2 * H;
    device_copy(m, param(L.final_table), 2 * H);
    add_into(m, slot_temb_.data() + k * H, H);
    add_into(m + H, slot_temb_.data() + k * H, H);
  }
  for (const WanRun& r : runs_) {
    const float* m = mod_.data() + r.slot * 2 * H;
    layernorm_modulate(x_.data() + r.row0 * H, r.rows, H, m, m + H, static_cast<float>(cfg_.eps), xm_.data() + r.row0 * H);
  }
  linear(L.final_linear, xm_.data(), H, Mp_, v_p, C);
  zero_padding(v_p);
}

void DitModel::wan_block(const DitLayout::WanBlock& blk) {
  const std::int64_t H = cfg_.hidden(), M = cfg_.mlp_hidden, d = cfg_.head_dim, nh = cfg_.heads;
  const std::int64_t ctx_rows = n_ctx_ * shard_.context;
  const float eps = static_cast<float>(cfg_.eps);
  // Per timestep slot k: (shift, scale, gate, c_shift, c_scale, c_gate) = table + tp_k; each run of rows
  // takes its slot's (one run of every row unless the tokens' timesteps differ).
  const std::int64_t S = static_cast<std::int64_t>(slot_t_.size());
  timed(DitPhase::conditioning, [&] {
    for (std::int64_t k = 0; k < S; ++k) {
      device_copy(mod_.data() + k * 6 * H, param(blk.table), 6 * H);
      add_into(mod_.data() + k * 6 * H, tproj_.data() + k * 6 * H, 6 * H);
    }
  });
  const auto modulate = [&](int first) {  // xm = (1 + scale) LN(x) + shift, mod columns [first H, (first + 2) H)
    for (const WanRun& r : runs_) {
      const float* m = mod_.data() + r.slot * 6 * H + first * H;
      layernorm_modulate(x_.data() + r.row0 * H, r.rows, H, m, m + H, eps, xm_.data() + r.row0 * H);
    }
  };
  const auto gate = [&](int col) {  // x += gate * y, the gate at mod column col H
    for (const WanRun& r : runs_)
      gated_add(x_.data() + r.row0 * H, r.rows, H, mod_.data() + r.slot * 6 * H + col * H, y_.data() + r.row0 * H, H);
  };
  timed(DitPhase::layernorm_mod, [&] { modulate(0); });
  // Self-attention: v first (V-First), then q | k with their norm across heads and the 3-D RoPE.
  v_first_qkv(blk.qkv, 3 * H, 3 * H);
  timed(DitPhase::qk_norm_rope, [&] {
    qk_norm_rope(big_.data(), Mp_, 3 * H, nh, d, param(blk.q_scale), param(blk.k_scale), eps, rope_.get(), true);
  });
  ex_.poll();
  timed(DitPhase::attention, [&] { ex_.attention({big_.data(), Mp_, 3 * nh, d, 3 * H}, {attn_.data(), Mp_, nh, d, H}); });
  timed(DitPhase::gemm, [&] { linear(blk.out, attn_.data(), H, Mp_, y_.data(), H); });
  timed(DitPhase::gated_add, [&] { gate(2); });

  // Cross-attention to the context: every head here, no exchange. norm2: LN with weight and bias
  // (cross_attn_norm; without it the queries read x itself, nn.Identity).
  const bool norm2 = blk.norm2_w >= 0;
  if (norm2)
    timed(DitPhase::layernorm_mod, [&] { affine_layernorm(x_.data(), Mp_, H, blk.norm2_w, blk.norm2_b, eps, xm_.data()); });
  timed(DitPhase::gemm, [&] { linear(blk.cross_q, norm2 ? xm_.data() : x_.data(), H, Mp_, y_.data(), H); });
  timed(DitPhase::qk_norm_rope,
        [&] { rmsnorm_forward(y_.data(), Mp_, 1, H, param(blk.cross_q_scale), eps, y_.data(), q_rstd_.data()); });
  // The queries y_ over one context's rows: keys / values projected by kv (k | v), the keys RMS-normed
  // (k_scale), into out [M_p, H].
  const auto attend = [&](const DitLinear& kv, std::int64_t k_scale, const float* ctx, std::int64_t rows,
                          const std::vector<BlockMask>& masks, float* k, float* v, float* rstd, float* out,
                          std::span<float> lse) {
    timed(DitPhase::gemm, [&] {
      linear(kv, ctx, H, rows, 0, H, k, H);
      linear(kv, ctx, H, rows, H, H, v, H);
    });
    timed(DitPhase::qk_norm_rope, [&] { rmsnorm_forward(k, rows, 1, H, param(k_scale), eps, k, rstd); });
    timed(DitPhase::attention, [&] {
      const Device dev = active_device();
      const auto view = [&](const float* p, std::int64_t n) {
        return ConstTensorView::contiguous(p, DType::f32, {n, nh, d}, dev);
      };
      attention_forward(masks[n_ctx_ > 1 ? 1 : 0], view(y_.data(), Mp_), view(k, rows), view(v, rows),
                        TensorView::contiguous(out, DType::f32, {Mp_, nh, d}, dev), lse);
    });
  };
  attend(blk.cross_kv, blk.cross_k_scale, ctx_.data(), ctx_rows, cross_masks_, ck_.data(), cv_.data(), ctx_rstd_.data(),
         attn_.data(), cross_lse_);
  if (blk.image_k_scale >= 0) {  // I2V: the same queries over the image context, a softmax of its own, summed
    attend(blk.image_kv, blk.image_k_scale, ictx_.data(), n_ctx_ * shape_.image_context, image_masks_, ik_.data(),
           iv_.data(), ictx_rstd_.data(), img_attn_.data(), img_lse_);
    timed(DitPhase::gated_add, [&] { add_into(attn_.data(), img_attn_.data(), Mp_ * H); });
  }
  timed(DitPhase::gemm, [&] { linear(blk.cross_out, attn_.data(), H, Mp_, y_.data(), H); });
  timed(DitPhase::gated_add, [&] { add_into(x_.data(), y_.data(), Mp_ * H); });

  // MLP
  timed(DitPhase::layernorm_mod, [&] { modulate(3); });
  timed(DitPhase::gemm, [&] { linear(blk.ffn0, xm_.data(), H, Mp_, big_.data(), M); });
  timed(DitPhase::activation, [&] { gelu_tanh_inplace(big_.data(), Mp_, M, M); });
  timed(DitPhase::gemm, [&] { linear(blk.ffn2, big_.data(), M, Mp_, y_.data(), H); });
  timed(DitPhase::gated_add, [&] { gate(5); });
}

void DitModel::set_step_cache(const StepCacheSpec& spec, Communicator& comm) {
  if (!spec.enabled) {
    step_cache_.reset();
    return;
  }
  DIFFCP_CHECK(cfg_.double_blocks + cfg_.single_blocks >= 2, "`step_cache`: the model has ",
               cfg_.double_blocks + cfg_.single_blocks, " block(s); First-Block Cache needs at least two (it skips all but the first)");
  step_cache_ = std::make_unique<FirstBlockCache>(spec.threshold, comm, shape_.batch, shard_.image_p,
                                                  shard_.image_valid(shard_.p), cfg_.hidden());
}

void DitModel::double_block(const DitLayout::DoubleBlock& blk) {
  const std::int64_t H = cfg_.hidden(), M = cfg_.mlp_hidden, d = cfg_.head_dim;
  const float eps = static_cast<float>(cfg_.eps);
  const std::pair<const DitLayout::Stream*, StreamRows> streams[] = {{&blk.txt, txt_rows_}, {&blk.img, img_rows_}};

  // Each stream's modulated, normed, rotated q | k | v into big_ as [M_p, 3H] (rows in place). V-First
  // (SPEC B.3): both streams' v columns first, V's exchange starts, then q | k + norm + RoPE. One
  // rank: nothing to overlap, so q | k | v in one GEMM (dense rows: no column-slice copies, the
  // activations rounded once).
  const bool whole = one_rank();
  for (int s = 0; s < 2; ++s) {
    const auto& [w, r] = streams[s];
    // shift1, scale1, gate1, shift2, scale2, gate2 (pre_only: shift, scale), a row per image (nv_)
    float* mod = mods_.data() + s * shape_.batch * 6 * H;
    timed(DitPhase::conditioning, [&] { modulation(w->mod, mod); });
    timed(DitPhase::layernorm_mod, [&] {
      for_images(r, [&](std::int64_t r0, std::int64_t rows, std::int64_t j) {
        const float* m = mod + j * w->mod.out;
        layernorm_modulate(x_.data() + r0 * H, rows, H, m, m + H, eps, xm_.data() + r0 * H);
      });
    });
    if (whole)
      project(w->qkv, xm_.data() + r.row0 * H, r.rows, 0, 3 * H, big_.data() + r.row0 * 3 * H, 3 * H);
    else
      project(w->qkv, xm_.data() + r.row0 * H, r.rows, 2 * H, H, big_.data() + r.row0 * 3 * H + 2 * H, 3 * H);
  }
  ex_.start_v({big_.data(), Mp_, 3 * cfg_.heads, d, 3 * H});
  for (int s = 0; s < 2; ++s) {
    const auto& [w, r] = streams[s];
    float* qkv = big_.data() + r.row0 * 3 * H;
    if (!whole) project(w->qkv, xm_.data() + r.row0 * H, r.rows, 0, 2 * H, qkv, 3 * H);
    timed(DitPhase::qk_norm_rope,
          [&] { qk_norm_rope(qkv, r.rows, 3 * H, cfg_.heads, d, param(w->q_scale), param(w->k_scale), eps, r.rope); });
    ex_.poll();
  }

  timed(DitPhase::attention,
        [&] { ex_.attention({big_.data(), Mp_, 3 * cfg_.heads, d, 3 * H}, {attn_.data(), Mp_, cfg_.heads, d, H}); });

  for (int s = 0; s < 2; ++s) {
    const auto& [w, r] = streams[s];
    if (w->pre_only) continue;  // SD3's last text stream: its rows are not read again
    const float* mod = mods_.data() + s * shape_.batch * 6 * H;
    float* xm = xm_.data() + r.row0 * H;
    // y_ holds the stream's rows from its first: image j's at (r0 - r.row0).
    const auto gated = [&](std::int64_t k) {
      for_images(r, [&](std::int64_t r0, std::int64_t rows, std::int64_t j) {
        gated_add(x_.data() + r0 * H, rows, H, mod + j * w->mod.out + k * H, y_.data() + (r0 - r.row0) * H, H);
      });
    };
    timed(DitPhase::gemm, [&] { linear(w->proj, attn_.data() + r.row0 * H, H, r.rows, y_.data(), H); });
    timed(DitPhase::gated_add, [&] { gated(2); });
    timed(DitPhase::layernorm_mod, [&] {
      for_images(r, [&](std::int64_t r0, std::int64_t rows, std::int64_t j) {
        const float* m = mod + j * w->mod.out;
        layernorm_modulate(x_.data() + r0 * H, rows, H, m + 3 * H, m + 4 * H, eps, xm_.data() + r0 * H);
      });
    });
    const std::int64_t mi = cfg_.mlp_in();
    timed(DitPhase::gemm, [&] { linear(w->mlp0, xm, H, r.rows, big_.data(), mi); });  // q | k | v are consumed: reuse
    timed(DitPhase::activation, [&] {
      if (cfg_.swiglu())
        swiglu_rows(big_.data(), r.rows, M, mi);  // [gate | up] -> silu(gate) * up in the first M columns
      else
        gelu_tanh_inplace(big_.data(), r.rows, M, M);
    });
    timed(DitPhase::gemm, [&] { linear(w->mlp2, big_.data(), mi, r.rows, y_.data(), H); });
    timed(DitPhase::gated_add, [&] { gated(5); });
  }
}

void DitModel::single_block(const DitLayout::SingleBlock& blk) {
  const std::int64_t H = cfg_.hidden(), M = cfg_.mlp_hidden, d = cfg_.head_dim, ld = 3 * H + cfg_.mlp_in();
  const float eps = static_cast<float>(cfg_.eps);
  timed(DitPhase::conditioning, [&] { modulation(blk.mod, mod_.data()); });  // shift, scale, gate
  const std::int64_t mo = blk.mod.out;  // a row of mod_ per image (nv_)
  timed(DitPhase::layernorm_mod, [&] {
    if (nv_ == 1) return layernorm_modulate(x_.data(), Mp_, H, mod_.data(), mod_.data() + H, eps, xm_.data());
    for (const StreamRows& r : {txt_rows_, img_rows_})
      for_images(r, [&](std::int64_t r0, std::int64_t rows, std::int64_t j) {
        layernorm_modulate(x_.data() + r0 * H, rows, H, mod_.data() + j * mo, mod_.data() + j * mo + H, eps, xm_.data() + r0 * H);
      });
  });
  // linear1 -> [M_p, q | k | v | m]: v first (V-First), then q | k + norm + RoPE, then m. One rank:
  // all of it in one GEMM (as in double_block).
  v_first_qkv(blk.linear1, ld, ld);
  for (const StreamRows& r : {txt_rows_, img_rows_}) {
    timed(DitPhase::qk_norm_rope, [&] {
      qk_norm_rope(big_.data() + r.row0 * ld, r.rows, ld, cfg_.heads, d, param(blk.q_scale), param(blk.k_scale), eps, r.rope);
    });
    ex_.poll();
  }
  if (!one_rank()) project(blk.linear1, xm_.data(), Mp_, 3 * H, cfg_.mlp_in(), big_.data() + 3 * H, ld);
  // The attention output overwrites the v columns, so [a | act(m)] is linear2's input in place.
  timed(DitPhase::attention, [&] {
    ex_.attention({big_.data(), Mp_, 3 * cfg_.heads, d, ld}, {big_.data() + 2 * H, Mp_, cfg_.heads, d, ld});
  });
  timed(DitPhase::activation, [&] {
    if (cfg_.swiglu())
      swiglu_rows(big_.data() + 3 * H, Mp_, M, ld);
    else
      gelu_tanh_inplace(big_.data() + 3 * H, Mp_, M, ld);
  });
  timed(DitPhase::gemm, [&] { linear(blk.linear2, big_.data() + 2 * H, ld, Mp_, y_.data(), H); });
  timed(DitPhase::gated_add, [&] {
    if (nv_ == 1) return gated_add(x_.data(), Mp_, H, mod_.data() + 2 * H, y_.data(), H);
    for (const StreamRows& r : {txt_rows_, img_rows_})
      for_images(r, [&](std::int64_t r0, std::int64_t rows, std::int64_t j) {
        gated_add(x_.data() + r0 * H, rows, H, mod_.data() + j * mo + 2 * H, y_.data() + r0 * H, H);
      });
  });
}

}  // namespace diffcp
