// diffcp._core: the C++ library seen from Python (pybind11). The typed, documented API is the
// Python package around it (python/diffcp/); this file only converts arrays and errors.
//
// Arrays: float tensors must be numpy float32, C-contiguous, of the documented shape — they are
// used in place (zero-copy) and a wrong one is a TypeError / ValueError, never a silent copy.
// Integer inputs (lengths, anchors) are converted to int64. diffcp::Error becomes ValueError.
// The GIL is released while kernels run.
#include <cstdint>
#include <string>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <optional>

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/mask.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/balance/balancer.hpp"
#include "diffcp/comm/mpi_communicator.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/cp/splitkv.hpp"
#include "diffcp/dit/diffusers.hpp"
#include "diffcp/dit/model.hpp"
#include "diffcp/dit/run.hpp"
#include "diffcp/dit/sampler.hpp"
#include "diffcp/drafter/draft.hpp"
#include "diffcp/drafter/draft_cache.hpp"
#include "diffcp/dit/usp.hpp"
#include "diffcp/ops/gemm.hpp"
#include "diffcp/drafter/hf_format.hpp"
#include "diffcp/drafter/selector.hpp"
#include "diffcp/testing/layer_run.hpp"
#include "diffcp/workload/batch.hpp"

namespace py = pybind11;
using namespace diffcp;

namespace {

using Ints = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>;
using Floats = py::array_t<float, py::array::c_style>;

PackedBatch make_batch(const Ints& lengths, const std::vector<Ints>& anchors, std::int64_t block) {
  if (lengths.ndim() != 1) throw py::value_error("lengths: expected a 1-D array of sample lengths");
  if (static_cast<std::size_t>(lengths.shape(0)) != anchors.size())
    throw py::value_error("anchors: " + std::to_string(anchors.size()) + " arrays for " +
                          std::to_string(lengths.shape(0)) + " samples (one array of anchors per sample)");
  PackedBatch b;
  b.block = block;
  b.lengths.assign(lengths.data(), lengths.data() + lengths.shape(0));
  for (std::size_t u = 0; u < anchors.size(); ++u) {
    if (anchors[u].ndim() != 1) throw py::value_error("anchors[" + std::to_string(u) + "]: expected a 1-D array");
    b.anchors.emplace_back(anchors[u].data(), anchors[u].data() + anchors[u].shape(0));
  }
  b.validate();
  return b;
}

std::string shape_str(const py::array& a) {
  std::string got = "[";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) got += (i ? ", " : "") + std::to_string(a.shape(i));
  return got + "]";
}

// A C-contiguous array of exactly `shape` and element type `dtype` (f32: float32; bf16: its bits
// as uint16, numpy having no bfloat16), used in place; `writable` for outputs.
const void* checked_any(const py::array& a, const char* name, const std::vector<std::int64_t>& shape, DType dtype,
                        bool writable = false) {
  const bool f32 = dtype == DType::f32;
  if (!a.dtype().is(f32 ? py::dtype::of<float>() : py::dtype::of<std::uint16_t>()))
    throw py::type_error(std::string(name) + ": expected a numpy " + (f32 ? "float32" : "uint16 (bf16 bits)") +
                         " array, got dtype " + py::str(a.dtype()).cast<std::string>());
  if (!(a.flags() & py::array::c_style)) throw py::value_error(std::string(name) + ": array must be C-contiguous");
  if (writable && !a.writeable()) throw py::value_error(std::string(name) + ": output array is read-only");
  bool ok = a.ndim() == static_cast<py::ssize_t>(shape.size());
  for (std::size_t i = 0; ok && i < shape.size(); ++i) ok = a.shape(static_cast<py::ssize_t>(i)) == shape[i];
  if (!ok) {
    std::string want = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + std::to_string(shape[i]);
    throw py::value_error(std::string(name) + ": shape " + shape_str(a) + ", expected " + want + "]");
  }
  return a.data();
}
// float32 only (the Split-KV layer's arrays).
const float* checked(const py::array& a, const char* name, const std::vector<std::int64_t>& shape) {
  return static_cast<const float*>(checked_any(a, name, shape, DType::f32));
}

Floats empty(std::vector<std::int64_t> shape) { return Floats(std::vector<py::ssize_t>(shape.begin(), shape.end())); }

// windows: the drafter's layers' sliding windows (0 = full attention), empty = one full layer.
py::dict plan(const Ints& lengths, const std::vector<Ints>& anchors, std::int64_t block, int P, int J,
              const std::string& balancer, const std::vector<std::int64_t>& windows) {
  const PackedBatch batch = make_batch(lengths, anchors, block);
  check_plan_args(balancer.c_str(), batch.context_rows(), P, J);
  const auto b = make_balancer(balancer);
  std::vector<KeyWindow> layers;
  for (std::int64_t w : windows) layers.push_back(KeyWindow::sliding(w));
  const CostModel cost = layers.empty() ? CostModel(batch) : CostModel(batch, layers);
  const Plan pl = b->plan(batch, cost, P, J);
  const PlanLoad load = plan_load(batch, cost, pl);
  const auto n = static_cast<py::ssize_t>(pl.chunks.size());
  py::array_t<std::int64_t> chunks({n, py::ssize_t{2}});
  py::array_t<std::int32_t> rank(n);
  auto c = chunks.mutable_unchecked<2>();
  auto r = rank.mutable_unchecked<1>();
  for (py::ssize_t i = 0; i < n; ++i) {
    c(i, 0) = pl.chunks[static_cast<std::size_t>(i)].begin;
    c(i, 1) = pl.chunks[static_cast<std::size_t>(i)].end;
    r(i) = pl.rank[static_cast<std::size_t>(i)];
  }
  py::dict out;
  out["balancer"] = pl.balancer;
  out["P"] = pl.P;
  out["J"] = pl.J;
  out["chunks"] = chunks;
  out["rank"] = rank;
  out["context_work"] = py::array_t<std::int64_t>(P, load.context_work.data());
  out["block_work"] = py::array_t<std::int64_t>(P, load.block_work.data());
  out["rank_work"] = py::array_t<std::int64_t>(P, load.rank_work.data());
  out["rho"] = load.rho;
  out["imbalance_pct"] = load.imbalance_pct();
  return out;
}

