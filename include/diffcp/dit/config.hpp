// The DiT of CoCoDiff's experiments (SPEC B), FLUX-style, inference only: its configuration, the
// token layout of one run, and the parameter layout with the documented tensor names.
//
// Legend: H hidden (= n_h * d_h), n_h heads, d_h head dim, M MLP width, C_in = C_lat * p^2 latent
//         channels of one token (p = patch), T text tokens, N_img = g_h * g_w image tokens of a
//         g_h x g_w grid (g_h = height / 16, g_w = width / 16: an 8x VAE then a 2x2 patch, as
//         FLUX), N = T + N_img tokens per image, b images, P ranks.
#pragma once

#include <array>
#include <initializer_list>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace diffcp {

// The DiT families diffcp runs (CoCoDiff's paper runs FLUX.1, SD3.5, FLUX.2 and Qwen-Image). Both
// below are double-stream (MMDiT) joint attention on the same block kinds; the family decides what
// surrounds the blocks (docs/dit.md, "Families"):
//   flux1:      vec adds the pooled text vector (vector_in) and, guidance-distilled, the guidance
//               (guidance_in); single-stream blocks after the double ones; text at RoPE position
//               (0, 0, 0), image token (r, c) at (0, r, c).
//   qwen_image: no pooled vector and no guidance embedding (vec = the timestep's MLP); the text
//               rows are RMS-normed (txt_norm, eps 1e-6) before txt_in; double-stream blocks only;
//               RoPE positions centred on the image (row r at r - ceil(g_h/2), column c at
//               c - ceil(g_w/2), frame 0) and text token i at (m + i, m + i, m + i), m = max(floor(g_h/2),
//               floor(g_w/2)) (diffusers' QwenEmbedRope with scale_rope); classifier-free guidance
//               with the conditional velocity's per-token norm kept (QwenImagePipeline's true CFG).
//   flux2:      no biases anywhere; the modulation is shared by all blocks (three Linears of vec:
//               double_stream_modulation_img / _txt, single_stream_modulation); SwiGLU MLPs (the
//               first Linear gives 2M: silu(gate) * up); no pooled vector; four RoPE axes (frame,
//               row, column, text index; theta 2000), text token i at (0, 0, 0, i), image (0, r, c, 0).
//   sd3:        Stable Diffusion 3.5 (MMDiT): no RoPE; a learned 2-D position table added to the
//               patch embedding (pos_embed, cropped to the grid at its centre); the last block's text
//               stream is context-pre-only (modulation (shift, scale) only: it gives K and V to the
//               joint attention, no output projection, no MLP); double-stream blocks only; pooled
//               vector; classifier-free guidance without rescaling (StableDiffusion3Pipeline); the
//               latent in [b, C, H/8, W/8], patchified inside (channels (c, ph, pw)).
//   wan:        Wan 2.1 / 2.2 text-to-video (diffusers' WanTransformer3DModel): the latent video
//               [b, C, F, H/8, W/8] patchified 1 x 2 x 2 (tokens in (frame, row, column) order); no
//               text tokens in the sequence: single-stream blocks of self-attention over the video
//               tokens (q / k RMSNorm across all heads, then 3-D RoPE: frame, row, column; the axes
//               d_h - 4 floor(d_h / 6), 2 floor(d_h / 6), 2 floor(d_h / 6)), cross-attention of every
//               video token to the whole embedded text (each rank holds it: no exchange), an MLP;
//               the modulation is a learned table per block plus one projection of the time
//               embedding; classifier-free guidance without rescaling (WanPipeline).
enum class DitFamily { flux1, qwen_image, flux2, sd3, wan };
const char* dit_family_name(DitFamily f);

