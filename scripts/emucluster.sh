#!/usr/bin/env bash
# An emulated multi-node cluster on one machine: real Open MPI over TCP across network namespaces
# whose links are rate-shaped with tc (tbf), so communication costs what it would on a cluster
# whose compute is scaled down to this machine's.
#
#   scripts/emucluster.sh run  --nodes N --ranks-per-node R TOPOLOGY [--keep] [--dry-run] -- PROGRAM ARGS...
#   scripts/emucluster.sh up   --nodes N --ranks-per-node R TOPOLOGY [--dry-run]     (prints the cluster's name)
#   scripts/emucluster.sh run  --name NAME -- PROGRAM ARGS...                         (on a cluster that is up)
#   scripts/emucluster.sh down [--name NAME | --all]
#   scripts/emucluster.sh status
# TOPOLOGY: --profile NAME|FILE [--scale auto|F]   (profiles/NAME.json; `shm`: no emulation, plain mpirun)
#         | --inter-gbit X [--intra-gbit Y] [--scale F]   (raw rates in Gbit/s per direction)
#
# Topology. Every rank is a host: its own network namespace with one interface (eth0) to its node's
# switch (a bridge), shaped to the intra-node rate in both directions. Each node's switch reaches a
# core switch through one uplink shaped to the inter-node rate in both directions, so a node's ranks
# share its uplink (a NIC), as on a real cluster. Switches live in a fabric namespace; nothing is
# added to the caller's namespace. A separate unshaped management network joins every host (second
# interface mg0) to the fabric namespace, where mpirun runs: launch and output forwarding never
# cross the shaped links. Each host runs its own Open MPI daemon (hostname r<node>x<local>); as
# Open MPI's PMIx server talks to its ranks over loopback, a rank must share its daemon's
# namespace, so to Open MPI every rank is a node of its own: the wrapper exports DIFFCP_NODE and
# Communicator::split_node_local groups ranks by it (TAPA's groups, `bench p2p`'s same_node). All
# MPI traffic goes over TCP on the shaped links (--mca btl tcp,self, pml ob1: no shared-memory
# transport). Ranks are pinned one per core when N*R <= cores; otherwise
# they float and timings are oversubscribed (a warning says so).
#
# Rates. A profile (profiles/*.json, fields in docs/emucluster.md) gives a real cluster's link
# rates and its accelerators' attainable FLOP/s. --scale auto measures this machine's per-rank
# attention-kernel rate (bench_attention on one core) and multiplies every bandwidth by
# local FLOP/s / profile FLOP/s, so communication/computation matches the real cluster; --scale F
# uses F; the factor and the resulting tc settings are printed. Latency is NOT emulated: this
# kernel has no netem (nor fq/etf, which could delay by timestamp), so links keep their native
# latency (tens of microseconds through veth + TCP; `diffcp bench p2p` measures it). Scaled
# latencies would be milliseconds, so the emulation favours methods that send many small messages.
#
# Every exit path (success, failure, Ctrl-C) of `run` removes what it made unless --keep; `down`
# removes a named cluster or, with --all, every namespace this script ever made (prefix dcpemu-).
# Environment: DIFFCP_BUILD (default build/release) for bench_attention; DIFFCP_EMU_RANK_GFLOPS
# skips the --scale auto measurement and uses that per-rank rate (GFLOP/s).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
state_root=/run/diffcp-emucluster
ns_prefix=dcpemu-
data_net=10.77   # rank hosts: 10.77.<node>.<local+1>/16 (inside our namespaces only)
mgmt_net=10.78   # node daemons: 10.78.<node>.1/16, mpirun: 10.78.255.254

say() { echo "emucluster: $*" >&2; }
die() { echo "emucluster: error: $*" >&2; exit 2; }
usage() { sed -n '2,13p' "$0" >&2; exit 2; }

# ---------------------------------------------------------------------------------------------
# Options
verb=${1:-}; [ -n "$verb" ] || usage; shift
nodes=""; rpn=""; profile=""; inter=""; intra=""; scale=""; keep=0; dry=0; name=""; all=0
prog=()
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) nodes=${2:?--nodes needs a value}; shift 2 ;;
    --ranks-per-node) rpn=${2:?--ranks-per-node needs a value}; shift 2 ;;
    --profile) profile=${2:?--profile needs a value}; shift 2 ;;
    --inter-gbit) inter=${2:?--inter-gbit needs a value}; shift 2 ;;
    --intra-gbit) intra=${2:?--intra-gbit needs a value}; shift 2 ;;
    --scale) scale=${2:?--scale needs a value}; shift 2 ;;
    --name) name=${2:?--name needs a value}; shift 2 ;;
    --keep) keep=1; shift ;;
    --dry-run) dry=1; shift ;;
    --all) all=1; shift ;;
    --) shift; prog=("$@"); break ;;
    -h|--help) usage ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

