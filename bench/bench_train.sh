#!/usr/bin/env bash
# Drafter training throughput at P = 1 and P = 2 (one rank per core, same global batch): median
# step time, tokens/s and peak RSS per rank, for the tiny default and the larger `small` preset,
# in f32 and bf16 mixed precision (DTYPES="f32 bf16" by default).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=${DIFFCP_BIN:-build/release/src/diffcp}
run() {  # name, np, dtype, args...
  local name=$1 np=$2 dt=$3
  shift 3
  OMP_NUM_THREADS=1 mpirun -np "$np" --bind-to core "$bin" train --no-progress --eval-every 0 --dtype "$dt" "$@" |
    grep "median step" | sed "s/^diffcp train:/$name $dt P=$np:/"
}
for dt in ${DTYPES:-f32 bf16}; do
  for np in 1 2; do run tiny "$np" "$dt" --steps 100; done
  for np in 1 2; do run small "$np" "$dt" --preset small --context 8192 --anchors 4 --steps 6; done
done
