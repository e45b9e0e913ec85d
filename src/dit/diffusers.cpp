#include "diffcp/dit/diffusers.hpp"

#include <cmath>
#include <filesystem>
#include <string_view>

#include <nlohmann/json.hpp>

#include "diffcp/core/error.hpp"
#include "diffcp/core/json_file.hpp"
#include "diffcp/core/json_int.hpp"

namespace diffcp {

namespace {

namespace fs = std::filesystem;

// diffusers' names of BFL's Linears and norm scales, by the BFL name without ".weight" / ".bias" /
// ".scale": each BFL tensor is the concatenation of these diffusers tensors' rows; empty = not mapped.
// FluxTransformer2DModel's names; QwenImageTransformer2DModel renames the embedders, the double
// blocks' modulation and MLPs, and adds txt_norm.
std::vector<std::string> diffusers_names(std::string_view base, DitFamily family) {
  if (family == DitFamily::wan) {  // diffusers' own names; the fused attention Linears split
    const std::string b(base);
    if (b.ends_with(".attn1.qkv")) {
      const std::string a = b.substr(0, b.size() - 3);
      return {a + "to_q", a + "to_k", a + "to_v"};
    }
    if (b.ends_with(".attn2.kv")) {
      const std::string a = b.substr(0, b.size() - 2);
      return {a + "to_k", a + "to_v"};
    }
    if (b.ends_with(".attn2.add_kv")) {  // I2V: the image context's keys and values
      const std::string a = b.substr(0, b.size() - 6);
      return {a + "add_k_proj", a + "add_v_proj"};
    }
    return {b};
  }
  const bool qwen = family == DitFamily::qwen_image, flux2 = family == DitFamily::flux2;
  if (qwen && (base == "img_in" || base == "txt_in" || base == "txt_norm")) return {std::string(base)};
  if (family == DitFamily::sd3 && base == "img_in") return {"pos_embed.proj"};
  if (flux2) {  // Flux2Transformer2DModel: the time / guidance embedders and the shared modulations
    static const std::pair<const char*, const char*> kFlux2[] = {
        {"time_in.in_layer", "time_guidance_embed.timestep_embedder.linear_1"},
        {"time_in.out_layer", "time_guidance_embed.timestep_embedder.linear_2"},
        {"guidance_in.in_layer", "time_guidance_embed.guidance_embedder.linear_1"},
        {"guidance_in.out_layer", "time_guidance_embed.guidance_embedder.linear_2"},
        {"double_stream_modulation_img.lin", "double_stream_modulation_img.linear"},
        {"double_stream_modulation_txt.lin", "double_stream_modulation_txt.linear"},
        {"single_stream_modulation.lin", "single_stream_modulation.linear"},
    };
    for (const auto& [bfl, dif] : kFlux2)
      if (base == bfl) return {dif};
  }
  constexpr std::string_view kDouble = "double_blocks.", kSingle = "single_blocks.";
  static const std::pair<const char*, const char*> kTop[] = {
      {"img_in", "x_embedder"},
      {"txt_in", "context_embedder"},
      {"time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"},
      {"time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"},
      {"guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"},
      {"guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2"},
      {"vector_in.in_layer", "time_text_embed.text_embedder.linear_1"},
      {"vector_in.out_layer", "time_text_embed.text_embedder.linear_2"},
      {"final_layer.adaLN_modulation.1", "norm_out.linear"},
      {"final_layer.linear", "proj_out"},
  };
  for (const auto& [bfl, dif] : kTop)
    if (base == bfl) return {dif};
  if (base.starts_with(kDouble)) {
    const std::size_t dot = base.find('.', kDouble.size());
    const std::string i = std::string(base.substr(kDouble.size(), dot - kDouble.size())), rest = std::string(base.substr(dot + 1));
    const std::string b = "transformer_blocks." + i + ".";
    const bool img = rest.starts_with("img_");
    const std::string s = rest.substr(4);  // after "img_" / "txt_"
    const auto a = [&](const char* img_name, const char* txt_name) { return b + (img ? img_name : txt_name); };
    if (s == "mod.lin") return {qwen ? a("img_mod.1", "txt_mod.1") : a("norm1.linear", "norm1_context.linear")};
    if (s == "attn.qkv")
      return {a("attn.to_q", "attn.add_q_proj"), a("attn.to_k", "attn.add_k_proj"), a("attn.to_v", "attn.add_v_proj")};
    if (s == "attn.norm.query_norm") return {a("attn.norm_q", "attn.norm_added_q")};
    if (s == "attn.norm.key_norm") return {a("attn.norm_k", "attn.norm_added_k")};
    if (s == "attn.proj") return {a("attn.to_out.0", "attn.to_add_out")};
    if (s == "mlp.0")
      return {qwen ? a("img_mlp.net.0.proj", "txt_mlp.net.0.proj") : flux2 ? a("ff.linear_in", "ff_context.linear_in") : a("ff.net.0.proj", "ff_context.net.0.proj")};
    if (s == "mlp.2")
      return {qwen ? a("img_mlp.net.2", "txt_mlp.net.2") : flux2 ? a("ff.linear_out", "ff_context.linear_out") : a("ff.net.2", "ff_context.net.2")};
  } else if (base.starts_with(kSingle)) {
    const std::size_t dot = base.find('.', kSingle.size());
    const std::string b = "single_transformer_blocks." + std::string(base.substr(kSingle.size(), dot - kSingle.size())) + ".";
    const std::string rest = std::string(base.substr(dot + 1));
    if (rest == "modulation.lin") return {b + "norm.linear"};
    if (rest == "linear1") {
      if (flux2) return {b + "attn.to_qkv_mlp_proj"};  // fused as BFL's linear1
      return {b + "attn.to_q", b + "attn.to_k", b + "attn.to_v", b + "proj_mlp"};
    }
    if (rest == "linear2") return {flux2 ? b + "attn.to_out" : b + "proj_out"};
    if (rest == "norm.query_norm") return {b + "attn.norm_q"};
    if (rest == "norm.key_norm") return {b + "attn.norm_k"};
  }
  return {};
}

// A diffusers config's `_class_name` ("" when absent or not a string).
std::string class_name(const nlohmann::json& j) {
  return j.contains("_class_name") && j["_class_name"].is_string() ? j["_class_name"].get<std::string>() : "";
}

}  // namespace

std::vector<DitFilePart> dit_file_parts(const DitLayout::Tensor& t, const DitConfig& cfg, DitFileFormat format) {
  const std::int64_t rows = t.shape[0];
  if (format == DitFileFormat::bfl) return {{t.name, t.shape, 0, rows}};
  if (t.name == "pos_embed") return {{"pos_embed.pos_embed", t.shape, 0, rows}};  // SD3's position table
  const std::size_t dot = t.name.rfind('.');
  if (dot == std::string::npos) return {{t.name, t.shape, 0, rows}};  // Wan's top-level scale_shift_table
  const std::string base = t.name.substr(0, dot), suffix = t.name.substr(dot + 1);
  const std::vector<std::string> names = diffusers_names(base, cfg.family);
  DIFFCP_CHECK(!names.empty(), "dit_file_parts: no diffusers name for '", t.name, "'");
  // QK-norm scales: BFL's RMSNorm.scale is diffusers' RMSNorm.weight.
  const std::string file_suffix = suffix == "scale" ? "weight" : suffix;
  const auto shape_of = [&](std::int64_t r) {
    std::vector<std::int64_t> s = t.shape;
    s[0] = r;
    return s;
  };
  const std::int64_t H = cfg.hidden();
  // diffusers: (scale, shift); BFL: (shift, scale). The final layer's, and SD3's context-pre-only
  // text modulation (AdaLayerNormContinuous) alike.
  if (base == "final_layer.adaLN_modulation.1" || (base.ends_with("txt_mod.lin") && rows == 2 * H)) {
    const std::string n = names[0] + "." + file_suffix;
    return {{n, t.shape, H, H}, {n, t.shape, 0, H}};
  }
  const bool sd3 = cfg.family == DitFamily::sd3, wan = cfg.family == DitFamily::wan;
  if (suffix == "weight" && ((sd3 && base == "img_in") || (wan && base == "patch_embedding"))) {
    // a stride-p conv: [H, C, p, p] (Wan's 3-D one: [H, C, 1, p, p])
    std::vector<std::int64_t> conv{H, cfg.latent_channels + cfg.condition_channels, cfg.patch, cfg.patch};
    if (wan) conv.insert(conv.begin() + 2, 1);
    return {{names[0] + ".weight", conv, 0, rows}};
  }
  if ((sd3 && base == "final_layer.linear") || (wan && base == "proj_out")) {
    // proj_out's rows are (ph, pw, c) (diffusers' unpatchify; Wan's (pt, ph, pw, c), pt = 1); ours
    // (c, ph, pw), as the input's.
    const std::int64_t C = cfg.latent_channels, pp = cfg.patch * cfg.patch;
    std::vector<DitFilePart> parts;
    for (std::int64_t i = 0; i < rows; ++i) parts.push_back({names[0] + "." + file_suffix, t.shape, (i % pp) * C + i / pp, 1});
    return parts;
  }
  std::vector<DitFilePart> parts;
  for (std::size_t k = 0; k < names.size(); ++k) {
    // Split Linears: q, k, v have H rows each; the single block's MLP input the rest.
    const std::int64_t r = names.size() == 1 ? rows : k < 3 ? H : rows - 3 * H;
    parts.push_back({names[k] + "." + file_suffix, shape_of(r), 0, r});
  }
  return parts;
}

namespace {

// The class's constructor arguments overridden by the file's fields (others refused by name;
// `ignored`: fields published configs carry that the class does not take, which diffusers ignores).
nlohmann::json constructor_args(const nlohmann::json& j, nlohmann::json defaults, const std::string& source,
                                std::initializer_list<const char*> ignored = {}) {
  const std::string cls = class_name(j);
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "_class_name" || it.key() == "_diffusers_version" || it.key() == "_name_or_path") continue;
    bool skip = false;
    for (const char* f : ignored) skip = skip || it.key() == f;
    if (skip) continue;
    DIFFCP_CHECK(defaults.contains(it.key()), "config '", source, "': unknown field '", it.key(), "' for ", cls);
    defaults[it.key()] = it.value();
  }
  return defaults;
}

