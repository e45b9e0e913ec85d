// FLUX-format checkpoints (issue #19), single process: f16 rounding, sharded sets with an index
// JSON, shape inference and FluxParams configs (FLUX.1's real shape), BF16 / F16 loading, every
// malformed case named, FLUX's shifted schedule, and the memory a load holds (mapped, not copied).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "diffcp/core/error.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/dit/model.hpp"
#include "diffcp/dit/sampler.hpp"
#include "diffcp/io/safetensors.hpp"
#include "error_of.hpp"

namespace diffcp {
namespace {

namespace fs = std::filesystem;

// A fresh per-process folder, removed at the end of the test.
struct TempDir {
  fs::path path = fs::temp_directory_path() / ("diffcp_flux_" + std::to_string(::getpid()) + "_" +
                                               ::testing::UnitTest::GetInstance()->current_test_info()->name());
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& f) const { return (path / f).string(); }
};

// 4 heads x 8, 1 double + 2 single blocks, guidance_in, C_in 16.
DitConfig small_config() {
  DitConfig c = dit_preset("tiny");
  c.heads = 4;
  c.head_dim = 8;
  c.rope_axes = flux_rope_axes(8);
  c.double_blocks = 1;
  c.single_blocks = 2;
  c.mlp_hidden = 128;
  c.text_dim = 12;
  c.pooled_dim = 10;
  c.time_dim = 256;
  c.guidance_embed = true;
  return c;
}

void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream f(path);
  f << j.dump();
}

TEST(Half, F16RoundingMatchesIeee) {
  // Every finite f16 survives f16 -> f32 -> f16; NaN stays NaN.
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = f16_to_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    ASSERT_EQ(f32_to_f16(f), h) << std::hex << h;
  }
  // numpy.float16 of these float32 values (round to nearest even, overflow to inf, subnormals).
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(65504.f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.f), 0x7c00);  // the tie above the largest finite rounds to inf
  EXPECT_EQ(f32_to_f16(6e-8f), 0x0001);
  EXPECT_EQ(f32_to_f16(1e-8f), 0x0000);
  EXPECT_EQ(f32_to_f16(3e-5f), 0x01f7);
  EXPECT_EQ(f32_to_f16(-2.5f), 0xc100);
  EXPECT_EQ(f32_to_f16(0.1f), 0x2e66);
  EXPECT_EQ(f32_to_f16(1.0f + 1.0f / 2048), 0x3c00);  // tie: to even
  EXPECT_EQ(f32_to_f16(1.0f + 3.0f / 2048), 0x3c02);  // tie: to even (up)
}

TEST(FluxCheckpoint, Bf16AndF16LoadAsTheRoundedWeights) {
  TempDir dir;
  const DitConfig cfg = small_config();
  DitWeights w(cfg);
  w.init_random(3);
  for (const char* dtype : {"BF16", "F16"}) {
    SCOPED_TRACE(dtype);
    const std::string path = dir / (std::string(dtype) + ".safetensors");
    w.save(path, dtype);
    DitWeights back(cfg);
    back.load(path);
    const std::vector<float> p = w.host_params(), got = back.host_params();
    for (std::size_t i = 0; i < p.size(); ++i) {
      const float v = p[i];
      const float want = std::string(dtype) == "BF16" ? bf16_to_f32(f32_to_bf16(v)) : f16_to_f32(f32_to_f16(v));
      ASSERT_EQ(got[i], want) << i;
    }
  }
  EXPECT_NE(error_of([&] { w.save(dir / "x.safetensors", "F64"); }).find("expected F32, BF16 or F16"), std::string::npos);
}

