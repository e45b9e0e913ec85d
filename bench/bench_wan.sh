#!/usr/bin/env bash
# Wan 2.1's video DiT (issue #70), measured on this machine and simulated at the papers' scale.
#
#   step       one denoising step of a transformer of Wan2.1-T2V-1.3B's width (H 1536 = 12 heads x
#              128, FFN 8960, text_dim 4096, 16 latent channels) cut to LAYERS blocks (default 1),
#              random weights (tools/wan_reference.py make), at 480p's token count: 81 frames ->
#              21 latent frames of 60 x 104 -> 21 x 30 x 52 = 32,760 tokens; 512 text tokens (the
#              pipeline's padded prompt), guidance 1 (one pass), f32. P = 1 (flat) and P = 2 in
#              every mode (flat, tapa, vfirst, cocodiff with nothing cached, usp = Ulysses 1 x Ring
#              2), STEPS steps (default 1; step_ms is the CLI's median). P = 1: one rank on both
#              cores (2 OpenMP threads); P = 2: a rank per core (--bind-to core, 1 thread); P = 4
#              (flat, tapa with groups of 2, cocodiff r 0.5 over 2 steps: a full and a selective
#              one): 4 ranks on 2 cores, oversubscribed: bytes only (timed = no).
#              Columns: the step, the bytes per rank per step inside / across groups and their
#              closed form (the cross-attention adds none: every rank holds the text).
#   diffusers  diffusers' WanTransformer3DModel forward on the same folder and inputs on the CPU
#              (torch, 2 threads; PYTHON needs torch + diffusers), timed REPS times (default 2),
#              and its velocity against diffcp's P = 1 step (bench/bench_wan_diffusers.py).
#   sim        `diffcp sim dit` at Wan2.1-T2V-14B's shape (tests/data/wan2.1-t2v-14b-diffusers.json:
#              5120 = 40 heads x 128, FFN 13824, 40 blocks), 480p (32,760 tokens) and 720p (21 x
#              45 x 80 = 75,600), 512 text tokens, one pass, 50 steps, P = 8, 16, 32, 40, 64 on the
#              h100-ib and aurora profiles: flat vs CoCoDiff (cache ratio 0.5, warm-up 5).
#
# Writes bench/wan_step.csv (step, diffusers) and bench/wan_sim.csv (sim). Usage:
# bench/bench_wan.sh [step|diffusers|sim]... (default all); DIFFCP_BIN overrides the binary.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=${DIFFCP_BIN:-build/release/src/diffcp}
py=${PYTHON:-python3}
LAYERS=${LAYERS:-1}
STEPS=${STEPS:-1}
REPS=${REPS:-2}
work=${WORK:-/tmp/diffcp_wan_bench}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(step diffusers sim)
want() { local p; for p in "${parts[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
W=832 Hpx=480 F=21 T=512
machine=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
isa=$(grep -o 'avx512_bf16\|avx512f\|amx_tile\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ' | sed 's/ $//')
today=$(date -u +%F)

folder() {  # the random 1.3B-wide folder, made once
  [ -f "$work/wan/noise.npy" ] && return
  mkdir -p "$work"
  "$py" tools/wan_reference.py make --out "$work/wan" --heads 12 --head-dim 128 --ffn 8960 --channels 16 \
    --text-dim 4096 --text-tokens $T --layers "$LAYERS" --frames $F --width $W --height $Hpx >/dev/null
}

if want step || want diffusers; then folder; fi

if want step; then
  out=bench/wan_step.csv
  echo "machine,isa,date,layers,tokens,text_tokens,P,mode,group_size,timed,step_ms,bytes_intra_group,bytes_inter_group,predicted_bytes_inter_group,exposed_comm_ms,load1" >"$out"
  run() {  # P label mode group_size timed [extra...]
    local P=$1 label=$2 mode=$3 L=$4 timed=$5
    shift 5
    # P = 1: one rank on both cores (2 OpenMP threads); P = 2: a rank per core; P = 4: oversubscribed
    local bind=(--bind-to core -x OMP_NUM_THREADS=1)
    [ "$P" = 1 ] && bind=(--bind-to none -x OMP_NUM_THREADS=2)
    [ "$timed" = no ] && bind=(--oversubscribe --bind-to none -x OMP_NUM_THREADS=1)
    local j
    j=$(mpirun -np "$P" "${bind[@]}" "$bin" dit --weights "$work/wan" --text-embeddings "$work/wan/txt.npy" \
      --noise "$work/wan/noise.npy" --width $W --height $Hpx --steps "${steps:-$STEPS}" --guidance 1 --mode "$mode" \
      --group-size "$L" --out "" --weights-dtype f32 --json "$@" 2>/dev/null | tail -n 1)
    local row
    row=$(echo "$j" | "$py" -c "import json, sys; j = json.load(sys.stdin); print(','.join(str(j[k]) for k in
      ('step_ms', 'bytes_intra_group', 'bytes_inter_group', 'predicted_bytes_inter_group', 'exposed_comm_ms')))")
    echo "\"$machine\",$isa,$today,$LAYERS,$((F * 30 * 52)),$T,$P,$label,$L,$timed,$row,$(cut -d' ' -f1 /proc/loadavg)" >>"$out"
    echo "step: P = $P $label (L = $L, timed $timed): $row"
  }
  rm -rf "$work/dump_p1"
  run 1 flat flat 1 yes --dump-velocity "$work/dump_p1"
  for mode in flat tapa vfirst; do run 2 $mode $mode 1 yes; done
  run 2 cocodiff cocodiff 1 yes --cache-schedule fixed --cache-ratio 0 --warmup 0
  run 2 usp flat 1 yes --ulysses-degree 1 --ring-degree 2
  run 4 flat flat 2 no
  run 4 tapa tapa 2 no
  # two steps: the first is always full, the second V-Major's selective one (bytes: their mean)
  steps=2 run 4 cocodiff_r0.5 cocodiff 2 no --cache-schedule fixed --cache-ratio 0.5 --warmup 0
