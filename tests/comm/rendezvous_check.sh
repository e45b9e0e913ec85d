#!/usr/bin/env bash
# The commands that communicate, on the rendezvous communicator (NCCL's semantics, issue #65),
# against the references and against themselves over MPI:
#   rendezvous_check.sh DIFFCP attn|bench|dit|train
#     attn   every CP method, forward + backward, vs the fp64 reference at P = 3 (f32, bf16) and 4
#            (f32); Ulysses at 2
#     bench  bench cp --check at P = 4 (every method on one workload)
#     dit    the DiT at P = 4 in every exchange mode and serving feature: the final latent equals
#            the MPI run's bitwise
#     train  the drafter trained at P = 3: the checkpoint equals the MPI run's bitwise
# A hang is ended by the watchdog (--comm-timeout 60), which names the stuck operation.
set -euo pipefail
d=$1
what=$2
run() { mpirun --oversubscribe -np "$@"; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "rendezvous_check: FAILED: $*"; exit 1; }
export DIFFCP_COMM_TIMEOUT=60

case "$what" in
  attn)
    for m in splitkv ring ringx lvxattn ulysses; do
      nps="3 4"; [ "$m" = ulysses ] && nps=2  # Ulysses needs P | n_kv = 2
      for np in $nps; do
        dts=f32; [ "$np" != 4 ] && dts="f32 bf16"  # bf16 moves other bytes, not other messages
        for dt in $dts; do
          out=$(run "$np" "$d" attn --check --comm rendezvous --method "$m" --dtype "$dt" --reps 1 --warmup 0 2>&1) ||
            { echo "$out" | tail -5; fail "attn $m P=$np $dt"; }
          echo "$out" | grep -q -- '-> PASSED' || { echo "$out" | tail -3; fail "attn $m P=$np $dt: no PASSED"; }
          echo "attn $m P=$np $dt: PASSED"
        done
      done
    done ;;
  bench)
    out=$(run 4 "$d" bench cp --check --comm rendezvous --reps 1 --warmup 0 2>&1) || { echo "$out" | tail -5; fail "bench cp"; }
    echo "$out"
    [ "$(echo "$out" | grep -c ' PASSED$')" -ge 4 ] || fail "bench cp: fewer than 4 methods PASSED"
    ! echo "$out" | grep -q FAILED || fail "bench cp: a method FAILED" ;;
  dit)
    dit() {  # NAME ARGS...: the same run over MPI and rendezvous; latents equal bitwise
      local name=$1; shift
      for c in mpi rendezvous; do
        run 4 "$d" dit --preset tiny --resolution 64 --steps 4 --warmup 1 --sync-every 2 --out "" --save-latent "$tmp/$name.$c.npy" \
          --comm "$c" "$@" >"$tmp/$name.$c.log" 2>&1 || { tail -5 "$tmp/$name.$c.log"; fail "dit $name over $c"; }
      done
      cmp -s "$tmp/$name.mpi.npy" "$tmp/$name.rendezvous.npy" || fail "dit $name: the rendezvous latent differs from MPI's"
      echo "dit $name: bitwise equal"
    }
    dit flat --mode flat
    dit tapa --mode tapa --group-size 2
    dit vfirst --mode vfirst --group-size 2
    dit cocodiff --mode cocodiff --group-size 2
    dit usp --mode flat --ulysses-degree 2 --ring-degree 2
    dit ring4 --mode flat --ulysses-degree 1 --ring-degree 4
    dit cfg_parallel --mode cocodiff --true-cfg-scale 3.5 --cfg-parallel
    dit fp8_wire --mode tapa --group-size 2 --wire fp8
    dit usp_fp8 --mode flat --ulysses-degree 2 --ring-degree 2 --wire fp8
    dit shard_weights --mode vfirst --group-size 2 --shard-weights
    dit step_cache --mode flat --step-cache fbcache:0.5
    dit cfg_parallel_step_cache --mode cocodiff --true-cfg-scale 3.5 --cfg-parallel --step-cache fbcache:0.5
    dit bf16 --mode cocodiff --group-size 2 --dtype bf16 ;;
  train)
    for c in mpi rendezvous; do
      run 3 "$d" train --comm "$c" --steps 4 --out "$tmp/$c" >"$tmp/$c.log" 2>&1 || { tail -5 "$tmp/$c.log"; fail "train over $c"; }
    done
    grep 'final loss' "$tmp/rendezvous.log"
    cmp -s "$tmp/mpi/checkpoint.bin" "$tmp/rendezvous/checkpoint.bin" || fail "train: the rendezvous checkpoint differs from MPI's"
    echo "train P=3: checkpoints bitwise equal" ;;
  *) fail "unknown check '$what'" ;;
esac
echo "rendezvous_check $what: PASSED"
