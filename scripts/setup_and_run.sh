#!/usr/bin/env bash
# Command 1: install dependencies, build (release preset), run the main job on its embedded
# default: `diffcp attn --check` on 2 MPI ranks (no downloads, no external data).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
scripts/install_deps.sh
cmake --preset release >/dev/null
cmake --build --preset release
mpirun -np 2 build/release/src/diffcp attn --check
