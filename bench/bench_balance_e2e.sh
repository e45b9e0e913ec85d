#!/usr/bin/env bash
# End-to-end effect of load balancing on the Split-KV layer at P = 2 (one rank per core): step
# time of one drafter attention layer (forward + backward) with the context laid out by none,
# zigzag and lpt, on a skewed batch (sample lengths drawn from a range). Extra arguments go to
# `diffcp attn`. Writes bench/balance_e2e.csv (DIFFCP_E2E_CSV).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=build/release/src/diffcp
csv=${DIFFCP_E2E_CSV:-bench/balance_e2e.csv}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for b in none zigzag lpt; do
  OMP_NUM_THREADS=1 mpirun -np 2 --bind-to core "$bin" attn --hidden 2048 --n-q 32 --n-kv 4 --d-h 128 \
    --samples 4 --context 2k:14k --queries 1k --reps 3 --balancer "$b" --json "$@" > "$tmp/$b.json"
done
/usr/bin/python3 - "$tmp" "$csv" <<'PY'
import csv, json, sys
r = {b: json.load(open(f"{sys.argv[1]}/{b}.json")) for b in ("none", "zigzag", "lpt")}
base = r["none"]["fwd_ms"] + r["none"]["bwd_ms"]
with open(sys.argv[2], "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["balancer", "imbalance_pct", "step_ms", "fwd_ms", "bwd_ms", "exposed_comm_ms", "redistribution_bytes", "speedup_over_none"])
    for b, d in r.items():
        step = d["fwd_ms"] + d["bwd_ms"]
        w.writerow([b, d["imbalance_pct"], round(step, 2), d["fwd_ms"], d["bwd_ms"], d["exposed_comm_ms"], d["redistribution_bytes"],
                    round(base / step, 3)])
for b, d in r.items():
    step = d["fwd_ms"] + d["bwd_ms"]
    print(f"{b:7s} imbalance {d['imbalance_pct']:6.2f} %  step {step:8.1f} ms (fwd {d['fwd_ms']:.1f}, bwd {d['bwd_ms']:.1f})  "
          f"exposed comm {d['exposed_comm_ms']:7.1f} ms  redistribution {d['redistribution_bytes'] / 1e6:.1f} MB/rank  "
          f"speedup over none {base / step:.2f}x")
PY
