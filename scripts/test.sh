#!/usr/bin/env bash
# Command 2: install every dependency, build everything (release preset) and run the whole test suite via ctest.
# Extra arguments go to ctest (e.g. -R attention, -L mpi). Tests run one per core
# (DIFFCP_TEST_JOBS overrides): most are mpirun jobs that wait on each other's messages, and the
# suite was written and timed that way (about 10 min at 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
scripts/build.sh all
ctest --preset release -j "${DIFFCP_TEST_JOBS:-$(nproc)}" "$@"