// Splits the file's tensors over two shards + an index, as Hugging Face ships large models.
void write_sharded(const DitWeights& w, const TempDir& dir, nlohmann::json& index) {
  const std::string one = dir / "all.safetensors";
  w.save(one);
  const SafeTensors st(one);
  const std::vector<std::string> names = st.names();
  std::vector<std::vector<float>> data;
  std::vector<NamedTensor> shard[2];
  for (const std::string& n : names) data.push_back(st.f32(n));
  for (std::size_t i = 0; i < names.size(); ++i) {
    const int s = i % 2;
    shard[s].push_back({names[i], "F32", st.info(names[i]).shape, data[i].data()});
    index["weight_map"][names[i]] = "part-" + std::to_string(s) + ".safetensors";
  }
  for (int s = 0; s < 2; ++s) write_safetensors(dir / ("part-" + std::to_string(s) + ".safetensors"), shard[s]);
  index["metadata"] = {{"total_size", 0}};
}

TEST(FluxCheckpoint, ShardedSetWithIndex) {
  TempDir dir;
  const DitConfig cfg = small_config();
  DitWeights w(cfg);
  w.init_random(4);
  nlohmann::json index;
  write_sharded(w, dir, index);
  write_json(dir / "model.safetensors.index.json", index);
  const SafeTensorsSet set(dir / "model.safetensors.index.json");
  EXPECT_EQ(set.files(), 2u);
  EXPECT_EQ(infer_dit_config(set).to_json(), cfg.to_json());
  DitWeights back(cfg);
  back.load(set);
  EXPECT_EQ(back.host_params(), w.host_params());

  const auto bad_index = [&](auto edit) {
    nlohmann::json j = index;
    edit(j);
    write_json(dir / "bad.json", j);
    return error_of([&] { SafeTensorsSet s(dir / "bad.json"); });
  };
  // A tensor mapped to the wrong shard; a shard tensor the map does not list; a missing shard;
  // paths outside the folder; no weight_map.
  const std::string other = index["weight_map"]["img_in.weight"] == "part-0.safetensors" ? "part-1.safetensors" : "part-0.safetensors";
  EXPECT_NE(bad_index([&](nlohmann::json& j) { j["weight_map"]["img_in.weight"] = other; })
                .find("tensor 'img_in.weight' is mapped to '" + other + "', which does not hold it"),
            std::string::npos);
  EXPECT_NE(bad_index([](nlohmann::json& j) { j["weight_map"].erase("img_in.bias"); })
                .find("holds tensor 'img_in.bias', which the weight_map does not list"),
            std::string::npos);
  EXPECT_NE(bad_index([](nlohmann::json& j) { j["weight_map"]["img_in.bias"] = "part-9.safetensors"; }).find("cannot open"),
            std::string::npos);
  for (const char* outside : {"/etc/passwd", "../part-0.safetensors", "sub/../../x.safetensors"})
    EXPECT_NE(bad_index([&](nlohmann::json& j) { j["weight_map"]["img_in.bias"] = outside; })
                  .find("expected a file name relative to the index's folder (no '..')"),
              std::string::npos)
        << outside;
  EXPECT_NE(bad_index([](nlohmann::json& j) { j.erase("weight_map"); }).find("\"weight_map\""), std::string::npos);
  {
    std::ofstream f(dir / "bad.json");
    f << "{ not json";
  }
  EXPECT_NE(error_of([&] { SafeTensorsSet s(dir / "bad.json"); }).find("not valid JSON"), std::string::npos);
}

