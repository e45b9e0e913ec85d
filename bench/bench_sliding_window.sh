#!/usr/bin/env bash
# bench_sliding_window.sh [DIFFCP]: sliding-window drafter layers (issue #36).
#  1. Planning: the imbalance of LPT (and the other balancers) fed the windows' real work vs fed
#     full-attention costs, both loaded with the real work, on the paper-shaped workload
#     (4 samples x 64k, 8k queries each, B = 16), for drafters of 5 layers: all sliding at
#     W = 512 / 2048 / 8192, and 3 sliding + 2 full at W = 2048. -> bench/sliding_window_plan.csv
#  2. One Split-KV layer (forward + backward) at P = 2 (one rank per core, Open MPI's binding for
#     np <= 2), full vs windows of 512 / 2048 / 8192 on 2 samples x 16k context, 1k queries each,
#     H 512 (8 heads of 64, 2 kv heads): step time against the share of visible pairs, and the
#     bytes per layer (a window moves nothing more or less: Split-KV's payload is Q-sized).
#     Medians of 5 timed repetitions after 1 warm-up, 3 interleaved rounds.
#     -> bench/sliding_window_attn.csv
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=${1:-build/release/src/diffcp}
export OMP_NUM_THREADS=1

plan_csv=bench/sliding_window_plan.csv
echo "windows,P,J,balancer,imbalance_pct_window_aware,imbalance_pct_full_cost_plan" > "$plan_csv"
for windows in 512,512,512,512,512 2048,2048,2048,2048,2048 8192,8192,8192,8192,8192 2048,0,2048,0,2048; do
  for PJ in "8 16" "64 16"; do
    set -- $PJ
    "$bin" plan --P "$1" --J "$2" --windows "$windows" --json --reps 3 | python3 -c '
import json, sys
w, P, J = sys.argv[1:4]
for r in json.load(sys.stdin):
    print("\"%s\",%s,%s,%s,%.3f,%.3f" % (w, P, J, r["balancer"], r["imbalance_pct"], r["imbalance_pct_full_cost_plan"]))
' "$windows" "$1" "$2" >> "$plan_csv"
  done
done
echo "wrote $plan_csv"

attn_csv=bench/sliding_window_attn.csv
echo "round,window,P,step_ms,fwd_ms,bwd_ms,visible_pair_share,bytes_per_layer" > "$attn_csv"
shape=(--samples 2 --context 16k --queries 1k --hidden 512 --n-q 8 --n-kv 2 --d-h 64 --balancer lpt --reps 5 --warmup 1 --json)
for round in 1 2 3; do
  for window in 0 8192 2048 512; do
    mpirun -np 2 "$bin" attn "${shape[@]}" --window "$window" | python3 -c '
import json, sys
j = json.loads(sys.stdin.read())
r, w = sys.argv[1:3]
print("%s,%s,2,%.2f,%.2f,%.2f,%.4f,%s" % (r, w, j["step_ms"], j["fwd_ms"], j["bwd_ms"], j["visible_pair_share"], j["attention_bytes_per_layer"]))
' "$round" "$window" >> "$attn_csv"
  done
done
echo "wrote $attn_csv"
python3 - "$attn_csv" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
full = statistics.median(float(r["step_ms"]) for r in rows if r["window"] == "0")
for w in ["0", "8192", "2048", "512"]:
    sel = [r for r in rows if r["window"] == w]
    med = statistics.median(float(r["step_ms"]) for r in sel)
    print(f"window {w:>5}: median step {med:8.2f} ms ({med / full:.3f} of full), visible pairs {float(sel[0]['visible_pair_share']):.4f} of full's, bytes/layer {sel[0]['bytes_per_layer']}")
PY
