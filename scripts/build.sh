#!/usr/bin/env bash
# build.sh [run|all]: install the dependencies (if missing) and build the release preset.
#   run (command 1): only what the diffcp program needs, and only the program (build/release/src/diffcp);
#   all (command 2, the default): the tests, the benchmarks and the Python package too.
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
  cmake --preset release -DDIFFCP_BUILD_TESTS=ON -DDIFFCP_BUILD_BENCH=ON -DDIFFCP_BUILD_PYTHON=ON >/dev/null
  cmake --build --preset release
fi
