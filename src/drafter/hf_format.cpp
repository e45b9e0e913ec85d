#include "diffcp/drafter/hf_format.hpp"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "diffcp/core/error.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/core/json_int.hpp"
#include "diffcp/cp/attention_layer.hpp"
#include "diffcp/io/safetensors.hpp"

namespace diffcp {

namespace {

// One tensor of the format and where it lives in our parameters: a matrix stored [in, out] at
// `offset` (exported transposed, as [out, in]) or a vector (in = 0).
// dims: a tensor stored as it is with that shape (in = 0, out = its size: DFlash2's base kernels
// and codebooks).
struct Entry {
  std::string name;
  std::int64_t offset, in, out;
  std::vector<std::int64_t> dims = {};
  std::vector<std::int64_t> shape() const {
    return !dims.empty() ? dims : in == 0 ? std::vector<std::int64_t>{out} : std::vector<std::int64_t>{out, in};
  }
  std::int64_t count() const { return in == 0 ? out : in * out; }
};

std::vector<Entry> entries(const DrafterConfig& c) {
  const DrafterLayout lay(c);
  const std::int64_t H = c.hidden, F = c.ffn, q = c.n_q * c.d_h, kv = c.n_kv * c.d_h;
  using A = AttnLayerParams;
  const auto a = A::offsets(c.attn());
  std::vector<Entry> e{{"fc.weight", lay.fc, c.target_layers * H, H}, {"hidden_norm.weight", lay.fc_norm, 0, H}};
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const auto& L = lay.layer[static_cast<std::size_t>(l)];
    const std::string p = "layers." + std::to_string(l) + ".";
    e.push_back({p + "input_layernorm.weight", L.attn_norm, 0, H});
    e.push_back({p + "self_attn.q_proj.weight", L.attn + a[A::wq], H, q});
    e.push_back({p + "self_attn.k_proj.weight", L.attn + a[A::wk], H, kv});
    e.push_back({p + "self_attn.v_proj.weight", L.attn + a[A::wv], H, kv});
    e.push_back({p + "self_attn.o_proj.weight", L.attn + a[A::wo], q, H});
    e.push_back({p + "self_attn.q_norm.weight", L.attn + a[A::q_norm], 0, c.d_h});
    e.push_back({p + "self_attn.k_norm.weight", L.attn + a[A::k_norm], 0, c.d_h});
    e.push_back({p + "post_attention_layernorm.weight", L.mlp_norm, 0, H});
    e.push_back({p + "mlp.gate_proj.weight", L.w_gate, H, F});
    e.push_back({p + "mlp.up_proj.weight", L.w_up, H, F});
    e.push_back({p + "mlp.down_proj.weight", L.w_down, F, H});
    if (c.has_conv()) {  // DFlash2: base_kernel [2, K, H], kernel_projection Linear(H -> 2 K G)
      const std::int64_t K = c.conv_taps, KG2 = 2 * K * c.conv_groups();
      e.push_back({p + "attention_conv.base_kernel", L.attn_conv_base, 0, 2 * K * H, {2, K, H}});
      e.push_back({p + "attention_conv.kernel_projection.weight", L.attn_conv_proj, H, KG2});
      e.push_back({p + "mlp_conv.base_kernel", L.mlp_conv_base, 0, 2 * K * H, {2, K, H}});
      e.push_back({p + "mlp_conv.kernel_projection.weight", L.mlp_conv_proj, H, KG2});
    }
  }
  e.push_back({"norm.weight", lay.final_norm, 0, H});
  if (c.has_selector()) {  // the codebooks are stored without ".weight" in released checkpoints
    const std::int64_t r = c.selector_rank;
    e.push_back({"candidate_selector.hidden_projection.weight", lay.sel_proj, H, r});
    e.push_back({"candidate_selector.predecessor_codebook", lay.sel_pred, 0, c.vocab * r, {c.vocab, r}});
    e.push_back({"candidate_selector.successor_codebook", lay.sel_succ, 0, c.vocab * r, {c.vocab, r}});
  }
  return e;
}

// SPEC A.1's loss decay for the block sizes it names; 7 otherwise (the B = 16 value).
double gamma_for_block(std::int64_t B) { return B == 8 ? 4.0 : B == 10 ? 5.0 : 7.0; }

void write_text_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    DIFFCP_CHECK(f.good(), "cannot write '", tmp, "'");
    f << text;
    DIFFCP_CHECK(f.good(), "write to '", tmp, "' failed");
  }
  std::filesystem::rename(tmp, path);
}

