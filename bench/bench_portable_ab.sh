#!/usr/bin/env bash
# Issue #39: what the portable build (kernels per ISA chosen at run time, the rest compiled for the
# x86-64 baseline) costs against a -march=native build of the previous commit, outside the
# attention kernels: one DiT step (P = 1, 256 px, the default model) and the tiny drafter's
# training step (P = 1 and P = 2, one rank per core), and the AVX2 kernels (DIFFCP_CPU_ISA=avx2,
# oneDNN capped at AVX2) against the previous commit built with -mavx2 -mfma (OLD_AVX2).
# Interleaved REPEAT times (default 3); writes every run to CSV (default bench/portable_ab.csv) and
# prints the medians of the step times as a table.
# Usage: OLD=<old diffcp> [OLD_AVX2=<old diffcp built -mavx2 -mfma>] bench/bench_portable_ab.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
new=${NEW:-build/release/src/diffcp}
old=${OLD:?OLD=<a diffcp binary of the previous commit>}
repeat=${REPEAT:-3}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
dit() {  # tag, binary, env...
  local tag=$1 bin=$2
  shift 2
  env "$@" "$bin" dit --resolution 256 --steps 6 --out "" --json |
    python3 -c "import json,sys; print('$tag dit_step_ms', json.load(sys.stdin)['step_ms'])" >>"$out"
}
train() {  # tag, binary, np, env...
  local tag=$1 bin=$2 np=$3
  shift 3
  env OMP_NUM_THREADS=1 "$@" mpirun -np "$np" --bind-to core "$bin" train --no-progress --eval-every 0 --steps 30 |
    awk -v tag="$tag train_np${np}_step_ms" '/median step/ {s = $0; sub(/.*median step /, "", s); sub(/ ms.*/, "", s); print tag, s}' >>"$out"
}
for ((r = 1; r <= repeat; r++)); do
  dit old-native "$old"
  dit new "$new"
  train old-native "$old" 1
  train new "$new" 1
  train old-native "$old" 2
  train new "$new" 2
  if [[ -n "${OLD_AVX2:-}" ]]; then
    dit old-avx2 "$OLD_AVX2" DNNL_MAX_CPU_ISA=AVX2
    dit new-avx2 "$new" DIFFCP_CPU_ISA=avx2 DNNL_MAX_CPU_ISA=AVX2
  fi
  echo "round $r of $repeat done" >&2
done
csv=${CSV:-bench/portable_ab.csv}
{ echo "build,measure,ms"; tr ' ' ',' <"$out"; } >"$csv"
python3 - "$csv" <<'PY'
import collections, csv, statistics, sys
d = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[1])):
    d[(r["measure"], r["build"])].append(float(r["ms"]))
print("| measure | build | runs | median ms |")
print("|---|---|---|---|")
for (what, tag), v in sorted(d.items()):
    print(f"| {what} | {tag} | {len(v)} | {statistics.median(v):.1f} |")
PY
