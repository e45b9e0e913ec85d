#!/usr/bin/env bash
# `diffcp sim` against real runs (issue #12): calibrate this machine, predict, run, compare.
# Every point: `diffcp sim calibrate` measures the compute rates and the links the ranks really
# use (shared memory, or the emulated cluster's shaped links), then `diffcp bench cp --methods
# all` runs the layer and `diffcp sim cp` predicts it from the calibrated profile alone.
#   shm      P = 2 on shared memory (one rank per core)
#   2x1_G    2 emulated nodes x 1 rank, inter-node link G Gbit/s (G in $RATES; one rank per core)
#   2x2      2 nodes x 2 ranks (4 ranks on 2 cores: OVERSUBSCRIBED; calibrate measures compute on all
#            4 ranks at once, so the profile's rates already carry the sharing; sim cp --cores 2: a
#            rank that ends a step early yields its core)
#   dit_*    the four DiT modes on 2 x 2 (`diffcp sim dit` vs `diffcp dit`), when sim dit exists
# Every point runs ROUNDS times (calibrate, run, predict: the host's slow spells move a single
# calibration or run by 5-60 %); the table compares the median measured with the median predicted
# time per method and gives the measured spread over the rounds ((max - min) / median).
# Writes bench/sim_validation.csv (point, method, measured and predicted fwd/bwd/step ms, error).
# Usage: [ROUNDS=3] [REPS=3] bench/bench_sim_validate.sh   (needs root for the emulated cluster and
# a release build)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=${DIFFCP_BIN:-build/release/src/diffcp}
emu=scripts/emucluster.sh
REPS=${REPS:-3}
ROUNDS=${ROUNDS:-3}
DIT_STEPS=${DIT_STEPS:-8}
RATES=${RATES:-"1 4 16"}
work=(--samples 2 --context 4k --queries 256 --hidden 1024 --n-q 16 --n-kv 4 --d-h 64)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMP_NUM_THREADS=1
tmp=$(mktemp -d)
cluster=""
cleanup() { [ -z "$cluster" ] || "$emu" down --name "$cluster" >/dev/null 2>&1 || true; rm -rf "$tmp"; }
trap cleanup EXIT
out=bench/sim_validation.csv
echo "point,method,P,ranks_per_node,oversubscribed,measured_fwd_ms,measured_bwd_ms,measured_step_ms,predicted_fwd_ms,predicted_bwd_ms,predicted_step_ms,step_error_pct,measured_bytes,predicted_bytes,rounds,measured_step_spread_pct" >"$out"

# compare POINT OVERSUB PREFIX: PREFIX.<round>.meas.json and PREFIX.<round>.pred.json of every round;
# medians over the rounds per method and field. Bytes must agree in every round.
compare() {
  python3 - "$@" "$ROUNDS" >>"$out" <<'PY'
import json, statistics, sys
point, over, prefix, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
med = statistics.median
meas, pred = {}, {}
for i in range(1, rounds + 1):
    for r in json.load(open(f"{prefix}.{i}.meas.json")):
        if r.get("supported", True): meas.setdefault(r["method"], []).append(r)
    for r in json.load(open(f"{prefix}.{i}.pred.json")):
        if r.get("supported", True): pred.setdefault(r["method"], []).append(r)
for method, ps in pred.items():
    ms = meas.get(method)
    if not ms:
        continue
    m = {k: med(r[k] for r in ms) for k in ("fwd_ms", "bwd_ms", "step_ms")}
    p = {k: med(r[k] for r in ps) for k in ("fwd_ms", "bwd_ms", "step_ms")}
    mb, pb = {r["bytes_per_layer"] for r in ms}, {r["bytes_per_layer"] for r in ps}
    assert len(mb) == 1 and len(pb) == 1, f"{point} {method}: bytes differ between rounds: {mb} {pb}"
    steps = [r["step_ms"] for r in ms]
    spread = 100 * (max(steps) - min(steps)) / m["step_ms"]
    err = 100 * (p["step_ms"] / m["step_ms"] - 1)
    print(f'{point},{method},{ps[0]["P"]},{ps[0]["ranks_per_node"]},{over},{m["fwd_ms"]:.3f},{m["bwd_ms"]:.3f},{m["step_ms"]:.3f},'
          f'{p["fwd_ms"]:.3f},{p["bwd_ms"]:.3f},{p["step_ms"]:.3f},{err:.1f},{mb.pop():.0f},{pb.pop():.0f},{len(ms)},{spread:.1f}')
PY
}

