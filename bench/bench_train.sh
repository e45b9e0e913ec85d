#!/usr/bin/env bash
# Drafter training throughput at P = 1 and P = 2 (one rank per core, same global batch), for the
# tiny default and the larger `small` preset, in f32 and bf16 mixed precision (DTYPES="f32 bf16"
# by default). The machine is noisy (VM steal time), so each configuration runs REPEAT times
# (default 5), P = 1 and P = 2 alternating, and the medians are compared: tokens/s (all tokens /
# busy time: the throughput), the P = 2 / P = 1 speed-up in it, the median step time, and the
# per-phase ms of the median-step run.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=${DIFFCP_BIN:-build/release/src/diffcp}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
run() {  # name, np, dtype, args...
  local name=$1 np=$2 dt=$3
  shift 3
  OMP_NUM_THREADS=1 mpirun -np "$np" --bind-to core "$bin" train --no-progress --eval-every 0 --dtype "$dt" "$@" |
    awk -v tag="$name $dt $np" '/median step/ {ms=$0; tok=$0} /ms per step:/ {ph=$0}
      END {sub(/.*median step /, "", ms); sub(/ ms.*/, "", ms); sub(/ tokens\/s.*/, "", tok); sub(/.* /, "", tok);
           sub(/.*ms per step: /, "", ph); print tag, ms, tok, ph}'
}
for dt in ${DTYPES:-f32 bf16}; do
  for rep in $(seq "${REPEAT:-5}"); do
    for np in 1 2; do run tiny "$np" "$dt" --steps 100 >>"$log"; done
    for np in 1 2; do run small "$np" "$dt" --preset small --context 8192 --anchors 4 --steps 6 >>"$log"; done
  done
done
python3 - "$log" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    name, dt, np, ms, tok, *phases = line.split()
    runs.setdefault((name, dt), {}).setdefault(int(np), []).append((float(ms), " ".join(phases), float(tok)))
for (name, dt), by_np in runs.items():
    med = {np: statistics.median(r[0] for r in rs) for np, rs in by_np.items()}
    for np in sorted(by_np):
        ms_all = sorted(r[0] for r in by_np[np])
        tok = statistics.median(r[2] for r in by_np[np])
        phases = min(by_np[np], key=lambda r: abs(r[0] - med[np]))[1]
        print(f"{name} {dt} P={np}: median step {med[np]:.1f} ms of {len(ms_all)} runs "
              f"(min {ms_all[0]:.1f}, max {ms_all[-1]:.1f}), {tok:.0f} tokens/s; phases of the median run: {phases}")
    if 1 in med and 2 in med:
        tok = {np: statistics.median(r[2] for r in by_np[np]) for np in (1, 2)}
        print(f"{name} {dt}: P = 2 / P = 1 speed-up {tok[2] / tok[1]:.2f}x in tokens/s "
              f"({med[1] / med[2]:.2f}x in median step time; steps differ in tokens), medians")
PY
