// Attention kernel throughput next to oneDNN GEMM throughput measured in the same run.
//
// Reports GFLOP/s of the block-sparse forward and backward (FLOPs over visible pairs only, as
// FlashAttention counts them: 4*d_h fwd, 10*d_h bwd per pair per query head) and of large oneDNN
// f32 and bf16 matmuls on the same threads, then the ratios kernel / GEMM of the same dtype and
// bf16 kernel / f32 kernel (issue #14). Medians of --reps timed runs after one warm-up. Default workload (issue #2): n_q=32, n_kv=4, d_h=128, B=16,
// 2 samples x 16k context, 256 anchors each, prompt 25 %.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <functional>
#include <limits>
#include <fstream>
#include <iostream>
#include <stdexcept>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <omp.h>
#include <oneapi/dnnl/dnnl.hpp>

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/mask.hpp"
#include "mask_json.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/core/random.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/workload/batch.hpp"

namespace {

double median_seconds(int reps, const std::function<void()>& fn) {
  fn();  // warm-up (page faults, oneDNN JIT)
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// GFLOP/s of an n x n x n oneDNN matmul in the given data type (f32 or bf16 inputs, f32 output).
double onednn_matmul_gflops(dnnl::memory::data_type dt, std::int64_t n, int reps) {
  using namespace dnnl;
  engine eng(engine::kind::cpu, 0);
  stream strm(eng);
  const memory::dims a_dims{n, n}, b_dims{n, n}, c_dims{n, n};
  const memory::desc a_md(a_dims, dt, memory::format_tag::ab), b_md(b_dims, dt, memory::format_tag::ab),
      c_md(c_dims, memory::data_type::f32, memory::format_tag::ab);
  const matmul::primitive_desc pd(matmul::desc(a_md, b_md, c_md), eng);
  memory a(a_md, eng), b(b_md, eng), c(c_md, eng);
  // Fill inputs (f32: ones-ish; bf16: zero bytes are valid numbers too, but use 1.0 = 0x3f80).
  const std::size_t elems = static_cast<std::size_t>(n * n);
  if (dt == memory::data_type::f32) {
    std::fill_n(static_cast<float*>(a.get_data_handle()), elems, 0.5f);
    std::fill_n(static_cast<float*>(b.get_data_handle()), elems, 0.25f);
  } else {
    std::fill_n(static_cast<std::uint16_t*>(a.get_data_handle()), elems, std::uint16_t{0x3f80});
    std::fill_n(static_cast<std::uint16_t*>(b.get_data_handle()), elems, std::uint16_t{0x3f80});
  }
  matmul prim(pd);
  const double s = median_seconds(reps, [&] {
    prim.execute(strm, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    strm.wait();
  });
  return 2.0 * static_cast<double>(n) * n * n / s / 1e9;
}

// GFLOP/s of the kernel's own tile GEMMs (S = Q K^T: 'N','T' GB x kt x d; O += P V: 'N','N'
// GB x d x kt) issued by every thread at once on private data, as the kernel issues them: the
// ceiling of this kernel design.
double tile_gemm_gflops(std::int64_t GB, std::int64_t kt, std::int64_t d, std::int64_t ld, int reps) {
  const int iters = 200;
  const double s = median_seconds(reps, [&] {
#pragma omp parallel
    {
      std::vector<float> q(static_cast<std::size_t>(GB * d), 0.5f), kv(static_cast<std::size_t>(kt * ld), 0.25f),
          p(static_cast<std::size_t>(GB * kt)), o(static_cast<std::size_t>(GB * d));
      for (int it = 0; it < iters; ++it) {
        dnnl_sgemm('N', 'T', GB, kt, d, 1.f, q.data(), d, kv.data(), ld, 0.f, p.data(), kt);
        dnnl_sgemm('N', 'N', GB, d, kt, 1.f, p.data(), kt, kv.data(), ld, 1.f, o.data(), d);
      }
    }
  });
  return 4.0 * static_cast<double>(GB) * kt * d * iters * omp_get_max_threads() / s / 1e9;
}

struct KernelTimes {
  double fwd_s, bwd_s;
};

// Median forward and backward seconds of the attention kernels on inputs of storage type T.
template <typename T>
KernelTimes time_kernels(const diffcp::BlockMask& mask, const std::vector<T>& q, const std::vector<T>& k,
                         const std::vector<T>& v, const std::vector<T>& dout, std::int64_t n_q, std::int64_t n_kv,
                         std::int64_t d_h, int reps) {
  using diffcp::head_rows;
  const std::int64_t Q = mask.query_rows(), Lk = mask.key_rows();
  std::vector<T> o(q.size()), dq(q.size()), dk(k.size()), dv(v.size());
  std::vector<float> lse(static_cast<std::size_t>(Q * n_q)), delta(lse.size());
  KernelTimes t{};
  t.fwd_s = median_seconds(reps, [&] {
    diffcp::attention_forward(mask, head_rows(q, Q, n_q, d_h), head_rows(k, Lk, n_kv, d_h),
                              head_rows(v, Lk, n_kv, d_h), head_rows(o, Q, n_q, d_h), lse);
  });
  diffcp::attention_delta(head_rows(dout, Q, n_q, d_h), head_rows(std::as_const(o), Q, n_q, d_h), delta);
  t.bwd_s = median_seconds(reps, [&] {
    diffcp::attention_backward(mask, head_rows(q, Q, n_q, d_h), head_rows(k, Lk, n_kv, d_h),
                               head_rows(v, Lk, n_kv, d_h), head_rows(dout, Q, n_q, d_h), lse, delta,
                               head_rows(dq, Q, n_q, d_h), head_rows(dk, Lk, n_kv, d_h), head_rows(dv, Lk, n_kv, d_h));
  });
  return t;
}

std::vector<diffcp::bf16_t> to_bf16(const std::vector<float>& x) {
  std::vector<diffcp::bf16_t> out(x.size());
  diffcp::convert_to_bf16(x.data(), reinterpret_cast<std::uint16_t*>(out.data()), static_cast<std::int64_t>(x.size()));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t samples = 2, context = 16384, anchors = 256, block = 16, n_q = 32, n_kv = 4, d_h = 128, gemm_n = 2048;
  int reps = 5;
  bool json = false;
  std::string dtype = "both";
  CLI::App app{"diffcp attention benchmark (kernel GFLOP/s vs oneDNN GEMM GFLOP/s, same run)"};
  app.add_option("--samples", samples)->capture_default_str();
  app.add_option("--context", context, "context tokens per sample")->capture_default_str();
  app.add_option("--anchors", anchors, "anchors per sample")->capture_default_str();
  app.add_option("--block", block)->capture_default_str();
  app.add_option("--n-q", n_q)->capture_default_str();
  app.add_option("--n-kv", n_kv)->capture_default_str();
  app.add_option("--d-h", d_h)->capture_default_str();
  app.add_option("--gemm-n", gemm_n, "size of the square reference GEMM")->capture_default_str();
  app.add_option("--reps", reps, "timed repetitions (median reported)")->capture_default_str()->check(CLI::Range(1, 1000));
  app.add_option("--dtype", dtype, "storage type of the kernels timed: f32 | bf16 | both")
      ->check(CLI::IsMember({"f32", "bf16", "both"}))
      ->capture_default_str();
  app.add_flag("--json", json, "print one JSON object");
  std::string dump_mask;
  app.add_option("--dump-mask", dump_mask,
                 "write the mask as JSON (block, context_rows, key_rows, per block [ctx_begin, ctx_end]; block i's own "
                 "rows are context_rows + i*block ..): bench/bench_attention_torch.py builds the same mask for PyTorch");
  CLI11_PARSE(app, argc, argv);

  try {
    const diffcp::PackedBatch batch = diffcp::make_random_batch(samples, context, anchors, block, 0.25, 1);
    const diffcp::BlockMask mask = diffcp::full_mask(batch);
    const std::int64_t Q = batch.query_rows(), Lk = mask.key_rows();
    if (!dump_mask.empty()) diffcp::bench::dump_mask_json(batch, mask, dump_mask);
    const auto q = diffcp::random_normal(static_cast<std::size_t>(Q * n_q * d_h), 1);
    const auto k = diffcp::random_normal(static_cast<std::size_t>(Lk * n_kv * d_h), 2);
    const auto v = diffcp::random_normal(static_cast<std::size_t>(Lk * n_kv * d_h), 3);
    const auto dout = diffcp::random_normal(static_cast<std::size_t>(Q * n_q * d_h), 4);
    const double gemm_f32 = onednn_matmul_gflops(dnnl::memory::data_type::f32, gemm_n, reps);
    // oneDNN has no bf16 matmul on CPUs without AVX-512 (e.g. AVX2-only machines): report it as
    // missing (null / n/a) rather than failing the whole benchmark.
    double gemm_bf16 = std::numeric_limits<double>::quiet_NaN();
    try {
      gemm_bf16 = onednn_matmul_gflops(dnnl::memory::data_type::bf16, gemm_n, reps);
    } catch (const dnnl::error&) {
    }
    const double gemm_tile = tile_gemm_gflops(block * (n_q / n_kv), 256, d_h, n_kv * d_h, reps);
    const bool run_f32 = dtype != "bf16", run_bf16 = dtype != "f32";
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const KernelTimes t32 = run_f32 ? time_kernels(mask, q, k, v, dout, n_q, n_kv, d_h, reps) : KernelTimes{nan, nan};
    const KernelTimes t16 = run_bf16 ? time_kernels(mask, to_bf16(q), to_bf16(k), to_bf16(v), to_bf16(dout), n_q, n_kv,
                                                    d_h, reps)
                                     : KernelTimes{nan, nan};
    const double t_fwd = t32.fwd_s, t_bwd = t32.bwd_s;
    const double fwd16 = diffcp::attention_forward_flops(mask, n_q, d_h) / t16.fwd_s / 1e9;
    const double bwd16 = diffcp::attention_backward_flops(mask, n_q, d_h) / t16.bwd_s / 1e9;
    const std::string bf16_path = diffcp::active_backend().describe(diffcp::DType::bf16);
    const std::string kernels = diffcp::active_backend().describe(diffcp::DType::f32);
    const double fwd = diffcp::attention_forward_flops(mask, n_q, d_h) / t_fwd / 1e9;
    const double bwd = diffcp::attention_backward_flops(mask, n_q, d_h) / t_bwd / 1e9;
    const double density = static_cast<double>(mask.visible_pairs()) / (static_cast<double>(Q) * static_cast<double>(Lk));
    if (json) {
      std::cout << nlohmann::json{{"kernels", kernels}, {"threads", omp_get_max_threads()}, {"samples", samples}, {"context", context},
                                  {"anchors", anchors}, {"block", block}, {"n_q", n_q}, {"n_kv", n_kv}, {"d_h", d_h},
                                  {"visible_pairs_per_head", mask.visible_pairs()}, {"mask_density", density},
                                  {"fwd_ms", t_fwd * 1e3}, {"bwd_ms", t_bwd * 1e3}, {"fwd_gflops", fwd},
                                  {"bwd_gflops", bwd}, {"gemm_f32_gflops", gemm_f32}, {"gemm_bf16_gflops", std::isnan(gemm_bf16) ? nlohmann::json() : nlohmann::json(gemm_bf16)}, {"tile_gemm_gflops", gemm_tile},
                                  {"fwd_over_f32_gemm", fwd / gemm_f32}, {"bwd_over_f32_gemm", bwd / gemm_f32},
                                  {"bf16_path", bf16_path}, {"bf16_fwd_ms", t16.fwd_s * 1e3}, {"bf16_bwd_ms", t16.bwd_s * 1e3},
                                  {"bf16_fwd_gflops", fwd16}, {"bf16_bwd_gflops", bwd16},
                                  {"bf16_fwd_over_bf16_gemm", fwd16 / gemm_bf16}, {"bf16_bwd_over_bf16_gemm", bwd16 / gemm_bf16},
                                  {"bf16_fwd_speedup", t_fwd / t16.fwd_s}, {"bf16_bwd_speedup", t_bwd / t16.bwd_s}}
                       .dump()
                << std::endl;
    } else {
      std::printf("workload: %lld samples x %lld context, %lld anchors/sample, B=%lld, n_q=%lld n_kv=%lld d_h=%lld\n",
                  static_cast<long long>(samples), static_cast<long long>(context), static_cast<long long>(anchors),
                  static_cast<long long>(block), static_cast<long long>(n_q), static_cast<long long>(n_kv),
                  static_cast<long long>(d_h));
      std::printf("  Q=%lld, L_k=%lld, visible pairs/head=%lld (density %.3f), threads=%d, median of %d\n",
                  static_cast<long long>(Q), static_cast<long long>(Lk), static_cast<long long>(mask.visible_pairs()),
                  density, omp_get_max_threads(), reps);
      std::printf("  kernels: %s\n", kernels.c_str());
      std::printf("  oneDNN matmul %lld^3   f32: %8.1f GFLOP/s   bf16: ", static_cast<long long>(gemm_n), gemm_f32);
      if (std::isnan(gemm_bf16)) std::printf("n/a (oneDNN has no bf16 matmul on this CPU)\n");
      else std::printf("%8.1f GFLOP/s\n", gemm_bf16);
      std::printf("  oneDNN sgemm on the kernel's tiles (%lld x 256 x %lld, all threads): %8.1f GFLOP/s\n",
                  static_cast<long long>(block * (n_q / n_kv)), static_cast<long long>(d_h), gemm_tile);
      std::printf("  attention forward : %8.1f ms %8.1f GFLOP/s = %5.1f %% of f32 GEMM (target: AVX2 >= 75 %%, AVX-512 >= 85 %%)\n",
                  t_fwd * 1e3, fwd, 100 * fwd / gemm_f32);
      std::printf("  attention backward: %8.1f ms %8.1f GFLOP/s = %5.1f %% of f32 GEMM (target: AVX2 >= 65 %%, AVX-512 >= 80 %%)\n",
                  t_bwd * 1e3, bwd, 100 * bwd / gemm_f32);
      if (run_bf16) {
        std::printf("  bf16 path: %s\n", bf16_path.c_str());
        std::printf("  bf16 forward      : %8.1f ms %8.1f GFLOP/s = %5.1f %% of bf16 GEMM (target >= 60 %%), %.2fx f32 kernel (target >= 1.6x)\n",
                    t16.fwd_s * 1e3, fwd16, 100 * fwd16 / gemm_bf16, t_fwd / t16.fwd_s);
        std::printf("  bf16 backward     : %8.1f ms %8.1f GFLOP/s = %5.1f %% of bf16 GEMM (target >= 50 %%), %.2fx f32 kernel (target >= 1.5x)\n",
                    t16.bwd_s * 1e3, bwd16, 100 * bwd16 / gemm_bf16, t_bwd / t16.bwd_s);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_attention: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
