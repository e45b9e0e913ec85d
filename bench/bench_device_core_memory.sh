#!/usr/bin/env bash
# Issue #33: peak RSS of the device-ready core against the commit before it, on the runs the issue
# names: `train --preset qwen3.5-35b-a3b` at P = 2 with 32k context per micro-batch (--shard full,
# --anchors 64, one optimizer step: as bench/bench_shard.sh) and the default `dit` run at P = 2
# (every option at the CLI's default). Peak RSS per rank: the trainer's own report (getrusage, max
# over ranks) and GNU time's maximum resident set of each dit rank (the larger of the two). Ranks one per core
# (mpirun --bind-to core), OMP_NUM_THREADS=1 for train. Appends to bench/device_core_memory.csv.
# Usage: bench/bench_device_core_memory.sh TAG DIFFCP_BINARY   (e.g. old <worktree>/build/release/src/diffcp)
# Takes ~12 minutes per binary on 2 cores (the 32k step is ~5 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
tag=${1:?TAG}
bin=${2:?DIFFCP_BINARY}
csv=${CSV:-bench/device_core_memory.csv}
[ -f "$csv" ] || echo "build,run,peak_rss_mib_per_rank,step_ms" >"$csv"
log=$(OMP_NUM_THREADS=1 timeout 1800 mpirun -np 2 --bind-to core "$bin" train --no-progress --preset qwen3.5-35b-a3b \
  --context 32768 --anchors 64 --accum 1 --steps 1 --shard full --heldout 0 2>&1)
rss=$(grep -o 'peak RSS [0-9]*' <<<"$log" | grep -o '[0-9]*$')
step=$(grep -o 'median step [0-9.]*' <<<"$log" | grep -o '[0-9.]*$')
echo "$tag,train qwen3.5-35b-a3b P=2 32k full,$rss,$step" | tee -a "$csv"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mpirun -np 2 --bind-to core /usr/bin/time -f "%M" -o "$tmp/rss.%q{OMPI_COMM_WORLD_RANK}" "$bin" dit --out "" --json \
  >"$tmp/dit.json"
rss=$(cat "$tmp"/rss.* | sort -n | tail -1)
step=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['step_ms'])" "$tmp/dit.json")
echo "$tag,dit default P=2,$((rss / 1024)),$step" | tee -a "$csv"