struct Dims {
  std::int64_t Q, Lk, n_q, n_kv, d_h;
};
Dims dims_of(const BlockMask& mask, const py::array& q, const py::array& k) {
  if (q.ndim() != 3 || k.ndim() != 3) throw py::value_error("q, k: expected 3-D arrays [rows, heads, d_h]");
  return {mask.query_rows(), mask.key_rows(), q.shape(1), k.shape(1), q.shape(2)};
}

// The storage type of an attention call: q's (float32 -> f32, uint16 -> bf16 bits).
DType attention_dtype(const py::array& q) {
  if (q.dtype().is(py::dtype::of<float>())) return DType::f32;
  if (q.dtype().is(py::dtype::of<std::uint16_t>())) return DType::bf16;
  throw py::type_error("q: expected a numpy float32 array or uint16 (bf16 bits), got dtype " +
                       py::str(q.dtype()).cast<std::string>());
}

template <typename T>
HeadRows<T> rows_of(const void* p, std::int64_t rows, std::int64_t heads, std::int64_t dim) {
  return {static_cast<T*>(const_cast<void*>(p)), rows, heads, dim, heads * dim};
}

void check_gqa(const Dims& d) {
  if (d.n_kv < 1 || d.n_q % d.n_kv != 0)
    throw py::value_error("q, k: n_q = " + std::to_string(d.n_q) + " is not a multiple of n_kv = " + std::to_string(d.n_kv));
}

// Writes o [Q, n_q, d_h] (q's dtype) and lse [Q, n_q] (float32).
void attention_forward_py(const py::array& q, const py::array& k, const py::array& v, const py::array& o,
                          const py::array& lse, const Ints& lengths, const std::vector<Ints>& anchors,
                          std::int64_t block, float scale) {
  const PackedBatch batch = make_batch(lengths, anchors, block);
  const BlockMask mask = full_mask(batch);
  const Dims d = dims_of(mask, q, k);
  const DType t = attention_dtype(q);
  const void* qp = checked_any(q, "q", {d.Q, d.n_q, d.d_h}, t);
  const void* kp = checked_any(k, "k", {d.Lk, d.n_kv, d.d_h}, t);
  const void* vp = checked_any(v, "v", {d.Lk, d.n_kv, d.d_h}, t);
  const void* op = checked_any(o, "o", {d.Q, d.n_q, d.d_h}, t, true);
  float* lp = const_cast<float*>(static_cast<const float*>(checked_any(lse, "lse", {d.Q, d.n_q}, DType::f32, true)));
  check_gqa(d);
  const std::span<float> lse_s(lp, static_cast<std::size_t>(d.Q * d.n_q));
  py::gil_scoped_release nogil;
  auto run = [&]<typename T>(T*) {
    attention_forward(mask, rows_of<const T>(qp, d.Q, d.n_q, d.d_h), rows_of<const T>(kp, d.Lk, d.n_kv, d.d_h),
                      rows_of<const T>(vp, d.Lk, d.n_kv, d.d_h), rows_of<T>(op, d.Q, d.n_q, d.d_h), lse_s, scale);
  };
  if (t == DType::bf16) run(static_cast<bf16_t*>(nullptr));
  else run(static_cast<float*>(nullptr));
}

// Writes dq [Q, n_q, d_h], dk, dv [L_k, n_kv, d_h] (q's dtype) from the forward's o and lse.
void attention_backward_py(const py::array& q, const py::array& k, const py::array& v, const py::array& o,
                           const py::array& lse, const py::array& dout, const py::array& dq, const py::array& dk,
                           const py::array& dv, const Ints& lengths, const std::vector<Ints>& anchors,
                           std::int64_t block, float scale) {
  const PackedBatch batch = make_batch(lengths, anchors, block);
  const BlockMask mask = full_mask(batch);
  const Dims d = dims_of(mask, q, k);
  const DType t = attention_dtype(q);
  const void* qp = checked_any(q, "q", {d.Q, d.n_q, d.d_h}, t);
  const void* kp = checked_any(k, "k", {d.Lk, d.n_kv, d.d_h}, t);
  const void* vp = checked_any(v, "v", {d.Lk, d.n_kv, d.d_h}, t);
  const void* op = checked_any(o, "o", {d.Q, d.n_q, d.d_h}, t);
  const auto* lp = static_cast<const float*>(checked_any(lse, "lse", {d.Q, d.n_q}, DType::f32));
  const void* gp = checked_any(dout, "do", {d.Q, d.n_q, d.d_h}, t);
  const void* dqp = checked_any(dq, "dq", {d.Q, d.n_q, d.d_h}, t, true);
  const void* dkp = checked_any(dk, "dk", {d.Lk, d.n_kv, d.d_h}, t, true);
  const void* dvp = checked_any(dv, "dv", {d.Lk, d.n_kv, d.d_h}, t, true);
  check_gqa(d);
  py::gil_scoped_release nogil;
  const auto n = static_cast<std::size_t>(d.Q * d.n_q);
  std::vector<float> delta(n);
  auto run = [&]<typename T>(T*) {
    attention_delta(rows_of<const T>(gp, d.Q, d.n_q, d.d_h), rows_of<const T>(op, d.Q, d.n_q, d.d_h), delta);
    attention_backward(mask, rows_of<const T>(qp, d.Q, d.n_q, d.d_h), rows_of<const T>(kp, d.Lk, d.n_kv, d.d_h),
                       rows_of<const T>(vp, d.Lk, d.n_kv, d.d_h), rows_of<const T>(gp, d.Q, d.n_q, d.d_h),
                       {lp, n}, delta, rows_of<T>(dqp, d.Q, d.n_q, d.d_h), rows_of<T>(dkp, d.Lk, d.n_kv, d.d_h),
                       rows_of<T>(dvp, d.Lk, d.n_kv, d.d_h), scale);
  };
  if (t == DType::bf16) run(static_cast<bf16_t*>(nullptr));
  else run(static_cast<float*>(nullptr));
}

