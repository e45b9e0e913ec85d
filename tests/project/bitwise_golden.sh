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
# Bitwise results depend on the kernels that run, so the hashes are recorded per machine key: what
# determines the bits, as `diffcp backends --key` prints it (the CPU kernels' version and ISA, the
# compiler, oneDNN's version, ISA and bf16 path, the fused attention paths; see
# CpuBackend::kernel_key) and the build type (DIFFCP_BUILD_KEY, default release). The golden file
# holds a "# key ID: KEY" line per key and "ID HASH CASE" per case (ID: a hash of KEY).
#   check      the cases recorded for the key of the kernels this CPU picks; exit 77 (skip, saying
#              so and what to record) where none are;
#   check-all  the same for every ISA this machine runs (DIFFCP_CPU_ISA=each): minutes per ISA;
#   record     every ISA this machine runs, each under its own key (run it on the commit BEFORE a
#              change, then `check` after it; a new machine: record from the commit before the
#              work starts). DIFFCP_GOLDEN_KEY=KEY records under KEY instead of asking the binary,
#              for the ISA DIFFCP_CPU_ISA names (or the CPU's choice): to record with an older build
#              whose `backends` has no --key, give the new build's `DIFFCP_CPU_ISA=X diffcp backends --key`.
# Keys of the older scheme (a hash of `diffcp backends`' text) are kept and still checked where
# they match (`legacy`), so a machine recorded before keeps its guard until it records again.
set -euo pipefail
bin=${1:?usage: bitwise_golden.sh DIFFCP check|check-all|record [GOLDEN]}
mode=${2:?check, check-all or record}
case "$mode" in check|check-all|record) ;; *) echo "bitwise_golden.sh: mode '$mode': expected check, check-all or record" >&2; exit 2 ;; esac
here=$(cd "$(dirname "$0")" && pwd)
golden=${3:-$here/../data/bitwise_golden.txt}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
given_isa=${DIFFCP_CPU_ISA:-}  # with DIFFCP_GOLDEN_KEY: the ISA that key is of
unset DIFFCP_CPU_ISA DIFFCP_BACKEND ONEDNN_MAX_CPU_ISA DNNL_MAX_CPU_ISA
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

build=$(printf %s "${DIFFCP_BUILD_KEY:-release}" | tr "[:upper:]" "[:lower:]")
key_of() {  # the readable key of the kernels DIFFCP_CPU_ISA (or the CPU's choice) runs
  if [ -n "${DIFFCP_GOLDEN_KEY:-}" ]; then echo "$DIFFCP_GOLDEN_KEY build=$build"; return; fi
  echo "$("$bin" backends --key) build=$build"
}
id_of() { printf '%s' "$1" | sha256sum | cut -c1-16; }
legacy_id() { ("$bin" backends | sed -n '1,/^guard/p' | grep -v '^guard'; echo "$build") | sha256sum | cut -c1-16; }
# The ISAs this machine runs (compiled in and on this CPU); with DIFFCP_GOLDEN_KEY only the one it
# is of (DIFFCP_CPU_ISA, or the CPU's choice).
isas=$("$bin" backends | sed -n 's/^ *instruction sets compiled in (DIFFCP_CPU_ISA)://p' |
  sed 's/ [a-z0-9_]* (not on this CPU)//g')
[ -n "${DIFFCP_GOLDEN_KEY:-}" ] && isas=${given_isa:-default}
use_isa() { if [ "$1" = default ]; then unset DIFFCP_CPU_ISA; else export DIFFCP_CPU_ISA=$1; fi; }

