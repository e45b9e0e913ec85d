#!/usr/bin/env bash
# Issue #54: is diffcp's f32 GEMM (oneDNN's sgemm) the fastest f32 GEMM at hand for the DiT's
# projection shapes? Compiles bench/gemm_blas.cpp against Debian's oneDNN and runs it: oneDNN's
# sgemm, oneDNN's f32 matmul with the weights packed once (onednn_packed), and the CBLAS libraries
# named in LIBS (dlopen'ed; install them yourself, e.g. Debian's libopenblas0 and
# libblis4: this script installs nothing and is not part of CI), 2 threads, on the small DiT's
# shapes (M = 1088 / 1024 rows, hidden 768: q|k|v, the fused single-block linear1, linear2, the
# MLP), one process per library and round (ROUNDS, interleaved; 5 calls each), the median of the
# rounds. ISA=avx2 caps each at AVX2 (oneDNN: DNNL_MAX_CPU_ISA=AVX2;
# OpenBLAS: OPENBLAS_CORETYPE=Haswell; BLIS picks its AVX2 zen kernels on AMD by itself).
#
# Usage: LIBS="openblas=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 blis=/usr/lib/x86_64-linux-gnu/libblis.so.4" \
#        [ISA=avx2] [ROUNDS=5] [OUT=bench/gemm_blas_avx2.csv] bench/bench_gemm_blas.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(mktemp -d)/gemm_blas
trap 'rm -rf "$(dirname "$bin")"' EXIT
g++ -O2 -std=c++17 bench/gemm_blas.cpp -o "$bin" -ldnnl -ldl
if [[ ${ISA:-} == avx2 ]]; then export DNNL_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell; fi
export OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 BLIS_NUM_THREADS=2
shapes="1088,768,2304 1088,768,5376 1088,3840,768 1024,768,3072 1024,3072,768"
out=${OUT:-$(dirname "$bin")/gemm_blas.csv}
echo "round,lib,M,K,N,median_ms,gflops" >"$out"
for ((r = 1; r <= ${ROUNDS:-5}; r++)); do
  # shellcheck disable=SC2086
  for lib in onednn onednn_packed ${LIBS:-}; do "$bin" 5 "$lib" $shapes | sed "s/^/$r,/" >>"$out"; done
done
python3 - "$out" <<'PY'
import collections, csv, statistics, sys
g = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[1])):
    g[(r["M"], r["K"], r["N"], r["lib"])].append(float(r["gflops"]))
print("| M, K, N | " + " | ".join(sorted({k[3] for k in g}, key=lambda s: (s != "onednn", s))) + " |  (GFLOP/s, medians)")
for shape in sorted({k[:3] for k in g}, key=lambda s: (-int(s[0]), int(s[1]))):
    libs = sorted({k[3] for k in g if k[:3] == shape}, key=lambda s: (s != "onednn", s))
    print(f"| {', '.join(shape)} | " + " | ".join(f"{statistics.median(g[shape + (l,)]):.1f}" for l in libs) + " |")
PY
