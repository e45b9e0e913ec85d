#!/usr/bin/env bash
# bench/bench_draft.sh [CTX...]: one DFlash draft block (`diffcp draft`), Split-KV over the context,
# at P = 1 and 2 (Open MPI binds each rank to one core at np <= 2; OMP_NUM_THREADS=1), small
# preset (H 512, 4 layers, n_t 3, B 16), random weights exported in the DFlash format, random
# target hidden states; median of 5 after a warm-up. Two ways (issue #53): `stateless`
# (draft_block: the whole context fused and projected again every block, model set-up included)
# and `cache` (`--draft-cache`: the context appended to a draft KV cache once, `append_ms`, then
# each block drafted from it). Two drafters: `full` (the preset's 4 full-attention layers) and
# `sliding` (the same weights, every layer sliding_attention with a window of 2048, as z-lab's
# sliding layers). Default contexts: 1024 4096 16384 32768. Writes bench/draft_cache.csv.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${DIFFCP_BUILD:-build/release}/src/diffcp
py=${DIFFCP_PYTHON:-/usr/bin/python3}  # with numpy (Debian's)
ctxs=("${@:-1024 4096 16384 32768}")
csv=${DIFFCP_DRAFT_CSV:-bench/draft_cache.csv}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mpirun -np 1 "$bin" train --preset small --steps 1 --context 512 --out "$work/t" --no-progress >/dev/null
"$bin" export --checkpoint "$work/t/checkpoint.bin" --out "$work/full" >/dev/null
mkdir -p "$work/sliding" && cp "$work/full/model.safetensors" "$work/sliding/"
"$py" -c "import json, sys; c = json.load(open(sys.argv[1])); c.update(layer_types=['sliding_attention'] * 4, use_sliding_window=True, sliding_window=2048); json.dump(c, open(sys.argv[2], 'w'))" \
  "$work/full/config.json" "$work/sliding/config.json"
echo "drafter,ctx,P,mode,ms,append_ms" > "$csv"
printf '%8s %8s %4s %10s %10s %10s\n' drafter ctx P mode ms append_ms
for ctx in ${ctxs[*]}; do
  "$py" -c "import numpy as n, sys; r = n.random.default_rng(1); n.save(sys.argv[1], r.standard_normal(($ctx, 1536), n.float32)); n.save(sys.argv[2], r.standard_normal((16, 512), n.float32))" "$work/H.npy" "$work/E.npy"
  for drafter in full sliding; do
    for P in 1 2; do
      for mode in stateless cache; do
        flag=(); [ $mode = cache ] && flag=(--draft-cache)
        line=$(mpirun -np $P "$bin" draft --model "$work/$drafter" --target-hidden "$work/H.npy" --noise-embedding "$work/E.npy" \
               --out "$work/o.npy" --reps 5 "${flag[@]}")
        ms=$(sed -n 's/.*\], \([0-9.]*\) ms.*/\1/p' <<<"$line")
        app=$(sed -n 's/.*took \([0-9.]*\) ms.*/\1/p' <<<"$line")
        printf '%8s %8s %4s %10s %10s %10s\n' "$drafter" "$ctx" "$P" "$mode" "$ms" "${app:-}"
        echo "$drafter,$ctx,$P,$mode,$ms,${app:-}" >> "$csv"
      done
    done
  done
done
