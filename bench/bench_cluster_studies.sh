#!/usr/bin/env bash
# The communication-bound studies of both papers on the emulated cluster (scripts/emucluster.sh;
# issue #11). Every run goes through `scripts/emucluster.sh run ... -- diffcp ...`: real Open MPI
# over TCP through tc-shaped links whose rates are the profile's scaled by this machine's compute
# (--scale auto, printed at the start of each run and recorded in the CSV as `scale`).
#
#   cp       Split-KV vs Ulysses / Ring (zigzag) / RingX / LV-XAttn, profile h100-ib, Q:S ablation
#            1:4 ... 1:32 (Q = $QS_Q packed query rows, $QS_CTX context per sample; (queries/sample,
#            samples) chosen so S/Q = 4, 8, 16, 32). 2 nodes x 1 rank (one rank per core: real
#            times) and 2 x 2 (4 ranks on 2 cores: times OVERSUBSCRIBED, bytes exact).
#   weak     weak scaling in S at 2 x 1 (h100-ib): 4 samples x $WEAK_QUERIES queries, context per
#            sample $WEAK_CONTEXTS (default 2k 4k 8k).
#   dit      CoCoDiff, profile aurora, 2 x 2 (L = 2 = one emulated node = one GPU's tiles):
#            flat / tapa / vfirst / cocodiff end to end ($DIT_STEPS steps, $DIT_RES^2), times
#            OVERSUBSCRIBED (4 ranks on 2 cores); and the all-to-all latency vs size, flat vs TAPA
#            (bench_tapa, the paper's Fig. 11 analogue).
#   balance  LPT vs none vs zigzag for Split-KV on a skewed batch, 2 x 1 (h100-ib).
#
# Layer shape (cp, weak, balance): H = 1024, n_q = 16, n_kv = 4, d_h = 64, f32; --reps $REPS after one
# warm-up, medians of the slowest rank. Writes bench/cluster_cp.csv, cluster_weak.csv,
# cluster_dit.csv, cluster_a2a.csv, cluster_balance.csv. Usage: bench/bench_cluster_studies.sh
# [cp|weak|dit|balance]...  (default all). Needs root (network namespaces) and a release build.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=${DIFFCP_BIN:-build/release/src/diffcp}
REPS=${REPS:-2}
QS_Q=${QS_Q:-512}
QS_CTX=${QS_CTX:-2k}
WEAK_QUERIES=${WEAK_QUERIES:-256}
DIT_STEPS=${DIT_STEPS:-12}
DIT_RES=${DIT_RES:-256}
shape=(--hidden 1024 --n-q 16 --n-kv 4 --d-h 64)
emu=scripts/emucluster.sh
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
studies=("$@")
[ ${#studies[@]} -eq 0 ] && studies=(cp weak dit balance)

# The scale of a profile on this machine (what emucluster's --scale auto measures), taken once per
# study and passed to every run as --scale, so one study's runs share one factor (the measurement
# itself varies by up to ~1.4x between runs on this noisy machine). H100_IB_SCALE / AURORA_SCALE
# pin it, e.g. to redo part of a study with the factor recorded in its CSV.
scale_of() {
  local pin; pin=$(echo "${1//-/_}_SCALE" | tr '[:lower:]' '[:upper:]')
  if [ -n "${!pin:-}" ]; then echo "${!pin}"; return; fi
  "$emu" run --nodes 1 --ranks-per-node 1 --profile "$1" --dry-run -- true 2>&1 >/dev/null |
    sed -n 's/.*-> factor \([0-9.e+-]*\).*/\1/p'
}

# csv_rows STUDY POINT TOPO SCALE JSON_ARRAY_FILE -> rows appended to $tmp/STUDY.csv
csv_rows() {
  local study=$1 point=$2 topo=$3 scale=$4 f=$5 out="$tmp/$1.csv"
  [ -f "$out" ] || echo "study,point,topology,oversubscribed,scale,method,layout,P,S,Q,fwd_ms,bwd_ms,step_ms,exposed_comm_ms,bytes_per_layer,predicted_bytes_per_layer,imbalance_pct,check_passed" >"$out"
  local over=0; [ "$topo" = 2x1 ] || over=1
  jq -r --arg s "$study" --arg p "$point" --arg t "$topo" --arg o "$over" --arg sc "$scale" '
    (if type == "array" then .[] else . end) | select(.supported != false) |
    [$s, $p, $t, $o, $sc, .method, (.layout // .config.balancer), .P // .config.P, .S // .config.S, .Q // .config.Q,
     .fwd_ms, .bwd_ms, (.step_ms // (.fwd_ms + .bwd_ms)), .exposed_comm_ms,
     (.bytes_per_layer // .attention_bytes_per_layer), (.predicted_bytes_per_layer), (.imbalance_pct), (.check_passed)]
    | map(if . == null then "" else tostring end) | join(",")' "$f" >>"$out"
}

for study in "${studies[@]}"; do
  case $study in
    cp)
      sc=$(scale_of h100-ib)
      for topo in 2x1 2x2; do
        for sq in 4 8 16 32; do
          ctx_rows=$(( $(echo "$QS_CTX" | sed 's/k$/*1024/') ))
          samples=$(( sq * QS_Q / ctx_rows )); [ "$samples" -ge 1 ] || samples=1
          echo "cp: h100-ib $topo Q:S 1:$sq ($samples samples x $((QS_Q / samples)) queries x $QS_CTX)" >&2
          "$emu" run --nodes 2 --ranks-per-node "${topo#2x}" --profile h100-ib --scale "$sc" -- "$bin" bench cp --methods all \
            "${shape[@]}" --samples "$samples" --queries $((QS_Q / samples)) --context "$QS_CTX" --reps "$REPS" --json \
            > "$tmp/run.json"
          csv_rows cp "$sq" "$topo" "$sc" "$tmp/run.json"
        done
      done ;;
    weak)
      sc=$(scale_of h100-ib)
      for ctx in ${WEAK_CONTEXTS:-2k 4k 8k}; do
        echo "weak: h100-ib 2x1 context $ctx" >&2
        "$emu" run --nodes 2 --ranks-per-node 1 --profile h100-ib --scale "$sc" -- "$bin" bench cp --methods all "${shape[@]}" \
          --samples 4 --queries "$WEAK_QUERIES" --context "$ctx" --reps "$REPS" --json > "$tmp/run.json"
        csv_rows weak "$ctx" 2x1 "$sc" "$tmp/run.json"
      done ;;
    balance)
      sc=$(scale_of h100-ib)
      for b in none zigzag lpt; do
        echo "balance: h100-ib 2x1 $b" >&2
        "$emu" run --nodes 2 --ranks-per-node 1 --profile h100-ib --scale "$sc" -- "$bin" attn "${shape[@]}" --samples 4 \
          --context 1k:7k --queries 512 --reps "$REPS" --balancer "$b" --json > "$tmp/run.json"
        csv_rows balance "$b" 2x1 "$sc" "$tmp/run.json"
      done ;;
    dit)
      sc=$(scale_of aurora)
      out="$tmp/dit.csv"
      echo "mode,P,group_size,steps,resolution,scale,oversubscribed,step_ms,exposed_comm_ms,bytes_intra_group,bytes_inter_group" >"$out"
      for mode in flat tapa vfirst cocodiff; do
        echo "dit: aurora 2x2 $mode" >&2
        "$emu" run --nodes 2 --ranks-per-node 2 --profile aurora --scale "$sc" -- "$bin" dit --mode "$mode" --group-size 0 \
          --steps "$DIT_STEPS" --resolution "$DIT_RES" --json --out "" > "$tmp/run.json"
        jq -r --arg sc "$sc" '[.mode, .P, .group_size, .steps, '"$DIT_RES"', $sc, 1, .step_ms, .exposed_comm_ms,
              .bytes_intra_group, .bytes_inter_group] | map(tostring) | join(",")' "$tmp/run.json" >>"$out"
      done
      echo "dit: aurora 2x2 all-to-all latency, flat vs TAPA" >&2
      "$emu" run --nodes 2 --ranks-per-node 2 --profile aurora --scale "$sc" -- "${bin%/src/diffcp}/bench/bench_tapa" --group-size 2 \
        --sizes 1,3,6,12,24 --reps 3 --warmup 1 --csv "$tmp/a2a.csv" >&2 ;;
    *) echo "unknown study '$study' (cp, weak, dit, balance)" >&2; exit 1 ;;
  esac
done
for f in "$tmp"/*.csv; do
  [ -e "$f" ] || continue
  cp "$f" "bench/cluster_$(basename "$f")"
  echo "wrote bench/cluster_$(basename "$f")"
done
