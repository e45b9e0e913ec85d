#include "diffcp/dit/config.hpp"

#include <nlohmann/json.hpp>

#include <cmath>

#include "diffcp/core/error.hpp"
#include "diffcp/core/json_file.hpp"
#include "diffcp/core/json_int.hpp"

namespace diffcp {

const char* dit_family_name(DitFamily f) {
  switch (f) {
    case DitFamily::flux1: return "flux1";
    case DitFamily::qwen_image: return "qwen_image";
    case DitFamily::flux2: return "flux2";
    case DitFamily::sd3: return "sd3";
    case DitFamily::wan: return "wan";
  }
  return "?";
}

void DitConfig::validate() const {
  // Bounds first, so nothing below (nor the layout's offsets) can overflow int64: every size at
  // most 2^24 and the parameter count under 2^40 (FLUX.1 has 1.2e10 = 2^33.5).
  for (const std::int64_t v : {heads, head_dim, double_blocks, single_blocks, mlp_hidden, latent_channels, patch, text_dim,
                               pooled_dim, time_dim, condition_channels, image_dim, image_pos_tokens})
    DIFFCP_CHECK(v <= (std::int64_t{1} << 24), "dit: a model size of ", v, " is beyond 2^24 (heads = ", heads,
                 ", head_dim = ", head_dim, ", blocks = ", double_blocks, " + ", single_blocks, ", mlp_hidden = ", mlp_hidden,
                 ", channels = ", latent_channels, " x ", patch, "^2, text_dim = ", text_dim, ", pooled_dim = ", pooled_dim, ")");
  {
    const double H = static_cast<double>(heads) * static_cast<double>(head_dim), M = static_cast<double>(mlp_hidden);
    const double params = static_cast<double>(double_blocks) * 2 * (10 * H * H + 2 * H * M) +
                          static_cast<double>(single_blocks) * (7 * H * H + 2 * H * M) +
                          H * static_cast<double>(embed_in_channels() + text_dim + pooled_dim + 2 * time_dim + 4 * H) +
                          static_cast<double>(image_dim) * static_cast<double>(image_dim + H + image_pos_tokens);
    DIFFCP_CHECK(params < std::ldexp(1.0, 40), "dit: the model would have ~", params, " parameters (hidden ", H,
                 ", mlp ", M, ", ", double_blocks, " + ", single_blocks, " blocks), beyond 2^40");
  }
  DIFFCP_CHECK(heads >= 1 && head_dim >= 2 && head_dim % 2 == 0, "dit: heads = ", heads, ", head_dim = ", head_dim,
               "; expected heads >= 1 and an even head_dim >= 2 (RoPE rotates pairs)");
  DIFFCP_CHECK(double_blocks >= 0 && single_blocks >= 0 && double_blocks + single_blocks >= 1,
               "dit: double_blocks = ", double_blocks, ", single_blocks = ", single_blocks,
               "; expected >= 0 each and at least one block");
  DIFFCP_CHECK(mlp_hidden >= 1 && latent_channels >= 1 && patch >= 1 && text_dim >= 1 && (pooled_dim >= 1) == has_pooled(),
               "dit: mlp_hidden = ", mlp_hidden, ", latent_channels = ", latent_channels, ", patch = ", patch,
               ", text_dim = ", text_dim, ", pooled_dim = ", pooled_dim, "; expected all >= 1 (pooled_dim: 0 for ",
               dit_family_name(family), has_pooled() ? ", which has a pooled vector)" : ", which has none)");
  DIFFCP_CHECK((family != DitFamily::qwen_image && family != DitFamily::sd3) || (single_blocks == 0 && !guidance_embed),
               "dit: ", dit_family_name(family),
               " has double-stream blocks only and no guidance embedding (single_blocks = ", single_blocks,
               ", guidance_embed = ", guidance_embed, ")");
  DIFFCP_CHECK(family != DitFamily::wan || (double_blocks == 0 && single_blocks >= 1 && !guidance_embed &&
                                            rope_axes.size() == 3),
               "dit: wan has its own blocks only (single_blocks = ", single_blocks, ", double_blocks = ", double_blocks,
               "), no guidance embedding and three RoPE axes (frame, row, column; ", rope_axes.size(), " given)");
  DIFFCP_CHECK((condition_channels == 0 && image_dim == 0 && image_pos_tokens == 0) ||
                   (family == DitFamily::wan && condition_channels >= 0 && image_dim >= 0 && image_pos_tokens >= 0 &&
                    (image_pos_tokens == 0 || image_dim > 0)),
               "dit: condition_channels = ", condition_channels, ", image_dim = ", image_dim, ", image_pos_tokens = ",
               image_pos_tokens, "; expected 0 each but in Wan's image-to-video models (", dit_family_name(family),
               " given), >= 0, and image positions only with an image context");
  DIFFCP_CHECK(time_dim >= 2 && time_dim % 2 == 0, "dit: time_dim = ", time_dim, ", expected even and >= 2 (cos, sin halves)");
  DIFFCP_CHECK((family == DitFamily::sd3) == rope_axes.empty() && rope_axes.size() <= kMaxRopeAxes, "dit: ",
               rope_axes.size(), " RoPE axes, expected ", family == DitFamily::sd3 ? "none (SD3 has no RoPE)" : "1 to 4");
  DIFFCP_CHECK((family == DitFamily::sd3) == (pos_embed_max >= 1) && pos_embed_max <= 4096, "dit: pos_embed_max = ",
               pos_embed_max, ", expected ", family == DitFamily::sd3 ? "1 to 4096 (SD3's position table)" : "0");
  std::int64_t sum = 0;
  for (const std::int64_t a : rope_axes) {
    DIFFCP_CHECK(a >= 0 && a % 2 == 0, "dit: rope axis dim ", a, " is not even and >= 0");
    sum += a;
  }
  DIFFCP_CHECK(rope_axes.empty() || sum == head_dim, "dit: rope axes ", nlohmann::json(rope_axes).dump(), " sum to ", sum,
               ", expected head_dim = ", head_dim);
  DIFFCP_CHECK(rope_theta > 1 && eps > 0, "dit: rope_theta = ", rope_theta, ", eps = ", eps,
               "; expected rope_theta > 1 and eps > 0");
}

nlohmann::json DitConfig::to_json() const {
  nlohmann::json j = {{"family", dit_family_name(family)}, {"pos_embed_max", pos_embed_max}, {"hidden", hidden()}, {"heads", heads}, {"head_dim", head_dim}, {"double_blocks", double_blocks},
          {"single_blocks", single_blocks}, {"mlp_hidden", mlp_hidden}, {"latent_channels", latent_channels},
          {"patch", patch}, {"text_dim", text_dim}, {"pooled_dim", pooled_dim}, {"time_dim", time_dim},
          {"rope_axes", rope_axes}, {"rope_theta", rope_theta}, {"eps", eps}, {"guidance_embed", guidance_embed},
          {"qkv_bias", qkv_bias}, {"cross_attn_norm", cross_attn_norm}};
  if (condition_channels > 0 || image_dim > 0)  // Wan I2V
    j.update({{"condition_channels", condition_channels}, {"image_dim", image_dim}, {"image_pos_tokens", image_pos_tokens}});
  return j;
}

nlohmann::json DitConfig::to_flux_params() const {
  DIFFCP_CHECK(family == DitFamily::flux1, "dit: a ", dit_family_name(family), " model has no FluxParams");
  return {{"in_channels", in_channels()}, {"out_channels", in_channels()}, {"vec_in_dim", pooled_dim},
          {"context_in_dim", text_dim}, {"hidden_size", hidden()},
          {"mlp_ratio", static_cast<double>(mlp_hidden) / static_cast<double>(hidden())}, {"num_heads", heads},
          {"depth", double_blocks}, {"depth_single_blocks", single_blocks}, {"axes_dim", rope_axes},
          {"theta", rope_theta}, {"qkv_bias", qkv_bias}, {"guidance_embed", guidance_embed}};
}

DitConfig dit_config_from_flux_params(const nlohmann::json& j, const std::string& source) {
  DIFFCP_CHECK(j.is_object(), "config '", source, "': expected a JSON object of FluxParams fields");
  static const char* const kFields[] = {"in_channels", "out_channels", "vec_in_dim", "context_in_dim", "hidden_size",
                                        "mlp_ratio", "num_heads", "depth", "depth_single_blocks", "axes_dim", "theta",
                                        "qkv_bias", "guidance_embed"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool known = false;
    for (const char* f : kFields) known = known || it.key() == f;
    DIFFCP_CHECK(known, "config '", source, "': unknown field '", it.key(),
                 "'; expected FLUX's FluxParams fields (in_channels, out_channels, vec_in_dim, context_in_dim, hidden_size,"
                 " mlp_ratio, num_heads, depth, depth_single_blocks, axes_dim, theta, qkv_bias, guidance_embed)",
                 it.key() == "num_layers" || it.key() == "joint_attention_dim" || it.key() == "_class_name"
                     ? "; this looks like a diffusers config.json: give its folder (config.json beside the "
                       "diffusion_pytorch_model safetensors, or the pipeline's folder) as `weights` instead"
                     : "");
  }
  const auto integer = [&](const char* f) {
    DIFFCP_CHECK(j.contains(f), "config '", source, "': missing field '", f, "'");
    const auto v = json_int64(j[f]);
    DIFFCP_CHECK(v.has_value() && *v >= 0, "config '", source, "': field '", f, "' = ", j[f].dump(),
                 ", expected a non-negative integer");
    return *v;
  };
  const auto boolean = [&](const char* f) {
    DIFFCP_CHECK(j.contains(f) && j[f].is_boolean(), "config '", source, "': field '", f, "' ",
                 j.contains(f) ? "= " + j[f].dump() + ", expected true or false" : std::string("is missing"));
    return j[f].get<bool>();
  };
  const auto number = [&](const char* f) {
    DIFFCP_CHECK(j.contains(f) && j[f].is_number(), "config '", source, "': field '", f, "' ",
                 j.contains(f) ? "= " + j[f].dump() + ", expected a number" : std::string("is missing"));
    return j[f].get<double>();
  };
  DitConfig c;
  const std::int64_t in = integer("in_channels"), hidden = integer("hidden_size"), heads = integer("num_heads");
  const std::int64_t out = j.contains("out_channels") ? integer("out_channels") : in;
  DIFFCP_CHECK(in >= 4 && in % 4 == 0, "config '", source, "': in_channels = ", in,
               ", expected a positive multiple of 4 (latent channels x FLUX's 2x2 patch)");
  DIFFCP_CHECK(out == in, "config '", source, "': out_channels = ", out, " != in_channels = ", in,
               "; the Euler sampler needs the velocity in the latent's shape (FLUX.1 Fill / Kontext-style inputs "
               "are not supported)");
  DIFFCP_CHECK(heads >= 1 && hidden >= 1 && hidden % heads == 0, "config '", source, "': hidden_size = ", hidden,
               " is not a multiple of num_heads = ", heads);
  const double ratio = number("mlp_ratio");
  DIFFCP_CHECK(std::isfinite(ratio) && ratio > 0 && ratio * static_cast<double>(hidden) < 1e12, "config '", source,
               "': mlp_ratio = ", ratio, ", expected a positive number");
  DIFFCP_CHECK(j.contains("axes_dim") && j["axes_dim"].is_array() && j["axes_dim"].size() == 3, "config '", source,
               "': field 'axes_dim' must be an array of 3 integers (token, row, column shares of the head dim)");
  c.rope_axes.clear();
  for (std::size_t a = 0; a < 3; ++a) {
    const auto v = json_int64(j["axes_dim"][a]);
    DIFFCP_CHECK(v.has_value() && *v >= 0, "config '", source, "': axes_dim[", a, "] = ", j["axes_dim"][a].dump(),
                 ", expected a non-negative integer");
    c.rope_axes.push_back(*v);
  }
  c.latent_channels = in / 4;
  c.patch = 2;
  c.heads = heads;
  c.head_dim = hidden / heads;
  c.mlp_hidden = static_cast<std::int64_t>(static_cast<double>(hidden) * ratio);  // Python's int(): truncation
  c.double_blocks = integer("depth");
  c.single_blocks = integer("depth_single_blocks");
  c.text_dim = integer("context_in_dim");
  c.pooled_dim = integer("vec_in_dim");
  c.time_dim = 256;
  c.rope_theta = number("theta");
  c.qkv_bias = boolean("qkv_bias");
  c.guidance_embed = boolean("guidance_embed");
  try {
    c.validate();
  } catch (const Error& e) {
    DIFFCP_FAIL("config '", source, "': ", e.what());
  }
  return c;
}

DitConfig read_dit_config(const std::string& path) {
  return dit_config_from_flux_params(read_json_file(path, "config"), path);
}

std::vector<std::int64_t> flux_rope_axes(std::int64_t head_dim) {
  const std::int64_t a = 2 * (7 * head_dim / 32);
  return {head_dim - 2 * a, a, a};
}

DitConfig dit_preset(const std::string& name) {
  DitConfig c;
  if (name == "default") return c;
  if (name == "tiny") {
    c.heads = 8;
    c.head_dim = 16;
    c.double_blocks = 1;
    c.single_blocks = 1;
    c.mlp_hidden = 256;
    c.latent_channels = 4;
    c.text_dim = 32;
    c.pooled_dim = 32;
    c.time_dim = 64;
    c.rope_axes = flux_rope_axes(c.head_dim);
    return c;
  }
  DIFFCP_FAIL("dit: unknown preset '", name, "', expected default or tiny");
}

DitConfig dit_preset(const std::string& name, const DitShapeOverrides& o) {
  DitConfig c = dit_preset(name);
  if (o.heads > 0) c.heads = o.heads;
  if (o.head_dim > 0) {
    c.head_dim = o.head_dim;
    c.rope_axes = flux_rope_axes(o.head_dim);
  }
  if (o.double_blocks >= 0) c.double_blocks = o.double_blocks;
  if (o.single_blocks >= 0) c.single_blocks = o.single_blocks;
  if (o.mlp_hidden > 0) c.mlp_hidden = o.mlp_hidden;
  c.validate();
  return c;
}

void DitShape::validate() const {
  DIFFCP_CHECK(batch >= 1, "dit: batch = ", batch, ", expected >= 1");
  DIFFCP_CHECK(width >= 16 && width % 16 == 0 && height >= 16 && height % 16 == 0 && width <= 65536 && height <= 65536,
               "dit: image ", width, "x", height,
               " pixels, expected positive multiples of 16 (8x VAE downsampling, then 2x2 patches), at most 65536");
  DIFFCP_CHECK(batch <= 65536 && text_tokens <= (std::int64_t{1} << 20), "dit: batch = ", batch, ", text_tokens = ",
               text_tokens, "; expected at most 65536 and 2^20");
  DIFFCP_CHECK(text_tokens >= 0, "dit: text_tokens = ", text_tokens, ", expected >= 0");
  DIFFCP_CHECK(image_context >= 0 && image_context <= (std::int64_t{1} << 20), "dit: image_context = ", image_context,
               " tokens, expected 0 to 2^20");
  DIFFCP_CHECK(frames >= 1 && frames <= 65536, "dit: frames = ", frames, ", expected 1 to 65536 latent frames");
  DIFFCP_CHECK(static_cast<double>(batch) * static_cast<double>(frames) * static_cast<double>(width / 16) *
                       static_cast<double>(height / 16) <= std::ldexp(1.0, 31),
               "dit: ", batch, " x ", frames, " frames of ", width / 16, " x ", height / 16, " tokens, beyond 2^31 tokens in a batch");
}

DitShard make_dit_shard(const DitConfig& cfg, const DitShape& shape, int P, int p, int ulysses) {
  cfg.validate();
  shape.validate();
  DIFFCP_CHECK(P >= 1 && p >= 0 && p < P, "dit: rank ", p, " of ", P, " is not a valid rank");
  const int U = ulysses == 0 ? P : ulysses;
  DIFFCP_CHECK(U >= 1 && P % U == 0, "dit: Ulysses degree U = ", U, " does not divide P = ", P, " ranks");
  if (U == P) {
    DIFFCP_CHECK(cfg.heads % P == 0, "dit: P = ", P, " ranks do not divide the ", cfg.heads,
                 " attention heads (Ulysses shards heads: P must divide the head count, or give the rest of the"
                 " ranks to a Ring: `ulysses_degree` U `ring_degree` R, U x R = P)");
  } else {
    DIFFCP_CHECK(cfg.heads % U == 0, "dit: Ulysses degree U = ", U, " does not divide the ", cfg.heads,
                 " attention heads (Ulysses shards heads; P = ", P, " = U x R with R = ", P / U, ")");
  }
  const std::int64_t mx = cfg.pos_embed_max;
  DIFFCP_CHECK(cfg.family != DitFamily::sd3 || (shape.grid_h() <= mx && shape.grid_w() <= mx), "dit: a ", shape.width,
               "x", shape.height, " image is ", shape.grid_w(), " x ", shape.grid_h(), " tokens, beyond SD3's position table of ",
               mx, " x ", mx, " (pos_embed_max_size; at most ", 16 * mx, " pixels a side)");
  DIFFCP_CHECK(shape.frames == 1 || cfg.family == DitFamily::wan, "dit: ", shape.frames, " latent frames, but ",
               dit_family_name(cfg.family), " is an image model (one frame; the video family: wan)");
  DIFFCP_CHECK(!cfg.cross_attention() || shape.text_tokens >= 1, "dit: wan's cross-attention needs at least one text token");
  const std::int64_t rmax = cfg.rope_max_positions;
  DIFFCP_CHECK(rmax == 0 || (shape.frames <= rmax && shape.grid_h() <= rmax && shape.grid_w() <= rmax), "dit: ",
               shape.frames, " latent frames of ", shape.grid_h(), " x ", shape.grid_w(), " tokens, beyond the model's RoPE table of ",
               rmax, " positions an axis (rope_max_seq_len)");
  const auto ceil_div = [P](std::int64_t n) { return (n + P - 1) / P; };
  DitShard s;
  s.P = P;
  s.p = p;
  s.context = cfg.cross_attention() ? shape.text_tokens : 0;
  s.text = cfg.cross_attention() ? 0 : shape.text_tokens;
  s.image = shape.image_tokens();
  s.text_p = ceil_div(s.text);
  s.image_p = ceil_div(s.image);
  return s;
}


DitLinear DitLayout::linear(const std::string& name, std::int64_t in, std::int64_t out, bool bias_in_file) {
  DitLinear l{matrices, 0, in, out};
  tensors.push_back({name + ".weight", {out, in}, matrices, in * out, true});
  matrices += in * out;
  parameters += in * out;
  if (bias_in_file) {
    l.b = vector(name + ".bias", out);
  } else {  // zeros, so every Linear has a bias to add
    l.b = vectors;
    vectors += out;
  }
  return l;
}

void DitLayout::add_unit(std::initializer_list<DitLinear*> linears) {
  units.emplace_back();
  for (DitLinear* l : linears) append(l);
}

void DitLayout::append(DitLinear* l) {
  Unit& u = units.back();
  l->unit = static_cast<int>(units.size()) - 1;
  l->at = u.size;
  u.w.push_back(l->w);
  u.n.push_back(l->in * l->out);
  u.size += l->in * l->out;
}

std::int64_t DitLayout::max_block_unit() const {
  std::int64_t m = 0;
  for (std::size_t u = 1; u < units.size(); ++u) m = std::max(m, units[u].size);
  return m;
}


std::int64_t DitLayout::table(const std::string& name, std::vector<std::int64_t> shape) {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) n *= d;
  tensors.push_back({name, std::move(shape), vectors, n, false});
  vectors += n;
  parameters += n;
  return vectors - n;
}

