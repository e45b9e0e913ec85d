#!/usr/bin/env bash
# Issue #33: what the device-ready core (memory owned by the backend, glue as ops, collectives that
# stage device memory) costs on the CPU, against the commit before it: one layer step of every CP
# method at P = 2 (`diffcp bench cp`, the default workload, f32 and bf16), the drafter's training
# step (`tiny`, 30 steps, and `small`, 8 steps; P = 1 and 2; the median step and its phases) and
# one DiT step (P = 1, 256 px). Ranks: one per core
# (mpirun --bind-to core; this machine has 2). Interleaved REPEAT times (default 3); every run goes
# to CSV (default bench/device_core_ab.csv); prints the medians and new / old ratios.
# FOCUS=1: instead, the measures nearest to 1.0 again with more repetitions: every method's f32
# layer step (FOCUS_DTYPES="f32 bf16": and bf16) with 21 repetitions per run and the DiT step, 6
# interleaved rounds (CSV default bench/device_core_ab_focus.csv).
# DIT_ONLY=1: instead, the DiT step alone at P = 2 (256 px, 6 steps), Flat and cocodiff with every
# step after the first selective at r = 0.5 (--cache-schedule fixed --warmup 1: V-Major's choice
# runs in 5 of 6 steps), REPEAT (default 6) interleaved rounds (CSV default
# bench/device_core_ab_dit.csv). Issue #65 ran it for V-Major's device selection: OLD = 654ecee.
# Issue #51 (each method written once over typed views) runs it again with CSV=bench/seam_ab.csv:
# OLD = 780489b, NEW = the change, both built alike in git worktrees (release preset,
# -DDIFFCP_CUDA=OFF, target diffcp_cli, in worktrees).
# Usage: OLD=<diffcp of the previous commit> [NEW=<diffcp>] [FOCUS=1 | DIT_ONLY=1] [CSV=...] bench/bench_device_core_ab.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
new=${NEW:-build/release/src/diffcp}
old=${OLD:?OLD=<a diffcp binary of the previous commit>}
repeat=${REPEAT:-3}
out=$(mktemp)
tmp=$(mktemp)
trap 'rm -f "$out" "$tmp"' EXIT
cp_step() {  # tag, binary, dtype
  mpirun -np 2 --bind-to core "$2" bench cp --methods all --dtype "$3" --reps 5 --csv "$tmp" >/dev/null
  python3 - "$1" "$3" "$tmp" >>"$out" <<'PY'
import csv, sys
for r in csv.DictReader(open(sys.argv[3])):
    print(sys.argv[1], f"cp_{r['method']}_{sys.argv[2]}_step_ms", r["step_ms"])
PY
}
train() {  # tag, binary, np, preset, steps
  OMP_NUM_THREADS=1 mpirun -np "$3" --bind-to core "$2" train --no-progress --eval-every 0 --preset "$4" --steps "$5" |
    awk -v tag="$1" -v m="train_$4_np$3" '
      /median step/ {s = $0; sub(/.*median step /, "", s); sub(/ ms.*/, "", s); print tag, m "_step_ms", s}
      /ms per step:/ {s = $0; sub(/.*ms per step: /, "", s); n = split(s, f, " "); for (i = 1; i < n; i += 2) print tag, m "_" f[i] "_ms", f[i + 1]}' >>"$out"
}
dit() {  # tag, binary
  "$2" dit --resolution 256 --steps 6 --out "" --json |
    python3 -c "import json,sys; print('$1 dit_step_ms', json.load(sys.stdin)['step_ms'])" >>"$out"
}
focus_round() {  # tag, binary
  dit "$1" "$2"
  for dt in ${FOCUS_DTYPES:-f32}; do
    mpirun -np 2 --bind-to core "$2" bench cp --methods all --dtype "$dt" --reps 21 --csv "$tmp" >/dev/null
    python3 - "$1" "$dt" "$tmp" >>"$out" <<'PY'
import csv, sys
for r in csv.DictReader(open(sys.argv[3])):
    print(sys.argv[1], f"cp_{r['method']}_{sys.argv[2]}_reps21_step_ms", r["step_ms"])
PY
  done
}
dit_p2() {  # tag, binary
  for mode in flat cocodiff; do
    mpirun -np 2 --bind-to core "$2" dit --resolution 256 --steps 6 --mode $mode --cache-schedule fixed \
      --cache-ratio 0.5 --warmup 1 --out "" --json |
      python3 -c "import json,sys; print('$1 dit_p2_${mode}_step_ms', json.load(sys.stdin)['step_ms'])" >>"$out"
  done
}
if [[ -n "${DIT_ONLY:-}" ]]; then
  repeat=${REPEAT:-6}
  for ((r = 1; r <= repeat; r++)); do
    dit_p2 old "$old"
    dit_p2 new "$new"
    echo "round $r of $repeat done" >&2
  done
fi
if [[ -n "${FOCUS:-}" ]]; then
  repeat=${REPEAT:-6}
  for ((r = 1; r <= repeat; r++)); do
    focus_round old "$old"
    focus_round new "$new"
    echo "round $r of $repeat done" >&2
  done
fi
for ((r = 1; r <= (${FOCUS:-0} || ${DIT_ONLY:-0} ? 0 : repeat); r++)); do
  for dt in f32 bf16; do
    cp_step old "$old" $dt
    cp_step new "$new" $dt
  done
  for np in 1 2; do
    for ps in "tiny 30" "small 8"; do
      train old "$old" $np $ps
      train new "$new" $np $ps
    done
  done
  dit old "$old"
  dit new "$new"
  echo "round $r of $repeat done" >&2
done
csv=${CSV:-bench/device_core_ab${FOCUS:+_focus}${DIT_ONLY:+_dit}.csv}
{ echo "build,measure,ms"; tr ' ' ',' <"$out"; } >"$csv"
python3 - "$csv" <<'PY'
import collections, csv, statistics, sys
d = collections.defaultdict(lambda: collections.defaultdict(list))
for r in csv.DictReader(open(sys.argv[1])):
    d[r["measure"]][r["build"]].append(float(r["ms"]))
print("| measure | runs | old median ms | new median ms | new / old |")
print("|---|---|---|---|---|")
for what, b in d.items():
    o, n = statistics.median(b["old"]), statistics.median(b["new"])
    ratio = f"{n / o:.3f}" if o > 0 else "-"
    print(f"| {what} | {len(b['new'])} | {o:.2f} | {n:.2f} | {ratio} |")
PY