struct DitConfig {
  DitFamily family = DitFamily::flux1;
  std::int64_t heads = 24, head_dim = 32;  // n_h, d_h; H = n_h * d_h
  std::int64_t double_blocks = 2, single_blocks = 4;
  std::int64_t mlp_hidden = 3072;          // M (FLUX: 4H)
  std::int64_t latent_channels = 16, patch = 2;
  std::int64_t text_dim = 256, pooled_dim = 256;  // text token features, pooled text vector (qwen_image: 0)
  std::int64_t time_dim = 256;             // sinusoidal timestep features (FLUX: 256)
  // RoPE axes (FLUX.1: token index, image row, image column; FLUX.2: a fourth, the text index):
  // head-dim share of each, even, summing to d_h; FLUX's [16, 56, 56] for d_h = 128 is
  // flux_rope_axes(128). 1 to kMaxRopeAxes axes.
  std::vector<std::int64_t> rope_axes{4, 14, 14};
  double rope_theta = 10000, eps = 1e-6;   // eps of every LayerNorm and QK RMSNorm
  std::int64_t pos_embed_max = 0;  // sd3: the position table's side (pos_embed_max_size); 0 otherwise
  bool guidance_embed = false;  // FLUX.1-dev: guidance_in adds the embedded guidance scale to vec
  bool qkv_bias = true;         // the double blocks' qkv Linears have a bias (FLUX.1: yes)
  bool cross_attn_norm = true;  // wan: the cross-attention's LayerNorm has a weight and a bias (norm2)
  std::int64_t rope_max_positions = 0;  // wan: rope_max_seq_len, the bound of every RoPE axis's position; 0: none
  // Wan image-to-video (WanImageToVideoPipeline): C_cond, the input's channels after the latent's (the
  // 4 of the frame mask, then the encoded conditioning video's: 20 in Wan 2.1 I2V and Wan 2.2 I2V
  // A14B; 0 otherwise); image_dim, the CLIP features of the image context (Wan 2.1 I2V / FLF2V:
  // 1280; 0: no image context); image_pos_tokens, FLF2V's learned positions of the first and last
  // frames' image tokens (pos_embed_seq_len; 0: none).
  std::int64_t condition_channels = 0, image_dim = 0, image_pos_tokens = 0;

  std::int64_t hidden() const { return heads * head_dim; }            // H
  bool has_pooled() const { return family == DitFamily::flux1 || family == DitFamily::sd3; }  // vector_in
  // --guidance is classifier-free guidance's scale (two passes, the negative prompt's) rather than a
  // distilled guidance embedding.
  bool true_cfg() const { return family == DitFamily::qwen_image || family == DitFamily::sd3 || family == DitFamily::wan; }
  // Wan: the text enters through cross-attention, whole on every rank, not as tokens of the sequence.
  bool cross_attention() const { return family == DitFamily::wan; }
  bool cfg_keeps_norm() const { return family == DitFamily::qwen_image; }  // the guided velocity rescaled per token
  // Whether a negative prompt can run: the true-CFG families, and FLUX.1 with FluxPipeline's
  // true_cfg_scale > 1 (beside its distilled guidance; SampleOptions::true_cfg_scale).
  bool accepts_negative() const { return true_cfg() || family == DitFamily::flux1; }
  bool biases() const { return family != DitFamily::flux2; }          // every Linear but qkv (qkv_bias)
  bool swiglu() const { return family == DitFamily::flux2; }          // MLP input 2M: silu(gate) * up
  bool shared_modulation() const { return family == DitFamily::flux2; }
  std::int64_t mlp_in() const { return swiglu() ? 2 * mlp_hidden : mlp_hidden; }  // the MLP input Linear's outputs
  std::int64_t in_channels() const { return latent_channels * patch * patch; }  // C_in (Wan: temporal patch 1)
  // The patch embedding's input per token: the latent's C_in, then the condition's (Wan I2V: the
  // velocity stays C_in wide).
  std::int64_t embed_in_channels() const { return (latent_channels + condition_channels) * patch * patch; }
  // The latent file's layout is the image / video of latents (SD3, Wan), not FLUX's packed tokens.
  bool latent_image_layout() const { return family == DitFamily::sd3 || family == DitFamily::wan; }
  // Throws diffcp::Error naming the bad value.
  void validate() const;
  nlohmann::json to_json() const;
  // (flux1 only) FLUX's FluxParams (black-forest-labs/flux, model.py) with its field names: in_channels,
  // out_channels, vec_in_dim, context_in_dim, hidden_size, mlp_ratio, num_heads, depth,
  // depth_single_blocks, axes_dim, theta, qkv_bias, guidance_embed.
  nlohmann::json to_flux_params() const;
};

// A config from FluxParams fields (to_flux_params()); `source` names the file in errors. Every
// field is required except out_channels (= in_channels); unknown fields are refused by name.
// in_channels must be 4 x the latent channels (FLUX's 2x2 packing), out_channels = in_channels,
// mlp_hidden = int(hidden_size * mlp_ratio) as FLUX computes it, time_dim 256.
DitConfig dit_config_from_flux_params(const nlohmann::json& j, const std::string& source);
DitConfig read_dit_config(const std::string& path);  // a JSON file of FluxParams fields

// FLUX's split of the head dim over the RoPE axes scaled to d_h: [d_h - 2a, a, a], a = 2*floor(7*d_h/32).
std::vector<std::int64_t> flux_rope_axes(std::int64_t head_dim);
inline constexpr std::size_t kMaxRopeAxes = 4;

