// bench_gemm_blas.sh's probe: the f32 GEMM rate of oneDNN's sgemm (diffcp's f32 GEMM,
// src/cpu/gemm.cpp) or of one CBLAS library (dlopen'ed: OpenBLAS, BLIS, MKL, ...) on row-major
// C[M, N] = A[M, K] B[K, N] shapes, the median of REPS calls after a warm-up. One library per
// process: a second threading runtime in the same process (oneDNN's OpenMP threads spin after each
// call) would take the cores from the other's threads.
// Usage: gemm_blas REPS onednn|name=/path/to/libblas.so M,K,N [M,K,N ...]
// Prints CSV rows (no header): lib,M,K,N,median_ms,gflops
#define _GNU_SOURCE  // clock_gettime, dlopen
#include <dlfcn.h>
#include <oneapi/dnnl/dnnl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void (*cblas_sgemm_fn)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                               float*, int);
enum { kRowMajor = 101, kNoTrans = 111 };

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
static int by_value(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: gemm_blas REPS onednn|name=/path/to/libblas.so M,K,N [M,K,N ...]\n");
    return 2;
  }
  const int reps = atoi(argv[1]);
  if (reps < 1 || reps > 63) {
    fprintf(stderr, "gemm_blas: REPS = %s, expected 1..63\n", argv[1]);
    return 2;
  }
  const char* name = argv[2];
  cblas_sgemm_fn fn = NULL;
  if (strcmp(name, "onednn") != 0) {
    char* eq = strchr(argv[2], '=');
    if (!eq) {
      fprintf(stderr, "gemm_blas: bad library '%s' (expected onednn or name=/path/to/lib.so)\n", argv[2]);
      return 2;
    }
    *eq = '\0';
    void* h = dlopen(eq + 1, RTLD_NOW | RTLD_LOCAL);
    fn = h ? (cblas_sgemm_fn)dlsym(h, "cblas_sgemm") : NULL;
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
    float* A = malloc(sizeof(float) * M * K);
    float* B = malloc(sizeof(float) * K * N);
    float* C = malloc(sizeof(float) * M * N);
    if (!A || !B || !C) {
      fprintf(stderr, "gemm_blas: out of memory for %ld x %ld x %ld\n", M, K, N);
      return 1;
    }
    for (long i = 0; i < M * K; ++i) A[i] = (float)((i * 7919) % 1000) / 1000.f - 0.5f;
    for (long i = 0; i < K * N; ++i) B[i] = (float)((i * 104729) % 1000) / 1000.f - 0.5f;
    double t[64];
    for (int r = 0; r <= reps; ++r) {  // r = 0: the warm-up
      const double t0 = now();
      if (!fn) {
        if (dnnl_sgemm('N', 'N', M, N, K, 1.f, A, K, B, N, 0.f, C, N) != dnnl_success) return 1;
      } else {
        fn(kRowMajor, kNoTrans, kNoTrans, (int)M, (int)N, (int)K, 1.f, A, (int)K, B, (int)N, 0.f, C, (int)N);
      }
      if (r > 0) t[r - 1] = now() - t0;
    }
    qsort(t, reps, sizeof(double), by_value);
    const double med = reps % 2 ? t[reps / 2] : 0.5 * (t[reps / 2 - 1] + t[reps / 2]);
    printf("%s,%ld,%ld,%ld,%.3f,%.1f\n", name, M, K, N, med * 1e3, 2.0 * M * N * K / med * 1e-9);
    free(A), free(B), free(C);
  }
  return 0;
}
