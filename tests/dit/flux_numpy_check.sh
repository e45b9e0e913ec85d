#!/usr/bin/env bash
# flux_numpy_check.sh DIFFCP: `diffcp dit` on FLUX-format checkpoints written by an independent
# numpy tool (tools/flux_reference.py make: BFL's tensor names, F32 / BF16 / F16, sharded with an
# index JSON, with and without guidance_in and qkv biases, rectangular images), its velocity at
# every step (--dump-velocity) against a numpy float64 implementation of FLUX's forward and
# sampler written from FLUX's public code (tools/flux_reference.py check), under every mode and
# several P; the shape is read off the checkpoint, or from the FluxParams --config where the RoPE
# axes are not FLUX's default split. The same model written in diffusers' layout (a pipeline
# folder) runs bit for bit as BFL's file does, and the reference reads that folder itself.
set -euo pipefail
py=${DIFFCP_PYTHON:-python3}  # a python3 with numpy (tests/CMakeLists.txt)
bin=${1:?usage: flux_numpy_check.sh DIFFCP}
here=$(cd "$(dirname "$0")" && pwd)
ref="$here/../../tools/flux_reference.py"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# case: name, make options, P, mode, schedule, steps, extra diffcp options, inputs as "f2" / "f8"
# (.npy in float16 / float64, which diffcp converts; default float32)
run_case() {
  local name=$1 make=$2 P=$3 mode=$4 schedule=$5 steps=$6 extra=${7:-} inputs=${8:-f4}
  local d="$work/$name"
  extra=${extra//CONFIG/$d/config.json}
  # shellcheck disable=SC2086
  "$py" "$ref" make --out "$d" $make >/dev/null
  if [ "$inputs" != f4 ]; then
    "$py" -c "import numpy as n, sys; [n.save(f, n.load(f).astype(sys.argv[1])) for f in sys.argv[2:]]" "<$inputs" \
      "$d/txt.npy" "$d/pooled.npy" "$d/noise.npy"
  fi
  local weights="$d/model.safetensors"
  [ -f "$weights" ] || weights="$d/model.safetensors.index.json"
  local W H
  W=$("$py" -c "import sys; a=sys.argv[1].split(); print(a[a.index('--width')+1] if '--width' in a else 64)" "$make")
  H=$("$py" -c "import sys; a=sys.argv[1].split(); print(a[a.index('--height')+1] if '--height' in a else 32)" "$make")
  # shellcheck disable=SC2086
  mpirun --oversubscribe -np "$P" "$bin" dit --weights "$weights" --text-embeddings "$d/txt.npy" --pooled "$d/pooled.npy" \
    --noise "$d/noise.npy" --width "$W" --height "$H" --steps "$steps" --schedule "$schedule" --mode "$mode" \
    --group-size 1 --dump-velocity "$d/dump" --out "" --weights-dtype "${WEIGHTS_DTYPE:-f32}" $extra >/dev/null
  local g=3.5
  [[ "$extra" == *"--guidance "* ]] && g=$("$py" -c "import sys; a=sys.argv[1].split(); print(a[a.index('--guidance')+1])" "$extra")
  echo "== $name: P = $P, mode $mode, $schedule schedule, $steps steps, make: $make, diffcp: $extra"
  "$py" "$ref" check --weights "$weights" --config "$d/config.json" --txt "$d/txt.npy" --pooled "$d/pooled.npy" \
    --noise "$d/noise.npy" --width "$W" --height "$H" --steps "$steps" --schedule "$schedule" --guidance "$g" \
    --dump "$d/dump" --tol "${TOL:-2e-5}"
}

# FLUX.1-dev-like: guidance_in, bf16, two shards, flux schedule, TAPA at P = 2.
run_case dev_bf16 "--dtype bf16 --shards 2 --guidance-embed 1 --width 64 --height 32" 2 tapa flux 4 "--guidance 4.5"
# The same file with its weights resident in bf16 (--weights-dtype auto: bf16 for a BF16 file), so
# every GEMM rounds its activations to bf16: within 1e-2 of the float64 reference (measured 4.3e-3).
WEIGHTS_DTYPE=auto TOL=1e-2 run_case dev_bf16_resident "--dtype bf16 --shards 2 --guidance-embed 1 --width 64 --height 32" \
  2 tapa flux 4 "--guidance 4.5"
# FLUX.1-schnell-like: no guidance_in, f16, linear schedule, no qkv bias; batch 2, 48x80 pixels,
# P = 3 (15 image tokens and 9 text tokens per image: 5 and 3 a rank), CoCoDiff with r = 0 (exact);
# the inputs as float16 .npy.
run_case schnell_f16 "--dtype f16 --qkv-bias 0 --batch 2 --width 80 --height 48 --text-tokens 9 --heads 3 --hidden 48 --axes-dim 4,6,6" \
  3 cocodiff linear 3 "--cache-schedule fixed --cache-ratio 0 --warmup 0" f2
# f32 with RoPE axes that are not FLUX's default split (the --config gives them), P = 4, V-First;
# 2 double + 1 single blocks, mlp_ratio 3.5; the inputs as float64 .npy.
run_case f32_axes "--dtype f32 --depth 2 --depth-single 1 --mlp-ratio 3.5 --axes-dim 2,8,6 --width 64 --height 64 --text-tokens 8" \
  4 vfirst flux 3 "--config CONFIG" f8
# diffusers' layout (issue #34): one model written twice by the reference (BFL's sharded file; a
# diffusers pipeline folder, bf16, sharded), run from the file, the pipeline folder and its
# transformer folder at P = 2 with V-First: the three velocity dumps are equal byte for byte, and
# the reference checks the folder's run from the folder's own tensors.
d="$work/diffusers"
mk="--dtype bf16 --shards 2 --guidance-embed 1 --width 64 --height 32"
# shellcheck disable=SC2086
"$py" "$ref" make --out "$d/bfl" $mk >/dev/null
# shellcheck disable=SC2086
"$py" "$ref" make --out "$d/pipe" $mk --format diffusers >/dev/null
k=0
for w in "$d/bfl/model.safetensors.index.json" "$d/pipe" "$d/pipe/transformer"; do
  mpirun --oversubscribe -np 2 "$bin" dit --weights "$w" --text-embeddings "$d/bfl/txt.npy" --pooled "$d/bfl/pooled.npy" \
    --noise "$d/bfl/noise.npy" --width 64 --height 32 --steps 3 --mode vfirst --group-size 1 --dump-velocity "$d/dump$k" \
    --schedule flux --out "" --weights-dtype f32 >/dev/null
  k=$((k + 1))
done
for s in 0 1 2; do
  cmp "$d/dump0/velocity_$s.npy" "$d/dump1/velocity_$s.npy"
  cmp "$d/dump0/velocity_$s.npy" "$d/dump2/velocity_$s.npy"
done
echo "== diffusers layout: the pipeline folder and the transformer folder give BFL's file's velocities, byte for byte"
"$py" "$ref" check --weights "$d/pipe" --config "$d/pipe/config.json" --txt "$d/bfl/txt.npy" --pooled "$d/bfl/pooled.npy" \
  --noise "$d/bfl/noise.npy" --width 64 --height 32 --steps 3 --schedule flux --dump "$d/dump1" --tol 2e-5
# The pipeline's own scheduler_config.json (--schedule auto): a non-default one (linear time shift
# with other base / max shifts, a shift_terminal), the sigmas and velocities against the
# reference's FluxPipeline + FlowMatchEulerDiscreteScheduler, at P = 4 with TAPA.
"$py" - "$d/pipe/scheduler/scheduler_config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.update(time_shift_type="linear", base_shift=0.3, max_shift=1.4, shift_terminal=0.05)
json.dump(c, open(sys.argv[1], "w"))
PY
mpirun --oversubscribe -np 4 "$bin" dit --weights "$d/pipe" --text-embeddings "$d/bfl/txt.npy" --pooled "$d/bfl/pooled.npy" \
  --noise "$d/bfl/noise.npy" --width 64 --height 32 --steps 4 --mode tapa --group-size 2 --dump-velocity "$d/dump_sched" \
  --out "" --weights-dtype f32 >/dev/null
echo "== diffusers layout: the pipeline's scheduler_config.json (linear time shift, shift_terminal 0.05), P = 4, TAPA"
"$py" "$ref" check --weights "$d/pipe" --config "$d/pipe/config.json" --txt "$d/bfl/txt.npy" --pooled "$d/bfl/pooled.npy" \
  --noise "$d/bfl/noise.npy" --width 64 --height 32 --steps 4 --schedule scheduler_config \
  --scheduler-config "$d/pipe/scheduler/scheduler_config.json" --dump "$d/dump_sched" --tol 2e-5
echo "flux_numpy_check: passed"
