#include "diffcp/dit/model.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include <nlohmann/json.hpp>

#include "diffcp/core/error.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/dit/diffusers.hpp"
#include "diffcp/io/safetensors.hpp"
#include "diffcp/ops/gemm.hpp"
#include "diffcp/ops/rmsnorm.hpp"

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

namespace {
// Writes one tensor's values into the parameters: `produce(dst)` fills [t.size] host floats, straight
// into the parameters when they are host memory, else into a staging copy sent with the backend's copy.
template <typename F>
void write_tensor(const Buffer& params, const DitLayout::Tensor& t, F&& produce) {
  float* dst = params.ptr<float>() + t.offset;
  if (params.device() == Device::host) {
    produce(dst);
    return;
  }
  std::vector<float> host(static_cast<std::size_t>(t.size));
  produce(host.data());
  const ScopedBackend use(*params.backend());
  copy(TensorView::contiguous(dst, DType::f32, {t.size}, params.device()),
       ConstTensorView::contiguous(host.data(), DType::f32, {t.size}));
}
}  // namespace

DitWeights::DitWeights(const DitConfig& cfg) : cfg_(cfg), layout_(cfg), params_(DType::f32, layout_.total) {
  fill(params_.view(), 0.f);
}

void DitWeights::init_random(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const DitLayout::Tensor& t : layout_.tensors) write_tensor(params_, t, [&](float* p) {
    if (t.linear_weight) {
      const float stddev = 1.f / std::sqrt(static_cast<float>(t.shape[1]));  // shape [out, in]
      for (std::int64_t i = 0; i < t.size; ++i) p[i] = normal(rng) * stddev;
    } else {
      // 1-D tensors: biases start at 0, the QK-norm scales at 1; SD3's position table N(0, 1/4).
      if (t.name == "pos_embed") {
        for (std::int64_t i = 0; i < t.size; ++i) p[i] = 0.5f * normal(rng);
        return;
      }
      const bool scale = t.name.ends_with(".scale");
      std::fill(p, p + t.size, scale ? 1.f : 0.f);
    }
  });
}

namespace {

// A floating-point tensor's bytes in the file (little-endian, as safetensors) as f32: `get(i)`.
enum class FileDtype { f32, bf16, f16 };
FileDtype file_dtype(const std::string& d) { return d == "F32" ? FileDtype::f32 : d == "BF16" ? FileDtype::bf16 : FileDtype::f16; }

template <FileDtype D>
inline float element(const std::byte* p, std::int64_t i) {
  if constexpr (D == FileDtype::f32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  } else {
    std::uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return D == FileDtype::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
  }
}

// src: file bytes [rows, cols] -> dst, transposed (dst[c * ld + r]: rows of a wider [cols, ld]) or
// not (dst[r * cols + c]); OpenMP over 64-row tiles.
template <FileDtype D>
void convert(const std::byte* src, std::int64_t rows, std::int64_t cols, bool transpose, std::int64_t ld, float* dst) {
  constexpr std::int64_t kTile = 64;
#pragma omp parallel for schedule(static)
  for (std::int64_t r0 = 0; r0 < rows; r0 += kTile)
    for (std::int64_t c0 = 0; c0 < cols; c0 += kTile)
      for (std::int64_t r = r0; r < std::min(rows, r0 + kTile); ++r)
        for (std::int64_t c = c0; c < std::min(cols, c0 + kTile); ++c)
          dst[transpose ? c * ld + r : r * cols + c] = element<D>(src, r * cols + c);
}

void convert(const std::byte* src, FileDtype d, std::int64_t rows, std::int64_t cols, bool transpose, std::int64_t ld,
             float* dst) {
  if (d == FileDtype::f32) convert<FileDtype::f32>(src, rows, cols, transpose, ld, dst);
  else if (d == FileDtype::bf16) convert<FileDtype::bf16>(src, rows, cols, transpose, ld, dst);
  else convert<FileDtype::f16>(src, rows, cols, transpose, ld, dst);
}

// Lists at most 50 lines, then how many more.
void append_problems(std::string& out, const char* what, const std::vector<std::string>& items) {
  constexpr std::size_t kMax = 50;
  if (items.empty()) return;
  out += "\n  " + std::to_string(items.size()) + " " + what + ":";
  for (std::size_t i = 0; i < items.size() && i < kMax; ++i) out += "\n    " + items[i];
  if (items.size() > kMax) out += "\n    ... and " + std::to_string(items.size() - kMax) + " more";
}

// Names other tools give FLUX's tensors, so the error says what the file is.
std::string foreign_format_hint(const SafeTensorsSet& ck) {
  for (const std::string& n : ck.names()) {
    if (n.starts_with("model.diffusion_model."))
      return "\n  (ComfyUI's layout: the tensors carry the prefix 'model.diffusion_model.'; strip it to get BFL's names)";
    if (n.starts_with("transformer_blocks.") || n.starts_with("x_embedder.") || n.starts_with("single_transformer_blocks."))
      return "\n  (diffusers' names, e.g. '" + n + "': give the diffusers folder (its config.json beside the file) as --weights)";
  }
  return "";
}

}  // namespace