template <typename T>
T field(const nlohmann::json& j, const std::string& key, const std::string& path) {
  DIFFCP_CHECK(j.contains(key), "'", path, "': field '", key, "' is missing");
  try {
    return j.at(key).get<T>();
  } catch (const nlohmann::json::exception&) {
    DIFFCP_FAIL("'", path, "': field '", key, "' = ", j.at(key).dump(), " has the wrong type");
  }
}

// A JSON integer (not a float: nlohmann would cast 1e300 or truncate 63.9).
std::int64_t integer(const nlohmann::json& v, const std::string& path, const std::string& key) {
  const auto i = json_int64(v);
  DIFFCP_CHECK(i.has_value(), "'", path, "': field '", key, "' = ", v.dump(), ", expected an integer");
  return *i;
}

// An optional field of the given JSON type (else the default), named when it has another type.
template <typename T>
T optional(const nlohmann::json& j, const std::string& key, T dflt, const std::string& path) {
  if (!j.contains(key) || (j.at(key).is_null() && !std::is_same_v<T, bool>)) return dflt;
  return field<T>(j, key, path);
}

std::int64_t positive(const nlohmann::json& j, const std::string& key, const std::string& path) {
  const nlohmann::json& v = j.contains(key) ? j.at(key) : nlohmann::json();
  const auto i = json_int64(v);
  DIFFCP_CHECK(i.has_value() && *i >= 1, "'", path, "': field '", key, "' = ", j.contains(key) ? v.dump() : "missing",
               ", expected a positive integer");
  return *i;
}

// Each layer's kind and the sliding window, as Qwen3Config resolves them and z-lab's
// DFlashDraftModel reads them: sliding_window counts only with use_sliding_window (Qwen3Config
// sets it to None otherwise); layer_types, when absent, is sliding from max_window_layers on if
// there is a window; is_causal, when present, applies to every layer.
void read_layer_types(const nlohmann::json& j, const std::string& path, DrafterConfig& c) {
  const bool use = optional<bool>(j, "use_sliding_window", false, path);
  const nlohmann::json& w = j.contains("sliding_window") ? j.at("sliding_window") : nlohmann::json(4096);
  if (use && !w.is_null()) {
    const auto v = json_int64(w);
    DIFFCP_CHECK(v.has_value() && *v >= 1, "'", path, "': sliding_window = ", w.dump(), ", expected a positive integer");
    c.sliding_window = *v;
  }
  c.layer_types.clear();
  if (j.contains("layer_types") && !j.at("layer_types").is_null()) {
    const auto& lt = j.at("layer_types");
    DIFFCP_CHECK(lt.is_array() && static_cast<std::int64_t>(lt.size()) == c.layers, "'", path, "': layer_types = ",
                 lt.dump(), ", expected a list of num_hidden_layers = ", c.layers, " layer types");
    for (const auto& t : lt) {
      DIFFCP_CHECK(t == "full_attention" || t == "sliding_attention", "'", path, "': layer type ", t.dump(),
                   " is not supported (full_attention or sliding_attention)");
      c.layer_types.push_back(t.get<std::string>());
    }
  } else if (c.sliding_window > 0) {
    const nlohmann::json& m = j.contains("max_window_layers") ? j.at("max_window_layers") : nlohmann::json(28);
    const auto from = json_int64(m);
    DIFFCP_CHECK(from.has_value() && *from >= 0, "'", path, "': max_window_layers = ", m.dump(),
                 ", expected an integer >= 0");
    for (std::int64_t l = 0; l < c.layers; ++l) c.layer_types.push_back(l >= *from ? "sliding_attention" : "full_attention");
  }
  if (std::all_of(c.layer_types.begin(), c.layer_types.end(), [](const std::string& t) { return t == "full_attention"; }))
    c.layer_types.clear();  // every layer full: the canonical form (what a config without layer_types means)
  if (j.contains("is_causal") && !j.at("is_causal").is_null()) c.is_causal = field<bool>(j, "is_causal", path);
}