std::int64_t config_int(const nlohmann::json& a, const char* f, const std::string& source) {
  const auto v = json_int64(a[f]);
  DIFFCP_CHECK(v.has_value() && *v >= 0, "config '", source, "': field '", f, "' = ", a[f].dump(),
               ", expected a non-negative integer");
  return *v;
}

// The config's axes_dims_rope as the model's RoPE axes; `count` of them (the family's positions).
std::vector<std::int64_t> config_rope_axes(const nlohmann::json& a, std::size_t count, const char* positions,
                                           const std::string& source) {
  const nlohmann::json& v = a["axes_dims_rope"];
  DIFFCP_CHECK(v.is_array() && v.size() == count, "config '", source, "': axes_dims_rope = ", v.dump(), "; ",
               v.is_array() ? std::to_string(v.size()) + " RoPE axes, but " : std::string(), "the positions (", positions,
               ") need ", count);
  std::vector<std::int64_t> axes;
  for (std::size_t i = 0; i < count; ++i) {
    const auto x = json_int64(v[i]);
    DIFFCP_CHECK(x.has_value() && *x >= 0, "config '", source, "': axes_dims_rope[", i, "] = ", v[i].dump(),
                 ", expected a non-negative integer");
    axes.push_back(*x);
  }
  return axes;
}

