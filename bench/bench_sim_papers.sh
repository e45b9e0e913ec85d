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
# Every study runs twice: with h100-ib as shipped (one 400 Gb/s uplink per node, shared by its 8
# ranks: the one figure the paper states) and with h100-ib-8nic (a 400 Gb/s NIC per accelerator,
# as a DGX H100 has: 3.2 Tb/s per node), since the paper does not say which. Writes
# bench/sim_papers.csv (one row per profile, study, point, model, method). Pure computation: runs
# anywhere in seconds, no MPI.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${DIFFCP_BIN:-build/release/src/diffcp}
out=bench/sim_papers.csv
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "profile,study,point,model,P,method,supported,layout,step_ms,fwd_ms,bwd_ms,exposed_comm_ms,compute_ms,bytes_per_layer,inter_node_bytes_per_layer,imbalance_pct,plan_ms" >"$out"
jq '.name = "h100-ib-8nic" | .inter_gbit = 3200 | .notes += " Variant: a 400 Gb/s NIC per accelerator (3.2 Tb/s per node)."' \
  profiles/h100-ib.json >"$tmp/h100-ib-8nic.json"
declare -A shape=([35b-a3b]="--hidden 2048 --n-q 32 --n-kv 4 --d-h 128" [27b]="--hidden 5120 --n-q 32 --n-kv 8 --d-h 128")

# row STUDY POINT MODEL SIM-ARGS...
row() {
  local study=$1 point=$2 model=$3; shift 3
  # shellcheck disable=SC2086
  "$bin" sim cp --profile "$profile" ${shape[$model]} --prompt-fraction 0.25 --block 16 "$@" --json >"$tmp/r.json"
  jq -r --arg s "$study" --arg p "$point" --arg m "$model" '.[] |
    [.profile, $s, $p, $m, .P, .method, .supported, .layout, .step_ms, .fwd_ms, .bwd_ms, .exposed_comm_ms, .compute_ms,
     .bytes_per_layer, .inter_node_bytes_per_layer, .imbalance_pct, .plan_ms] | @csv' "$tmp/r.json" >>"$out"
}

for profile in h100-ib "$tmp/h100-ib-8nic.json"; do
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
done
echo "wrote $out ($(($(wc -l <"$out") - 1)) rows)"

# CoCoDiff (SPEC B.5) on the aurora profile (a node = one GPU's 2 tiles, TAPA's L = 2): FLUX.1-dev's
# shape (tests/data/flux1-dev.json), 2304^2 (20736 image tokens) + 480 text tokens (P must divide
# them; FLUX's T5 gives 512), 50 steps, warm-up 5, sync every 10, linear cache schedule to r = 1;
# P = 2 ... 24 tiles (1 - 12 GPUs; past 24 = the head count Ulysses cannot go, and USP is not
# modelled by sim dit).
dout=bench/sim_papers_dit.csv
echo "P,mode,supported,step_ms,total_ms,exposed_comm_ms,bytes_intra_group,bytes_inter_group" >"$dout"
for P in 2 4 8 12 24 48; do
  "$bin" sim dit --profile aurora --P "$P" --config tests/data/flux1-dev.json --resolution 2304 --text-tokens 480 \
    --steps 50 --mode all --json |
    jq -r '.[] | [.P, .mode, .supported, .step_ms, .total_ms, .exposed_comm_ms, .bytes_intra_group, .bytes_inter_group] | @csv' >>"$dout"
done
echo "wrote $dout"