TEST(FluxCheckpoint, ShapeInferenceAndItsErrors) {
  TempDir dir;
  for (const bool guidance : {false, true})
    for (const bool qkv_bias : {false, true})
      for (const std::int64_t doubles : {0, 2}) {
        DitConfig cfg = small_config();
        cfg.guidance_embed = guidance;
        cfg.qkv_bias = qkv_bias || doubles == 0;  // without double blocks there is no qkv to have a bias
        cfg.double_blocks = doubles;
        DitWeights w(cfg);
        w.init_random(1);
        w.save(dir / "m.safetensors", "BF16");
        const DitConfig got = infer_dit_config(SafeTensorsSet(dir / "m.safetensors"));
        EXPECT_EQ(got.to_json(), cfg.to_json()) << got.to_json().dump() << "\nvs " << cfg.to_json().dump();
      }
  const DitConfig cfg = small_config();
  DitWeights w(cfg);
  w.save(dir / "m.safetensors");
  const SafeTensorsSet set(dir / "m.safetensors");
  EXPECT_EQ(infer_dit_config(set, 4).heads, 4);
  EXPECT_NE(error_of([&] { infer_dit_config(set, 3); }).find("`heads` 3 disagrees with the checkpoint: hidden 32 / head dim 8"),
            std::string::npos);
  // diffusers' and ComfyUI's names: nothing to read the shape from, and the message says why.
  std::vector<float> x(4, 0.f);
  write_safetensors(dir / "diffusers.safetensors", {{"x_embedder.weight", "F32", {2, 2}, x.data()}});
  const std::string diffusers = error_of([&] { infer_dit_config(SafeTensorsSet(dir / "diffusers.safetensors")); });
  EXPECT_NE(diffusers.find("cannot infer the model shape without tensor 'img_in.weight'"), std::string::npos);
  EXPECT_NE(diffusers.find("diffusers' names, e.g. 'x_embedder.weight'"), std::string::npos) << diffusers;
  write_safetensors(dir / "comfy.safetensors", {{"model.diffusion_model.img_in.weight", "F32", {2, 2}, x.data()}});
  EXPECT_NE(error_of([&] { check_dit_checkpoint(cfg, SafeTensorsSet(dir / "comfy.safetensors")); }).find("ComfyUI's layout"),
            std::string::npos);
  // A guidance-distilled file read with a config that says otherwise: the extra tensors are named.
  DitConfig no_guidance = cfg;
  no_guidance.guidance_embed = false;
  const std::string err = error_of([&] { check_dit_checkpoint(no_guidance, set); });
  for (const char* want : {"4 tensors this model does not have", "'guidance_in.in_layer.weight' F32 [32, 256]",
                           "guidance_embed = true"})
    EXPECT_NE(err.find(want), std::string::npos) << want << "\n" << err;
}

TEST(FluxCheckpoint, FluxParamsConfigAndTheRealFlux1Shape) {
  // FLUX.1-dev's FluxParams (black-forest-labs/flux, util.py configs["flux-dev"]).
  const DitConfig c = read_dit_config(std::string(DIFFCP_TEST_DATA) + "/flux1-dev.json");
  EXPECT_EQ(c.hidden(), 3072);
  EXPECT_EQ(c.heads, 24);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.double_blocks, 19);
  EXPECT_EQ(c.single_blocks, 38);
  EXPECT_EQ(c.mlp_hidden, 12288);
  EXPECT_EQ(c.in_channels(), 64);
  EXPECT_EQ(c.text_dim, 4096);
  EXPECT_EQ(c.pooled_dim, 768);
  EXPECT_EQ(c.rope_axes, (std::vector<std::int64_t>{16, 56, 56}));
  EXPECT_EQ(flux_rope_axes(128), c.rope_axes);
  EXPECT_TRUE(c.guidance_embed && c.qkv_bias);
  // FLUX.1-dev's published parameter count (11.9B); schnell lacks guidance_in.
  EXPECT_EQ(DitLayout(c).parameters, 11901408320);
  DitConfig schnell = c;
  schnell.guidance_embed = false;
  EXPECT_EQ(DitLayout(schnell).parameters, 11901408320 - (256 * 3072 + 3072 + 3072 * 3072 + 3072));
  EXPECT_EQ(dit_config_from_flux_params(c.to_flux_params(), "round trip").to_json(), c.to_json());

  const nlohmann::json good = c.to_flux_params();
  const auto err = [&](auto edit) {
    nlohmann::json j = good;
    edit(j);
    return error_of([&] { dit_config_from_flux_params(j, "cfg.json"); });
  };
  EXPECT_NE(err([](nlohmann::json& j) { j["num_layers"] = 19; }).find("unknown field 'num_layers'"), std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["num_layers"] = 19; }).find("diffusers"), std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j.erase("depth"); }).find("missing field 'depth'"), std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["depth"] = 19.5; }).find("field 'depth' = 19.5, expected a non-negative integer"),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["out_channels"] = 16; }).find("out_channels = 16 != in_channels = 64"),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["num_heads"] = 7; }).find("hidden_size = 3072 is not a multiple of num_heads = 7"),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["axes_dim"] = {16, 56, 58}; }).find("rope axes [16,56,58] sum to 130"),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["qkv_bias"] = 1; }).find("field 'qkv_bias' = 1, expected true or false"),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["in_channels"] = 62; }).find("in_channels = 62, expected a positive multiple of 4"),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["mlp_ratio"] = -1; }).find("mlp_ratio = -1"), std::string::npos);
  EXPECT_NE(error_of([] { read_dit_config("/nonexistent/flux.json"); }).find("cannot open"), std::string::npos);
}