std::int64_t DitLayout::vector(const std::string& name, std::int64_t n) {
  tensors.push_back({name, {n}, vectors, n, false});
  vectors += n;
  parameters += n;
  return vectors - n;
}

DitLayout::DitLayout(const DitConfig& c) {
  c.validate();
  const std::int64_t H = c.hidden(), M = c.mlp_hidden, d = c.head_dim;
  if (c.family == DitFamily::wan) {  // diffusers' WanTransformer3DModel, in its order
    img_in = linear("patch_embedding", c.embed_in_channels(), H);
    txt_in = linear("condition_embedder.text_embedder.linear_1", c.text_dim, H);
    txt_in2 = linear("condition_embedder.text_embedder.linear_2", H, H);
    time_in0 = linear("condition_embedder.time_embedder.linear_1", c.time_dim, H);
    time_in1 = linear("condition_embedder.time_embedder.linear_2", H, H);
    time_proj = linear("condition_embedder.time_proj", H, 6 * H);
    if (c.image_dim > 0) {  // I2V: WanImageEmbedding
      const std::string pre = "condition_embedder.image_embedder.";
      image_norm1_w = vector(pre + "norm1.weight", c.image_dim);
      image_norm1_b = vector(pre + "norm1.bias", c.image_dim);
      image_in = linear(pre + "ff.net.0.proj", c.image_dim, c.image_dim);
      image_in2 = linear(pre + "ff.net.2", c.image_dim, H);
      image_norm2_w = vector(pre + "norm2.weight", H);
      image_norm2_b = vector(pre + "norm2.bias", H);
      if (c.image_pos_tokens > 0) image_pos = table(pre + "pos_embed", {1, c.image_pos_tokens, c.image_dim});
    }
    for (std::int64_t i = 0; i < c.single_blocks; ++i) {
      const std::string pre = "blocks." + std::to_string(i) + ".";
      WanBlock blk;
      blk.table = table(pre + "scale_shift_table", {1, 6, H});
      blk.qkv = linear(pre + "attn1.qkv", H, 3 * H);
      blk.q_scale = vector(pre + "attn1.norm_q.weight", H);
      blk.k_scale = vector(pre + "attn1.norm_k.weight", H);
      blk.out = linear(pre + "attn1.to_out.0", H, H);
      if (c.cross_attn_norm) {
        blk.norm2_w = vector(pre + "norm2.weight", H);
        blk.norm2_b = vector(pre + "norm2.bias", H);
      }
      blk.cross_q = linear(pre + "attn2.to_q", H, H);
      blk.cross_kv = linear(pre + "attn2.kv", H, 2 * H);
      blk.cross_q_scale = vector(pre + "attn2.norm_q.weight", H);
      blk.cross_k_scale = vector(pre + "attn2.norm_k.weight", H);
      if (c.image_dim > 0) {
        blk.image_kv = linear(pre + "attn2.add_kv", H, 2 * H);
        blk.image_k_scale = vector(pre + "attn2.norm_added_k.weight", H);
      }
      blk.cross_out = linear(pre + "attn2.to_out.0", H, H);
      blk.ffn0 = linear(pre + "ffn.net.0.proj", H, M);
      blk.ffn2 = linear(pre + "ffn.net.2", M, H);
      wan_blocks.push_back(blk);
    }
    final_table = table("scale_shift_table", {1, 2, H});
    final_linear = linear("proj_out", H, c.in_channels());
    total = matrices + vectors;
    add_unit({&img_in, &txt_in, &txt_in2, &time_in0, &time_in1, &time_proj, &final_linear});
    if (c.image_dim > 0) {
      append(&image_in);
      append(&image_in2);
    }
    for (WanBlock& blk : wan_blocks) {
      add_unit({&blk.qkv, &blk.out, &blk.cross_q, &blk.cross_kv, &blk.cross_out});
      if (c.image_dim > 0) append(&blk.image_kv);
      add_unit({&blk.ffn0, &blk.ffn2});
    }
    return;
  }
  const bool b = c.biases();
  img_in = linear("img_in", c.in_channels(), H, b);
  if (c.family == DitFamily::sd3) pos_embed = table("pos_embed", {1, c.pos_embed_max * c.pos_embed_max, H});
  time_in0 = linear("time_in.in_layer", c.time_dim, H, b);
  time_in1 = linear("time_in.out_layer", H, H, b);
  if (c.guidance_embed) {
    guidance_in0 = linear("guidance_in.in_layer", c.time_dim, H, b);
    guidance_in1 = linear("guidance_in.out_layer", H, H, b);
  }
  if (c.has_pooled()) {
    vector_in0 = linear("vector_in.in_layer", c.pooled_dim, H);
    vector_in1 = linear("vector_in.out_layer", H, H);
  }
  if (c.family == DitFamily::qwen_image) txt_norm = vector("txt_norm.scale", c.text_dim);
  txt_in = linear("txt_in", c.text_dim, H, b);
  // FLUX.2: one modulation per stream kind, shared by every block (each block's `mod` is it).
  DitLinear shared_img, shared_txt, shared_single;
  if (c.shared_modulation()) {
    shared_img = linear("double_stream_modulation_img.lin", H, 6 * H, b);
    shared_txt = linear("double_stream_modulation_txt.lin", H, 6 * H, b);
    shared_single = linear("single_stream_modulation.lin", H, 3 * H, b);
  }
  for (std::int64_t i = 0; i < c.double_blocks; ++i) {
    const std::string pre = "double_blocks." + std::to_string(i) + ".";
    DoubleBlock blk;
    for (const char* s : {"img", "txt"}) {
      Stream& st = std::string(s) == "img" ? blk.img : blk.txt;
      const std::string sp = pre + s;
      // SD3: the last block's text stream only feeds the joint attention.
      st.pre_only = c.family == DitFamily::sd3 && &st == &blk.txt && i == c.double_blocks - 1;
      st.mod = c.shared_modulation() ? (&st == &blk.img ? shared_img : shared_txt)
                                     : linear(sp + "_mod.lin", H, (st.pre_only ? 2 : 6) * H, b);
      st.qkv = linear(sp + "_attn.qkv", H, 3 * H, c.qkv_bias && b);
      st.q_scale = vector(sp + "_attn.norm.query_norm.scale", d);
      st.k_scale = vector(sp + "_attn.norm.key_norm.scale", d);
      if (st.pre_only) continue;
      st.proj = linear(sp + "_attn.proj", H, H, b);
      st.mlp0 = linear(sp + "_mlp.0", H, c.mlp_in(), b);
      st.mlp2 = linear(sp + "_mlp.2", M, H, b);
    }
    double_blocks.push_back(blk);
  }
  for (std::int64_t i = 0; i < c.single_blocks; ++i) {
    const std::string pre = "single_blocks." + std::to_string(i) + ".";
    SingleBlock blk;
    blk.linear1 = linear(pre + "linear1", H, 3 * H + c.mlp_in(), b);
    blk.linear2 = linear(pre + "linear2", H + M, H, b);
    blk.q_scale = vector(pre + "norm.query_norm.scale", d);
    blk.k_scale = vector(pre + "norm.key_norm.scale", d);
    blk.mod = c.shared_modulation() ? shared_single : linear(pre + "modulation.lin", H, 3 * H, b);
    single_blocks.push_back(blk);
  }
  final_mod = linear("final_layer.adaLN_modulation.1", H, 2 * H, b);
  final_linear = linear("final_layer.linear", H, c.in_channels(), b);
  total = matrices + vectors;

  // The gather units (in the forward's order of use; DitModel::double_block, single_block).
  add_unit({&img_in, &time_in0, &time_in1, &txt_in, &final_mod, &final_linear});
  for (DitLinear* l : {&guidance_in0, &guidance_in1, &vector_in0, &vector_in1})
    if (l->in > 0) append(l);
  if (c.shared_modulation())  // used by every block, so outside them
    for (DitLinear* l : {&shared_img, &shared_txt, &shared_single}) append(l);
  for (DoubleBlock& blk : double_blocks) {
    if (c.shared_modulation()) {
      blk.txt.mod = shared_txt;  // the copies made above predate the shared Linears' unit places
      blk.img.mod = shared_img;
      add_unit({&blk.txt.qkv, &blk.img.qkv});
    } else {
      add_unit({&blk.txt.mod, &blk.txt.qkv, &blk.img.mod, &blk.img.qkv});
    }
    if (!blk.txt.pre_only) add_unit({&blk.txt.proj, &blk.txt.mlp0, &blk.txt.mlp2});
    add_unit({&blk.img.proj, &blk.img.mlp0, &blk.img.mlp2});
  }
  for (SingleBlock& blk : single_blocks) {
    if (c.shared_modulation()) {
      blk.mod = shared_single;
      add_unit({&blk.linear1, &blk.linear2});
    } else {
      add_unit({&blk.mod, &blk.linear1, &blk.linear2});
    }
  }
}

}  // namespace diffcp
