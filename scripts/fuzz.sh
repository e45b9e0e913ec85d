#!/usr/bin/env bash
# scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]: a longer libFuzzer run of every target of fuzz/
# (default 120 s each; targets: safetensors npy anchors checkpoint dit_weights shards cli_args).
# Builds fuzz/ with clang++ in $FUZZ_BUILD_DIR (default build/fuzz), keeps a growing corpus per
# target in $FUZZ_BUILD_DIR/corpus/<target> (seeded from the build's seeds), and prints a table:
# executions, exec/s, coverage (libFuzzer's final cov: and ft:), corpus size, crashes. A crash
# (or UB report, leak, OOM, timeout) stops that target; its input is saved under
# $FUZZ_BUILD_DIR/artifacts/<target>/ and the script exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-120}
shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(safetensors npy anchors checkpoint dit_weights shards cli_args)
build=${FUZZ_BUILD_DIR:-build/fuzz}
command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ missing: run scripts/install_deps.sh" >&2; exit 2; }
source scripts/env.sh
[ -f "$build/build.ninja" ] || cmake -S fuzz -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ >/dev/null
cmake --build "$build" -j "${FUZZ_BUILD_JOBS:-2}" >/dev/null

rows=()
failed=0
for t in "${targets[@]}"; do
  exe="$build/fuzz_$t"
  [ -x "$exe" ] || { echo "fuzz.sh: no target '$t' ($exe)" >&2; exit 2; }
  corpus="$build/corpus/$t" art="$build/artifacts/$t" log="$build/logs/$t.log"
  mkdir -p "$corpus" "$art" "$(dirname "$log")"
  dict=()
  [ "$t" != cli_args ] && dict=(-dict=fuzz/diffcp.dict)
  echo "fuzz.sh: $t for ${secs}s ..." >&2
  rc=0
  "$exe" -max_total_time="$secs" -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=10 -max_len=65536 \
    -print_final_stats=1 -artifact_prefix="$art/" "${dict[@]}" "$corpus" "$build/seeds/$t" >"$log" 2>&1 || rc=$?
  last=$(grep -E '^#[0-9]+[[:space:]].*cov: ' "$log" | tail -1 || true)
  cov=$(sed -nE 's/.* cov: ([0-9]+).*/\1/p' <<<"$last")
  ft=$(sed -nE 's/.* ft: ([0-9]+).*/\1/p' <<<"$last")
  corp=$(sed -nE 's/.* corp: ([0-9]+\/[0-9A-Za-z]+).*/\1/p' <<<"$last")
  execs=$(sed -nE 's/^stat::number_of_executed_units: *([0-9]+)/\1/p' "$log")
  eps=$(sed -nE 's/^stat::average_exec_per_sec: *([0-9]+)/\1/p' "$log")
  crashes=$(grep -cE 'Test unit written to' "$log" || true)
  status=ok
  if [ "$rc" -ne 0 ] || [ "$crashes" -ne 0 ]; then
    status="CRASH: $(grep -m1 -E 'SUMMARY|ERROR: libFuzzer|runtime error|terminate called|violated' "$log" | cut -c1-120) -> $(sed -nE 's/.*Test unit written to (.*)/\1/p' "$log" | head -1)"
    failed=1
  fi
  rows+=("| $t | ${execs:-?} | ${eps:-?} | ${cov:-?} | ${ft:-?} | ${corp:-?} | $crashes | $status |")
done
echo
echo "libFuzzer, ${secs} s per target (clang++ $(clang++ -dumpversion), ASan + UBSan, -rss_limit_mb=2048 -malloc_limit_mb=512):"
echo
echo "| target | executions | exec/s | cov | ft | corpus (files/bytes) | crashes | status |"
echo "|---|---:|---:|---:|---:|---|---:|---|"
printf '%s\n' "${rows[@]}"
exit $failed
