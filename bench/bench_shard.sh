#!/usr/bin/env bash
# Memory of the real drafter shapes under --shard (drafter/sharded_state.hpp): peak RSS per rank,
# the model state and LM head each rank holds, and the per-phase time of one step, for
#   1. qwen3.5-35b-a3b, P = 1, 2 (timed; one rank per core) and 4, 8 (oversubscribed: memory
#      only) at 8k context, --shard none vs full;
#   2. qwen3.5-35b-a3b at P = 2 with 32k context per micro-batch (the issue's goal).
# --anchors 64 keeps a step within minutes on 2 cores (the recipe's 512 anchors = 8192 query rows
# per sample: ~9 minutes a step here; the memory of the state does not depend on it).
# Output: bench/shard_memory.csv. Takes ~25 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=${DIFFCP_BIN:-build/release/src/diffcp}
out=bench/shard_memory.csv
echo "preset,P,context,anchors,shard,recompute,peak_rss_mib_per_rank,state_mib_per_rank,lm_head_mib_per_rank,step_ms,phases" > "$out"
run() {  # preset np context anchors shard
  local preset=$1 np=$2 ctx=$3 anchors=$4 shard=$5 log
  local bind=(--bind-to core)
  [ "$np" -gt 2 ] && bind=(--oversubscribe --bind-to none)
  log=$(OMP_NUM_THREADS=1 timeout 1800 mpirun -np "$np" "${bind[@]}" "$bin" train --no-progress --preset "$preset" \
        --context "$ctx" --anchors "$anchors" --accum 1 --steps 1 --shard "$shard" --heldout 0 2>&1) || {
    echo "$preset,$np,$ctx,$anchors,$shard,,failed (out of memory?),,,," | tee -a "$out"; echo "$log" | tail -3; return 0; }
  local rss step state lm rec phases
  rss=$(grep -o 'peak RSS [0-9]*' <<<"$log" | grep -o '[0-9]*$')
  step=$(grep -o 'median step [0-9.]*' <<<"$log" | grep -o '[0-9.]*$')
  state=$(grep -o 'model state [0-9]*' <<<"$log" | grep -o '[0-9]*$')
  lm=$(grep -o 'LM head [0-9]*' <<<"$log" | grep -o '[0-9]*$')
  rec=$(grep -q 'activations recomputed' <<<"$log" && echo on || echo off)
  phases=$(grep -o 'ms per step:.*' <<<"$log" | sed 's/ms per step: //')
  echo "$preset,$np,$ctx,$anchors,$shard,$rec,$rss,$state,$lm,$step,$phases" | tee -a "$out"
}
run qwen3.5-35b-a3b 2 32768 64 full
run qwen3.5-35b-a3b 2 8192 64 full
run qwen3.5-35b-a3b 1 8192 64 none
run qwen3.5-35b-a3b 4 8192 64 full
run qwen3.5-35b-a3b 8 8192 64 full
run qwen3.5-35b-a3b 2 8192 64 none
