#!/usr/bin/env bash
# dflash_numpy_check.sh DIFFCP: a drafter trained by `diffcp train`, exported in the DFlash format
# (f32 and bf16; and the f32 files converted to F16 by numpy, as a half-precision release would
# ship), drafted with `mpirun -np 3 diffcp draft` (Split-KV over the context), equals an
# independent numpy implementation of the reference forward reading the same files
# (tools/dflash_reference.py). Then the f32 drafter with sliding-window layers (issue #36): layer
# types sliding, full, sliding, full with windows 100 (inside the 301-row context) and 7 (below
# the block), causal and two-sided (is_causal false). The f32 and sliding drafters also draft from
# the draft KV cache (`draft --draft-cache`, issue #53), against the same reference. Last, a DFlash2
# drafter (issue #67) written by numpy in the released layout, drafted at P = 2 and 3 and from the cache.
set -euo pipefail
py=${DIFFCP_PYTHON:-python3}  # a python3 with numpy (tests/CMakeLists.txt)
bin=${1:?usage: dflash_numpy_check.sh DIFFCP}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# A large learning rate moves every weight (norms too) far from its init in 3 steps, so a
# misplaced or swapped tensor shows.
mpirun -np 2 "$bin" train --preset small --steps 3 --lr 0.2 --context 512 --out "$work/train" --no-progress >/dev/null
"$py" - "$work" <<'PY'
import sys, numpy as np
rng = np.random.default_rng(7)
np.save(f"{sys.argv[1]}/H.npy", rng.standard_normal((301, 3 * 512)).astype(np.float32))  # small: n_t = 3, H = 512
np.save(f"{sys.argv[1]}/E.npy", rng.standard_normal((16, 512)).astype(np.float32))       # B = 16
PY
for dtype in f32 bf16 f16; do
  if [ $dtype = f16 ]; then  # numpy rewrites the f32 export's tensors as F16
    mkdir -p "$work/f16" && cp "$work/f32/config.json" "$work/f16/"
    "$py" - "$work/f32/model.safetensors" "$work/f16/model.safetensors" <<'PY'