void check_dit_checkpoint(const DitConfig& cfg, const SafeTensorsSet& ck, DitFileFormat format) {
  const DitLayout layout(cfg);
  // The whole header first: every problem named in one error, before any data is read.
  std::vector<std::string> missing, misshapen, extra;
  std::set<std::string> expected;
  for (const DitLayout::Tensor& t : layout.tensors)
    for (const DitFilePart& part : dit_file_parts(t, cfg, format)) {
      if (!expected.insert(part.name).second) continue;
      if (!ck.has(part.name)) {
        missing.push_back("'" + part.name + "' " + shape_str(part.file_shape));
        continue;
      }
      const SafeTensors::Info& info = ck.info(part.name);
      const bool fp = info.dtype == "F32" || info.dtype == "BF16" || info.dtype == "F16";
      if (!fp || info.shape != part.file_shape)
        misshapen.push_back("'" + part.name + "' is " + info.dtype + " " + shape_str(info.shape) + ", expected " +
                            shape_str(part.file_shape) + (t.linear_weight ? " ([out, in], PyTorch's Linear layout)" : "") +
                            (fp ? "" : " of F32, BF16 or F16"));
    }
  for (const std::string& n : ck.names())
    if (!expected.count(n)) extra.push_back("'" + n + "' " + ck.info(n).dtype + " " + shape_str(ck.info(n).shape));
  if (!missing.empty() || !misshapen.empty() || !extra.empty()) {
    std::string msg;
    append_problems(msg, "missing tensors", missing);
    append_problems(msg, "tensors of the wrong dtype or shape", misshapen);
    append_problems(msg, "tensors this model does not have", extra);
    const nlohmann::json c = cfg.to_json();
    DIFFCP_FAIL("weights '", ck.path(), "' do not match the model (", c.dump(), "; names and shapes: ",
                format == DitFileFormat::bfl ? std::string("dit/config.hpp")
                                             : std::string("diffusers' ") + diffusers_class(cfg.family) + ", dit/diffusers.hpp",
                "):", msg,
                !cfg.guidance_embed && ck.has("guidance_in.in_layer.weight")
                    ? "\n  (a guidance-distilled checkpoint such as FLUX.1-dev: its config needs guidance_embed = true)"
                    : "",
                format == DitFileFormat::bfl ? foreign_format_hint(ck) : "");
  }
}

void DitWeights::load(const SafeTensorsSet& ck, DitFileFormat format) {
  check_dit_checkpoint(cfg_, ck, format);
  for (const DitLayout::Tensor& t : layout_.tensors) {
    // The tensor's rows from its parts in the file ([out, in] rows of a Linear weight, which lands
    // transposed: rows of [in, out] become columns; a vector's elements).
    const std::vector<DitFilePart> parts = dit_file_parts(t, cfg_, format);
    std::int64_t cols = 1;  // elements per row: a Linear's in, or the rest of a table's dims
    for (std::size_t k = 1; k < t.shape.size(); ++k) cols *= t.shape[k];
    write_tensor(params_, t, [&](float* dst) {
      std::int64_t row = 0;
      for (const DitFilePart& part : parts) {
        const SafeTensors& file = ck.file(part.name);
        const FileDtype d = file_dtype(file.info(part.name).dtype);
        const std::byte* src = file.bytes(part.name).data() + part.row0 * cols * (d == FileDtype::f32 ? 4 : 2);
        convert(src, d, part.rows, cols, t.linear_weight, t.shape[0], t.linear_weight ? dst + row : dst + row * cols);
        row += part.rows;
      }
    });
    for (const DitFilePart& part : parts) ck.file(part.name).release(part.name);
  }
}

