#!/usr/bin/env bash
# sim_cluster_check.sh DIFFCP TOL_PCT: `diffcp sim` predicts a run it then makes. On an emulated
# 2-node cluster (one rank per node and core, 2 Gbit/s between the nodes): `sim calibrate` measures
# the compute rates and the shaped link, `bench cp` runs Split-KV, Ring and LV-XAttn, and `sim cp`
# predicts them from the calibrated profile; each predicted step time must be within TOL_PCT % of
# the measured one, and the bytes exact.
set -euo pipefail
py=${DIFFCP_PYTHON:-python3}  # a python3 with numpy (tests/CMakeLists.txt)
bin=${1:?usage: sim_cluster_check.sh DIFFCP TOL_PCT}
tol=${2:?}
here=$(cd "$(dirname "$0")" && pwd)
emu="$here/../scripts/emucluster.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1
shape=(--samples 2 --context 4k --queries 256 --hidden 1024 --n-q 16 --n-kv 4 --d-h 64)
topo=(--nodes 2 --ranks-per-node 1 --inter-gbit 2 --intra-gbit 16)
"$emu" run "${topo[@]}" -- "$bin" sim calibrate --n-q 16 --n-kv 4 --d-h 64 --out "$work/profile.json" >/dev/null
"$emu" run "${topo[@]}" -- "$bin" bench cp --methods splitkv,ring,lvxattn "${shape[@]}" --reps 3 --json >"$work/meas.json"
"$bin" sim cp --profile "$work/profile.json" --P 2 --ranks-per-node 1 --methods splitkv,ring,lvxattn "${shape[@]}" --json \
  >"$work/pred.json"
"$py" - "$work/meas.json" "$work/pred.json" "$tol" <<'PY'
import json, sys
meas = {r["method"]: r for r in json.load(open(sys.argv[1]))}
pred = json.load(open(sys.argv[2]))
tol, bad = float(sys.argv[3]), 0
for p in pred:
    m = meas[p["method"]]
    err = 100 * (p["step_ms"] / m["step_ms"] - 1)
    ok = abs(err) <= tol and p["bytes_per_layer"] == m["bytes_per_layer"]
    bad += not ok
    print(f'{p["method"]:8s} measured {m["step_ms"]:8.2f} ms predicted {p["step_ms"]:8.2f} ms ({err:+.1f} %, tolerance {tol} %); '
          f'bytes {m["bytes_per_layer"]:.0f} vs {p["bytes_per_layer"]:.0f} {"ok" if ok else "FAIL"}')
print("sim_cluster_check: passed" if bad == 0 else "sim_cluster_check: FAILED")
sys.exit(1 if bad else 0)
PY