DrafterConfig config_from_hf(const nlohmann::json& j, const std::string& path) {
  DIFFCP_CHECK(j.is_object(), "'", path, "' is not a JSON object");
  const auto arch = j.value("architectures", nlohmann::json::array());
  bool dflash = false, dflash2 = false;
  for (const auto& a : arch) {
    dflash |= a.is_string() && a.get<std::string>() == "DFlashDraftModel";
    dflash2 |= a.is_string() && a.get<std::string>() == "DFlash2DraftModel";
  }
  DIFFCP_CHECK(dflash || dflash2, "'", path, "': architectures = ", arch.dump(),
               ", expected [\"DFlashDraftModel\"] or [\"DFlash2DraftModel\"] (not a DFlash drafter)");
  DIFFCP_CHECK(!optional<bool>(j, "attention_bias", false, path), "'", path,
               "': attention_bias = true; DFlash drafters (Qwen3 layers) have no attention biases");
  DIFFCP_CHECK(optional<std::string>(j, "hidden_act", "silu", path) == "silu", "'", path, "': hidden_act = ",
               j.at("hidden_act").dump(), ", expected \"silu\" (SwiGLU)");
  const auto& rs = j.contains("rope_scaling") ? j.at("rope_scaling") : nlohmann::json();
  DIFFCP_CHECK(rs.is_null(), "'", path, "': rope_scaling = ", rs.dump(), " is not supported (plain RoPE only)");
  DIFFCP_CHECK(j.contains("dflash_config") && j.at("dflash_config").is_object(), "'", path,
               "': dflash_config is missing (expected {target_layer_ids, mask_token_id})");
  const auto& dc = j.at("dflash_config");
  // A draft value as the reference reads it: dflash_config's, else the top level's (null: absent).
  const auto draft_value = [&](const char* key) {
    return dc.contains(key) ? dc.at(key) : j.contains(key) ? j.at(key) : nlohmann::json();
  };
  // What the newest reference reads beside these and we do not implement: refused unless neutral
  // (the embedding scale 1; for DFlash, the logit multiplier 1 and no softcap), never silently ignored.
  for (const auto& [key, neutral] : {std::pair<const char*, double>{"input_embedding_scale", 1.0},
                                     std::pair<const char*, double>{"output_multiplier", 1.0},
                                     std::pair<const char*, double>{"final_logit_softcapping", 0.0}}) {
    if (dflash2 && std::string(key) != "input_embedding_scale") continue;  // DFlash2's selector reads them
    const nlohmann::json v = draft_value(key);
    DIFFCP_CHECK(v.is_null() || (v.is_number() && v.get<double>() == neutral), "'", path, "': dflash_config.", key,
                 " = ", v.dump(), " is not supported (", neutral == 0.0 ? "none" : "1", " only)");
  }
  DrafterConfig c;
  if (dflash2) {  // the convolutions and the candidate selector: every key required
    const auto required = [&](const char* key) {
      DIFFCP_CHECK(!draft_value(key).is_null(), "'", path, "': dflash_config.", key, " is missing (a DFlash2 drafter has it)");
      return positive(dc.contains(key) ? dc : j, key, path);
    };
    c.conv_taps = required("conv_kernel_size");
    c.conv_group_size = required("conv_group_size");
    c.selector_rank = required("selector_rank");
    c.selector_top_k = required("selector_top_k");
    const nlohmann::json mult = draft_value("output_multiplier"), cap = draft_value("final_logit_softcapping");
    DIFFCP_CHECK(mult.is_null() || mult.is_number(), "'", path, "': dflash_config.output_multiplier = ", mult.dump());
    DIFFCP_CHECK(cap.is_null() || cap.is_number(), "'", path, "': dflash_config.final_logit_softcapping = ", cap.dump());
    c.output_multiplier = mult.is_null() ? 1.0 : mult.get<double>();
    c.logit_softcap = cap.is_null() ? 0.0 : cap.get<double>();
  }
  c.hidden = positive(j, "hidden_size", path);
  c.layers = positive(j, "num_hidden_layers", path);
  c.n_q = positive(j, "num_attention_heads", path);
  c.n_kv = j.contains("num_key_value_heads") ? positive(j, "num_key_value_heads", path) : c.n_q;
  c.d_h = j.contains("head_dim") && !j.at("head_dim").is_null() ? positive(j, "head_dim", path) : c.hidden / c.n_q;
  c.ffn = positive(j, "intermediate_size", path);
  c.vocab = positive(j, "vocab_size", path);
  c.block = dc.contains("block_size") ? positive(dc, "block_size", path) : positive(j, "block_size", path);
  c.rms_eps = j.contains("rms_norm_eps") ? field<double>(j, "rms_norm_eps", path) : 1e-6;
  if (j.contains("rope_theta")) {
    c.rope_theta = field<double>(j, "rope_theta", path);
  } else {
    DIFFCP_CHECK(j.contains("rope_parameters") && j.at("rope_parameters").contains("rope_theta"), "'", path,
                 "': rope_theta is missing (top level or rope_parameters.rope_theta)");
    const auto& rp = j.at("rope_parameters");
    for (auto it = rp.begin(); it != rp.end(); ++it)
      DIFFCP_CHECK(it.key() == "rope_theta" || (it.key() == "rope_type" && it.value() == "default"), "'", path,
                   "': rope_parameters.", it.key(), " = ", it.value().dump(), " is not supported (plain RoPE only)");
    c.rope_theta = field<double>(rp, "rope_theta", path);
  }
  DIFFCP_CHECK(c.rope_theta > 0 && c.rms_eps > 0, "'", path, "': rope_theta = ", c.rope_theta, " and rms_norm_eps = ",
               c.rms_eps, " must be > 0");
  DIFFCP_CHECK(dc.contains("mask_token_id"), "'", path, "': dflash_config.mask_token_id is missing");
  const auto mask = integer(dc.at("mask_token_id"), path, "dflash_config.mask_token_id");
  DIFFCP_CHECK(mask >= 0 && mask < c.vocab, "'", path, "': dflash_config.mask_token_id = ", mask, " outside the vocabulary [0, ",
               c.vocab, ")");
  c.mask_token = static_cast<std::int32_t>(mask);
  c.target_depth = j.contains("num_target_layers") ? positive(j, "num_target_layers", path) : 0;
  if (dc.contains("target_layer_ids")) {
    const auto& ids = dc.at("target_layer_ids");
    DIFFCP_CHECK(ids.is_array() && !ids.empty(), "'", path, "': dflash_config.target_layer_ids = ", ids.dump(),
                 ", expected a non-empty list of layer ids");
    c.target_layer_ids.clear();
    for (const auto& id : ids) c.target_layer_ids.push_back(integer(id, path, "dflash_config.target_layer_ids"));
  } else {  // the reference's default: one target layer per drafter layer
    DIFFCP_CHECK(c.target_depth > 0, "'", path, "': neither dflash_config.target_layer_ids nor num_target_layers");
    c.target_layer_ids = default_target_layer_ids(c.target_depth, c.layers);
  }
  c.target_layers = static_cast<std::int64_t>(c.target_layer_ids.size());
  read_layer_types(j, path, c);
  c.gamma = j.contains("diffcp") && j.at("diffcp").contains("gamma") ? field<double>(j.at("diffcp"), "gamma", path)
                                                                      : gamma_for_block(c.block);
  try {
    c.validate();
  } catch (const Error& e) {
    DIFFCP_FAIL("'", path, "': ", e.what());
  }
  return c;
}

}  // namespace

