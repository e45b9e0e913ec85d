#!/usr/bin/env bash
# CI's part outside the clean room: the CUDA build, which the clean room's bare Debian root cannot
# do (it has no CUDA toolkit; this machine has one). Builds, with the CUDA backend and the NCCL
# communicator (release preset, build/release), every target whose code differs in a CUDA build —
# the library, the diffcp program, the op harness, the device and guard tests, the device
# benchmarks — and runs the tests labelled `cuda` (the host-side plan tests run; the NCCL tests
# skip, saying why, without a GPU). The whole suite runs once, in the clean room
# (scripts/check_fresh_machine.sh, .ci/run). Without nvcc it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=$(command -v nvcc || true)
[ -n "$nvcc" ] || { [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc; } || true
if [ -z "$nvcc" ]; then
  echo "cuda_build_check: no nvcc on this machine: the CUDA build is not checked here"
  exit 0
fi
source scripts/env.sh
scripts/install_deps.sh all
t0=$SECONDS
cmake --preset release -DDIFFCP_BUILD_TESTS=ON -DDIFFCP_BUILD_BENCH=ON -DDIFFCP_BUILD_PYTHON=OFF -DDIFFCP_CUDA=ON \
  -DCMAKE_CUDA_COMPILER="$nvcc" >/dev/null
cmake --build --preset release --target diffcp_cli test_cuda_plan test_nccl_comm test_backend_ops test_cp_guard \
  test_dit_guard test_drafter_guard bench_backend_ops bench_device_attention
echo "cuda_build_check: CUDA build in $((SECONDS - t0)) s"
ctest --preset release -L cuda
echo "cuda_build_check: the CUDA build and its cuda-labelled tests passed"
