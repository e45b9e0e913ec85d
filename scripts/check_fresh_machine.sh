#!/usr/bin/env bash
# Clean-room check: do the README's two commands work on a machine that has only Debian 12's
# minimal base? Builds (once, then cached) a `debootstrap --variant=minbase` bookworm root from
# this machine's own Debian mirror, copies the committed tree into it (`git archive HEAD`), mounts
# /proc, /sys, /dev (+ /dev/pts, /dev/shm for MPI) and runs the two commands exactly as the README
# writes them, inside `chroot`. Prints one verdict line; exits non-zero with the first error line
# when either command fails, or with the reason when the root cannot be made. Needs root.
#
#   scripts/check_fresh_machine.sh [--rebuild-base] [--keep]
#     --rebuild-base  debootstrap a new base even if a cached one exists
#     --keep          leave the root on disk (its path is printed) for inspection; mounts are
#                     always removed
# Environment: DIFFCP_CLEANROOM_CACHE (default /var/cache/diffcp-cleanroom) holds the cached base
# (the minbase root only, never the project's dependencies); DIFFCP_CLEANROOM_DIR (default
# /var/tmp) is where the per-run root is made.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

say()  { echo "check_fresh_machine: $*" >&2; }
fail() { echo "check_fresh_machine: FAIL: $*"; exit 1; }

rebuild=0; keep=0
for a in "$@"; do
  case "$a" in
    --rebuild-base) rebuild=1 ;;
    --keep) keep=1 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) fail "unknown option '$a' (see --help)" ;;
  esac
done

[ "$(id -u)" -eq 0 ] || fail "must run as root (debootstrap, mount and chroot need it)"
git -C "$repo" rev-parse --verify -q HEAD >/dev/null || fail "$repo is not a git checkout with a HEAD"

suite=bookworm   # Debian 12
# The mirror: the first Debian archive URI in this machine's own apt sources (deb822 or one-line).
mirror=$( { cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ {print $2}';
            cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
              awk '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) {print $i; break}}'; } |
          grep -v -- '-security' | grep -E '/debian/?$' | head -n1 || true)
[ -n "$mirror" ] || fail "no Debian mirror found in /etc/apt/sources.list{,.d/} to build the root from"

if ! command -v debootstrap >/dev/null; then
  say "installing debootstrap (Debian package)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap; } >&2 ||
    fail "cannot install debootstrap from the Debian mirror (apt-get failed; no network to the registry?)"
fi

cache=${DIFFCP_CLEANROOM_CACHE:-/var/cache/diffcp-cleanroom}
key=$(printf '%s %s minbase' "$suite" "$mirror" | sha1sum | cut -c1-12)
base="$cache/$suite-minbase-$key.tar"
mkdir -p "$cache"

