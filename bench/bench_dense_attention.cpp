// The DiT's dense attention forward (issue #54): one block of --tokens query rows over the same
// --tokens keys, --heads heads of --d-h (dit/exchange.cpp's mask at P = 1), timed on the CPU
// backend. Which kernel runs is the backend's choice (`kernels` in the output: bf16 fused on AMX
// tiles on a CPU with AMX, else f32 and bf16 fused on AVX-512 registers where the kernels can,
// else the tile path; DIFFCP_CPU_AMX=0 DIFFCP_CPU_FUSED=0 force the tile path), so
// bench_dit_cpu.sh fused runs it twice, interleaved. Medians of --reps timed calls after one warm-up.
#include <algorithm>
#include <chrono>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <omp.h>

#include "diffcp/attention/attention.hpp"
#include "diffcp/attention/mask.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/core/random.hpp"
#include "diffcp/ops/backend.hpp"

namespace {

template <typename T>
std::vector<T> rows_of(const std::vector<float>& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    std::vector<T> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) out[i].bits = diffcp::f32_to_bf16(x[i]);
    return out;
  }
}

template <typename T>
double median_ms(std::int64_t n, std::int64_t heads, std::int64_t d, int reps) {
  using namespace diffcp;
  const BlockMask mask(n, n, {{0, 0, n}}, {{0, n, -1}});
  const std::size_t size = static_cast<std::size_t>(n * heads * d);
  const auto q = rows_of<T>(random_normal(size, 1)), k = rows_of<T>(random_normal(size, 2)),
             v = rows_of<T>(random_normal(size, 3));
  std::vector<T> o(size);
  std::vector<float> lse(static_cast<std::size_t>(n * heads));
  std::vector<double> ms;
  for (int r = 0; r <= reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    attention_forward(mask, head_rows(q, n, heads, d), head_rows(k, n, heads, d), head_rows(v, n, heads, d),
                      head_rows(o, n, heads, d), lse);
    if (r > 0) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"the DiT's dense attention forward on the CPU backend"};
  std::int64_t tokens = 1088, heads = 24, d_h = 32;
  int reps = 10;
  std::string dtype = "bf16";
  app.add_option("--tokens", tokens, "query rows = keys (the small preset: 1024 image + 64 text)")->capture_default_str();
  app.add_option("--heads", heads)->capture_default_str();
  app.add_option("--d-h", d_h)->capture_default_str();
  app.add_option("--reps", reps, "timed calls (median reported)")->capture_default_str()->check(CLI::Range(1, 1000));
  app.add_option("--dtype", dtype, "f32 | bf16")->check(CLI::IsMember({"f32", "bf16"}))->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    const double ms = dtype == "bf16" ? median_ms<diffcp::bf16_t>(tokens, heads, d_h, reps)
                                      : median_ms<float>(tokens, heads, d_h, reps);
    const double flops = 4.0 * static_cast<double>(tokens) * static_cast<double>(tokens) * static_cast<double>(d_h * heads);
    std::cout << nlohmann::json{{"kernels", diffcp::cpu_backend().describe(dtype == "bf16" ? diffcp::DType::bf16
                                                                                           : diffcp::DType::f32)},
                                {"threads", omp_get_max_threads()}, {"tokens", tokens}, {"heads", heads}, {"d_h", d_h},
                                {"dtype", dtype}, {"median_ms", ms}, {"gflops", flops / ms / 1e6}}
              << "\n";
  } catch (const std::exception& e) {
    std::cerr << "bench_dense_attention: " << e.what() << "\n";
    return 1;
  }
}