void DitWeights::save(const std::string& path, const std::string& dtype) const {
  DIFFCP_CHECK(dtype == "F32" || dtype == "BF16" || dtype == "F16", "DitWeights::save: dtype '", dtype,
               "', expected F32, BF16 or F16");
  // Linear weights go back to [out, in]; the converted copies live until the file is written.
  std::vector<std::vector<float>> transposed;
  std::vector<std::vector<std::uint16_t>> halves;
  std::vector<NamedTensor> out;
  std::vector<float> staged;  // the parameters on the host, when they live elsewhere
  const float* params = params_.device() == Device::host ? params_.ptr<float>() : (staged = host_params()).data();
  for (const DitLayout::Tensor& t : layout_.tensors) {
    const float* data = params + t.offset;
    if (t.linear_weight) {
      transposed.emplace_back(static_cast<std::size_t>(t.size));
      transpose(data, t.shape[1], t.shape[0], transposed.back().data());
      data = transposed.back().data();
    }
    if (dtype == "F32") {
      out.push_back({t.name, "F32", t.shape, data});
      continue;
    }
    halves.emplace_back(static_cast<std::size_t>(t.size));
    for (std::int64_t i = 0; i < t.size; ++i)
      halves.back()[static_cast<std::size_t>(i)] = dtype == "BF16" ? f32_to_bf16(data[i]) : f32_to_f16(data[i]);
    out.push_back({t.name, dtype, t.shape, halves.back().data()});
  }
  write_safetensors(path, out);
}