// "default": the config above (H 768, 24 heads x 32, 2 double + 4 single blocks, M 3072, ~79M
// parameters; 50 steps at 512^2 take ~15 s at P = 2 on 2 cores); "tiny": H 128, 8 heads x 16,
// 1 + 1 blocks, M 256, 4 latent channels (the tests).
DitConfig dit_preset(const std::string& name);
// The preset with the CLI's overrides (0 / -1: keep the preset's); a new head_dim takes FLUX's RoPE
// split of it (flux_rope_axes). Validated.
struct DitShapeOverrides {
  std::int64_t heads = 0, head_dim = 0, double_blocks = -1, single_blocks = -1, mlp_hidden = 0;
};
DitConfig dit_preset(const std::string& name, const DitShapeOverrides& o);

// One run's tokens. Every image of the batch shares the prompt and the timestep; only the noise
// differs. Image token n sits at grid (row, col) = (n / g_w, n % g_w), FLUX's img_ids (0, row, col).
struct DitShape {
  std::int64_t batch = 1;        // b
  std::int64_t width = 512, height = 512;  // image size in pixels; multiples of 16
  std::int64_t text_tokens = 64; // T (Wan: the context every rank holds, not in the sequence)
  std::int64_t frames = 1;       // F: latent frames (video families; 1 for an image)
  std::int64_t image_context = 0;  // I_ctx: Wan I2V's image context tokens (CLIP's; every rank all of them); 0: none

  std::int64_t grid_h() const { return height / 16; }                 // g_h
  std::int64_t grid_w() const { return width / 16; }                  // g_w
  std::int64_t image_tokens() const { return frames * grid_h() * grid_w(); }  // N_img: F g_h g_w (frame-major)
  std::int64_t tokens() const { return text_tokens + image_tokens(); }  // N (Wan's sequence: N_img alone)
  void validate() const;
};

// Rank p's tokens under sequence parallelism (SPEC B.1): the text tokens [p*T_p, (p+1)*T_p) and
// image tokens [p*I_p, (p+1)*I_p) of every image, T_p = ceil(T/P), I_p = ceil(N_img/P). When P does
// not divide a count the last ranks' rows run past it: those rows are padding (zero inputs, a
// velocity of 0, and no query sees them as keys: ExchangeLayout::valid), so any token count runs at
// any P and equals the P = 1 run to fp32 rounding. The same under USP (P = U x R, rank p = g U + u,
// dit/ring_attention.hpp): the tokens are sharded over all P ranks in rank order.
struct DitShard {
  int P = 1, p = 0;
  std::int64_t text_p = 0, image_p = 0;  // T_p, I_p: rows per rank and image (padding included)
  std::int64_t text = 0, image = 0;      // T, N_img: the real tokens per image (in the sequence)
  std::int64_t context = 0;              // Wan: the T text tokens every rank holds whole (cross-attention)
  std::int64_t tokens_p() const { return text_p + image_p; }  // n_p
  // Rank r's real rows per image: its first text_valid(r) text rows and image_valid(r) image rows.
  std::int64_t text_valid(int r) const { return valid(text, text_p, r); }
  std::int64_t image_valid(int r) const { return valid(image, image_p, r); }
  bool padded() const { return text_p * P != text || image_p * P != image; }

 private:
  static std::int64_t valid(std::int64_t n, std::int64_t n_p, int r) {
    const std::int64_t v = n - r * n_p;
    return v < 0 ? 0 : v > n_p ? n_p : v;
  }
};
// Throws diffcp::Error (the same on every rank, before any communication) unless the Ulysses degree
// U (0: U = P, plain Ulysses) divides P and the head count.
DitShard make_dit_shard(const DitConfig& cfg, const DitShape& shape, int P, int p, int ulysses = 0);


// A Linear layer's place in the parameters: W at `w` of the matrices stored [in, out] (y = x W),
// bias at `b` [out] of the vectors.
struct DitLinear {
  std::int64_t w = 0, b = 0, in = 0, out = 0;
  int unit = 0;         // its gather unit (DitLayout::units)
  std::int64_t at = 0;  // its weight's offset inside that unit's concatenation
};

