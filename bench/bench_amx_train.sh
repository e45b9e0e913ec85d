#!/usr/bin/env bash
# The main job's train step (issue #69): `diffcp train --preset small`, one 4096-token sample per step,
# 64 anchors, P = 1 with both cores' threads (OMP_NUM_THREADS=2, one rank, --bind-to none), in f32, in
# bf16 mixed precision, and in bf16 with AMX off (DIFFCP_CPU_AMX=0: the attention's tile path, what a
# CPU without AMX runs); each round runs the three back to back, then bench_attention's same-run
# oneDNN GEMM rates (2048^3, f32 and bf16), REPEAT rounds (default 5). Writes one row per run to
# bench/amx_train.csv (AMX_TRAIN_CSV): round, variant, median step ms, tokens/s, the GEMM rates, and
# the step's phases (ms per step, as `diffcp train` prints them); prints the medians over the rounds.
#   bench/bench_amx_train.sh            # REPEAT=5 STEPS=6
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=${DIFFCP_BIN:-build/release/src/diffcp}
bench=${BENCH_ATTENTION:-build/release/bench/bench_attention}
out=${AMX_TRAIN_CSV:-bench/amx_train.csv}
steps=${STEPS:-6}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
train() {  # round, variant, dtype, env...: one line "round variant ms tokens phases..."
  local round=$1 variant=$2 dt=$3
  shift 3
  env OMP_NUM_THREADS=2 "$@" mpirun -np 1 --bind-to none "$bin" train --no-progress --eval-every 0 --dtype "$dt" \
    --preset small --context 4096 --anchors 64 --steps "$steps" |
    awk -v tag="$round $variant" '/median step/ {s = $0; sub(/.*median step /, "", s); sub(/ ms.*/, "", s);
        t = $0; sub(/ tokens\/s.*/, "", t); sub(/.* /, "", t)} /ms per step:/ {p = $0; sub(/.*ms per step: /, "", p)}
      END {print tag, s, t, p}'
}
for round in $(seq "${REPEAT:-5}"); do
  train "$round" f32 f32 >>"$log"
  train "$round" bf16 bf16 >>"$log"
  # AMX off only where AMX exists (elsewhere it is the bf16 run again)
  if grep -qw amx_tile /proc/cpuinfo; then train "$round" bf16_amx_off bf16 DIFFCP_CPU_AMX=0 >>"$log"; fi
  OMP_NUM_THREADS=2 "$bench" --samples 1 --context 1024 --anchors 8 --reps 3 --dtype f32 --json |
    python3 -c 'import json, sys; j = json.loads(sys.stdin.read().splitlines()[-1]); print(sys.argv[1], "gemm", j["gemm_f32_gflops"], j["gemm_bf16_gflops"])' "$round" >>"$log"
done
python3 - "$log" "$out" <<'PY'
import csv, statistics, sys
runs, gemm = [], {}
for line in open(sys.argv[1]):
    f = line.split()
    if f[1] == "gemm":
        gemm[f[0]] = tuple(float(x) if x != "None" else float("nan") for x in f[2:4])  # None: no bf16 GEMM (AVX2)
        continue
    phases = dict(zip(f[4::2], map(float, f[5::2])))
    runs.append({"round": f[0], "variant": f[1], "step_ms": float(f[2]), "tokens_per_s": float(f[3]), **phases})
names = sorted({k for r in runs for k in r} - {"round", "variant", "step_ms", "tokens_per_s"})
with open(sys.argv[2], "w", newline="") as fh:
    w = csv.DictWriter(fh, ["round", "variant", "step_ms", "tokens_per_s", "gemm_f32_gflops", "gemm_bf16_gflops"] +
                       [f"{n}_ms" for n in names])
    w.writeheader()
    for r in runs:
        g = gemm[r["round"]]
        w.writerow({"round": r["round"], "variant": r["variant"], "step_ms": r["step_ms"],
                    "tokens_per_s": r["tokens_per_s"], "gemm_f32_gflops": g[0], "gemm_bf16_gflops": g[1],
                    **{f"{n}_ms": r.get(n, "") for n in names}})
med = lambda v: statistics.median(v)
for variant in ("f32", "bf16", "bf16_amx_off"):
    rs = [r for r in runs if r["variant"] == variant]
    if not rs:
        continue
    print(f"{variant}: median step {med([r['step_ms'] for r in rs]):.0f} ms over {len(rs)} rounds; phases (medians): " +
          " ".join(f"{n} {med([r[n] for r in rs if n in r]):.0f}" for n in names if any(n in r for r in rs)))
by = {(r["round"], r["variant"]): r["step_ms"] for r in runs}
rounds = sorted({r["round"] for r in runs})
print("bf16 / f32 step speed-up (median of each round's own): %.2fx" % med([by[(k, "f32")] / by[(k, "bf16")] for k in rounds]))
if all((k, "bf16_amx_off") in by for k in rounds):
    print("AMX on / off, bf16 step (median of each round's own): %.2fx" % med([by[(k, "bf16_amx_off")] / by[(k, "bf16")] for k in rounds]))
span = lambda v: "n/a" if any(x != x for x in v) else "%.0f-%.0f" % (min(v), max(v))  # nan: no bf16 GEMM
print("same-run oneDNN GEMM 2048^3: f32 %s GFLOP/s, bf16 %s GFLOP/s (min-max over the rounds)" % (
    span([g[0] for g in gemm.values()]), span([g[1] for g in gemm.values()])))
PY