void export_dflash(const std::string& dir, const DrafterConfig& c, std::span<const float> params, const std::string& dtype,
                   std::int64_t max_positions) {
  (void)compute_dtype(dtype, "export dtype");
  DIFFCP_CHECK(max_positions >= 1, "export: max_position_embeddings ", max_positions, ", expected >= 1");
  DIFFCP_CHECK(c.has_conv() == c.has_selector(), "export: a drafter with ", c.has_conv() ? "" : "no ",
               "convolutions and ", c.has_selector() ? "a" : "no", " candidate selector; the released layouts have both "
               "(DFlash2DraftModel) or neither (DFlashDraftModel)");
  const DrafterLayout lay(c);
  DIFFCP_CHECK(static_cast<std::int64_t>(params.size()) == lay.total, "export: ", params.size(),
               " parameters, the model has ", lay.total);
  DIFFCP_CHECK(!c.target_layer_ids.empty() && c.target_depth > 0,
               "export: the model does not say which target layers its context features come from "
               "(dflash_config.target_layer_ids, num_target_layers); give `target_layer_ids` and `num_target_layers`");
  const auto a = AttnLayerParams::offsets(c.attn());
  for (std::int64_t l = 0; l < c.layers; ++l)
    for (std::int64_t k = 0; k < c.hidden; ++k)
      DIFFCP_CHECK(params[static_cast<std::size_t>(lay.layer[static_cast<std::size_t>(l)].attn + a[AttnLayerParams::bo] + k)] == 0.f,
                   "export: layer ", l, " has a non-zero attention output bias (b_o[", k,
                   "]); the DFlash format has none (a checkpoint from before b_o was fixed at zero?)");
  std::filesystem::create_directories(dir);

  const std::string arch = c.has_conv() ? "DFlash2DraftModel" : "DFlashDraftModel";
  nlohmann::json cfg = {
      {"architectures", {arch}},
      {"model_type", "qwen3"},
      {"auto_map", {{"AutoModel", "dflash." + arch}}},
      {"hidden_size", c.hidden},
      {"num_hidden_layers", c.layers},
      {"num_attention_heads", c.n_q},
      {"num_key_value_heads", c.n_kv},
      {"head_dim", c.d_h},
      {"intermediate_size", c.ffn},
      {"hidden_act", "silu"},
      {"vocab_size", c.vocab},
      {"rms_norm_eps", c.rms_eps},
      {"rope_theta", c.rope_theta},
      {"rope_scaling", nullptr},
      {"max_position_embeddings", max_positions},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"tie_word_embeddings", false},
      {"use_cache", true},
      {"torch_dtype", dtype == "bf16" ? "bfloat16" : "float32"},
      {"layer_types", c.layer_types.empty() ? std::vector<std::string>(static_cast<std::size_t>(c.layers), "full_attention")
                                             : c.layer_types},
      {"use_sliding_window", c.sliding_window > 0},
      {"sliding_window", c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json()},
      {"max_window_layers", c.layers},
      {"block_size", c.block},
      {"num_target_layers", c.target_depth},
      {"dflash_config", {{"target_layer_ids", c.target_layer_ids}, {"mask_token_id", c.mask_token}}},
      {"diffcp", {{"gamma", c.gamma}}},
  };

  if (c.is_causal) cfg["is_causal"] = *c.is_causal;
  if (c.has_conv()) {
    auto& dc = cfg["dflash_config"];
    dc["block_size"] = c.block;
    dc["conv_kernel_size"] = c.conv_taps;
    dc["conv_group_size"] = c.conv_group_size;
    dc["selector_rank"] = c.selector_rank;
    dc["selector_top_k"] = c.selector_top_k;
    if (c.output_multiplier != 1.0) dc["output_multiplier"] = c.output_multiplier;
    if (c.logit_softcap != 0.0) dc["final_logit_softcapping"] = c.logit_softcap;
  }

  // Transposed [out, in] copies, in the storage dtype.
  const auto list = entries(c);
  std::vector<std::vector<float>> f32(list.size());
  std::vector<std::vector<std::uint16_t>> b16(list.size());
  std::vector<NamedTensor> tensors;
  for (std::size_t t = 0; t < list.size(); ++t) {
    const Entry& e = list[t];
    std::vector<float> v(static_cast<std::size_t>(e.count()));
    const float* src = params.data() + e.offset;
    if (e.in == 0) std::copy_n(src, e.out, v.begin());
    else
      for (std::int64_t i = 0; i < e.in; ++i)
        for (std::int64_t o = 0; o < e.out; ++o) v[static_cast<std::size_t>(o * e.in + i)] = src[i * e.out + o];
    if (dtype == "bf16") {
      b16[t].resize(v.size());
      for (std::size_t i = 0; i < v.size(); ++i) b16[t][i] = f32_to_bf16(v[i]);
      tensors.push_back({e.name, "BF16", e.shape(), b16[t].data()});
    } else {
      f32[t] = std::move(v);
      tensors.push_back({e.name, "F32", e.shape(), f32[t].data()});
    }
  }
  write_safetensors(dir + "/model.safetensors", tensors);
  write_text_atomically(dir + "/config.json", cfg.dump(2) + "\n");
}

