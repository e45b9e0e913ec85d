#!/usr/bin/env bash
# family_numpy_check.sh FAMILY DIFFCP: `diffcp dit` on diffusers pipeline folders of one DiT family
# (qwen_image, flux2, sd3, wan) written by an independent NumPy tool (tools/qwenimage_reference.py,
# tools/flux2_reference.py, tools/sd3_reference.py, tools/wan_reference.py make: the diffusers class's tensor names, F32 / BF16 / F16, sharded or
# not, the published model's scheduler_config.json), every step's velocity (--dump-velocity;
# Qwen-Image's and SD3.5's with classifier-free guidance the guided one; SD3.5's in its latent image
# layout [b, C, H/8, W/8]; Wan's in its video layout [b, C, F, H/8, W/8]) against a NumPy float64 forward
# and sampler written from diffusers' transformer and pipeline code (the tool's check), under every
# mode and several P; and the pipeline folder and its transformer folder give the same bytes.
set -euo pipefail
py=${DIFFCP_PYTHON:-python3}  # a python3 with numpy (tests/CMakeLists.txt)
family=${1:?usage: family_numpy_check.sh qwen_image|flux2|sd3|wan DIFFCP}
bin=${2:?usage: family_numpy_check.sh qwen_image|flux2|sd3|wan DIFFCP}
here=$(cd "$(dirname "$0")" && pwd)
case $family in
  qwen_image) ref="$here/../../tools/qwenimage_reference.py" ;;
  flux2) ref="$here/../../tools/flux2_reference.py" ;;
  sd3) ref="$here/../../tools/sd3_reference.py" ;;
  wan) ref="$here/../../tools/wan_reference.py" ;;
  *) echo "family_numpy_check.sh: unknown family '$family'" >&2; exit 2 ;;
esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

opt() {  # opt NAME DEFAULT "ARGS": the value after --NAME in ARGS
  "$py" -c "import sys; a=sys.argv[3].split(); print(a[a.index('--'+sys.argv[1])+1] if '--'+sys.argv[1] in a else sys.argv[2])" "$@"
}

# case: name, make options, P, mode, steps, guidance ("-": none given), extra diffcp options
run_case() {
  local name=$1 make=$2 P=$3 mode=$4 steps=$5 g=$6 extra=${7:-}
  local d="$work/$name" gopt=() neg=() chk=() pooled=()
  # shellcheck disable=SC2086
  "$py" "$ref" make --out "$d" $make >/dev/null
  local W H
  W=$(opt width 64 "$make")
  H=$(opt height 48 "$make")
  if [ "$g" != - ]; then
    gopt=(--guidance "$g")
    chk=(--guidance "$g")
  fi
  local save=()
  if [ "$family" = wan ]; then  # and the final latent: the last update (UniPC's at sigma 0) is checked too
    chk+=(--frames "$(opt frames 3 "$make")" --latent "$d/latent.npy")
    save=(--save-latent "$d/latent.npy")
  fi
  if [ "$family" = sd3 ]; then
    pooled=(--pooled "$d/pooled.npy")
    chk+=(--pooled "$d/pooled.npy" --neg-pooled "$d/neg_pooled.npy")
  fi
  if [ "$family" != flux2 ]; then
    chk+=(--neg "$d/neg.npy")
    if "$py" -c "import sys; sys.exit(0 if float(sys.argv[1]) > 1 else 1)" "$g"; then
      neg=(--negative-text-embeddings "$d/neg.npy")
      [ "$family" = sd3 ] && neg+=(--negative-pooled "$d/neg_pooled.npy")
    fi
  fi
  # shellcheck disable=SC2086
  mpirun --oversubscribe -np "$P" "$bin" dit --weights "$d" --text-embeddings "$d/txt.npy" "${pooled[@]}" "${neg[@]}" \
    --noise "$d/noise.npy" --width "$W" --height "$H" --steps "$steps" "${gopt[@]}" --mode "$mode" \
    --group-size 1 --dump-velocity "$d/dump" --out "" --weights-dtype f32 "${save[@]}" $extra >/dev/null
  echo "== $family $name: P = $P, mode $mode, guidance $g, $steps steps, make: $make, diffcp: $extra"
  "$py" "$ref" check --weights "$d" --txt "$d/txt.npy" --noise "$d/noise.npy" --width "$W" --height "$H" \
    --steps "$steps" "${chk[@]}" --dump "$d/dump" --tol 2e-5
}

