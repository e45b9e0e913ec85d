#include "diffcp/drafter/data.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <filesystem>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "diffcp/core/error.hpp"
#include "diffcp/io/safetensors.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/ops/linear.hpp"

namespace diffcp {

namespace {

// hidden state of one position: n_t layers of tanh([E(tok_x); E(tok_{x-1})] W_t), W_t: [2H, H].
class SyntheticSource final : public DataSource {
 public:
  SyntheticSource(const DrafterConfig& cfg, const SyntheticSpec& spec) : cfg_(cfg), spec_(spec) {
    DIFFCP_CHECK(spec.min_length >= cfg.block + 2 && spec.max_length >= spec.min_length, "synthetic data: lengths [",
                 spec.min_length, ", ", spec.max_length, "] must be >= B + 2 = ", cfg.block + 2, " and ordered");
    const std::int64_t V = cfg.vocab, H = cfg.hidden;
    std::mt19937_64 rng(spec.seed);
    std::normal_distribution<double> n01(0.0, 1.0);
    W_.resize(static_cast<std::size_t>(cfg.target_layers * 2 * H * H));
    for (auto& x : W_) x = static_cast<float>(n01(rng) / std::sqrt(2.0 * static_cast<double>(H)));
    // Markov chain over the text tokens (all but the mask token).
    const std::int64_t text = V - 1;
    std::uniform_int_distribution<std::int64_t> pick(0, text - 1);
    next_.resize(static_cast<std::size_t>(text * 3));
    for (auto& x : next_) x = static_cast<std::int32_t>(pick(rng));
    auto make = [&](std::int64_t n, std::vector<Sample>& out) {
      std::uniform_int_distribution<std::int64_t> len(spec.min_length, spec.max_length);
      std::uniform_real_distribution<double> u(0.0, 1.0);
      for (std::int64_t s = 0; s < n; ++s) {
        Sample smp;
        const std::int64_t L = len(rng);
        const auto prompt = static_cast<std::int64_t>(std::llround(spec.prompt_fraction * static_cast<double>(L)));
        std::int32_t tok = static_cast<std::int32_t>(pick(rng));
        for (std::int64_t x = 0; x < L; ++x) {
          smp.tokens.push_back(text_token(tok));
          smp.loss_mask.push_back(x >= prompt ? 1 : 0);
          const double r = u(rng);
          tok = next_[static_cast<std::size_t>(tok * 3 + (r < 0.75 ? 0 : r < 0.9 ? 1 : 2))];
        }
        out.push_back(std::move(smp));
      }
    };
    make(spec.train_samples, train_);
    make(spec.heldout_samples, heldout_);
  }
  const std::vector<Sample>& train() const override { return train_; }
  const std::vector<Sample>& heldout() const override { return heldout_; }
  void embedding_rows(std::span<const std::int32_t> tokens, float* out) const override {
    for (std::size_t i = 0; i < tokens.size(); ++i) embedding_row(tokens[i], out + static_cast<std::int64_t>(i) * cfg_.hidden);
  }
  void lm_head_columns(std::int64_t v0, std::int64_t v1, float* out) const override {
    const std::int64_t H = cfg_.hidden, n = v1 - v0;
    DIFFCP_CHECK(0 <= v0 && v0 <= v1 && v1 <= cfg_.vocab, "synthetic LM head: columns [", v0, ", ", v1, ") of ", cfg_.vocab);
    const double scale = 1 / std::sqrt(static_cast<double>(H));
    std::vector<float> col(static_cast<std::size_t>(H));
    for (std::int64_t v = v0; v < v1; ++v) {
      seeded_normals(v, 0x1e4d, col.data());
      for (std::int64_t h = 0; h < H; ++h) out[h * n + (v - v0)] = static_cast<float>(col[static_cast<std::size_t>(h)] * scale);
    }
  }
  std::string describe() const override {
    return "synthetic: Markov chain over " + std::to_string(cfg_.vocab - 1) + " tokens, " +
           std::to_string(train_.size()) + " train / " + std::to_string(heldout_.size()) +
           " held-out samples, frozen random target model (seed " + std::to_string(spec_.seed) + ")";
  }
  // Rows are computed in tiles of kTile positions aligned to the sample's start, whatever range is
  // asked for: a position's hidden state then comes from the same GEMM call (same shape, same
  // place in it) on every rank and for every split, so it is bitwise independent of P (oneDNN's
  // kernels may round a row differently in a GEMM of another shape, as on AVX2 machines).
  void hidden(bool held, std::size_t s, std::int64_t begin, std::int64_t end, float* out) const override {
    const Sample& smp = (held ? heldout_ : train_)[s];
    const std::int64_t H = cfg_.hidden, T = cfg_.target_layers, L = static_cast<std::int64_t>(smp.tokens.size());
    constexpr std::int64_t kTile = 64;
    const ScopedBackend host(cpu_backend());  // host data (a shard file's stand-in): its GEMMs run on the host
    std::vector<float> in(static_cast<std::size_t>(kTile * 2 * H)), h(static_cast<std::size_t>(kTile * H));
    for (std::int64_t t0 = begin / kTile * kTile; t0 < end; t0 += kTile) {
      const std::int64_t n = std::min(kTile, L - t0);
      // in: [n, 2H] = [E(tok_x); E(tok_{x-1})]; per layer one GEMM [n, 2H] x [2H, H], then tanh.
      std::fill(in.begin(), in.end(), 0.f);
      for (std::int64_t x = t0; x < t0 + n; ++x) {
        float* row = in.data() + (x - t0) * 2 * H;
        embedding_row(smp.tokens[static_cast<std::size_t>(x)], row);
        if (x == t0 && x > 0) embedding_row(smp.tokens[static_cast<std::size_t>(x - 1)], row + H);
        if (x > t0) std::copy_n(row - 2 * H, H, row + H);  // the previous position's E(tok)
      }
      const std::int64_t r0 = std::max(begin, t0), r1 = std::min(end, t0 + n);
      for (std::int64_t t = 0; t < T; ++t) {
        linear_forward(in.data(), n, 2 * H, W_.data() + t * 2 * H * H, H, h.data());
        for (std::int64_t r = r0; r < r1; ++r)
          for (std::int64_t c = 0; c < H; ++c)
            out[((r - begin) * T + t) * H + c] = std::tanh(h[static_cast<std::size_t>((r - t0) * H + c)]);
      }
    }
  }