need_root() {
  [ "$(id -u)" -eq 0 ] || die "must run as root: network namespaces, veth links and tc need CAP_NET_ADMIN"
  mountpoint -q / || die "/ is not a mount point here (a chroot?): 'ip netns exec' remounts / and cannot work; bind-mount the root onto itself first"
  for t in ip tc unshare taskset jq mpirun; do
    command -v "$t" >/dev/null || die "'$t' not found: run scripts/install_deps.sh (iproute2, util-linux, jq, openmpi-bin)"
  done
}
is_num() { [[ "$1" =~ ^[0-9]+([.][0-9]+)?([eE][-+]?[0-9]+)?$ ]]; }
is_int() { [[ "$1" =~ ^[0-9]+$ ]]; }

# ---------------------------------------------------------------------------------------------
# Profiles: profiles/NAME.json or a file. Unknown fields and bad values are errors.
profile_fields='name description source ranks_per_node rank_tflops intra_gbit inter_gbit intra_latency_us inter_latency_us notes gemm_tflops gemm_n_half attn_bwd_tflops elementwise_gbs kernel_us comm_overlap sync_loss'
load_profile() {  # $1 = NAME|FILE; sets p_* variables
  local f=$1
  [ -f "$f" ] || f="$repo/profiles/$1.json"
  [ -f "$f" ] || die "profile '$1': no file $1 nor $repo/profiles/$1.json (have: $(cd "$repo/profiles" && ls *.json | sed 's/\.json$//' | paste -sd' '), shm)"
  jq -e 'type == "object"' "$f" >/dev/null 2>&1 || die "profile '$f' does not parse as a JSON object"
  local k
  for k in $(jq -r 'keys[]' "$f"); do
    [[ " $profile_fields " == *" $k "* ]] || die "profile '$f': unknown field '$k' (known: $profile_fields)"
  done
  for k in rank_tflops intra_gbit inter_gbit; do
    local v; v=$(jq -r ".$k // empty" "$f")
    { [ -n "$v" ] && is_num "$v" && [ "$(awk -v x="$v" 'BEGIN{print (x > 0)}')" = 1 ]; } ||
      die "profile '$f': field '$k' must be a positive number, got '${v:-missing}'"
    printf -v "p_$k" '%s' "$v"
  done
  p_name=$(jq -r '.name // empty' "$f"); [ -n "$p_name" ] || die "profile '$f': field 'name' is missing"
  p_file=$f
}

# bench_attention on one core, one thread: this machine's per-rank attention forward rate (GFLOP/s).
# Cached in $state_root (a tmpfs: forgotten at reboot) next to the binary's modification time.
measure_rank_gflops() {
  if [ -n "${DIFFCP_EMU_RANK_GFLOPS:-}" ]; then echo "$DIFFCP_EMU_RANK_GFLOPS"; return; fi
  local bin="$repo/${DIFFCP_BUILD:-build/release}/bench/bench_attention"
  [ -x "$bin" ] || die "--scale auto needs $bin (build first: scripts/build.sh)"
  local cache="$state_root/.rank_gflops" stamp out g
  stamp="$(stat -c %Y "$bin") $(uname -n)"
  if [ -f "$cache" ] && [ "$(head -n1 "$cache")" = "$stamp" ]; then tail -n1 "$cache"; return; fi
  out=$(OMP_NUM_THREADS=1 taskset -c 0 "$bin" --json --reps 5 --samples 1 --context 4096 --anchors 64 \
        --n-q 8 --n-kv 2 --d-h 128 --gemm-n 256 2>&1) || die "bench_attention failed: $out"
  g=$(jq -r '.fwd_gflops' <<<"$out")
  { mkdir -p "$state_root" && printf '%s\n%s\n' "$stamp" "$g" >"$cache"; } || true
  echo "$g"
}

