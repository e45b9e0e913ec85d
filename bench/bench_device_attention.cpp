// bench_device_attention [--backend NAME] [workload] [--json]: the DFlash block-sparse attention
// (forward, and backward from the global lse and D) on one backend's memory and kernels, next to
// that backend's own bf16 / f32 GEMM rate measured in the same run (issue #55: the cuda backend on
// a lent GPU; cpu here). FLOPs over visible pairs only, as bench_attention counts them (4 d_h
// forward, 10 d_h backward per pair per query head); medians of --reps timed runs after one
// warm-up, each run closed by the backend's synchronize(). --dump-mask writes the mask as
// bench_attention does, for the PyTorch peers (bench/bench_gpu_peers.py: FlexAttention, SDPA).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/mask.hpp"
#include "mask_json.hpp"
#include "diffcp/core/random.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/ops/buffer.hpp"
#include "diffcp/ops/gemm.hpp"
#include "diffcp/testing/guard_backend.hpp"
#include "diffcp/workload/batch.hpp"
#ifdef DIFFCP_HAVE_CUDA
#include "diffcp/cuda/backend.hpp"
#endif

namespace {

using diffcp::Backend;
using diffcp::Buffer;
using diffcp::DType;

double median_ms(Backend& b, int reps, const std::function<void()>& fn) {
  fn();  // warm-up
  b.synchronize();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    b.synchronize();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// `n` normal values in `dtype`, in the backend's memory.
Buffer random_buffer(Backend& b, DType dtype, std::int64_t n, std::uint64_t seed) {
  const std::vector<float> host = diffcp::random_normal(static_cast<std::size_t>(n), seed);
  Buffer f = diffcp::to_device(std::span<const float>(host), b);
  if (dtype == DType::f32) return f;
  Buffer out(dtype, n, b);
  diffcp::convert(f.view(), out.view());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The DFlash block-sparse attention on one backend, next to its GEMM rate"};
  std::string backend = "cpu", dtype_s = "bf16", dump_mask;
  std::int64_t samples = 2, context = 32768, anchors = 64, block = 16, n_q = 32, n_kv = 8, d_h = 128, gemm_n = 8192;
  int reps = 5;
  bool json = false, backward = true;
  app.add_option("--backend", backend, "registered backend (cpu, guard, cuda)")->capture_default_str();
  app.add_option("--samples", samples)->capture_default_str();
  app.add_option("--context", context, "context tokens per sample")->capture_default_str();
  app.add_option("--anchors", anchors, "anchors per sample")->capture_default_str();
  app.add_option("--block", block)->capture_default_str();
  app.add_option("--n-q", n_q)->capture_default_str();
  app.add_option("--n-kv", n_kv)->capture_default_str();
  app.add_option("--d-h", d_h)->capture_default_str();
  app.add_option("--dtype", dtype_s, "storage dtype: f32 | bf16")->check(CLI::IsMember({"f32", "bf16"}))->capture_default_str();
  app.add_option("--gemm-n", gemm_n, "size of the square reference GEMM on the same backend (0: none)")->capture_default_str();
  app.add_option("--reps", reps)->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_flag("!--no-backward", backward, "time the forward only");
  app.add_flag("--json", json, "one JSON object on stdout");
  app.add_option("--dump-mask", dump_mask, "write the block mask as JSON (bench_attention's format) and go on");
  CLI11_PARSE(app, argc, argv);
  try {
    (void)diffcp::guard_backend();
#ifdef DIFFCP_HAVE_CUDA
    if (backend == "cuda") (void)diffcp::cuda_backend();  // registers it, or says why there is no device
#endif
    Backend& b = diffcp::find_backend(backend);
    diffcp::ScopedBackend use(b);
    const DType dt = dtype_s == "bf16" ? DType::bf16 : DType::f32;
    const diffcp::PackedBatch batch = diffcp::make_random_batch(samples, context, anchors, block, 0.25, 1);
    const diffcp::BlockMask mask = diffcp::full_mask(batch);
    const std::int64_t Q = batch.query_rows(), Lk = mask.key_rows();
    if (!dump_mask.empty()) diffcp::bench::dump_mask_json(batch, mask, dump_mask);
    const Buffer q = random_buffer(b, dt, Q * n_q * d_h, 1), k = random_buffer(b, dt, Lk * n_kv * d_h, 2),
                 v = random_buffer(b, dt, Lk * n_kv * d_h, 3), dout = random_buffer(b, dt, Q * n_q * d_h, 4);
    Buffer o(dt, Q * n_q * d_h, b), dq(dt, Q * n_q * d_h, b), dk(dt, Lk * n_kv * d_h, b), dv(dt, Lk * n_kv * d_h, b),
        lse(DType::f32, Q * n_q, b), delta(DType::f32, Q * n_q, b);
    const auto hv = [](const Buffer& x, std::int64_t rows, std::int64_t heads, std::int64_t d) {
      return diffcp::head_view(x.view(), rows, heads, d);
    };
    const std::span<float> lse_s(lse.ptr<float>(), static_cast<std::size_t>(Q * n_q));
    const std::span<float> delta_s(delta.ptr<float>(), lse_s.size());
    const double fwd_ms = median_ms(b, reps, [&] {
      diffcp::attention_forward(mask, hv(q, Q, n_q, d_h), hv(k, Lk, n_kv, d_h), hv(v, Lk, n_kv, d_h), hv(o, Q, n_q, d_h),
                                lse_s);
    });
    double bwd_ms = 0;
    if (backward) {
      diffcp::attention_delta(hv(dout, Q, n_q, d_h), hv(o, Q, n_q, d_h), delta_s);
      bwd_ms = median_ms(b, reps, [&] {
        diffcp::attention_backward(mask, hv(q, Q, n_q, d_h), hv(k, Lk, n_kv, d_h), hv(v, Lk, n_kv, d_h),
                                   hv(dout, Q, n_q, d_h), lse_s, delta_s, hv(dq, Q, n_q, d_h), hv(dk, Lk, n_kv, d_h),
                                   hv(dv, Lk, n_kv, d_h));
      });
    }
    double gemm_gflops = 0;
    if (gemm_n > 0) {  // C (f32) = A B, A and B of the kernels' dtype
      const Buffer a = random_buffer(b, dt, gemm_n * gemm_n, 5), bm = random_buffer(b, dt, gemm_n * gemm_n, 6);
      Buffer c(DType::f32, gemm_n * gemm_n, b);
      diffcp::GemmArgs g;
      g.M = g.N = g.K = gemm_n;
      g.A = a.data(), g.B = bm.data(), g.C = c.data();
      g.lda = g.ldb = g.ldc = gemm_n;
      g.dtype = dt;
      g.c_dtype = DType::f32;
      const double ms = median_ms(b, reps, [&] { b.gemm(g); });
      gemm_gflops = 2.0 * static_cast<double>(gemm_n) * gemm_n * gemm_n / (ms * 1e6);
    }
    const double fwd_flops = diffcp::attention_forward_flops(mask, n_q, d_h),
                 bwd_flops = diffcp::attention_backward_flops(mask, n_q, d_h);
    const double fwd_gf = fwd_flops / (fwd_ms * 1e6), bwd_gf = backward ? bwd_flops / (bwd_ms * 1e6) : 0;
    const nlohmann::json r{{"backend", b.name()}, {"kernels", b.describe(dt)}, {"dtype", dtype_s}, {"samples", samples},
                           {"context", context}, {"anchors", anchors}, {"block", block}, {"n_q", n_q}, {"n_kv", n_kv},
                           {"d_h", d_h}, {"query_rows", Q}, {"key_rows", Lk},
                           {"visible_pairs_per_head", mask.visible_pairs()}, {"reps", reps}, {"fwd_ms", fwd_ms},
                           {"bwd_ms", bwd_ms}, {"fwd_gflops", fwd_gf}, {"bwd_gflops", bwd_gf}, {"gemm_n", gemm_n},
                           {"gemm_gflops", gemm_gflops},
                           {"fwd_over_gemm", gemm_gflops > 0 ? fwd_gf / gemm_gflops : 0},
                           {"bwd_over_gemm", gemm_gflops > 0 ? bwd_gf / gemm_gflops : 0}};
    if (json) {
      std::cout << r.dump() << std::endl;
    } else {
      std::printf("%s, %s: Q %lld, L_k %lld, n_q %lld, n_kv %lld, d_h %lld, %lld visible pairs per head\n", b.name(),
                  b.describe(dt).c_str(), static_cast<long long>(Q), static_cast<long long>(Lk),
                  static_cast<long long>(n_q), static_cast<long long>(n_kv), static_cast<long long>(d_h),
                  static_cast<long long>(mask.visible_pairs()));
      std::printf("  forward  %10.3f ms %10.1f GFLOP/s", fwd_ms, fwd_gf);
      if (gemm_gflops > 0) std::printf(" = %5.1f %% of the %s GEMM (%.1f GFLOP/s)", 100 * fwd_gf / gemm_gflops, dtype_s.c_str(), gemm_gflops);
      std::printf("\n");
      if (backward) {
        std::printf("  backward %10.3f ms %10.1f GFLOP/s", bwd_ms, bwd_gf);
        if (gemm_gflops > 0) std::printf(" = %5.1f %% of the GEMM", 100 * bwd_gf / gemm_gflops);
        std::printf("\n");
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_device_attention: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