DrafterWeights import_dflash(const std::string& dir) {
  const std::string cpath = dir + "/config.json", mpath = dir + "/model.safetensors";
  DIFFCP_CHECK(std::filesystem::is_directory(dir), "`init` '", dir, "': not a directory (expected config.json + model.safetensors)");
  std::ifstream f(cpath);
  DIFFCP_CHECK(f.good(), "'", cpath, "': cannot open it (a DFlash drafter directory has config.json + model.safetensors)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    DIFFCP_FAIL("'", cpath, "' is not valid JSON: ", e.what());
  }
  DrafterWeights w;
  w.config = config_from_hf(j, cpath);
  DIFFCP_CHECK(std::filesystem::exists(mpath), "'", mpath, "' is missing",
               std::filesystem::exists(dir + "/model.safetensors.index.json")
                   ? " (sharded files with an index are not supported: a drafter is one file)" : "");
  const SafeTensors st(mpath);
  const auto list = entries(w.config);
  w.params.assign(static_cast<std::size_t>(DrafterLayout(w.config).total), 0.f);  // b_o stays zero
  std::set<std::string> expected;
  for (const Entry& e : list) {
    expected.insert(e.name);
    DIFFCP_CHECK(st.has(e.name), "'", mpath, "': tensor '", e.name, "' is missing (config: ", w.config.layers,
                 " layers, hidden ", w.config.hidden, ")");
    const auto& info = st.info(e.name);
    DIFFCP_CHECK(info.shape == e.shape(), "'", mpath, "': tensor '", e.name, "' has shape ",
                 nlohmann::json(info.shape).dump(), ", config.json implies ", nlohmann::json(e.shape()).dump());
    const std::vector<float> v = st.to_f32(e.name);
    float* dst = w.params.data() + e.offset;
    if (e.in == 0) std::copy(v.begin(), v.end(), dst);
    else
      for (std::int64_t o = 0; o < e.out; ++o)
        for (std::int64_t i = 0; i < e.in; ++i) dst[i * e.out + o] = v[static_cast<std::size_t>(o * e.in + i)];
  }
  for (const auto& name : st.names())
    DIFFCP_CHECK(expected.count(name) != 0, "'", mpath, "': unexpected tensor '", name,
                 "' (not part of a DFlash drafter with this config; biases are not supported)");
  return w;
}

}  // namespace diffcp
