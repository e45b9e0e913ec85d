#!/usr/bin/env bash
# Command 2: install every dependency, build everything (release preset) and run the whole test suite via ctest.
# Extra arguments go to ctest (e.g. -R attention, -L mpi).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
scripts/build.sh all
ctest --preset release "$@"