// `c` validated, its errors naming the config file.
DitConfig validated(const DitConfig& c, const std::string& source) {
  try {
    c.validate();
  } catch (const Error& e) {
    DIFFCP_FAIL("config '", source, "': ", e.what());
  }
  return c;
}

bool config_bool(const nlohmann::json& a, const char* f, const std::string& source) {
  DIFFCP_CHECK(a[f].is_boolean(), "config '", source, "': field '", f, "' = ", a[f].dump(), ", expected true or false");
  return a[f].get<bool>();
}

// FluxTransformer2DModel (diffusers' transformer_flux.py): FluxParams, as BFL's FLUX.1 configs hold
// the same model (diffusers' mlp_ratio, theta and qkv biases are fixed in the class).
DitConfig flux1_from_diffusers(const nlohmann::json& j, const std::string& source) {
  const nlohmann::json a = constructor_args(
      j,
      {{"patch_size", 1}, {"in_channels", 64}, {"out_channels", nullptr}, {"num_layers", 19}, {"num_single_layers", 38},
       {"attention_head_dim", 128}, {"num_attention_heads", 24}, {"joint_attention_dim", 4096},
       {"pooled_projection_dim", 768}, {"guidance_embeds", false}, {"axes_dims_rope", {16, 56, 56}}},
      source);
  DIFFCP_CHECK(config_int(a, "patch_size", source) == 1, "config '", source, "': patch_size = ", a["patch_size"].dump(),
               "; FLUX.1 packs 2x2 patches in the pipeline and has patch_size 1 (the only one supported)");
  config_bool(a, "guidance_embeds", source);
  const std::int64_t heads = config_int(a, "num_attention_heads", source);
  const nlohmann::json p = {{"in_channels", a["in_channels"]},
                            {"out_channels", a["out_channels"].is_null() ? a["in_channels"] : a["out_channels"]},
                            {"vec_in_dim", a["pooled_projection_dim"]},
                            {"context_in_dim", a["joint_attention_dim"]},
                            {"hidden_size", heads * config_int(a, "attention_head_dim", source)},
                            {"mlp_ratio", 4.0},
                            {"num_heads", heads},
                            {"depth", a["num_layers"]},
                            {"depth_single_blocks", a["num_single_layers"]},
                            {"axes_dim", a["axes_dims_rope"]},
                            {"theta", 10000},
                            {"qkv_bias", true},
                            {"guidance_embed", a["guidance_embeds"]}};
  return dit_config_from_flux_params(p, source + " (as FluxParams)");
}

