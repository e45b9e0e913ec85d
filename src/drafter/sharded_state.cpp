#include "diffcp/drafter/sharded_state.hpp"

#include <algorithm>
#include <cmath>

#include "diffcp/core/error.hpp"
#include "diffcp/ops/elementwise.hpp"
#include "diffcp/ops/optim.hpp"

namespace diffcp {

ShardMode parse_shard_mode(const std::string& name) {
  if (name == "none") return ShardMode::none;
  if (name == "optimizer") return ShardMode::optimizer;
  if (name == "full") return ShardMode::full;
  DIFFCP_FAIL("`shard` '", name, "': expected none, optimizer or full");
}

ShardMode resolve_shard_mode(const std::string& name, bool real_shape, int ranks) {
  DIFFCP_CHECK(name == "auto" || name == "none" || name == "optimizer" || name == "full", "`shard` '", name,
               "': expected none, optimizer, full or auto");
  if (name != "auto") return parse_shard_mode(name);
  return ranks == 1 ? ShardMode::none : real_shape ? ShardMode::full : ShardMode::optimizer;
}

const char* shard_mode_name(ShardMode m) {
  return m == ShardMode::none ? "none" : m == ShardMode::optimizer ? "optimizer" : "full";
}

double shard_bytes_per_step(const DrafterLayout& layout, ShardMode m, int W, std::int64_t accum) {
  double N = 0;
  for (const auto& u : layout.units) N += static_cast<double>(W) * static_cast<double>((u.size + W - 1) / W);
  const double f = static_cast<double>(W - 1) / W * 4.0, total = static_cast<double>(layout.total);
  if (m == ShardMode::none) return 2.0 * total * f;  // all_reduce(total): the bandwidth-optimal count
  // + the gradient norm's all_reduce of one double.
  return (m == ShardMode::optimizer ? 2.0 * total : 3.0 * static_cast<double>(accum) * N) * f + 2.0 * 2 * f;
}

ShardedState::ShardedState(Communicator& mesh, const DrafterLayout& layout, ShardMode mode)
    : mesh_(mesh), layout_(layout), mode_(mode) {
  if (mode_ != ShardMode::none) W_ = mesh.size(), r_ = mesh.rank();
  own_off_.push_back(0);
  for (int u = 0; u < units(); ++u) own_off_.push_back(own_off_.back() + piece(u));
  const std::int64_t total = layout_.total, owned = own_off_.back();
  const auto zeros = [](DeviceVector<float>& v, std::int64_t n) {
    v.resize(n);
    fill(v.data(), n, 0.f);
  };
  if (mode_ != ShardMode::full) zeros(params_, total), zeros(grads_, total);
  if (mode_ == ShardMode::full) zeros(p_own_, owned);
  if (mode_ != ShardMode::none) zeros(g_own_, owned);
  zeros(m_, mode_ == ShardMode::none ? total : owned);
  zeros(v_, static_cast<std::int64_t>(m_.size()));
}

ShardedState::~ShardedState() {
  for (auto& [u, g] : gathered_)
    if (g.pending) try {
        g.pending->wait();
      } catch (...) {  // a failing mesh is being torn down anyway
      }
}

std::int64_t ShardedState::piece(int u) const {
  const std::int64_t n = layout_.units[static_cast<std::size_t>(u)].size;
  return (n + W_ - 1) / W_;
}

std::pair<std::int64_t, std::int64_t> ShardedState::owned(int u, int r) const {
  const auto& U = layout_.units[static_cast<std::size_t>(u)];
  const std::int64_t c = piece(u), lo = std::min(U.size, r * c), hi = std::min(U.size, (r + 1) * c);
  return {U.begin + lo, U.begin + hi};
}

void ShardedState::gather_unit(int u, bool async) {
  Gathered& g = gathered_[u];
  const std::int64_t c = piece(u);
  g.buf.resize(W_ * c);
  g.pending = mesh_.all_gather_async(own(p_own_, u), g.buf.data(), static_cast<std::size_t>(c), DType::f32);
  if (!async) g.pending->wait(), g.pending.reset();
}

const float* ShardedState::acquire(int u, bool backward) {
  DIFFCP_CHECK(u >= 0 && u < units(), "sharded state: unit ", u, " of ", units());
  if (mode_ != ShardMode::full) return params_.data() + layout_.units[static_cast<std::size_t>(u)].begin;
  auto it = gathered_.find(u);
  if (it == gathered_.end()) gather_unit(u, false);
  else if (it->second.pending) it->second.pending->wait(), it->second.pending.reset();
  const int next = backward ? u - 1 : u + 1;  // prefetch: overlaps this unit's compute
  if (next >= 0 && next < units() && gathered_.count(next) == 0) gather_unit(next, true);
  if (backward) {
    gscratch_.resize(W_ * piece(u));
    fill(gscratch_.data(), W_ * piece(u), 0.f);
  }
  return gathered_[u].buf.data();
}

float* ShardedState::unit_grads(int u) {
  if (mode_ != ShardMode::full) return grads_.data() + layout_.units[static_cast<std::size_t>(u)].begin;
  return gscratch_.data();
}

void ShardedState::release(int u, bool backward) {
  if (mode_ != ShardMode::full) return;
  gathered_.erase(u);
  if (!backward) return;
  const std::int64_t c = piece(u);
  DeviceVector<float> mine;  // [c_u] this rank's reduced share
  mine.resize(c);
  mesh_.reduce_scatter_async(gscratch_.data(), mine.data(), static_cast<std::size_t>(c), DType::f32, ReduceOp::sum)
      ->wait();
  add_into(own(g_own_, u), mine.data(), c);
  gscratch_ = DeviceVector<float>();  // freed until the next unit's backward
}

void ShardedState::gather_rounds_only() {
  for (int u = 0; u < units(); ++u) {
    acquire(u, false);
    release(u, false);
  }
}

void ShardedState::zero_grads() {
  fill(grads_.data(), static_cast<std::int64_t>(grads_.size()), 0.f);
  fill(g_own_.data(), static_cast<std::int64_t>(g_own_.size()), 0.f);
}

double ShardedState::reduce_grads(double scale) {
  if (mode_ == ShardMode::none) {
    mesh_.all_reduce<float>(std::span<float>(grads_.data(), grads_.size()));
    return grad_norm_ = std::sqrt(scale_sumsq(grads_.data(), layout_.total, scale));
  }
  if (mode_ == ShardMode::optimizer) {  // straight from the whole vector: no padded copy
    for (int u = 0; u < units(); ++u) {
      const auto& U = layout_.units[static_cast<std::size_t>(u)];
      mesh_.reduce_scatter_v_async(grads_.data() + U.begin, own(g_own_, u), piece_counts(u), DType::f32, ReduceOp::sum)
          ->wait();
    }
  }
  // padding is zero
  std::vector<double> t{scale_sumsq(g_own_.data(), static_cast<std::int64_t>(g_own_.size()), scale)};
  mesh_.all_reduce<double>(t);
  return grad_norm_ = std::sqrt(t[0]);
}

void ShardedState::apply(AdamW& adam, double lr_now, double clip) {
  const double s = clip_scale(grad_norm_, clip);
  auto clip_all = [&](DeviceVector<float>& g) {
    if (s != 1.0) scale_sumsq(g.data(), static_cast<std::int64_t>(g.size()), s);
  };
  adam.begin_step();
  if (mode_ == ShardMode::none) {
    clip_all(grads_);
    adam.update(params_.data(), grads_.data(), m_.data(), v_.data(), 0, layout_.total, lr_now, layout_.vectors);
    return;
  }
  clip_all(g_own_);
  DeviceVector<float> mine;  // optimizer: [hi - lo] the updated piece
  for (int u = 0; u < units(); ++u) {
    const auto [lo, hi] = owned(u, r_);
    if (mode_ == ShardMode::full) {
      adam.update(own(p_own_, u), own(g_own_, u), own(m_, u), own(v_, u), lo, hi - lo, lr_now, layout_.vectors);
      continue;
    }
    // optimizer: update a copy of the owned piece, then every rank's piece back into every
    // rank's whole vector (the all-gather's send must not alias its receive buffer).
    mine.resize(hi - lo);
    device_copy(mine.data(), params_.data() + lo, hi - lo);
    adam.update(mine.data(), own(g_own_, u), own(m_, u), own(v_, u), lo, hi - lo, lr_now, layout_.vectors);
    const auto& U = layout_.units[static_cast<std::size_t>(u)];
    mesh_.all_gather_v_async(mine.data(), params_.data() + U.begin, piece_counts(u), DType::f32)->wait();
  }
}

std::vector<std::size_t> ShardedState::piece_counts(int u) const {
  std::vector<std::size_t> c;
  for (int r = 0; r < W_; ++r) {
    const auto [lo, hi] = owned(u, r);
    c.push_back(static_cast<std::size_t>(hi - lo));
  }
  return c;
}

DeviceVector<float>& ShardedState::params() {
  DIFFCP_CHECK(mode_ != ShardMode::full, "sharded state: `shard` full holds no whole parameter vector");
  return params_;
}

DeviceVector<float>& ShardedState::grads() {
  DIFFCP_CHECK(mode_ != ShardMode::full, "sharded state: `shard` full holds no whole gradient vector");
  return grads_;
}

std::vector<float> ShardedState::gather_params() {
  std::vector<float> full(static_cast<std::size_t>(layout_.total));
  if (mode_ != ShardMode::full) {
    copy(view_of(std::span<float>(full)), ConstTensorView::contiguous(params_.data(), DType::f32, {layout_.total}, device()));
    return full;
  }
  DeviceVector<float> all;
  for (int u = 0; u < units(); ++u) {
    const auto& U = layout_.units[static_cast<std::size_t>(u)];
    all.resize(W_ * piece(u));
    mesh_.all_gather_async(own(p_own_, u), all.data(), static_cast<std::size_t>(piece(u)), DType::f32)->wait();
    copy(view_of(std::span<float>(full.data() + U.begin, static_cast<std::size_t>(U.size))),
         ConstTensorView::contiguous(all.data(), DType::f32, {U.size}, device()));
  }
  return full;
}

void ShardedState::init(const std::function<void(int, float*)>& fill_unit) {
  std::vector<float> unit;  // host: one unit at a time
  for (int u = 0; u < units(); ++u) {
    const auto& U = layout_.units[static_cast<std::size_t>(u)];
    unit.resize(static_cast<std::size_t>(U.size));
    fill_unit(u, unit.data());
    const auto [lo, hi] = mode_ == ShardMode::full ? owned(u, r_) : std::pair{U.begin, U.begin + U.size};
    float* dst = mode_ == ShardMode::full ? own(p_own_, u) : params_.data() + U.begin;
    copy(TensorView::contiguous(dst, DType::f32, {hi - lo}, device()),
         view_of(std::span<const float>(unit.data() + (lo - U.begin), static_cast<std::size_t>(hi - lo))));
  }
}

void ShardedState::set_params(std::span<const float> full) {
  DIFFCP_CHECK(static_cast<std::int64_t>(full.size()) == layout_.total, "sharded state: ", full.size(),
               " parameters for a model of ", layout_.total);
  init([&](int u, float* out) {
    const auto& U = layout_.units[static_cast<std::size_t>(u)];
    std::copy_n(full.begin() + U.begin, U.size, out);
  });
}

void ShardedState::write_unit(CheckpointWriter* w, int u, const DeviceVector<float>* full, const DeviceVector<float>& sharded) {
  const auto& U = layout_.units[static_cast<std::size_t>(u)];
  const auto to_host = [&](const float* src, std::int64_t n) {  // one unit's slice through the host
    std::vector<float> h(static_cast<std::size_t>(n));
    copy(view_of(std::span<float>(h)), ConstTensorView::contiguous(src, DType::f32, {n}, device()));
    return h;
  };
  if (full != nullptr) {  // the same whole vector on every rank
    if (w != nullptr) w->append(to_host(full->data() + U.begin, U.size).data(), static_cast<std::uint64_t>(U.size));
    return;
  }
  std::vector<float> buf;
  for (int r = 0; r < W_; ++r) {
    const auto [lo, hi] = owned(u, r);
    const auto n = static_cast<std::size_t>(hi - lo);
    if (r == r_ && r_ == 0) {
      w->append(to_host(own(sharded, u), hi - lo).data(), n);
    } else if (r == r_) {
      mesh_.send<float>(to_host(own(sharded, u), hi - lo), 0, 71);
    } else if (r_ == 0) {
      buf.resize(n);
      mesh_.recv<float>(buf, r, 71);
      w->append(buf.data(), n);
    }
  }
}

void ShardedState::save(const std::string& path, const nlohmann::json& meta) {
  std::unique_ptr<CheckpointWriter> w;
  if (mesh_.rank() == 0) w = std::make_unique<CheckpointWriter>(path, meta, static_cast<std::uint64_t>(layout_.total));
  const bool whole = mode_ == ShardMode::none;
  for (int u = 0; u < units(); ++u) write_unit(w.get(), u, mode_ == ShardMode::full ? nullptr : &params_, p_own_);
  for (int u = 0; u < units(); ++u) write_unit(w.get(), u, whole ? &m_ : nullptr, m_);
  for (int u = 0; u < units(); ++u) write_unit(w.get(), u, whole ? &v_ : nullptr, v_);
  if (w) w->commit();
  mesh_.barrier();
}

void ShardedState::load(CheckpointReader& ck) {
  DIFFCP_CHECK(static_cast<std::int64_t>(ck.n()) == layout_.total, "checkpoint: ", ck.n(), " parameters, the model has ",
               layout_.total);
  std::vector<float> h;  // host: one array or piece at a time
  const auto read = [&](CkArray a, std::uint64_t at, std::uint64_t n, float* dst) {
    h.resize(static_cast<std::size_t>(n));
    ck.read(a, at, n, h.data());
    copy(TensorView::contiguous(dst, DType::f32, {static_cast<std::int64_t>(n)}, device()),
         view_of(std::span<const float>(h)));
  };
  if (mode_ != ShardMode::full) read(CkArray::params, 0, ck.n(), params_.data());
  if (mode_ == ShardMode::none) {
    read(CkArray::m, 0, ck.n(), m_.data());
    read(CkArray::v, 0, ck.n(), v_.data());
    return;
  }
  for (int u = 0; u < units(); ++u) {
    const auto [lo, hi] = owned(u, r_);
    const auto at = static_cast<std::uint64_t>(lo), n = static_cast<std::uint64_t>(hi - lo);
    if (mode_ == ShardMode::full) read(CkArray::params, at, n, own(p_own_, u));
    read(CkArray::m, at, n, own(m_, u));
    read(CkArray::v, at, n, own(v_, u));
  }
}

std::int64_t ShardedState::resident_bytes() const {
  std::size_t n = params_.size() + grads_.size() + p_own_.size() + g_own_.size() + m_.size() + v_.size() + gscratch_.size();
  for (const auto& [u, g] : gathered_) n += g.buf.size();
  return static_cast<std::int64_t>(n * sizeof(float));
}

}  // namespace diffcp
