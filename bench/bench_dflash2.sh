#!/usr/bin/env bash
# DFlash2 vs DFlash: the drafter's train step at P = 1 and P = 2 (one rank per core, --bind-to
# core, OMP_NUM_THREADS=1), the tiny and small presets (DFlash2 = --arch dflash2: the presets'
# variant with 2-tap grouped dynamic convolutions around every sublayer and a rank-min(256, H)
# candidate selector over the top 16 logits). REPEAT rounds (default 5), the four architectures x
# rank counts of a round back to back, interleaved; the table is the median of the rounds: median
# step ms, tokens/s, and the per-phase ms of the median round (lm_head holds the selector's loss:
# the top-K, its host math and the codebook gradients). Every run goes to bench/dflash2_step.csv
# (DIFFCP_DFLASH2_CSV): preset, arch, P, round, step ms, tokens/s, phases.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=${DIFFCP_BIN:-build/release/src/diffcp}
csv=${DIFFCP_DFLASH2_CSV:-bench/dflash2_step.csv}
repeat=${REPEAT:-5}
presets=${PRESETS:-"tiny small"}
steps=${STEPS:-30}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo "preset,arch,P,round,step_ms,tokens_per_s,phases" > "$csv"
for r in $(seq 1 "$repeat"); do
  for preset in $presets; do
    for np in 1 2; do
      for arch in dflash dflash2; do
        out=$(OMP_NUM_THREADS=1 mpirun -np "$np" --bind-to core "$bin" train --no-progress --eval-every 0 \
                --preset "$preset" --arch "$arch" --steps "$steps" --context 2048)
        ms=$(sed -n 's/.*median step \([0-9.]*\) ms.*/\1/p' <<<"$out")
        tok=$(sed -n 's/.*ms, \([0-9.]*\) tokens\/s.*/\1/p' <<<"$out")
        ph=$(sed -n 's/.*ms per step: //p' <<<"$out")
        echo "$preset,$arch,$np,$r,$ms,$tok,\"$ph\"" >> "$csv"
      done
    done
  done
done
python3 - "$csv" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print("| preset | P | DFlash step ms | DFlash2 step ms | DFlash2 / DFlash | DFlash2 lm_head ms (DFlash) |")
print("|---|---|---|---|---|---|")
for preset in dict.fromkeys(r["preset"] for r in rows):
    for P in ("1", "2"):
        med = {}
        for arch in ("dflash", "dflash2"):
            sel = [r for r in rows if r["preset"] == preset and r["P"] == P and r["arch"] == arch]
            ms = [float(r["step_ms"]) for r in sel]
            mid = sorted(sel, key=lambda r: float(r["step_ms"]))[len(sel) // 2]
            lm = dict(p.split(" ") for p in [" ".join(x) for x in zip(*[iter(mid["phases"].split())] * 2)])
            med[arch] = (statistics.median(ms), float(lm.get("lm_head", "nan")))
        a, b = med["dflash"], med["dflash2"]
        print(f"| {preset} | {P} | {a[0]:.1f} | {b[0]:.1f} | {b[0] / a[0]:.2f} | {b[1]:.1f} ({a[1]:.1f}) |")
PY
