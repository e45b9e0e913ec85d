// The DFlash drafter format (drafter/hf_format.hpp) and one-block drafting (drafter/draft.hpp),
// at every rank count: export -> import is bitwise, bf16 re-export is bitwise, every malformed
// directory is refused by name, `draft_block` equals an fp64 reference of the reference
// implementation's forward, and a training run started from an imported drafter equals one
// started from the same parameters natively.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include <gtest/gtest.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "diffcp/testing/compare.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/cp/attention_layer.hpp"
#include "diffcp/drafter/checkpoint.hpp"
#include "diffcp/drafter/draft.hpp"
#include "diffcp/drafter/draft_cache.hpp"
#include "diffcp/drafter/hf_format.hpp"
#include "diffcp/drafter/model.hpp"
#include "diffcp/drafter/trainer.hpp"
#include "diffcp/io/safetensors.hpp"
#include "diffcp/ops/buffer.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

namespace fs = std::filesystem;
using Vec = std::vector<double>;

template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what() << "\nexpected: " << needle;
  }
}

// A directory of this process only (the np variants of this test run concurrently under ctest -j).
std::string own_dir(const std::string& what) {
  return (fs::temp_directory_path() / ("diffcp_test_dflash_" + what + "_" + std::to_string(::getpid()))).string();
}

// A directory shared by the ranks of this test run (rank 0 makes it empty).
std::string shared_dir(const std::string& what) {
  Communicator& w = test::world();
  const std::string d = (fs::temp_directory_path() / ("diffcp_test_dflash_np" + std::to_string(w.size()) + "_" + what)).string();
  if (w.rank() == 0) {
    fs::remove_all(d);
    fs::create_directories(d);
  }
  w.barrier();
  return d;
}

// The tiny preset with trained-looking parameters: the seeded init, then every norm weight moved
// off 1 (so a misplaced norm shows); b_o stays zero.
std::vector<float> test_params(const DrafterConfig& cfg, std::uint64_t seed) {
  Drafter d(test::world(), cfg);
  d.init_params(seed);
  std::vector<float> p = to_host<float>(d.params().view());
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0.0, 0.2);
  const DrafterLayout lay(cfg);
  const auto a = AttnLayerParams::offsets(cfg.attn());
  for (const auto& [off, len] : lay.vectors)
    for (std::int64_t j = 0; j < len; ++j) p[static_cast<std::size_t>(off + j)] += static_cast<float>(n(rng));
  for (const auto& L : lay.layer) std::fill_n(p.begin() + L.attn + a[AttnLayerParams::bo], cfg.hidden, 0.f);
  if (cfg.has_conv())  // DFlash2: the taps' projections off zero too (the bases are vectors: moved above)
    for (const auto& L : lay.layer)
      for (const std::int64_t proj : {L.attn_conv_proj, L.mlp_conv_proj})
        for (std::int64_t j = 0; j < cfg.hidden * 2 * cfg.conv_taps * cfg.conv_groups(); ++j)
          p[static_cast<std::size_t>(proj + j)] = static_cast<float>(n(rng));
  return p;
}