import json, struct, sys, numpy as np
src, dst = sys.argv[1], sys.argv[2]
raw = open(src, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
head, data = json.loads(raw[8:8 + n]), raw[8 + n:]
out, blobs, off = {}, [], 0
for name, t in head.items():
    b, e = t["data_offsets"]
    a = np.frombuffer(data[b:e], dtype="<f4").astype("<f2").tobytes()
    out[name] = {"dtype": "F16", "shape": t["shape"], "data_offsets": [off, off + len(a)]}
    blobs.append(a)
    off += len(a)
h = json.dumps(out).encode()
h += b" " * (-len(h) % 8)
open(dst, "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
PY
  else
    "$bin" export --checkpoint "$work/train/checkpoint.bin" --out "$work/$dtype" --dtype $dtype >/dev/null
  fi
  mpirun --oversubscribe -np 3 "$bin" draft --model "$work/$dtype" --target-hidden "$work/H.npy" \
    --noise-embedding "$work/E.npy" --out "$work/got_$dtype.npy" >/dev/null
  echo "$dtype:"
  "$py" "$here/../../tools/dflash_reference.py" "$work/$dtype" "$work/H.npy" "$work/E.npy" "$work/ref_$dtype.npy" \
    --check "$work/got_$dtype.npy" --rtol 2e-5
done
mpirun --oversubscribe -np 3 "$bin" draft --model "$work/f32" --target-hidden "$work/H.npy" \
  --noise-embedding "$work/E.npy" --out "$work/cached_f32.npy" --draft-cache >/dev/null
echo "f32 from the draft cache:"
"$py" "$here/../../tools/dflash_reference.py" "$work/f32" "$work/H.npy" "$work/E.npy" "$work/ref_f32.npy" \
  --check "$work/cached_f32.npy" --rtol 2e-5
for variant in "100 null" "7 null" "100 false"; do
  set -- $variant
  d="$work/sliding_$1_$2"
  mkdir -p "$d" && cp "$work/f32/model.safetensors" "$d/"
  "$py" - "$work/f32/config.json" "$d/config.json" "$1" "$2" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.update(layer_types=["sliding_attention", "full_attention"] * 2, use_sliding_window=True, sliding_window=int(sys.argv[3]))
if sys.argv[4] != "null":
    c["is_causal"] = json.loads(sys.argv[4])
json.dump(c, open(sys.argv[2], "w"))
PY
  mpirun --oversubscribe -np 3 "$bin" draft --model "$d" --target-hidden "$work/H.npy" \
    --noise-embedding "$work/E.npy" --out "$d/got.npy" >/dev/null
  echo "sliding window $1, is_causal $2:"
  "$py" "$here/../../tools/dflash_reference.py" "$d" "$work/H.npy" "$work/E.npy" "$d/ref.npy" --check "$d/got.npy" --rtol 2e-5
  mpirun --oversubscribe -np 2 "$bin" draft --model "$d" --target-hidden "$work/H.npy" \
    --noise-embedding "$work/E.npy" --out "$d/cached.npy" --draft-cache >/dev/null
  echo "  from the draft cache:"
  "$py" "$here/../../tools/dflash_reference.py" "$d" "$work/H.npy" "$work/E.npy" "$d/ref.npy" --check "$d/cached.npy" --rtol 2e-5
  # the window matters: the full-attention drafter's block differs
  "$py" -c "import numpy as np, sys; a, b = np.load(sys.argv[1]), np.load(sys.argv[2]); e = np.abs(a - b).max() / np.abs(b).max(); print(f'  differs from full attention by {e:.3g}'); sys.exit(int(e < 1e-3))" "$d/got.npy" "$work/got_f32.npy"
done
# DFlash2 (issue #67) in the released layout, written here by numpy as z-lab's checkpoints name and
# shape it (convolutions, candidate selector, the logits' multiplier and soft cap), every layer
# sliding and two-sided as the release: the drafted block, at P = 2 and 3 and from the draft cache,
# against the reference with the convolutions.
d2="$work/dflash2"
"$py" - "$d2" <<'PY'
import json, os, struct, sys, numpy as np
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
rng = np.random.default_rng(11)
H, L, nq, nkv, hd, F, V, nt, K, gs, r = 512, 2, 8, 2, 64, 1024, 256, 3, 3, 64, 16
G = H // gs
t = {"fc.weight": rng.standard_normal((H, nt * H)) / np.sqrt(nt * H), "hidden_norm.weight": 1 + 0.2 * rng.standard_normal(H),
     "norm.weight": 1 + 0.2 * rng.standard_normal(H),
     "candidate_selector.hidden_projection.weight": rng.standard_normal((r, H)) / np.sqrt(H),
     "candidate_selector.predecessor_codebook": 0.02 * rng.standard_normal((V, r)),
     "candidate_selector.successor_codebook": 0.02 * rng.standard_normal((V, r))}
for i in range(L):
    p = f"layers.{i}."
    for name, shape in [("input_layernorm.weight", (H,)), ("post_attention_layernorm.weight", (H,)),
                        ("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,))]:
        t[p + name] = 1 + 0.2 * rng.standard_normal(shape)
    for name, shape in [("self_attn.q_proj.weight", (nq * hd, H)), ("self_attn.k_proj.weight", (nkv * hd, H)),
                        ("self_attn.v_proj.weight", (nkv * hd, H)), ("self_attn.o_proj.weight", (H, nq * hd)),
                        ("mlp.gate_proj.weight", (F, H)), ("mlp.up_proj.weight", (F, H)), ("mlp.down_proj.weight", (H, F)),
                        ("attention_conv.kernel_projection.weight", (2 * K * G, H)),
                        ("mlp_conv.kernel_projection.weight", (2 * K * G, H))]:
        t[p + name] = rng.standard_normal(shape) / np.sqrt(shape[1])
    for name in ("attention_conv.base_kernel", "mlp_conv.base_kernel"):
        base = 0.3 * rng.standard_normal((2, K, H))
        base[:, 0] += 1
        t[p + name] = base
head, blobs, off = {}, [], 0
for name, a in t.items():
    b = np.ascontiguousarray(a, dtype="<f4").tobytes()
    head[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
    blobs.append(b)
    off += len(b)
h = json.dumps(head).encode()
h += b" " * (-len(h) % 8)
open(f"{d}/model.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
cfg = {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "attention_bias": False, "is_causal": False,
       "hidden_size": H, "num_hidden_layers": L, "num_attention_heads": nq, "num_key_value_heads": nkv, "head_dim": hd,
       "intermediate_size": F, "vocab_size": V, "rms_norm_eps": 1e-5, "hidden_act": "silu",
       "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "num_target_layers": 8,
       "layer_types": ["sliding_attention"] * L, "use_sliding_window": True, "sliding_window": 100, "max_window_layers": L,
       "dflash_config": {"block_size": 16, "conv_group_size": gs, "conv_kernel_size": K, "final_logit_softcapping": 20.0,
                         "mask_token_id": V - 2, "output_multiplier": 0.2, "selector_rank": r, "selector_top_k": 4,
                         "target_layer_ids": [1, 3, 5]}}
json.dump(cfg, open(f"{d}/config.json", "w"))
PY
for np_ in 2 3; do
  mpirun --oversubscribe -np $np_ "$bin" draft --model "$d2" --target-hidden "$work/H.npy" \
    --noise-embedding "$work/E.npy" --out "$d2/got_$np_.npy" >/dev/null
  echo "dflash2, P = $np_:"
  "$py" "$here/../../tools/dflash_reference.py" "$d2" "$work/H.npy" "$work/E.npy" "$d2/ref.npy" --check "$d2/got_$np_.npy" --rtol 2e-5
done
mpirun --oversubscribe -np 2 "$bin" draft --model "$d2" --target-hidden "$work/H.npy" \
  --noise-embedding "$work/E.npy" --out "$d2/cached.npy" --draft-cache >/dev/null
echo "dflash2 from the draft cache:"
"$py" "$here/../../tools/dflash_reference.py" "$d2" "$work/H.npy" "$work/E.npy" "$d2/ref.npy" --check "$d2/cached.npy" --rtol 2e-5
# the convolutions matter: the reference without them (the same folder read as DFlash) differs
mkdir -p "$work/as_v1" && ln -s "$d2/model.safetensors" "$work/as_v1/model.safetensors"
"$py" -c "import json, sys; c = json.load(open(sys.argv[1])); c['architectures'] = ['DFlashDraftModel']; json.dump(c, open(sys.argv[2], 'w'))" \
  "$d2/config.json" "$work/as_v1/config.json"
"$py" "$here/../../tools/dflash_reference.py" "$work/as_v1" "$work/H.npy" "$work/E.npy" "$work/as_v1/ref.npy" >/dev/null
"$py" -c "import numpy as np, sys; a, b = np.load(sys.argv[1]), np.load(sys.argv[2]); e = np.abs(a - b).max() / np.abs(b).max(); print(f'  differs from the reference without convolutions by {e:.3g}'); sys.exit(int(e < 1e-3))" "$d2/got_2.npy" "$work/as_v1/ref.npy"
echo "dflash_numpy_check: passed"
