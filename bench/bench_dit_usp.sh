#!/usr/bin/env bash
# DiT USP past the head limit (SPEC B.1; CoCoDiff's multi-node observation): `diffcp dit` with a
# model of few heads (tiny preset, --heads $HEADS, default 4, head dim 32: H = 128) at
# P = 1, 2, 4, 8 ranks, U = min(P, heads) Ulysses x R = P / U Ring, every mode (flat, tapa, vfirst,
# cocodiff with the paper's schedule). Link groups ("nodes") of L = min(P, 2) consecutive ranks, so
# the Ulysses groups span nodes up to the head limit and the ring runs across nodes past it.
# $RES^2 (default 256: 256 image + 64 text tokens), $STEPS steps (default 20).
#
# Quality: every run is compared with the Flat P = 1 latent (--reference): PSNR of the images and
# max |latent diff|. Bytes are per rank per denoising step, by link class, as counted by the
# communicators; ring_bytes is Ring's K|V share of them.
# Timings: plain mpirun --oversubscribe on a 2-core machine (often shared with builds: load1 is the
# 1-minute load when the run started), so rows with P > nproc are oversubscribed (timing =
# "oversubscribed"): compare their bytes, not their step_ms.
#
# Writes bench/dit_usp.csv. Usage: bench/bench_dit_usp.sh ; DIFFCP_BIN overrides the binary.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=${DIFFCP_BIN:-build/release/src/diffcp}
HEADS=${HEADS:-4}
STEPS=${STEPS:-20}
RES=${RES:-256}
out=bench/dit_usp.csv
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
model=(--preset tiny --heads "$HEADS" --head-dim 32 --resolution "$RES" --text-tokens 64 --steps "$STEPS" --out "")

# run <np> <L> <U> <R> <diffcp dit args...>: one CSV row from the JSON
run() {
  local np=$1 L=$2 U=$3 R=$4; shift 4
  local timing=real load1
  [ "$np" -gt "$(nproc)" ] && timing=oversubscribed
  load1=$(cut -d' ' -f1 /proc/loadavg)
  OMP_NUM_THREADS=1 mpirun --oversubscribe -np "$np" "$bin" dit --json "${model[@]}" --group-size "$L" \
    --ulysses-degree "$U" --ring-degree "$R" "$@" > "$tmp/out.json"
  python3 - "$tmp/out.json" "$U" "$R" "$L" "$timing" "$load1" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
assert j["ulysses_degree"] == int(sys.argv[2]) and j["ring_degree"] == int(sys.argv[3])
assert j["ring_bytes"] == j["predicted_ring_bytes"], (j["ring_bytes"], j["predicted_ring_bytes"])
psnr = j.get("psnr", "")
row = [j["P"], j["ulysses_degree"], j["ring_degree"], j["mode"], round(j["step_ms"], 2), int(j["bytes_intra_group"]),
       int(j["bytes_inter_group"]), int(j["ring_bytes"]), "inf" if psnr is None else round(psnr, 2), sys.argv[4],
       j.get("max_abs_diff", ""), sys.argv[5], sys.argv[6]]
print(",".join(str(v) for v in row))
PY
}

echo "P,U,R,mode,step_ms,bytes_intra,bytes_inter,ring_bytes,psnr_vs_flat_P1,L,max_abs_diff_vs_flat_P1,timing,load1" > $out
ref=$tmp/flat_p1.npy
OMP_NUM_THREADS=1 mpirun --oversubscribe -np 1 "$bin" dit "${model[@]}" --mode flat --save-latent "$ref" > /dev/null
for P in 1 2 4 8; do
  U=$(( P < HEADS ? P : HEADS )) R=$(( P / (P < HEADS ? P : HEADS) )) L=$(( P < 2 ? P : 2 ))
  for m in flat tapa vfirst cocodiff; do
    run "$P" "$L" "$U" "$R" --mode $m --reference "$ref" | tee -a $out
  done
done
echo "wrote $out"
