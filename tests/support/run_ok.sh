#!/usr/bin/env bash
# run_ok.sh COMMAND...: runs COMMAND with its output passed through; when it exits non-zero, prints
# "run_ok: FAILED: exit status N" last and exits N. ctest judges a test that has a
# PASS_REGULAR_EXPRESSION by its output alone, not by the exit status; tests/CMakeLists.txt runs
# every such test through this script and fails it on that line (FAIL_REGULAR_EXPRESSION), so a
# program that prints the expected text and then fails does not pass.
"$@"
rc=$?
[ "$rc" -eq 0 ] || echo "run_ok: FAILED: exit status $rc"
exit "$rc"
