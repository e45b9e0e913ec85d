#include "diffcp/dit/weights.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <random>
#include <set>

#include <nlohmann/json.hpp>

#include "diffcp/core/error.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/ops/gemm.hpp"

namespace diffcp {

namespace {

// src: [rows, cols] -> dst: [cols, rows]
void transpose(const float* src, std::int64_t rows, std::int64_t cols, float* dst) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

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
      return "\n  (diffusers' names, e.g. '" + n + "': give the diffusers folder (its config.json beside the file) as `weights`)";
  }
  return "";
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Which unit holds the Linear weight at matrix offset w, and where in it.
std::pair<int, std::int64_t> unit_place(const DitLayout& L, std::int64_t w) {
  for (std::size_t u = 0; u < L.units.size(); ++u) {
    std::int64_t at = 0;
    for (std::size_t i = 0; i < L.units[u].w.size(); ++i) {
      if (L.units[u].w[i] == w) return {static_cast<int>(u), at};
      at += L.units[u].n[i];
    }
  }
  DIFFCP_FAIL("dit weights: no Linear weight at matrix offset ", w);
}

}  // namespace

std::int64_t dit_weight_bytes(const DitLayout& L, DType storage, int shards) {
  DIFFCP_CHECK(shards >= 1, "dit_weight_bytes: ", shards, " shards");
  const std::int64_t e = static_cast<std::int64_t>(dtype_size(storage));
  if (shards == 1) return e * L.matrices + 4 * L.vectors;
  std::int64_t held = L.units[0].size, widest = 0;
  for (std::size_t u = 1; u < L.units.size(); ++u) {
    held += ceil_div(L.units[u].size, shards);
    widest = std::max(widest, ceil_div(L.units[u].size, shards));
  }
  return e * (held + 2 * shards * widest) + 4 * L.vectors;
}

std::int64_t dit_gather_bytes(const DitLayout& L, DType storage, int shards) {
  std::int64_t c = 0;
  for (std::size_t u = 1; u < L.units.size(); ++u) c += ceil_div(L.units[u].size, shards);
  return shards > 1 ? static_cast<std::int64_t>(dtype_size(storage)) * (shards - 1) * c : 0;
}

DitWeights::DitWeights(const DitConfig& cfg, DType storage, Communicator* shard_over)
    : cfg_(cfg), layout_(cfg), storage_(storage), vectors_(DType::f32, layout_.vectors) {
  DIFFCP_CHECK(storage == DType::f32 || storage == DType::bf16, "`weights_dtype` ", dtype_name(storage),
               ": expected f32 or bf16");
  if (shard_over != nullptr && shard_over->size() > 1) {
    comm_ = shard_over->split(0, shard_over->rank(), "dit.weights");
    shards_ = comm_->size();
    rank_ = comm_->rank();
  }
  fill(vectors_.view(), 0.f);
  std::int64_t widest = 0;
  for (std::size_t u = 0; u < layout_.units.size(); ++u) {
    units_.emplace_back(storage_, slice(static_cast<int>(u)));
    if (units_.back().numel() > 0) fill(units_.back().view(), 0.f);
    if (u > 0) widest = std::max(widest, slice(static_cast<int>(u)));
  }
  if (sharded())
    for (Buffer& w : windows_) w = Buffer(storage_, shards_ * widest);
}

DitWeights::~DitWeights() = default;

std::int64_t DitWeights::slice(int u) const {
  const std::int64_t S = layout_.units[static_cast<std::size_t>(u)].size;
  return sharded() && u > 0 ? ceil_div(S, shards_) : S;
}

std::int64_t DitWeights::bytes() const {
  std::int64_t b = static_cast<std::int64_t>(vectors_.bytes() + windows_[0].bytes() + windows_[1].bytes());
  for (const Buffer& u : units_) b += static_cast<std::int64_t>(u.bytes());
  return b;
}

