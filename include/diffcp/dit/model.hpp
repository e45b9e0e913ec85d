// The DiT forward (one denoising step's velocity) on rank p of P under Ulysses sequence
// parallelism, FLUX-style, for every family of dit/config.hpp (SPEC B; names and layout there). Inference only.
//
// Legend as in dit/config.hpp; T_p, I_p text / image tokens per rank and image, M_p = b (T_p + I_p).
//
//   vec  = MLP_time(timestep_embedding(t)) [+ MLP_guidance(timestep_embedding(guidance))] [+ MLP_vector(pooled)]
//          MLP(x) = W2 silu(W1 x + b1) + b2; the guidance term only with guidance_embed (FLUX.1-dev),
//          the pooled one only in families that have it (FLUX; not Qwen-Image)
//   img  = x_p W_img_in + b,  txt = txt_p W_txt_in + b                [b I_p, H], [b T_p, H]
//          (Qwen-Image: txt_p RMS-normed first, txt_norm; SD3: img += this token's row of the
//          centre-cropped position table, pos_embed)
//   double-stream block (separate img / txt weights, joint attention):
//     (shift1, scale1, gate1, shift2, scale2, gate2) = Lin_s(silu(vec))   per stream s
//     q, k, v = Lin_qkv((1 + scale1) LN(x_s) + shift1); q, k = RMSNorm per head; RoPE (the family's positions)
//     a = Attn over the concatenated txt and img tokens of each image (the exchange, sharded heads)
//     x_s += gate1 * Lin_proj(a_s);  x_s += gate2 * MLP((1 + scale2) LN(x_s) + shift2)
//     MLP = Lin(M -> H)(GELU_tanh(Lin(H -> M)))
//   single-stream block (one weight set for all tokens):
//     (shift, scale, gate) = Lin(silu(vec)); h = linear1((1 + scale) LN(x) + shift) = [q | k | v | m]
//     x += gate * linear2([Attn(q, k, v) | GELU_tanh(m)])
//   final layer: (shift, scale) = Lin(silu(vec)); v_p = Lin((1 + scale) LN(img) + shift)  [b I_p, C_in]
// LN: LayerNorm without affine weights, eps; every image of the batch shares t and the prompt.
//
// Wan (diffusers' WanTransformer3DModel; no text rows in the sequence, T_p = 0):
//   temb = MLP_time(timestep_embedding(t)); tp = time_proj(silu(temb))              [H], [6H]
//   ctx  = Lin(GELU_tanh(Lin(txt)))  the whole text on every rank                    [T, H]
//   block: (shift, scale, gate, c_shift, c_scale, c_gate) = table + tp
//     q, k, v = Lin_qkv((1 + scale) LN(x) + shift); q, k = RMSNorm across heads; 3-D RoPE
//     x += gate * Lin_out(Attn(q, k, v))                        (the exchange, sharded heads)
//     x += Lin_co(Attn(RMSNorm(Lin_cq(LN2(x))), RMSNorm(ctx W_k), ctx W_v))   (local: all heads)
//          I2V: + Attn(the same q, RMSNorm(ictx W_ak), ictx W_av) inside Lin_co, the image context
//          ictx = LN_w,b(Lin(GELU(Lin(LN_w,b(image [+ pos]))))) (eps 1e-5, exact GELU), whole on every rank
//     x += c_gate * Lin(GELU_tanh(Lin((1 + c_scale) LN(x) + c_shift)))
//   LN2: LayerNorm with weight and bias (cross_attn_norm; else none: x itself)
//   final: (shift, scale) = final_table + temb; v_p = Lin((1 + scale) LN(x) + shift)
//
// Local row layout of the activations: the text rows of every image first (image-major, [b][T_p]),
// then the image rows ([b][I_p]); so each stream's projection is one GEMM. The exchange's row table
// lists, per image, its real text rows, its real image rows, then its padding rows
// (dit/exchange.hpp, DitShard).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "diffcp/attention/mask.hpp"
#include "diffcp/dit/config.hpp"
#include "diffcp/dit/exchange.hpp"
#include "diffcp/dit/ops.hpp"
#include "diffcp/dit/profile.hpp"
#include "diffcp/dit/step_cache.hpp"
#include "diffcp/dit/weights.hpp"
#include "diffcp/ops/buffer.hpp"

namespace diffcp {

class DitModel {
 public:
  // The forward of rank exchange.seq_rank() of exchange.seq_size() (P; USP: U x R, the exchange's
  // Ulysses degree U = exchange.size()); throws (before any communication) when U does not divide
  // the heads. Any token count: padding rows where P does not divide it (DitShard). Sets the exchange's layout, so one model uses an exchange at a
  // time. `weights` and `exchange` must outlive the model; SD3's position rows are read from the
  // weights here (load them first).
  DitModel(const DitWeights& weights, const DitShape& shape, AttentionExchange& exchange);

