#!/usr/bin/env bash
# Command 2: install dependencies, build (release preset) and run the whole test suite via ctest.
# Extra arguments go to ctest (e.g. -R attention, -L mpi).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
scripts/build.sh
ctest --preset release "$@"