fi

if want diffusers; then
  "$py" bench/bench_wan_diffusers.py --folder "$work/wan" --dump "$work/dump_p1" --reps "$REPS" --threads 2 \
    --row-prefix "\"$machine\",$isa,$today,$LAYERS,$((F * 30 * 52)),$T" >>bench/wan_step.csv
  tail -n 1 bench/wan_step.csv
fi

if want sim; then
  out=bench/wan_sim.csv
  echo "profile,resolution,tokens,P,mode,step_ms,compute_ms,exposed_comm_ms,bytes_intra_group,bytes_inter_group,total_ms,reason" >"$out"
  for profile in h100-ib aurora; do
    for res in 480p 720p; do
      case $res in 480p) w=832 h=480 ;; 720p) w=1280 h=720 ;; esac
      for P in 8 16 32 40 64; do  # Ulysses needs P | 40 heads: 16, 32, 64 are rows of their reason
        for mode in flat cocodiff; do
          "$bin" sim dit --profile "$profile" --P "$P" --config tests/data/wan2.1-t2v-14b-diffusers.json --width $w \
            --height $h --frames $F --text-tokens $T --steps 50 --mode "$mode" --cache-ratio 0.5 --warmup 5 --json |
            "$py" -c "import json, sys
for r in json.load(sys.stdin):
    cols = [str(r.get(k, '')) for k in ('step_ms', 'compute_ms', 'exposed_comm_ms', 'bytes_intra_group', 'bytes_inter_group', 'total_ms')]
    print(','.join(['$profile', '$res', str($F * ($h // 16) * ($w // 16)), str(r['P']), r['mode']] + cols +
                   ['\"' + r['reason'].split(' (')[0] + '\"' if r['reason'] else '']))" >>"$out"
        done
      done
    done
  done
  echo "sim: $(($(wc -l <"$out") - 1)) rows in $out"
fi
