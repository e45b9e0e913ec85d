#!/usr/bin/env bash
# dflash_numpy_check.sh DIFFCP: a drafter trained by `diffcp train`, exported in the DFlash format
# (f32 and bf16; and the f32 files converted to F16 by numpy, as a half-precision release would
# ship), drafted with `mpirun -np 3 diffcp draft` (Split-KV over the context), equals an
# independent numpy implementation of the reference forward reading the same files
# (tools/dflash_reference.py). Then the f32 drafter with sliding-window layers (issue #36): layer
# types sliding, full, sliding, full with windows 100 (inside the 301-row context) and 7 (below
# the block), causal and two-sided (is_causal false). The f32 and sliding drafters also draft from
# the draft KV cache (`draft --draft-cache`, issue #53), against the same reference.
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
echo "dflash_numpy_check: passed"