  const DitConfig& config() const { return cfg_; }
  const DitShard& shard() const { return shard_; }
  const DitShape& shape() const { return shape_; }
  AttentionExchange& exchange() { return ex_; }
  // The backend holding the weights: the one this model runs on (a run installs it).
  Backend& backend() const { return *w_.backend(); }

  // One velocity evaluation. Collective over the exchange's ranks (two all-to-alls per block). Runs
  // on the backend holding the weights (an error otherwise); every pointer is its device memory.
  //   x_p:    [b, I_p, C_in] this rank's latent tokens of every image (padding rows: any finite value);
  //           Wan I2V: [b, I_p, C_in + C_cond], the condition's channels after the latent's
  //   txt_p:  [T_p, text_dim] this rank's text rows, shared by the images; per_image: [b, T_p, text_dim],
  //           each image's own (padding rows zero). Wan: the whole text, [T, text_dim] (or [b, T, text_dim])
  //   pooled: [pooled_dim] the pooled text vector; per_image: [b, pooled_dim] (unread, may be null,
  //           in families without one). Wan I2V (image_dim > 0): this slot is the image context, the
  //           whole [I_ctx, image_dim] on every rank (CLIP's hidden states; per_image: [b, I_ctx, image_dim])
  //   t:      in [0, 1], 1 = pure noise (every image's)
  //   guidance: the guidance scale (read only with guidance_embed; every image's)
  //   v_p:    [b, I_p, C_in] out: the predicted velocity (flow matching: d x_t / d t); 0 in padding rows
  // per_image: a batch of prompts (a server's requests) as one batch: each image's text rows and,
  // where the family has one, its pooled vector, so its own modulation (vec, per image).
  // token_t (Wan only; empty: every token at t): each video token's timestep [N_img], shared by the
  // images (Wan 2.2 TI2V's image conditioning: the first frame's tokens at 0); the modulations of
  // the blocks and the final layer per token.
  void velocity(const float* x_p, const float* txt_p, const float* pooled, double t, double guidance, float* v_p,
                bool per_image = false, std::span<const double> token_t = {});

  // Step caching (dit/step_cache.hpp): First-Block Cache over the ranks of `comm` (the ranks that
  // run this model's pass; it must outlive the model), deciding at every velocity() from then on;
  // spec.enabled false: off. Throws for a model of fewer than two blocks (nothing to skip).
  void set_step_cache(const StepCacheSpec& spec, Communicator& comm);
  const FirstBlockCache* step_cache() const { return step_cache_.get(); }  // null: off
  // Per op family timers (dit/profile.hpp) into `profile` from the next velocity() on, the model's
  // first (warm-up) evaluation left out; null: off.
  void set_profile(DitProfile* profile) { profile_ = profile; }

 private:
  // Rows [row0, row0 + rows) of the activations form one stream (text or image).
  struct StreamRows {
    std::int64_t row0, rows;
    const AxialRope* rope;  // null: no rotation (FLUX's text rows)
    std::int64_t image_rows;  // rows of one image: rows / b
  };
  // f(row0, rows, j) over stream r's rows: once for all of them when the images share their
  // modulation (nv_ == 1), else once per image j.
  template <class F>
  void for_images(const StreamRows& r, F&& f) const {
    if (nv_ == 1) return f(r.row0, r.rows, std::int64_t{0});
    for (std::int64_t j = 0; j < shape_.batch; ++j) f(r.row0 + j * r.image_rows, r.image_rows, j);
  }
  void double_block(const DitLayout::DoubleBlock& blk);
  void single_block(const DitLayout::SingleBlock& blk);
  // Wan's forward (velocity's arguments; txt_p: the whole text, [T, text_dim] or per image [b, T, text_dim])
  void wan_velocity(const float* x_p, const float* txt_p, const float* image_p, double t, float* v_p, bool per_image,
                    std::span<const double> token_t);
  void wan_timestep_runs(double t, std::span<const double> token_t);  // runs_, slot_t_
  void wan_image_context(const float* image_p);  // I2V: image_p [n_ctx I_ctx, image_dim] -> ictx_
  // y = LN(x) * w + b over [rows, cols] (the layout's weight / bias vectors at offsets w, b)
  void affine_layernorm(const float* x, std::int64_t rows, std::int64_t cols, std::int64_t w, std::int64_t b, float eps,
                        float* y);
  void wan_block(const DitLayout::WanBlock& blk);
  void time_mlp(double t);             // vec_ = MLP_time(timestep_embedding(t)) (temb_, h_ scratch)
  void zero_padding(float* v_p) const;  // v = 0 in this rank's padding rows of v_p [b, I_p, C_in]
  // xm_ [M_p, H] through Linear l into big_ (row stride ld) as V-First wants it: v's columns [2H, 3H),
  // V's exchange started, then q | k's [0, 2H); one rank: columns [0, whole_cols) in one GEMM.
  void v_first_qkv(const DitLinear& l, std::int64_t whole_cols, std::int64_t ld);
  // y[rows, ncols] (row stride ldy) = x[rows, l.in] W[:, c0 : c0 + ncols] + bias[c0 : c0 + ncols], in
  // chunks of kPollRows rows with exchange().poll() after each (V-First's progress; one chunk on one
  // rank with replicated weights). The chunks are the same in every mode of one P, so every mode
  // computes bitwise the same q, k, v.
  void project(const DitLinear& l, const float* x, std::int64_t rows, std::int64_t c0, std::int64_t ncols, float* y,
               std::int64_t ldy);
  // One rank with replicated weights: no exchange to progress, so projections run whole (one GEMM
  // over all rows and all of a fused weight's columns).
  bool one_rank() const { return ex_.seq_size() == 1 && !w_.sharded(); }
  // y[M, ncols] (row stride ldy) = x[M, l.in] (row stride ldx) W[:, c0 : c0 + ncols] + b[c0 : c0 +
  // ncols]: with the f32 weights, the bf16 ones (stored so, or their rounded copy under bf16
  // compute: DitWeights::rounded), from the gather window when sharded (dit/weights.hpp).
  void linear(const DitLinear& l, const float* x, std::int64_t ldx, std::int64_t M, std::int64_t c0, std::int64_t ncols,
              float* y, std::int64_t ldy) const;
  // The whole layer: y[M, l.out].
  void linear(const DitLinear& l, const float* x, std::int64_t ldx, std::int64_t M, float* y, std::int64_t ldy) const {
    linear(l, x, ldx, M, 0, l.out, y, ldy);
  }
  // out [nv_, n] = Lin(silu(vec)) for a modulation layer of n = k*H outputs (row j: image j's)
  void modulation(const DitLinear& l, float* out) const;
  template <class F>
  void timed(DitPhase phase, F&& f) {  // f() under phase's timer (dit/profile.hpp)
    const DitPhaseScope t(timing_, phase);
    f();
  }
  const float* param(std::int64_t offset) const { return w_.vector(offset); }  // a vector (bias, scale, table)

