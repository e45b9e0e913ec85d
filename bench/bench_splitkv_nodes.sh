#!/usr/bin/env bash
# Split-KV across nodes (issue #16): output-projection placement and two-level collectives.
#
#   shm      one shared-memory node, P = 2 (one rank per core, `mpirun -np 2`: Open MPI binds each
#            rank to one core): --oproj all vs owned vs auto for two layer shapes, n_q d_h = H
#            (H 1024, n_q 16, d_h 64: owned sends the same bytes) and the drafter shape n_q d_h = 2H
#            (H 512: owned sends more). Q:S = 1:4 (2 x 2k queries, 8k context per sample).
#   cluster  the emulated cluster (scripts/emucluster.sh), 2 nodes x 2 ranks, profile h100-ib at
#            scale $SCALE: every CP method (bench cp, Split-KV with its defaults) and Split-KV's
#            four variants {flat, hierarchical} x {all, owned}; Q:S 1:16 and 1:128 (Q = 512 packed
#            query rows, 2k context per sample: 4 x 128 and 32 x 16 queries). 4 ranks on 2 cores: times are
#            OVERSUBSCRIBED; bytes (total and to other nodes) are exact.
#
# Writes bench/splitkv_nodes.csv (one row per run). Usage: bench/bench_splitkv_nodes.sh [shm|cluster]...
# (default both). Root and a release build needed for `cluster`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=${DIFFCP_BIN:-build/release/src/diffcp}
REPS=${REPS:-3}
SCALE=${SCALE:-8.55e-5}  # the cluster studies' h100-ib factor (bench/cluster_cp.csv)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=bench/splitkv_nodes.csv
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
studies=("$@")
[ ${#studies[@]} -eq 0 ] && studies=(shm cluster)

echo "study,topology,oversubscribed,shape,qs,method,collectives,oproj,step_ms,fwd_ms,bwd_ms,exposed_comm_ms,bytes_per_layer,inter_bytes_per_layer,predicted_inter_bytes_per_layer,check_passed" >"$tmp/rows.csv"
# rows STUDY TOPO OVER SHAPE QS FILE
rows() {
  jq -r --arg s "$1" --arg t "$2" --arg o "$3" --arg sh "$4" --arg q "$5" '
    (if type == "array" then .[] else . end) | select(.supported != false) |
    [$s, $t, $o, $sh, $q, .method, (.collectives // "-"), (.oproj // "-"), .step_ms, .fwd_ms, .bwd_ms, .exposed_comm_ms,
     (.bytes_per_layer // .attention_bytes_per_layer), .inter_bytes_per_layer, (.predicted_inter_bytes_per_layer // ""),
     .check_passed] | @csv' "$6" >>"$tmp/rows.csv"
}

for study in "${studies[@]}"; do
  case $study in
    shm)
      for shape in "1024 16" "512 16"; do
        set -- $shape
        dims=(--hidden "$1" --n-q "$2" --n-kv 4 --d-h 64)
        for oproj in all owned auto; do
          mpirun -np 2 "$bin" attn "${dims[@]}" --queries 2k --samples 2 --context 8k --balancer lpt \
            --reps "$REPS" --warmup 1 --oproj "$oproj" --json >"$tmp/r.json"
          rows shm 1x2 0 "H$1" 1:4 "$tmp/r.json"
          echo "shm H=$1 oproj $oproj: $(jq -c '{oproj, step_ms, attention_bytes_per_layer, oproj_auto}' "$tmp/r.json")"
        done
      done
      ;;
    cluster)
      emu=(scripts/emucluster.sh run --nodes 2 --ranks-per-node 2 --profile h100-ib --scale "$SCALE" --)
      shape=(--hidden 1024 --n-q 16 --n-kv 4 --d-h 64)
      for qs in "128 4 1:16" "16 32 1:128"; do
        set -- $qs
        work=(--queries "$1" --samples "$2" --context 2k --reps "$REPS" --warmup 1)
        "${emu[@]}" "$bin" bench cp "${shape[@]}" "${work[@]}" --json 2>/dev/null | tail -n 1 >"$tmp/r.json"
        rows cluster 2x2 1 H1024 "$3" "$tmp/r.json"
        for coll in flat hierarchical; do
          for oproj in all owned; do
            "${emu[@]}" "$bin" attn "${shape[@]}" "${work[@]}" --balancer lpt --collectives "$coll" --oproj "$oproj" \
              --json 2>/dev/null | tail -n 1 >"$tmp/r.json"
            rows cluster 2x2 1 H1024 "$3" "$tmp/r.json"
          done
        done
        echo "cluster Q:S $3 done"
      done
      ;;
    *) echo "unknown study '$study' (shm | cluster)" >&2; exit 2 ;;
  esac
done
# A run of one study keeps the other study's rows.
if [ -f "$out" ]; then
  for old in shm cluster; do
    [[ " ${studies[*]} " == *" $old "* ]] || grep "^\"$old\"" "$out" >>"$tmp/rows.csv" || true
  done
fi
cp "$tmp/rows.csv" "$out"
column -s, -t <"$out"