 private:
  // Text tokens skip the mask token id.
  std::int32_t text_token(std::int32_t t) const { return t >= cfg_.mask_token ? t + 1 : t; }
  // out [H]: N(0, 1) values that depend on (seed, v, salt) only: SplitMix64 + Box-Muller, cheap
  // enough to generate a row per position of every micro-batch.
  void seeded_normals(std::int64_t v, std::uint64_t salt, float* out) const {
    std::uint64_t x = spec_.seed * 0x9e3779b97f4a7c15ull ^ static_cast<std::uint64_t>(v) * 0xbf58476d1ce4e5b9ull ^ salt;
    auto next = [&x] {
      std::uint64_t z = (x += 0x9e3779b97f4a7c15ull);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      return z ^ (z >> 31);
    };
    for (std::int64_t h = 0; h < cfg_.hidden; h += 2) {
      const double u1 = (static_cast<double>(next() >> 11) + 1.0) * 0x1.0p-53, u2 = static_cast<double>(next() >> 11) * 0x1.0p-53;
      const double r = std::sqrt(-2.0 * std::log(u1)), t = 2.0 * std::numbers::pi * u2;
      out[h] = static_cast<float>(r * std::cos(t));
      if (h + 1 < cfg_.hidden) out[h + 1] = static_cast<float>(r * std::sin(t));
    }
  }
  void embedding_row(std::int32_t v, float* out) const {
    DIFFCP_CHECK(v >= 0 && v < cfg_.vocab, "synthetic embedding: token ", v, " outside [0, ", cfg_.vocab, ")");
    seeded_normals(v, 0xe3b, out);
  }
  DrafterConfig cfg_;
  SyntheticSpec spec_;
  std::vector<float> W_;
  std::vector<std::int32_t> next_;
  std::vector<Sample> train_, heldout_;
};

class ShardSource final : public DataSource {
 public:
  ShardSource(const DrafterConfig& cfg, const std::string& dir, std::int64_t heldout)
      : cfg_(cfg), dir_(dir), model_(std::make_unique<SafeTensors>(dir + "/model.safetensors")) {
    const std::int64_t V = cfg.vocab, H = cfg.hidden, T = cfg.target_layers * H;
    const SafeTensors& model = *model_;
    const auto& meta = model.metadata();
    if (meta.count("target_layer_ids") != 0) {
      auto bad = [&] {
        DIFFCP_FAIL("data '", dir, "': model.safetensors metadata target_layer_ids = '", meta.at("target_layer_ids"),
                    "', num_target_layers = '", meta.count("num_target_layers") ? meta.at("num_target_layers") : "",
                    "': expected a JSON list of non-negative integers and a positive integer");
      };
      nlohmann::json ids = nlohmann::json::parse(meta.at("target_layer_ids"), nullptr, false);
      if (!ids.is_array()) bad();
      for (const auto& id : ids) {
        if (!id.is_number_integer() || id.get<std::int64_t>() < 0) bad();
        ids_.push_back(id.get<std::int64_t>());
      }
      if (meta.count("num_target_layers") != 0) {
        const std::string& d = meta.at("num_target_layers");
        if (d.empty() || d.size() > 9 || d.find_first_not_of("0123456789") != std::string::npos) bad();
        depth_ = std::stoll(d);
      }
      DIFFCP_CHECK(static_cast<std::int64_t>(ids_.size()) == cfg.target_layers, "data '", dir, "': hidden states of ",
                   ids_.size(), " target layers (metadata), the model fuses ", cfg.target_layers);
    }
    for (const char* name : {"embedding", "lm_head"})
      DIFFCP_CHECK(model.has(name) && model.info(name).dtype == "F32", "data '", dir, "': model.safetensors needs an F32 '",
                   name, "'", model.has(name) ? ", it is " + model.info(name).dtype : std::string(", it has none"));
    DIFFCP_CHECK(model.info("embedding").shape == std::vector<std::int64_t>({V, H}) &&
                     model.info("lm_head").shape == std::vector<std::int64_t>({H, V}),
                 "data '", dir, "': embedding must be [V, H] = [", V, ", ", H, "] and lm_head [H, V]");
    std::vector<std::string> files;
    for (const auto& e : std::filesystem::directory_iterator(dir))
      if (e.path().filename().string().rfind("shard_", 0) == 0 && e.path().extension() == ".safetensors")
        files.push_back(e.path().string());
    std::sort(files.begin(), files.end());
    DIFFCP_CHECK(!files.empty(), "data '", dir, "': no shard_*.safetensors files");
    std::vector<Sample> all;
    for (const auto& path : files) {
      const SafeTensors st(path);
      const auto tokens = st.i32("tokens", 1);
      const auto mask = st.u8("loss_mask", 1);
      const auto offsets = st.i64("offsets", 1);
      auto hidden = st.f32("hidden", 2);
      const auto greedy = st.has("target_greedy") ? st.i32("target_greedy", 1) : std::vector<std::int32_t>{};
      DIFFCP_CHECK(greedy.empty() || greedy.size() == tokens.size(), "shard '", path, "': target_greedy has ",
                   greedy.size(), " entries, expected one per token (", tokens.size(), ")");
      const auto rows = static_cast<std::int64_t>(tokens.size());
      DIFFCP_CHECK(static_cast<std::int64_t>(mask.size()) == rows && st.info("hidden").shape == std::vector<std::int64_t>({rows, T}),
                   "shard '", path, "': loss_mask must be [", rows, "] and hidden [", rows, ", n_t*H = ", T, "]");
      DIFFCP_CHECK(offsets.size() >= 2 && offsets.front() == 0 && offsets.back() == rows, "shard '", path,
                   "': offsets must run from 0 to the ", rows, " token rows");
      for (std::size_t i = 0; i + 1 < offsets.size(); ++i) {
        DIFFCP_CHECK(offsets[i] < offsets[i + 1] && offsets[i + 1] <= rows, "shard '", path, "': offsets ", i, ", ", i + 1,
                     " = ", offsets[i], ", ", offsets[i + 1], ": not increasing within the ", rows, " token rows");
        Sample s{{tokens.begin() + offsets[i], tokens.begin() + offsets[i + 1]}, {mask.begin() + offsets[i], mask.begin() + offsets[i + 1]}, {}};
        if (!greedy.empty()) s.greedy.assign(greedy.begin() + offsets[i], greedy.begin() + offsets[i + 1]);
        for (std::int32_t t : s.tokens)
          DIFFCP_CHECK(t >= 0 && t < V, "shard '", path, "': token id ", t, " outside the vocabulary [0, ", V, ")");
        for (std::int32_t t : s.greedy)
          DIFFCP_CHECK(t >= 0 && t < V, "shard '", path, "': target_greedy id ", t, " outside the vocabulary [0, ", V, ")");
        all.push_back(std::move(s));
        hidden_.push_back(std::vector<float>(hidden.begin() + offsets[i] * T, hidden.begin() + offsets[i + 1] * T));
      }
    }
    DIFFCP_CHECK(heldout >= 0 && heldout < static_cast<std::int64_t>(all.size()), "data '", dir, "': ", all.size(),
                 " samples cannot hold out ", heldout);
    const std::size_t n_train = all.size() - static_cast<std::size_t>(heldout);
    train_.assign(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(n_train));
    heldout_.assign(all.begin() + static_cast<std::ptrdiff_t>(n_train), all.end());
  }
  const std::vector<Sample>& train() const override { return train_; }
  const std::vector<Sample>& heldout() const override { return heldout_; }
  // Read in place from the mapped model.safetensors: ranks on one node share its pages.
  void embedding_rows(std::span<const std::int32_t> tokens, float* out) const override {
    const std::int64_t H = cfg_.hidden;
    const std::byte* E = model_->bytes("embedding").data();  // (maybe unaligned: memcpy only)
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      DIFFCP_CHECK(tokens[i] >= 0 && tokens[i] < cfg_.vocab, "data '", dir_, "': token ", tokens[i], " outside the vocabulary");
      std::memcpy(out + static_cast<std::int64_t>(i) * H, E + tokens[i] * H * 4, static_cast<std::size_t>(H) * 4);
    }
  }
  void lm_head_columns(std::int64_t v0, std::int64_t v1, float* out) const override {
    const std::int64_t H = cfg_.hidden, V = cfg_.vocab, n = v1 - v0;
    DIFFCP_CHECK(0 <= v0 && v0 <= v1 && v1 <= V, "data '", dir_, "': LM head columns [", v0, ", ", v1, ") of ", V);
    const std::byte* W = model_->bytes("lm_head").data();
    for (std::int64_t h = 0; h < H; ++h) std::memcpy(out + h * n, W + (h * V + v0) * 4, static_cast<std::size_t>(n) * 4);
  }
  std::string describe() const override {
    return "shards in " + dir_ + ": " + std::to_string(train_.size()) + " train / " + std::to_string(heldout_.size()) + " held-out samples";
  }
  std::vector<std::int64_t> target_layer_ids() const override { return ids_; }
  std::int64_t target_depth() const override { return depth_; }
  void hidden(bool held, std::size_t s, std::int64_t begin, std::int64_t end, float* out) const override {
    const std::int64_t T = cfg_.target_layers * cfg_.hidden;
    const auto& h = hidden_[held ? train_.size() + s : s];
    std::copy(h.begin() + begin * T, h.begin() + end * T, out);
  }

