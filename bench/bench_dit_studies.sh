#!/usr/bin/env bash
# The CoCoDiff studies of issue #7 (SPEC B.3-B.5) for `diffcp dit`, scaled down to this 2-core
# machine (random weights: no FLUX checkpoint here).
#
#   modes    default model (H 768, 24 heads, 2 + 4 blocks), $RES^2 (default 256: 256 image + 64 text tokens),
#            $STEPS steps (default 50), paper schedule (linear 0 -> 1, warm-up 5, sync every 10):
#            flat / tapa / vfirst / cocodiff. P = 2 one rank per core (real times) with L = 2 (one
#            group: TAPA's phase 1 is the whole exchange, so V-First has something to hide) and
#            L = 1 (two groups: everything is phase 2, the bytes V-Major cuts). P = 4 oversubscribed,
#            L = 2 (2 groups of 2), 256^2: volumes only.
#   quality  P = 2, L = 1, 256^2, $STEPS steps: cocodiff with fixed r in {0, 0.2, ..., 0.8, 0.9}
#            and the linear schedule; PSNR / SSIM against the Flat latent of the same run shape.
#
# Before each study the script waits (up to 3 x 60 s) for the 1-minute load to drop below 1.5
# (not before every run: a 2-rank run itself lifts the 1-minute average to ~2); every real run
# records the load it started under (load1; NA for oversubscribed volume-only runs).
# Writes bench/dit_modes.csv, bench/dit_quality.csv; plot with bench/plot_dit.py.
# Usage: bench/bench_dit_studies.sh [modes|quality]... ; DIFFCP_BIN overrides the binary.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=${DIFFCP_BIN:-build/release/src/diffcp}
STEPS=${STEPS:-50}
RES=${RES:-256}  # modes at P = 2: 512 is the model default; 256 keeps the study inside ~8 min of machine time
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
studies=("$@")
[ ${#studies[@]} -eq 0 ] && studies=(modes quality)

load1() { cut -d' ' -f1 /proc/loadavg; }
wait_quiet() {
  for _ in 1 2 3; do
    awk -v l="$(load1)" 'BEGIN { exit !(l < 1.5) }' && return 0
    echo "load $(load1) >= 1.5: waiting 60 s" >&2
    sleep 60
  done
  echo "load still $(load1): running anyway (recorded)" >&2
}
# run <np> <timed 0|1> <study> <point> <diffcp dit args...>: one CSV row from the JSON
run() {
  local np=$1 timed=$2 study=$3 point=$4; shift 4
  local l=NA bind=()
  if [ "$timed" = 1 ]; then l=$(load1); bind=(--bind-to core); fi
  OMP_NUM_THREADS=1 mpirun -np "$np" "${bind[@]}" "$bin" dit --json --out "" "$@" > "$tmp/out.json"
  python3 - "$tmp/out.json" "$study" "$point" "$timed" "$l" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
keys = ["mode", "P", "group_size", "steps", "resolution", "cache_schedule", "cache_ratio", "step_ms", "total_ms",
        "exposed_comm_ms", "mean_exposed_comm_ms", "v_wait_ms", "v_phase1_hidden", "bytes_intra_group",
        "bytes_inter_group", "predicted_bytes_inter_group", "tapa_bytes_inter_group", "predicted_inter_ratio_vs_tapa",
        "measured_inter_ratio_vs_tapa", "predicted_qkv_inter_ratio_vs_tapa", "messages", "cache_bytes_per_rank"]
row = [sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]] + [j[k] for k in keys]
psnr = j.get("psnr", "")
row += ["inf" if psnr is None else psnr, j.get("ssim", ""), j.get("mse", "")]
print(",".join(str(v) for v in row))
PY
}
header="study,point,timed,load1,mode,P,group_size,steps,resolution,cache_schedule,cache_ratio,step_ms,total_ms,exposed_comm_ms,mean_exposed_comm_ms,v_wait_ms,v_phase1_hidden,bytes_intra_group,bytes_inter_group,predicted_bytes_inter_group,tapa_bytes_inter_group,predicted_inter_ratio_vs_tapa,measured_inter_ratio_vs_tapa,predicted_qkv_inter_ratio_vs_tapa,messages,cache_bytes_per_rank,psnr,ssim,mse"

for study in "${studies[@]}"; do
  wait_quiet
  case $study in
    modes)
      out=bench/dit_modes.csv
      echo "$header" > $out
      for L in 2 1; do
        for m in flat tapa vfirst cocodiff; do
          cmp=(); [ $m = cocodiff ] && cmp=(--compare flat)
          run 2 1 modes "P2_L$L" --mode $m --group-size $L --steps $STEPS --resolution $RES "${cmp[@]}" | tee -a $out
        done
      done
      for m in flat tapa vfirst cocodiff; do
        run 4 0 modes P4_L2 --mode $m --group-size 2 --steps $STEPS --resolution 256 | tee -a $out
      done ;;
    quality)
      out=bench/dit_quality.csv
      echo "$header" > $out
      ref=$tmp/flat.npy
      run 2 1 quality flat --mode flat --group-size 1 --steps $STEPS --resolution 256 --save-latent $ref | tee -a $out
      run 2 1 quality tapa --mode tapa --group-size 1 --steps $STEPS --resolution 256 --reference $ref | tee -a $out
      for r in 0 0.2 0.4 0.6 0.8 0.9; do
        run 2 1 quality "fixed_$r" --mode cocodiff --group-size 1 --steps $STEPS --resolution 256 \
          --cache-schedule fixed --cache-ratio $r --reference $ref | tee -a $out
      done
      run 2 1 quality linear --mode cocodiff --group-size 1 --steps $STEPS --resolution 256 --reference $ref | tee -a $out ;;
    *) echo "unknown study '$study' (modes, quality)" >&2; exit 2 ;;
  esac
done