# point NAME P R SHARE RUNNER...: calibrate, bench, predict under RUNNER (a command prefix).
point() {
  local name=$1 P=$2 R=$3 share=$4; shift 4
  local n; n=$(getconf _NPROCESSORS_ONLN)  # not nproc: it honours the exported OMP_NUM_THREADS
  local cores=$(( P < n ? P : n ))        # fewer than P: the ranks share the cores (oversubscribed)
  local i
  for i in $(seq "$ROUNDS"); do
    echo "== $name (round $i of $ROUNDS)" >&2
    "$@" "$bin" sim calibrate --n-q 16 --n-kv 4 --d-h 64 --out "$tmp/$name.$i.json" >/dev/null
    "$@" "$bin" bench cp --methods all "${work[@]}" --reps "$REPS" --json >"$tmp/$name.$i.meas.json"
    "$bin" sim cp --profile "$tmp/$name.$i.json" --P "$P" --ranks-per-node "$R" --rank-share "$share" --cores "$cores" \
      "${work[@]}" --json >"$tmp/$name.$i.pred.json"
  done
  local over=0; [ "$P" -le 2 ] || over=1
  compare "$name" "$over" "$tmp/$name"
}

point shm 2 2 1 mpirun -np 2
for g in $RATES; do
  cluster=$("$emu" up --nodes 2 --ranks-per-node 1 --inter-gbit "$g" --intra-gbit 16 2>/dev/null | tail -n1)
  point "2x1_${g}g" 2 1 1 "$emu" run --name "$cluster" --
  "$emu" down --name "$cluster" >/dev/null; cluster=""
done
cluster=$("$emu" up --nodes 2 --ranks-per-node 2 --inter-gbit 4 --intra-gbit 16 2>/dev/null | tail -n1)
point 2x2_4g 4 2 1 "$emu" run --name "$cluster" --
# The four DiT modes on the same cluster (TAPA's group L = 2 = an emulated node), predicted from a
# profile calibrated on it at the DiT's attention shape (the default preset: 24 heads x 32, where the
# kernel runs at ~0.4x its rate at the drafter's 16/4 x 64: calibrate at the shape you predict).
dit=(--preset default --resolution 256 --text-tokens 64 --steps "$DIT_STEPS" --warmup 2 --sync-every 4)
for i in $(seq "$ROUNDS"); do
  "$emu" run --name "$cluster" -- "$bin" sim calibrate --n-q 24 --n-kv 24 --d-h 32 --out "$tmp/dit.$i.json" >/dev/null
  for mode in flat tapa vfirst cocodiff; do
    echo "== dit $mode (round $i of $ROUNDS)" >&2
    "$emu" run --name "$cluster" -- "$bin" dit "${dit[@]}" --mode "$mode" --group-size 0 --json --out "" >"$tmp/dit_$mode.$i.meas"
    "$bin" sim dit --profile "$tmp/dit.$i.json" --P 4 --ranks-per-node 2 "${dit[@]}" --mode "$mode" --json \
      >"$tmp/dit_$mode.$i.pred"
  done
done
for mode in flat tapa vfirst cocodiff; do
  python3 - "$mode" "$tmp/dit_$mode" "$ROUNDS" >>"$out" <<'PY'
import json, statistics, sys
mode, prefix, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
ms = [json.load(open(f"{prefix}.{i}.meas")) for i in range(1, rounds + 1)]
ps = [json.load(open(f"{prefix}.{i}.pred"))[0] for i in range(1, rounds + 1)]
total = lambda r: r["bytes_intra_group"] + r["bytes_inter_group"]
mb, pb = {total(r) for r in ms}, {total(r) for r in ps}
assert len(mb) == 1 and len(pb) == 1, f"dit {mode}: bytes differ between rounds: {mb} {pb}"
steps = [r["step_ms"] for r in ms]
m, p = statistics.median(steps), statistics.median(r["step_ms"] for r in ps)
err = 100 * (p / m - 1)
print(f'dit_2x2_4g,{mode},4,2,1,,,{m:.3f},,,{p:.3f},{err:.1f},{mb.pop():.0f},{pb.pop():.0f},{rounds},{100 * (max(steps) - min(steps)) / m:.1f}')
PY
done
"$emu" down --name "$cluster" >/dev/null; cluster=""

python3 - "$out" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
errs = [abs(float(r["step_error_pct"])) for r in rows]
print(f"{len(rows)} points, medians of {rows[0]['rounds']} rounds: mean |error| of step_ms {sum(errs)/len(errs):.1f} %, worst {max(errs):.1f} %")
for r in rows:
    print(f'{r["point"]:10s} {r["method"]:8s} measured {float(r["measured_step_ms"]):9.2f} ms (spread {float(r["measured_step_spread_pct"]):5.1f} %)'
          f'  predicted {float(r["predicted_step_ms"]):9.2f} ms  {float(r["step_error_pct"]):+6.1f} %')
PY