# Resolves the topology into: intra_mbit, inter_mbit (0 = unshaped), scale_used, shm.
resolve_rates() {
  shm=0; intra_mbit=0; inter_mbit=0; scale_used=1
  if [ "$profile" = shm ]; then shm=1; return; fi
  local gi=0 ge=0
  if [ -n "$profile" ]; then
    [ -z "$inter$intra" ] || die "--profile and --inter-gbit/--intra-gbit exclude each other"
    load_profile "$profile"
    gi=$p_intra_gbit; ge=$p_inter_gbit
    case "${scale:-auto}" in
      auto) local g; g=$(measure_rank_gflops)
            is_num "$g" || die "could not measure the per-rank kernel rate (got '$g')"
            scale_used=$(awk -v g="$g" -v t="$p_rank_tflops" 'BEGIN{printf "%.6g", g * 1e9 / (t * 1e12)}')
            say "scale auto: this machine's attention forward on one core = $g GFLOP/s;" \
                "profile $p_name = $p_rank_tflops TFLOP/s per rank -> factor $scale_used" ;;
      *) is_num "$scale" || die "--scale '$scale': expected auto or a positive number"; scale_used=$scale ;;
    esac
  else
    [ -n "$inter" ] || die "give --profile NAME|FILE|shm or --inter-gbit X [--intra-gbit Y]"
    is_num "$inter" || die "--inter-gbit '$inter': expected a positive number (Gbit/s)"
    [ -z "$intra" ] || is_num "$intra" || die "--intra-gbit '$intra': expected a positive number (Gbit/s)"
    [ "${scale:-1}" != auto ] || die "--scale auto needs a --profile (it scales the profile's rates)"
    ge=$inter; gi=${intra:-0}; scale_used=${scale:-1}
    is_num "$scale_used" || die "--scale '$scale_used': expected a positive number"
  fi
  inter_mbit=$(awk -v x="$ge" -v s="$scale_used" 'BEGIN{printf "%d", x * s * 1000 + 0.5}')
  intra_mbit=$(awk -v x="$gi" -v s="$scale_used" 'BEGIN{printf "%d", x * s * 1000 + 0.5}')
  [ "$inter_mbit" -ge 1 ] || die "inter-node rate rounds to 0 Mbit/s (scale $scale_used): too slow to emulate"
  [ "$gi" = 0 ] || [ "$intra_mbit" -ge 1 ] || die "intra-node rate rounds to 0 Mbit/s (scale $scale_used)"
}

# ---------------------------------------------------------------------------------------------
# Commands (x runs or, with --dry-run, prints)
x() { if [ "$dry" -eq 1 ]; then echo "$*"; else "$@"; fi; }

# tbf on a device's egress: rate in Mbit/s; burst = 1 ms of traffic, at least 64 KiB (one GSO
# segment must fit, or tbf splits it); up to 50 ms of queue.
shape() {  # ns dev mbit
  [ "$3" -gt 0 ] || return 0
  local burst=$(( $3 * 1000 * 1000 / 8 / 1000 ))
  [ "$burst" -ge 65536 ] || burst=65536
  x ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "${3}mbit" burst "$burst" latency 50ms
}

