#include "dit/model.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "core/error.hpp"
#include "io/safetensors.hpp"

namespace diffcp {

namespace {

std::string shape_str(const std::vector<std::int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// src: [rows, cols] -> dst: [cols, rows]
void transpose(const float* src, std::int64_t rows, std::int64_t cols, float* dst) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

}  // namespace

DitWeights::DitWeights(const DitConfig& cfg) : cfg_(cfg), layout_(cfg), params_(static_cast<std::size_t>(layout_.total)) {}

void DitWeights::init_random(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const DitLayout::Tensor& t : layout_.tensors) {
    float* p = params_.data() + t.offset;
    if (t.linear_weight) {
      const float stddev = 1.f / std::sqrt(static_cast<float>(t.shape[1]));  // shape [out, in]
      for (std::int64_t i = 0; i < t.size; ++i) p[i] = normal(rng) * stddev;
    } else {
      // 1-D tensors: biases start at 0, the QK-norm scales at 1.
      const bool scale = t.name.ends_with(".scale");
      std::fill(p, p + t.size, scale ? 1.f : 0.f);
    }
  }
}

void DitWeights::load(const std::string& path) {
  const SafeTensors st(path);
  for (const DitLayout::Tensor& t : layout_.tensors) {
    DIFFCP_CHECK(st.has(t.name), "weights '", path, "': missing tensor '", t.name, "' (expected F32 ", shape_str(t.shape),
                 "; names and shapes: dit/config.hpp)");
    const SafeTensors::Info& info = st.info(t.name);
    DIFFCP_CHECK(info.dtype == "F32" && info.shape == t.shape, "weights '", path, "': tensor '", t.name, "' is ",
                 info.dtype, " ", shape_str(info.shape), ", expected F32 ", shape_str(t.shape),
                 t.linear_weight ? " ([out, in], PyTorch's Linear layout)" : "");
    const std::vector<float> v = st.f32(t.name);
    if (t.linear_weight)
      transpose(v.data(), t.shape[0], t.shape[1], params_.data() + t.offset);
    else
      std::copy(v.begin(), v.end(), params_.begin() + t.offset);
  }
}

void DitWeights::save(const std::string& path) const {
  // Linear weights go back to [out, in]; the transposed copies live until the file is written.
  std::vector<std::vector<float>> transposed;
  std::vector<NamedTensor> out;
  for (const DitLayout::Tensor& t : layout_.tensors) {
    const float* data = params_.data() + t.offset;
    if (t.linear_weight) {
      transposed.emplace_back(static_cast<std::size_t>(t.size));
      transpose(data, t.shape[1], t.shape[0], transposed.back().data());
      data = transposed.back().data();
    }
    out.push_back({t.name, "F32", t.shape, data});
  }
  write_safetensors(path, out);
}

DitModel::DitModel(const DitWeights& weights, const DitShape& shape, AttentionExchange& exchange)
    : w_(weights), cfg_(weights.config()), shape_(shape),
      shard_(make_dit_shard(cfg_, shape, exchange.seq_size(), exchange.seq_rank(), exchange.size())), ex_(exchange) {
  const std::int64_t b = shape_.batch, Tp = shard_.text_p, Ip = shard_.image_p, H = cfg_.hidden();
  const std::int64_t Mt = b * Tp, Mi = b * Ip;
  Mp_ = Mt + Mi;

  // Image token n (row-major over the g x g grid) sits at (n / g, n % g); rank p holds
  // n in [p I_p, (p+1) I_p) of every image.
  std::vector<std::array<std::int64_t, 2>> pos;
  for (std::int64_t j = 0; j < b; ++j)
    for (std::int64_t i = 0; i < Ip; ++i) {
      const std::int64_t n = shard_.p * Ip + i;
      pos.push_back({n / shape_.grid(), n % shape_.grid()});
    }
  rope_ = std::make_unique<AxialRope>(cfg_, pos);
  txt_rows_ = {0, Mt, nullptr};
  img_rows_ = {Mt, Mi, rope_.get()};

  ExchangeLayout l{b, Tp + Ip, cfg_.heads, cfg_.head_dim, Mp_, {}};
  for (std::int64_t j = 0; j < b; ++j) {
    for (std::int64_t t = 0; t < Tp; ++t) l.rows.push_back(j * Tp + t);
    for (std::int64_t t = 0; t < Ip; ++t) l.rows.push_back(Mt + j * Ip + t);
  }
  ex_.set_layout(std::move(l));

  const auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  x_.resize(sz(Mp_ * H));
  xm_.resize(x_.size());
  attn_.resize(x_.size());
  y_.resize(x_.size());
  big_.resize(sz(Mp_ * (3 * H + cfg_.mlp_hidden)));
  silu_vec_.resize(sz(H));
  mod_.resize(sz(6 * H));
}

namespace {
// Rows per projection chunk between two polls of the exchange (V-First, SPEC B.3).
constexpr std::int64_t kPollRows = 64;
}  // namespace

void DitModel::project(const DitLinear& l, const float* x, std::int64_t rows, std::int64_t c0, std::int64_t ncols, float* y,
                       std::int64_t ldy) {
  const float* W = param(l.w) + c0;  // [in, out]: columns c0.. with row stride out
  const float* b = param(l.b) + c0;
  for (std::int64_t r0 = 0; r0 < rows; r0 += kPollRows) {
    dit_linear(x + r0 * l.in, l.in, std::min(kPollRows, rows - r0), l.in, W, l.out, ncols, b, y + r0 * ldy, ldy);
    ex_.poll();
  }
}

void DitModel::modulation(const DitLinear& l, std::vector<float>& out) const {
  dit_linear(w_.params(), l, silu_vec_.data(), l.in, 1, out.data(), l.out);
}

void DitModel::velocity(const float* x_p, const float* txt_p, const float* pooled, double t, float* v_p) {
  const std::vector<float>& P = w_.params();
  const DitLayout& L = w_.layout();
  const std::int64_t H = cfg_.hidden(), Tp = shard_.text_p;

  // vec = MLP_time(timestep features) + MLP_vector(pooled); the blocks use silu(vec).
  const std::vector<float> temb = timestep_embedding(t, cfg_.time_dim);
  std::vector<float> h(static_cast<std::size_t>(H)), vec(h.size());
  dit_linear(P, L.time_in0, temb.data(), cfg_.time_dim, 1, h.data(), H);
  silu_inplace(h.data(), H);
  dit_linear(P, L.time_in1, h.data(), H, 1, vec.data(), H);
  dit_linear(P, L.vector_in0, pooled, cfg_.pooled_dim, 1, h.data(), H);
  silu_inplace(h.data(), H);
  dit_linear(P, L.vector_in1, h.data(), H, 1, y_.data(), H);
  for (std::int64_t c = 0; c < H; ++c) silu_vec_[static_cast<std::size_t>(c)] = vec[static_cast<std::size_t>(c)] + y_[static_cast<std::size_t>(c)];
  silu_inplace(silu_vec_.data(), H);

  // Embeddings: the text rows are the same for every image, projected once and copied.
  dit_linear(P, L.img_in, x_p, cfg_.in_channels(), img_rows_.rows, x_.data() + img_rows_.row0 * H, H);
  if (Tp > 0) {
    dit_linear(P, L.txt_in, txt_p, cfg_.text_dim, Tp, x_.data(), H);
    for (std::int64_t j = 1; j < shape_.batch; ++j) std::copy_n(x_.data(), Tp * H, x_.data() + j * Tp * H);
  }

  for (const auto& blk : L.double_blocks) double_block(blk);
  for (const auto& blk : L.single_blocks) single_block(blk);

  // Final layer on the image rows: (shift, scale).
  modulation(L.final_mod, mod_);
  const float* img = x_.data() + img_rows_.row0 * H;
  layernorm_modulate(img, img_rows_.rows, H, mod_.data(), mod_.data() + H, static_cast<float>(cfg_.eps), xm_.data());
  dit_linear(P, L.final_linear, xm_.data(), H, img_rows_.rows, v_p, cfg_.in_channels());
}

void DitModel::double_block(const DitLayout::DoubleBlock& blk) {
  const std::vector<float>& P = w_.params();
  const std::int64_t H = cfg_.hidden(), M = cfg_.mlp_hidden, d = cfg_.head_dim;
  const float eps = static_cast<float>(cfg_.eps);
  const std::pair<const DitLayout::Stream*, StreamRows> streams[] = {{&blk.txt, txt_rows_}, {&blk.img, img_rows_}};
  std::vector<float> mods[2];

  // Each stream's modulated, normed, rotated q | k | v into big_ as [M_p, 3H] (rows in place). V-First
  // (SPEC B.3): both streams' v columns first, V's exchange starts, then q | k + norm + RoPE.
  for (int s = 0; s < 2; ++s) {
    const auto& [w, r] = streams[s];
    mods[s].resize(static_cast<std::size_t>(6 * H));
    modulation(w->mod, mods[s]);
    const float* mod = mods[s].data();  // shift1, scale1, gate1, shift2, scale2, gate2
    layernorm_modulate(x_.data() + r.row0 * H, r.rows, H, mod, mod + H, eps, xm_.data() + r.row0 * H);
    project(w->qkv, xm_.data() + r.row0 * H, r.rows, 2 * H, H, big_.data() + r.row0 * 3 * H + 2 * H, 3 * H);
  }
  ex_.start_v({big_.data(), Mp_, 3 * cfg_.heads, d, 3 * H});
  for (int s = 0; s < 2; ++s) {
    const auto& [w, r] = streams[s];
    float* qkv = big_.data() + r.row0 * 3 * H;
    project(w->qkv, xm_.data() + r.row0 * H, r.rows, 0, 2 * H, qkv, 3 * H);
    qk_norm_rope(qkv, r.rows, 3 * H, cfg_.heads, d, param(w->q_scale), param(w->k_scale), eps, r.rope);
    ex_.poll();
  }

  ex_.attention({big_.data(), Mp_, 3 * cfg_.heads, d, 3 * H}, {attn_.data(), Mp_, cfg_.heads, d, H});

  for (int s = 0; s < 2; ++s) {
    const auto& [w, r] = streams[s];
    const float* mod = mods[s].data();
    float* x = x_.data() + r.row0 * H;
    float* xm = xm_.data() + r.row0 * H;
    dit_linear(P, w->proj, attn_.data() + r.row0 * H, H, r.rows, y_.data(), H);
    gated_add(x, r.rows, H, mod + 2 * H, y_.data(), H);
    layernorm_modulate(x, r.rows, H, mod + 3 * H, mod + 4 * H, eps, xm);
    dit_linear(P, w->mlp0, xm, H, r.rows, big_.data(), M);  // q | k | v are consumed: reuse
    gelu_tanh_inplace(big_.data(), r.rows, M, M);
    dit_linear(P, w->mlp2, big_.data(), M, r.rows, y_.data(), H);
    gated_add(x, r.rows, H, mod + 5 * H, y_.data(), H);
  }
}

void DitModel::single_block(const DitLayout::SingleBlock& blk) {
  const std::vector<float>& P = w_.params();
  const std::int64_t H = cfg_.hidden(), M = cfg_.mlp_hidden, d = cfg_.head_dim, ld = 3 * H + M;
  const float eps = static_cast<float>(cfg_.eps);
  modulation(blk.mod, mod_);  // shift, scale, gate
  layernorm_modulate(x_.data(), Mp_, H, mod_.data(), mod_.data() + H, eps, xm_.data());
  // linear1 -> [M_p, q | k | v | m]: v first (V-First), then q | k + norm + RoPE, then m.
  project(blk.linear1, xm_.data(), Mp_, 2 * H, H, big_.data() + 2 * H, ld);
  ex_.start_v({big_.data(), Mp_, 3 * cfg_.heads, d, ld});
  project(blk.linear1, xm_.data(), Mp_, 0, 2 * H, big_.data(), ld);
  for (const StreamRows& r : {txt_rows_, img_rows_}) {
    qk_norm_rope(big_.data() + r.row0 * ld, r.rows, ld, cfg_.heads, d, param(blk.q_scale), param(blk.k_scale), eps, r.rope);
    ex_.poll();
  }
  project(blk.linear1, xm_.data(), Mp_, 3 * H, M, big_.data() + 3 * H, ld);
  // The attention output overwrites the v columns, so [a | m] is linear2's input in place.
  ex_.attention({big_.data(), Mp_, 3 * cfg_.heads, d, ld}, {big_.data() + 2 * H, Mp_, cfg_.heads, d, ld});
  gelu_tanh_inplace(big_.data() + 3 * H, Mp_, M, ld);
  dit_linear(P, blk.linear2, big_.data() + 2 * H, ld, Mp_, y_.data(), H);
  gated_add(x_.data(), Mp_, H, mod_.data() + 2 * H, y_.data(), H);
}

}  // namespace diffcp