// ---- fp64 reference of one draft block, written from the reference implementation's math:
// ctx = RMSNorm(H fc); per layer x += o_proj(SDPA(q, [k_ctx; k_blk], [v_ctx; v_blk])) with q, k
// per-head RMSNorm'ed then RoPE'd (rotate-half; context at 0..ctx-1, block at ctx..ctx+B-1), the
// context straight into k/v (no input_layernorm), the block after input_layernorm; x += MLP; the
// final norm.
struct Ref {
  const DrafterConfig& c;
  const std::vector<float>& p;
  DrafterLayout lay{c};
  double at(std::int64_t off) const { return static_cast<double>(p[static_cast<std::size_t>(off)]); }
  // y [n, out] = x [n, in] W, W stored [in, out] at off
  Vec lin(const Vec& x, std::int64_t n, std::int64_t in, std::int64_t off, std::int64_t out) const {
    Vec y(static_cast<std::size_t>(n * out), 0.0);
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t i = 0; i < in; ++i)
        for (std::int64_t o = 0; o < out; ++o) y[static_cast<std::size_t>(r * out + o)] += x[static_cast<std::size_t>(r * in + i)] * at(off + i * out + o);
    return y;
  }
  // RMSNorm of every `w`-wide group of x, weight at off
  Vec norm(Vec x, std::int64_t w, std::int64_t off) const {
    for (std::size_t g = 0; g < x.size(); g += static_cast<std::size_t>(w)) {
      double ss = 0;
      for (std::int64_t j = 0; j < w; ++j) ss += x[g + static_cast<std::size_t>(j)] * x[g + static_cast<std::size_t>(j)];
      const double r = 1.0 / std::sqrt(ss / static_cast<double>(w) + c.rms_eps);
      for (std::int64_t j = 0; j < w; ++j) x[g + static_cast<std::size_t>(j)] *= r * at(off + j);
    }
    return x;
  }
  void rope(Vec& x, std::int64_t n, std::int64_t heads, std::int64_t pos0) const {
    const std::int64_t d = c.d_h, half = d / 2;
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t h = 0; h < heads; ++h)
        for (std::int64_t i = 0; i < half; ++i) {
          const double ang = static_cast<double>(pos0 + r) * std::pow(c.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(d));
          double& a = x[static_cast<std::size_t>((r * heads + h) * d + i)];
          double& b = x[static_cast<std::size_t>((r * heads + h) * d + i + half)];
          const double a0 = a, b0 = b;
          a = a0 * std::cos(ang) - b0 * std::sin(ang);
          b = b0 * std::cos(ang) + a0 * std::sin(ang);
        }
  }
  // DFlash2 (z-lab's GroupedDynamicCausalConv over the block's B rows): y[t, c] = sum over
  // o <= min(K - 1, t) of (base[half, o, c] + dyn[t, half, o, c / gs]) x[t - o, c]
  Vec conv(const Vec& x, const Vec& dyn, std::int64_t half, std::int64_t base) const {
    const std::int64_t H = c.hidden, B = c.block, K = c.conv_taps, G = c.conv_groups(), KG = K * G;
    Vec y(x.size(), 0.0);
    for (std::int64_t t = 0; t < B; ++t)
      for (std::int64_t ch = 0; ch < H; ++ch)
        for (std::int64_t o = 0; o < K && o <= t; ++o)
          y[static_cast<std::size_t>(t * H + ch)] +=
              (at(base + (half * K + o) * H + ch) + dyn[static_cast<std::size_t>(t * 2 * KG + half * KG + o * G + ch / c.conv_group_size)]) *
              x[static_cast<std::size_t>((t - o) * H + ch)];
    return y;
  }
  Vec draft(const std::vector<float>& hid, std::int64_t ctx, const std::vector<float>& noise) const {
    const std::int64_t H = c.hidden, B = c.block, F = c.ffn, nq = c.n_q, nkv = c.n_kv, d = c.d_h;
    using A = AttnLayerParams;
    const auto ao = A::offsets(c.attn());
    const Vec ctxf = norm(lin(Vec(hid.begin(), hid.end()), ctx, c.target_layers * H, lay.fc, H), H, lay.fc_norm);
    Vec x(noise.begin(), noise.end());
    for (std::int64_t l = 0; l < c.layers; ++l) {
      const auto& L = lay.layer[static_cast<std::size_t>(l)];
      const Vec a0 = norm(x, H, L.attn_norm);
      const std::int64_t KG2 = 2 * c.conv_taps * c.conv_groups();
      const Vec a_dyn = c.has_conv() ? lin(a0, B, H, L.attn_conv_proj, KG2) : Vec{};
      const Vec a = c.has_conv() ? conv(a0, a_dyn, 0, L.attn_conv_base) : a0;
      Vec q = norm(lin(a, B, H, L.attn + ao[A::wq], nq * d), d, L.attn + ao[A::q_norm]);
      Vec kc = norm(lin(ctxf, ctx, H, L.attn + ao[A::wk], nkv * d), d, L.attn + ao[A::k_norm]);
      Vec kb = norm(lin(a, B, H, L.attn + ao[A::wk], nkv * d), d, L.attn + ao[A::k_norm]);
      const Vec vc = lin(ctxf, ctx, H, L.attn + ao[A::wv], nkv * d), vb = lin(a, B, H, L.attn + ao[A::wv], nkv * d);
      rope(q, B, nq, ctx);
      rope(kc, ctx, nkv, 0);
      rope(kb, B, nkv, ctx);
      Vec o(static_cast<std::size_t>(B * nq * d), 0.0);
      for (std::int64_t r = 0; r < B; ++r)
        for (std::int64_t h = 0; h < nq; ++h) {
          const std::int64_t g = h / (nq / nkv);
          auto key = [&](std::int64_t j) { return j < ctx ? &kc[static_cast<std::size_t>((j * nkv + g) * d)] : &kb[static_cast<std::size_t>(((j - ctx) * nkv + g) * d)]; };
          auto val = [&](std::int64_t j) { return j < ctx ? &vc[static_cast<std::size_t>((j * nkv + g) * d)] : &vb[static_cast<std::size_t>(((j - ctx) * nkv + g) * d)]; };
          Vec s(static_cast<std::size_t>(ctx + B));
          double mx = -INFINITY;
          // a sliding layer (z-lab's _attention_mask): query at ctx + r sees key position j only if
          // j <= ctx + r (causal unless is_causal = false) and ctx + r - j < W (and j - ctx - r < W
          // when two-sided)
          const bool sliding = !c.layer_types.empty() && c.layer_types[static_cast<std::size_t>(l)] == "sliding_attention";
          const bool causal = c.is_causal ? *c.is_causal : sliding;
          const std::int64_t W = sliding ? c.sliding_window : 0, qp = ctx + r;
          auto hidden = [&](std::int64_t j) {
            return (causal && j > qp) || (W > 0 && (qp - j >= W || (!causal && j - qp >= W)));
          };
          for (std::int64_t j = 0; j < ctx + B; ++j) {
            if (hidden(j)) {
              s[static_cast<std::size_t>(j)] = -INFINITY;
              continue;
            }
            double dot = 0;
            for (std::int64_t e = 0; e < d; ++e) dot += q[static_cast<std::size_t>((r * nq + h) * d + e)] * key(j)[e];
            s[static_cast<std::size_t>(j)] = dot / std::sqrt(static_cast<double>(d));
            mx = std::max(mx, s[static_cast<std::size_t>(j)]);
          }
          double z = 0;
          for (double& v : s) z += (v = std::exp(v - mx));
          for (std::int64_t j = 0; j < ctx + B; ++j)
            for (std::int64_t e = 0; e < d; ++e) o[static_cast<std::size_t>((r * nq + h) * d + e)] += s[static_cast<std::size_t>(j)] / z * val(j)[e];
        }
      Vec y = lin(o, B, nq * d, L.attn + ao[A::wo], H);
      if (c.has_conv()) y = conv(y, a_dyn, 1, L.attn_conv_base);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] += y[i];
      const Vec m0 = norm(x, H, L.mlp_norm);
      const Vec m_dyn = c.has_conv() ? lin(m0, B, H, L.mlp_conv_proj, KG2) : Vec{};
      const Vec m = c.has_conv() ? conv(m0, m_dyn, 0, L.mlp_conv_base) : m0;
      const Vec gt = lin(m, B, H, L.w_gate, F), up = lin(m, B, H, L.w_up, F);
      Vec act(gt.size());
      for (std::size_t i = 0; i < act.size(); ++i) act[i] = gt[i] / (1.0 + std::exp(-gt[i])) * up[i];
      Vec dn = lin(act, B, F, L.w_down, H);
      if (c.has_conv()) dn = conv(dn, m_dyn, 1, L.mlp_conv_base);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] += dn[i];
    }
    return norm(x, H, lay.final_norm);
  }
};

