#!/usr/bin/env bash
# Split-KV layer scaling on this machine: one drafter attention layer, forward + backward, at P = 1
# and P = 2 with one rank per core (OMP_NUM_THREADS=1, --bind-to core): same total work, so the
# ratio of step times is the parallel speedup. Default shape: the Qwen3.5-35B-A3B drafter layer
# (SPEC A.1) scaled to fit 24 GiB: H = 2048, n_q = 32, n_kv = 4, d_h = 128, 2 samples x 32k context,
# 256 anchors (4k queries) each. Extra arguments go to `diffcp attn` (e.g. --context 8k). Writes
# bench/splitkv_scaling.csv (DIFFCP_SPLITKV_CSV).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=build/release/src/diffcp
csv=${DIFFCP_SPLITKV_CSV:-bench/splitkv_scaling.csv}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# Defaults; an extra "--option value" of the same name replaces one (CLI11 refuses an option twice).
declare -A opt=([--hidden]=2048 [--n-q]=32 [--n-kv]=4 [--d-h]=128 [--samples]=2 [--context]=32k [--queries]=4k [--reps]=3)
extra=()
while (($#)); do
  if [[ -v "opt[$1]" && $# -ge 2 ]]; then opt[$1]=$2; shift 2; else extra+=("$1"); shift; fi
done
args=(attn --json)
for k in "${!opt[@]}"; do args+=("$k" "${opt[$k]}"); done
args+=("${extra[@]}")
for np in 1 2; do
  OMP_NUM_THREADS=1 mpirun -np "$np" --bind-to core "$bin" "${args[@]}" > "$tmp/np$np.json"
done
/usr/bin/python3 - "$tmp" "$csv" <<'PY'
import csv, json, sys
r = {p: json.load(open(f"{sys.argv[1]}/np{p}.json")) for p in (1, 2)}
keys = ["fwd_ms", "bwd_ms", "exposed_comm_ms", "fwd_allgather_exposed_ms", "bwd_reducescatter_exposed_ms", "blocking_comm_ms",
        "attention_bytes_per_layer", "predicted_bytes_per_layer"]
with open(sys.argv[2], "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["P", "step_ms"] + keys)
    for p, d in r.items():
        w.writerow([p, round(d["fwd_ms"] + d["bwd_ms"], 2)] + [d[k] for k in keys])
for p, d in r.items():
    print(f"P={p}: fwd {d['fwd_ms']:.0f} ms, bwd {d['bwd_ms']:.0f} ms, step {d['fwd_ms'] + d['bwd_ms']:.0f} ms, "
          f"exposed comm {d['exposed_comm_ms']:.1f} ms (fwd all-gather {d['fwd_allgather_exposed_ms']:.1f}, "
          f"bwd reduce-scatter {d['bwd_reducescatter_exposed_ms']:.1f}, blocking {d['blocking_comm_ms']:.1f}), "
          f"bytes/layer/rank {d['attention_bytes_per_layer']:.0f} (predicted {d['predicted_bytes_per_layer']:.0f})")
s1 = r[1]['fwd_ms'] + r[1]['bwd_ms']; s2 = r[2]['fwd_ms'] + r[2]['bwd_ms']
print(f"speedup P=2 over P=1: {s1 / s2:.2f}x (goal >= 1.8x)")
PY
