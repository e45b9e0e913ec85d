#!/usr/bin/env bash
# bench/bench_draft.sh [CTX...]: `diffcp draft` (one DFlash draft block, Split-KV over the
# context) at P = 1 and 2 (Open MPI binds each rank to one core at np <= 2; OMP_NUM_THREADS=1),
# small preset (H 512, 4 layers, n_t 3, B 16), random weights exported in the DFlash format,
# random target hidden states; median of 5 after a warm-up. Default contexts: 4096 16384.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${DIFFCP_BUILD:-build/release}/src/diffcp
ctxs=("${@:-4096 16384}")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mpirun -np 1 "$bin" train --preset small --steps 1 --context 512 --out "$work/t" --no-progress >/dev/null
"$bin" export --checkpoint "$work/t/checkpoint.bin" --out "$work/m" >/dev/null
printf '%8s %4s %10s\n' ctx P ms
for ctx in ${ctxs[*]}; do
  python3 -c "import numpy as n, sys; r = n.random.default_rng(1); n.save(sys.argv[1], r.standard_normal(($ctx, 1536), n.float32)); n.save(sys.argv[2], r.standard_normal((16, 512), n.float32))" "$work/H.npy" "$work/E.npy"
  for P in 1 2; do
    ms=$(mpirun -np $P "$bin" draft --model "$work/m" --target-hidden "$work/H.npy" --noise-embedding "$work/E.npy" \
         --out "$work/o.npy" --reps 5 | sed -n 's/.*\], \([0-9.]*\) ms.*/\1/p')
    printf '%8s %4s %10s\n' "$ctx" "$P" "$ms"
  done
done