std::vector<float> randn(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(0.0, 1.0);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(d(rng));
  return v;
}

TEST(DFlashFormat, ExportImportRoundTripIsBitwise) {
  Communicator& w = test::world();
  const DrafterConfig cfg = drafter_preset("small");
  const std::vector<float> p = test_params(cfg, 11);
  const std::string dir = shared_dir("roundtrip");
  if (w.rank() == 0) {
    export_dflash(dir + "/f32", cfg, p, "f32");
    export_dflash(dir + "/bf16", cfg, p, "bf16");
  }
  w.barrier();
  const DrafterWeights f = import_dflash(dir + "/f32");
  EXPECT_EQ(f.config.to_json(), cfg.to_json());
  ASSERT_EQ(f.params.size(), p.size());
  EXPECT_EQ(std::memcmp(f.params.data(), p.data(), p.size() * sizeof(float)), 0) << "f32 round trip not bitwise";
  // bf16: the values are p rounded to nearest even, and exporting them again gives the same file.
  const DrafterWeights b = import_dflash(dir + "/bf16");
  for (std::size_t i = 0; i < p.size(); ++i) ASSERT_EQ(b.params[i], bf16_to_f32(f32_to_bf16(p[i]))) << "at " << i;
  if (w.rank() == 0) {
    export_dflash(dir + "/bf16_again", cfg, b.params, "bf16");
    auto bytes = [](const std::string& path) {
      std::ifstream in(path, std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(in), {});
    };
    EXPECT_EQ(bytes(dir + "/bf16/model.safetensors"), bytes(dir + "/bf16_again/model.safetensors"));
    EXPECT_EQ(bytes(dir + "/bf16/config.json"), bytes(dir + "/bf16_again/config.json"));
    // PyTorch's [out, in]: q_proj of layer 0 is [n_q d_h, H], fc is [H, n_t H].
    const SafeTensors st(dir + "/f32/model.safetensors");
    EXPECT_EQ(st.info("layers.0.self_attn.q_proj.weight").shape, (std::vector<std::int64_t>{cfg.n_q * cfg.d_h, cfg.hidden}));
    EXPECT_EQ(st.info("fc.weight").shape, (std::vector<std::int64_t>{cfg.hidden, cfg.target_layers * cfg.hidden}));
    EXPECT_EQ(st.names().size(), static_cast<std::size_t>(3 + 11 * cfg.layers));
  }
}

// Rewrites DIR/config.json through `edit`.
void edit_config(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
  edit(j);
  std::ofstream(dir + "/config.json") << j.dump();
}

