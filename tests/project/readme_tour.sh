#!/usr/bin/env bash
# readme_tour.sh DIFFCP: runs the README's "A tour" block, line by line, as a newcomer would (each
# must exit 0), in a scratch directory, with the built program as $d. The emulated-cluster line
# needs network namespaces and is covered by the `cluster` tests instead.
set -euo pipefail
bin=${1:?usage: readme_tour.sh DIFFCP}
here=$(cd "$(dirname "$0")" && pwd)
readme="$here/../../README.md"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mapfile -t lines < <(awk '/^## A tour/ {s = 1} s && /^```sh/ {b = 1; next} b && /^```/ {exit}
                          b {sub(/[ \t]+#.*$/, ""); if ($0 != "") print}' "$readme")
[ "${#lines[@]}" -ge 5 ] || { echo "readme_tour: FAILED: found ${#lines[@]} lines under '## A tour'"; exit 1; }
cd "$work"
n=0
for line in "${lines[@]}"; do
  case "$line" in
    d=*) continue ;;                      # the README's own path to the program
    "source scripts/env.sh") source "$here/../../scripts/env.sh"; continue ;;
    *emucluster.sh*) echo "readme_tour: skipped (cluster tests): $line"; continue ;;
  esac
  echo "readme_tour: \$ $line"
  if ! d=$bin bash -c "set -e; $line" >"$work/out.txt" 2>&1; then
    tail -n 20 "$work/out.txt"
    echo "readme_tour: FAILED: $line"; exit 1
  fi
  tail -n 2 "$work/out.txt"
  n=$((n + 1))
done
echo "readme_tour: passed ($n commands)"
