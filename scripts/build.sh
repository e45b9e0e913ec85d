#!/usr/bin/env bash
# build.sh [run|all]: install the dependencies (if missing) and build the release preset.
#   run (command 1): only what the diffcp program needs, and only the program (build/release/src/diffcp);
#   all (command 2, the default): the tests, the benchmarks and the Python package too, and the
#     CUDA backend where nvcc is found.
set -euo pipefail
cd "$(dirname "$0")/.."
set_=${1:-all}
scripts/install_deps.sh "$set_"
if [ "$set_" = run ]; then
  # A build dir that command 2 configured keeps its targets: build the program in it.
  if [ -f build/release/CMakeCache.txt ] && grep -q '^DIFFCP_BUILD_TESTS:BOOL=ON' build/release/CMakeCache.txt; then
    cmake --preset release >/dev/null
  else
    cmake --preset release -DDIFFCP_BUILD_TESTS=OFF -DDIFFCP_BUILD_BENCH=OFF -DDIFFCP_BUILD_PYTHON=OFF >/dev/null
  fi
  cmake --build --preset release --target diffcp_cli
else
  # The CUDA backend (issue #55) is built wherever nvcc is found (PATH, or the toolkit's usual
  # place), so it cannot rot; its tests skip, saying why, on a machine without a GPU.
  nvcc=$(command -v nvcc || true)
  [ -n "$nvcc" ] || { [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc; } || true
  cuda=(-DDIFFCP_CUDA=OFF)
  [ -n "$nvcc" ] && cuda=(-DDIFFCP_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc")
  cmake --preset release -DDIFFCP_BUILD_TESTS=ON -DDIFFCP_BUILD_BENCH=ON -DDIFFCP_BUILD_PYTHON=ON "${cuda[@]}" >/dev/null
  cmake --build --preset release
fi
