#!/usr/bin/env bash
# cluster_faults.sh DIFFCP [RESULTS.csv]: faults of a real cluster, injected mid-step into
# `diffcp train` across 2 emulated nodes (scripts/emucluster.sh, 1 rank each, 1 Gbit/s uplinks;
# ctest label `cluster`):
#   kill   rank 1 gets SIGKILL: the job ends within 10 s with Open MPI's message;
#   link   node 1's uplink goes down (ip link set u1 down in the fabric): the watchdog message,
#          then a clean exit; the link comes back up before the resume;
#   stall  rank 1 gets SIGSTOP: the watchdog message names the operation it left waiting.
# After each: no process of the job is left on any emulated host, and the last checkpoint resumes
# to a final checkpoint bitwise equal to an uninterrupted run's. Prints (and with RESULTS.csv,
# appends) the time from the fault to the end of the job.
set -uo pipefail
bin=${1:?usage: cluster_faults.sh DIFFCP [RESULTS.csv]}
results=${2:-}
here=$(cd "$(dirname "$0")" && pwd)
emu="$here/../../scripts/emucluster.sh"
timeout_s=5         # --comm-timeout of the runs
steps=120 every=5   # ~65 ms a step here: ~8 s a run, a checkpoint every 5 steps
fail() { echo "cluster_faults: FAIL: $*"; exit 1; }
[ -z "$(ip netns list | grep '^dcpemu-')" ] || fail "another emulated cluster is up; this test needs none"