 private:
  DrafterConfig cfg_;
  std::string dir_;
  std::unique_ptr<SafeTensors> model_;  // embedding [V, H] and lm_head [H, V], mapped
  std::vector<std::vector<float>> hidden_;  // per sample (train then held-out) [L, n_t*H]
  std::vector<std::int64_t> ids_;
  std::int64_t depth_ = 0;
  std::vector<Sample> train_, heldout_;
};

}  // namespace

std::unique_ptr<DataSource> make_synthetic_source(const DrafterConfig& cfg, const SyntheticSpec& spec) {
  return std::make_unique<SyntheticSource>(cfg, spec);
}

std::unique_ptr<DataSource> make_shard_source(const DrafterConfig& cfg, const std::string& dir, std::int64_t heldout) {
  return std::make_unique<ShardSource>(cfg, dir, heldout);
}

std::vector<std::vector<std::size_t>> pack_samples(const std::vector<Sample>& samples, std::int64_t context) {
  DIFFCP_CHECK(context >= 1, "packing: context ", context, ", expected >= 1");
  std::vector<std::vector<std::size_t>> out;
  std::int64_t used = context;
  for (std::size_t s = 0; s < samples.size(); ++s) {
    const auto L = std::min(static_cast<std::int64_t>(samples[s].tokens.size()), context);
    if (used + L > context) {
      out.emplace_back();
      used = 0;
    }
    out.back().push_back(s);
    used += L;
  }
  return out;
}

