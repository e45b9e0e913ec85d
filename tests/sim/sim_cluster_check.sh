#!/usr/bin/env bash
# sim_cluster_check.sh DIFFCP TOL_PCT: `diffcp sim` predicts a run it then makes. On an emulated
# 2-node cluster (one rank per node and core, 2 Gbit/s between the nodes): `sim calibrate` measures
# the compute rates and the shaped link, `bench cp` runs Split-KV, Ring and LV-XAttn, and `sim cp`
# predicts them from the calibrated profile; each predicted step time must be within TOL_PCT % of
# the measured one (at most 3 attempts), and the bytes exact.
set -euo pipefail
py=${DIFFCP_PYTHON:-python3}  # a python3 with numpy (tests/CMakeLists.txt)
bin=${1:?usage: sim_cluster_check.sh DIFFCP TOL_PCT}
tol=${2:?}
here=$(cd "$(dirname "$0")" && pwd)
emu="$here/../../scripts/emucluster.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1
# Split-KV's output projection pinned alike on both sides (bench cp defaults to all, sim cp to auto).
shape=(--samples 2 --context 4k --queries 256 --hidden 1024 --n-q 16 --n-kv 4 --d-h 64 --oproj owned)
topo=(--nodes 2 --ranks-per-node 1 --inter-gbit 2 --intra-gbit 16)
# One attempt: calibrate, run, predict, compare. Exit 0: passed; 1: a step time off (the host's
# slow spells move one measurement or one calibration by 35-60 %:
# bench/history/2026-12-02-issue-12-sim.md); 2: bytes differ.
attempt() {
  "$emu" run "${topo[@]}" -- "$bin" sim calibrate --n-q 16 --n-kv 4 --d-h 64 --out "$work/profile.json" >/dev/null
  "$emu" run "${topo[@]}" -- "$bin" bench cp --methods splitkv,ring,lvxattn "${shape[@]}" --reps 3 --json >"$work/meas.json"
  "$bin" sim cp --profile "$work/profile.json" --P 2 --ranks-per-node 1 --methods splitkv,ring,lvxattn "${shape[@]}" --json \
    >"$work/pred.json"
  "$py" - "$work/meas.json" "$work/pred.json" "$tol" <<'PY'
import json, sys
meas = {r["method"]: r for r in json.load(open(sys.argv[1]))}
pred = json.load(open(sys.argv[2]))
tol, slow, bytes_bad = float(sys.argv[3]), 0, 0
for p in pred:
    m = meas[p["method"]]
    err = 100 * (p["step_ms"] / m["step_ms"] - 1)
    same_bytes = p["bytes_per_layer"] == m["bytes_per_layer"]
    slow += abs(err) > tol
    bytes_bad += not same_bytes
    print(f'{p["method"]:8s} measured {m["step_ms"]:8.2f} ms predicted {p["step_ms"]:8.2f} ms ({err:+.1f} %, tolerance {tol} %); '
          f'bytes {m["bytes_per_layer"]:.0f} vs {p["bytes_per_layer"]:.0f} {"ok" if abs(err) <= tol and same_bytes else "FAIL"}')
sys.exit(2 if bytes_bad else 1 if slow else 0)
PY
}
# Bytes must be exact at once; a step time off the tolerance is measured again (at most 3
# attempts): a wrong model misses every time, a slow spell once.
for try in 1 2 3; do
  rc=0
  attempt || rc=$?
  [ "$rc" -eq 0 ] && { echo "sim_cluster_check: passed (attempt $try)"; exit 0; }
  [ "$rc" -eq 2 ] && { echo "sim_cluster_check: FAILED: the predicted bytes differ from the measured"; exit 1; }
  echo "sim_cluster_check: attempt $try: a step time outside $tol %"
done
echo "sim_cluster_check: FAILED: a step time outside $tol % in 3 attempts"
exit 1