// bf16 <-> float32 (round to nearest even), what diffcp.to_bf16 / from_bf16 call.
py::array_t<std::uint16_t> to_bf16_py(const py::array_t<float, py::array::c_style | py::array::forcecast>& x) {
  py::array_t<std::uint16_t> out(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
  convert_to_bf16(x.data(), out.mutable_data(), x.size());
  return out;
}
py::array_t<float> from_bf16_py(const py::array_t<std::uint16_t, py::array::c_style>& x) {
  py::array_t<float> out(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
  convert_to_f32(x.data(), out.mutable_data(), x.size());
  return out;
}

// The bindings that take an mpi4py communicator need MPI initialized (by importing mpi4py.MPI).
void require_mpi(const char* what) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw py::value_error(std::string(what) + ": MPI is not initialized (import mpi4py.MPI first)");
}

// One Split-KV attention layer over an mpi4py communicator (the handle comes in as comm.py2f(), so
// no mpi4py headers are needed). The layer is collective: every rank of the communicator calls
// forward / backward together, as in C++.
// What forward returns to Python: the layer's saved context and the input arrays it refers to (the
// C++ contract: x_p and ctx_p stay alive and unchanged until backward), kept alive here.
struct SavedPy {
  CpSaved saved;
  py::object x, ctx;
};

class SplitKVLayerPy {
 public:
  SplitKVLayerPy(MPI_Fint comm, const AttnLayerConfig& cfg, const Ints& lengths, const std::vector<Ints>& anchors,
                 std::int64_t block, const std::optional<Ints>& chunks, const std::optional<Ints>& rank,
                 const std::string& dtype, const std::string& comm_kind)
      : cfg_(cfg) {
    const DType compute = compute_dtype(dtype, "SplitKV: dtype");  // diffcp::Error: ValueError
    require_mpi("SplitKV");
    comm_ = make_communicator(comm_kind, MPI_Comm_f2c(comm), "python");
    cfg_.validate();
    const PackedBatch batch = make_batch(lengths, anchors, block);
    const int P = comm_->size(), p = comm_->rank();
    if (chunks.has_value() != rank.has_value()) throw py::value_error("SplitKV: give both chunks and rank (a Plan), or neither");
    if (chunks) {
      if (chunks->ndim() != 2 || chunks->shape(1) != 2 || rank->ndim() != 1 || rank->shape(0) != chunks->shape(0))
        throw py::value_error("SplitKV: chunks must be [n, 2] and rank [n]");
      Plan pl;
      pl.P = P;
      for (py::ssize_t i = 0; i < chunks->shape(0); ++i) {
        pl.chunks.push_back({chunks->at(i, 0), chunks->at(i, 1)});
        pl.rank.push_back(static_cast<int>(rank->at(i)));
      }
      pl.validate(batch.context_rows());
      shard_ = std::make_unique<CpShard>(chunked_shard(batch, P, p, pl.chunks_of_rank()));
    } else {
      shard_ = std::make_unique<CpShard>(contiguous_shard(batch, P, p));
    }
    SplitKVOptions opt;
    opt.compute = compute;
    layer_ = std::make_unique<SplitKVLayer>(*comm_, cfg_, *shard_, opt);
  }

  std::int64_t param_count() const { return AttnLayerParams::count(cfg_); }
  py::dict param_layout() const {
    const auto off = AttnLayerParams::offsets(cfg_);
    AttnLayerParams probe(cfg_);
    py::dict d;
    for (int i = 0; i < AttnLayerParams::kCount; ++i) {
      const auto id = static_cast<AttnLayerParams::Id>(i);
      d[AttnLayerParams::name(id)] = py::make_tuple(off[i], py::tuple(py::cast(probe.shape(id))));
    }
    return d;
  }
  py::array_t<float> init_params(std::uint64_t seed) const {
    AttnLayerParams w(cfg_);
    w.init_random(seed);
    return py::array_t<float>(static_cast<py::ssize_t>(w.all().size()), w.all().data());
  }
  py::tuple owned_query_rows() const {
    const std::int64_t B = shard_->batch.block;
    return py::make_tuple(shard_->blocks.begin * B, shard_->blocks.end * B);
  }
  py::array_t<std::int64_t> context_chunks() const {
    py::array_t<std::int64_t> a({static_cast<py::ssize_t>(shard_->chunks.size()), py::ssize_t{2}});
    for (std::size_t i = 0; i < shard_->chunks.size(); ++i) {
      a.mutable_at(static_cast<py::ssize_t>(i), 0) = shard_->chunks[i].begin;
      a.mutable_at(static_cast<py::ssize_t>(i), 1) = shard_->chunks[i].end;
    }
    return a;
  }
  double predicted_bytes_per_layer() const { return layer_->predicted_bytes_per_layer(); }
  std::uint64_t bytes_sent() const { return comm_->stats().total().bytes_sent; }

  py::tuple forward(const py::array& params, const py::array& x, const py::array& ctx) {
    const std::int64_t H = cfg_.hidden, Qp = shard_->own_query_rows(), Cp = shard_->context_rows();
    AttnLayerParams w(cfg_, const_cast<float*>(checked(params, "params", {param_count()})));
    const float* xp = checked(x, "x", {Qp, H});
    const float* cp = checked(ctx, "ctx", {Cp, H});
    Floats y = empty({Qp, H});
    auto saved = std::make_shared<SavedPy>();
    saved->x = x;
    saved->ctx = ctx;
    {
      py::gil_scoped_release nogil;
      saved->saved = layer_->forward(w, ConstTensorView::contiguous(xp, DType::f32, {Qp, H}),
                               ConstTensorView::contiguous(cp, DType::f32, {Cp, H}),
                               TensorView::contiguous(y.mutable_data(), DType::f32, {Qp, H}));
    }
    return py::make_tuple(y, py::cast(saved));
  }
  py::tuple backward(const std::shared_ptr<SavedPy>& saved, const py::array& params, const py::array& dy) {
    const std::int64_t H = cfg_.hidden, Qp = shard_->own_query_rows(), Cp = shard_->context_rows();
    AttnLayerParams w(cfg_, const_cast<float*>(checked(params, "params", {param_count()})));
    const float* g = checked(dy, "dy", {Qp, H});
    if (!saved) throw py::value_error("backward: saved is None");
    Floats dx = empty({Qp, H}), dctx = empty({Cp, H});
    AttnLayerParams grad(cfg_);
    {
      py::gil_scoped_release nogil;
      layer_->backward(std::move(saved->saved), w, ConstTensorView::contiguous(g, DType::f32, {Qp, H}),
                       TensorView::contiguous(dx.mutable_data(), DType::f32, {Qp, H}),
                       TensorView::contiguous(dctx.mutable_data(), DType::f32, {Cp, H}), grad);
    }
    saved->x = saved->ctx = py::none();
    return py::make_tuple(dx, dctx, py::array_t<float>(static_cast<py::ssize_t>(grad.all().size()), grad.all().data()));
  }

 private:
  AttnLayerConfig cfg_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<CpShard> shard_;
  std::unique_ptr<SplitKVLayer> layer_;
};

}  // namespace