template <typename F>
void DitWeights::write(const DitLayout::Tensor& t, F&& produce) {
  const ScopedBackend use(*vectors_.backend());
  std::vector<float> host;
  const bool direct = !t.linear_weight && vectors_.device() == Device::host;
  float* dst = direct ? vectors_.ptr<float>() + t.offset : (host.resize(static_cast<std::size_t>(t.size)), host.data());
  produce(dst);
  if (direct) return;
  if (!t.linear_weight) {
    copy(TensorView::contiguous(vectors_.ptr<float>() + t.offset, DType::f32, {t.size}, vectors_.device()),
         ConstTensorView::contiguous(host.data(), DType::f32, {t.size}));
    return;
  }
  // A matrix: the part of [at, at + size) of its unit that this rank holds.
  const auto [u, at] = unit_place(layout_, t.offset);
  const std::int64_t held = slice(u), lo = sharded() && u > 0 ? rank_ * held : 0;
  const std::int64_t a = std::max(at, lo), b = std::min(at + t.size, lo + held);
  if (a >= b) return;
  const Buffer& unit = units_[static_cast<std::size_t>(u)];
  const ConstTensorView src = ConstTensorView::contiguous(host.data() + (a - at), DType::f32, {b - a});
  if (storage_ == DType::f32) {
    copy(TensorView::contiguous(unit.ptr<float>() + (a - lo), DType::f32, {b - a}, unit.device()), src);
  } else {
    DeviceVector<float> staged;
    staged.assign(host.data() + (a - at), b - a);
    convert(staged.data(), unit.ptr<bf16_t>() + (a - lo), b - a);
  }
}

void DitWeights::drop_packed() {
  packed_.clear();
  window_packed_.reset();
  window_packed_of_ = -1;
}

void DitWeights::drop_derived() {
  rounded_.clear();
  drop_packed();
}

