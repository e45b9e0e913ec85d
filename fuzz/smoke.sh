#!/usr/bin/env bash
# fuzz/smoke.sh EXE SEEDS WORKDIR RUNS MAX_SECONDS [DICT]: the ctest smoke run of one fuzz target
# (label `fuzz`): a fixed-seed, bounded libFuzzer run on a copy of the seed corpus in WORKDIR (the
# source and seed trees stay clean). Fails (non-zero) on any crash, sanitizer report, leak, huge
# allocation (-malloc_limit_mb) or slow input; the input is saved in WORKDIR/artifacts/.
set -euo pipefail
[ $# -ge 5 ] || { echo "usage: smoke.sh EXE SEEDS WORKDIR RUNS MAX_SECONDS [DICT]" >&2; exit 2; }
exe=$1 seeds=$2 work=$3 runs=$4 secs=$5 dict=${6:-}
[ -d "$seeds" ] || { echo "smoke.sh: no seed corpus $seeds (is the fuzz build done?)" >&2; exit 2; }
rm -rf "$work"
mkdir -p "$work/corpus" "$work/artifacts"
cp -R "$seeds"/. "$work/corpus/"
args=(-seed=1 -runs="$runs" -max_total_time="$secs" -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=10
      -max_len=65536 -print_final_stats=1 -artifact_prefix="$work/artifacts/")
[ -n "$dict" ] && args+=(-dict="$dict")
exec "$exe" "${args[@]}" "$work/corpus"
