#!/usr/bin/env bash
# Command 1: install what the diffcp program needs, build only it (release preset), run the main job on its embedded
# default (no downloads, no external data): one Split-KV attention layer on 2 MPI ranks checked
# against the fp64 reference, then `diffcp train` of the tiny DFlash drafter on its synthetic
# corpus across 2 ranks, ending with the final loss, the acceptance length tau and the checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
scripts/build.sh run
mpirun -np 2 build/release/src/diffcp attn --check
mpirun -np 2 build/release/src/diffcp train --out out/train --log out/train/metrics.jsonl