if [ "$family" = qwen_image ]; then
  # True CFG (QwenImagePipeline's default scale 4) with a negative prompt of another length, bf16
  # weights in two shards, TAPA at P = 2.
  run_case bf16 "--dtype bf16 --shards 2 --text-tokens 8 --neg-tokens 4" 2 tapa 3 4.0
  # One conditional pass (guidance 1), f16, batch 2, an 80x48 image (15 image and 9 text tokens per
  # image: 5 and 3 a rank) at P = 3, CoCoDiff with r = 0 (exact).
  run_case f16_p3 "--dtype f16 --batch 2 --width 80 --height 48 --text-tokens 9 --heads 3 --head-dim 16" \
    3 cocodiff 3 1 "--cache-schedule fixed --cache-ratio 0 --warmup 0"
  # f32, three blocks, RoPE axes of another split, an odd grid height (3 x 4 tokens: rows centred
  # at -2 .. 0, columns at -2 .. 1), CFG 2.5 at P = 4 with V-First.
  run_case f32_p4 "--dtype f32 --layers 3 --axes-dim 2,8,6 --text-tokens 8 --neg-tokens 12" 4 vfirst 3 2.5
  # USP: Ulysses 2 x Ring 2 at P = 4, CFG 4.
  run_case usp "--text-tokens 8 --neg-tokens 4" 4 flat 2 4.0 "--ulysses-degree 2 --ring-degree 2"
  both=(--negative-text-embeddings "$work/bf16/neg.npy")
elif [ "$family" = sd3 ]; then
  # Classifier-free guidance at StableDiffusion3Pipeline's default 7 with a negative prompt of
  # another length, bf16 weights in two shards, TAPA at P = 2.
  run_case bf16 "--dtype bf16 --shards 2 --text-tokens 8 --neg-tokens 4" 2 tapa 3 7.0
  # One conditional pass, f16, batch 2, an 80x48 image (15 tokens, 5 a rank; the position table
  # cropped at offsets (1, 1)) at P = 3, CoCoDiff with r = 0 (exact).
  run_case f16_p3 "--dtype f16 --batch 2 --width 80 --height 48 --text-tokens 9 --heads 3" \
    3 cocodiff 3 1 "--cache-schedule fixed --cache-ratio 0 --warmup 0"
  # f32, three blocks (the last one's text stream context-pre-only), a 6 x 6 position table, CFG 3
  # at P = 4 with V-First.
  run_case f32_p4 "--dtype f32 --layers 3 --pos-max 6 --text-tokens 8 --neg-tokens 12" 4 vfirst 3 3.0
  # USP: Ulysses 2 x Ring 2 at P = 4, CFG 7.
  run_case usp "--text-tokens 8 --neg-tokens 4" 4 flat 2 7.0 "--ulysses-degree 2 --ring-degree 2"
  both=(--pooled "$work/bf16/pooled.npy" --negative-text-embeddings "$work/bf16/neg.npy"
        --negative-pooled "$work/bf16/neg_pooled.npy")
elif [ "$family" = wan ]; then
  # Three latent frames of 64x48 (3 x 3 x 4 = 36 tokens), WanPipeline's guidance 5 with a negative
  # prompt of another length: flat at P = 1; bf16 weights in two shards, TAPA at P = 2.
  run_case f32_p1 "--text-tokens 7 --neg-tokens 5" 1 flat 2 5.0
  run_case bf16 "--dtype bf16 --shards 2 --text-tokens 8 --neg-tokens 4" 2 tapa 3 5.0
  # One conditional pass, f16, 6 heads, 2 frames of 80x32 (20 tokens: 7, 7 and 6 a rank) at P = 3,
  # CoCoDiff with r = 0 (exact).
  run_case f16_p3 "--dtype f16 --frames 2 --width 80 --height 32 --heads 6 --text-tokens 9" \
    3 cocodiff 3 1 "--cache-schedule fixed --cache-ratio 0 --warmup 0"
  # f32, three blocks, head_dim 20 (RoPE 8 / 6 / 6), no cross-attention norm, CFG 3 at P = 4 with V-First.
  run_case f32_p4 "--dtype f32 --layers 3 --head-dim 20 --no-cross-attn-norm --text-tokens 8 --neg-tokens 12" 4 vfirst 3 3.0
  # USP: Ulysses 2 x Ring 2 at P = 4; CFG-parallel at P = 4 (two ranks a pass).
  run_case usp "--text-tokens 8 --neg-tokens 4" 4 flat 2 5.0 "--ulysses-degree 2 --ring-degree 2"
  run_case cfgp "--text-tokens 8 --neg-tokens 4" 4 tapa 2 5.0 "--cfg-parallel"
  # The weights sharded over the ranks (gathered per block unit), First-Block Cache at threshold 0
  # (computes every step), batch-free V-First at P = 2.
  run_case shard "--text-tokens 8 --neg-tokens 4" 2 vfirst 2 5.0 "--shard-weights --step-cache fbcache:0"
  # The scheduler Wan's folders ship: UniPC (flow, bh2) of order 2 at P = 2 (4 steps: the warm-up at
  # order 1, the corrector, the last step at order 1) and of order 3 at P = 3 (5 steps: the 3 x 3 system).
  run_case unipc "--scheduler unipc --text-tokens 8 --neg-tokens 4" 2 tapa 4 5.0
  run_case unipc3 "--scheduler unipc --solver-order 3 --frames 2 --width 80 --height 32 --text-tokens 5" 3 flat 5 1
  # UniPC's model timesteps trunc(N sigma) over long schedules, against the reference's (NumPy's
  # linspace, as diffusers): flow_shift 3 at 111 steps and 1 at 9 steps put an N sigma on an integer
  # that another rounding of the linspace crosses.
  for sk in "3 111" "1 9"; do
    # shellcheck disable=SC2086
    set -- $sk
    "$py" - "$work/unipc/scheduler/scheduler_config.json" "$1" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["flow_shift"] = float(sys.argv[2]); json.dump(c, open(sys.argv[1], "w"))