// Sliding-window layers (issue #36): a drafter with mixed layer kinds exports them (layer_types,
// use_sliding_window, sliding_window, is_causal) and reads them back equal; a config without
// layer_types resolves them as Qwen3Config does (sliding_window counts only with
// use_sliding_window; sliding from max_window_layers on).
TEST(DFlashFormat, SlidingLayersRoundTripAndResolveAsQwen3Config) {
  Communicator& w = test::world();
  if (w.rank() != 0) return;  // files only
  DrafterConfig cfg;  // tiny, 2 layers
  cfg.layer_types = {"sliding_attention", "full_attention"};
  cfg.sliding_window = 12;
  const std::vector<float> p = test_params(cfg, 4);
  const std::string dir = own_dir("sliding");
  fs::remove_all(dir);
  export_dflash(dir, cfg, p, "f32");
  const nlohmann::json j = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
  EXPECT_EQ(j.at("layer_types"), nlohmann::json({"sliding_attention", "full_attention"}));
  EXPECT_EQ(j.at("sliding_window"), 12);
  EXPECT_EQ(j.at("use_sliding_window"), true);
  EXPECT_FALSE(j.contains("is_causal"));
  DrafterWeights back = import_dflash(dir);
  EXPECT_EQ(back.config.layer_types, cfg.layer_types);
  EXPECT_EQ(back.config.sliding_window, 12);
  EXPECT_FALSE(back.config.is_causal.has_value());
  EXPECT_EQ(back.params, p);
  EXPECT_EQ(back.config.layer_window(0).window, 12);
  EXPECT_TRUE(back.config.layer_window(0).causal);
  EXPECT_EQ(back.config.layer_window(1).window, 0);
  EXPECT_FALSE(back.config.layer_window(1).causal);
  // is_causal = false (as DFlash2's released config sets it): two-sided windows, full layers as before
  edit_config(dir, [](nlohmann::json& c) { c["is_causal"] = false; });
  back = import_dflash(dir);
  EXPECT_FALSE(back.config.layer_window(0).causal);
  EXPECT_EQ(back.config.layer_window(0).window, 12);
  // Qwen3Config's defaults: sliding_window 4096 without use_sliding_window is no window at all
  edit_config(dir, [](nlohmann::json& c) {
    c.erase("is_causal");
    c.erase("layer_types");
    c["use_sliding_window"] = false;
    c["sliding_window"] = 4096;
  });
  back = import_dflash(dir);
  EXPECT_TRUE(back.config.layer_types.empty());
  EXPECT_EQ(back.config.sliding_window, 0);
  // with use_sliding_window, layers from max_window_layers on slide
  edit_config(dir, [](nlohmann::json& c) {
    c["use_sliding_window"] = true;
    c["max_window_layers"] = 1;
  });
  back = import_dflash(dir);
  EXPECT_EQ(back.config.layer_types, (std::vector<std::string>{"full_attention", "sliding_attention"}));
  EXPECT_EQ(back.config.layer_window(1).window, 4096);
  // sliding layers whose config has no window (use_sliding_window false): causal, unbounded
  edit_config(dir, [](nlohmann::json& c) {
    c["use_sliding_window"] = false;
    c["layer_types"] = {"sliding_attention", "sliding_attention"};
  });
  back = import_dflash(dir);
  EXPECT_EQ(back.config.layer_window(0).window, 0);
  EXPECT_TRUE(back.config.layer_window(0).causal);
  // our checkpoint's JSON keeps them too
  EXPECT_EQ(DrafterConfig::from_json(cfg.to_json()).layer_types, cfg.layer_types);
  EXPECT_EQ(DrafterConfig::from_json(cfg.to_json()).sliding_window, 12);
  fs::remove_all(dir);
}

