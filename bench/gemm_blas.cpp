// bench_gemm_blas.sh's probe: the f32 GEMM rate of oneDNN's sgemm (`onednn`: diffcp's f32 GEMM,
// src/cpu/gemm.cpp), of oneDNN's f32 matmul primitive with B packed once into the layout it asks
// for (`onednn_packed`: what diffcp's bf16 projections do, CpuBackend::dense_linear), or of one
// CBLAS library (dlopen'ed: OpenBLAS, BLIS, MKL, ...) on row-major C[M, N] = A[M, K] B[K, N]
// shapes, the median of REPS calls after a warm-up. One library per process: a second threading
// runtime in the same process (oneDNN's OpenMP threads spin after each call) would take the cores
// from the other's threads.
// Usage: gemm_blas REPS onednn|onednn_packed|name=/path/to/libblas.so M,K,N [M,K,N ...]
// Prints CSV rows (no header): lib,M,K,N,median_ms,gflops
#include <dlfcn.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <vector>

typedef void (*cblas_sgemm_fn)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                               float*, int);
enum { kRowMajor = 101, kNoTrans = 111 };

static double now() {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: gemm_blas REPS onednn|onednn_packed|name=/path/to/libblas.so M,K,N [M,K,N ...]\n");
    return 2;
  }
  const int reps = atoi(argv[1]);
  if (reps < 1 || reps > 63) {
    fprintf(stderr, "gemm_blas: REPS = %s, expected 1..63\n", argv[1]);
    return 2;
  }
  const char* name = argv[2];
  cblas_sgemm_fn fn = nullptr;
  const bool packed = strcmp(name, "onednn_packed") == 0;
  if (strcmp(name, "onednn") != 0 && !packed) {
    char* eq = strchr(argv[2], '=');
    if (!eq) {
      fprintf(stderr, "gemm_blas: bad library '%s' (expected onednn or name=/path/to/lib.so)\n", argv[2]);
      return 2;
    }
    *eq = '\0';
    void* h = dlopen(eq + 1, RTLD_NOW | RTLD_LOCAL);
    fn = h ? reinterpret_cast<cblas_sgemm_fn>(dlsym(h, "cblas_sgemm")) : nullptr;
    if (!fn) {
      fprintf(stderr, "gemm_blas: %s: no cblas_sgemm (%s)\n", eq + 1, dlerror());
      return 1;
    }
  }
  for (int a = 3; a < argc; ++a) {
    long M, K, N;
    if (sscanf(argv[a], "%ld,%ld,%ld", &M, &K, &N) != 3 || M < 1 || K < 1 || N < 1) {
      fprintf(stderr, "gemm_blas: bad shape '%s' (expected M,K,N >= 1)\n", argv[a]);
      return 2;
    }
    std::vector<float> A(M * K), B(K * N), C(M * N);
    for (long i = 0; i < M * K; ++i) A[i] = static_cast<float>((i * 7919) % 1000) / 1000.f - 0.5f;
    for (long i = 0; i < K * N; ++i) B[i] = static_cast<float>((i * 104729) % 1000) / 1000.f - 0.5f;
    // onednn_packed: one primitive for the shape, B reordered once into its layout (not timed).
    using tag = dnnl::memory::format_tag;
    const dnnl::engine eng(dnnl::engine::kind::cpu, 0);
    dnnl::stream strm(eng);
    const dnnl::memory::desc ad({M, K}, dnnl::memory::data_type::f32, tag::ab);
    const dnnl::memory::desc cd({M, N}, dnnl::memory::data_type::f32, tag::ab);
    const dnnl::memory::desc bd({K, N}, dnnl::memory::data_type::f32, tag::any);
    dnnl::matmul::primitive_desc pd;
    dnnl::memory am, bm, cm;
    dnnl::matmul mm;
    if (packed) {
      pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(ad, bd, cd), eng);
      mm = dnnl::matmul(pd);
      am = dnnl::memory(ad, eng, A.data());
      cm = dnnl::memory(cd, eng, C.data());
      bm = dnnl::memory(pd.weights_desc(), eng);
      dnnl::memory plain({{K, N}, dnnl::memory::data_type::f32, tag::ab}, eng, B.data());
      dnnl::reorder(plain, bm).execute(strm, plain, bm);
      strm.wait();
    }
    std::vector<double> t;
    for (int r = 0; r <= reps; ++r) {  // r = 0: the warm-up
      const double t0 = now();
      if (packed) {
        mm.execute(strm, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
        strm.wait();
      } else if (!fn) {
        if (dnnl_sgemm('N', 'N', M, N, K, 1.f, A.data(), K, B.data(), N, 0.f, C.data(), N) != dnnl_success) return 1;
      } else {
        fn(kRowMajor, kNoTrans, kNoTrans, static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), 1.f, A.data(),
           static_cast<int>(K), B.data(), static_cast<int>(N), 0.f, C.data(), static_cast<int>(N));
      }
      if (r > 0) t.push_back(now() - t0);
    }
    std::sort(t.begin(), t.end());
    const double med = reps % 2 ? t[reps / 2] : 0.5 * (t[reps / 2 - 1] + t[reps / 2]);
    const std::string lib = packed ? std::string(name) + " (" + pd.impl_info_str() + ")" : name;
    printf("%s,%ld,%ld,%ld,%.3f,%.1f\n", lib.c_str(), M, K, N, med * 1e3, 2.0 * M * N * K / med * 1e-9);
  }
  return 0;
}
