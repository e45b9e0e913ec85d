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

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/mask.hpp"
#include "diffcp/balance/balancer.hpp"
#include "diffcp/core/error.hpp"
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

// A float32 C-contiguous array of exactly `shape`, used in place.
const float* checked(const py::array& a, const char* name, const std::vector<std::int64_t>& shape) {
  if (!a.dtype().is(py::dtype::of<float>()))
    throw py::type_error(std::string(name) + ": expected a numpy float32 array, got dtype " +
                         py::str(a.dtype()).cast<std::string>());
  if (!(a.flags() & py::array::c_style)) throw py::value_error(std::string(name) + ": array must be C-contiguous");
  bool ok = a.ndim() == static_cast<py::ssize_t>(shape.size());
  for (std::size_t i = 0; ok && i < shape.size(); ++i) ok = a.shape(static_cast<py::ssize_t>(i)) == shape[i];
  if (!ok) {
    std::string want = "[", got = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + std::to_string(shape[i]);
    for (py::ssize_t i = 0; i < a.ndim(); ++i) got += (i ? ", " : "") + std::to_string(a.shape(i));
    throw py::value_error(std::string(name) + ": shape " + got + "], expected " + want + "]");
  }
  return static_cast<const float*>(a.data());
}

Floats empty(std::vector<std::int64_t> shape) { return Floats(std::vector<py::ssize_t>(shape.begin(), shape.end())); }

py::dict plan(const Ints& lengths, const std::vector<Ints>& anchors, std::int64_t block, int P, int J,
              const std::string& balancer) {
  const PackedBatch batch = make_batch(lengths, anchors, block);
  check_plan_args(balancer.c_str(), batch.context_rows(), P, J);
  const auto b = make_balancer(balancer);
  const CostModel cost(batch);
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

py::tuple attention_forward_py(const py::array& q, const py::array& k, const py::array& v, const Ints& lengths,
                               const std::vector<Ints>& anchors, std::int64_t block, float scale) {
  const PackedBatch batch = make_batch(lengths, anchors, block);
  const BlockMask mask = full_mask(batch);
  const Dims d = dims_of(mask, q, k);
  const float* qp = checked(q, "q", {d.Q, d.n_q, d.d_h});
  const float* kp = checked(k, "k", {d.Lk, d.n_kv, d.d_h});
  const float* vp = checked(v, "v", {d.Lk, d.n_kv, d.d_h});
  if (d.n_kv < 1 || d.n_q % d.n_kv != 0)
    throw py::value_error("q, k: n_q = " + std::to_string(d.n_q) + " is not a multiple of n_kv = " + std::to_string(d.n_kv));
  Floats o = empty({d.Q, d.n_q, d.d_h}), lse = empty({d.Q, d.n_q});
  {
    py::gil_scoped_release nogil;
    attention_forward(mask, {qp, d.Q, d.n_q, d.d_h, d.n_q * d.d_h}, {kp, d.Lk, d.n_kv, d.d_h, d.n_kv * d.d_h},
                      {vp, d.Lk, d.n_kv, d.d_h, d.n_kv * d.d_h}, {o.mutable_data(), d.Q, d.n_q, d.d_h, d.n_q * d.d_h},
                      {lse.mutable_data(), static_cast<std::size_t>(d.Q * d.n_q)}, scale);
  }
  return py::make_tuple(o, lse);
}

py::tuple attention_backward_py(const py::array& q, const py::array& k, const py::array& v, const py::array& o,
                                const py::array& lse, const py::array& dout, const Ints& lengths,
                                const std::vector<Ints>& anchors, std::int64_t block, float scale) {
  const PackedBatch batch = make_batch(lengths, anchors, block);
  const BlockMask mask = full_mask(batch);
  const Dims d = dims_of(mask, q, k);
  const float* qp = checked(q, "q", {d.Q, d.n_q, d.d_h});
  const float* kp = checked(k, "k", {d.Lk, d.n_kv, d.d_h});
  const float* vp = checked(v, "v", {d.Lk, d.n_kv, d.d_h});
  const float* op = checked(o, "o", {d.Q, d.n_q, d.d_h});
  const float* lp = checked(lse, "lse", {d.Q, d.n_q});
  const float* gp = checked(dout, "do", {d.Q, d.n_q, d.d_h});
  if (d.n_kv < 1 || d.n_q % d.n_kv != 0)
    throw py::value_error("q, k: n_q = " + std::to_string(d.n_q) + " is not a multiple of n_kv = " + std::to_string(d.n_kv));
  Floats dq = empty({d.Q, d.n_q, d.d_h}), dk = empty({d.Lk, d.n_kv, d.d_h}), dv = empty({d.Lk, d.n_kv, d.d_h});
  {
    py::gil_scoped_release nogil;
    const auto n = static_cast<std::size_t>(d.Q * d.n_q);
    std::vector<float> delta(n);
    const std::int64_t qs = d.n_q * d.d_h, ks = d.n_kv * d.d_h;
    attention_delta({gp, d.Q, d.n_q, d.d_h, qs}, {op, d.Q, d.n_q, d.d_h, qs}, delta);
    attention_backward(mask, {qp, d.Q, d.n_q, d.d_h, qs}, {kp, d.Lk, d.n_kv, d.d_h, ks}, {vp, d.Lk, d.n_kv, d.d_h, ks},
                       {gp, d.Q, d.n_q, d.d_h, qs}, {lp, n}, delta, {dq.mutable_data(), d.Q, d.n_q, d.d_h, qs},
                       {dk.mutable_data(), d.Lk, d.n_kv, d.d_h, ks}, {dv.mutable_data(), d.Lk, d.n_kv, d.d_h, ks}, scale);
  }
  return py::make_tuple(dq, dk, dv);
}

}  // namespace

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
        py::arg("balancer"));
  m.def("balancer_names", &balancer_names);
  m.def("attention_forward", &attention_forward_py, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("lengths"),
        py::arg("anchors"), py::arg("block"), py::arg("softmax_scale"));
  m.def("attention_backward", &attention_backward_py, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"),
        py::arg("lse"), py::arg("do"), py::arg("lengths"), py::arg("anchors"), py::arg("block"),
        py::arg("softmax_scale"));
}
