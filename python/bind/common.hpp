// What every binding file of diffcp._core shares (python/_core.cpp): the array types and their
// checks. Arrays: float tensors must be numpy float32, C-contiguous, of the documented shape; they
// are used in place (zero-copy) and a wrong one is a TypeError / ValueError, never a silent copy.
// Integer inputs (lengths, anchors) are converted to int64. The GIL is released while kernels run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <mpi.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "diffcp/core/dtype.hpp"
#include "diffcp/workload/batch.hpp"

namespace diffcp::py_bind {

namespace py = pybind11;

using Ints = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>;
using Floats = py::array_t<float, py::array::c_style>;

inline PackedBatch make_batch(const Ints& lengths, const std::vector<Ints>& anchors, std::int64_t block) {
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

inline std::string shape_str(const py::array& a) {
  std::string got = "[";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) got += (i ? ", " : "") + std::to_string(a.shape(i));
  return got + "]";
}

// A C-contiguous array of exactly `shape` and element type `dtype` (f32: float32; bf16: its bits
// as uint16, numpy having no bfloat16), used in place; `writable` for outputs.
inline const void* checked_any(const py::array& a, const char* name, const std::vector<std::int64_t>& shape, DType dtype,
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
inline const float* checked(const py::array& a, const char* name, const std::vector<std::int64_t>& shape) {
  return static_cast<const float*>(checked_any(a, name, shape, DType::f32));
}

inline Floats empty(std::vector<std::int64_t> shape) { return Floats(std::vector<py::ssize_t>(shape.begin(), shape.end())); }

// The bindings that take an mpi4py communicator need MPI initialized (by importing mpi4py.MPI).
inline void require_mpi(const char* what) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw py::value_error(std::string(what) + ": MPI is not initialized (import mpi4py.MPI first)");
}

// One area's bindings each (python/bind/*.cpp).
void bind_attention(py::module_& m);
void bind_splitkv(py::module_& m);
void bind_dit(py::module_& m);
void bind_drafter(py::module_& m);

}  // namespace diffcp::py_bind