// DFlash2 in the released layout (z-lab's DFlash2DraftModel, as its Qwen3.8-27B-DFlash2 checkpoint
// names and shapes them): architectures, dflash_config's convolution and selector keys, the
// logits' multiplier and soft cap, base kernels [2, K, H], kernel projections [2 K G, H], the
// selector's hidden projection [r, H] and codebooks [V, r] without ".weight"; the round trip is
// bitwise; a missing key is refused by name; the trainer starts from it (--arch dflash refused).
TEST(DFlashFormat, Dflash2RoundTripsInTheReleasedLayout) {
  Communicator& w = test::world();
  auto self = w.split(w.rank(), 0, "self");  // (collective: before the other ranks leave)
  if (w.rank() != 0) return;  // files only
  DrafterConfig cfg;  // tiny: H 64, V 64, 2 layers
  cfg.conv_taps = 2;
  cfg.conv_group_size = 16;
  cfg.selector_rank = 8;
  cfg.selector_top_k = 4;
  cfg.output_multiplier = 0.25;
  cfg.logit_softcap = 20.0;
  cfg.layer_types = {"sliding_attention", "sliding_attention"};
  cfg.sliding_window = 12;
  cfg.is_causal = false;
  std::vector<float> p = test_params(cfg, 5);
  const DrafterLayout lay(cfg);
  const std::vector<float> succ = randn(static_cast<std::size_t>(cfg.vocab * cfg.selector_rank), 6);
  std::copy(succ.begin(), succ.end(), p.begin() + lay.sel_succ);  // off its zero init
  const std::string dir = own_dir("dflash2");
  fs::remove_all(dir);
  export_dflash(dir, cfg, p, "f32", 262144);  // a target of 256k positions
  const nlohmann::json j = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
  EXPECT_EQ(j.at("architectures"), nlohmann::json({"DFlash2DraftModel"}));
  EXPECT_EQ(j.at("max_position_embeddings"), 262144);
  EXPECT_EQ(j.at("is_causal"), false);  // every key a serving engine reads
  EXPECT_EQ(j.at("num_target_layers"), cfg.target_depth);
  const nlohmann::json& dc = j.at("dflash_config");
  EXPECT_EQ(dc.at("conv_kernel_size"), 2);
  EXPECT_EQ(dc.at("conv_group_size"), 16);
  EXPECT_EQ(dc.at("selector_rank"), 8);
  EXPECT_EQ(dc.at("selector_top_k"), 4);
  EXPECT_EQ(dc.at("output_multiplier"), 0.25);
  EXPECT_EQ(dc.at("final_logit_softcapping"), 20.0);
  EXPECT_EQ(dc.at("block_size"), cfg.block);
  const SafeTensors st(dir + "/model.safetensors");
  const std::int64_t H = cfg.hidden, K = cfg.conv_taps, G = cfg.conv_groups(), r = cfg.selector_rank;
  EXPECT_EQ(st.info("layers.1.attention_conv.base_kernel").shape, (std::vector<std::int64_t>{2, K, H}));
  EXPECT_EQ(st.info("layers.1.mlp_conv.kernel_projection.weight").shape, (std::vector<std::int64_t>{2 * K * G, H}));
  EXPECT_EQ(st.info("candidate_selector.hidden_projection.weight").shape, (std::vector<std::int64_t>{r, H}));
  EXPECT_EQ(st.info("candidate_selector.predecessor_codebook").shape, (std::vector<std::int64_t>{cfg.vocab, r}));
  EXPECT_EQ(st.info("candidate_selector.successor_codebook").shape, (std::vector<std::int64_t>{cfg.vocab, r}));
  EXPECT_EQ(st.names().size(), static_cast<std::size_t>(3 + 15 * cfg.layers + 3));
  const DrafterWeights back = import_dflash(dir);
  EXPECT_EQ(back.config.to_json(), cfg.to_json());
  EXPECT_EQ(back.params, p);
  // the imported drafter drafts the fp64 reference's block (with the convolutions)
  const auto hid = randn(static_cast<std::size_t>(9 * cfg.target_layers * H), 7);
  const auto noise = randn(static_cast<std::size_t>(cfg.block * H), 8);
  const Vec ref = Ref{cfg, p}.draft(hid, 9, noise);
  const CompareResult cr = compare<float>(draft_block(*self, back.config, back.params, hid, 9, noise), ref, scaled_to(kTolF32, ref));
  EXPECT_TRUE(cr.pass()) << "max abs err " << cr.max_abs;
  TrainOptions opt;  // the trainer starts from it (its selector trains), and keeps its architecture
  opt.init = dir;
  opt.steps = 2;
  opt.eval_every = 0;
  {
    Trainer t(*self, opt);
    const StepStats s1 = t.step();
    EXPECT_TRUE(std::isfinite(s1.loss) && s1.candidate_recall && s1.selector_loss && *s1.selector_loss > 0);
  }
  opt.arch = "dflash";
  expect_error([&] { Trainer t(*self, opt); }, "is dflash2, and its folder fixes the architecture");
  edit_config(dir, [](nlohmann::json& c) { c["dflash_config"].erase("selector_rank"); });
  expect_error([&] { import_dflash(dir); }, "dflash_config.selector_rank is missing");
  // a DFlash drafter keeps refusing the multiplier it does not apply
  DrafterConfig v1;
  export_dflash(dir + "1", v1, test_params(v1, 3), "f32");
  edit_config(dir + "1", [](nlohmann::json& c) { c["dflash_config"]["output_multiplier"] = 0.5; });
  expect_error([&] { import_dflash(dir + "1"); }, "dflash_config.output_multiplier = 0.5 is not supported");
  fs::remove_all(dir);
  fs::remove_all(dir + "1");
}