PY
    "$bin" dit --weights "$work/unipc" --dry-run --json --steps "$2" --width 64 --height 48 --frames 3 --text-tokens 8 \
      --guidance 1 | "$py" -c "
import json, sys
sys.path.insert(0, sys.argv[1])
import wan_reference as w
j = json.loads(sys.stdin.read())
sig, model = w.unipc_schedule(json.load(open(sys.argv[2])), int(sys.argv[3]))
ok = j['model_timesteps'] == model and max(abs(a - b) for a, b in zip(j['timesteps'], sig)) == 0
print(f'== wan unipc schedule, flow_shift {sys.argv[4]}, {sys.argv[3]} steps: model timesteps and sigmas',
      'equal the reference' if ok else 'MISMATCH')
sys.exit(0 if ok else 1)" "$(dirname "$ref")" "$work/unipc/scheduler/scheduler_config.json" "$2" "$1"
  done
  both=(--negative-text-embeddings "$work/bf16/neg.npy")
else
  # FLUX.2-dev-like (guidance embedding, guidance 4.5), bf16 weights in two shards, TAPA at P = 2.
  run_case bf16 "--dtype bf16 --shards 2" 2 tapa 3 4.5
  # No guidance embedding, f16, batch 2, an 80x48 image at P = 3 (5 image and 3 text tokens a rank),
  # CoCoDiff with r = 0 (exact).
  run_case f16_p3 "--dtype f16 --guidance-embed 0 --batch 2 --width 80 --height 48 --text-tokens 9 --heads 3" \
    3 cocodiff 3 - "--cache-schedule fixed --cache-ratio 0 --warmup 0"
  # f32, two double and one single block, mlp_ratio 2.5, another RoPE split, P = 4 with V-First.
  run_case f32_p4 "--dtype f32 --layers 2 --single-layers 1 --mlp-ratio 2.5 --axes-dim 4,4,4,4" 4 vfirst 3 3.0
  # USP: Ulysses 2 x Ring 2 at P = 4.
  run_case usp "--text-tokens 8" 4 flat 2 4.0 "--ulysses-degree 2 --ring-degree 2"
  both=()
fi
# The pipeline folder and its transformer folder (no scheduler there: --schedule linear both ways)
# give the same velocities, byte for byte.
d="$work/bf16"
for w in "$d" "$d/transformer"; do
  mpirun --oversubscribe -np 2 "$bin" dit --weights "$w" --text-embeddings "$d/txt.npy" "${both[@]}" \
    --noise "$d/noise.npy" --width 64 --height 48 --steps 2 --schedule linear --mode vfirst --group-size 1 \
    --dump-velocity "$w/dump_linear" --out "" --weights-dtype f32 >/dev/null
done
for s in 0 1; do cmp "$d/dump_linear/velocity_$s.npy" "$d/transformer/dump_linear/velocity_$s.npy"; done
echo "== the pipeline folder and its transformer folder give the same velocities, byte for byte"
echo "family_numpy_check $family: passed"