work=$(mktemp -d "${DIFFCP_CLEANROOM_DIR:-/var/tmp}/diffcp-cleanroom.XXXXXX")
root="$work/root"
mounts=()
cleanup() {
  local rc=$?
  local m
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    m=${mounts[i]}
    umount -R "$m" 2>/dev/null || umount -R -l "$m" 2>/dev/null || say "could not unmount $m"
  done
  # Whatever the commands started inside the root (e.g. a stray orted) must not outlive us.
  if [ -d "$root" ]; then
    for p in /proc/[0-9]*; do
      [ "$(readlink "$p/root" 2>/dev/null)" = "$root" ] && kill -9 "${p#/proc/}" 2>/dev/null || true
    done
  fi
  if grep -q " $work" /proc/self/mounts; then
    say "mounts left under $work; not deleting it"
  elif [ "$keep" -eq 1 ]; then
    say "root kept at $root"
  else
    rm -rf "$work"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# 1. The base root: debootstrap once, then reuse the cached tarball.
if [ "$rebuild" -eq 1 ] || [ ! -s "$base" ]; then
  say "debootstrap --variant=minbase $suite from $mirror (cached afterwards in $base)"
  t0=$SECONDS
  if ! debootstrap --variant=minbase "$suite" "$work/base" "$mirror" >"$work/debootstrap.log" 2>&1; then
    tail -n 5 "$work/debootstrap.log" >&2
    fail "debootstrap of $suite from $mirror failed: $(grep -m1 -E '^(E|W): ' "$work/debootstrap.log" || tail -n1 "$work/debootstrap.log")"
  fi
  tar -C "$work/base" -cf "$base.tmp" . && mv "$base.tmp" "$base"
  rm -rf "$work/base"
  say "base root made in $((SECONDS - t0)) s"
fi
mkdir -p "$root"
tar -C "$root" -xf "$base" || fail "cannot unpack the cached base $base (run with --rebuild-base)"

# 2. This machine's apt sources and apt settings (as on a fresh machine of this kind), DNS, CAs,
#    the tree.
rm -f "$root/etc/apt/sources.list"
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] && cp "$f" "$root$f"
done
for f in /etc/apt/apt.conf.d/*; do
  [ -f "$f" ] && [ ! -e "$root$f" ] && cp "$f" "$root$f"
done
cp -L /etc/resolv.conf "$root/etc/resolv.conf"
# An installed machine has /etc/hosts naming itself (debootstrap's root has none). Without it every
# mpirun start resolves this host's name through DNS and waits seconds for the answer: the suite's
# ~300 mpirun tests ran 2x slower here than on the machine itself (rendezvous_cli_dit 10x).
if [ -f /etc/hosts ]; then cp -L /etc/hosts "$root/etc/hosts"; else printf '127.0.0.1 localhost %s\n' "$(hostname)" >"$root/etc/hosts"; fi
# HTTPS as on this machine: its locally added CAs (a fresh machine of this kind has them; egress
# may go through a TLS proxy whose CA only they carry), its CA bundle until the ca-certificates
# package (installed by command 1) regenerates it from them, and its pip settings. Without these
# `pip install .` (PyPI for scikit-build-core) fails for a reason no fresh machine of this kind has.
if [ -d /usr/local/share/ca-certificates ]; then
  mkdir -p "$root/usr/local/share/ca-certificates"
  cp -a /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/"
fi
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  mkdir -p "$root/etc/ssl/certs" && cp -L /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
fi
[ -f /etc/pip.conf ] && cp -L /etc/pip.conf "$root/etc/pip.conf"
mkdir -p "$root/src/diffcp"
git -C "$repo" archive HEAD | tar -x -C "$root/src/diffcp"
if [ -d "$repo/../shared" ]; then   # CI lays ../shared beside the clone; so do we
  mkdir -p "$root/src/shared" && cp -a "$repo/../shared/." "$root/src/shared/"
fi
commit=$(git -C "$repo" rev-parse --short HEAD)

# 3. Mounts (recorded for the trap, which removes them on every exit path).
mnt() { local dst=$1; shift; mount "$@" "$dst"; mounts+=("$dst"); }
# The root itself is a mount point, as / is on a real machine (`ip netns exec`, used by the
# emulated-cluster tests, remounts / and fails on a plain directory).
mnt "$root" --bind "$root"
mount --make-private "$root"
mnt "$root/proc" -t proc proc
mnt "$root/sys" -t sysfs sysfs
mnt "$root/dev" --bind /dev
mount --make-rslave "$root/dev"
mnt "$root/dev/pts" --bind /dev/pts
mnt "$root/dev/shm" -t tmpfs -o mode=1777,size=4g shm
mkdir -p "$root/run" "$root/tmp" && chmod 1777 "$root/tmp"
mnt "$root/run" -t tmpfs -o mode=0755 run

# 4. The README's two commands, exactly as written there: the sh block under "## The two commands".
mapfile -t cmds < <(awk '/^## The two commands/ {s = 1} s && /^```sh/ {b = 1; next} b && /^```/ {exit}
                         b {sub(/[ \t]*#.*$/, ""); if ($0 != "") print}' "$repo/README.md")
[ ${#cmds[@]} -eq 2 ] || fail "README.md: expected 2 commands in the sh block under '## The two commands', found ${#cmds[@]}"

run_in_root() {  # $1 = command line; log to $2
  chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/bash -c "cd /src/diffcp && $1" </dev/null >"$2" 2>&1
}
first_error() {  # the first error line; for CMake's "CMake Error at X (message):" also the message
  local n
  n=$(grep -n -m1 -E '(^|[^A-Za-z])(error|Error|ERROR)([^A-Za-z]|$)|FAILED|Failed|No such file|not found' "$1" |
      cut -d: -f1)
  if [ -z "$n" ]; then tail -n1 "$1"; return; fi
  if sed -n "${n}p" "$1" | grep -q '(message):$'; then
    sed -n "${n},$((n + 1))p" "$1" | sed 's/^ *//' | paste -sd' '
  else
    sed -n "${n}p" "$1"
  fi
}
logs="$work/logs"; mkdir -p "$logs"
times=()
for i in 0 1; do
  n=$((i + 1)); log="$logs/command$n.log"
  say "command $n: ${cmds[i]}   (log: $log)"
  t0=$SECONDS
  if ! run_in_root "${cmds[i]}" "$log"; then
    keep=1
    tail -n 20 "$log" >&2
    fail "command $n (${cmds[i]}) failed on a fresh Debian 12 minbase root (commit $commit): $(first_error "$log")   [log kept: $log]"
  fi
  times+=("$((SECONDS - t0))")
done
# Command 2's ctest output (CI reads its summary line), then the verdict.
sed -n '/^Test project/,$p' "$logs/command2.log"
summary=$(grep -E 'tests passed|tests failed' "$logs/command2.log" | tail -n1 | sed 's/^ *//')
[ -n "$summary" ] || { keep=1; fail "command 2 printed no ctest summary line   [log kept: $logs/command2.log]"; }
echo "check_fresh_machine: PASS: commit $commit on a fresh Debian 12 ($suite) minbase root:" \
     "command 1 ${times[0]} s, command 2 ${times[1]} s ($summary)"
