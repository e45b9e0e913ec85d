#!/usr/bin/env bash
# The CP-method studies of issue #5 (SPEC A.5), scaled down to this 2-core machine, all with
# `diffcp bench cp --methods all` (one row per method: splitkv, ulysses, ring, ringx, lvxattn).
#
#   qs      Q:S ablation as in the paper: Q = 4096 packed query rows, 8k context per sample,
#           (queries/sample, samples) = (2k, 2) (1k, 4) (512, 8) (256, 16) -> S/Q = 4, 8, 16, 32.
#           P = 2, one rank per core: real timings. P = 8 oversubscribed: volumes only.
#   weak    4 samples x 512 queries, context per sample 4k * P (S/P fixed): P = 1, 2 real; P = 4, 8
#           volumes only.
#   strong  4 samples x 512 queries x 8k context: P = 1, 2 real; P = 4, 8 volumes only.
#
# "Real" runs: OMP_NUM_THREADS=1 mpirun -np P --bind-to core, --reps $REPS (default 5) after one
# warm-up; before each, the script waits (up to WAIT_TRIES x 60 s, default 5) for the 1-minute load
# to drop to LOAD_MAX (default 1.5) and records the load it ran under. "Volumes only": 8 ranks share 2 cores, so times are meaningless
# and only the bytes (and per-rank peak memory) count: --warmup 0 --reps 1.
# Layer: H = 1024, n_q = 16, n_kv = 4, d_h = 64, f32 (Ulysses cannot run P = 8: P must divide n_kv).
# Layouts: splitkv lpt, ring zigzag, the others contiguous (bench cp's defaults).
#
# Writes bench/cp_qs.csv, bench/cp_weak.csv, bench/cp_strong.csv (bench cp's columns plus study,
# point, timed, load1; rows of points not rerun are kept; CSV_SUFFIX=_zen3 writes bench/cp_qs_zen3.csv
# etc. instead, for another machine's rows); plot with bench/plot_cp.py. Usage: bench/bench_cp_studies.sh [qs|weak|strong]...
# (default all three); DIFFCP_BIN overrides the binary (default build/release/src/diffcp).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=${DIFFCP_BIN:-build/release/src/diffcp}
REPS=${REPS:-5}
shape=(--hidden 1024 --n-q 16 --n-kv 4 --d-h 64)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
studies=("$@")
[ ${#studies[@]} -eq 0 ] && studies=(qs weak strong)

LOAD_MAX=${LOAD_MAX:-1.5}
load1() { cut -d' ' -f1 /proc/loadavg; }
wait_quiet() {
  local l
  for _ in $(seq "${WAIT_TRIES:-5}"); do
    l=$(load1)
    awk -v l="$l" -v m="$LOAD_MAX" 'BEGIN { exit !(l <= m) }' && break
    echo "  load $l > $LOAD_MAX, waiting 60 s" >&2
    sleep 60
  done
  load1
}

# run STUDY POINT NP TIMED bench-cp-args...
run() {
  local study=$1 point=$2 np=$3 timed=$4 load=""
  shift 4
  local csv="$tmp/$study-$point-np$np.csv"
  if [ "$timed" = 1 ]; then
    load=$(wait_quiet)
    echo "$study $point P=$np (timed, load $load)" >&2
    OMP_NUM_THREADS=1 mpirun -np "$np" --bind-to core "$bin" bench cp --methods all "${shape[@]}" --reps "$REPS" \
      --csv "$csv" "$@" >&2
  else
    echo "$study $point P=$np (volumes only, oversubscribed)" >&2
    OMP_NUM_THREADS=1 mpirun -np "$np" --oversubscribe "$bin" bench cp --methods all "${shape[@]}" --warmup 0 --reps 1 \
      --csv "$csv" "$@" >&2
  fi
  echo "$study,$point,$timed,$load,$csv" >> "$tmp/index"
}

# Timed runs first, volume runs after, so an oversubscribed run's load does not delay a timed one.
# QS_P (default "2 8") and QS_POINTS (default "4 8 16 32") pick the Q:S ablation's rank counts and
# S/Q points, e.g. QS_P=2 QS_POINTS="16 32" to redo only those timings.
passes="1 0"
[ "${TIMED_ONLY:-0}" = 1 ] && passes=1  # TIMED_ONLY=1: redo the timed runs only (volumes are deterministic)
for pass in $passes; do
  for study in "${studies[@]}"; do
    case $study in
      qs)
        for np in ${QS_P:-2 8}; do
          timed=$([ "$np" -le 2 ] && echo 1 || echo 0)
          [ "$timed" = "$pass" ] || continue
          for sq in ${QS_POINTS:-4 8 16 32}; do  # S/Q; Q = 4096 = samples * queries, 8k context each
            samples=$((sq / 2))
            run qs "$sq" "$np" "$timed" --samples "$samples" --queries $((4096 / samples)) --context 8k
          done
        done ;;
      weak|strong)
        for np in 1 2 4 8; do
          timed=$([ "$np" -le 2 ] && echo 1 || echo 0)
          [ "$timed" = "$pass" ] || continue
          ctx=8k
          [ "$study" = weak ] && ctx=$((4 * np))k
          run "$study" "$np" "$np" "$timed" --samples 4 --queries 512 --context "$ctx"
        done ;;
      *) echo "unknown study '$study' (expected qs, weak, strong)" >&2; exit 1 ;;
    esac
  done
done

python3 - "$tmp/index" "${CSV_SUFFIX:-}" <<'PY'
import csv, sys
by_study = {}
for line in open(sys.argv[1]):
    study, point, timed, load, path = line.strip().split(",")
    for row in csv.DictReader(open(path)):
        row.update(study=study, point=point, timed=timed, load1=load)
        by_study.setdefault(study, []).append(row)
for study, rows in by_study.items():
    out = f"bench/cp_{study}{sys.argv[2]}.csv"
    # Rows of (point, P) pairs this run did not redo are kept from the previous file.
    redone = {(r["point"], r["P"]) for r in rows}
    try:
        kept = [r for r in csv.DictReader(open(out)) if (r["point"], r["P"]) not in redone]
    except FileNotFoundError:
        kept = []
    rows = sorted(kept + rows, key=lambda r: (int(r["P"]), int(r["point"])))
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["study", "point", "timed", "load1"] + [k for k in rows[0] if k not in ("study", "point", "timed", "load1")])
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out} ({len(rows)} rows, {len(kept)} kept from before)")
PY
