#!/usr/bin/env bash
# diffusers_fixture.sh PYTHON DIR: diffusers folders for `diffcp dit`'s bad-input tests (issue #34):
# DIR/pipe (a pipeline folder written by tools/flux_reference.py make --format diffusers) and
# transformer folders that share its weights but not its config: bad_class (another class),
# bad_field (a field FluxTransformer2DModel does not have), deeper (num_layers one more than the
# file holds), empty (no config.json); and pipelines that share its transformer but not its
# scheduler: sched_karras (use_karras_sigmas), sched_field (a field the scheduler does not have);
# flux1-dev: FLUX.1-dev's published transformer config.json with a data-less (sparse) file of its
# real shape in diffusers' names. Qwen-Image (tools/qwenimage_reference.py): qwen (a tiny pipeline),
# qwen_zero_cond (zero_cond_t, an edit model's flag), qwen_guidance (guidance_embeds),
# qwen-image (Qwen/Qwen-Image's published config.json, data-less). FLUX.2
# (tools/flux2_reference.py): flux2 (a tiny pipeline), flux2_axes (three RoPE axes), flux2_noguid
# (guidance_embeds false, as FLUX.2 [klein]), flux2-dev (FLUX.2-dev's config.json, data-less). SD3.5
# (tools/sd3_reference.py): sd3 (a tiny pipeline), sd3_dual (SD3.5-medium's dual attention),
# sd3.5-large (stabilityai/stable-diffusion-3.5-large's config.json, data-less). Wan
# (tools/wan_reference.py): wan (a tiny pipeline), wan_i2v (a tiny image-to-video transformer: the
# condition's channels, an image context), wan_half_i2v (image_dim without added_kv_proj_dim),
# wan22_a14b (its pipeline with Wan 2.2 A14B's second expert in model_index.json), wan_unipc_eps
# (a UniPC scheduler predicting noise),
# wan2.1-1.3b (Wan-AI/Wan2.1-T2V-1.3B-Diffusers' config.json, data-less), wan2.2-ti2v-5b (Wan 2.2
# TI2V-5B's transformer config as diffusers' conversion script writes it, data-less), wan2.1-i2v-14b
# (Wan2.1-I2V-14B-480P's transformer config, data-less).
set -euo pipefail
py=${1:?usage: diffusers_fixture.sh PYTHON DIR}
dir=${2:?usage: diffusers_fixture.sh PYTHON DIR}
here="$(cd "$(dirname "$0")" && pwd)"
ref="$here/../../tools/flux_reference.py"
rm -rf "$dir"
"$py" "$ref" make --out "$dir/pipe" --format diffusers >/dev/null
t="$dir/pipe/transformer"
for case in bad_class bad_field deeper; do
  mkdir -p "$dir/$case"
  ln -s "$t/diffusion_pytorch_model.safetensors" "$dir/$case/"
  "$py" - "$t/config.json" "$dir/$case/config.json" "$case" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
case = sys.argv[3]
if case == "bad_class":
    c["_class_name"] = "HunyuanDiT2DModel"
elif case == "bad_field":
    c["mlp_ratio"] = 4.0
else:
    c["num_layers"] += 1
json.dump(c, open(sys.argv[2], "w"))
PY
done
mkdir -p "$dir/empty"
qref="$here/../../tools/qwenimage_reference.py"
"$py" "$qref" make --out "$dir/qwen" --text-tokens 8 --neg-tokens 5 >/dev/null
"$py" "$qref" header --config "$here/../data/qwen-image-diffusers.json" --out "$dir/qwen-image" >/dev/null
fref="$here/../../tools/flux2_reference.py"
"$py" "$fref" make --out "$dir/flux2" >/dev/null
"$py" "$fref" header --config "$here/../data/flux2-dev-diffusers.json" --out "$dir/flux2-dev" >/dev/null
sref="$here/../../tools/sd3_reference.py"
"$py" "$sref" make --out "$dir/sd3" >/dev/null
"$py" "$sref" header --config "$here/../data/sd3.5-large-diffusers.json" --out "$dir/sd3.5-large" >/dev/null
wref="$here/../../tools/wan_reference.py"
"$py" "$wref" make --out "$dir/wan" >/dev/null
"$py" "$wref" header --config "$here/../data/wan2.1-t2v-1.3b-diffusers.json" --out "$dir/wan2.1-1.3b" >/dev/null
"$py" "$wref" header --config "$here/../data/wan2.2-ti2v-5b-diffusers.json" --out "$dir/wan2.2-ti2v-5b" >/dev/null
"$py" "$wref" header --config "$here/../data/wan2.1-i2v-14b-480p-diffusers.json" --out "$dir/wan2.1-i2v-14b" >/dev/null
"$py" "$wref" make --out "$dir/wan_i2v" --condition-channels 8 --image-dim 20 --image-tokens 6 >/dev/null
mkdir -p "$dir/wan_half_i2v"
ln -s "$dir/wan/transformer/diffusion_pytorch_model.safetensors" "$dir/wan_half_i2v/"
"$py" -c "import json, sys; c = json.load(open(sys.argv[1])); c['image_dim'] = 1280; json.dump(c, open(sys.argv[2], 'w'))" \
  "$dir/wan/transformer/config.json" "$dir/wan_half_i2v/config.json"