// QwenImageTransformer2DModel (diffusers' transformer_qwenimage.py): double-stream blocks with
// FeedForward's 4x GELU-tanh MLP, biased q/k/v, RMS QK-norm (eps 1e-6), RoPE theta 10000.
DitConfig qwen_image_from_diffusers(const nlohmann::json& j, const std::string& source) {
  // Qwen/Qwen-Image's published config.json carries pooled_projection_dim, which the class does not
  // take (diffusers ignores it; so does diffcp).
  const nlohmann::json a = constructor_args(
      j,
      {{"patch_size", 2}, {"in_channels", 64}, {"out_channels", 16}, {"num_layers", 60}, {"attention_head_dim", 128},
       {"num_attention_heads", 24}, {"joint_attention_dim", 3584}, {"guidance_embeds", false},
       {"axes_dims_rope", {16, 56, 56}}, {"zero_cond_t", false}, {"use_additional_t_cond", false},
       {"use_layer3d_rope", false}},
      source, {"pooled_projection_dim"});
  for (const char* f : {"guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"})
    DIFFCP_CHECK(!config_bool(a, f, source), "config '", source, "': ", f, " = true is not supported (diffcp runs ",
                 "Qwen-Image's text-to-image transformer; the edit and layered variants' conditioning is not implemented",
                 std::string(f) == "guidance_embeds" ? ", and the class's timestep embedding takes no guidance" : "", ")");
  const std::int64_t patch = config_int(a, "patch_size", source), in = config_int(a, "in_channels", source);
  const std::int64_t out = a["out_channels"].is_null() ? in : config_int(a, "out_channels", source);
  DIFFCP_CHECK(patch == 2, "config '", source, "': patch_size = ", patch,
               "; Qwen-Image's pipeline packs 2x2 latent patches (the only patch size supported)");
  DIFFCP_CHECK(out >= 1 && in == out * patch * patch, "config '", source, "': in_channels = ", in, " != out_channels (", out,
               ") x patch_size^2; the Euler sampler needs the velocity in the packed latent's shape");
  DitConfig c;
  c.family = DitFamily::qwen_image;
  c.heads = config_int(a, "num_attention_heads", source);
  c.head_dim = config_int(a, "attention_head_dim", source);
  c.double_blocks = config_int(a, "num_layers", source);
  c.single_blocks = 0;
  c.mlp_hidden = 4 * c.heads * c.head_dim;
  c.latent_channels = out;
  c.patch = 2;
  c.text_dim = config_int(a, "joint_attention_dim", source);
  c.pooled_dim = 0;
  c.time_dim = 256;
  c.rope_axes = config_rope_axes(a, 3, "frame, row, column", source);
  c.rope_theta = 10000;
  c.qkv_bias = true;
  c.guidance_embed = false;
  return validated(c, source);
}

// Flux2Transformer2DModel (diffusers' transformer_flux2.py): no biases, shared modulation, SwiGLU
// MLPs (mlp_hidden = int(H * mlp_ratio)), RMS QK-norm, four RoPE axes.
DitConfig flux2_from_diffusers(const nlohmann::json& j, const std::string& source) {
  const nlohmann::json a = constructor_args(
      j,
      {{"patch_size", 1}, {"in_channels", 128}, {"out_channels", nullptr}, {"num_layers", 8}, {"num_single_layers", 48},
       {"attention_head_dim", 128}, {"num_attention_heads", 48}, {"joint_attention_dim", 15360},
       {"timestep_guidance_channels", 256}, {"mlp_ratio", 3.0}, {"axes_dims_rope", {32, 32, 32, 32}},
       {"rope_theta", 2000}, {"eps", 1e-6}, {"guidance_embeds", true}},
      source);
  DIFFCP_CHECK(config_int(a, "patch_size", source) == 1, "config '", source, "': patch_size = ", a["patch_size"].dump(),
               "; FLUX.2 packs 2x2 patches in the pipeline and has patch_size 1 (the only one supported)");
  const std::int64_t in = config_int(a, "in_channels", source);
  const std::int64_t out = a["out_channels"].is_null() ? in : config_int(a, "out_channels", source);
  DIFFCP_CHECK(in >= 4 && in % 4 == 0 && out == in, "config '", source, "': in_channels = ", in, ", out_channels = ", out,
               "; expected equal, a multiple of 4 (latent channels x the pipeline's 2x2 patch)");
  const auto number = [&](const char* f) {
    DIFFCP_CHECK(a[f].is_number() && std::isfinite(a[f].get<double>()) && a[f].get<double>() > 0, "config '", source,
                 "': field '", f, "' = ", a[f].dump(), ", expected a positive number");
    return a[f].get<double>();
  };
  DitConfig c;
  c.family = DitFamily::flux2;
  c.heads = config_int(a, "num_attention_heads", source);
  c.head_dim = config_int(a, "attention_head_dim", source);
  c.double_blocks = config_int(a, "num_layers", source);
  c.single_blocks = config_int(a, "num_single_layers", source);
  c.mlp_hidden = static_cast<std::int64_t>(static_cast<double>(c.heads * c.head_dim) * number("mlp_ratio"));  // int()
  c.latent_channels = in / 4;
  c.patch = 2;
  c.text_dim = config_int(a, "joint_attention_dim", source);
  c.pooled_dim = 0;
  c.time_dim = config_int(a, "timestep_guidance_channels", source);
  c.rope_axes = config_rope_axes(a, 4, "frame, row, column, text index", source);
  c.rope_theta = number("rope_theta");
  c.eps = number("eps");
  c.qkv_bias = false;
  c.guidance_embed = config_bool(a, "guidance_embeds", source);
  return validated(c, source);
}

