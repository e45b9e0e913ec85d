#!/usr/bin/env bash
# expect_fail.sh <seconds> <regex> <command...>
# Passes iff the command exits non-zero within <seconds> and its output (stdout+stderr) matches
# <regex> (grep -E). Used for "bad input gives a clear error" and "one rank's error aborts the job".
set -u
limit=$1 regex=$2
shift 2
out=$(timeout "$limit" "$@" 2>&1)
rc=$?
printf '%s\n' "$out" | tail -n 20
if [ "$rc" -eq 0 ]; then echo "expect_fail: command succeeded, expected an error"; exit 1; fi
if [ "$rc" -eq 124 ]; then echo "expect_fail: command hung (killed after ${limit}s)"; exit 1; fi
if ! printf '%s\n' "$out" | grep -Eq -- "$regex"; then echo "expect_fail: output lacks /$regex/"; exit 1; fi
echo "expect_fail: exit $rc with the expected message"