// A DFlash drafter from a DFlash-format folder (import_dflash: ours or a released one), drafting one
// block at a time over an mpi4py communicator (draft_block: Split-KV over the context; COMM_SELF
// for one process). Collective like SplitKV: every rank of the communicator calls draft together.
class DrafterPy {
 public:
  DrafterPy(const std::string& dir, MPI_Fint comm, const std::string& comm_kind) : w_(import_dflash(dir)) {
    require_mpi("Drafter");
    comm_ = make_communicator(comm_kind, MPI_Comm_f2c(comm), "python");
  }

  py::dict config() const {
    const DrafterConfig& c = w_.config;
    py::dict d;
    d["hidden_size"] = c.hidden;
    d["num_hidden_layers"] = c.layers;
    d["num_attention_heads"] = c.n_q;
    d["num_key_value_heads"] = c.n_kv;
    d["head_dim"] = c.d_h;
    d["intermediate_size"] = c.ffn;
    d["vocab_size"] = c.vocab;
    d["block_size"] = c.block;
    d["mask_token_id"] = c.mask_token;
    d["target_layer_ids"] = c.target_layer_ids;
    d["num_target_layers"] = c.target_depth;
    std::vector<std::string> types = c.layer_types;
    if (types.empty()) types.assign(static_cast<std::size_t>(c.layers), "full_attention");
    d["layer_types"] = types;
    d["sliding_window"] = c.sliding_window > 0 ? py::object(py::int_(c.sliding_window)) : py::object(py::none());
    d["is_causal"] = c.is_causal ? py::object(py::bool_(*c.is_causal)) : py::object(py::none());
    d["architecture"] = c.has_conv() ? "DFlash2DraftModel" : "DFlashDraftModel";
    if (c.has_conv()) {
      d["conv_kernel_size"] = c.conv_taps;
      d["conv_group_size"] = c.conv_group_size;
      d["selector_rank"] = c.selector_rank;
      d["selector_top_k"] = c.selector_top_k;
    }
    return d;
  }

  //   target_hidden: [ctx, n_t*H] float32   noise: [b, H] float32, 2 <= b <= block_size
  //   -> [b, H] float32: the final RMSNorm's output of the b block rows
  py::array_t<float> draft(const Floats& target_hidden, const Floats& noise) {
    const DrafterConfig& c = w_.config;
    const std::int64_t T = c.target_layers * c.hidden;
    if (target_hidden.ndim() != 2 || target_hidden.shape(1) != T || target_hidden.shape(0) < 1)
      throw py::value_error("draft: target_hidden must be [ctx >= 1, n_t*H = " + std::to_string(T) + "]");
    if (noise.ndim() != 2 || noise.shape(1) != c.hidden || noise.shape(0) < 2 || noise.shape(0) > c.block)
      throw py::value_error("draft: noise_embedding must be [b, H = " + std::to_string(c.hidden) + "] with 2 <= b <= " +
                            "block_size = " + std::to_string(c.block));
    DrafterConfig cfg = c;  // a shorter block drafts with b rows (the layout does not depend on B)
    cfg.block = noise.shape(0);
    const std::int64_t ctx = target_hidden.shape(0);
    std::vector<float> out;
    {
      py::gil_scoped_release release;
      out = draft_block(*comm_, cfg, w_.params, {target_hidden.data(), static_cast<std::size_t>(target_hidden.size())},
                        ctx, {noise.data(), static_cast<std::size_t>(noise.size())});
    }
    py::array_t<float> r({static_cast<py::ssize_t>(cfg.block), static_cast<py::ssize_t>(c.hidden)});
    std::copy(out.begin(), out.end(), r.mutable_data());
    return r;
  }

  //   hidden: [n, H] float32 (the drafted rows 1 .. b-1)  logits: [n, V] float32 (the LM head's on them)
  //   -> (path int64 [n], candidates int64 [n, K], q float32 [n, K] or None when greedy)
  py::tuple propose(const Floats& hidden, const Floats& logits, std::int64_t anchor, double temperature, std::uint64_t seed) {
    const DrafterConfig& c = w_.config;
    if (hidden.ndim() != 2 || hidden.shape(1) != c.hidden || logits.ndim() != 2 || logits.shape(0) != hidden.shape(0) ||
        logits.shape(1) != c.vocab)
      throw py::value_error("propose: hidden must be [n, H = " + std::to_string(c.hidden) + "] and logits [n, V = " +
                            std::to_string(c.vocab) + "]");
    Proposal p;
    {
      py::gil_scoped_release release;
      p = diffcp::propose(c, w_.params, {hidden.data(), static_cast<std::size_t>(hidden.size())},
                          {logits.data(), static_cast<std::size_t>(logits.size())}, static_cast<std::int32_t>(anchor),
                          temperature, seed);
    }
    const py::ssize_t n = hidden.shape(0), K = c.selector_top_k;
    py::array_t<std::int64_t> path(n), cand({n, K});
    std::copy(p.path.begin(), p.path.end(), path.mutable_data());
    std::copy(p.candidates.begin(), p.candidates.end(), cand.mutable_data());
    py::object q = py::none();
    if (!p.q.empty()) {
      py::array_t<float> qa({n, K});
      std::copy(p.q.begin(), p.q.end(), qa.mutable_data());
      q = qa;
    }
    return py::make_tuple(path, cand, q);
  }

  const DrafterWeights& weights() const { return w_; }
  Communicator& comm() { return *comm_; }

 private:
  DrafterWeights w_;
  std::unique_ptr<Communicator> comm_;
};

// The draft KV cache of one generation (drafter/draft_cache.hpp): append the target's hidden
// states of the positions it accepts, draft a block from the cached K/V. Collective over the
// drafter's communicator, as DrafterPy::draft. Keeps its drafter alive (keep_alive below).
class DraftCachePy {
 public:
  explicit DraftCachePy(DrafterPy& d) : cache_(d.comm(), d.weights().config, d.weights().params), cfg_(d.weights().config) {}