// Offsets of every parameter in the model's two spaces, and the documented tensor names: the
// matrices (every Linear weight: stored in the weights' dtype, and sharded over ranks with
// --shard-weights, dit/weights.hpp) and the vectors (biases, norm scales, SD3's position table:
// f32 on every rank).
//
// Tensor names are FLUX's (black-forest-labs/flux state-dict names, the format of BFL's
// flux1-*.safetensors; diffusers renames them); in the file a Linear weight has PyTorch's shape
// [out, in] (it is transposed on load into the [in, out] memory layout and back on save). `i`
// counts blocks from 0; `s` is img or txt.
//   img_in.{weight [H, C_in], bias [H]}              txt_in.{weight [H, text_dim], bias [H]}
//   time_in.in_layer.{weight [H, time_dim], bias}    time_in.out_layer.{weight [H, H], bias}
//   guidance_in.in_layer.{weight [H, time_dim], bias} guidance_in.out_layer.{weight [H, H], bias}  (guidance_embed)
//   vector_in.in_layer.{weight [H, pooled_dim], bias} vector_in.out_layer.{weight [H, H], bias}  (flux1)
//   txt_norm.scale [text_dim]                       (qwen_image: RMSNorm of the text rows before txt_in)
//   double_blocks.i.s_mod.lin.{weight [6H, H], bias [6H]}       (shift1, scale1, gate1, shift2, scale2, gate2)
//   double_blocks.i.s_attn.qkv.{weight [3H, H], bias [3H]}      (rows: q heads, k heads, v heads; bias: qkv_bias)
//   double_blocks.i.s_attn.norm.query_norm.scale [d_h], ...key_norm.scale [d_h]
//   double_blocks.i.s_attn.proj.{weight [H, H], bias [H]}
//   double_blocks.i.s_mlp.0.{weight [M, H], bias [M]}   double_blocks.i.s_mlp.2.{weight [H, M], bias [H]}
//   single_blocks.i.modulation.lin.{weight [3H, H], bias [3H]}  (shift, scale, gate)
//   (sd3: img_in is pos_embed.proj (a stride-2 conv: [H, C, 2, 2] in the file), pos_embed [1,
//    pos_embed_max^2, H]; the last block's txt_mod.lin [2H, H] (shift, scale), no txt proj / mlp;
//    final_layer.linear's rows in (c, ph, pw) order (diffusers' proj_out: (ph, pw, c)))
//   (flux2: no per-block modulation and no biases; double_stream_modulation_{img,txt}.lin.weight [6H, H]
//    and single_stream_modulation.lin.weight [3H, H] shared by every block; mlp.0 [2M, H] and
//    linear1 [3H + 2M, H]: SwiGLU's gate then up)
//   single_blocks.i.linear1.{weight [3H + M, H], bias}          (q, k, v, then the MLP input)
//   single_blocks.i.linear2.{weight [H, H + M], bias [H]}       (input: attention output, then GELU(MLP))
//   single_blocks.i.norm.query_norm.scale [d_h], ...key_norm.scale [d_h]
//   final_layer.adaLN_modulation.1.{weight [2H, H], bias [2H]}  (shift, scale)
//   final_layer.linear.{weight [C_in, H], bias [C_in]}
//   (wan: diffusers' names, the self-attention's q / k / v fused as blocks.i.attn1.qkv and the
//    cross-attention's k / v as blocks.i.attn2.kv: patch_embedding [H, C, 1, 2, 2] in the file,
//    condition_embedder.{text_embedder.linear_1, text_embedder.linear_2, time_embedder.linear_1,
//    time_embedder.linear_2, time_proj [6H, H]}, blocks.i.{scale_shift_table [1, 6, H], attn1.qkv,
//    attn1.norm_q / norm_k [H], attn1.to_out.0, norm2 (cross_attn_norm), attn2.to_q, attn2.kv,
//    attn2.norm_q / norm_k [H], attn2.to_out.0, ffn.net.0.proj, ffn.net.2}, scale_shift_table
//    [1, 2, H], proj_out (rows in (c, ph, pw) order; diffusers': (pt, ph, pw, c)); I2V:
//    condition_embedder.image_embedder.{norm1, ff.net.0.proj, ff.net.2, norm2, pos_embed},
//    blocks.i.attn2.{add_kv (add_k_proj | add_v_proj), norm_added_k})
struct DitLayout {
  struct Tensor {
    std::string name;
    std::vector<std::int64_t> shape;  // in the file (a Linear weight: [out, in])
    std::int64_t offset = 0, size = 0;  // in the matrices (a Linear weight) or the vectors
    bool linear_weight = false;       // a matrix, stored transposed in memory: [in, out]
  };
  // The Linear weights used together, in the order the forward uses them: the unit of
  // --shard-weights' all-gather (dit/weights.hpp). units[0] holds the weights outside the blocks
  // (embedders, the final layer, FLUX.2's shared modulation; never sharded); then per double block
  // one unit for both streams' modulation and qkv, one per stream for proj and the MLP (none for
  // SD3's context-pre-only text stream); per single block one (modulation, linear1, linear2).
  struct Unit {
    std::vector<std::int64_t> w, n;  // its Linears' matrix offsets and element counts (in * out), in order
    std::int64_t size = 0;           // the sum of n: the weights stored concatenated
  };
  struct Stream {  // one stream (image or text) of a double-stream block
    DitLinear mod, qkv, proj, mlp0, mlp2;
    std::int64_t q_scale = 0, k_scale = 0;
    bool pre_only = false;  // SD3's last text stream: mod (shift, scale), q | k | v; no proj, no MLP
  };
  struct DoubleBlock {
    Stream img, txt;
  };
  struct SingleBlock {
    DitLinear mod, linear1, linear2;
    std::int64_t q_scale = 0, k_scale = 0;
  };
  // A Wan block (diffusers' WanTransformerBlock): table + time_proj -> (shift, scale, gate, c_shift,
  // c_scale, c_gate); self-attention (qkv, out; q / k RMSNorm across heads: scales [H]); the
  // cross-attention (norm2's weight / bias, -1 without cross_attn_norm; q of the tokens, k | v of the
  // context, out; scales [H]); the MLP (ffn0 H -> M, GELU-tanh, ffn2 M -> H).
  // I2V (image_dim > 0): image_kv (add_k_proj | add_v_proj) over the embedded image context and its
  // keys' RMSNorm scale [H] (norm_added_k); its attention's output added to the text's before out.
  struct WanBlock {
    std::int64_t table = 0;  // [6, H]
    DitLinear qkv, out, cross_q, cross_kv, cross_out, ffn0, ffn2, image_kv;
    std::int64_t q_scale = 0, k_scale = 0, cross_q_scale = 0, cross_k_scale = 0, image_k_scale = -1;
    std::int64_t norm2_w = -1, norm2_b = -1;
  };