std::int64_t anchor_candidates(const Sample& s, std::int64_t block, std::int64_t max_length) {
  const auto L = std::min(static_cast<std::int64_t>(s.tokens.size()), max_length);
  std::int64_t n = 0;
  for (std::int64_t x = 0; x + block <= L; ++x) n += s.loss_mask[static_cast<std::size_t>(x)] ? 1 : 0;
  return n;
}

PackedBatch sample_anchors(const std::vector<Sample>& samples, const std::vector<std::size_t>& members,
                           std::int64_t anchors, std::int64_t block, std::mt19937_64& rng, std::int64_t max_length) {
  PackedBatch b;
  b.block = block;
  for (std::size_t s : members) {
    const Sample& smp = samples[s];
    const auto L = std::min(static_cast<std::int64_t>(smp.tokens.size()), max_length);
    std::vector<std::int64_t> cand;
    for (std::int64_t x = 0; x + block <= L; ++x)
      if (smp.loss_mask[static_cast<std::size_t>(x)]) cand.push_back(x);
    const auto k = std::min<std::int64_t>(anchors, static_cast<std::int64_t>(cand.size()));
    // Partial Fisher-Yates: the first k of a uniform shuffle.
    for (std::int64_t i = 0; i < k; ++i) {
      std::uniform_int_distribution<std::int64_t> d(i, static_cast<std::int64_t>(cand.size()) - 1);
      std::swap(cand[static_cast<std::size_t>(i)], cand[static_cast<std::size_t>(d(rng))]);
    }
    std::vector<std::int64_t> picked(cand.begin(), cand.begin() + k);
    std::sort(picked.begin(), picked.end());
    b.lengths.push_back(L);
    b.anchors.push_back(std::move(picked));
  }
  b.validate();
  return b;
}

}  // namespace diffcp