TEST(DFlashFormat, MalformedDirectoriesAreRefusedByName) {
  Communicator& w = test::world();
  if (w.rank() != 0) return;  // files only
  const DrafterConfig cfg;  // tiny
  const std::vector<float> p = test_params(cfg, 3);
  const std::string base = own_dir("malformed");
  fs::remove_all(base);
  auto fresh = [&](const std::string& name) {
    const std::string d = base + "/" + name;
    export_dflash(d, cfg, p, "f32");
    return d;
  };
  expect_error([&] { import_dflash(base + "/nothing"); }, "not a directory");
  {
    const std::string d = fresh("no_config");
    fs::remove(d + "/config.json");
    expect_error([&] { import_dflash(d); }, "config.json': cannot open it");
  }
  {
    const std::string d = fresh("not_json");
    std::ofstream(d + "/config.json") << "{\"hidden_size\": 64,";
    expect_error([&] { import_dflash(d); }, "is not valid JSON");
  }
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> bad_configs = {
      {[](nlohmann::json& j) { j["architectures"] = {"Qwen3ForCausalLM"}; }, "not a DFlash drafter"},
      {[](nlohmann::json& j) { j.erase("hidden_size"); }, "field 'hidden_size' = missing"},
      {[](nlohmann::json& j) { j["num_hidden_layers"] = -2; }, "field 'num_hidden_layers' = -2"},
      {[](nlohmann::json& j) { j["attention_bias"] = true; }, "attention_bias = true"},
      {[](nlohmann::json& j) { j["rope_scaling"] = {{"rope_type", "yarn"}}; }, "is not supported (plain RoPE only)"},
      {[](nlohmann::json& j) { j["dflash_config"]["mask_token_id"] = 64; }, "mask_token_id = 64 outside the vocabulary"},
      {[](nlohmann::json& j) { j.erase("dflash_config"); }, "dflash_config is missing"},
      {[](nlohmann::json& j) { j["dflash_config"]["target_layer_ids"] = {0, 7}; }, "target layer id 7 outside [0, 2)"},
      {[](nlohmann::json& j) { j["num_attention_heads"] = 3; }, "n_q = 3"},
      {[](nlohmann::json& j) { j["dflash_config"]["mask_token_id"] = 1e300; }, "field 'dflash_config.mask_token_id' = 1e+300, expected an integer"},
      {[](nlohmann::json& j) { j["dflash_config"]["target_layer_ids"] = {0, 1.5}; }, "target_layer_ids' = 1.5, expected an integer"},
      {[](nlohmann::json& j) { j["attention_bias"] = nullptr; }, "field 'attention_bias' = null has the wrong type"},
      {[](nlohmann::json& j) { j["layer_types"] = {"full_attention", "chunked_attention"}; },
       "layer type \"chunked_attention\" is not supported"},
      {[](nlohmann::json& j) { j["layer_types"] = {"full_attention"}; }, "expected a list of num_hidden_layers = 2"},
      {[](nlohmann::json& j) { j["use_sliding_window"] = true; j["sliding_window"] = 0; },
       "sliding_window = 0, expected a positive integer"},
      {[](nlohmann::json& j) { j["use_sliding_window"] = true; j["sliding_window"] = 9223372036854775807LL; },
       "sliding window 9223372036854775807, expected 1 .. 2^40"},
      {[](nlohmann::json& j) { j["is_causal"] = "yes"; }, "field 'is_causal' = \"yes\" has the wrong type"},
      {[](nlohmann::json& j) { j["dflash_config"]["output_multiplier"] = 0.196; }, "dflash_config.output_multiplier = 0.196 is not supported"},
      {[](nlohmann::json& j) { j["dflash_config"]["final_logit_softcapping"] = 20.0; }, "final_logit_softcapping = 20.0 is not supported"},
      {[](nlohmann::json& j) { j["input_embedding_scale"] = 2; }, "input_embedding_scale = 2 is not supported"},
      {[](nlohmann::json& j) { j.erase("rope_theta"); j["rope_parameters"] = {{"rope_theta", 1e6}, {"factor", 4}}; },
       "rope_parameters.factor = 4 is not supported"},
  };
  for (std::size_t i = 0; i < bad_configs.size(); ++i) {
    const std::string d = fresh("config" + std::to_string(i));
    edit_config(d, bad_configs[i].first);
    expect_error([&] { import_dflash(d); }, bad_configs[i].second);
  }
  {  // the config says 3 layers: layer 2's tensors are missing
    const std::string d = fresh("missing_tensor");
    edit_config(d, [](nlohmann::json& j) {
      j["num_hidden_layers"] = 3;
      j.erase("layer_types");
    });
    expect_error([&] { import_dflash(d); }, "tensor 'layers.2.input_layernorm.weight' is missing");
  }
  {  // a wider MLP in the config than in the file
    const std::string d = fresh("wrong_shape");
    edit_config(d, [](nlohmann::json& j) { j["intermediate_size"] = 256; });
    expect_error([&] { import_dflash(d); }, "tensor 'layers.0.mlp.gate_proj.weight' has shape [128,64], config.json implies [256,64]");
  }
  {  // an extra tensor (a bias) and an integer tensor
    const std::string d = fresh("extra");
    const SafeTensors st(d + "/model.safetensors");
    std::vector<std::vector<float>> keep;
    std::vector<NamedTensor> ts;
    for (const auto& n : st.names()) {
      keep.push_back(st.f32(n));
      ts.push_back({n, "F32", st.info(n).shape, keep.back().data()});
    }
    const std::vector<float> bias(64, 0.f);
    ts.push_back({"layers.0.self_attn.o_proj.bias", "F32", {64}, bias.data()});
    write_safetensors(d + "/model.safetensors", ts);
    expect_error([&] { import_dflash(d); }, "unexpected tensor 'layers.0.self_attn.o_proj.bias'");
    ts.pop_back();
    const std::vector<std::int32_t> ints(64, 1);
    ts.back() = {"norm.weight", "I32", {64}, ints.data()};
    write_safetensors(d + "/model.safetensors", ts);
    expect_error([&] { import_dflash(d); }, "tensor 'norm.weight' is I32, expected a floating-point dtype");
  }
  // Export refuses what the format cannot say.
  std::vector<float> biased = p;
  biased[static_cast<std::size_t>(DrafterLayout(cfg).layer[1].attn + AttnLayerParams::offsets(cfg.attn())[AttnLayerParams::bo] + 5)] = 0.5f;
  expect_error([&] { export_dflash(base + "/biased", cfg, biased, "f32"); }, "layer 1 has a non-zero attention output bias (b_o[5])");
  DrafterConfig unknown = drafter_preset("qwen3.5-27b");
  unknown.layers = 1, unknown.hidden = 64, unknown.ffn = 64, unknown.n_q = 2, unknown.n_kv = 1, unknown.d_h = 32, unknown.vocab = 8000;
  unknown.mask_token = 7999;
  expect_error([&] { export_dflash(base + "/unknown", unknown, std::vector<float>(static_cast<std::size_t>(DrafterLayout(unknown).total)), "f32"); },
               "give `target_layer_ids` and `num_target_layers`");
  expect_error([&] { export_dflash(base + "/dtype", cfg, p, "f16"); }, "export dtype 'f16': expected f32 or bf16");
  fs::remove_all(base);
}

