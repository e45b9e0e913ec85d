#!/usr/bin/env bash
# How faithful is the emulated cluster (scripts/emucluster.sh)? Measures with `diffcp bench p2p`
# (rank 0 -> rank 1, TCP through the shaped links, one rank per core):
#   rate   configured vs measured bandwidth, 2 nodes x 1 rank, 16 MiB transfers, inter = intra x 1
#          at 0.05 ... 20 Gbit/s, and unshaped (--intra/--inter far above what TCP can do here):
#          where the emulation stops being limited by tc and starts being limited by the CPU.
#   burst  message size 16 KiB ... 16 MiB at 0.2 Gbit/s: tbf lets a burst (64 KiB here) through at
#          line rate, so small messages see more than the configured rate.
#   shm    the same pair over shared memory (plain mpirun): what the emulation replaces.
# Writes bench/cluster_fidelity.csv (study,configured_gbit,bytes,gbit_s,latency_us).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bin=${DIFFCP_BIN:-build/release/src/diffcp}
out=bench/cluster_fidelity.csv
echo "study,configured_gbit,bytes,gbit_s,latency_us" >"$out"
p2p() {  # study configured bytes -- launcher args
  local study=$1 conf=$2 bytes=$3; shift 3
  local j
  j=$("$@" "$bin" bench p2p --json --bytes "$bytes" --reps 9 --latency-reps 200 2>/dev/null | tail -n1)
  echo "$study,$conf,$(jq -r '.bytes' <<<"$j"),$(jq -r '.pairs[0].gbit_s' <<<"$j"),$(jq -r '.pairs[0].latency_us' <<<"$j")" | tee -a "$out"
}
emu() { echo scripts/emucluster.sh run --nodes 2 --ranks-per-node 1 --inter-gbit "$1" --intra-gbit "$1" --; }
for g in 0.05 0.2 1 5 10 20 1000; do
  # shellcheck disable=SC2046
  p2p rate "$g" 16m $(emu "$g")
done
for b in 16k 64k 256k 1m 4m 16m; do
  # shellcheck disable=SC2046
  p2p burst 0.2 "$b" $(emu 0.2)
done
p2p shm none 16m mpirun -np 2 --bind-to core
echo "wrote $out"