  //   target_hidden: [n >= 1, n_t*H] float32, positions [len, len + n)
  void append(const Floats& target_hidden) {
    const std::int64_t T = cfg_.target_layers * cfg_.hidden;
    if (target_hidden.ndim() != 2 || target_hidden.shape(1) != T || target_hidden.shape(0) < 1)
      throw py::value_error("append: target_hidden must be [n >= 1, n_t*H = " + std::to_string(T) + "]");
    py::gil_scoped_release release;
    cache_.append({target_hidden.data(), static_cast<std::size_t>(target_hidden.size())});
  }

  //   noise: [b, H] float32, 1 <= b <= block_size -> [b, H] float32 (as DrafterPy::draft)
  py::array_t<float> draft(const Floats& noise) {
    if (noise.ndim() != 2 || noise.shape(1) != cfg_.hidden || noise.shape(0) < 1 || noise.shape(0) > cfg_.block)
      throw py::value_error("draft: noise_embedding must be [b, H = " + std::to_string(cfg_.hidden) +
                            "] with 1 <= b <= block_size = " + std::to_string(cfg_.block));
    if (cache_.length() < 1) throw py::value_error("draft: the cache holds no context yet (append the prompt's first)");
    std::vector<float> out;
    {
      py::gil_scoped_release release;
      out = cache_.draft({noise.data(), static_cast<std::size_t>(noise.size())});
    }
    py::array_t<float> r({static_cast<py::ssize_t>(noise.shape(0)), static_cast<py::ssize_t>(cfg_.hidden)});
    std::copy(out.begin(), out.end(), r.mutable_data());
    return r;
  }

  std::int64_t length() const { return cache_.length(); }
  std::int64_t bytes() const { return cache_.bytes(); }

 private:
  DraftCache cache_;
  DrafterConfig cfg_;
};

// A diffusers transformer folder's DiT, run across the ranks of `comm` (diffcp.diffusers): the
// weights loaded once (bf16 or f32, replicated or sharded), one exchange and model per run shape
// and pass (V-Major keeps a cache per pass, as diffusers' cache_context does; so does the step
// cache, restarted at step 0). cfg_parallel: the ranks split into two halves (dit/run.hpp
// CfgGroups), the weights sharded within each half, and velocity_pair runs a CFG pair's two passes
// at once, one per half.
class DitPy {
 public:
  DitPy(const std::string& folder, MPI_Fint comm, const std::string& mode, int ulysses, int group_size,
        const std::string& weights_dtype, bool shard_weights, const std::string& compute, double cache_ratio,
        bool cfg_parallel, const std::string& step_cache, const std::string& wire, const std::string& comm_kind) {
    require_mpi("Dit");
    comm_ = make_communicator(comm_kind, MPI_Comm_f2c(comm), "python");
    const DiffusersTransformer t = open_diffusers_transformer(folder);
    const SafeTensorsSet ck(t.weights);
    mode_ = parse_exchange_mode(mode);
    compute_ = compute_dtype(compute, "dtype");
    wire_ = parse_wire(wire);
    check_wire_supported(wire_, compute_);  // the active backend runs the codec, before any collective
    const DType storage = diffcp::weights_dtype(weights_dtype, false, "weights_dtype");  // "auto" resolved in Python
    check_shard_weights(shard_weights, storage, compute_, "shard_weights", "weights_dtype");
    schedule_ = {CacheScheduleKind::linear, cache_ratio, 5, 10};
    schedule_.validate();
    ulysses_ = ulysses;
    group_size_ = group_size;
    step_cache_ = parse_step_cache(step_cache);
    DIFFCP_CHECK(!step_cache_.enabled || t.config.double_blocks + t.config.single_blocks >= 2, "step_cache ", step_cache,
                 ": the model has ", t.config.double_blocks + t.config.single_blocks, " block(s); First-Block Cache needs at least two");
    DIFFCP_CHECK(!cfg_parallel || comm_->size() % 2 == 0, "cfg_parallel splits the ranks into two equal halves, one per "
                 "classifier-free guidance pass; P = ", comm_->size(), " is odd");
    const int P_pass = cfg_parallel ? comm_->size() / 2 : comm_->size();
    // U | heads, before any collective
    make_dit_shard(t.config, DitShape{1, 16, 16, 1}, P_pass, comm_->rank() % P_pass, ulysses);
    if (cfg_parallel) {
      groups_ = std::make_unique<CfgGroups>(make_cfg_groups(*comm_));
      // The halves build their exchanges apart (lazily, per shape): one that fails on one half only
      // would leave the other half waiting in the pair's all-gather. Build one now, agree over all ranks.
      std::string err;
      try {
        make_attention_exchange(mode_, *groups_->group, group_size_, schedule_, ulysses_);
      } catch (const Error& e) {
        err = e.what();
      }
      std::vector<std::int32_t> failed{err.empty() ? 0 : 1};
      comm_->all_reduce<std::int32_t>(failed);
      DIFFCP_CHECK(failed[0] == 0, "cfg_parallel: the exchange of ", err.empty() ? "the other half" : "this half",
                   " cannot be made", err.empty() ? "" : ": ", err);
    }
    w_ = std::make_unique<DitWeights>(t.config, storage, shard_weights ? &pass_comm() : nullptr);
    w_->load(ck, DitFileFormat::diffusers);
  }

  py::dict config() const {
    const DitConfig& c = w_->config();
    py::dict d;
    d["family"] = dit_family_name(c.family);
    d["in_channels"] = c.in_channels();
    d["text_dim"] = c.text_dim;
    d["pooled_dim"] = c.pooled_dim;
    d["heads"] = c.heads;
    d["guidance_embed"] = c.guidance_embed;
    d["weights_dtype"] = dtype_name(w_->storage());
    d["shard_weights"] = w_->sharded();
    d["weights_bytes_per_rank"] = w_->bytes();
    d["P"] = comm_->size();
    d["cfg_parallel"] = groups_ != nullptr;
    d["step_cache"] = step_cache_.name();
    return d;
  }

