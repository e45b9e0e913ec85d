#!/usr/bin/env bash
# scripts/gpu_check.sh prepare | run OUT   (issue #55; first part: the op harness on the GPU)
#
#   prepare  (here, on a build machine with nvcc): builds the CUDA backend's checks in build/release
#            (scripts/build.sh all turns DIFFCP_CUDA on where nvcc is found) and bundles into
#            gpu_check/ (ignored by git; carry it: ~45 MiB) the two programs and the Debian runtime
#            libraries they load that a bare device image may lack (oneDNN, libgomp, the OpenCL
#            loader). cuBLASLt is not bundled: the device's PyTorch venv brings it.
#   run OUT  (on the device machine, from the repository root): finds libcublasLt.so.13 (the
#            venv's nvidia wheels, or a CUDA toolkit), then runs the op harness on the "cuda"
#            backend against the CPU (test_backend_ops, and bench_backend_ops --perf for the
#            table); logs and the gtest XML go to OUT. Exit status: non-zero if a check failed.
# Rehearse `run` here: it finds this machine's toolkit and the harness skips, saying why (no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=gpu_check
case "${1:-}" in
  prepare)
    scripts/build.sh all >/dev/null
    grep -q '^DIFFCP_CUDA:BOOL=ON' build/release/CMakeCache.txt ||
      { echo "gpu_check: build/release has no CUDA backend (no nvcc found?)" >&2; exit 1; }
    rm -rf "$bundle" && mkdir -p "$bundle/lib"
    cp build/release/tests/test_backend_ops build/release/bench/bench_backend_ops "$bundle/"
    for l in libdnnl.so.2 libgomp.so.1 libOpenCL.so.1; do
      p=$(ldd "$bundle/test_backend_ops" | awk -v l="$l" '$1 == l {print $3}')
      [ -n "$p" ] || { echo "gpu_check: $l not found by ldd" >&2; exit 1; }
      cp -L "$p" "$bundle/lib/"
    done
    grep -qx '/gpu_check/' .gitignore || echo '/gpu_check/' >> .gitignore
    du -sh "$bundle" | awk '{print "gpu_check: prepared " $2 " in gpu_check/ (carry it)"}'
    ;;
  run)
    out=${2:?usage: gpu_check.sh run OUT}
    mkdir -p "$out"
    [ -x "$bundle/test_backend_ops" ] || { echo "gpu_check: no $bundle/: run 'scripts/gpu_check.sh prepare' first, and carry it" >&2; exit 1; }
    # libcublasLt.so.13: a python's nvidia-cublas wheel, else a toolkit's lib64.
    lt=""
    for py in python3 /opt/torch/.venv/bin/python3; do  # the device image: python3 holds PyTorch and its nvidia wheels
      command -v "$py" >/dev/null 2>&1 || continue
      lt=$("$py" -c 'import glob, os, nvidia
c = sorted(f for p in nvidia.__path__ for f in glob.glob(os.path.join(p, "*", "lib", "libcublasLt.so.13")))
print(c[0] if c else "")' 2>/dev/null || true)
      [ -n "$lt" ] && break
    done
    [ -n "$lt" ] || lt=$(ls /usr/local/cuda/lib64/libcublasLt.so.13 /usr/local/cuda*/lib64/libcublasLt.so.13 2>/dev/null | head -1 || true)
    [ -n "$lt" ] || { echo "gpu_check: libcublasLt.so.13 not found (no nvidia-cublas wheel, no toolkit)" | tee "$out/gpu_check.log"; exit 1; }
    export LD_LIBRARY_PATH="$(dirname "$lt"):$PWD/$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
    {
      echo "gpu_check: cuBLASLt $lt"
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
      rc=0
      "$bundle/test_backend_ops" --gtest_output="xml:$out/test_backend_ops.xml" || rc=1
      "$bundle/bench_backend_ops" --backend cuda --perf --reps 10 || rc=1
      echo "gpu_check: $([ $rc = 0 ] && echo passed || echo FAILED)"
      exit $rc
    } 2>&1 | tee "$out/gpu_check.log"
    exit "${PIPESTATUS[0]}"
    ;;
  *) sed -n '2,14p' "$0"; exit 2 ;;
esac