// Qwen/Qwen-Image's published transformer config.json (tests/data): the family, its shape and its
// published parameter count (20.43B); the fields that select the edit / layered variants and shapes
// the pipeline cannot pack are refused by name.
TEST(FluxCheckpoint, QwenImageDiffusersConfigAndTheRealShape) {
  const std::string path = std::string(DIFFCP_TEST_DATA) + "/qwen-image-diffusers.json";
  std::ifstream f(path);
  const nlohmann::json good = nlohmann::json::parse(f);
  const DitConfig c = dit_config_from_diffusers(good, path);
  EXPECT_EQ(c.family, DitFamily::qwen_image);
  EXPECT_TRUE(c.true_cfg() && !c.has_pooled() && !c.guidance_embed);
  EXPECT_EQ(c.hidden(), 3072);
  EXPECT_EQ(c.double_blocks, 60);
  EXPECT_EQ(c.single_blocks, 0);
  EXPECT_EQ(c.mlp_hidden, 12288);
  EXPECT_EQ(c.in_channels(), 64);
  EXPECT_EQ(c.text_dim, 3584);
  EXPECT_EQ(c.pooled_dim, 0);
  EXPECT_EQ(c.rope_axes, (std::vector<std::int64_t>{16, 56, 56}));
  EXPECT_EQ(DitLayout(c).parameters, 20430401088);
  EXPECT_NE(error_of([&] { c.to_flux_params(); }).find("no FluxParams"), std::string::npos);
  const auto err = [&](auto edit) {
    nlohmann::json j = good;
    edit(j);
    return error_of([&] { dit_config_from_diffusers(j, "cfg.json"); });
  };
  EXPECT_NE(err([](nlohmann::json& j) { j["num_single_layers"] = 1; }).find("unknown field 'num_single_layers' for QwenImageTransformer2DModel"),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["use_layer3d_rope"] = true; }).find("use_layer3d_rope = true is not supported"),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["patch_size"] = 1; }).find("patch_size = 1"), std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["out_channels"] = 8; }).find("in_channels = 64 != out_channels (8) x patch_size^2"),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["axes_dims_rope"] = {16, 56}; }).find("2 RoPE axes, but the positions (frame, row, column) need 3"),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["num_layers"] = -1; }).find("field 'num_layers' = -1"), std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["_class_name"] = "QwenImageTransformer3DModel"; }).find("supported: "),
            std::string::npos);
  // The diffusers names of the family's own tensors.
  const std::pair<const char*, const char*> names[] = {
      {"txt_norm.scale", "txt_norm.weight"},
      {"double_blocks.3.txt_mod.lin.weight", "transformer_blocks.3.txt_mod.1.weight"},
      {"double_blocks.0.img_mlp.2.bias", "transformer_blocks.0.img_mlp.net.2.bias"},
      {"time_in.out_layer.weight", "time_text_embed.timestep_embedder.linear_2.weight"}};
  int found = 0;
  for (const DitLayout::Tensor& t : DitLayout(c).tensors)
    for (const auto& [ours, theirs] : names)
      if (t.name == ours) {
        EXPECT_EQ(dit_file_parts(t, c, DitFileFormat::diffusers).at(0).name, theirs);
        ++found;
      }
  EXPECT_EQ(found, 4);
}

