// diffcp._core: the C++ library seen from Python (pybind11). The typed, documented API is the
// Python package around it (python/diffcp/); the bindings only convert arrays and errors, one file
// per area (python/bind/: attention, splitkv, dit, drafter; their shared checks in common.hpp).
// diffcp::Error becomes ValueError; the library names its options' fields in backticks
// (`cfg_parallel`), Python's keywords.
#include "bind/common.hpp"

#include "diffcp/core/error.hpp"

PYBIND11_MODULE(_core, m) {
  namespace py = pybind11;
  m.doc() = "diffcp's C++ core (use the diffcp package, not this module)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const diffcp::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  diffcp::py_bind::bind_attention(m);
  diffcp::py_bind::bind_splitkv(m);
  diffcp::py_bind::bind_dit(m);
  diffcp::py_bind::bind_drafter(m);
}