// SD3Transformer2DModel (diffusers' transformer_sd3.py, SD3.5-large's variant): JointTransformerBlocks
// with RMS QK-norm, the last one context-pre-only, a stride-2 patch embedding and a learned
// position table; the caption projection must be the hidden size (as in every SD3 release).
DitConfig sd3_from_diffusers(const nlohmann::json& j, const std::string& source) {
  const nlohmann::json a = constructor_args(
      j,
      {{"sample_size", 128}, {"patch_size", 2}, {"in_channels", 16}, {"num_layers", 18}, {"attention_head_dim", 64},
       {"num_attention_heads", 18}, {"joint_attention_dim", 4096}, {"caption_projection_dim", 1152},
       {"pooled_projection_dim", 2048}, {"out_channels", 16}, {"pos_embed_max_size", 96},
       {"dual_attention_layers", nlohmann::json::array()}, {"qk_norm", nullptr}},
      source);
  DIFFCP_CHECK(a["dual_attention_layers"].is_array() && a["dual_attention_layers"].empty(), "config '", source,
               "': dual_attention_layers = ", a["dual_attention_layers"].dump(), " is not supported (SD3.5-medium's ",
               "MMDiT-X blocks); SD3.5-large's empty list is");
  DIFFCP_CHECK(a["qk_norm"] == "rms_norm", "config '", source, "': qk_norm = ", a["qk_norm"].dump(),
               "; diffcp's blocks have RMS QK-norm (SD3.5's \"rms_norm\"; SD3.0 without it is not supported)");
  const std::int64_t patch = config_int(a, "patch_size", source), in = config_int(a, "in_channels", source);
  DIFFCP_CHECK(patch == 2, "config '", source, "': patch_size = ", patch, "; diffcp's token grid is the latent's 2x2 ",
               "patches (8x VAE, 16 pixels a token), the only patch size supported");
  DIFFCP_CHECK(!a["out_channels"].is_null() && config_int(a, "out_channels", source) == in, "config '", source,
               "': out_channels = ", a["out_channels"].dump(), " != in_channels = ", in,
               "; the Euler sampler needs the velocity in the latent's shape");
  DitConfig c;
  c.family = DitFamily::sd3;
  c.heads = config_int(a, "num_attention_heads", source);
  c.head_dim = config_int(a, "attention_head_dim", source);
  DIFFCP_CHECK(config_int(a, "caption_projection_dim", source) == c.heads * c.head_dim, "config '", source,
               "': caption_projection_dim = ", a["caption_projection_dim"].dump(), " != the hidden size ",
               c.heads * c.head_dim, " (num_attention_heads x attention_head_dim); not supported");
  c.double_blocks = config_int(a, "num_layers", source);
  c.single_blocks = 0;
  c.mlp_hidden = 4 * c.heads * c.head_dim;
  c.latent_channels = in;
  c.patch = 2;
  c.text_dim = config_int(a, "joint_attention_dim", source);
  c.pooled_dim = config_int(a, "pooled_projection_dim", source);
  c.time_dim = 256;
  c.rope_axes.clear();
  c.pos_embed_max = config_int(a, "pos_embed_max_size", source);
  config_int(a, "sample_size", source);  // the training size: read for its type only
  c.qkv_bias = true;
  c.guidance_embed = false;
  return validated(c, source);
}

