#!/usr/bin/env bash
# Drafter training throughput at P = 1 and P = 2 (one rank per core, same global batch), for the
# tiny default and the larger `small` preset, in f32 and bf16 mixed precision (DTYPES="f32 bf16"
# by default). The machine is noisy (a host shared with other tenants), so each
# configuration runs REPEAT times (default 5), the runs of one repetition back to back, and the
# medians are compared: tokens/s (all tokens / busy time: the throughput), the P = 2 / P = 1
# speed-up in it, the median step time, and the per-phase ms of the median-step run.
#
# Each repetition also runs the host's own two-core ceiling: a "pair" of two independent P = 1
# runs of the same configuration at the same time, one pinned to each of the two cores (no
# communication, no synchronisation: what two replicas that never talk get). Its tokens/s summed
# over the two, divided by P = 1's, is the best any P = 2 split can reach on this host in that
# hour (two cores share the L3, the memory bandwidth and the host's other tenants); the table
# reports the P = 2 speed-up against it (parallel efficiency = P = 2 / pair). Writes every run to
# bench/train_throughput.csv (DIFFCP_TRAIN_CSV): config, dtype, P (or pair), step ms, tokens/s.
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
# The first two CPUs this script may use: the pair's cores (as --bind-to core picks for P = 2).
read -r cpu0 cpu1 < <(python3 -c 'import os; c = sorted(os.sched_getaffinity(0)); print(*c[:2]) if len(c) >= 2 else print()')
[[ -n "${cpu1:-}" ]] || { echo "bench_train.sh: needs two CPUs (P = 2 and the pair)" >&2; exit 1; }
pair() {  # name, dtype, args...: two P = 1 runs at once, one per core; one line, tokens/s summed
  local name=$1 dt=$2 a b
  shift 2
  a=$(mktemp) b=$(mktemp)
  OMP_NUM_THREADS=1 taskset -c "$cpu0" mpirun -np 1 --bind-to none "$bin" train --no-progress --eval-every 0 --dtype "$dt" "$@" >"$a" &
  OMP_NUM_THREADS=1 taskset -c "$cpu1" mpirun -np 1 --bind-to none "$bin" train --no-progress --eval-every 0 --dtype "$dt" "$@" >"$b"
  wait $!
  cat "$a" "$b" | awk -v tag="$name $dt pair" '/median step/ {s = $0; sub(/.*median step /, "", s); sub(/ ms.*/, "", s);
      t = $0; sub(/ tokens\/s.*/, "", t); sub(/.* /, "", t); ms += s / 2; tok += t; n++}
    END {if (n != 2) exit 1; print tag, ms, tok}'
  rm -f "$a" "$b"
}
for dt in ${DTYPES:-f32 bf16}; do
  for rep in $(seq "${REPEAT:-5}"); do
    for np in 1 2; do run tiny "$np" "$dt" --steps 100 >>"$log"; done
    pair tiny "$dt" --steps 100 >>"$log"
    for np in 1 2; do run small "$np" "$dt" --preset small --context 8192 --anchors 4 --steps 6 >>"$log"; done
    pair small "$dt" --preset small --context 8192 --anchors 4 --steps 6 >>"$log"
  done
done
{ echo "config,dtype,P,median_step_ms,tokens_per_s"; awk '{print $1 "," $2 "," $3 "," $4 "," $5}' "$log"; } > "${DIFFCP_TRAIN_CSV:-bench/train_throughput.csv}"
python3 - "$log" <<'PY'
import statistics, sys
runs, pairs = {}, {}
for line in open(sys.argv[1]):
    name, dt, np, ms, tok, *phases = line.split()
    if np == "pair":
        pairs.setdefault((name, dt), []).append(float(tok))
        continue
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
        if (name, dt) in pairs:
            ceil = statistics.median(pairs[(name, dt)])
            print(f"{name} {dt}: two independent P = 1 runs at once (one per core) {ceil:.0f} tokens/s together: "
                  f"the host's two-core ceiling {ceil / tok[1]:.2f}x P = 1; P = 2 reaches {tok[2] / ceil:.0%} of it, medians")
PY
