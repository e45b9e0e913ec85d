#!/usr/bin/env bash
# bitwise_golden.sh DIFFCP check|record [GOLDEN]: the CPU results of every CP method, the DiT and
# the drafter's train step, hashed bit for bit, against the hashes recorded before a refactor of
# the compute seam (issue #51: each method written once over typed tensors must not change one
# bit of any result, in f32 or bf16).
#
# The cases: `diffcp attn --dump` of each CP method (Split-KV with --oproj all and owned) in f32
# and bf16 at 2 and 3 ranks, and with a sliding window at 2; `diffcp dit --dump-velocity` (tiny
# FLUX.1, 3 steps) in each exchange mode, f32 and bf16, USP (Ulysses degree 1) and bf16-stored
# weights; `diffcp train` (3 steps) in f32 and bf16, its checkpoint. One rank per core
# (OMP_NUM_THREADS=1), so the kernels' reduction orders are fixed.
#
# Bitwise results depend on the kernels this CPU runs (the CPU backend's ISA and oneDNN's), so
# the hashes are recorded per machine key (a hash of `diffcp backends`' CPU lines and the build
# type in DIFFCP_BUILD_KEY): `check` compares the cases recorded for this key and skips (exit 77,
# saying so) where none are. `record` appends this machine's hashes (run it on the commit BEFORE
# a change, then `check` after it).
set -euo pipefail
bin=${1:?usage: bitwise_golden.sh DIFFCP check|record [GOLDEN]}
mode=${2:?check or record}
here=$(cd "$(dirname "$0")" && pwd)
golden=${3:-$here/data/bitwise_golden.txt}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
unset DIFFCP_CPU_ISA DIFFCP_BACKEND ONEDNN_MAX_CPU_ISA DNNL_MAX_CPU_ISA
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

key=$( ("$bin" backends | sed -n '1,/^guard/p' | grep -v '^guard'; echo "${DIFFCP_BUILD_KEY:-release}") |
  sha256sum | cut -c1-16)
# check on a machine with nothing recorded: say so before running any case (they take minutes)
if [ "$mode" = check ] && ! grep -q "^$key " "$golden" 2>/dev/null; then
  echo "SKIP: no golden hashes recorded for this machine key ($key: $("$bin" backends | sed -n 3p | sed 's/^ *//'))"
  exit 77
fi

# hash_of DIR FILE...: one hash of the named files' bytes, in order.
hash_of() {
  local dir=$1; shift
  (cd "$dir" && cat "$@") | sha256sum | cut -c1-16
}

declare -a names hashes
add() { names+=("$1"); hashes+=("$2"); }
mpirun_bin=$(type -P mpirun)
# mpirun with a bound: a run that does not end in 120 s is retried once (an Open MPI start-up
# that stalls under load), and fails naming itself the second time (a real hang).
mpirun() {
  local rc=0
  timeout 120 "$mpirun_bin" "$@" || rc=$?
  if [ "$rc" = 124 ]; then
    echo "bitwise_golden: mpirun $* did not end in 120 s; retrying once" >&2
    rc=0
    timeout 120 "$mpirun_bin" "$@" || rc=$?
    [ "$rc" = 124 ] && echo "bitwise_golden: FAIL: mpirun $* did not end in 120 s twice" >&2
  fi
  return "$rc"
}

attn_case() {  # np method dtype extra...
  local np=$1 method=$2 dtype=$3; shift 3
  local d="$work/attn"
  rm -rf "$d"
  mpirun --oversubscribe -np "$np" "$bin" attn --method "$method" --dtype "$dtype" --samples 2 --context 300 \
    --queries 64 --block 16 --hidden 64 --n-q 12 --n-kv 6 --d-h 8 --reps 1 --warmup 0 --seed 3 --dump "$d" "$@" \
    >/dev/null
  add "attn np$np $method $dtype${*:+ $*}" "$(hash_of "$d" y.npy dx.npy dctx.npy dwq.npy dwk.npy dwv.npy dwo.npy dbo.npy dq_norm.npy dk_norm.npy)"
}
for np in 2 3; do
  for dtype in f32 bf16; do
    for method in splitkv ulysses ring ringx lvxattn; do attn_case $np $method $dtype; done
    attn_case $np splitkv $dtype --oproj owned
  done
done
for dtype in f32 bf16; do
  for method in splitkv ulysses ring ringx lvxattn; do attn_case 2 $method $dtype --window 40; done
done

dit_case() {  # dtype mode extra...
  local dtype=$1 m=$2; shift 2
  local d="$work/dit"
  rm -rf "$d"
  mpirun --oversubscribe -np 2 "$bin" dit --preset tiny --resolution 64 --steps 3 --mode "$m" --warmup 1 \
    --sync-every 0 --dtype "$dtype" --out '' --dump-velocity "$d" "$@" >/dev/null
  add "dit np2 $m $dtype${*:+ $*}" "$(hash_of "$d" velocity_0.npy velocity_1.npy velocity_2.npy)"
}
for dtype in f32 bf16; do
  for m in flat tapa vfirst cocodiff; do dit_case $dtype $m; done
  dit_case $dtype flat --ulysses-degree 1
  dit_case $dtype cocodiff --weights-dtype bf16
done

for dtype in f32 bf16; do
  rm -rf "$work/train"
  mpirun --oversubscribe -np 2 "$bin" train --steps 3 --context 256 --dtype $dtype --out "$work/train" --no-progress \
    >/dev/null
  add "train np2 $dtype" "$(hash_of "$work/train" checkpoint.bin)"
done

if [ "$mode" = record ]; then
  tmp=$work/golden
  [ -f "$golden" ] && grep -v "^$key " "$golden" >"$tmp" || true
  for i in "${!names[@]}"; do echo "$key ${hashes[$i]} ${names[$i]}" >>"$tmp"; done
  mkdir -p "$(dirname "$golden")"
  cp "$tmp" "$golden"
  echo "recorded ${#names[@]} cases for machine key $key in $golden"
  exit 0
fi

[ "$mode" = check ] || { echo "bitwise_golden.sh: mode '$mode': expected check or record" >&2; exit 2; }
fail=0
for i in "${!names[@]}"; do
  want=$(grep "^$key [0-9a-f]* ${names[$i]}\$" "$golden" | cut -d' ' -f2 || true)
  if [ -z "$want" ]; then
    echo "FAIL: ${names[$i]}: no recorded hash for this case"
    fail=1
  elif [ "$want" != "${hashes[$i]}" ]; then
    echo "FAIL: ${names[$i]}: hash ${hashes[$i]}, recorded $want (a result changed)"
    fail=1
  fi
done
[ $fail = 0 ] && echo "all ${#names[@]} cases equal the recorded results bit for bit (machine key $key)"
exit $fail