create() {  # uses nodes, rpn, intra_mbit, inter_mbit, name
  local fab="$name-fab" i l
  mkdir -p "$state_root/$name"
  if [ "$dry" -eq 1 ]; then echo ip netns add "$fab"
  else ip netns add "$fab" 2>/dev/null ||
    die "cannot create a network namespace ('ip netns add $fab' failed): this needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root outside a restricted container)"
  fi
  x ip -n "$fab" link set lo up
  x ip -n "$fab" link add core type bridge
  x ip -n "$fab" link set core up
  x ip -n "$fab" link add mgmt type bridge
  x ip -n "$fab" addr add "$mgmt_net.255.254/16" dev mgmt
  x ip -n "$fab" link set mgmt up
  for ((i = 0; i < nodes; i++)); do
    x ip -n "$fab" link add "b$i" type bridge
    x ip -n "$fab" link set "b$i" up
    x ip -n "$fab" link add "u$i" mtu 9000 type veth peer name "c$i" mtu 9000
    x ip -n "$fab" link set "u$i" master "b$i" up
    x ip -n "$fab" link set "c$i" master core up
    shape "$fab" "u$i" "$inter_mbit"   # node -> core
    shape "$fab" "c$i" "$inter_mbit"   # core -> node
    for ((l = 0; l < rpn; l++)); do
      local host="r${i}x$l" rns="$name-r${i}x$l"
      x ip netns add "$rns"
      x ip -n "$rns" link set lo up
      # data: eth0 <-> a port of the node switch, shaped both ways
      x ip -n "$fab" link add "$host" mtu 9000 type veth peer name eth0 mtu 9000 netns "$rns"
      x ip -n "$fab" link set "$host" master "b$i" up
      x ip -n "$rns" addr add "$data_net.$i.$((l + 1))/16" dev eth0
      x ip -n "$rns" link set eth0 up
      shape "$rns" eth0 "$intra_mbit"      # rank -> switch
      shape "$fab" "$host" "$intra_mbit"   # switch -> rank
      # management (Open MPI's launch and I/O forwarding only): mg0 <-> the unshaped mgmt bridge
      x ip -n "$fab" link add "m$host" type veth peer name mg0 netns "$rns"
      x ip -n "$fab" link set "m$host" master mgmt up
      x ip -n "$rns" addr add "$mgmt_net.$i.$((l + 1))/16" dev mg0
      x ip -n "$rns" link set mg0 up
    done
  done
  local st="$state_root/$name"
  # The rsh agent mpirun uses to start a daemon "on" host r<i>x<l>: inside that host's namespace
  # with hostname r<i>x<l>. The arguments after the host form one shell command line, as with ssh.
  cat >"$st/rsh" <<EOF
#!/bin/sh
host=\$1; shift
exec ip netns exec "$name-\$host" unshare --uts /bin/sh -c 'hostname "\$0" && exec /bin/sh -c "\$*"' "\$host" "\$@"
EOF
  # Every rank: DIFFCP_NODE = its emulated node (Communicator::split_node_local groups by it, since
  # to Open MPI every host is a node of its own) and, when ranks <= cores, its own core.
  local cores; cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
  pin=0; [ $((nodes * rpn)) -le "$cores" ] && pin=1
  cat >"$st/exec" <<EOF
#!/bin/sh
node=\$(hostname); node=\${node#r}; export DIFFCP_NODE=\${node%x*}
if [ $pin -eq 1 ]; then exec taskset -c "\$((\${OMPI_COMM_WORLD_RANK:?not started by mpirun} % $cores))" "\$@"; fi
export OMP_NUM_THREADS=\${OMP_NUM_THREADS:-1}   # ranks float over the cores: one thread each
exec "\$@"
EOF
  chmod +x "$st/rsh" "$st/exec"
  : >"$st/hostfile"
  for ((i = 0; i < nodes; i++)); do
    for ((l = 0; l < rpn; l++)); do echo "r${i}x$l slots=1" >>"$st/hostfile"; done
  done
  cat >"$st/env" <<EOF
nodes=$nodes
rpn=$rpn
intra_mbit=$intra_mbit
inter_mbit=$inter_mbit
scale_used=$scale_used
profile=${profile:-raw}
pin=$pin
EOF
}

teardown() {  # $1 = cluster name: kill what runs in its namespaces, delete them, forget it
  local n=$1 ns pids
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$n-" || true); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
  done
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$n-" || true); do
    ip netns del "$ns" 2>/dev/null || say "could not delete namespace $ns"
  done
  rm -rf "${state_root:?}/$n"
}

describe() {
  local cores; cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
  say "cluster $name: $nodes node(s) x $rpn rank(s); profile ${profile:-raw}, scale $scale_used;" \
      "intra-node link per rank $( [ "$intra_mbit" -gt 0 ] && echo "${intra_mbit} Mbit/s" || echo unshaped )," \
      "node uplink $inter_mbit Mbit/s (tbf each direction); latency native (not emulated)"
  if [ $((nodes * rpn)) -gt "$cores" ]; then
    say "warning: $((nodes * rpn)) ranks on $cores cores: ranks float and timings are OVERSUBSCRIBED (compare bytes, not times)"
  else
    say "ranks pinned one per core (rank r on core r)"
  fi
}

mpirun_cmd() {  # the mpirun command line for the cluster in $name, program in "$@"
  local st="$state_root/$name"
  echo ip netns exec "$name-fab" mpirun -np $((nodes * rpn)) --hostfile "$st/hostfile" --map-by slot --bind-to none \
    --mca plm_rsh_agent "$st/rsh" --mca plm_rsh_no_tree_spawn 1 --mca pml ob1 --mca btl tcp,self \
    --mca btl_tcp_if_include "$data_net.0.0/16" --mca oob_tcp_if_include "$mgmt_net.0.0/16" \
    --mca orte_keep_fqdn_hostnames 1 $( [ "$pin" -eq 1 ] || echo --mca mpi_yield_when_idle 1 ) "$st/exec"
}

# Runs mpirun in the background and waits for it, so that a signal to this script alone (not to
# its process group, e.g. `kill` or a test runner's timeout) runs the traps at once instead of
# after the program ends; the EXIT trap then kills everything left in the cluster's namespaces.
# Exits with the program's status.
run_program() {
  "$@" &
  local child=$! rc=0
  trap 'kill -TERM '"$child"' 2>/dev/null; exit 130' INT
  trap 'kill -TERM '"$child"' 2>/dev/null; exit 143' TERM
  wait "$child" || rc=$?
  exit "$rc"
}

check_topology() {
  is_int "$nodes" && [ "$nodes" -ge 1 ] && [ "$nodes" -le 250 ] || die "--nodes '$nodes': expected 1..250"
  is_int "$rpn" && [ "$rpn" -ge 1 ] && [ "$rpn" -le 250 ] || die "--ranks-per-node '$rpn': expected 1..250"
  [ $((nodes * rpn)) -le 64 ] || die "$nodes x $rpn = $((nodes * rpn)) ranks: more than 64 emulated hosts on one machine is not supported"
}

# ---------------------------------------------------------------------------------------------
case "$verb" in
  up|run)
    if [ -n "$name" ] && [ "$verb" = run ]; then   # run on a cluster that is up
      [ -f "$state_root/$name/env" ] || die "no cluster named '$name' is up (scripts/emucluster.sh status)"
      [ ${#prog[@]} -gt 0 ] || die "run: give the program after --"
      need_root
      # shellcheck disable=SC1090
      . "$state_root/$name/env"
      describe
      cmd=$(mpirun_cmd)
      [ "$dry" -eq 0 ] || { echo "$cmd ${prog[*]}"; exit 0; }
      run_program $cmd "${prog[@]}"
    fi
    [ -n "$nodes" ] && [ -n "$rpn" ] || die "$verb needs --nodes N --ranks-per-node R"
    check_topology
    [ "$verb" = up ] || [ ${#prog[@]} -gt 0 ] || die "run: give the program after --"
    [ "$dry" -eq 1 ] || need_root
    resolve_rates
    if [ "$shm" -eq 1 ]; then   # no emulation: today's behaviour (shared memory, one node)
      cmd=(mpirun -np $((nodes * rpn)))
      say "profile shm: no emulation, plain mpirun on this machine (one node, shared memory)"
      [ "$verb" = run ] || die "up: profile shm has nothing to bring up"
      if [ "$dry" -eq 1 ]; then echo "${cmd[*]} ${prog[*]}"; exit 0; fi
      exec "${cmd[@]}" "${prog[@]}"
    fi
    name="${ns_prefix}$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')"
    if [ "$dry" -eq 1 ]; then
      state_root=$(mktemp -d); trap 'rm -rf "$state_root"' EXIT
      describe; create
      echo "$(mpirun_cmd) ${prog[*]}"
      exit 0
    fi
    if [ "$verb" = run ] && [ "$keep" -eq 0 ]; then
      trap 'teardown "$name"' EXIT
      trap 'exit 130' INT
      trap 'exit 143' TERM
    else
      trap 'rc=$?; [ $rc -eq 0 ] || teardown "$name"' EXIT   # a failed `up` leaves nothing
    fi
    describe
    create
    if [ "$verb" = up ]; then echo "$name"; exit 0; fi
    [ "$keep" -eq 0 ] || say "--keep: cluster stays up; remove it with: scripts/emucluster.sh down --name $name"
    run_program $(mpirun_cmd) "${prog[@]}"
    ;;
  down)
    need_root
    if [ "$all" -eq 1 ]; then
      for n in $( { ls "$state_root" 2>/dev/null; ip netns list 2>/dev/null | awk '{print $1}' |
                    grep -E "^$ns_prefix" | sed -E 's/-(fab|n[0-9]+|r[0-9]+x[0-9]+)$//'; } | sort -u); do
        say "removing $n"; teardown "$n"
      done
    else
      [ -n "$name" ] || die "down needs --name NAME or --all"
      teardown "$name"
    fi
    ;;
  status)
    found=0
    for d in "$state_root"/*/; do
      [ -f "$d/env" ] || continue
      found=1; n=$(basename "$d")
      echo "$n: $(tr '\n' ' ' <"$d/env")"
    done
    left=$(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$ns_prefix" || true)
    [ -z "$left" ] || { found=1; echo "namespaces: $(echo "$left" | paste -sd' ')"; }
    [ "$found" -eq 1 ] || echo "no emulated cluster is up"
    ;;
  *) die "unknown command '$verb' (run, up, down, status)" ;;
esac