mkdir -p "$dir/wan_unipc_eps/scheduler"  # UniPC with its default noise prediction (not flow): refused
ln -s "$dir/wan/transformer" "$dir/wan/model_index.json" "$dir/wan_unipc_eps/"
"$py" -c "import json, sys; json.dump({'_class_name': 'UniPCMultistepScheduler', 'prediction_type': 'epsilon', \
'use_flow_sigmas': True, 'flow_shift': 3.0}, open(sys.argv[1], 'w'))" "$dir/wan_unipc_eps/scheduler/scheduler_config.json"
mkdir -p "$dir/wan22_a14b"  # Wan 2.2 A14B's index: a second expert and its boundary
ln -s "$dir/wan/transformer" "$dir/wan/scheduler" "$dir/wan22_a14b/"
"$py" -c "import json, sys; c = json.load(open(sys.argv[1])); c['transformer_2'] = ['diffusers', 'WanTransformer3DModel']; \
c['boundary_ratio'] = 0.875; json.dump(c, open(sys.argv[2], 'w'))" "$dir/wan/model_index.json" "$dir/wan22_a14b/model_index.json"
mkdir -p "$dir/sd3_dual"
ln -s "$dir/sd3/transformer/diffusion_pytorch_model.safetensors" "$dir/sd3_dual/"
"$py" -c "import json, sys; c = json.load(open(sys.argv[1])); c['dual_attention_layers'] = [0]; json.dump(c, open(sys.argv[2], 'w'))" \
  "$dir/sd3/transformer/config.json" "$dir/sd3_dual/config.json"
for case in flux2_axes flux2_noguid; do
  mkdir -p "$dir/$case"
  ln -s "$dir/flux2/transformer/diffusion_pytorch_model.safetensors" "$dir/$case/"
  "$py" - "$dir/flux2/transformer/config.json" "$dir/$case/config.json" "$case" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
if sys.argv[3] == "flux2_axes":
    c["axes_dims_rope"] = [4, 6, 6]
else:
    c["guidance_embeds"] = False
json.dump(c, open(sys.argv[2], "w"))
PY
done
for case in qwen_zero_cond qwen_guidance; do
  mkdir -p "$dir/$case"
  ln -s "$dir/qwen/transformer/diffusion_pytorch_model.safetensors" "$dir/$case/"
  "$py" - "$dir/qwen/transformer/config.json" "$dir/$case/config.json" "$case" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["zero_cond_t" if sys.argv[3] == "qwen_zero_cond" else "guidance_embeds"] = True
json.dump(c, open(sys.argv[2], "w"))
PY
done
"$py" "$ref" header --format diffusers --config "$here/../data/flux1-dev-diffusers.json" --out "$dir/flux1-dev" >/dev/null
for case in sched_karras sched_field; do
  mkdir -p "$dir/$case/scheduler"
  ln -s "$t" "$dir/$case/transformer"
  cp "$dir/pipe/model_index.json" "$dir/$case/"
  "$py" - "$dir/pipe/scheduler/scheduler_config.json" "$dir/$case/scheduler/scheduler_config.json" "$case" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["use_karras_sigmas" if sys.argv[3] == "sched_karras" else "sigma_schedule"] = True
json.dump(c, open(sys.argv[2], "w"))
PY
done
