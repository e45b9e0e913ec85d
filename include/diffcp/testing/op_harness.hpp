// The op harness (ggml's test-backend-ops idea, our own code): every op of a backend against the
// CPU backend, on random inputs at several shapes (edges included), each output compared by a
// normalised error bound stated per case; and a perf mode that times each case on both.
//
// A case runs public ops (ops/*.hpp, attention/*.hpp, dit/ops.hpp) on arrays that live in the
// backend's memory: the same body runs once with the CPU backend active and once with the backend
// under test, from the same inputs, and the arrays (inputs and outputs) are compared afterwards.
// A backend that does not support one of a case's (op, dtype) pairs skips that case (reported);
// one that claims an op and gets it wrong fails with the case, its shape, the array and the error.
// The guard device passes it bit for bit (tests/kernels/test_guard.cpp checks that stronger property on
// the same cases); tests/kernels/test_backend_ops.cpp runs every registered backend through it and shows
// that a wrong op fails; bench/bench_backend_ops.cpp is the command (`--perf`).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "diffcp/ops/backend.hpp"

namespace diffcp {

// How an array is compared after the case ran.
enum class OpCompare : std::uint8_t {
  value,      // elementwise in its dtype: max |x - ref| / max |ref| <= bound (non-finite: equal)
  f64_bytes,  // its bytes hold doubles (host statistics a case stores): compared as value
  exact,      // bytes (encoded payloads: checked through what decodes them)
};

struct OpArray {
  DType dtype;
  std::int64_t n;
  float lo = -1.f, hi = 1.f;  // initial values uniform in [lo, hi) (bf16: rounded)
  OpCompare cmp = OpCompare::value;
  // An f32 array computed from bf16 results (attention's D = sum dO o over a bf16 o) is held to
  // the bf16 bound too: two correct backends' o may differ by a bf16 ulp (where P is rounded).
  bool from_bf16 = false;
};

struct OpCase {
  std::string name;   // "gemm f32"
  std::string shape;  // "M 20 N 16 K 24"
  std::vector<std::pair<OpKind, DType>> ops;  // what it runs (a backend must support all of them)
  std::vector<OpArray> arrays;
  // The body, given the arrays as views of the active backend's memory.
  std::function<void(Backend& b, std::vector<TensorView>& t)> body;
  double bound = 1e-5;  // of the f32 value arrays; bf16 arrays: max(bound, kBf16Bound)
  double flops = 0;     // per run, for --perf (0: GB/s of the arrays' bytes instead)
};
// bf16 outputs: 1.6e-2 of the largest element (2 to 4 bf16 ulps of it, by where it sits in its binade)
inline constexpr double kBf16Bound = 1.6e-2;

// Every case, each op at several shapes; together they cover every OpKind.
std::vector<OpCase> op_cases();

// Runs `c` on `b` from the seeded inputs; returns every array's bytes afterwards (host).
std::vector<std::vector<unsigned char>> run_op_case(Backend& b, const OpCase& c);

struct OpResult {
  std::string name, shape;
  bool skipped = false;   // the backend lacks one of the case's ops (skip_reason says which)
  std::string skip_reason;
  std::string failure;    // empty: within bounds; else what differs, by how much
  double worst = 0;       // the largest error / bound over its value arrays
  double cpu_ms = 0, backend_ms = 0;  // --perf: median per run
  double bytes = 0, flops = 0;
};

struct OpHarnessOptions {
  std::string op;                // run only the cases whose name or op names contain it ("" = all)
  Backend* reference = nullptr;  // what `b` is compared with (nullptr: the CPU backend, cpu_backend())
  bool perf = false;             // also time each case on both (median of `reps` runs after one warm-up)
  int reps = 10;
};
// Every case of op_cases() (those matching o.op) on `b` against the reference.
std::vector<OpResult> run_op_harness(Backend& b, const OpHarnessOptions& o = {});

// What the harness puts through it on this machine: every registered backend but the CPU's, and
// the CPU backend once per instruction set this build has and this CPU runs (its kernels are
// separate implementations per ISA: src/cpu/isa.hpp), each named as `-b` selects it
// ("guard", "cuda", "cpu:avx2", ...). A CPU ISA is compared with the generic (x86-64 baseline)
// kernels, and those with the widest other ISA; a build with one ISA has no CPU target.
struct OpHarnessTarget {
  std::string name;
  Backend* backend;
  Backend* reference;
};
std::vector<OpHarnessTarget> op_harness_targets();

}  // namespace diffcp