  const DitWeights& w_;
  const DitConfig& cfg_;
  DitShape shape_;
  DitShard shard_;
  AttentionExchange& ex_;
  std::unique_ptr<FirstBlockCache> step_cache_;
  DitProfile* profile_ = nullptr;
  DitProfile* timing_ = nullptr;  // this evaluation's: profile_, or null on the first
  int evaluations_ = 0;
  std::unique_ptr<AxialRope> rope_;      // [b I_p] image rows
  std::unique_ptr<AxialRope> txt_rope_;  // [b T_p] text rows (Qwen-Image; null: FLUX's text is not rotated)
  StreamRows txt_rows_{}, img_rows_{};
  std::int64_t Mp_ = 0;
  std::int64_t nv_ = 1;  // this evaluation's modulation vectors: 1 (shared) or b (per_image with a pooled vector)
  // Device memory of the weights' backend, sized once.
  DeviceVector<float> x_, xm_, big_, attn_, y_;  // [M_p, H], [M_p, H], [M_p, 3H + M], [M_p, H], [M_p, H]
  DeviceVector<float> temb_, h_, vec_, silu_vec_;  // [time_dim], [b, H], [b, H], [b, H]
  DeviceVector<float> txt_normed_, txt_rstd_;      // Qwen-Image's txt_norm: [b, T_p, text_dim], [b, T_p]
  DeviceVector<float> pos_rows_;                   // SD3: [b I_p, H] this rank's rows of the position table
  DeviceVector<float> mod_, mods_;                 // [b, 6H]; [2, b, 6H] a double block's two streams
  // Wan: the embedded context and each block's cross-attention keys / values over it (n_ctx = 1, or
  // b per image: this evaluation's), the time projection, norm2's scale - 1, the cross-attention's
  // masks (one block of I_p query rows per image; [0]: a shared context, [1]: one per image)
  DeviceVector<float> ctx_h_, ctx_, ck_, cv_;      // [n_ctx T, H] each
  DeviceVector<float> ctx_rstd_, q_rstd_, cross_lse_;  // [b T], [M_p], [M_p, n_h]
  DeviceVector<float> tproj_, ln_scale_, minus_ones_;  // [S, 6H] (sized per call), [max(H, image_dim)] x 2
  std::vector<BlockMask> cross_masks_;
  std::int64_t n_ctx_ = 1;
  // Wan I2V: the image context [n_ctx I_ctx] rows: its input (+ positions), normed input, the
  // embedded context, each block's keys / values over it and its attention's output; masks as above
  DeviceVector<float> ictx_in_, ictx_n_, ictx_, ik_, iv_, ictx_rstd_, img_attn_, img_lse_;
  std::vector<BlockMask> image_masks_;
  // Wan's timesteps: the distinct values (slots) and the runs of consecutive rows that share one;
  // slot_temb_ [S, H], tproj_ [S, 6H] and mod_ [S, 6H] per slot (S = 1 unless tokens' timesteps differ)
  struct WanRun {
    std::int64_t row0 = 0, rows = 0;
    int slot = 0;
  };
  std::vector<WanRun> runs_;
  std::vector<double> slot_t_;
  DeviceVector<float> slot_temb_;
};

}  // namespace diffcp