// WanTransformer3DModel (diffusers' transformer_wan.py), text-to-video: patch (1, 2, 2), RMS QK-norm
// across heads, 3-D RoPE with the class's fixed split of the head dim, GELU-tanh FFN, freq_dim
// timestep features. Image-to-video (WanImageToVideoPipeline's): in_channels above out_channels (the
// condition's channels after the latent's), and Wan 2.1's image context (image_dim, added_kv_proj_dim
// = the hidden size; FLF2V's pos_embed_seq_len).
DitConfig wan_from_diffusers(const nlohmann::json& j, const std::string& source) {
  const nlohmann::json a = constructor_args(
      j,
      {{"patch_size", {1, 2, 2}}, {"num_attention_heads", 40}, {"attention_head_dim", 128}, {"in_channels", 16},
       {"out_channels", 16}, {"text_dim", 4096}, {"freq_dim", 256}, {"ffn_dim", 13824}, {"num_layers", 40},
       {"cross_attn_norm", true}, {"qk_norm", "rms_norm_across_heads"}, {"eps", 1e-6}, {"image_dim", nullptr},
       {"added_kv_proj_dim", nullptr}, {"rope_max_seq_len", 1024}, {"pos_embed_seq_len", nullptr}},
      source);
  DIFFCP_CHECK(a["patch_size"] == nlohmann::json({1, 2, 2}), "config '", source, "': patch_size = ", a["patch_size"].dump(),
               "; diffcp's token grid is the latent's 1 x 2 x 2 patches (frame, row, column), the only patch supported");
  DIFFCP_CHECK(a["qk_norm"] == "rms_norm_across_heads", "config '", source, "': qk_norm = ", a["qk_norm"].dump(),
               "; diffcp runs Wan's \"rms_norm_across_heads\" (the only one its releases use)");
  const std::int64_t in = config_int(a, "in_channels", source);
  const std::int64_t out = a["out_channels"].is_null() ? in : config_int(a, "out_channels", source);
  DIFFCP_CHECK(out >= 1 && in >= out, "config '", source, "': in_channels = ", in, ", out_channels = ", out,
               "; expected out_channels >= 1 and in_channels >= out_channels (the input is the latent, then any "
               "image-to-video condition's channels)");
  const auto optional_int = [&](const char* f) { return a[f].is_null() ? std::int64_t{0} : config_int(a, f, source); };
  const std::int64_t image_dim = optional_int("image_dim"), added_kv = optional_int("added_kv_proj_dim"),
                     pos_tokens = optional_int("pos_embed_seq_len");
  const std::int64_t hidden = config_int(a, "num_attention_heads", source) * config_int(a, "attention_head_dim", source);
  DIFFCP_CHECK((image_dim == 0 && added_kv == 0 && pos_tokens == 0) || (image_dim >= 1 && added_kv == hidden),
               "config '", source, "': image_dim = ", a["image_dim"].dump(), ", added_kv_proj_dim = ",
               a["added_kv_proj_dim"].dump(), ", pos_embed_seq_len = ", a["pos_embed_seq_len"].dump(),
               "; diffcp runs Wan's image context as its releases have it: image_dim and added_kv_proj_dim = the hidden size (",
               hidden, ") together, pos_embed_seq_len only with them");
  DIFFCP_CHECK(a["eps"].is_number() && a["eps"].get<double>() > 0, "config '", source, "': eps = ", a["eps"].dump(),
               ", expected a positive number");
  DitConfig c;
  c.family = DitFamily::wan;
  c.heads = config_int(a, "num_attention_heads", source);
  c.head_dim = config_int(a, "attention_head_dim", source);
  c.double_blocks = 0;
  c.single_blocks = config_int(a, "num_layers", source);
  c.mlp_hidden = config_int(a, "ffn_dim", source);
  c.latent_channels = out;
  c.condition_channels = in - out;
  c.image_dim = image_dim;
  c.image_pos_tokens = pos_tokens;
  c.patch = 2;
  c.text_dim = config_int(a, "text_dim", source);
  c.pooled_dim = 0;
  c.time_dim = config_int(a, "freq_dim", source);
  const std::int64_t hw = 2 * (c.head_dim / 6);  // WanRotaryPosEmbed's split: [t | h | w]
  c.rope_axes = {c.head_dim - 2 * hw, hw, hw};
  c.rope_theta = 10000;
  c.eps = a["eps"].get<double>();
  c.qkv_bias = true;
  c.guidance_embed = false;
  c.cross_attn_norm = config_bool(a, "cross_attn_norm", source);
  c.rope_max_positions = config_int(a, "rope_max_seq_len", source);  // WanRotaryPosEmbed's table: F, g_h, g_w at most this
  DIFFCP_CHECK(c.rope_max_positions >= 1, "config '", source, "': rope_max_seq_len = 0, expected >= 1");
  return validated(c, source);
}

}  // namespace

const char* diffusers_class(DitFamily family) {
  switch (family) {
    case DitFamily::flux1: return "FluxTransformer2DModel";
    case DitFamily::qwen_image: return "QwenImageTransformer2DModel";
    case DitFamily::flux2: return "Flux2Transformer2DModel";
    case DitFamily::sd3: return "SD3Transformer2DModel";
    case DitFamily::wan: return "WanTransformer3DModel";
  }
  return "?";
}

DitConfig dit_config_from_diffusers(const nlohmann::json& j, const std::string& source) {
  DIFFCP_CHECK(j.is_object(), "config '", source, "': expected a JSON object (a diffusers config.json)");
  const std::string cls = class_name(j);
  if (cls == "FluxTransformer2DModel") return flux1_from_diffusers(j, source);
  if (cls == "QwenImageTransformer2DModel") return qwen_image_from_diffusers(j, source);
  if (cls == "Flux2Transformer2DModel") return flux2_from_diffusers(j, source);
  if (cls == "SD3Transformer2DModel") return sd3_from_diffusers(j, source);
  if (cls == "WanTransformer3DModel") return wan_from_diffusers(j, source);
  DIFFCP_FAIL("config '", source, "': _class_name '", cls, "' is not a DiT diffcp runs; supported: ",
              "FluxTransformer2DModel (FLUX.1), QwenImageTransformer2DModel (Qwen-Image), Flux2Transformer2DModel (FLUX.2), ",
              "SD3Transformer2DModel (SD3.5), WanTransformer3DModel (Wan 2.1 / 2.2 text-to-video)");
}

