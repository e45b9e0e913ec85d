#!/usr/bin/env bash
# sim_profile_check.sh DIFFCP: what a calibrated profile says it measured (issue #41).
#   1. `sim calibrate` in one process (no mpirun) warns on stderr that no link was measured and
#      records it: measured.intra_link / inter_link / comm_overlap / sync_loss false, compute true,
#      and the attention shape of its kernel rates.
#   2. `sim cp` on that profile warns when it predicts P > 1 over the defaulted links, and when the
#      workload's head shape is not the profile's; at P = 1 with the profile's shape it is silent.
#   3. The shipped profiles (published figures) predict without a warning.
set -euo pipefail
py=${DIFFCP_PYTHON:-python3}
bin=${1:?usage: sim_profile_check.sh DIFFCP}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "sim_profile_check: FAILED: $*"; exit 1; }
shape=(--samples 1 --context 2k --queries 128 --hidden 256)

"$bin" sim calibrate --reps 1 --n-q 8 --n-kv 2 --d-h 64 --out "$work/p.json" >"$work/cal.out" 2>"$work/cal.err"
cat "$work/cal.err"
grep -q "warning: one rank, so no link was measured: intra and inter links are DEFAULTS" "$work/cal.err" ||
  fail "calibrate on one rank did not warn on stderr"
"$py" - "$work/p.json" <<'PY' || fail "the profile does not record what was measured"
import json, sys
p = json.load(open(sys.argv[1]))
want = {"compute": True, "intra_link": False, "inter_link": False, "comm_overlap": False, "sync_loss": False}
assert p["measured"] == want, p["measured"]
assert p["attention_shape"] == {"n_q": 8, "n_kv": 2, "d_h": 64}, p["attention_shape"]
print("profile records measured", p["measured"], "attention_shape", p["attention_shape"])
PY

# P = 2 over the defaulted (never measured) link: warned; the prediction itself still printed.
"$bin" sim cp --profile "$work/p.json" --P 2 --methods splitkv "${shape[@]}" --n-q 8 --n-kv 2 --d-h 64 --json \
  >"$work/p2.out" 2>"$work/p2.err"
cat "$work/p2.err"
grep -q "the inter-node link (100.* Gbit/s.*) was not measured by sim calibrate" "$work/p2.err" || fail "sim cp at P = 2 did not warn"
grep -q '"step_ms"' "$work/p2.out" || fail "sim cp at P = 2 printed no prediction"
# Another head shape than the rates': warned (P = 1 uses no link).
"$bin" sim cp --profile "$work/p.json" --P 1 --methods splitkv "${shape[@]}" --n-q 8 --n-kv 2 --d-h 32 --json \
  >/dev/null 2>"$work/shape.err"
cat "$work/shape.err"
grep -q "measured at 8/2 heads x 64, this workload has 8/2 heads x 32" "$work/shape.err" || fail "no head-shape warning"
grep -q "link" "$work/shape.err" && fail "P = 1 warned about a link it does not use"
# The profile's own shape at P = 1, and a shipped profile at P = 16: silent.
"$bin" sim cp --profile "$work/p.json" --P 1 --methods splitkv "${shape[@]}" --n-q 8 --n-kv 2 --d-h 64 --json \
  >/dev/null 2>"$work/quiet.err"
[ ! -s "$work/quiet.err" ] || { cat "$work/quiet.err"; fail "a fitting prediction warned"; }
"$bin" sim cp --profile h100-ib --P 16 --methods splitkv "${shape[@]}" --json >/dev/null 2>"$work/h100.err"
[ ! -s "$work/h100.err" ] || { cat "$work/h100.err"; fail "a shipped profile warned"; }
echo "sim_profile_check: passed"
