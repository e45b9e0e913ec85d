#!/usr/bin/env bash
# Issue #54: what bounds the DiT step's f32 projections on this CPU. Three measurements, 2 threads
# (OMP_NUM_THREADS=2), printed as lines:
#   1. the FMA peak of the cores at 8 and 16 f32 lanes (12 independent FMA chains per thread);
#   2. oneDNN's sgemm and its fixed-shape matmul primitive (weights packed once) on the small
#      preset's projection shapes (M = 1088 tokens), natively and with ONEDNN_MAX_CPU_ISA=AVX2;
#   3. if Debian's OpenBLAS / BLIS are installed (not by this project: `apt-get install
#      libopenblas-pthread-dev libblis-pthread-dev`, removed after), their sgemm on the same shapes.
# Not part of CI. Usage: bench/bench_gemm_ceiling.sh
set -euo pipefail
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
cat >"$d/peak.cpp" <<'CPP'
#include <immintrin.h>
#include <omp.h>
#include <cstdio>
template <int W>
double peak(long iters) {
  const double t0 = omp_get_wtime();
  float sink = 0;
#pragma omp parallel reduction(+ : sink)
  {
    if constexpr (W == 8) {
      __m256 a[12], b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-6f);
      for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(1.f + i);
      for (long it = 0; it < iters; ++it)
        for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], b, c);
      for (int i = 0; i < 12; ++i) sink += _mm256_cvtss_f32(a[i]);
    } else {
      __m512 a[12], b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-6f);
      for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(1.f + i);
      for (long it = 0; it < iters; ++it)
        for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
      for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(a[i]);
    }
  }
  const double t = omp_get_wtime() - t0;
  if (sink == 42.f) std::printf(" ");
  return 2.0 * W * 12 * iters * omp_get_max_threads() / t / 1e9;
}
int main() {
  double p8 = 0, p16 = 0;
  for (int r = 0; r < 3; ++r) p8 = peak<8>(200000000) > p8 ? peak<8>(200000000) : p8;
  std::printf("fma peak, 8 lanes (AVX2): %.1f GFLOP/s\n", p8);
  if (__builtin_cpu_supports("avx512f")) {
    for (int r = 0; r < 3; ++r) p16 = peak<16>(200000000) > p16 ? peak<16>(200000000) : p16;
    std::printf("fma peak, 16 lanes (AVX-512): %.1f GFLOP/s\n", p16);
  }
}
CPP
cat >"$d/gemm.cpp" <<'CPP'
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
#include <dnnl.hpp>
#ifdef WITH_CBLAS
#include <cblas.h>
#endif
using namespace dnnl;
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  engine eng(engine::kind::cpu, 0);
  stream s(eng);
  struct Shape { long M, N, K; const char* what; } shapes[] = {
      {1088, 2304, 768, "double block qkv"}, {1088, 3072, 768, "MLP up"}, {1088, 768, 3072, "MLP down"},
      {1088, 5376, 768, "single block in"}, {1088, 768, 3840, "single block out"}};
  for (const Shape& sh : shapes) {
    std::vector<float> A(sh.M * sh.K, 0.5f), B(sh.K * sh.N, 0.25f), C(sh.M * sh.N);
    const auto best = [&](auto fn) {
      double t = 1e9;
      for (int r = 0; r < 9; ++r) {
        const double t0 = now();
        fn();
        t = std::min(t, now() - t0);
      }
      return 2.0 * sh.M * sh.N * sh.K / t / 1e9;
    };
    const double sg = best([&] { dnnl_sgemm('N', 'N', sh.M, sh.N, sh.K, 1.f, A.data(), sh.K, B.data(), sh.N, 0.f, C.data(), sh.N); });
    memory::desc a_md({sh.M, sh.K}, memory::data_type::f32, memory::format_tag::ab);
    memory::desc b_md({sh.K, sh.N}, memory::data_type::f32, memory::format_tag::ab);
    memory::desc c_md({sh.M, sh.N}, memory::data_type::f32, memory::format_tag::ab);
    const matmul::primitive_desc pd(matmul::desc(a_md, memory::desc({sh.K, sh.N}, memory::data_type::f32, memory::format_tag::any), c_md), eng);
    memory a(a_md, eng, A.data()), bu(b_md, eng, B.data()), c(c_md, eng, C.data()), b(pd.weights_desc(), eng);
    reorder(bu, b).execute(s, bu, b);
    matmul mm(pd);
    const double pk = best([&] {
      mm.execute(s, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
      s.wait();
    });
    std::printf("%-17s M %ld N %ld K %ld: oneDNN sgemm %.1f, matmul packed (%s) %.1f", sh.what, sh.M, sh.N, sh.K, sg,
                pd.impl_info_str(), pk);
#ifdef WITH_CBLAS
    std::printf(", %s %.1f", BLAS_NAME, best([&] {
                  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, sh.M, sh.N, sh.K, 1.f, A.data(), sh.K, B.data(), sh.N,
                              0.f, C.data(), sh.N);
                }));
#endif
    std::printf(" GFLOP/s\n");
  }
}
CPP
g++ -O3 -funroll-loops -mavx512f -mavx2 -mfma -fopenmp "$d/peak.cpp" -o "$d/peak"
g++ -O2 -std=c++17 "$d/gemm.cpp" -o "$d/gemm" -ldnnl
export OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 BLIS_NUM_THREADS=2
grep -m1 'model name' /proc/cpuinfo
"$d/peak"
echo "native:"; "$d/gemm"
echo "ONEDNN_MAX_CPU_ISA=AVX2:"; ONEDNN_MAX_CPU_ISA=AVX2 "$d/gemm"
for lib in openblas blis; do
  dir=/usr/lib/x86_64-linux-gnu/$lib-pthread inc=/usr/include/x86_64-linux-gnu/openblas-pthread
  [ $lib = blis ] && inc=/usr/include/blis
  [ -e "$dir/lib$lib.so" ] || { echo "$lib: not installed (skipped)"; continue; }
  g++ -O2 -std=c++17 -DWITH_CBLAS -DBLAS_NAME="\"$lib\"" -I"$inc" "$d/gemm.cpp" -o "$d/gemm_$lib" -L"$dir" -l$lib -ldnnl -Wl,-rpath,"$dir"
  echo "with $lib:"; "$d/gemm_$lib"
done