// FLUX.2-dev's transformer config.json (tests/data): its shape and parameter count (32.2B), and
// Flux2Pipeline's sigmas (compute_empirical_mu, not the config's base / max shift).
TEST(FluxCheckpoint, Flux2DiffusersConfigTheRealShapeAndItsSigmas) {
  const std::string path = std::string(DIFFCP_TEST_DATA) + "/flux2-dev-diffusers.json";
  std::ifstream f(path);
  const nlohmann::json good = nlohmann::json::parse(f);
  const DitConfig c = dit_config_from_diffusers(good, path);
  EXPECT_EQ(c.family, DitFamily::flux2);
  EXPECT_TRUE(c.guidance_embed && !c.has_pooled() && !c.biases() && c.swiglu() && c.shared_modulation());
  EXPECT_EQ(c.hidden(), 6144);
  EXPECT_EQ(c.double_blocks, 8);
  EXPECT_EQ(c.single_blocks, 48);
  EXPECT_EQ(c.mlp_hidden, 18432);
  EXPECT_EQ(c.in_channels(), 128);
  EXPECT_EQ(c.rope_axes, (std::vector<std::int64_t>{32, 32, 32, 32}));
  EXPECT_EQ(c.rope_theta, 2000);
  EXPECT_EQ(DitLayout(c).parameters, 32223281152);
  const auto err = [&](auto edit) {
    nlohmann::json j = good;
    edit(j);
    return error_of([&] { dit_config_from_diffusers(j, "cfg.json"); });
  };
  EXPECT_NE(err([](nlohmann::json& j) { j["qk_norm"] = "rms"; }).find("unknown field 'qk_norm' for Flux2Transformer2DModel"),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["patch_size"] = 2; }).find("patch_size = 2"), std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["out_channels"] = 64; }).find("out_channels = 64"), std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["axes_dims_rope"] = {32, 32, 64}; }).find("3 RoPE axes"), std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["mlp_ratio"] = 0; }).find("'mlp_ratio' = 0, expected a positive number"),
            std::string::npos);
  // Flux2Pipeline: 4096 image tokens, 28 steps: mu = a 28 + b between the 10- and 200-step fits.
  FlowMatchEulerScheduler s;
  s.dynamic = true;
  const std::vector<double> sig = s.pipeline_sigmas(28, 4096, DitFamily::flux2);
  const double m200 = 0.00016927 * 4096 + 0.45666666, m10 = 8.73809524e-05 * 4096 + 1.89833333;
  const double a = (m200 - m10) / 190.0, mu = a * 28 + (m200 - 200 * a);
  ASSERT_EQ(sig.size(), 29u);
  EXPECT_DOUBLE_EQ(sig[0], 1.0);
  const double s1 = 1.0 + (1.0 / 28 - 1.0) / 27;  // linspace(1, 1/28, 28)[1]
  EXPECT_NEAR(sig[1], std::exp(mu) / (std::exp(mu) + 1 / s1 - 1), 1e-14);
  EXPECT_EQ(sig[28], 0.0);
  EXPECT_NE(s.pipeline_sigmas(28, 5000, DitFamily::flux2)[1], s.pipeline_sigmas(28, 5000, DitFamily::flux1)[1]);
}