  explicit DitLayout(const DitConfig& cfg);

  DitLinear img_in, txt_in, time_in0, time_in1, vector_in0, vector_in1, final_mod, final_linear;
  DitLinear guidance_in0, guidance_in1;  // allocated only when guidance_embed
  std::int64_t txt_norm = -1;            // qwen_image: [text_dim]; -1 otherwise
  std::int64_t pos_embed = -1;           // sd3: [pos_embed_max^2, H]; -1 otherwise
  // wan: txt_in and txt_in2 the text MLP (GELU-tanh between), time_proj [6H] of silu(time
  // embedding), final_table [2, H] (shift, scale) added to the time embedding; -1 / empty otherwise
  DitLinear txt_in2, time_proj;
  std::int64_t final_table = -1;
  // wan I2V: the image context's embedder (diffusers' WanImageEmbedding): LayerNorm (weight, bias
  // [image_dim]; eps 1e-5), image_in (image_dim -> image_dim), exact GELU, image_in2 (image_dim -> H),
  // LayerNorm (weight, bias [H]); FLF2V's position table [image_pos_tokens, image_dim] added first
  DitLinear image_in, image_in2;
  std::int64_t image_norm1_w = -1, image_norm1_b = -1, image_norm2_w = -1, image_norm2_b = -1, image_pos = -1;
  std::vector<DoubleBlock> double_blocks;
  std::vector<SingleBlock> single_blocks;
  std::vector<WanBlock> wan_blocks;  // wan: its blocks (cfg.single_blocks of them; the others none)
  std::vector<Tensor> tensors;  // every tensor of the file, in allocation order
  std::int64_t matrices = 0;    // elements of every Linear weight
  std::int64_t vectors = 0;     // elements of the rest (a qkv bias without qkv_bias: zeros, not in the file)
  std::int64_t total = 0;       // matrices + vectors
  std::int64_t parameters = 0;  // parameters in the file (the sum over `tensors`)
  std::vector<Unit> units;
  std::int64_t max_block_unit() const;  // the largest units[u].size, u >= 1 (0 without blocks)

 private:
  void add_unit(std::initializer_list<DitLinear*> linears);  // a new unit of these Linears
  void append(DitLinear* l);                                // l joins the last unit
  DitLinear linear(const std::string& name, std::int64_t in, std::int64_t out, bool bias_in_file = true);
  std::int64_t vector(const std::string& name, std::int64_t n);
  std::int64_t table(const std::string& name, std::vector<std::int64_t> shape);  // any shape, row-major
};

}  // namespace diffcp