DitConfig infer_dit_config(const SafeTensorsSet& ck, std::optional<std::int64_t> heads) {
  const auto shape_of = [&](const std::string& name, std::size_t rank) {
    DIFFCP_CHECK(ck.has(name), "weights '", ck.path(), "': cannot infer the model shape without tensor '", name,
                 "' (expected a FLUX checkpoint with BFL's tensor names, as flux1-*.safetensors)", foreign_format_hint(ck));
    const std::vector<std::int64_t>& s = ck.info(name).shape;
    DIFFCP_CHECK(s.size() == rank, "weights '", ck.path(), "': tensor '", name, "' has shape ", shape_str(s),
                 ", expected ", rank, " dimensions");
    return s;
  };
  // The number of blocks: 1 + the largest index i of "prefix.i." among the names.
  const auto count_blocks = [&](const std::string& prefix) {
    std::int64_t n = 0;
    for (const std::string& name : ck.names()) {
      if (!name.starts_with(prefix)) continue;
      const std::size_t dot = name.find('.', prefix.size());
      const std::string idx = name.substr(prefix.size(), dot == std::string::npos ? std::string::npos : dot - prefix.size());
      if (idx.empty() || idx.size() > 6 || idx.find_first_not_of("0123456789") != std::string::npos) continue;
      n = std::max<std::int64_t>(n, std::stoll(idx) + 1);
    }
    return n;
  };
  DitConfig c;
  const auto img_in = shape_of("img_in.weight", 2);
  const std::int64_t H = img_in[0], in = img_in[1];
  DIFFCP_CHECK(in >= 4 && in % 4 == 0, "weights '", ck.path(), "': img_in.weight is ", shape_str(img_in),
               ", expected C_in = 4 x latent channels (FLUX's 2x2 packing)");
  c.latent_channels = in / 4;
  c.patch = 2;
  c.text_dim = shape_of("txt_in.weight", 2)[1];
  c.pooled_dim = shape_of("vector_in.in_layer.weight", 2)[1];
  c.time_dim = shape_of("time_in.in_layer.weight", 2)[1];
  c.guidance_embed = ck.has("guidance_in.in_layer.weight");
  c.double_blocks = count_blocks("double_blocks.");
  c.single_blocks = count_blocks("single_blocks.");
  DIFFCP_CHECK(c.double_blocks + c.single_blocks >= 1, "weights '", ck.path(), "': no double_blocks.* or single_blocks.* tensors");
  const std::string norm = c.double_blocks > 0 ? "double_blocks.0.img_attn.norm.query_norm.scale" : "single_blocks.0.norm.query_norm.scale";
  c.head_dim = shape_of(norm, 1)[0];
  DIFFCP_CHECK(c.head_dim >= 1 && H % c.head_dim == 0, "weights '", ck.path(), "': '", norm, "' has d_h = ", c.head_dim,
               ", which does not divide the hidden size ", H);
  c.heads = H / c.head_dim;
  DIFFCP_CHECK(!heads || *heads == c.heads, "--heads ", heads.value_or(0), " disagrees with the checkpoint: hidden ", H,
               " / head dim ", c.head_dim, " (from '", norm, "') = ", c.heads, " heads");
  if (c.double_blocks > 0) {
    c.mlp_hidden = shape_of("double_blocks.0.img_mlp.0.weight", 2)[0];
    c.qkv_bias = ck.has("double_blocks.0.img_attn.qkv.bias");
  } else {
    c.mlp_hidden = shape_of("single_blocks.0.linear1.weight", 2)[0] - 3 * H;
  }
  c.rope_axes = flux_rope_axes(c.head_dim);
  try {
    c.validate();
  } catch (const Error& e) {
    DIFFCP_FAIL("weights '", ck.path(), "': the shape read off the tensors is not a valid model: ", e.what());
  }
  return c;
}

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
      const std::int64_t n = shard_.p * Ip + i, r = n / gw, c = n % gw;
      pos.push_back(qwen ? std::array<double, kMaxRopeAxes>{0.0, static_cast<double>(r - (gh - gh / 2)),
                                                            static_cast<double>(c - (gw - gw / 2)), 0.0}
                         : std::array<double, kMaxRopeAxes>{0.0, static_cast<double>(r), static_cast<double>(c), 0.0});
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
  txt_rows_ = {0, Mt, txt_rope_.get()};
  img_rows_ = {Mt, Mi, rope_.get()};

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

  DIFFCP_CHECK(&active_backend() == w_.params().backend(), "DitModel: the active backend '", active_backend().name(),
               "' is not the one holding the weights ('", w_.params().backend()->name(), "')");
  for (DeviceVector<float>* v : {&x_, &xm_, &attn_, &y_}) v->resize(Mp_ * H);
  big_.resize(Mp_ * (3 * H + cfg_.mlp_in()));
  temb_.resize(cfg_.time_dim);
  if (qwen) {
    txt_normed_.resize(Tp * cfg_.text_dim);
    txt_rstd_.resize(Tp);
  }
  for (DeviceVector<float>* v : {&h_, &vec_, &silu_vec_}) v->resize(H);
  mod_.resize(6 * H);
  mods_.resize(12 * H);
}

void DitModel::project(const DitLinear& l, const float* x, std::int64_t rows, std::int64_t c0, std::int64_t ncols, float* y,
                       std::int64_t ldy) {
  for (std::int64_t r0 = 0; r0 < rows; r0 += kPollRows) {
    linear(l, x + r0 * l.in, l.in, std::min(kPollRows, rows - r0), c0, ncols, y + r0 * ldy, ldy);
    ex_.poll();
  }
}

void DitModel::linear(const DitLinear& l, const float* x, std::int64_t ldx, std::int64_t M, std::int64_t c0,
                      std::int64_t ncols, float* y, std::int64_t ldy) const {
  // W: [in, out], columns c0.. with row stride out
  if (params16_.empty())
    dit_linear(x, ldx, M, l.in, param(l.w) + c0, l.out, ncols, param(l.b) + c0, y, ldy);
  else
    dit_linear(x, ldx, M, l.in, params16_.data() + l.w + c0, l.out, ncols, param(l.b) + c0, y, ldy);
}

void DitModel::modulation(const DitLinear& l, float* out) const { linear(l, silu_vec_.data(), l.in, 1, out, l.out); }

