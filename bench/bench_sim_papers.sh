#!/usr/bin/env bash
# `diffcp sim` at the papers' workloads and beyond (issue #12): predictions with the h100-ib
# profile (the Split-KV paper's testbed: 8 ranks per node, 400 Gb/s between nodes; profiles/) for
# the drafter attention layer of both paper models (qwen3.5-35b-a3b: H 2048, 32/4 heads x 128;
# qwen3.5-27b: H 5120, 32/8 heads x 128), per layer (ratios are per-layer ratios):
#   qs       Q:S ablation at P = 32: Q = 64k packed, 128k context per sample, (Q_sample, b) =
#            (32k, 2), (16k, 4), (8k, 8), (4k, 16)                       (SPEC A.5)
#   weak     context 128k -> 1M per sample with P 8 -> 64, 8k queries, b = 8
#   strong   b = 4, 256k context, 8k queries per sample, P 8 -> 64
#   balance  Split-KV with LPT vs no balancing, b = 4, 8k queries, 256k context, P 8 -> 64
#   scale    beyond the papers: the weak scaling above continued to P = 128 ... 1024 (8 per node):
#            b = 8, 8k queries and 16k x P context per sample (2M ... 16M; S up to 128M rows); the
#            planner really runs at every P
# Writes bench/sim_papers.csv (one row per study, point, model, method). Pure computation: runs
# anywhere in seconds, no MPI.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${DIFFCP_BIN:-build/release/src/diffcp}
out=bench/sim_papers.csv
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "study,point,model,P,method,supported,layout,step_ms,fwd_ms,bwd_ms,exposed_comm_ms,compute_ms,bytes_per_layer,inter_node_bytes_per_layer,imbalance_pct,plan_ms" >"$out"
declare -A shape=([35b-a3b]="--hidden 2048 --n-q 32 --n-kv 4 --d-h 128" [27b]="--hidden 5120 --n-q 32 --n-kv 8 --d-h 128")

# row STUDY POINT MODEL SIM-ARGS...
row() {
  local study=$1 point=$2 model=$3; shift 3
  # shellcheck disable=SC2086
  "$bin" sim cp --profile h100-ib ${shape[$model]} --prompt-fraction 0.25 --block 16 "$@" --json >"$tmp/r.json"
  jq -r --arg s "$study" --arg p "$point" --arg m "$model" '.[] |
    [$s, $p, $m, .P, .method, .supported, .layout, .step_ms, .fwd_ms, .bwd_ms, .exposed_comm_ms, .compute_ms,
     .bytes_per_layer, .inter_node_bytes_per_layer, .imbalance_pct, .plan_ms] | @csv' "$tmp/r.json" >>"$out"
}

for model in 35b-a3b 27b; do
  for qb in 32k:2 16k:4 8k:8 4k:16; do
    row qs "1:$((128 / ${qb%%k:*}))" "$model" --P 32 --samples "${qb#*:}" --queries "${qb%%:*}" --context 128k
  done
  for pc in 8:128k 16:256k 32:512k 64:1m; do
    row weak "P${pc%%:*}" "$model" --P "${pc%%:*}" --samples 8 --queries 8k --context "${pc#*:}"
  done
  for P in 8 16 32 64; do
    row strong "P$P" "$model" --P "$P" --samples 4 --queries 8k --context 256k
    row balance "P${P}_lpt" "$model" --P "$P" --samples 4 --queries 8k --context 256k --methods splitkv --balancer lpt
    row balance "P${P}_none" "$model" --P "$P" --samples 4 --queries 8k --context 256k --methods splitkv --balancer none
  done
done
for P in 8 16 32 64 128 256 512 1024; do
  row scale "P$P" 35b-a3b --P "$P" --samples 8 --queries 8k --context $((16 * P))k
done
echo "wrote $out ($(($(wc -l <"$out") - 1)) rows)"