TEST(DFlashDraft, OneBlockEqualsTheFp64ReferenceAtEveryRankCount) {
  for (const std::string preset : {"tiny", "small", "small-sliding", "tiny-sliding", "tiny-dflash2"}) {
    DrafterConfig cfg = drafter_preset(preset.substr(0, preset.find('-')));
    if (preset == "tiny-dflash2") {  // DFlash2's convolutions: 4 taps, groups of 8 channels
      cfg.conv_taps = 4;
      cfg.conv_group_size = 8;
    } else if (preset == "small-sliding") {  // mixed layers, causal windows of 40 (inside the longer contexts)
      cfg.layer_types = {"sliding_attention", "full_attention", "sliding_attention", "sliding_attention"};
      cfg.sliding_window = 40;
    } else if (preset == "tiny-sliding") {  // a two-sided window of 5, below the block (B = 8)
      cfg.layer_types = {"full_attention", "sliding_attention"};
      cfg.sliding_window = 5;
      cfg.is_causal = false;
    }
    const std::vector<float> p = test_params(cfg, 21);
    for (std::int64_t ctx : {1, 2, 37, 300}) {
      const auto hid = randn(static_cast<std::size_t>(ctx * cfg.target_layers * cfg.hidden), 5 + static_cast<std::uint64_t>(ctx));
      const auto noise = randn(static_cast<std::size_t>(cfg.block * cfg.hidden), 9);
      const std::vector<float> got = draft_block(test::world(), cfg, p, hid, ctx, noise);
      const Vec ref = Ref{cfg, p}.draft(hid, ctx, noise);
      const CompareResult r = compare<float>(got, ref, scaled_to(kTolF32, ref));
      EXPECT_TRUE(r.pass()) << preset << " ctx " << ctx << ": max abs err " << r.max_abs << ", worst ratio " << r.worst_ratio;
    }
  }
  const DrafterConfig cfg;
  const auto p = test_params(cfg, 1);
  expect_error([&] { draft_block(test::world(), cfg, p, std::vector<float>(10), 3, std::vector<float>(cfg.block * cfg.hidden)); },
               "expected [ctx, n_t*H] = [3, 128]");
}

// The draft KV cache (issue #53): the context appended in pieces (crossing the cache's chunks of
// 256 positions, which the ranks hold round-robin), each draft equals the stateless draft_block
// within f32 rounding and the fp64 reference within the f32 bound; a sliding layer keeps at most
// 2 (W - 1) keys per rank, a full layer all of them over the ranks.
TEST(DraftCache, EqualsTheStatelessDraftAndTheFp64ReferenceAtEveryRankCount) {
  Communicator& w = test::world();
  for (const std::string preset : {"tiny", "small-sliding", "tiny-sliding", "tiny-dflash2"}) {
    DrafterConfig cfg = drafter_preset(preset.substr(0, preset.find('-')));
    if (preset == "tiny-dflash2") {  // DFlash2's convolutions over the block's rows (b of them)
      cfg.conv_taps = 3;
      cfg.conv_group_size = 16;
    } else if (preset == "small-sliding") {
      cfg.layer_types = {"sliding_attention", "full_attention", "sliding_attention", "sliding_attention"};
      cfg.sliding_window = 40;
    } else if (preset == "tiny-sliding") {
      cfg.layer_types = {"full_attention", "sliding_attention"};
      cfg.sliding_window = 5;
      cfg.is_causal = false;
    }
    const std::int64_t T = cfg.target_layers * cfg.hidden, H = cfg.hidden;
    const std::vector<float> p = test_params(cfg, 23);
    const std::int64_t total = preset == "small-sliding" ? 560 : 700;
    const auto hid = randn(static_cast<std::size_t>(total * T), 31);
    DraftCache cache(w, cfg, p);
    expect_error([&] { cache.draft(std::vector<float>(static_cast<std::size_t>(cfg.block * H))); }, "no context yet");
    expect_error([&] { cache.append(std::vector<float>(static_cast<std::size_t>(T + 1))); }, "expected [n >= 1, n_t*H");
    std::int64_t ctx = 0;
    for (std::int64_t piece : {1, 36, 200, 1, 62, 100, 300}) {
      piece = std::min(piece, total - ctx);
      if (piece == 0) break;
      cache.append(std::span<const float>(hid).subspan(static_cast<std::size_t>(ctx * T), static_cast<std::size_t>(piece * T)));
      ctx += piece;
      ASSERT_EQ(cache.length(), ctx);
      for (const std::int64_t b : {cfg.block, std::int64_t{3}}) {
        SCOPED_TRACE(preset + " ctx " + std::to_string(ctx) + " b " + std::to_string(b));
        DrafterConfig cb = cfg;
        cb.block = b;
        const auto noise = randn(static_cast<std::size_t>(b * H), 40 + static_cast<std::uint64_t>(ctx));
        const std::vector<float> got = cache.draft(noise);
        const std::vector<float> stateless =
            draft_block(w, cb, p, std::span<const float>(hid).first(static_cast<std::size_t>(ctx * T)), ctx, noise);
        const std::vector<float> h(hid.begin(), hid.begin() + ctx * T);
        const Vec ref = Ref{cb, p}.draft(h, ctx, noise);
        const CompareResult r = compare<float>(got, ref, scaled_to(kTolF32, ref));
        EXPECT_TRUE(r.pass()) << "vs fp64: max abs err " << r.max_abs << ", worst ratio " << r.worst_ratio;
        double diff = 0, scale = 0;
        ASSERT_EQ(got.size(), stateless.size());
        for (std::size_t i = 0; i < got.size(); ++i) {
          diff = std::max(diff, static_cast<double>(std::abs(got[i] - stateless[i])));
          scale = std::max(scale, static_cast<double>(std::abs(stateless[i])));
        }
        EXPECT_LE(diff, 1e-5 * scale) << "vs draft_block";
      }
    }
    for (std::int64_t l = 0; l < cfg.layers; ++l) {
      const KeyWindow win = cfg.layer_window(l);
      const std::int64_t keys = cache.cached_keys(l);
      std::int64_t all = keys;
      w.all_reduce<std::int64_t>(std::span<std::int64_t>(&all, 1));
      if (win.window > 0)
        EXPECT_LE(keys, 2 * (win.window - 1)) << preset << " layer " << l;
      else
        EXPECT_EQ(all, total) << preset << " layer " << l;
    }
    expect_error([&] { cache.draft(std::vector<float>(static_cast<std::size_t>((cfg.block + 1) * H))); },
                 "with 1 <= b <= B");
  }
}

