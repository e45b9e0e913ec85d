// bench_backend_ops [--backend NAME] [--op OP] [--perf] [--reps N]: the op harness
// (testing/op_harness.hpp) on one target (a registered backend, or one CPU ISA's kernels as
// "cpu:avx2"): every case against its reference within its error bound, and with --perf each
// case's median time on both, with GB/s of its arrays' bytes (GFLOP/s for GEMMs and
// attention). Exit status 1 if any case fails. `diffcp backends` lists the backends.
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include "diffcp/ops/backend.hpp"
#include "diffcp/testing/guard_backend.hpp"
#include "diffcp/testing/op_harness.hpp"
#ifdef DIFFCP_HAVE_CUDA
#include "diffcp/cuda/backend.hpp"
#endif

int main(int argc, char** argv) {
  CLI::App app{"The op harness: every op of a backend against the CPU backend"};
  std::string backend = "guard", op;
  bool perf = false;
  int reps = 10;
  app.add_option("--backend", backend, "target under test (guard, cuda, cpu:avx2, ...; cpu: the active CPU kernels)")->capture_default_str();
  app.add_option("--op", op, "only the cases whose name or ops contain it");
  app.add_flag("--perf", perf, "time each case on the CPU and on the backend (median of --reps)");
  app.add_option("--reps", reps, "timed runs per case with --perf")->check(CLI::Range(1, 1000))->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    (void)diffcp::guard_backend();  // registered by the test library
#ifdef DIFFCP_HAVE_CUDA
    if (backend == "cuda") (void)diffcp::cuda_backend();  // registers it, or says why there is no device
#endif
    diffcp::OpHarnessOptions o{.op = op, .reference = nullptr, .perf = perf, .reps = reps};
    diffcp::Backend* target = nullptr;
    for (const diffcp::OpHarnessTarget& t : diffcp::op_harness_targets())
      if (t.name == backend) target = t.backend, o.reference = t.reference;
    diffcp::Backend& b = target != nullptr ? *target : diffcp::find_backend(backend);
    int failed = 0, skipped = 0, n = 0;
    std::printf("%-44s %-40s %-6s %10s", "case", "shape", "result", "err/bound");
    if (perf) std::printf(" %10s %10s %12s %12s", "cpu ms", "ms", "cpu rate", "rate");
    std::printf("\n");
    for (const diffcp::OpResult& r : diffcp::run_op_harness(b, o)) {
      ++n;
      const char* res = r.skipped ? "skip" : r.failure.empty() ? "ok" : "FAIL";
      std::printf("%-44s %-40s %-6s %10.3g", r.name.c_str(), r.shape.c_str(), res, r.worst);
      if (perf && !r.skipped) {
        const bool fl = r.flops > 0;
        const auto rate = [&](double ms) { return (fl ? r.flops : r.bytes) / (ms * 1e6); };
        std::printf(" %10.4f %10.4f %9.2f %s %9.2f %s", r.cpu_ms, r.backend_ms, rate(r.cpu_ms), fl ? "GF/s" : "GB/s",
                    rate(r.backend_ms), fl ? "GF/s" : "GB/s");
      }
      std::printf("\n");
      if (r.skipped) ++skipped, std::printf("    skipped: %s does not support %s\n", b.name(), r.skip_reason.c_str());
      if (!r.failure.empty()) ++failed, std::printf("    %s\n", r.failure.c_str());
    }
    std::printf("bench_backend_ops: backend %s: %d cases, %d within their bounds, %d failed, %d skipped\n", backend.c_str(), n,
                n - failed - skipped, failed, skipped);
    return failed ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_backend_ops: error: %s\n", e.what());
    return 1;
  }
}
