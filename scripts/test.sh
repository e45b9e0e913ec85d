#!/usr/bin/env bash
# Command 2: install every dependency, build everything (release preset) and run the whole test suite via ctest.
# Extra arguments go to ctest: -L GROUP runs one group (every test has a label: unit, mpi, cli,
# python, device, golden, cuda, cpu_isa, bad_input, fuzz, cluster, install, and slow across them;
# tests/CMakeLists.txt says what each holds; -LE slow leaves the slowest out), -R REGEX by name
# (e.g. -R rendezvous; gtest cases are named after their program: -R '^test_dit\.'). Tests run one per core
# (DIFFCP_TEST_JOBS overrides): most are mpirun jobs that wait on each other's messages, and the
# suite was written and timed that way (about 10 min at 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
scripts/build.sh all
ctest --preset release -j "${DIFFCP_TEST_JOBS:-$(nproc)}" "$@"