  // Per pass that ran (its index; CFG-parallel pairs: "pair<q>", this rank's half only): the step
  // cache's decisions since that pass's step 0.
  py::dict step_cache_stats() const {
    py::dict d;
    for (const auto& [key, r] : runs_)
      if (r.model && r.model->step_cache() != nullptr) {
        const StepCacheStats& st = r.model->step_cache()->stats();
        py::dict e;
        e["computed"] = st.computed;
        e["cached"] = st.cached;
        e["rel_l1"] = st.rel_l1;
        // CFG-parallel: "pair<i>.<q>", pair i of a step, this rank's half q
        d[py::str(key >= kPairKey ? "pair" + std::to_string((key - kPairKey) / 2) + "." + std::to_string(key % 2)
                                  : std::to_string(key))] = e;
      }
    return d;
  }

  //   x: [b, N_img, C_in] every rank's full latent tokens (the same on every rank), N_img = (height/16) (width/16)
  //   txt: [T, text_dim] the prompt's rows (shared by the b images)   pooled: [pooled_dim] (empty without one)
  //   -> [b, N_img, C_in] the velocity, gathered on every rank. Collective over comm.
  py::array_t<float> velocity(const Floats& x, std::int64_t height, std::int64_t width, const Floats& txt,
                              const Floats& pooled, double t, double guidance, int pass, int step, int steps) {
    const DitShape shape = check_inputs(x, height, width, txt, pooled);
    std::vector<float> out;
    {
      py::gil_scoped_release release;
      Run& r = run(shape, pass, *comm_);
      out = gather_latent(*comm_, pass_velocity(r, x, txt, pooled, t, guidance, step, steps), w_->config(), shape,
                          r.model->shard());
    }
    py::array_t<float> v({x.shape(0), x.shape(1), x.shape(2)});
    std::copy(out.begin(), out.end(), v.mutable_data());
    return v;
  }

  // CFG-parallel: a pair of passes q = 0, 1 (x_q [b, N_img, C_in], txt_q [T_q, text_dim], pooled_q) at
  // once, pass q on half q; the halves trade their velocity rows over the pair (b I_p C_in floats)
  // -> [2, b, N_img, C_in] on every rank. Collective over comm.
  // `pair`: the pair's index within the step (each pair of a step has its own exchange and caches).
  py::array_t<float> velocity_pair(const Floats& x0, const Floats& txt0, const Floats& pooled0, const Floats& x1,
                                   const Floats& txt1, const Floats& pooled1, std::int64_t height, std::int64_t width,
                                   double t, double guidance, int step, int steps, int pair_index) {
    if (pair_index < 0 || pair_index >= kPairKey / 2) throw py::value_error("velocity_pair: pair index out of range");
    if (!groups_) throw py::value_error("velocity_pair: this Dit was made without cfg_parallel");
    const DitShape s0 = check_inputs(x0, height, width, txt0, pooled0), s1 = check_inputs(x1, height, width, txt1, pooled1);
    if (s0.batch != s1.batch) throw py::value_error("velocity_pair: the two passes have " + std::to_string(s0.batch) +
                                                    " and " + std::to_string(s1.batch) + " images");
    const int q = groups_->pass();
    const DitConfig& c = w_->config();
    std::vector<float> both[2];
    {
      py::gil_scoped_release release;
      Run& r = run(q == 0 ? s0 : s1, kPairKey + 2 * pair_index + q, *groups_->group);
      const std::vector<float> v_p = q == 0 ? pass_velocity(r, x0, txt0, pooled0, t, guidance, step, steps)
                                            : pass_velocity(r, x1, txt1, pooled1, t, guidance, step, steps);
      std::vector<float> pair(2 * v_p.size());
      groups_->pair->all_gather<float>(v_p, pair);
      for (int k = 0; k < 2; ++k)
        both[k] = gather_latent(*groups_->group, std::vector<float>(pair.begin() + k * v_p.size(),
                                                                    pair.begin() + (k + 1) * v_p.size()),
                                c, s0, r.model->shard());
    }
    py::array_t<float> v({std::int64_t{2}, x0.shape(0), x0.shape(1), x0.shape(2)});
    std::copy(both[0].begin(), both[0].end(), v.mutable_data());
    std::copy(both[1].begin(), both[1].end(), v.mutable_data() + both[0].size());
    return v;
  }

 private:
  struct Run {
    std::unique_ptr<AttentionExchange> exchange;
    std::unique_ptr<DitModel> model;
    Communicator* comm = nullptr;  // the ranks that run it
  };
  static constexpr int kPairKey = 1 << 20;  // runs_ keys of CFG-parallel pairs: kPairKey + q

  Communicator& pass_comm() { return groups_ ? *groups_->group : *comm_; }

  //   x: [b, N_img, C_in], txt: [T, text_dim], pooled: [pooled_dim] -> the shape, or a ValueError naming the misfit
  DitShape check_inputs(const Floats& x, std::int64_t height, std::int64_t width, const Floats& txt, const Floats& pooled) const {
    const DitConfig& c = w_->config();
    if (x.ndim() != 3 || txt.ndim() != 2 || txt.shape(1) != c.text_dim || x.shape(2) != c.in_channels())
      throw py::value_error("velocity: x must be [b, N_img, " + std::to_string(c.in_channels()) + "] and txt [T, " +
                            std::to_string(c.text_dim) + "], got " + shape_str(x) + " and " + shape_str(txt));
    const DitShape shape{x.shape(0), width, height, txt.shape(0)};
    shape.validate();
    if (x.shape(1) != shape.image_tokens())
      throw py::value_error("velocity: " + std::to_string(x.shape(1)) + " image tokens, a " + std::to_string(width) + "x" +
                            std::to_string(height) + " image has " + std::to_string(shape.image_tokens()));
    if (pooled.size() != c.pooled_dim)
      throw py::value_error("velocity: pooled has " + std::to_string(pooled.size()) + " values, expected " +
                            std::to_string(c.pooled_dim));
    return shape;
  }

  // One pass's velocity on this rank's rows: [b, I_p, C_in] on the host. Collective over the run's ranks.
  std::vector<float> pass_velocity(Run& r, const Floats& x, const Floats& txt, const Floats& pooled, double t,
                                   double guidance, int step, int steps) {
    const DitConfig& c = w_->config();
    const DitShard& s = r.model->shard();
    // The model reads and writes the active backend's memory (host data go there and back).
    DeviceVector<float> x_p, txt_p, pooled_d, v_p;
    x_p.assign(shard_latent(std::vector<float>(x.data(), x.data() + x.size()), c, r.model->shape(), s));
    txt_p.assign(shard_text(std::vector<float>(txt.data(), txt.data() + txt.size()), c.text_dim, s));
    pooled_d.assign(pooled.data(), pooled.size());
    v_p.resize(x_p.size());
    const ScopedF32GemmCompute precision(compute_);
    r.exchange->set_compute(compute_);
    r.exchange->begin_step(step, steps);
    if (step == 0) r.model->set_step_cache(step_cache_, *r.comm);  // a new generation: the cache starts afresh
    r.model->velocity(x_p.data(), txt_p.data(), pooled_d.data(), t, guidance, v_p.data());
    return to_host<float>(v_p.view());
  }