void DitModel::velocity(const float* x_p, const float* txt_p, const float* pooled, double t, double guidance,
                        float* v_p) {
  const DitLayout& L = w_.layout();
  DIFFCP_CHECK(&active_backend() == w_.params().backend(), "DitModel::velocity: the active backend '",
               active_backend().name(), "' is not the one holding the weights ('", w_.params().backend()->name(), "')");
  // bf16 compute: the weights rounded once (they are constant for the model's life), the
  // activations at each GEMM; f32: the f32 weights.
  if (f32_gemm_compute() == DType::bf16 && params16_.empty()) {
    params16_.resize(L.total);
    convert(w_.params().ptr<float>(), params16_.data(), L.total);
  } else if (f32_gemm_compute() == DType::f32) {
    params16_ = DeviceVector<bf16_t>();
  }
  const std::int64_t H = cfg_.hidden(), Tp = shard_.text_p;
  // The timestep features (host math on one scalar) into temb_.
  const auto features = [&](double s) {
    temb_.assign(timestep_embedding(s, cfg_.time_dim));
  };

  // vec = MLP_time(timestep features) + MLP_vector(pooled); the blocks use silu(vec).
  features(t);
  linear(L.time_in0, temb_.data(), cfg_.time_dim, 1, h_.data(), H);
  silu_inplace(h_.data(), H);
  linear(L.time_in1, h_.data(), H, 1, vec_.data(), H);
  if (cfg_.guidance_embed) {  // FLUX.1-dev: vec += MLP_guidance(timestep_embedding(guidance))
    features(guidance);
    linear(L.guidance_in0, temb_.data(), cfg_.time_dim, 1, h_.data(), H);
    silu_inplace(h_.data(), H);
    linear(L.guidance_in1, h_.data(), H, 1, y_.data(), H);
    add_into(vec_.data(), y_.data(), H);
  }
  if (cfg_.has_pooled()) {  // FLUX: vec += MLP_vector(pooled)
    linear(L.vector_in0, pooled, cfg_.pooled_dim, 1, h_.data(), H);
    silu_inplace(h_.data(), H);
    linear(L.vector_in1, h_.data(), H, 1, silu_vec_.data(), H);
    add_into(silu_vec_.data(), vec_.data(), H);
  } else {
    device_copy(silu_vec_.data(), vec_.data(), H);
  }
  silu_inplace(silu_vec_.data(), H);

  // Embeddings: the text rows are the same for every image, projected once and copied.
  linear(L.img_in, x_p, cfg_.in_channels(), img_rows_.rows, x_.data() + img_rows_.row0 * H, H);
  if (L.pos_embed >= 0) add_into(x_.data() + img_rows_.row0 * H, pos_rows_.data(), img_rows_.rows * H);  // SD3
  if (Tp > 0) {
    if (L.txt_norm >= 0) {  // Qwen-Image: txt_in(RMSNorm(txt))
      rmsnorm_forward(txt_p, Tp, 1, cfg_.text_dim, param(L.txt_norm), static_cast<float>(cfg_.eps), txt_normed_.data(),
                      txt_rstd_.data());
      txt_p = txt_normed_.data();
    }
    linear(L.txt_in, txt_p, cfg_.text_dim, Tp, x_.data(), H);
    for (std::int64_t j = 1; j < shape_.batch; ++j) device_copy(x_.data() + j * Tp * H, x_.data(), Tp * H);
  }

  for (const auto& blk : L.double_blocks) double_block(blk);
  for (const auto& blk : L.single_blocks) single_block(blk);

  // Final layer on the image rows: (shift, scale).
  modulation(L.final_mod, mod_.data());
  const float* img = x_.data() + img_rows_.row0 * H;
  layernorm_modulate(img, img_rows_.rows, H, mod_.data(), mod_.data() + H, static_cast<float>(cfg_.eps), xm_.data());
  linear(L.final_linear, xm_.data(), H, img_rows_.rows, v_p, cfg_.in_channels());
  const std::int64_t C = cfg_.in_channels(), Ip = shard_.image_p, iv = shard_.image_valid(shard_.p);
  if (iv < Ip)  // padding rows: v = 0, so they stay as they came in
    for (std::int64_t j = 0; j < shape_.batch; ++j) fill(v_p + (j * Ip + iv) * C, (Ip - iv) * C, 0.f);
}

