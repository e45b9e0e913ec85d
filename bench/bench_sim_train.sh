#!/usr/bin/env bash
# `diffcp sim train` against real training runs (issue #12): the `small` preset trained from
# safetensors shards (the real trainer's data path: the target's hidden states are read, not
# computed; the synthetic source's frozen target forward is not part of a drafter step and sim
# train does not model it), at P = 1 and P = 2 on shared memory (one rank per core, OMP 1 thread).
# Every round: `diffcp sim calibrate` under the same launcher, `diffcp train --data SHARDS`, and
# `diffcp sim train` on that profile; medians over ROUNDS of the median step (the trainer's) and
# of the prediction, per-phase columns beside. Writes bench/sim_train_validation.csv.
# The shards hold random tokens and hidden states of the preset's shape (timing does not depend on
# their values): SAMPLES samples of 256 tokens, a quarter of each a prompt (no loss there).
# Usage: [ROUNDS=3] [STEPS=6] [SAMPLES=208] bench/bench_sim_train.sh   (a release build; python3 with numpy)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=${DIFFCP_BIN:-build/release/src/diffcp}
py=${DIFFCP_PYTHON:-/usr/bin/python3}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-6}
SAMPLES=${SAMPLES:-208}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
out=bench/sim_train_validation.csv
shape=(--preset small --context 8192 --anchors 4)

# Shards of the small preset: V 256, H 512, n_t 3 target layers (drafter/config.cpp).
"$py" - "$tmp/shards" "$SAMPLES" <<'PY'
import json, os, struct, sys
import numpy as np
d, n = sys.argv[1], int(sys.argv[2])
V, H, T, L = 256, 512, 3, 256
os.makedirs(d)
rng = np.random.default_rng(1)
def write(path, tensors):
    header, blobs, off = {}, [], 0
    for name, arr, dt in tensors:
        b = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)
write(f"{d}/model.safetensors",
      [("embedding", rng.standard_normal((V, H), dtype=np.float32), "F32"),
       ("lm_head", (rng.standard_normal((H, V), dtype=np.float32) / np.sqrt(H)).astype(np.float32), "F32")])
rows = n * L
tokens = rng.integers(0, V - 1, rows, dtype=np.int32)  # the mask token (V - 1) never appears in text
mask = np.tile((np.arange(L) >= L // 4).astype(np.uint8), n)
offsets = np.arange(0, rows + 1, L, dtype=np.int64)
hidden = np.tanh(rng.standard_normal((rows, T * H), dtype=np.float32))
write(f"{d}/shard_00000.safetensors",
      [("tokens", tokens, "I32"), ("loss_mask", mask, "U8"), ("offsets", offsets, "I64"), ("hidden", hidden, "F32")])
PY

for np_ in 1 2; do
  for i in $(seq "$ROUNDS"); do
    echo "== P = $np_ (round $i of $ROUNDS)" >&2
    mpirun -np "$np_" --bind-to core "$bin" sim calibrate --n-q 8 --n-kv 2 --d-h 64 --out "$tmp/p$np_.$i.json" >/dev/null
    mpirun -np "$np_" --bind-to core "$bin" train "${shape[@]}" --data "$tmp/shards" --steps "$STEPS" --eval-every 0 \
      --no-progress >"$tmp/train$np_.$i.txt"
    "$bin" sim train "${shape[@]}" --profile "$tmp/p$np_.$i.json" --P "$np_" --ranks-per-node "$np_" --json \
      >"$tmp/sim$np_.$i.json"
  done
done

"$py" - "$tmp" "$ROUNDS" "$out" <<'PY'
import json, re, statistics, sys
tmp, rounds, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
med = statistics.median
rows = []
for P in (1, 2):
    meas, pred, phases = [], [], []
    for i in range(1, rounds + 1):
        text = open(f"{tmp}/train{P}.{i}.txt").read()
        meas.append(float(re.search(r"median step ([0-9.]+) ms", text).group(1)))
        ph = dict((k, float(v)) for k, v in re.findall(r" ([a-z_]+) ([0-9.]+)", text.split("ms per step:")[1].splitlines()[0]))
        phases.append(ph)
        pred.append(json.load(open(f"{tmp}/sim{P}.{i}.json")))
    m, p = med(meas), med(r["step_ms"] for r in pred)
    mp = {k: med(ph[k] for ph in phases) for k in phases[0]}
    pp = {k: med(r["phases"][k] for r in pred) for k in pred[0]["phases"]}
    rows.append((P, m, p, 100 * (p / m - 1), 100 * (max(meas) - min(meas)) / m, mp, pp, pred[0]["shard"], pred[0]["oproj"]))
with open(out, "w") as f:
    f.write("P,shard,oproj,measured_step_ms,predicted_step_ms,step_error_pct,measured_spread_pct,rounds,measured_phases,predicted_phases\n")
    for P, m, p, e, s, mp, pp, shard, oproj in rows:
        kv = lambda d: ";".join(f"{k}={v:.1f}" for k, v in d.items())
        f.write(f"{P},{shard},{oproj},{m:.1f},{p:.1f},{e:.1f},{s:.1f},{rounds},{kv(mp)},{kv(pp)}\n")
        print(f"P = {P} (--shard {shard}, oproj {oproj}): measured median step {m:.1f} ms (spread {s:.1f} %), predicted {p:.1f} ms, {e:+.1f} %")
        print(f"  measured phases (ms per step): " + ", ".join(f"{k} {v:.0f}" for k, v in mp.items()))
        print(f"  predicted phases (ms per step): " + ", ".join(f"{k} {v:.0f}" for k, v in pp.items()))
    if len(rows) == 2:
        print(f"P = 2 / P = 1 step speed-up: measured {rows[0][1] / rows[1][1]:.2f}x, predicted {rows[0][2] / rows[1][2]:.2f}x")
PY