work=$(mktemp -d)
name=""
cleanup() { [ -z "$name" ] || "$emu" down --name "$name" >/dev/null 2>&1; rm -rf "$work"; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
name=$("$emu" up --nodes 2 --ranks-per-node 1 --inter-gbit 1 2>"$work/up.log") || fail "emucluster up: $(cat "$work/up.log")"
[ -n "$name" ] || fail "emucluster up printed no cluster name"

train() {  # $1 = checkpoint dir, more train options after it
  local dir=$1; shift
  "$emu" run --name "$name" -- "$bin" train --steps $steps --save-every $every --out "$dir" --no-progress \
    --log "$dir/log.jsonl" --comm-timeout $timeout_s "$@"
}
rank_pid() {  # $1 = world rank, $2 = checkpoint dir of the run: the pid of that rank's process
  local p
  for p in $(pgrep -x diffcp); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$1" &&
      tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q -- "--out $2 " && { echo "$p"; return; }
  done
}
left_behind() {  # processes in the cluster's namespaces (the emulated hosts and the fabric)
  local ns
  for ns in $(ip netns list | awk '{print $1}' | grep "^$name-"); do ip netns pids "$ns"; done | paste -sd' '
}

train "$work/ref" >"$work/ref.out" 2>&1 || fail "the uninterrupted run failed: $(tail -5 "$work/ref.out")"
echo "cluster_faults: uninterrupted run done ($(grep -c '"step"' "$work/ref/log.jsonl") steps)"

fault_case() {  # $1 = case, $2 = regex the output must match, $3 = limit in seconds
  local c=$1 regex=$2 limit=$3 dir="$work/$1" pid victim t0 t1 rc dt
  mkdir -p "$dir"
  train "$dir" >"$dir.out" 2>&1 &
  pid=$!
  for _ in $(seq 300); do  # until step 12 is logged (a checkpoint at step 10 exists): mid-run
    local n; n=$(grep -c '"step"' "$dir/log.jsonl" 2>/dev/null)
    [ "${n:-0}" -ge 12 ] && break
    kill -0 "$pid" 2>/dev/null || fail "$c: the run ended before the fault: $(tail -5 "$dir.out")"
    sleep 0.1
  done
  victim=""
  for _ in $(seq 20); do  # a process can be briefly unreadable (or not yet listed): retry, bounded
    victim=$(rank_pid 1 "$dir")
    [ -n "$victim" ] && break
    sleep 0.1
  done
  [ -n "$victim" ] || fail "$c: rank 1's process not found (steps logged: $(grep -c '"step"' "$dir/log.jsonl" 2>/dev/null)," \
    "job $(kill -0 "$pid" 2>/dev/null && echo running || echo ended); its output: $(tail -5 "$dir.out"))"
  t0=$(date +%s.%N)
  case $c in
    kill) kill -KILL "$victim" ;;
    link) ip -n "$name-fab" link set u1 down ;;
    stall) kill -STOP "$victim" ;;
  esac
  wait "$pid"; rc=$?
  t1=$(date +%s.%N)
  dt=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b - a}')
  [ "$c" != link ] || ip -n "$name-fab" link set u1 up
  [ "$rc" -ne 0 ] || fail "$c: the job exited 0 after the fault"
  grep -Eq -- "$regex" "$dir.out" || fail "$c: output lacks /$regex/: $(tail -20 "$dir.out")"
  awk -v d="$dt" -v l="$limit" 'BEGIN{exit !(d <= l)}' || fail "$c: took $dt s from fault to end (limit $limit s)"
  sleep 1
  local left; left=$(left_behind)
  [ -z "$left" ] || fail "$c: processes left on the emulated hosts: $(ps -o pid,stat,args -p "${left// /,}")"
  echo "cluster_faults: $c: job ended $dt s after the fault (limit $limit s) with: $(grep -Eo -m1 -- "$regex" "$dir.out")"
  [ -z "$results" ] || echo "$c,$timeout_s,$dt,$limit" >>"$results"
  # The last checkpoint is intact: it is the last multiple of $every before the fault, and
  # resuming from it (the log continues at its step + 1) ends bitwise equal to the uninterrupted run.
  local at ck lines first
  at=$(grep -o '"step":[0-9]*' "$dir/log.jsonl" | tail -1 | cut -d: -f2)
  ck=$(grep -a -o '"step":[0-9]*' "$dir/checkpoint.bin" | head -1 | cut -d: -f2)
  [ -n "$ck" ] && [ "$ck" -ge 10 ] && [ "$ck" -le "$at" ] && [ $((ck % every)) -eq 0 ] ||
    fail "$c: the checkpoint is at step '${ck:-?}', expected the last multiple of $every <= $at"
  lines=$(wc -l <"$dir/log.jsonl")
  train "$dir" --resume >"$dir.resume.out" 2>&1 || fail "$c: resume failed: $(tail -5 "$dir.resume.out")"
  first=$(tail -n +$((lines + 1)) "$dir/log.jsonl" | head -1 | grep -o '"step":[0-9]*' | cut -d: -f2)
  [ "$first" = $((ck + 1)) ] || fail "$c: the resumed run logged step '${first:-none}' first, expected $((ck + 1))"
  cmp -s "$dir/checkpoint.bin" "$work/ref/checkpoint.bin" || fail "$c: the resumed run's final checkpoint differs from the uninterrupted run's"
  echo "cluster_faults: $c: hit after step $at; resumed from the checkpoint of step $ck; final checkpoint bitwise equal to the uninterrupted run's"
}

[ -z "$results" ] || [ -s "$results" ] || echo "fault,comm_timeout_s,fault_to_end_s,limit_s" >"$results"
fault_case kill "rank 1 with PID [0-9]+ on node r1x0 exited on signal 9" 10
# watchdog cases: the timeout + its 2 s of listening + Open MPI's teardown, with margin
# The operation named is a collective (all_reduce #N, ...) or, when the fault lands while a
# checkpoint gathers rank 1's ZeRO-1 shard, the point-to-point one (recv from rank 1).
waited="watchdog: ([a-z_]+ #[0-9]+|recv from rank 1|send to rank 1) on communicator '[^']+' .*did not complete within $timeout_s s.*not arrived: rank 1"
fault_case link "$waited" $((timeout_s + 7))
fault_case stall "$waited" $((timeout_s + 7))
echo "cluster_faults: passed"
