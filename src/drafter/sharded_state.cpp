#include "diffcp/drafter/sharded_state.hpp"

#include <algorithm>
#include <cmath>

#include "diffcp/core/error.hpp"

namespace diffcp {

ShardMode parse_shard_mode(const std::string& name) {
  if (name == "none") return ShardMode::none;
  if (name == "optimizer") return ShardMode::optimizer;
  if (name == "full") return ShardMode::full;
  DIFFCP_FAIL("--shard '", name, "': expected none, optimizer or full");
}

ShardMode resolve_shard_mode(const std::string& name, bool real_shape, int ranks) {
  DIFFCP_CHECK(name == "auto" || name == "none" || name == "optimizer" || name == "full", "--shard '", name,
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
  const auto total = static_cast<std::size_t>(layout_.total), owned = static_cast<std::size_t>(own_off_.back());
  if (mode_ != ShardMode::full) params_.assign(total, 0.f), grads_.assign(total, 0.f);
  if (mode_ == ShardMode::full) p_own_.assign(owned, 0.f);
  if (mode_ != ShardMode::none) g_own_.assign(owned, 0.f);
  m_.assign(mode_ == ShardMode::none ? total : owned, 0.f);
  v_.assign(m_.size(), 0.f);
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
  g.buf.resize(static_cast<std::size_t>(W_ * c));
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
    gscratch_.assign(static_cast<std::size_t>(W_ * piece(u)), 0.f);
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
  std::vector<float> mine(static_cast<std::size_t>(c));
  mesh_.reduce_scatter<float>(gscratch_, mine);
  float* g = own(g_own_, u);
  for (std::int64_t i = 0; i < c; ++i) g[i] += mine[static_cast<std::size_t>(i)];
  std::vector<float>().swap(gscratch_);
}

void ShardedState::gather_rounds_only() {
  for (int u = 0; u < units(); ++u) {
    acquire(u, false);
    release(u, false);
  }
}

void ShardedState::zero_grads() {
  std::fill(grads_.begin(), grads_.end(), 0.f);
  std::fill(g_own_.begin(), g_own_.end(), 0.f);
}

double ShardedState::reduce_grads(double scale) {
  double ss = 0;
  auto scale_and_square = [&](float* g, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) {
      g[i] = static_cast<float>(static_cast<double>(g[i]) * scale);
      ss += static_cast<double>(g[i]) * g[i];
    }
  };
  if (mode_ == ShardMode::none) {
    mesh_.all_reduce<float>(grads_);
    scale_and_square(grads_.data(), layout_.total);
    return grad_norm_ = std::sqrt(ss);
  }
  if (mode_ == ShardMode::optimizer) {  // straight from the whole vector: no padded copy
    for (int u = 0; u < units(); ++u) {
      const auto& U = layout_.units[static_cast<std::size_t>(u)];
      mesh_.reduce_scatter_v_async(grads_.data() + U.begin, own(g_own_, u), piece_counts(u), DType::f32, ReduceOp::sum)
          ->wait();
    }
  }
  scale_and_square(g_own_.data(), static_cast<std::int64_t>(g_own_.size()));  // padding is zero
  std::vector<double> t{ss};
  mesh_.all_reduce<double>(t);
  return grad_norm_ = std::sqrt(t[0]);
}

void ShardedState::apply(AdamW& adam, double lr_now, double clip) {
  const double s = clip_scale(grad_norm_, clip);
  auto clip_all = [&](std::vector<float>& g) {
    if (s != 1.0)
      for (float& x : g) x = static_cast<float>(x * s);
  };
  adam.begin_step();
  if (mode_ == ShardMode::none) {
    clip_all(grads_);
    adam.update(params_.data(), grads_.data(), m_.data(), v_.data(), 0, layout_.total, lr_now, layout_.vectors);
    return;
  }
  clip_all(g_own_);
  std::vector<float> mine;
  for (int u = 0; u < units(); ++u) {
    const auto [lo, hi] = owned(u, r_);
    if (mode_ == ShardMode::full) {
      adam.update(own(p_own_, u), own(g_own_, u), own(m_, u), own(v_, u), lo, hi - lo, lr_now, layout_.vectors);
      continue;
    }
    // optimizer: update a copy of the owned piece, then every rank's piece back into every
    // rank's whole vector (the all-gather's send must not alias its receive buffer).
    mine.assign(params_.begin() + lo, params_.begin() + hi);
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

std::vector<float>& ShardedState::params() {
  DIFFCP_CHECK(mode_ != ShardMode::full, "sharded state: --shard full holds no whole parameter vector");
  return params_;
}

std::vector<float>& ShardedState::grads() {
  DIFFCP_CHECK(mode_ != ShardMode::full, "sharded state: --shard full holds no whole gradient vector");
  return grads_;
}

std::vector<float> ShardedState::gather_params() {
  if (mode_ != ShardMode::full) return params_;
  std::vector<float> full(static_cast<std::size_t>(layout_.total)), all;
  for (int u = 0; u < units(); ++u) {
    const auto& U = layout_.units[static_cast<std::size_t>(u)];
    all.resize(static_cast<std::size_t>(W_ * piece(u)));
    mesh_.all_gather<float>(std::span<const float>(own(p_own_, u), static_cast<std::size_t>(piece(u))), all);
    std::copy_n(all.begin(), U.size, full.begin() + U.begin);
  }
  return full;
}

void ShardedState::init(const std::function<void(int, float*)>& fill) {
  std::vector<float> unit;
  for (int u = 0; u < units(); ++u) {
    const auto& U = layout_.units[static_cast<std::size_t>(u)];
    if (mode_ != ShardMode::full) {
      fill(u, params_.data() + U.begin);
      continue;
    }
    unit.resize(static_cast<std::size_t>(U.size));
    fill(u, unit.data());
    const auto [lo, hi] = owned(u, r_);
    std::copy(unit.begin() + (lo - U.begin), unit.begin() + (hi - U.begin), own(p_own_, u));
  }
}

void ShardedState::set_params(const std::vector<float>& full) {
  DIFFCP_CHECK(static_cast<std::int64_t>(full.size()) == layout_.total, "sharded state: ", full.size(),
               " parameters for a model of ", layout_.total);
  init([&](int u, float* out) {
    const auto& U = layout_.units[static_cast<std::size_t>(u)];
    std::copy_n(full.begin() + U.begin, U.size, out);
  });
}

void ShardedState::write_unit(CheckpointWriter* w, int u, const std::vector<float>* full, std::vector<float>& sharded) {
  const auto& U = layout_.units[static_cast<std::size_t>(u)];
  if (full != nullptr) {  // the same whole vector on every rank
    if (w != nullptr) w->append(full->data() + U.begin, static_cast<std::uint64_t>(U.size));
    return;
  }
  std::vector<float> buf;
  for (int r = 0; r < W_; ++r) {
    const auto [lo, hi] = owned(u, r);
    const auto n = static_cast<std::size_t>(hi - lo);
    if (r == r_ && r_ == 0) {
      w->append(own(sharded, u), n);
    } else if (r == r_) {
      mesh_.send<float>(std::span<const float>(own(sharded, u), n), 0, 71);
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
  if (mode_ != ShardMode::full) ck.read(CkArray::params, 0, ck.n(), params_.data());
  if (mode_ == ShardMode::none) {
    ck.read(CkArray::m, 0, ck.n(), m_.data());
    ck.read(CkArray::v, 0, ck.n(), v_.data());
    return;
  }
  for (int u = 0; u < units(); ++u) {
    const auto [lo, hi] = owned(u, r_);
    const auto at = static_cast<std::uint64_t>(lo), n = static_cast<std::uint64_t>(hi - lo);
    if (mode_ == ShardMode::full) ck.read(CkArray::params, at, n, own(p_own_, u));
    ck.read(CkArray::m, at, n, own(m_, u));
    ck.read(CkArray::v, at, n, own(v_, u));
  }
}

std::int64_t ShardedState::resident_bytes() const {
  std::size_t n = params_.size() + grads_.size() + p_own_.size() + g_own_.size() + m_.size() + v_.size() + gscratch_.size();
  for (const auto& [u, g] : gathered_) n += g.buf.size();
  return static_cast<std::int64_t>(n * sizeof(float));
}

}  // namespace diffcp