void DitWeights::init_random(std::uint64_t seed) {
  drop_derived();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const DitLayout::Tensor& t : layout_.tensors) write(t, [&](float* p) {
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
  // diffusers ignores Wan I2V's unused norm_added_q (WanTransformer3DModel._keys_to_ignore_on_load_unexpected)
  const auto ignored = [&](const std::string& n) {
    return format == DitFileFormat::diffusers && cfg.family == DitFamily::wan && n.find(".norm_added_q.") != std::string::npos;
  };
  for (const std::string& n : ck.names())
    if (!expected.count(n) && !ignored(n)) extra.push_back("'" + n + "' " + ck.info(n).dtype + " " + shape_str(ck.info(n).shape));
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
  drop_derived();
  check_dit_checkpoint(cfg_, ck, format);
  for (const DitLayout::Tensor& t : layout_.tensors) {
    // The tensor's rows from its parts in the file ([out, in] rows of a Linear weight, which lands
    // transposed: rows of [in, out] become columns; a vector's elements).
    const std::vector<DitFilePart> parts = dit_file_parts(t, cfg_, format);
    std::int64_t cols = 1;  // elements per row: a Linear's in, or the rest of a table's dims
    for (std::size_t k = 1; k < t.shape.size(); ++k) cols *= t.shape[k];
    write(t, [&](float* dst) {
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

std::vector<float> DitWeights::host_params() const {
  DIFFCP_CHECK(!sharded(), "dit weights: host_params / save need the whole model on one rank (not `shard_weights`)");
  const ScopedBackend use(*vectors_.backend());
  std::vector<float> out(static_cast<std::size_t>(layout_.total));
  float* m = out.data();
  for (std::size_t u = 0; u < units_.size(); ++u) {
    const std::vector<float> unit = storage_ == DType::f32 ? to_host<float>(units_[u].view()) : [&] {
      const std::vector<bf16_t> h = to_host<bf16_t>(units_[u].view());
      std::vector<float> f(h.size());
      for (std::size_t i = 0; i < h.size(); ++i) f[i] = bf16_to_f32(h[i].bits);
      return f;
    }();
    std::int64_t at = 0;
    for (std::size_t i = 0; i < layout_.units[u].w.size(); ++i) {
      std::copy_n(unit.begin() + at, layout_.units[u].n[i], m + layout_.units[u].w[i]);
      at += layout_.units[u].n[i];
    }
  }
  copy(TensorView::contiguous(out.data() + layout_.matrices, DType::f32, {layout_.vectors}), vectors_.view());
  return out;
}

void DitWeights::set_host_params(const std::vector<float>& p) {
  drop_derived();
  DIFFCP_CHECK(static_cast<std::int64_t>(p.size()) == layout_.total, "dit weights: ", p.size(), " parameters, the model has ",
               layout_.total);
  for (const DitLayout::Tensor& t : layout_.tensors)
    write(t, [&](float* dst) { std::copy_n(p.begin() + (t.linear_weight ? 0 : layout_.matrices) + t.offset, t.size, dst); });
}

void DitWeights::save(const std::string& path, const std::string& dtype) const {
  DIFFCP_CHECK(dtype == "F32" || dtype == "BF16" || dtype == "F16", "DitWeights::save: dtype '", dtype,
               "', expected F32, BF16 or F16");
  // Linear weights go back to [out, in]; the converted copies live until the file is written.
  std::vector<std::vector<float>> transposed;
  std::vector<std::vector<std::uint16_t>> halves;
  std::vector<NamedTensor> out;
  const std::vector<float> params = host_params();
  for (const DitLayout::Tensor& t : layout_.tensors) {
    const float* data = params.data() + (t.linear_weight ? 0 : layout_.matrices) + t.offset;
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

const void* DitWeights::matrix(const DitLinear& l) const {
  const std::size_t e = dtype_size(storage_);
  if (!sharded() || l.unit == 0) return static_cast<const std::byte*>(units_[static_cast<std::size_t>(l.unit)].data()) + l.at * e;
  if (window_unit_[current_] != l.unit) {
    if (window_unit_[1 - current_] == l.unit) {
      current_ = 1 - current_;
    } else {
      if (pending_unit_ != l.unit) issue(l.unit);  // out of order: fetched now
      const auto t0 = std::chrono::steady_clock::now();
      finish_pending();
      stats_.wait_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      current_ = window_unit_[0] == l.unit ? 0 : 1;
    }
    const int next = l.unit + 1;  // flies meanwhile, unless the other window still holds it
    if (next < static_cast<int>(layout_.units.size()) && window_unit_[1 - current_] != next) issue(next);
  }
  return static_cast<const std::byte*>(windows_[current_].data()) + l.at * e;
}

void DitWeights::finish_pending() const {
  for (WorkPtr& w : pending_) w->wait();
  pending_.clear();
  window_unit_[pending_window_] = pending_unit_;
  pending_unit_ = -1;
}

void DitWeights::issue(int u) const {
  if (!pending_.empty()) finish_pending();  // a gather nobody asked for yet: complete it first (messages stay in order)
  pending_window_ = 1 - current_;
  window_unit_[pending_window_] = -1;
  if (window_packed_of_ == pending_window_) window_packed_of_ = -1;  // its packed slice was of the unit it held
  pending_unit_ = u;
  // The all-gather as point-to-point messages (the receives first): they progress at every poll()
  // and complete in one copy each on a node, where a non-blocking collective would wait for its
  // rounds (measured: bench/history/2026-12-04-issue-35-weights-and-pipelines.md). Window = [P][c_u]: rank r's slice at r c_u.
  const std::size_t c = static_cast<std::size_t>(slice(u));
  const void* mine = units_[static_cast<std::size_t>(u)].data();
  std::byte* window = static_cast<std::byte*>(windows_[pending_window_].data());
  const std::size_t e = dtype_size(storage_);
  // One hop (exchange_async): on NCCL one group, so no rank's send waits on a later group.
  const Device dev = active_backend().device_of(mine);
  std::vector<Communicator::P2pOp> ops;
  const auto n = static_cast<std::int64_t>(c);
  for (int r = 0; r < shards_; ++r)
    if (r != rank_)
      ops.push_back(Communicator::P2pOp::recv(
          TensorView::contiguous(window + static_cast<std::size_t>(r) * c * e, storage_, {n}, dev), r));
  for (int r = 0; r < shards_; ++r)
    if (r != rank_) ops.push_back(Communicator::P2pOp::send(ConstTensorView::contiguous(mine, storage_, {n}, dev), r));
  if (!ops.empty()) pending_.push_back(comm_->exchange_async(ops));
  convert_rows(mine, storage_, static_cast<std::int64_t>(c), window + static_cast<std::size_t>(rank_) * c * e, storage_,
               static_cast<std::int64_t>(c), 1, static_cast<std::int64_t>(c));
  ++stats_.gathers;
}

void DitWeights::set_packing(bool on) {
  packing_ = on;
  if (!on) drop_packed();
}

const PackedWeight* DitWeights::packed(const DitLinear& l, std::int64_t c0, std::int64_t ncols) const {
  if (!packing_) return nullptr;
  DIFFCP_CHECK(c0 >= 0 && ncols >= 0 && c0 + ncols <= l.out, "dit weights: columns [", c0, ", ", c0 + ncols,
               ") of a Linear with ", l.out);
  const ConstTensorView w = gemm_weight(l, c0, ncols);  // for a sharded block unit: its window made current
  if (w.dtype != DType::bf16) return nullptr;           // the f32 GEMMs read the weights as stored
  const PackedKey key{l.unit, l.at, c0, ncols};
  const auto pack = [&] {
    Backend& b = active_backend();
    DIFFCP_CHECK(&b == backend(), "dit weights: packed on backend '", b.name(), "', the weights live on '",
                 backend()->name(), "'");
    return b.pack_weight(w);
  };
  if (sharded() && l.unit != 0) {
    if (window_packed_of_ != current_ || window_key_ != key) {
      window_packed_ = pack();
      window_packed_of_ = current_;
      window_key_ = key;
    }
    return window_packed_.get();
  }
  auto [it, fresh] = packed_.try_emplace(key);
  if (fresh) it->second = pack();
  return it->second.get();
}

std::size_t DitWeights::packed_bytes() const {
  std::size_t n = 0;
  for (const auto& [key, p] : packed_) n += p ? p->bytes() : 0;
  if (window_packed_) n += window_packed_->bytes();
  return n;
}

ConstTensorView DitWeights::gemm_weight(const DitLinear& l, std::int64_t c0, std::int64_t ncols) const {
  DIFFCP_CHECK(c0 >= 0 && ncols >= 0 && c0 + ncols <= l.out, "dit weights: columns [", c0, ", ", c0 + ncols,
               ") of a Linear with ", l.out);
  const void* m = matrix(l);
  const bool round = storage_ == DType::f32 && f32_gemm_compute() == DType::bf16;
  const DType t = round ? DType::bf16 : storage_;
  const std::byte* at = static_cast<const std::byte*>(round ? static_cast<const void*>(rounded(l)) : m) +
                        static_cast<std::size_t>(c0) * dtype_size(t);
  ConstTensorView v = ConstTensorView::contiguous(at, t, {l.in, ncols}, backend()->device());
  v.stride[0] = l.out;
  return v;
}

const bf16_t* DitWeights::rounded(const DitLinear& l) const {
  DIFFCP_CHECK(storage_ == DType::f32 && !sharded(), "dit weights: a rounded copy of replicated f32 weights only");
  if (rounded_.empty())
    for (const Buffer& u : units_) {
      rounded_.emplace_back(DType::bf16, u.numel());
      if (u.numel() > 0) convert(u.ptr<float>(), rounded_.back().ptr<bf16_t>(), u.numel());
    }
  return rounded_[static_cast<std::size_t>(l.unit)].ptr<bf16_t>() + l.at;
}

void DitWeights::begin_forward() const {
  if (!sharded() || layout_.units.size() < 2) return;
  if (window_unit_[0] != 1 && window_unit_[1] != 1 && pending_unit_ != 1) issue(1);
}

void DitWeights::poll() const {
  for (WorkPtr& w : pending_) w->test();
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
  DIFFCP_CHECK(!heads || *heads == c.heads, "`heads` ", heads.value_or(0), " disagrees with the checkpoint: hidden ", H,
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


}  // namespace diffcp