  // The exchange and model of one pass (its V-Major caches) over `comm`, rebuilt when the pass's
  // shape changes (collectively: every rank calls velocity() with the same shapes in the same order).
  Run& run(const DitShape& shape, int key, Communicator& comm) {
    Run& r = runs_[key];
    const DitShape& s = r.model ? r.model->shape() : DitShape{};
    if (r.model && s.batch == shape.batch && s.width == shape.width && s.height == shape.height &&
        s.text_tokens == shape.text_tokens)
      return r;
    r.model.reset();  // the model uses the exchange: destroyed first
    r.exchange = make_attention_exchange(mode_, comm, group_size_, schedule_, ulysses_);
    r.exchange->set_wire(wire_);
    r.model = std::make_unique<DitModel>(*w_, shape, *r.exchange);
    r.comm = &comm;
    r.model->set_step_cache(step_cache_, comm);
    return r;
  }

  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<CfgGroups> groups_;  // cfg_parallel
  std::unique_ptr<DitWeights> w_;
  StepCacheSpec step_cache_;
  ExchangeMode mode_ = ExchangeMode::flat;
  DType compute_ = DType::f32;
  Wire wire_ = Wire::compute;  // the exchanges' payload (dit/wire.hpp)
  CacheSchedule schedule_;
  int ulysses_ = 0, group_size_ = 1;
  std::map<int, Run> runs_;  // by pass (CFG-parallel pairs: kPairKey + the half's pass)
};

// diffcp.run_layer: one CP method's measured layer run (testing/layer_run.hpp), the routine `diffcp
// attn` runs, over an mpi4py communicator; every rank calls it alike (collective).
py::dict run_layer_py(MPI_Fint comm, const AttnLayerConfig& cfg, const std::string& method, const std::string& layout,
                      std::int64_t samples, std::int64_t context, std::int64_t queries, std::int64_t block,
                      double prompt_fraction, std::int64_t window, const std::string& dtype, std::uint64_t seed,
                      int warmup, int reps, int J, bool check, const std::string& comm_kind) {
  require_mpi("run_layer");
  const DType compute = compute_dtype(dtype, "run_layer: dtype");
  DIFFCP_CHECK(block >= 1 && queries >= 0 && queries % block == 0, "run_layer: queries = ", queries,
               " per sample, block = ", block, "; expected block >= 1 dividing queries");
  cfg.validate();
  const std::unique_ptr<Communicator> comm_ptr = make_communicator(comm_kind, MPI_Comm_f2c(comm), "python");
  Communicator& world = *comm_ptr;
  LayerProblem pb(cfg, make_random_batch(samples, context, queries / block, block, prompt_fraction, seed), seed);
  pb.window = KeyWindow::sliding(window);
  const ReferenceLayerResult ref = check ? pb.reference() : ReferenceLayerResult{};
  LayerRunSpec spec;
  spec.method = method;
  spec.layout = layout;
  spec.J = J;
  spec.warmup = warmup;
  spec.reps = reps;
  spec.dtype = compute;
  spec.reference = check ? &ref : nullptr;
  const LayerRun run = [&] {
    py::gil_scoped_release release;
    return run_layer(world, pb, spec);
  }();
  py::dict d;
  d["method"] = run.method;
  d["layout"] = run.layout;
  d["J"] = run.J;
  d["fwd_ms"] = run.fwd_ms;
  d["bwd_ms"] = run.bwd_ms;
  d["step_ms"] = run.step_ms;
  d["exposed_comm_ms"] = run.exposed_comm_ms;
  d["bytes_per_layer"] = run.bytes_per_layer;
  d["predicted_bytes_per_layer"] = run.predicted_bytes_per_layer;
  d["redistribution_bytes"] = run.redistribution_bytes;
  d["imbalance_pct"] = run.imbalance_pct;
  d["oproj"] = run.oproj;
  d["checked"] = run.checked;
  d["check_passed"] = run.check_passed;
  d["max_rel_err"] = run.max_rel_err;
  d["max_tol_ratio"] = run.max_tol_ratio;
  d["mismatches"] = run.mismatches;
  return d;
}

