// diffcp._core: the load balancer's plans, the block-sparse attention kernels, bf16 conversion
// and the backends.
#include "bind/common.hpp"

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/mask.hpp"
#include "diffcp/balance/balancer.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/ops/backend.hpp"

namespace diffcp::py_bind {

namespace {

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

}  // namespace

void bind_attention(py::module_& m) {
  m.def("plan", &plan, py::arg("lengths"), py::arg("anchors"), py::arg("block"), py::arg("P"), py::arg("J"),
        py::arg("balancer"), py::arg("windows") = std::vector<std::int64_t>{});
  m.def("balancer_names", &balancer_names);
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
  m.def("bf16_path", [] { return active_backend().describe(DType::bf16); });
  m.def("cpu_kernels", [] { return active_backend().describe(DType::f32); });
}

}  // namespace diffcp::py_bind