namespace {
// Flux2Pipeline's compute_empirical_mu: two lines in the image token count (fitted at 10 and 200
// steps), interpolated linearly in the step count up to 4300 tokens, the 200-step line beyond.
double flux2_empirical_mu(std::int64_t image_tokens, int steps) {
  const double n = static_cast<double>(image_tokens);
  const double m200 = 0.00016927 * n + 0.45666666;
  if (image_tokens > 4300) return m200;
  const double m10 = 8.73809524e-05 * n + 1.89833333;
  const double a = (m200 - m10) / 190.0;
  return a * steps + (m200 - 200.0 * a);
}
}  // namespace

std::vector<double> FlowMatchEulerScheduler::pipeline_sigmas(int steps, std::int64_t image_tokens, DitFamily family) const {
  DIFFCP_CHECK(steps >= 1, "`steps` = ", steps, ", expected >= 1");
  DIFFCP_CHECK(!(dynamic && family == DitFamily::wan), "scheduler: use_dynamic_shifting = true with Wan: WanPipeline ",
               "passes no mu (diffusers raises); give a static `shift` (Wan's flow_shift)");
  const double m = (max_shift - base_shift) / (max_seq - base_seq);
  const double mu = family == DitFamily::flux2 ? flux2_empirical_mu(image_tokens, steps)
                                               : static_cast<double>(image_tokens) * m + (base_shift - m * base_seq);
  std::vector<double> sig(static_cast<std::size_t>(steps) + 1, 0.0);
  // The unshifted grid: FLUX / Qwen-Image / FLUX.2 pass sigmas = linspace(1, 1/N, N); SD3's and
  // Wan's pipelines pass none, and the scheduler spaces them linspace(sigma_max, sigma_min, N) over its training
  // sigmas (sigma_max = 1; sigma_min = 1/1000, statically shifted unless use_dynamic_shifting).
  const bool unset = family == DitFamily::sd3 || family == DitFamily::wan;  // the pipeline passes no sigmas
  const double last = !unset ? 1.0 / steps : dynamic ? 1e-3 : shift * 1e-3 / (1 + (shift - 1) * 1e-3);
  for (int k = 0; k < steps; ++k) {
    const double s = steps == 1 ? 1.0 : 1.0 + (last - 1.0) * static_cast<double>(k) / (steps - 1);
    sig[static_cast<std::size_t>(k)] = !dynamic     ? shift * s / (1 + (shift - 1) * s)
                                       : exponential ? std::exp(mu) / (std::exp(mu) + (1 / s - 1))
                                                     : mu / (mu + (1 / s - 1));
  }
  DIFFCP_CHECK(shift_terminal == 0 || steps >= 2, "scheduler: shift_terminal = ", shift_terminal, " needs `steps` >= 2 ",
               "(its stretch divides by 1 - the last sigma before 0, which is 1 with one step: diffusers computes NaN)");
  if (shift_terminal > 0) {  // stretch so that the last sigma before 0 is shift_terminal
    const double scale = (1 - sig[static_cast<std::size_t>(steps) - 1]) / (1 - shift_terminal);
    for (int k = 0; k < steps; ++k) sig[static_cast<std::size_t>(k)] = 1 - (1 - sig[static_cast<std::size_t>(k)]) / scale;
  }
  // A config can be accepted field by field and still shift into nonsense (mu so large that e^mu
  // overflows, a negative linear shift): every sigma must be a number in [0, 1], non-increasing.
  for (std::size_t k = 0; k < sig.size(); ++k)
    DIFFCP_CHECK(std::isfinite(sig[k]) && sig[k] >= 0 && sig[k] <= 1 && (k == 0 || sig[k] <= sig[k - 1]),
                 "scheduler: sigma ", k, " of ", steps, " steps is ", sig[k], " (", image_tokens, " image tokens; shift ",
                 shift, ", base / max_shift ", base_shift, " / ", max_shift, ", base / max_image_seq_len ", base_seq, " / ",
                 max_seq, ", shift_terminal ", shift_terminal, "): expected non-increasing sigmas in [0, 1]");
  return sig;
}