PYBIND11_MODULE(_core, m) {
  m.doc() = "diffcp's C++ core (use the diffcp package, not this module)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const diffcp::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  m.def("plan", &plan, py::arg("lengths"), py::arg("anchors"), py::arg("block"), py::arg("P"), py::arg("J"),
        py::arg("balancer"), py::arg("windows") = std::vector<std::int64_t>{});
  m.def("balancer_names", &balancer_names);
  m.def("run_layer", &run_layer_py, py::arg("comm"), py::arg("config"), py::arg("method"), py::arg("layout"),
        py::arg("samples"), py::arg("context"), py::arg("queries"), py::arg("block"), py::arg("prompt_fraction"),
        py::arg("window"), py::arg("dtype"), py::arg("seed"), py::arg("warmup"), py::arg("reps"), py::arg("J"),
        py::arg("check"), py::arg("comm_kind") = "mpi");
  py::class_<AttnLayerConfig>(m, "LayerConfig")
      .def(py::init([](std::int64_t hidden, std::int64_t n_q, std::int64_t n_kv, std::int64_t d_h, double rope_theta,
                       double rms_eps) { return AttnLayerConfig{hidden, n_q, n_kv, d_h, rope_theta, rms_eps}; }),
           py::arg("hidden"), py::arg("n_q"), py::arg("n_kv"), py::arg("d_h"), py::arg("rope_theta") = 1e6,
           py::arg("rms_eps") = 1e-6)
      .def_readonly("hidden", &AttnLayerConfig::hidden)
      .def_readonly("n_q", &AttnLayerConfig::n_q)
      .def_readonly("n_kv", &AttnLayerConfig::n_kv)
      .def_readonly("d_h", &AttnLayerConfig::d_h)
      .def_readonly("rope_theta", &AttnLayerConfig::rope_theta)
      .def_readonly("rms_eps", &AttnLayerConfig::rms_eps);
  py::class_<SavedPy, std::shared_ptr<SavedPy>>(m, "Saved");
  py::class_<SplitKVLayerPy>(m, "SplitKV")
      .def(py::init<MPI_Fint, const AttnLayerConfig&, const Ints&, const std::vector<Ints>&, std::int64_t,
                    const std::optional<Ints>&, const std::optional<Ints>&, const std::string&, const std::string&>(),
           py::arg("comm_f"), py::arg("config"), py::arg("lengths"), py::arg("anchors"), py::arg("block"),
           py::arg("chunks") = std::nullopt, py::arg("rank") = std::nullopt, py::arg("dtype") = "f32",
           py::arg("comm_kind") = "mpi")
      .def_property_readonly("param_count", &SplitKVLayerPy::param_count)
      .def("param_layout", &SplitKVLayerPy::param_layout)
      .def("init_params", &SplitKVLayerPy::init_params, py::arg("seed"))
      .def_property_readonly("owned_query_rows", &SplitKVLayerPy::owned_query_rows)
      .def_property_readonly("context_chunks", &SplitKVLayerPy::context_chunks)
      .def_property_readonly("predicted_bytes_per_layer", &SplitKVLayerPy::predicted_bytes_per_layer)
      .def_property_readonly("bytes_sent", &SplitKVLayerPy::bytes_sent)
      .def("forward", &SplitKVLayerPy::forward, py::arg("params"), py::arg("x"), py::arg("ctx"))
      .def("backward", &SplitKVLayerPy::backward, py::arg("saved"), py::arg("params"), py::arg("dy"));
  py::class_<DitPy>(m, "Dit")
      .def(py::init<const std::string&, MPI_Fint, const std::string&, int, int, const std::string&, bool, const std::string&,
                    double, bool, const std::string&, const std::string&, const std::string&>(),
           py::arg("folder"), py::arg("comm_f"), py::arg("mode"), py::arg("ulysses_degree"), py::arg("group_size"),
           py::arg("weights_dtype"), py::arg("shard_weights"), py::arg("dtype"), py::arg("cache_ratio"),
           py::arg("cfg_parallel") = false, py::arg("step_cache") = "none", py::arg("wire") = "auto",
           py::arg("comm_kind") = "mpi")
      .def("config", &DitPy::config)
      .def("step_cache_stats", &DitPy::step_cache_stats)
      .def("velocity_pair", &DitPy::velocity_pair, py::arg("x0"), py::arg("txt0"), py::arg("pooled0"), py::arg("x1"),
           py::arg("txt1"), py::arg("pooled1"), py::arg("height"), py::arg("width"), py::arg("t"), py::arg("guidance"),
           py::arg("step"), py::arg("steps"), py::arg("pair_index") = 0)
      .def("velocity", &DitPy::velocity, py::arg("x"), py::arg("height"), py::arg("width"), py::arg("txt"), py::arg("pooled"),
           py::arg("t"), py::arg("guidance"), py::arg("pass_index"), py::arg("step"), py::arg("steps"));
  py::class_<DrafterPy>(m, "Drafter")
      .def(py::init<const std::string&, MPI_Fint, const std::string&>(), py::arg("dir"), py::arg("comm_f"),
           py::arg("comm_kind") = "mpi")
      .def("config", &DrafterPy::config)
      .def("draft", &DrafterPy::draft, py::arg("target_hidden"), py::arg("noise_embedding"))
      .def("propose", &DrafterPy::propose, py::arg("hidden"), py::arg("logits"), py::arg("anchor"), py::arg("temperature"),
           py::arg("seed"))
      .def("new_cache", [](DrafterPy& d) { return std::make_unique<DraftCachePy>(d); }, py::keep_alive<0, 1>());
  py::class_<DraftCachePy>(m, "DraftCache")
      .def("append", &DraftCachePy::append, py::arg("target_hidden"))
      .def("draft", &DraftCachePy::draft, py::arg("noise_embedding"))
      .def("__len__", &DraftCachePy::length)
      .def_property_readonly("bytes", &DraftCachePy::bytes);
  m.def("attention_forward", &attention_forward_py, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"),
        py::arg("lse"), py::arg("lengths"), py::arg("anchors"), py::arg("block"), py::arg("softmax_scale"));
  m.def("attention_backward", &attention_backward_py, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"),
        py::arg("lse"), py::arg("do"), py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("lengths"),
        py::arg("anchors"), py::arg("block"), py::arg("softmax_scale"));
  m.def("to_bf16", &to_bf16_py, py::arg("x"));
  m.def("from_bf16", &from_bf16_py, py::arg("x"));
  // The registered backends (this module registers none beyond the library's: the CPU), and the
  // check of a `backend=` argument: known, and on host memory (the bindings hand numpy memory to
  // the ops; a device backend needs staging, which comes with it).
  m.def("backends", [] {
    py::list out;
    for (Backend* b : registered_backends()) {
      py::dict d;
      d["name"] = b->name();
      d["device"] = device_name(b->device());
      d["f32"] = b->describe(DType::f32);
      d["bf16"] = b->describe(DType::bf16);
      out.append(d);
    }
    return out;
  });
  m.def("check_backend", [](const std::string& name) {
    const Backend* found = &find_backend(name);  // unknown: the error names the registered ones
    if (found != &active_backend())
      throw py::value_error("backend '" + name + "': the Python bindings hand numpy memory to the process's backend, '" +
                            active_backend().name() + "'; no other is selectable from Python yet");
  }, py::arg("name"));
  // USP's degrees (dit/usp.hpp): the given ones checked, or the largest U dividing P and the heads.
  m.def("resolve_usp_degrees", [](int P, std::int64_t heads, std::optional<int> ulysses, std::optional<int> ring) {
    const UspDegrees d = resolve_usp_degrees(P, heads, ulysses, ring, "ulysses_degree", "ring_degree");
    return py::make_tuple(d.ulysses, d.ring);
  }, py::arg("P"), py::arg("heads"), py::arg("ulysses") = std::nullopt, py::arg("ring") = std::nullopt);
  m.def("bf16_path", [] { return active_backend().describe(DType::bf16); });
  m.def("cpu_kernels", [] { return active_backend().describe(DType::f32); });
}