// Also for a drafter with sliding-window layers (issue #36): it trains from the released format
// exactly as natively (the windows came through --init) and exports back with its layer types.
TEST(DFlashTrain, StartingFromAnImportedDrafterEqualsStartingNatively) {
  Communicator& w = test::world();
  DrafterConfig sliding;  // tiny, layer 0 sliding with a window of 5 rows
  sliding.layer_types = {"sliding_attention", "full_attention"};
  sliding.sliding_window = 5;
  std::vector<std::string> dirs;  // the full drafter's, the sliding one's
  for (const DrafterConfig& cfg : {DrafterConfig{}, sliding}) {
    const std::vector<float> p0 = test_params(cfg, 42);
    const std::string dir = shared_dir(cfg.layer_types.empty() ? "train" : "train_sliding");
    dirs.push_back(dir);
    if (w.rank() == 0) {
      export_dflash(dir + "/drafter", cfg, p0, "f32");
      // The same parameters as a step-0 checkpoint with fresh optimizer state.
      fs::create_directories(dir + "/native");
      save_checkpoint(dir + "/native/checkpoint.bin",
                      {{{"config", cfg.to_json()}, {"step", 0}, {"seed", 1}, {"adam_t", 0}, {"cp", w.size()}, {"dp", 1}},
                       p0, std::vector<float>(p0.size(), 0.f), std::vector<float>(p0.size(), 0.f)});
    }
    w.barrier();
    TrainOptions opt;
    opt.steps = 3;
    opt.eval_every = 0;
    TrainOptions imported = opt, native = opt;
    imported.init = dir + "/drafter";
    imported.out = dir + "/imported";
    native.out = dir + "/native";
    native.resume = true;
    // no preset has sliding layers: that run takes its shape from --init, its state from the checkpoint
    if (!cfg.layer_types.empty()) native.init = imported.init;
    const TrainResult a = train(w, imported), b = train(w, native);
    ASSERT_EQ(a.params.size(), b.params.size());
    EXPECT_EQ(std::memcmp(a.params.data(), b.params.data(), a.params.size() * sizeof(float)), 0);
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_NE(a.params, p0);  // it trained
    if (w.rank() == 0) {  // exported back: the same layer kinds and the trained parameters
      export_dflash(dir + "/trained", cfg, a.params, "f32");
      const DrafterWeights back = import_dflash(dir + "/trained");
      EXPECT_EQ(back.config.to_json(), cfg.to_json());
      EXPECT_EQ(back.params, a.params);
    }
    w.barrier();
  }
  {  // the window changes training: the sliding drafter's run differs from the full one's
    const TrainResult full = [&] {
      TrainOptions o;
      o.steps = 1;
      o.eval_every = 0;
      o.init = dirs[0] + "/drafter";
      o.out = dirs[0] + "/again";
      return train(w, o);
    }();
    TrainOptions o;
    o.steps = 1;
    o.eval_every = 0;
    o.init = dirs[1] + "/drafter";
    o.out = dirs[1] + "/again";
    EXPECT_NE(train(w, o).loss, full.loss);
  }
  TrainOptions both;
  both.init = dirs[0] + "/drafter";
  both.out = dirs[0] + "/both";
  both.preset = "small";
  expect_error([&] { train(w, both); }, "give one (the drafter directory's config.json is the shape)");
}

}  // namespace
}  // namespace diffcp
