#!/usr/bin/env python3
"""json_check.py [--rc N] [--file PATH] EXPR... -- COMMAND...

Runs COMMAND, requires its exit status to be N (default 0), reads its stdout as JSON (the whole
of it, else its last line that parses; with --file, the file PATH the command wrote) into `j`, and evaluates each Python EXPR with `j` (and math) in scope: every
one must be true. Prints each expression with its verdict, then "json_check: passed" or exits 1.
Unlike a ctest PASS_REGULAR_EXPRESSION, a failing program or a wrong number fails the test.
"""
import json
import math
import subprocess
import sys


def main(argv):
    want_rc, path = 0, None
    while argv[:1] in (["--rc"], ["--file"]):
        if argv[0] == "--rc":
            want_rc = int(argv[1])
        else:
            path = argv[1]
        argv = argv[2:]
    if "--" not in argv:
        sys.exit("usage: json_check.py [--rc N] [--file PATH] EXPR... -- COMMAND...")
    split = argv.index("--")
    exprs, cmd = argv[:split], argv[split + 1:]
    if not exprs or not cmd:
        sys.exit("json_check: give at least one EXPR and a COMMAND")
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    sys.stderr.write(p.stderr[-4000:])
    if p.returncode != want_rc:
        print(p.stdout[-4000:])
        sys.exit(f"json_check: exit status {p.returncode}, expected {want_rc}")
    j = None
    if path is not None:
        with open(path) as f:
            j = json.load(f)
    else:
        try:
            j = json.loads(p.stdout)
        except ValueError:
            pass
    for line in ([] if j is not None else reversed(p.stdout.strip().splitlines())):
        try:
            j = json.loads(line)
            break
        except ValueError:
            continue
    if j is None:
        print(p.stdout[-4000:])
        sys.exit("json_check: no JSON line in the output")
    failed = 0
    for e in exprs:
        try:
            ok, why = bool(eval(e, {"math": math, "j": j})), ""  # noqa: S307 - the test's own expressions (j global: comprehensions see it)
        except Exception as err:  # a missing key or a wrong type is a failed expectation, said as such
            ok, why = False, f"  ({type(err).__name__}: {err})"
        print(f"  {'ok  ' if ok else 'FAIL'} {e}{why}")
        failed += not ok
    if failed:
        print(json.dumps(j)[:4000])
        sys.exit(f"json_check: {failed} of {len(exprs)} expressions false")
    print("json_check: passed")


if __name__ == "__main__":
    main(sys.argv[1:])