// SD3.5-large's transformer config.json (tests/data): its shape and parameter count (8.1B with the
// position table), the patchified latent's round trip, proj_out's reordered rows, the sigmas.
TEST(FluxCheckpoint, Sd3DiffusersConfigLatentLayoutAndSigmas) {
  const std::string path = std::string(DIFFCP_TEST_DATA) + "/sd3.5-large-diffusers.json";
  std::ifstream f(path);
  const nlohmann::json good = nlohmann::json::parse(f);
  const DitConfig c = dit_config_from_diffusers(good, path);
  EXPECT_EQ(c.family, DitFamily::sd3);
  EXPECT_TRUE(c.true_cfg() && !c.cfg_keeps_norm() && c.has_pooled() && c.rope_axes.empty());
  EXPECT_EQ(c.hidden(), 2432);
  EXPECT_EQ(c.heads, 38);
  EXPECT_EQ(c.double_blocks, 38);
  EXPECT_EQ(c.pos_embed_max, 192);
  EXPECT_EQ(c.in_channels(), 64);
  EXPECT_EQ(DitLayout(c).parameters, 8146280768);
  const auto err = [&](auto edit) {
    nlohmann::json j = good;
    edit(j);
    return error_of([&] { dit_config_from_diffusers(j, "cfg.json"); });
  };
  EXPECT_NE(err([](nlohmann::json& j) { j["dual_attention_layers"] = {0, 1}; }).find("dual_attention_layers = [0,1] is not supported"),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["qk_norm"] = nullptr; }).find("qk_norm = null"), std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["caption_projection_dim"] = 1536; }).find("caption_projection_dim = 1536"),
            std::string::npos);
  EXPECT_NE(err([](nlohmann::json& j) { j["out_channels"] = 8; }).find("out_channels = 8 != in_channels = 16"), std::string::npos);
  // tokens <-> [b, C, H/8, W/8]: a round trip, and the (c, ph, pw) channel order
  DitConfig t = c;
  t.latent_channels = 3;
  const DitShape shape{2, 64, 32, 4};  // 4 x 2 tokens
  std::vector<float> img(static_cast<std::size_t>(2 * 3 * 4 * 8));
  for (std::size_t i = 0; i < img.size(); ++i) img[i] = static_cast<float>(i);
  const std::vector<float> tok = pack_latent(img, t, shape);
  EXPECT_EQ(unpack_latent(tok, t, shape), img);
  // image 1, channel 2, pixel (y 3, x 5) -> token (1, 2) of image 1, channel 2 * 4 + 1 * 2 + 1
  EXPECT_EQ(tok[static_cast<std::size_t>((1 * 8 + 1 * 4 + 2) * 12 + 2 * 4 + 3)], img[static_cast<std::size_t>(((1 * 3 + 2) * 4 + 3) * 8 + 5)]);
  // proj_out: our row c * 4 + ph * 2 + pw is diffusers' (ph * 2 + pw) * C + c
  for (const DitLayout::Tensor& x : DitLayout(c).tensors)
    if (x.name == "final_layer.linear.bias") {
      const std::vector<DitFilePart> parts = dit_file_parts(x, c, DitFileFormat::diffusers);
      ASSERT_EQ(parts.size(), 64u);
      EXPECT_EQ(parts[4 * 5 + 2 * 1 + 0].row0, (1 * 2 + 0) * 16 + 5);
      EXPECT_EQ(parts[0].name, "proj_out.bias");
    }
  // StableDiffusion3Pipeline's sigmas at shift 3: shift(linspace(1, shift(1/1000), N))
  FlowMatchEulerScheduler s;
  s.shift = 3;
  const std::vector<double> sig = s.pipeline_sigmas(28, 4096, DitFamily::sd3);
  const auto shifted = [](double x) { return 3 * x / (1 + 2 * x); };
  ASSERT_EQ(sig.size(), 29u);
  EXPECT_DOUBLE_EQ(sig[0], 1.0);
  EXPECT_NEAR(sig[27], shifted(shifted(1e-3)), 1e-15);
  EXPECT_NEAR(sig[13], shifted(1 + (shifted(1e-3) - 1) * 13 / 27.0), 1e-15);
}

