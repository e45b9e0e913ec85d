#!/usr/bin/env bash
# bench/bench_watchdog.sh [ROUNDS]: the collective watchdog's cost when it does not fire. Alternates
# --comm-timeout 0 (off: operations are not wrapped) and 600 (the CLI default: every wait polls a
# deadline) for ROUNDS rounds (default 5) of `diffcp bench coll --bytes 64 --reps 1000` (latency:
# where a per-operation cost would show) and of a 30-step `diffcp train`, 2 ranks on shared memory
# (Open MPI binds each rank to one core at np 2). Prints the medians over rounds and writes them to
# bench/watchdog.csv (DIFFCP_WATCHDOG_CSV).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${DIFFCP_BUILD:-build/release}/src/diffcp
rounds=${1:-5}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for r in $(seq "$rounds"); do
  for t in 0 600; do
    mpirun -np 2 "$bin" bench coll --bytes 64 --reps 1000 --json --comm-timeout $t 2>/dev/null | tail -1 |
      jq -r --arg t $t '.collectives[] | "\($t) \(.collective) \(.ms * 1000)"' >>"$tmp/coll"
    mpirun -np 2 "$bin" train --steps 30 --no-progress --comm-timeout $t 2>/dev/null |
      sed -n 's/.*median step \([0-9.]*\) ms.*/'"$t"' train_step \1/p' >>"$tmp/coll"
  done
done
median() { sort -g | awk '{v[NR]=$1} END{print v[int((NR+1)/2)]}'; }
csv=${DIFFCP_WATCHDOG_CSV:-bench/watchdog.csv}
echo "what,off,timeout_600,unit,ratio" > "$csv"
printf '%-16s %14s %14s %8s\n' what "off" "timeout 600" ratio
for w in all_gather reduce_scatter all_reduce all_to_all train_step; do
  off=$(awk -v w=$w '$1==0 && $2==w {print $3}' "$tmp/coll" | median)
  on=$(awk -v w=$w '$1==600 && $2==w {print $3}' "$tmp/coll" | median)
  unit=$([ $w = train_step ] && echo ms || echo us)
  ratio=$(awk -v a="$on" -v b="$off" 'BEGIN{print a/b}')
  printf '%-16s %11.2f %s %11.2f %s %8.3f\n' $w "$off" $unit "$on" $unit "$ratio"
  echo "$w,$off,$on,$unit,$ratio" >> "$csv"
done
