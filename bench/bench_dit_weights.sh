#!/usr/bin/env bash
# bench_dit_weights.sh [DIFFCP]: weights that fit (issue #35).
#  1. Memory per rank of the real shapes (`dit --dry-run --json`, the closed form of dit/weights.hpp
#     that a run's allocation is tested against): FLUX.1-dev at 1024^2 (512 text tokens) for
#     P = 1, 2, 4, 8, and Qwen-Image (1664x928, 256 text tokens), FLUX.2-dev and SD3.5-large (1024^2)
#     at P = 2, in f32 and bf16, replicated and sharded (--shard-weights). Data-less files of the
#     published configs (tests/dit/diffusers_fixture.sh): no weights are read.
#     -> bench/dit_weights_memory.csv
#  2. Measured at reduced depth, real width (FLUX.1's H 3072 = 24 heads x 128, M 12288; 2 double +
#     6 single blocks, FLUX's 1:2, random weights), 512^2 with 64 text tokens, 6 Euler steps, P = 2 (one rank per
#     core: Open MPI binds each rank to a core for np <= 2): the step time (median over steps, the
#     slowest rank's), the weights' allocation, the process's peak resident memory (VmHWM via
#     ru_maxrss, the largest rank's), the bytes gathered and the time blocked on gathers, for f32
#     and bf16 weights, replicated and sharded. 2 interleaved rounds. -> bench/dit_weights_step.csv
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=${1:-build/release/src/diffcp}
export OMP_NUM_THREADS=1
fixture=$(mktemp -d)
trap 'rm -rf "$fixture"' EXIT
tests/dit/diffusers_fixture.sh "${DIFFCP_PYTHON:-/usr/bin/python3}" "$fixture" > /dev/null

mem_csv=bench/dit_weights_memory.csv
echo "model,P,weights_dtype,shard_weights,parameters,weights_bytes_per_rank,activation_bytes_per_rank,gather_bytes_per_forward" > "$mem_csv"
dry() {  # model P args...
  local model=$1 P=$2
  shift 2
  for dtype in f32 bf16; do
    for shard in "" --shard-weights; do
      mpirun --oversubscribe -np "$P" "$bin" dit "$@" --dry-run --json --weights-dtype "$dtype" $shard | python3 -c '
import json, sys
m, P = sys.argv[1:3]
j = json.load(sys.stdin)
print("%s,%s,%s,%d,%d,%d,%d,%d" % (m, P, j["weights_dtype"], j["shard_weights"], j["parameters"], j["weights_bytes_per_rank"],
                                   j["activation_bytes_per_rank"], j["weight_gather_bytes_per_forward"]))
' "$model" "$P" >> "$mem_csv"
    done
  done
}
for P in 1 2 4 8; do
  dry FLUX.1-dev "$P" --weights "$fixture/flux1-dev" --resolution 1024 --text-tokens 512
done
dry Qwen-Image 2 --weights "$fixture/qwen-image" --width 1664 --height 928 --text-tokens 256 --guidance 1
dry FLUX.2-dev 2 --weights "$fixture/flux2-dev" --resolution 1024 --text-tokens 512
dry SD3.5-large 2 --weights "$fixture/sd3.5-large" --resolution 1024 --text-tokens 334 --guidance 1
echo "wrote $mem_csv"

step_csv=bench/dit_weights_step.csv
echo "round,weights_dtype,shard_weights,step_ms,weights_bytes_per_rank,peak_rss_bytes,weight_gather_bytes_per_step,weight_gather_wait_ms_per_step" > "$step_csv"
shape=(--preset default --heads 24 --head-dim 128 --mlp-hidden 12288 --double-blocks 2 --single-blocks 6
       --resolution 512 --text-tokens 64 --steps 6 --mode tapa --json --out "")
for round in 1 2; do
  for dtype in f32 bf16; do
    for shard in "" --shard-weights; do
      mpirun -np 2 "$bin" dit "${shape[@]}" --weights-dtype "$dtype" $shard | python3 -c '
import json, sys
r = sys.argv[1]
j = json.load(sys.stdin)
print("%s,%s,%d,%.1f,%d,%d,%d,%.2f" % (r, j["weights_dtype"], j["shard_weights"], j["step_ms"], j["weights_bytes_per_rank"],
                                       j["peak_rss_bytes"], j["weight_gather_bytes"], j["weight_gather_wait_ms"]))
' "$round" >> "$step_csv"
    done
  done
done
echo "wrote $step_csv"