TEST(FluxCheckpoint, FluxScheduleIsFluxsShiftedSchedule) {
  // mu = 0.5 at 256 image tokens, 1.15 at 4096; t = e^mu / (e^mu + 1/s - 1) on s = 1 - k/T.
  EXPECT_DOUBLE_EQ(flux_shift_mu(256), 0.5);
  EXPECT_NEAR(flux_shift_mu(4096), 1.15, 1e-15);
  const std::vector<double> t = flow_schedule(4, TimeSchedule::flux, 256);
  ASSERT_EQ(t.size(), 5u);
  EXPECT_EQ(t[0], 1.0);
  EXPECT_EQ(t[4], 0.0);
  const double e = std::exp(0.5);
  for (int k = 1; k < 4; ++k) {
    const double s = 1.0 - k / 4.0;
    EXPECT_NEAR(t[static_cast<std::size_t>(k)], e / (e + 1 / s - 1), 1e-15);
  }
  EXPECT_NEAR(t[1], 0.8318, 1e-4);  // as FLUX's get_schedule(4, 256) prints
  EXPECT_EQ(flow_schedule(4, TimeSchedule::linear, 256), (std::vector<double>{1.0, 0.75, 0.5, 0.25, 0.0}));
  // More image tokens shift the schedule towards t = 1 (more steps at high noise).
  EXPECT_GT(flow_schedule(4, TimeSchedule::flux, 4096)[2], t[2]);
  EXPECT_EQ(parse_time_schedule("flux"), TimeSchedule::flux);
  EXPECT_NE(error_of([] { parse_time_schedule("cosine"); }).find("`schedule` 'cosine': unknown schedule"), std::string::npos);
}

// Peak resident memory of this process, and a reset of it to the current RSS (Linux >= 4.0).
std::int64_t status_kib(const char* key) {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(std::strlen(key)));
  return -1;
}

// Loading maps the file and converts tensor by tensor, releasing each one's pages: the peak
// holds the parameters plus about one tensor of the file, not a copy of the whole file (which the
// previous reader made: parameters + file = 2x here).
TEST(FluxCheckpoint, LoadingHoldsTheParametersPlusOneTensor) {
  TempDir dir;
  DitConfig cfg = small_config();
  cfg.heads = 8;
  cfg.head_dim = 64;  // H = 512
  cfg.rope_axes = flux_rope_axes(64);
  cfg.mlp_hidden = 2048;
  cfg.double_blocks = 2;
  cfg.single_blocks = 4;  // ~37M parameters: 150 MB in f32
  const std::string path = dir / "big.safetensors";
  std::int64_t largest = 0;
  {
    DitWeights w(cfg);
    w.init_random(2);
    w.save(path);
    for (const DitLayout::Tensor& t : w.layout().tensors) largest = std::max(largest, t.size);
  }
  DitWeights w(cfg);  // the parameters are allocated (and zeroed: resident) here
  const double param_bytes = 4.0 * static_cast<double>(w.layout().total);
  {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";
  }
  const std::int64_t before = status_kib("VmRSS:"), hwm_reset = status_kib("VmHWM:");
  ASSERT_GT(before, 0);
  if (hwm_reset > before + 1024) GTEST_SKIP() << "this kernel cannot reset VmHWM (/proc/self/clear_refs)";
  w.load(path);
  const double grew = 1024.0 * static_cast<double>(status_kib("VmHWM:") - before);
  const double bound = 4.0 * static_cast<double>(largest) + 16.0 * (1 << 20);  // one tensor + 16 MiB slack
  EXPECT_LT(grew, bound) << "loading " << param_bytes / 1e6 << " MB of parameters raised the peak by " << grew / 1e6
                         << " MB; one tensor is " << 4e-6 * static_cast<double>(largest) << " MB";
  EXPECT_GT(param_bytes, 4 * bound);  // the file is far larger than the bound: a full copy would fail
  RecordProperty("peak_growth_bytes", std::to_string(grew));
}

}  // namespace
}  // namespace diffcp