void DitModel::double_block(const DitLayout::DoubleBlock& blk) {
  const std::int64_t H = cfg_.hidden(), M = cfg_.mlp_hidden, d = cfg_.head_dim;
  const float eps = static_cast<float>(cfg_.eps);
  const std::pair<const DitLayout::Stream*, StreamRows> streams[] = {{&blk.txt, txt_rows_}, {&blk.img, img_rows_}};

  // Each stream's modulated, normed, rotated q | k | v into big_ as [M_p, 3H] (rows in place). V-First
  // (SPEC B.3): both streams' v columns first, V's exchange starts, then q | k + norm + RoPE.
  for (int s = 0; s < 2; ++s) {
    const auto& [w, r] = streams[s];
    float* mod = mods_.data() + s * 6 * H;  // shift1, scale1, gate1, shift2, scale2, gate2 (pre_only: shift, scale)
    modulation(w->mod, mod);
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
    if (w->pre_only) continue;  // SD3's last text stream: its rows are not read again
    const float* mod = mods_.data() + s * 6 * H;
    float* x = x_.data() + r.row0 * H;
    float* xm = xm_.data() + r.row0 * H;
    linear(w->proj, attn_.data() + r.row0 * H, H, r.rows, y_.data(), H);
    gated_add(x, r.rows, H, mod + 2 * H, y_.data(), H);
    layernorm_modulate(x, r.rows, H, mod + 3 * H, mod + 4 * H, eps, xm);
    const std::int64_t mi = cfg_.mlp_in();
    linear(w->mlp0, xm, H, r.rows, big_.data(), mi);  // q | k | v are consumed: reuse
    if (cfg_.swiglu())
      swiglu_rows(big_.data(), r.rows, M, mi);  // [gate | up] -> silu(gate) * up in the first M columns
    else
      gelu_tanh_inplace(big_.data(), r.rows, M, M);
    linear(w->mlp2, big_.data(), mi, r.rows, y_.data(), H);
    gated_add(x, r.rows, H, mod + 5 * H, y_.data(), H);
  }
}

void DitModel::single_block(const DitLayout::SingleBlock& blk) {
  const std::int64_t H = cfg_.hidden(), M = cfg_.mlp_hidden, d = cfg_.head_dim, ld = 3 * H + cfg_.mlp_in();
  const float eps = static_cast<float>(cfg_.eps);
  modulation(blk.mod, mod_.data());  // shift, scale, gate
  layernorm_modulate(x_.data(), Mp_, H, mod_.data(), mod_.data() + H, eps, xm_.data());
  // linear1 -> [M_p, q | k | v | m]: v first (V-First), then q | k + norm + RoPE, then m.
  project(blk.linear1, xm_.data(), Mp_, 2 * H, H, big_.data() + 2 * H, ld);
  ex_.start_v({big_.data(), Mp_, 3 * cfg_.heads, d, ld});
  project(blk.linear1, xm_.data(), Mp_, 0, 2 * H, big_.data(), ld);
  for (const StreamRows& r : {txt_rows_, img_rows_}) {
    qk_norm_rope(big_.data() + r.row0 * ld, r.rows, ld, cfg_.heads, d, param(blk.q_scale), param(blk.k_scale), eps, r.rope);
    ex_.poll();
  }
  project(blk.linear1, xm_.data(), Mp_, 3 * H, cfg_.mlp_in(), big_.data() + 3 * H, ld);
  // The attention output overwrites the v columns, so [a | act(m)] is linear2's input in place.
  ex_.attention({big_.data(), Mp_, 3 * cfg_.heads, d, ld}, {big_.data() + 2 * H, Mp_, cfg_.heads, d, ld});
  if (cfg_.swiglu())
    swiglu_rows(big_.data() + 3 * H, Mp_, M, ld);
  else
    gelu_tanh_inplace(big_.data() + 3 * H, Mp_, M, ld);
  linear(blk.linear2, big_.data() + 2 * H, ld, Mp_, y_.data(), H);
  gated_add(x_.data(), Mp_, H, mod_.data() + 2 * H, y_.data(), H);
}

}  // namespace diffcp
