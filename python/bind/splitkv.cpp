// diffcp._core: the Split-KV attention layer and the measured layer run over an mpi4py communicator.
#include "bind/common.hpp"

#include "diffcp/comm/mpi_communicator.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/cp/splitkv.hpp"
#include "diffcp/testing/layer_run.hpp"

namespace diffcp::py_bind {

namespace {

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

}  // namespace

void bind_splitkv(py::module_& m) {
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
}

}  // namespace diffcp::py_bind
