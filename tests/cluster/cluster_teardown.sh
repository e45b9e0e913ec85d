#!/usr/bin/env bash
# cluster_teardown.sh: scripts/emucluster.sh removes everything it made on every exit path and
# passes the program's exit status through (ctest label `cluster`):
#   1. a program that fails (exit 7): `run` exits 7;
#   2. SIGINT to the script while the program runs: exit 130 within 10 s;
#   3. SIGTERM likewise: exit 143;
# after each: no namespace of the run, no state, no process of the run left.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
emu="$here/../../scripts/emucluster.sh"
fail() { echo "cluster_teardown: FAIL: $*"; exit 1; }
topo=(--nodes 2 --ranks-per-node 1 --inter-gbit 1)
nothing_left() {  # $1 = what happened
  sleep 1
  local ns; ns=$(ip netns list | awk '{print $1}' | grep '^dcpemu-' | paste -sd' ')
  [ -z "$ns" ] || fail "$1: namespaces left: $ns"
  ! ls /run/diffcp-emucluster/dcpemu-* >/dev/null 2>&1 || fail "$1: state left in /run/diffcp-emucluster"
  ! pgrep -f '/run/diffcp-emucluster/dcpemu-' >/dev/null || fail "$1: processes left: $(pgrep -af /run/diffcp-emucluster/dcpemu-)"
  ! pgrep -f 'emucluster-teardown-marker' >/dev/null || fail "$1: the program is still running"
  echo "$1: nothing left behind"
}
[ -z "$(ip netns list | grep '^dcpemu-')" ] || fail "another emulated cluster is up; this test needs none"
marks=$(mktemp -d)
trap 'rm -rf "$marks"' EXIT

"$emu" run "${topo[@]}" -- sh -c 'exit 7' >/dev/null 2>&1
rc=$?
[ "$rc" -eq 7 ] || fail "a program exiting 7 made run exit $rc"
nothing_left "program failed (exit 7)"

for sig in INT TERM; do
  want=$([ $sig = INT ] && echo 130 || echo 143)
  # A background job of a script starts with SIGINT ignored (and then untrappable): restore it.
  # The program marks that it runs (a file: `pgrep -f` would also match run's own arguments and
  # fire during set-up, before run traps the signal, where bash defers it until the step it waits
  # for ends and then carries on).
  started="$marks/started.$sig"
  env --default-signal=INT "$emu" run "${topo[@]}" -- sh -c "touch $started; sleep 60 # emucluster-teardown-marker" >/dev/null 2>&1 &
  pid=$!
  for _ in $(seq 150); do [ -e "$started" ] && break; sleep 0.2; done
  [ -e "$started" ] || fail "the program did not start within 30 s"
  t0=$SECONDS
  kill -"$sig" "$pid"
  wait "$pid"; rc=$?
  [ "$rc" -eq "$want" ] || fail "SIG$sig: run exited $rc, expected $want"
  [ $((SECONDS - t0)) -le 10 ] || fail "SIG$sig: run took $((SECONDS - t0)) s to end"
  nothing_left "SIG$sig mid-run"
done
echo "cluster_teardown: passed"