# hash_of DIR FILE...: one hash of the named files' bytes, in order.
hash_of() {
  local dir=$1; shift
  (cd "$dir" && cat "$@") | sha256sum | cut -c1-16
}

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
dit_case() {  # dtype mode extra...
  local dtype=$1 m=$2; shift 2
  local d="$work/dit"
  rm -rf "$d"
  mpirun --oversubscribe -np 2 "$bin" dit --preset tiny --resolution 64 --steps 3 --mode "$m" --warmup 1 \
    --sync-every 0 --dtype "$dtype" --out '' --dump-velocity "$d" "$@" >/dev/null
  add "dit np2 $m $dtype${*:+ $*}" "$(hash_of "$d" velocity_0.npy velocity_1.npy velocity_2.npy)"
}
# run_cases: every case under the kernels DIFFCP_CPU_ISA (or the CPU's choice) runs, into names / hashes.
run_cases() {
  names=() hashes=()
  for np in 2 3; do
    for dtype in f32 bf16; do
      for method in splitkv ulysses ring ringx lvxattn; do attn_case $np $method $dtype; done
      attn_case $np splitkv $dtype --oproj owned
    done
  done
  for dtype in f32 bf16; do
    for method in splitkv ulysses ring ringx lvxattn; do attn_case 2 $method $dtype --window 40; done
  done

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
}

# cases_for ID: "HASH CASE" lines recorded under ID.
cases_for() { grep "^$1 " "$golden" 2>/dev/null | cut -d' ' -f2- || true; }

if [ "$mode" = record ]; then
  tmp=$work/golden
  cp "$golden" "$tmp" 2>/dev/null || : >"$tmp"
  n=0
  for isa in $isas; do
    use_isa "$isa"
    key=$(key_of) id=$(id_of "$key")
    run_cases
    grep -v -e "^$id " -e "^# key $id:" "$tmp" >"$tmp.new" || true
    echo "# key $id: $key" >>"$tmp.new"
    for i in "${!names[@]}"; do echo "$id ${hashes[$i]} ${names[$i]}" >>"$tmp.new"; done
    mv "$tmp.new" "$tmp"
    echo "recorded ${#names[@]} cases under $id: $key"
    n=$((n + 1))
  done
  mkdir -p "$(dirname "$golden")"
  cp "$tmp" "$golden"
  echo "recorded $n instruction sets ($isas) in $golden"
  exit 0
fi

# check_one: the cases under the kernels DIFFCP_CPU_ISA (or the CPU's choice) runs; 77 where none are recorded.
check_one() {
  local key id recorded
  key=$(key_of) id=$(id_of "$key")
  recorded=$(cases_for "$id")
  if [ -z "$recorded" ] && [ -z "${DIFFCP_CPU_ISA:-}" ]; then
    id=$(legacy_id)
    recorded=$(cases_for "$id")
    [ -n "$recorded" ] && echo "bitwise_golden: no cases under this key; checking the legacy key $id"
  fi
  if [ -z "$recorded" ]; then
    echo "SKIP: no golden hashes recorded for $key (record them from the commit before a change: tests/project/bitwise_golden.sh DIFFCP record)"
    return 77
  fi
  run_cases
  local fail=0 want
  for i in "${!names[@]}"; do
    want=$(grep "^[0-9a-f]* ${names[$i]}\$" <<<"$recorded" | cut -d' ' -f1 || true)
    if [ -z "$want" ]; then
      echo "FAIL: ${names[$i]}: no recorded hash for this case"
      fail=1
    elif [ "$want" != "${hashes[$i]}" ]; then
      echo "FAIL: ${names[$i]}: hash ${hashes[$i]}, recorded $want (a result changed)"
      fail=1
    fi
  done
  [ $fail = 0 ] && echo "all ${#names[@]} cases equal the recorded results bit for bit ($key)"
  return $fail
}

if [ "$mode" = check ]; then
  [ -n "${DIFFCP_GOLDEN_KEY:-}" ] && use_isa "$isas"  # the ISA the given key is of
  rc=0
  check_one || rc=$?
  exit $rc
fi
rc=0 ran=0
for isa in $isas; do
  use_isa "$isa"
  r=0
  check_one || r=$?
  [ "$r" = 77 ] && continue
  ran=$((ran + 1))
  [ "$r" = 0 ] || rc=1
done
[ $ran -gt 0 ] || { echo "SKIP: no instruction set of this machine has recorded hashes"; exit 77; }
exit $rc