FlowMatchEulerScheduler flow_match_scheduler_from_json(const nlohmann::json& j, const std::string& source) {
  DIFFCP_CHECK(j.is_object(), "scheduler config '", source, "': expected a JSON object");
  const std::string cls = class_name(j);
  DIFFCP_CHECK(cls == "FlowMatchEulerDiscreteScheduler", "scheduler config '", source, "': _class_name '", cls,
               "'; supported: FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler in its flow configuration ",
               "(dit/unipc.hpp), or give `schedule` linear | flux");
  FlowMatchEulerScheduler s;
  const auto number = [&](const std::string& f, const nlohmann::json& v) {
    DIFFCP_CHECK(v.is_number() && std::isfinite(v.get<double>()), "scheduler config '", source, "': field '", f, "' = ",
                 v.dump(), ", expected a number");
    return v.get<double>();
  };
  const auto flag = [&](const std::string& f, const nlohmann::json& v) {
    DIFFCP_CHECK(v.is_boolean(), "scheduler config '", source, "': field '", f, "' = ", v.dump(), ", expected true or false");
    return v.get<bool>();
  };
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& f = it.key();
    const nlohmann::json& v = it.value();
    if (f == "_class_name" || f == "_diffusers_version") continue;
    if (f == "shift") s.shift = number(f, v);
    else if (f == "use_dynamic_shifting") s.dynamic = flag(f, v);
    else if (f == "base_shift") s.base_shift = v.is_null() ? 0.5 : number(f, v);
    else if (f == "max_shift") s.max_shift = v.is_null() ? 1.15 : number(f, v);
    else if (f == "base_image_seq_len") s.base_seq = number(f, v);
    else if (f == "max_image_seq_len") s.max_seq = number(f, v);
    else if (f == "shift_terminal") s.shift_terminal = v.is_null() ? 0.0 : number(f, v);
    else if (f == "time_shift_type") {
      DIFFCP_CHECK(v == "exponential" || v == "linear", "scheduler config '", source, "': time_shift_type ", v.dump(),
                   ", expected \"exponential\" or \"linear\"");
      s.exponential = v == "exponential";
    } else if (f == "num_train_timesteps") {
      DIFFCP_CHECK(number(f, v) == 1000, "scheduler config '", source, "': num_train_timesteps = ", v.dump(),
                   "; diffcp's pipeline feeds the model sigma = timestep / 1000 (FluxPipeline's), so only 1000 is supported");
    } else if (f == "invert_sigmas" || f == "use_karras_sigmas" || f == "use_exponential_sigmas" || f == "use_beta_sigmas" ||
               f == "stochastic_sampling") {
      DIFFCP_CHECK(!flag(f, v), "scheduler config '", source, "': ", f, " = true is not supported (diffcp samples with ",
                   "the Euler step of FlowMatchEulerDiscreteScheduler's default sigmas)");
    } else {
      DIFFCP_FAIL("scheduler config '", source, "': unknown field '", f, "' for FlowMatchEulerDiscreteScheduler");
    }
  }
  DIFFCP_CHECK(s.shift > 0 && s.max_seq != s.base_seq && (s.shift_terminal == 0 || (s.shift_terminal > 0 && s.shift_terminal < 1)),
               "scheduler config '", source, "': shift = ", s.shift, " (> 0), base / max_image_seq_len = ", s.base_seq, " / ",
               s.max_seq, " (distinct), shift_terminal = ", s.shift_terminal, " (in (0, 1) or null)");
  return s;
}

bool is_directory(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec);
}

DiffusersTransformer open_diffusers_transformer(const std::string& path) {
  fs::path dir(path);
  std::string scheduler;
  if (fs::exists(dir / "model_index.json")) {
    if (fs::exists(dir / "scheduler" / "scheduler_config.json")) scheduler = (dir / "scheduler" / "scheduler_config.json").string();
    const nlohmann::json index = read_json_file((dir / "model_index.json").string(), "pipeline index");
    DIFFCP_CHECK(index.is_object() && index.contains("transformer"), "pipeline '", path,
                 "': model_index.json has no 'transformer' (diffcp runs the pipeline's DiT)");
    // Wan 2.2 A14B: a second (low-noise) expert takes the steps below boundary_ratio; diffcp runs one
    // transformer, so such a pipeline is refused rather than run on its first expert alone.
    for (const char* f : {"transformer_2", "boundary_ratio"})
      DIFFCP_CHECK(!index.contains(f) || index[f].is_null() || (index[f].is_array() && index[f].size() == 2 && index[f][0].is_null()),
                   "pipeline '", path, "': model_index.json's ", f, " = ", index[f].dump(), " (Wan 2.2 A14B's two experts, ",
                   "switched at the boundary timestep) is not supported: diffcp runs one transformer");
    dir /= "transformer";
  }
  const fs::path config = dir / "config.json";
  DIFFCP_CHECK(fs::exists(config), "`weights` '", path, "': a folder without model_index.json or config.json ",
               "(expected a diffusers pipeline or transformer folder, or a .safetensors file / index .json)");
  DiffusersTransformer t;
  t.dir = dir.string();
  t.scheduler_config = scheduler;
  t.config = dit_config_from_diffusers(read_json_file(config.string(), "config"), config.string());
  for (const char* name : {"diffusion_pytorch_model.safetensors.index.json", "diffusion_pytorch_model.safetensors"})
    if (t.weights.empty() && fs::exists(dir / name)) t.weights = (dir / name).string();
  DIFFCP_CHECK(!t.weights.empty(), "transformer folder '", t.dir, "' has no diffusion_pytorch_model.safetensors ",
               "(or its sharded index .json)");
  return t;
}

}  // namespace diffcp
