#!/usr/bin/env bash
# The fp8 wire of the DiT's exchanges (issue #52, --wire fp8: e4m3 with one f32 scale per (token,
# head)) against the exact f32 run, and the bf16 wire (--dtype bf16) for comparison, at P = 2 (flat
# Ulysses; mpirun binds one core per rank at np <= 2, one OpenMP thread each).
#
# Configs (random weights):
#   flux1_tiny       FLUX.1, the tiny preset (8 heads x 16), 256^2 (256 image + 64 text tokens)
#   sd3_tiny         SD3.5 (tools/sd3_reference.py's folder: 2 joint blocks, 8 heads x 16, position
#                    table 16^2), 256^2, classifier-free guidance (two passes a step)
#   flux1_realwidth  FLUX.1 at the real width (24 heads x 128 = 3072, MLP 12288), 1 double + 1 single
#                    block, 256^2
# at $STEPS (default "28 50") steps, the real-width one at $RW_STEPS (default 28). Quality: the exact f32 run's latent (--save-latent), then
# --reference: PSNR / SSIM of the images, max |latent diff|. Bytes per rank per step (everything the
# exchanges send, intra + inter), of them the scales, and the payload (bytes - scales).
#
# Writes bench/dit_fp8.csv. Usage: bench/bench_dit_fp8.sh ; DIFFCP_BIN overrides the binary, STEPS /
# RW_STEPS the step counts. About 6 minutes on 2 cores (the real-width rows: ~17 s of random init
# and ~1 min of sampling per run).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=${DIFFCP_BIN:-build/release/src/diffcp}
py=${DIFFCP_PYTHON:-/usr/bin/python3}
STEPS=${STEPS:-"28 50"}
RW_STEPS=${RW_STEPS:-28}  # the real-width rows: ~2 s a step here, so 28 steps only by default
out=bench/dit_fp8.csv
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" tools/sd3_reference.py make --out "$tmp/sd3" --heads 8 --head-dim 16 --layers 2 --pos-max 16 > /dev/null

config_args() {
  case $1 in
    flux1_tiny) echo --preset tiny --resolution 256 --text-tokens 64 ;;
    sd3_tiny) echo --weights "$tmp/sd3" --resolution 256 --text-tokens 64 ;;
    flux1_realwidth) echo --preset tiny --heads 24 --head-dim 128 --double-blocks 1 --single-blocks 1 --mlp-hidden 12288 \
                          --resolution 256 --text-tokens 64 ;;
  esac
}

# run <config> <steps> <diffcp dit args...>: one CSV row from the JSON
run() {
  local config=$1 steps=$2; shift 2
  # shellcheck disable=SC2046
  OMP_NUM_THREADS=1 mpirun -np 2 "$bin" dit --json --out "" --mode flat --steps "$steps" $(config_args "$config") "$@" \
    > "$tmp/out.json"
  python3 - "$tmp/out.json" "$config" "$(cut -d' ' -f1 /proc/loadavg)" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
assert j["scale_bytes"] == j["predicted_scale_bytes"], (j["scale_bytes"], j["predicted_scale_bytes"])
total = j["bytes_intra_group"] + j["bytes_inter_group"]
ref = "psnr" in j  # the exact f32 run itself has no reference: empty quality columns
psnr = j["psnr"] if ref else ""
row = [sys.argv[2], j["family"], j["steps"], j["P"], j["dtype"], j["wire"], j["mode"], j["cfg_passes"],
       ("inf" if psnr is None else round(psnr, 2)) if ref else "", round(j["ssim"], 6) if ref else "",
       j["max_abs_diff"] if ref else "",
       int(total), int(j["scale_bytes"]), int(total - j["scale_bytes"]), round(j["step_ms"], 1),
       round(j["exposed_comm_ms"], 2), sys.argv[3]]
print(",".join(str(v) for v in row))
PY
}

echo "config,family,steps,P,dtype,wire,mode,cfg_passes,psnr_vs_f32,ssim_vs_f32,max_abs_diff_vs_f32,bytes_per_step,scale_bytes_per_step,payload_bytes_per_step,step_ms,exposed_comm_ms,load1" > $out
for config in flux1_tiny sd3_tiny flux1_realwidth; do
  steps_list=$STEPS
  [ "$config" = flux1_realwidth ] && steps_list=$RW_STEPS
  for steps in $steps_list; do
    ref=$tmp/${config}_${steps}.npy
    run "$config" "$steps" --save-latent "$ref" | tee -a $out                 # the exact f32 run
    run "$config" "$steps" --wire fp8 --reference "$ref" | tee -a $out        # fp8 wire, f32 compute
    run "$config" "$steps" --dtype bf16 --reference "$ref" | tee -a $out      # bf16 compute and wire
    run "$config" "$steps" --dtype bf16 --wire fp8 --reference "$ref" | tee -a $out  # bf16 compute, fp8 wire
  done
done
echo "wrote $out"
